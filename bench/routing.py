"""Prefix-affine routing against least-loaded: the same load through one gateway in front of
four engine replicas, once with `gateway.routing: least_loaded` and once with `prefix`.

The replicas are `fairgate engine` on the simulated executor in real time (h100, llama-3-8b
shapes: a step sleeps its roofline time, and a prefix-cache hit leaves only the uncached tokens
to compute, so hits shorten prefill: see the probe line the run prints first). Each replica's
KV cache is set small (`num_kv_blocks`), so that one replica cannot hold every prefix of the
workload: with an unbounded cache least-loaded routing would in time cache every prefix on every
replica. Before each measurement every replica is reconfigured (POST /admin/reconfigure: a new
scheduler and an empty KV pool) and the load generator's prompts get a fresh salt, so neither
routing mode finds the other's warm cache. Each mode gets its own `fairgate serve` process.

Workloads, each at one offered load for both modes (open loop, Poisson arrivals):

- shared-prefix: tuner's named workload (8 groups x 2048-token prefix + 64-512 unique tokens,
  128 out), 20 req/s: least-loaded keeps up but queues (TTFT p99 over 10x its p50). The
  gateway keys affinity on the first `prefix_chars` (2048) characters: the prefix.
- mooncake: the Mooncake conversation trace in its order, its hash_ids blocks turned into shared
  leading text (tuner.workload), tokens scaled by 1/16 so that a replica serves the trace's
  shape at this machine's rate (blocks of 32 tokens). Its timestamps come in 3-s quanta, so the
  requests keep the trace's order on Poisson arrivals (40 req/s: 12x the trace's rate, so that
  a conversation's next turn comes within the run). `prefix_chars` scales with the tokens
  (2048 / 16 = 128 characters: the first 4 blocks, as 2048 characters are of the unscaled trace).
- no-sharing: the shared-prefix lengths (2112-2560 in, 128 out) with no prefix in common: what
  affinity costs where there is nothing to gain (goal: throughput within 5%). 14 req/s: each
  prompt holds its 2.4k tokens of KV alone, so least-loaded is at its knee (preemptions) there
  and collapses at shared-prefix's 20.

Hit rate = sum of prefix_cache_hits / sum of prefix_cache_queries (tokens) over the four
replicas, their deltas over the measured run (GET /load). A preempted request is looked up
again when it is readmitted and finds its own blocks: that is the hit rate of no-sharing
(`preempt` counts preemptions). `spread` is the busiest replica's share of the prompt tokens
over the mean share (1: even). Each case also prints what one unbounded cache would hit (every
prefix kept from its first use): the most any routing reaches.

    .venv/bin/python bench/routing.py [--duration 40] [--rate 20] [--mooncake-rate 40]
    .venv/bin/python bench/routing.py --quick        (about 90 s; a smoke run, not a verdict)
    .venv/bin/python bench/routing.py --cases shared-prefix --prefix-groups 32 --kv-blocks 1536
        (32 system prompts: what one replica holds is a smaller share of them)
    .venv/bin/python bench/routing.py --load-factors 2 4   (prefix routing under looser bounds too)

Goals (issue 18): on shared-prefix, prefix routing >= 2x the hit rate and >= 30% lower TTFT p99
than least-loaded; on no-sharing, requests/s and output tokens/s within 5%.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository

from bench.common import (  # noqa: E402
    ROOT,
    free_port,
    machine,
    rotated,
    start_engine,
    start_gateway,
    stop,
    verdict,
)
from bench.gateway_overhead import ms  # noqa: E402
from tuner.loadgen import RunOptions, Target, run_workload  # noqa: E402
from tuner.report import Report  # noqa: E402
from tuner.traces import TraceRequest  # noqa: E402
from tuner.workload import Limits, LoadShape, build_requests, parse_workload  # noqa: E402

MODEL = "random:tiny"
REPLICAS = 4
MAX_MODEL_LEN = 4096
ENGINE = {"executor": "sim", "sim_clock": "realtime", "sim_hardware": "h100",
          "sim_model": "llama-3-8b", "max_num_seqs": 32, "max_num_batched_tokens": 2048,
          "max_model_len": MAX_MODEL_LEN, "policy": "fcfs"}
LEAST, PREFIX = "least-loaded", "prefix"
DEFAULT_LOAD_FACTOR = 1.25  # gateway.prefix_load_factor's default: what the goals judge
MOONCAKE_SCALE = 1 / 16
GOAL_HIT_RATIO, GOAL_P99_RATIO, GOAL_THROUGHPUT = 2.0, 0.70, 0.95


@dataclass(frozen=True)
class Ratios:
    """Prefix routing's figures over least-loaded's."""

    hit: float
    p50: float
    p99: float
    requests: float
    tokens: float


Goals = Callable[[str, "Ratios"], list[str]]  # (case name, ratios) -> verdict lines


@dataclass(frozen=True)
class Case:
    """One workload: its requests, the replicas' KV cache for it, the affinity key's length,
    and the goals it is judged on."""

    name: str
    about: str
    requests: list[TraceRequest]
    num_kv_blocks: int
    prefix_chars: int
    goals: Goals


@dataclass(frozen=True)
class Mode:
    """A routing setting: its label and the gateway settings that make it."""

    label: str
    settings: dict[str, Any]


def modes(load_factors: list[float]) -> list[Mode]:
    """Least-loaded, prefix at the default bound, then prefix at each other bound asked for."""
    out = [Mode(LEAST, {"routing": "least_loaded"}),
           Mode(PREFIX, {"routing": "prefix", "prefix_load_factor": DEFAULT_LOAD_FACTOR})]
    return out + [Mode(f"prefix x{f:g}", {"routing": "prefix", "prefix_load_factor": f})
                  for f in load_factors if f != DEFAULT_LOAD_FACTOR]


@dataclass
class Segment:
    """One routing mode's measured run of one case."""

    mode: str
    report: Report
    queries: list[int]  # per replica: prompt tokens looked up in the prefix cache
    hits: list[int]  # per replica: of those, found
    preemptions: int  # all replicas: requests preempted (a recomputed prompt is looked up again)

    @property
    def hit_rate(self) -> float:
        return sum(self.hits) / max(1, sum(self.queries))

    @property
    def spread(self) -> float:
        """The busiest replica's share of the prompt tokens over the mean share (1 = even)."""
        return max(self.queries) * len(self.queries) / max(1, sum(self.queries))

    def ttft(self, key: str) -> float:
        value = self.report.total.ttft[key]
        return float("nan") if value is None else value


# ---- the replicas ---------------------------------------------------------------------------
def http_json(url: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        out: dict[str, Any] = json.load(resp)
    return out


COUNTERS = ("prefix_cache_queries", "prefix_cache_hits", "num_preemptions")


def counters(urls: list[str]) -> list[list[int]]:
    """COUNTERS of each replica, cumulative (they outlive a reconfiguration)."""
    return [[int(load[k]) for k in COUNTERS] for load in (http_json(u + "/load") for u in urls)]


def reset(urls: list[str], num_kv_blocks: int) -> None:
    """A new scheduler and an empty KV pool of `num_kv_blocks` on every (idle) replica."""
    for u in urls:
        http_json(u + "/admin/reconfigure", {"changes": {"num_kv_blocks": num_kv_blocks}})


def code_version() -> str:
    """The commit measured, and the routing files that differ from it (work in progress)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout
    changed = [line[3:] for line in git("status", "--porcelain", "--", "gateway").splitlines()]
    return f"code: {git('rev-parse', '--short', 'HEAD').strip() or 'unknown'}" + (
        f" + uncommitted {', '.join(changed)}" if changed else "")


def probe(url: str) -> str:
    """The same 2,500-token prompt twice on a fresh replica: the miss's and the hit's time."""
    body = {"model": MODEL, "prompt": "probe " * 417, "max_tokens": 1}
    times = []
    for _ in range(2):
        start = time.perf_counter()
        http_json(url + "/v1/completions", body)
        times.append(time.perf_counter() - start)
    return (f"probe (one replica, one 2,503-token prompt, 1 output token): miss {times[0] * 1e3:.0f}"
            f" ms, then hit {times[1] * 1e3:.0f} ms")


# ---- one measurement ------------------------------------------------------------------------
def measure(case: Case, mode: Mode, urls: list[str], workdir: Path, timeout: float) -> Segment:
    reset(urls, case.num_kv_blocks)
    config = {"gateway": {"backends": [{"url": u} for u in urls], **mode.settings,
                          "prefix_chars": case.prefix_chars}}
    gateway, url, keys = start_gateway(config, workdir)
    try:
        before = counters(urls)
        report = asyncio.run(run_workload(case.requests, Target(url, keys["demo"], model=MODEL),
                                          options=RunOptions(request_timeout=timeout)))
        after = counters(urls)
    finally:
        stop(gateway)
    delta = [[a - b for a, b in zip(x, y, strict=True)] for x, y in zip(after, before, strict=True)]
    return Segment(mode.label, report, [d[0] for d in delta], [d[1] for d in delta],
                   sum(d[2] for d in delta))


def row(s: Segment) -> str:
    t = s.report.total
    failed = sum(t.failed.values())
    return (f"{s.mode:<14}{t.completed:>6}{failed:>6}{s.hit_rate:>10.1%}"
            f"{ms(s.ttft('median_ms')):>10}{ms(s.ttft('p99_ms')):>10}"
            f"{t.request_throughput:>9.2f}{t.output_throughput:>10.0f}{s.spread:>8.2f}"
            f"{s.preemptions:>8}")


HEADER = (f"{'mode':<14}{'ok':>6}{'fail':>6}{'hit rate':>10}{'TTFT p50':>10}{'TTFT p99':>10}"
          f"{'req/s':>9}{'out tok/s':>10}{'spread':>8}{'preempt':>8}")


def ratios(least: Segment, prefix: Segment) -> Ratios:
    a, b = least.report.total, prefix.report.total
    return Ratios(prefix.hit_rate / max(least.hit_rate, 1e-9),
                  prefix.ttft("median_ms") / least.ttft("median_ms"),
                  prefix.ttft("p99_ms") / least.ttft("p99_ms"),
                  b.request_throughput / a.request_throughput,
                  b.output_throughput / a.output_throughput)


def ceiling(requests: list[TraceRequest], block_size: int = 16) -> float:
    """The hit rate of one unbounded cache that keeps every prefix from its first use (tokens,
    whole KV blocks): the most any routing can reach. A prefix block is its chain of ids."""
    seen: set[int] = set()
    hits = total = 0
    for r in requests:
        chains = list(accumulate(r.prefix_hashes, lambda c, b: hash((c, b)), initial=0))[1:]
        matched = next((k for k, c in enumerate(chains) if c not in seen), len(chains))
        hits += min(matched * r.block_tokens, r.prompt_tokens - 1) // block_size * block_size
        total += r.prompt_tokens
        seen.update(chains)
    return hits / max(1, total)


def sharing_goals(name: str, r: Ratios) -> list[str]:
    return [f"{name}: hit rate {r.hit:.2f}x (goal >= {GOAL_HIT_RATIO:g}x): "
            f"{verdict(r.hit >= GOAL_HIT_RATIO)}",
            f"{name}: TTFT p99 {r.p99:.2f} of least-loaded's (goal <= {GOAL_P99_RATIO:.2f}, 30% "
            f"lower): {verdict(r.p99 <= GOAL_P99_RATIO)}"]


def throughput_goals(name: str, r: Ratios) -> list[str]:
    low = min(r.requests, r.tokens)
    return [f"{name}: throughput req/s {r.requests:.3f}, out tok/s {r.tokens:.3f} (goal >= "
            f"{GOAL_THROUGHPUT}): {verdict(low >= GOAL_THROUGHPUT)}"]


def no_goals(name: str, r: Ratios) -> list[str]:
    return []


def report_case(case: Case, segments: dict[str, Segment]) -> list[str]:
    """Print the case's table and ratios; the goal lines (for the summary)."""
    print(f"\n== {case.name}: {case.about} ==")
    print(f"{len(case.requests)} requests; {case.num_kv_blocks} KV blocks "
          f"({case.num_kv_blocks * 16:,} tokens) per replica; prefix_chars {case.prefix_chars}; "
          f"one unbounded cache would hit {ceiling(case.requests):.1%}")
    print(HEADER)
    for s in segments.values():
        print(row(s))
    for s in segments.values():
        for status, message in s.report.errors.items():
            print(f"  {s.mode}: {s.report.total.failed[status]} x {status}: {message[:200]}")
    for label, s in segments.items():
        if label != LEAST:
            r = ratios(segments[LEAST], s)
            print(f"{label} / {LEAST}: hit rate {r.hit:.2f}x, TTFT p50 {r.p50:.2f}, TTFT p99 "
                  f"{r.p99:.2f}, req/s {r.requests:.3f}, out tok/s {r.tokens:.3f}")
    lines = case.goals(case.name, ratios(segments[LEAST], segments[PREFIX]))
    for line in lines:
        print(line)
    return lines


# ---- the workloads --------------------------------------------------------------------------
def shared_prefix(args: argparse.Namespace) -> Case:
    workload = parse_workload({"base": "shared-prefix", "prefix_groups": args.prefix_groups})
    shape = LoadShape(rate=args.rate, duration=args.duration, seed=args.seed)
    return Case("shared-prefix",
                f"{args.prefix_groups} groups x 2048-token prefix + 64-512 tokens, 128 out, "
                f"{args.rate:g} req/s for {args.duration:g} s",
                build_requests(workload, shape), args.kv_blocks, 2048, sharing_goals)


def mooncake(args: argparse.Namespace) -> Case:
    workload = parse_workload("mooncake")
    shape = LoadShape(rate=args.mooncake_rate, duration=args.duration, arrivals="poisson",
                      seed=args.seed)
    limits = Limits(scale_tokens=MOONCAKE_SCALE, max_prompt_tokens=MAX_MODEL_LEN - 128,
                    max_output_tokens=128)
    requests = build_requests(workload, shape, limits)
    return Case("mooncake",
                f"the trace's first {len(requests)} requests, tokens x 1/16 (blocks of 32 tokens),"
                f" {args.mooncake_rate:g} req/s for {args.duration:g} s",
                requests, args.mooncake_kv_blocks, args.mooncake_prefix_chars, no_goals)


def no_sharing(args: argparse.Namespace) -> Case:
    workload = parse_workload({"base": "shared-prefix", "prefix_groups": 0,
                               "prompt_tokens": [2048 + 64, 2048 + 512]})
    shape = LoadShape(rate=args.no_sharing_rate, duration=args.duration, seed=args.seed)
    return Case("no-sharing",
                f"2112-2560 tokens, nothing shared, 128 out, {args.no_sharing_rate:g} req/s for "
                f"{args.duration:g} s", build_requests(workload, shape), args.kv_blocks, 2048,
                throughput_goals)


CASES: dict[str, Callable[[argparse.Namespace], Case]] = {
    "shared-prefix": shared_prefix, "mooncake": mooncake, "no-sharing": no_sharing}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--duration", type=float, default=40.0, help="seconds of load per run")
    parser.add_argument("--rate", type=float, default=20.0, help="requests/s of shared-prefix")
    parser.add_argument("--mooncake-rate", type=float, default=40.0)
    parser.add_argument("--no-sharing-rate", type=float, default=14.0,
                        help="requests/s of no-sharing (its prompts hold ~2.4k tokens of KV "
                        "each, shared with nobody: the replicas' KV caps it below shared-prefix)")
    parser.add_argument("--kv-blocks", type=int, default=1024,
                        help="KV blocks (16 tokens) per replica, shared-prefix and no-sharing")
    parser.add_argument("--mooncake-kv-blocks", type=int, default=6144)
    parser.add_argument("--mooncake-prefix-chars", type=int, default=round(2048 * MOONCAKE_SCALE),
                        help="the affinity key's length on mooncake (default: the gateway's "
                        "2048 scaled with the tokens)")
    parser.add_argument("--prefix-groups", type=int, default=8)
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    parser.add_argument("--load-factors", type=float, nargs="*", default=[],
                        help="also run prefix routing with these prefix_load_factor values "
                        f"(the goals judge the default, {DEFAULT_LOAD_FACTOR})")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true",
                        help="10 s per run: a smoke run, not a verdict")
    args = parser.parse_args()
    if args.quick:
        args.duration = 10.0
    return args


def main() -> int:
    args = parse_args()
    ports = [free_port() for _ in range(REPLICAS)]
    engines = [start_engine(p, {**ENGINE, "num_kv_blocks": args.kv_blocks}) for p in ports]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    goals: list[str] = []
    try:
        print(f"{REPLICAS} replicas: {ENGINE}; {machine()}")
        print(code_version())
        print(probe(urls[0]))
        with tempfile.TemporaryDirectory() as tmp:
            for i, name in enumerate(args.cases):
                case = CASES[name](args)
                # each case starts with another mode: drift does not always land on one
                by_label = {m.label: m for m in modes(args.load_factors)}
                measured = {label: measure(case, by_label[label], urls, Path(tmp),
                                           60 + args.duration)
                            for label in rotated(list(by_label), i)}
                segments = {label: measured[label] for label in by_label}
                goals += report_case(case, segments)
    finally:
        for engine in engines:
            stop(engine)
    print(f"\nat the end: {machine()}")
    print("\n".join(["goals:", *goals]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
