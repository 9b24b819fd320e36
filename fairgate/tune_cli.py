"""`fairgate tune`: search engine knobs with Optuna against p99 TTFT and ITL SLOs.

    fairgate tune --mode sim | replay --url URL | launch --command '...{port}...{knob}...'
                  [--api-key KEY] [--launch-timeout S] [-c fairgate.yaml] [--set KNOB=VALUE]
                  (--workload NAME | --trace FILE | --workload-file F) [--rate R] [--duration S]
                  [--slo-ttft-p99 S] [--slo-itl-p99 S] [--objective goodput|capacity]
                  [--space space.yaml]
                  [--trials N | --timeout S] [--study NAME] [--storage URL] [--out DIR] [--seed N]

An SLO not given is the strictest one an enabled tenant in the database sets (said on stderr).
Every input is checked before the study opens or --out is touched; a mistake is one line and
exit status 2 (for replay that includes an unreachable --url). Exit status 1: the study ran but
no trial met both SLOs (no best.yaml). In launch mode a server that exits or never becomes
healthy makes that trial infeasible and the study goes on; when it is the base config's trial,
a line says so at the end.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from fairgate.config import database_url, load_config_file
from fairgate.engine_cli import build_config
from protocol.measures import SLO
from protocol.validators import check_number, check_positive_int
from tuner.bench_cli import plan_requests
from tuner.space import default_space, load_space_file
from tuner.study import (
    MODES,
    OBJECTIVES,
    RUNNERS,
    RunnerOptions,
    TuneSpec,
    check_mode,
    check_objective,
    run_study,
    value_text,
)
from tuner.traces import TRACE_FORMATS
from tuner.workload import WORKLOADS

DEFAULT_TRIALS = 30
# the workload options of `fairgate bench` that tune does not offer, at bench's defaults
_BENCH_DEFAULTS = {"scale_tokens": 1.0, "max_prompt_tokens": None, "max_output_tokens": None,
                   "num_requests": None, "arrivals": None, "burstiness": None, "speed": None,
                   "start": None}


def register(parser: argparse.ArgumentParser) -> None:
    parser.description = "Search engine knobs with Optuna against p99 TTFT and ITL SLOs."
    # a string, not choices=: an unbuilt mode gets its own one-line answer in run()
    parser.add_argument("--mode", default="sim", help=f"{' | '.join(MODES)} (built: "
                        f"{', '.join(RUNNERS)}); sim: in process on a virtual clock; replay: "
                        "reconfigure a running `fairgate engine` per trial; launch: start a "
                        "server per trial from --command. replay and launch run in real time")
    parser.add_argument("--url", help="replay: the running `fairgate engine` (http://host:port)")
    # dest: `command` is the top-level parser's subcommand
    parser.add_argument("--command", dest="launch_command", metavar="TEMPLATE",
                        help="launch: the server command, split like a shell line (no shell); "
                             "{port} is a free port, {max_num_seqs} etc. the trial's knobs")
    parser.add_argument("--api-key", metavar="KEY", help="replay/launch: bearer key for the server")
    parser.add_argument("--launch-timeout", type=float, default=RunnerOptions.launch_timeout_s,
                        metavar="S", help="launch: seconds a server has to answer /health "
                        f"(default {RunnerOptions.launch_timeout_s:g})")
    parser.add_argument("-c", "--config", metavar="FILE",
                        help="fairgate.yaml: its `engine` section is the base config, its "
                             "`database` the default study storage")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KNOB=VALUE", help="override one base engine knob (YAML value)")
    src = parser.add_mutually_exclusive_group()
    src.add_argument("--workload", metavar="NAME", help=f"a named workload: {', '.join(WORKLOADS)}")
    src.add_argument("--trace", metavar="FILE", help="a trace file (azure CSV, mooncake or "
                                                     "fairgate JSONL)")
    src.add_argument("--workload-file", metavar="FILE", help="YAML/JSON tenant mix")
    parser.add_argument("--trace-format", choices=TRACE_FORMATS, default="auto")
    parser.add_argument("--rate", type=float, metavar="R", help="requests/s (traces: rescales time)")
    parser.add_argument("--duration", type=float, metavar="S", help="seconds of workload (default 60)")
    parser.add_argument("--slo-ttft-p99", type=float, metavar="S",
                        help="p99 TTFT target, seconds (default: the strictest an enabled "
                        "tenant of the database sets)")
    parser.add_argument("--slo-itl-p99", type=float, metavar="S",
                        help="p99 inter-token target (each request's TPOT), seconds (default: "
                        "the strictest tenant's)")
    parser.add_argument("--objective", default="goodput", help=f"{' | '.join(OBJECTIVES)} "
                        "(built: goodput, capacity; capacity in replay/launch mode is slow: "
                        "each of its probes is a real-time replay of the workload)")
    parser.add_argument("--space", metavar="FILE", help="YAML search space (default: the token "
                        "budget, max_num_seqs, max_model_len, memory_fraction)")
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument("--trials", type=int, metavar="N",
                        help=f"trials to run now (default {DEFAULT_TRIALS})")
    budget.add_argument("--timeout", type=float, metavar="S", help="run trials for S seconds")
    parser.add_argument("--study", metavar="NAME", help="study name; an existing one resumes "
                                                        "(default: a new tune-<time> study)")
    parser.add_argument("--storage", metavar="URL", help="Optuna storage (default: the config's "
                                                         "database URL)")
    parser.add_argument("--out", metavar="DIR", help="best.yaml, trials.csv, report.md "
                                                     "(default tune-<study>)")
    parser.add_argument("--seed", type=int, default=0, metavar="N",
                        help="sampler and workload seed (default 0)")
    parser.set_defaults(**_BENCH_DEFAULTS)


def build_spec(args: argparse.Namespace) -> TuneSpec:
    """Every option checked, in the order a user reads them; ValueError for the first mistake."""
    mode = check_mode(args.mode)
    objective = check_objective(args.objective)
    defaults = tenant_slos(database_url(load_config_file(args.config))) if (
        args.slo_ttft_p99 is None or args.slo_itl_p99 is None) else {}
    slo = SLO(ttft_s=_slo("--slo-ttft-p99", args.slo_ttft_p99, defaults.get("ttft")),
              itl_s=_slo("--slo-itl-p99", args.slo_itl_p99, defaults.get("itl")))
    runner = runner_options(mode, args)
    base = build_config(args.config, args.overrides)
    space = load_space_file(args.space) if args.space else default_space(
        base, RUNNERS[mode](runner).prepare(base))
    if not (args.workload or args.trace or args.workload_file):
        raise ValueError("give the workload: --workload NAME, --trace FILE or --workload-file F")
    requests = plan_requests(args)
    trials = None if args.timeout is not None else check_positive_int(
        "--trials", DEFAULT_TRIALS if args.trials is None else args.trials)
    study = args.study or time.strftime("tune-%Y%m%d-%H%M%S")
    storage = args.storage or database_url(load_config_file(args.config))
    return TuneSpec(mode=mode, base=base, space=space, requests=tuple(requests), slo=slo,
                    storage=storage, study_name=study, out_dir=Path(args.out or study),
                    objective=objective, trials=trials, timeout_s=args.timeout,
                    seed=args.seed, workload=args.workload or args.trace or args.workload_file,
                    runner=runner)


def runner_options(mode: str, args: argparse.Namespace) -> RunnerOptions:
    """The mode's own options, checked up front (a replay --url must answer)."""
    from tuner.loadgen import Target
    from tuner.remote import check_reachable, check_template

    for flag, value, wanted in (("--url", args.url, "replay"),
                                ("--command", args.launch_command, "launch")):
        if value is not None and mode != wanted:
            raise ValueError(f"{flag} is for --mode {wanted}, not --mode {mode}")
    if mode == "replay":
        if args.url is None:
            raise ValueError("--mode replay needs --url URL of a running fairgate engine")
        Target(args.url)  # the URL's form
        check_reachable(args.url, args.api_key)
    if mode == "launch":
        if args.launch_command is None:
            raise ValueError("--mode launch needs --command '... --port {port} ...'")
        check_template(args.launch_command)
    timeout = check_number("--launch-timeout", args.launch_timeout, low=0, open_low=True)
    return RunnerOptions(url=args.url, command=args.launch_command, api_key=args.api_key,
                         launch_timeout_s=timeout)


def _slo(flag: str, value: float | None, from_tenants: tuple[float, str] | None) -> float:
    if value is None:
        if from_tenants is None:
            raise ValueError(f"{flag} S is required (seconds): no tenant in the database sets "
                             "that SLO")
        value, tenant = from_tenants
        print(f"fairgate tune: {flag} {value:g} s, the strictest tenant SLO ({tenant})",
              file=sys.stderr)
    return check_number(flag, value, low=0, open_low=True)


def tenant_slos(url: str) -> dict[str, tuple[float, str]]:
    """{"ttft"|"itl": (the strictest p99 target any enabled tenant sets, its tenant)}; empty
    when the database does not exist yet or holds no tenants (it is never created here)."""
    import asyncio

    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import SQLAlchemyError

    from tenants import TenantStore

    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite" and not Path(parsed.database or "").is_file():
        return {}

    async def read() -> list[Any]:
        store = TenantStore(url)
        try:
            return await store.list_tenants()
        finally:
            await store.close()

    try:
        tenants = asyncio.run(read())
    except (SQLAlchemyError, OSError):  # no schema yet, or a server that does not answer
        return {}
    found: dict[str, tuple[float, str]] = {}
    for tenant in tenants:
        for measure, target in (("ttft", tenant.slo_ttft_p99_s), ("itl", tenant.slo_itl_p99_s)):
            if tenant.enabled and target is not None and (
                    measure not in found or target < found[measure][0]):
                found[measure] = (target, tenant.name)
    return found


def run(args: argparse.Namespace) -> int:
    import optuna

    spec = build_spec(args)
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # our own line per trial instead
    outcome = run_study(spec, progress=lambda line: print(line, file=sys.stderr, flush=True))
    written = ", ".join(str(p) for p in outcome.files)
    default = outcome.default
    if spec.mode == "launch" and default is not None and not default.ran:
        print(f"fairgate tune: the base config's trial #{default.number} got no server to "
              f"measure ({default.infeasible})", file=sys.stderr)
    if outcome.best is None:
        print(f"fairgate tune: no trial met both SLOs (p99 TTFT <= {spec.slo.ttft_s:g} s, "
              f"p99 ITL <= {spec.slo.itl_s:g} s) in {len(outcome.rows)} trials; wrote "
              f"{written}", file=sys.stderr)
        return 1
    best = outcome.best
    print(f"fairgate tune: best trial #{best.number}: {value_text(best)} with "
          f"{best.params}; wrote {written}", file=sys.stderr)
    return 0
