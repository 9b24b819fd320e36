"""`fairgate bench`: load test an OpenAI-compatible endpoint and print a TTFT/ITL report."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
from pathlib import Path
from typing import TextIO

from protocol.validators import check_out_file
from tuner.loadgen import ENDPOINTS, BenchError, Progress, RunOptions, Target, run_workload
from tuner.report import Report
from tuner.traces import TRACE_FORMATS, TraceRequest, write_fairgate_trace
from tuner.workload import (
    ARRIVALS,
    TOKENIZERS,
    WORKLOADS,
    Limits,
    LoadShape,
    MixSpec,
    TenantMix,
    TraceReplay,
    Workload,
    build_mix,
    get_workload,
    load_workload_file,
)


def register(parser: argparse.ArgumentParser) -> None:
    parser.description = "Stream a workload to an OpenAI-compatible endpoint; report latencies."
    parser.add_argument("--url", required=True, help="base URL, e.g. http://127.0.0.1:8000")
    parser.add_argument(
        "--api-key", metavar="KEY", default=None, help="default key (tenants may have their own)"
    )
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--workload", metavar="NAME", help=f"a named workload: {', '.join(WORKLOADS)}")
    src.add_argument(
        "--trace",
        metavar="FILE",
        help="replay a trace file (azure CSV, mooncake or fairgate JSONL)",
    )
    src.add_argument(
        "--workload-file", metavar="FILE", help="YAML/JSON tenant mix (see tuner/workload.py)"
    )
    parser.add_argument("--trace-format", choices=TRACE_FORMATS, default="auto",
                        help="the --trace file's format (auto: from its name and first line)")
    load = parser.add_argument_group("load shape")
    load.add_argument("--rate", type=float, metavar="R", help="requests/s (traces: rescales time)")
    load.add_argument(
        "--duration", type=float, metavar="S", help="seconds (default 60, none with a count)"
    )
    load.add_argument("--num-requests", type=int, metavar="N", help="stop after this many requests")
    load.add_argument("--max-concurrency", type=int, metavar="C", help="cap on requests in flight")
    load.add_argument("--arrivals", choices=ARRIVALS, help="default: poisson, or trace on replay")
    load.add_argument(
        "--burstiness", type=float, metavar="B", help="gamma shape: 1 = Poisson, < 1 burstier"
    )
    load.add_argument("--speed", type=float, metavar="K", help="replay a trace k times faster")
    load.add_argument("--start", type=float, metavar="S", help="skip the trace's first S seconds")
    load.add_argument("--seed", type=int, metavar="N", help="lengths and arrivals seed (default 0)")
    lengths = parser.add_argument_group("lengths")
    lengths.add_argument(
        "--scale-tokens", type=float, default=1.0, metavar="F", help="multiply all lengths"
    )
    lengths.add_argument("--max-prompt-tokens", type=int, metavar="N",
                         help="cap each prompt at N tokens (after --scale-tokens)")
    lengths.add_argument("--max-output-tokens", type=int, metavar="N",
                         help="cap each output at N tokens (after --scale-tokens)")
    lengths.add_argument(
        "--tokenizer",
        choices=list(TOKENIZERS),
        default="byte",
        help="how prompt text maps to tokens (byte: fairgate's default model)",
    )
    req = parser.add_argument_group("requests")
    req.add_argument("--endpoint", choices=list(ENDPOINTS), default="completions",
                     help="/v1/completions or /v1/chat/completions")
    req.add_argument("--model", help="the model every request names (default: the workload "
                     "file's model, else the first id of GET /v1/models)")
    req.add_argument("--request-timeout", type=float, default=600.0, metavar="S",
                     help="give up on one request after S seconds (default 600)")
    slo = parser.add_argument_group(
        "SLOs (vLLM's names)",
        "goodput counts the requests within --slo-ttft and --slo-tpot, as "
        "`vllm bench serve --goodput ttft:.. tpot:..` does; --slo-itl is reported apart",
    )
    slo.add_argument("--slo-ttft", type=float, metavar="S", help="each request's TTFT, seconds")
    slo.add_argument("--slo-tpot", type=float, metavar="S", help="each request's TPOT, seconds")
    slo.add_argument(
        "--slo-itl",
        type=float,
        metavar="S",
        help="every gap between tokens, seconds: reports the share of all gaps within S (ITL "
        "attainment); before, this flag bounded TPOT: use --slo-tpot for that",
    )
    out = parser.add_argument_group("output")
    out.add_argument("--json", dest="json_out", metavar="OUT", help="write the report as JSON")
    out.add_argument("--csv", dest="csv_out", metavar="OUT", help="write one CSV row per request")
    out.add_argument(
        "--save-trace", metavar="OUT", help="write the planned requests as a fairgate trace"
    )
    out.add_argument("--progress", action="store_true", help="progress bar even without a TTY")


def run(args: argparse.Namespace) -> int:
    for flag, out in (("--json", args.json_out), ("--csv", args.csv_out)):
        if out:
            check_out_file(flag, out)
    mix = plan_mix(args)
    requests = build_mix(mix, _limits(args))
    if not requests:
        raise ValueError("the workload produced no requests; raise --duration or --rate")
    if args.save_trace:
        write_fairgate_trace(args.save_trace, requests)
    if args.model is None and mix.model is not None:
        print(f"fairgate bench: model {mix.model!r}, named by {args.workload_file}",
              file=sys.stderr)
    target = Target(args.url, args.api_key, args.endpoint, args.model or mix.model)
    options = RunOptions(
        max_concurrency=args.max_concurrency,
        slo_ttft=args.slo_ttft,
        slo_tpot=args.slo_tpot,
        slo_itl=args.slo_itl,
        request_timeout=args.request_timeout,
        tokenizer=args.tokenizer,
    )
    span = requests[-1].arrival
    print(
        f"fairgate bench: {len(requests)} requests over {span:.1f} s to {target.base}",
        file=sys.stderr,
    )
    bar = ProgressBar(sys.stderr) if args.progress or sys.stderr.isatty() else None
    try:
        report = asyncio.run(run_workload(requests, target, options=options, on_progress=bar))
    except BenchError as exc:
        print(f"fairgate bench: error: {exc}", file=sys.stderr)
        return 2
    finally:
        if bar is not None:
            bar.close()
    return finish(report, args)


def finish(report: Report, args: argparse.Namespace) -> int:
    print(report.format())
    if args.json_out:
        report.write_json(args.json_out)
    if args.csv_out:
        report.write_csv(args.csv_out)
    if report.total.completed == 0:
        first = next(iter(report.errors.items()), ("", ""))
        print(f"fairgate bench: every request failed ({first[0]}: {first[1]})", file=sys.stderr)
        return 1
    return 0


def plan_requests(args: argparse.Namespace) -> list[TraceRequest]:
    """The requests the options describe: one workload, one trace, or a tenant mix."""
    return build_mix(plan_mix(args), _limits(args))


def plan_mix(args: argparse.Namespace) -> MixSpec:
    """A workload file's tenant mix (its shape under the command line's), or one named
    workload or trace, each request as its own tenant (a trace's own: a capture keeps its
    tenants; "default" for the rest)."""
    if args.workload_file:
        spec = load_workload_file(args.workload_file)
        return dataclasses.replace(spec, shape=_shape(args, spec.shape))
    workload: Workload = (
        TraceReplay(args.trace, Path(args.trace), args.trace_format)
        if args.trace
        else get_workload(args.workload)
    )
    return MixSpec((TenantMix(None, workload),), _shape(args, LoadShape()))


def _limits(args: argparse.Namespace) -> Limits:
    return Limits(args.scale_tokens, args.max_prompt_tokens, args.max_output_tokens)


def _shape(args: argparse.Namespace, base: LoadShape) -> LoadShape:
    """Command-line values win over the file's; a count alone means no time limit."""
    given = {
        name: getattr(args, name)
        for name in (
            "rate",
            "duration",
            "num_requests",
            "arrivals",
            "burstiness",
            "speed",
            "start",
            "seed",
            "window",
        )
        if getattr(args, name, None) is not None
    }
    if "duration" not in given and ("num_requests" in given or "window" in given):
        given["duration"] = None
    return dataclasses.replace(base, **given)


class ProgressBar:
    """One self-rewriting stderr line; cheap enough to call four times a second."""

    def __init__(self, stream: TextIO, width: int = 30) -> None:
        self.stream = stream
        self.width = width
        self.drawn = False

    def __call__(self, p: Progress) -> None:
        filled = self.width * p.done // max(1, p.total)
        bar = "#" * filled + "-" * (self.width - filled)
        failed = f", {p.failed} failed" if p.failed else ""
        self.stream.write(f"\r[{bar}] {p.done}/{p.total}{failed}  {p.elapsed:6.1f} s")
        self.stream.flush()
        self.drawn = True

    def close(self) -> None:
        if self.drawn:
            self.stream.write("\n")
            self.stream.flush()
