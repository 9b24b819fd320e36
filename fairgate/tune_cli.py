"""`fairgate tune`: search engine knobs with Optuna against p99 TTFT, TPOT and ITL SLOs.

    fairgate tune --mode sim | replay --url URL | launch --command '...{port}...{knob}...'
                  | shadow --gateway URL --admin-key K --shadow NAME [--shadow-requests N]
                    [--shadow-window S] [--recheck N]
                  [--api-key KEY] [--launch-timeout S] [-c fairgate.yaml] [--set KNOB=VALUE]
                  [--sim-profile FILE]
                  (--workload NAME | --trace FILE | --workload-file F) [--rate R] [--duration S]
                  [--start S] [--window S]
                  [--slo-ttft-p99 S] [--slo-tpot-p99 S] [--slo-itl-p99 S]
                  [--objective goodput|capacity|pareto]
                  [--space space.yaml] [--baseline vllm-grid] [--holdout K] [--holdout-top N]
                  [--trials N | --timeout S] [--workers N] [--study NAME] [--storage URL]
                  [--out DIR] [--seed N]

--trials is the study's size: a resumed study (the same --study) runs only the trials it still
lacks, so a study whose worker was killed is finished by running the same command again (the
killed trial is re-run with the same knobs once its heartbeat is stale).

The SLOs are vLLM's: TTFT and TPOT per request, ITL every gap between tokens pooled over the
trial; any combination is a constraint. An SLO not given is the strictest one an enabled tenant
in the database sets (said on stderr); at least one must be set.

The search trains on one window of the workload and chooses on --holdout K others it never
optimised on (tuner/holdout.py): a searched config replaces the best baseline (the default, or
vLLM's grid) only when its held-out lower bound beats that baseline. Each window holds enough
requests for its p99 to rest on ten beyond it (1,000 at p99) unless --window or --duration
says otherwise.
Every input is checked before the study opens or --out is touched; a mistake is one line and
exit status 2 (for replay that includes an unreachable --url). Exit status 1: the study ran but
no trial met both SLOs (no best.yaml). In launch mode a server that exits or never becomes
healthy makes that trial infeasible and the study goes on; when it is the base config's trial,
a line says so at the end.

After a shadow study the recommendation and the next best feasible configs (--recheck N, default
3; 0: off) are re-checked on the traffic the gateway captured during the study (it needs
`gateway.capture`): replayed on the shadow engine with the mirroring to it paused, and in sim
(tuner/recheck.py); the report and recheck.csv show live-shadow, replay and sim figures side
by side. Without a capture the re-check is skipped with a line saying so.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fairgate.config import database_url, load_config_file
from fairgate.engine_cli import build_config
from fairgate.tenants_common import DEFAULT_CONFIG
from gateway.config import ADMIN_KEY_ENV  # a tune job's worker gets the key here, never in argv
from protocol.measures import SLO
from protocol.validators import check_int, check_number, check_positive_int
from tuner.bench_cli import plan_requests
from tuner.measures import min_requests, slo_text
from tuner.outcome import value_text
from tuner.runners import MODES, RUNNERS, RunnerOptions, check_mode
from tuner.space import default_space, load_space_file
from tuner.spec import HEARTBEAT_S, MAX_RECHECK, OBJECTIVES, TuneSpec, Window, check_objective
from tuner.study import run_study
from tuner.traces import TRACE_FORMATS, TraceRequest
from tuner.windows import study_windows
from tuner.workload import WORKLOADS

STORAGE_ENV = "FAIRGATE_TUNE_STORAGE"  # the default --storage (a URL may hold a password)

DEFAULT_TRIALS = 30
DEFAULT_RECHECK = 3
DEFAULT_HOLDOUT = 3
# the workload options of `fairgate bench` that tune does not offer, at bench's defaults
_BENCH_DEFAULTS = {"scale_tokens": 1.0, "max_prompt_tokens": None, "max_output_tokens": None,
                   "num_requests": None, "arrivals": None, "burstiness": None, "speed": None}


def register(parser: argparse.ArgumentParser) -> None:
    parser.description = "Search engine knobs with Optuna against p99 TTFT and ITL SLOs."
    # a string, not choices=: an unbuilt mode gets its own one-line answer in run()
    parser.add_argument("--mode", default="sim", help=f"{' | '.join(MODES)} (built: "
                        f"{', '.join(RUNNERS)}); sim: in process on a virtual clock; replay: "
                        "reconfigure a running `fairgate engine` per trial; launch: start a "
                        "server per trial from --command. replay and launch run in real time")
    parser.add_argument("--url", action="append", default=[],
                        help="replay: the running `fairgate engine` (http://host:port); repeat "
                             "it for several engines, one worker each")
    # dest: `command` is the top-level parser's subcommand
    parser.add_argument("--command", dest="launch_command", metavar="TEMPLATE",
                        help="launch: the server command, split like a shell line (no shell); "
                             "{port} is a free port, {max_num_seqs} etc. the trial's knobs")
    parser.add_argument("--api-key", metavar="KEY", help="replay/launch: bearer key for the server")
    parser.add_argument("--gateway", metavar="URL", help="shadow: the gateway whose shadow "
                        "target the trials run on")
    parser.add_argument("--admin-key", metavar="KEY", default=os.environ.get(ADMIN_KEY_ENV),
                        help=f"shadow: the gateway's admin key (default: ${ADMIN_KEY_ENV})")
    parser.add_argument("--shadow", metavar="NAME", help="shadow: the gateway's shadow target "
                        "(a fairgate engine: reconfigured per trial)")
    parser.add_argument("--shadow-requests", type=int, default=RunnerOptions.shadow_requests,
                        metavar="N", help="shadow: mirrored requests per trial (default "
                        f"{RunnerOptions.shadow_requests})")
    parser.add_argument("--shadow-window", type=float, default=RunnerOptions.shadow_window_s,
                        metavar="S", help="shadow: the longest a trial waits for them (default "
                        f"{RunnerOptions.shadow_window_s:g} s)")
    parser.add_argument("--recheck", type=int, metavar="N", help="shadow: after the study, "
                        "re-check the recommendation and the next best feasible configs, N in "
                        "all, on the traffic the gateway captured during it (replay on the "
                        "shadow engine, mirroring paused, and sim; needs gateway.capture). "
                        f"Default {DEFAULT_RECHECK}, 0: off")
    parser.add_argument("--launch-timeout", type=float, default=RunnerOptions.launch_timeout_s,
                        metavar="S", help="launch: seconds a server has to answer /health "
                        f"(default {RunnerOptions.launch_timeout_s:g})")
    parser.add_argument("--engine", default="fairgate", metavar="NAME",
                        help="vllm | sglang | fairgate (default): launch: the server --command "
                        "starts; its flags for the tuned knobs (and --host/--port unless "
                        "--command has {port}) are appended, its out-of-memory lines make a "
                        "trial infeasible. best.yaml gives the winner as its flags")
    parser.add_argument("--apply", action="store_true", help="replay: leave the engine on the "
                        "recommended config at the end (default: put it back on its own)")
    parser.add_argument("-c", "--config", metavar="FILE",
                        help="fairgate.yaml: its `engine` section is the base config, its "
                             f"`database` the default study storage (default: ./{DEFAULT_CONFIG} "
                             "if present)")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KNOB=VALUE", help="override one base engine knob (YAML value)")
    parser.add_argument("--sim-profile", metavar="FILE", help="sim: step times and KV size "
                        "from a `fairgate tune calibrate` profile (the same as --set "
                        "sim_profile=FILE)")
    src = parser.add_mutually_exclusive_group()
    src.add_argument("--workload", metavar="NAME", help=f"a named workload: {', '.join(WORKLOADS)}")
    src.add_argument("--trace", metavar="FILE", help="a trace file (azure CSV, mooncake or "
                                                     "fairgate JSONL)")
    src.add_argument("--workload-file", metavar="FILE", help="YAML/JSON tenant mix")
    parser.add_argument("--trace-format", choices=TRACE_FORMATS, default="auto")
    parser.add_argument("--rate", type=float, metavar="R", help="requests/s (traces: rescales "
                        "time so that R is the mean over the train window)")
    parser.add_argument("--duration", type=float, metavar="S", help="seconds of workload per "
                        "window (default: long enough for 1,000 requests, at least 60 s)")
    parser.add_argument("--start", type=float, metavar="S", help="traces: the train window "
                        "starts S trace-seconds in (default 0)")
    parser.add_argument("--window", type=float, metavar="S", help="traces: each window is S "
                        "trace-seconds long (default: what holds 1,000 requests, or "
                        "--rate x --duration of them)")
    parser.add_argument("--slo-ttft-p99", type=float, metavar="S",
                        help="p99 TTFT target, seconds (default: the strictest an enabled "
                        "tenant of the database sets)")
    parser.add_argument("--slo-tpot-p99", type=float, metavar="S",
                        help="p99 TPOT target (each request's time per output token after the "
                        "first), seconds (default: the strictest tenant's)")
    parser.add_argument("--slo-itl-p99", type=float, metavar="S",
                        help="p99 ITL target (every gap between two tokens, pooled over the "
                        "trial, as vllm bench serve's ITL), seconds (default: the strictest "
                        "tenant's)")
    parser.add_argument("--objective", default="goodput", help=f"{' | '.join(OBJECTIVES)}: "
                        "goodput (req/s meeting both SLOs), capacity (the highest rate at which "
                        "both p99s hold; slow in replay/launch mode: each probe is a real-time "
                        "replay), pareto (output tokens/s against p99 TTFT)")
    parser.add_argument("--baseline", metavar="NAME", help="vllm-grid: vLLM auto_tune's 8 "
                        "configs (max_num_seqs 128/256 x max_num_batched_tokens 512..4096, "
                        "memory_fraction probed from 0.98 down) join the study")
    parser.add_argument("--holdout", "--robustness", dest="holdout", type=int, metavar="K",
                        help="choose the recommendation on K held-out windows of the workload "
                        "(a trace's other windows, a synthetic workload's other seeds); 0: the "
                        f"study's own best (default {DEFAULT_HOLDOUT} in sim mode, 0 in "
                        "replay/launch: real time)")
    parser.add_argument("--holdout-top", "--robust-top", dest="holdout_top", type=int,
                        default=3, metavar="N", help="the study's top configs run on the "
                        "held-out windows beside the baselines (default 3)")
    parser.add_argument("--workers", type=int, metavar="N", help="trials in parallel: sim and "
                        "launch in N processes, replay one per --url (default: 1, replay: the "
                        "number of --url)")
    parser.add_argument("--heartbeat", type=int, default=HEARTBEAT_S, metavar="S",
                        help="seconds between a running trial's heartbeats; a trial silent for "
                        f"two is re-run (default {HEARTBEAT_S})")
    parser.add_argument("--space", metavar="FILE", help="YAML search space (default: the token "
                        "budget, max_num_seqs, max_model_len, memory_fraction)")
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument("--trials", type=int, metavar="N",
                        help=f"the study's size in finished trials, counting earlier runs of "
                        f"the same --study (default {DEFAULT_TRIALS})")
    budget.add_argument("--timeout", type=float, metavar="S",
                        help="run trials for S seconds (instead of --trials)")
    parser.add_argument("--study", metavar="NAME", help="study name; an existing one resumes "
                                                        "(default: a new tune-<time> study)")
    parser.add_argument("--storage", metavar="URL", help=f"Optuna storage (default: "
                        f"${STORAGE_ENV}, else the config's database URL)")
    parser.add_argument("--out", metavar="DIR", help="best.yaml, trials.csv, report.md "
                                                     "(default tune-<study>)")
    parser.add_argument("--seed", type=int, default=0, metavar="N",
                        help="sampler and workload seed (default 0)")
    parser.set_defaults(**_BENCH_DEFAULTS)


def config_file(path: str | None) -> str | None:
    """-c FILE, else ./fairgate.yaml when it exists (as `fairgate tenants` and `keys` choose
    it), else None: the built-in defaults."""
    if path is not None or not Path(DEFAULT_CONFIG).is_file():
        return path
    return DEFAULT_CONFIG


def build_spec(args: argparse.Namespace) -> TuneSpec:
    """Every option checked, in the order a user reads them; ValueError for the first mistake."""
    args = argparse.Namespace(**{**vars(args), "config": config_file(args.config)})
    mode = check_mode(args.mode)
    objective = check_objective(args.objective)
    slo = build_slo(args)
    runner = runner_options(mode, args)
    overrides = list(args.overrides)
    if args.sim_profile is not None:
        overrides.append(f"sim_profile={args.sim_profile}")
    base = build_config(args.config, overrides)
    space = load_space_file(args.space) if args.space else default_space(
        base, RUNNERS[mode](runner).prepare(base))
    if mode == "shadow":
        if args.workload or args.trace or args.workload_file:
            raise ValueError("--mode shadow runs on the gateway's mirrored live traffic: drop "
                             "--workload/--trace/--workload-file")
        if objective != "goodput":
            raise ValueError("--mode shadow scores SLO attainment against the live engine: "
                             "--objective goodput only")
        # the window's size: the study counts these, the traffic is the gateway's
        requests = [TraceRequest(0.0, 1, 1) for _ in range(runner.shadow_requests)]
        held: tuple[Window, ...] = ()
    elif not (args.workload or args.trace or args.workload_file):
        raise ValueError("give the workload: --workload NAME, --trace FILE or --workload-file F")
    else:
        holdout = check_int("--holdout", args.holdout if args.holdout is not None
                            else (DEFAULT_HOLDOUT if mode == "sim" else 0), low=0,
                            high=MAX_HOLDOUT)
        train, held = study_windows(args, holdout, min_requests(slo.target), plan_requests,
                                    strict=args.holdout is not None)
        if len(held) < holdout:
            print(f"fairgate tune: the trace holds {len(held)} held-out windows beside the "
                  f"train window, not {holdout}: choosing on {len(held)}"
                  + (" (the recommendation is the study's own best)" if not held else ""),
                  file=sys.stderr)
        requests = list(train.requests)
    trials = None if args.timeout is not None else check_positive_int(
        "--trials", DEFAULT_TRIALS if args.trials is None else args.trials)
    study = args.study or time.strftime("tune-%Y%m%d-%H%M%S")
    storage = args.storage or os.environ.get(STORAGE_ENV) or database_url(
        load_config_file(args.config))
    out_dir = check_out_dir(Path(args.out or study))
    if mode == "shadow" and args.holdout:
        raise ValueError("--holdout re-runs other draws of a workload: --mode shadow has "
                         "none (its traffic is live)")
    if mode != "shadow" and args.recheck is not None:
        raise ValueError(f"--recheck re-checks a shadow study on its captured traffic: it is "
                         f"for --mode shadow, not --mode {mode}")
    recheck = check_int("--recheck", DEFAULT_RECHECK if args.recheck is None else args.recheck,
                        low=0, high=MAX_RECHECK)
    return TuneSpec(mode=mode, base=base, space=space, requests=tuple(requests), slo=slo,
                    storage=storage, study_name=study, out_dir=out_dir,
                    objective=objective, trials=trials, timeout_s=args.timeout,
                    seed=args.seed, workload=args.workload or args.trace or args.workload_file
                    or f"requests mirrored by {args.gateway} to {args.shadow}",
                    runner=runner, baseline=args.baseline, workers=workers(mode, args),
                    urls=tuple(args.url), holdout=held if mode != "shadow" else (),
                    holdout_top=check_int("--holdout-top", args.holdout_top, low=1),
                    heartbeat_s=check_positive_int("--heartbeat", args.heartbeat),
                    recheck=recheck if mode == "shadow" else 0)


MAX_HOLDOUT = 16


def check_out_dir(path: Path) -> Path:
    """--out must be a directory that exists or can be made; said before any trial runs, so
    a study is not lost to an unwritable path at its end. Nothing is created here."""
    if path.exists() and not path.is_dir():
        raise ValueError(f"--out {path} exists and is not a directory")
    parent = path
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"--out {path}: cannot create it ({parent} is not a writable directory)")
    return path


def workers(mode: str, args: argparse.Namespace) -> int:
    if mode == "replay":
        count = check_positive_int("--workers", len(args.url) if args.workers is None
                                   else args.workers)
        if count > len(args.url):
            raise ValueError(f"--workers {count} in replay mode needs {count} engines: give "
                             f"--url once per engine ({len(args.url)} given)")
        return count
    return check_positive_int("--workers", 1 if args.workers is None else args.workers)


def runner_options(mode: str, args: argparse.Namespace) -> RunnerOptions:
    """The mode's own options, checked up front (a replay --url must answer)."""
    from tuner.engines import engine_named
    from tuner.loadgen import Target
    from tuner.remote import check_reachable, check_template

    for flag, value, wanted in (("--gateway", args.gateway, "shadow"),
                                ("--shadow", args.shadow, "shadow"),
                                ("--url", args.url or None, "replay"),
                                ("--command", args.launch_command, "launch")):
        if value is not None and mode != wanted:
            raise ValueError(f"{flag} is for --mode {wanted}, not --mode {mode}")
    if mode == "replay":
        if not args.url:
            raise ValueError("--mode replay needs --url URL of a running fairgate engine")
        for url in args.url:
            Target(url)  # the URL's form
            check_reachable(url, args.api_key)
    if mode == "launch":
        if args.launch_command is None:
            raise ValueError("--mode launch needs --command '... --port {port} ...'")
        check_template(args.launch_command)
    if mode == "shadow" and (args.gateway is None or args.shadow is None):
        raise ValueError("--mode shadow needs --gateway URL and --shadow NAME")
    timeout = check_number("--launch-timeout", args.launch_timeout, low=0, open_low=True)
    if args.apply and mode != "replay":
        raise ValueError(f"--apply leaves a replayed engine on the winner: it is for --mode "
                         f"replay, not --mode {mode}")
    return RunnerOptions(url=args.url[0] if args.url else None, command=args.launch_command,
                         engine=engine_named(args.engine).name, apply=args.apply,
                         api_key=args.api_key, launch_timeout_s=timeout, gateway=args.gateway,
                         admin_key=args.admin_key, shadow=args.shadow,
                         shadow_requests=check_positive_int("--shadow-requests",
                                                            args.shadow_requests),
                         shadow_window_s=check_number("--shadow-window", args.shadow_window,
                                                      low=0, open_low=True))


SLO_FLAGS = {"ttft": "--slo-ttft-p99", "tpot": "--slo-tpot-p99", "itl": "--slo-itl-p99"}


def build_slo(args: argparse.Namespace) -> SLO:
    """The SLOs given; each one not given is the strictest an enabled tenant sets (said on
    stderr); at least one must be set."""
    given = {name: getattr(args, f"slo_{name}_p99") for name in SLO_FLAGS}
    tenants = tenant_slos(database_url(load_config_file(args.config))) if None in \
        given.values() else {}
    targets: dict[str, float | None] = {}
    for name, flag in SLO_FLAGS.items():
        value = given[name]
        if value is None and name in tenants:
            value, tenant = tenants[name]
            print(f"fairgate tune: {flag} {value:g} s, the strictest tenant SLO ({tenant})",
                  file=sys.stderr)
        targets[name] = None if value is None else check_number(flag, value, low=0,
                                                                 open_low=True)
    if all(v is None for v in targets.values()):
        raise ValueError("give at least one SLO (seconds): --slo-ttft-p99 S, --slo-tpot-p99 S "
                         "or --slo-itl-p99 S; no tenant in the database sets one")
    return SLO(ttft_s=targets["ttft"], tpot_s=targets["tpot"], itl_s=targets["itl"])


def tenant_slos(url: str) -> dict[str, tuple[float, str]]:
    """{"ttft"|"tpot"|"itl": (the strictest p99 target any enabled tenant sets, its tenant)};
    empty when the database does not exist yet or holds no tenants (it is never created
    here)."""
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
        for measure, target in (("ttft", tenant.slo_ttft_p99_s), ("tpot", tenant.slo_tpot_p99_s),
                                ("itl", tenant.slo_itl_p99_s)):
            if tenant.enabled and target is not None and (
                    measure not in found or target < found[measure][0]):
                found[measure] = (target, tenant.name)
    return found


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM ends the study as Ctrl-C does, so a replayed engine is put back on its own
    config and launched servers are stopped (in the main thread only, where signals land)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run(args: argparse.Namespace) -> int:
    import optuna

    from tuner.progress import ProgressBar
    from tuner.remote import LaunchAborted
    from tuner.study_report import margin_text

    spec = build_spec(args)
    optuna.logging.set_verbosity(optuna.logging.ERROR)  # our own line per trial instead
    try:
        with ProgressBar(spec.trials, sys.stderr) as bar, _sigterm_as_interrupt():
            outcome = run_study(spec, progress=bar)
    except LaunchAborted as exc:
        print(f"fairgate tune: error: {exc}", file=sys.stderr)
        return 2
    written = ", ".join(str(p) for p in outcome.files)
    default = outcome.default
    if spec.mode == "launch" and default is not None and not default.ran:
        print(f"fairgate tune: the base config's trial #{default.number} got no server to "
              f"measure ({default.infeasible})", file=sys.stderr)
    if outcome.best is None:
        print(f"fairgate tune: no trial met the SLOs ({slo_text(spec.slo)}) in "
              f"{len(outcome.rows)} trials; wrote "
              f"{written}", file=sys.stderr)
        return 1
    best = outcome.best
    for line in margin_text(spec, outcome):
        print(f"fairgate tune: {line.removeprefix('- ')}", file=sys.stderr)
    print(f"fairgate tune: recommended trial #{best.number}: {value_text(best)} with "
          f"{best.params}; wrote {written}", file=sys.stderr)
    return 0
