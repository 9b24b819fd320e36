"""`fairgate tune`: search engine knobs with Optuna against p99 TTFT, TPOT and ITL SLOs.

    fairgate tune [--spec FILE]
                  --mode sim | replay --url URL | launch --command '...{port}...{knob}...'
                  | shadow --gateway URL --admin-key K --shadow NAME [--shadow-requests N]
                    [--shadow-window S] [--recheck N]
                  [--api-key KEY] [--engine-admin-key KEY] [--launch-timeout S]
                  [-c fairgate.yaml] [--set KNOB=VALUE]
                  [--sim-profile FILE]
                  (--workload NAME | --trace FILE | --workload-file F) [--rate R] [--duration S]
                  [--start S] [--window S]
                  [--slo-ttft-p99 S] [--slo-tpot-p99 S] [--slo-itl-p99 S]
                  [--objective goodput|capacity|pareto]
                  [--no-tenant-slos] [--space space.yaml] [--baseline vllm-grid]
                  [--holdout K] [--holdout-top N]
                  [--trials N | --timeout S] [--workers N] [--study NAME] [--storage URL]
                  [--out DIR] [--seed N]

Every option is a field of one spec (tuner/options.py: its table gives each flag's field name,
its check and its one default): `--spec FILE` reads them from a YAML or JSON file by field name
(trials: 30, slo_ttft_p99_s: 0.5, space: {max_num_seqs: {low: 8, high: 256}}, ...), flags given
beside it win; a tune job's worker is run so, on the spec.json its gateway wrote.

--trials is the study's size: a resumed study (the same --study) runs only the trials it still
lacks, so a study whose worker was killed is finished by running the same command again (the
killed trial is re-run with the same knobs once its heartbeat is stale).

The SLOs are vLLM's: TTFT and TPOT per request, ITL every gap between tokens pooled over the
trial; any combination is a constraint. An SLO not given is the strictest one an enabled tenant
in the database sets (said on stderr; --no-tenant-slos: none); at least one must be set.

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.config import ENGINE_ADMIN_KEY_ENV, ENGINE_KEY_ENV, EngineConfig
from fairgate.config import database_url, load_config_file, section
from fairgate.engine_cli import parse_overrides
from fairgate.tenants_common import DEFAULT_CONFIG
from gateway.config import ADMIN_KEY_ENV  # a tune job's worker gets the key here, never in argv
from protocol.stats import min_samples
from tuner.bench_cli import plan_requests
from tuner.measures import slo_text
from tuner.options import (
    ALIASES,
    CLI,
    FILE,
    OPTIONS,
    SLO_FIELDS,
    OptionError,
    Surface,
    TuneOptions,
    argparse_kwargs,
    read_spec,
    settle_slos,
)
from tuner.outcome import value_text
from tuner.runners import RUNNERS, RunnerOptions, check_mode
from tuner.space import default_space, load_space_file, parse_space
from tuner.spec import TuneSpec, Window, check_objective
from tuner.study import run_study
from tuner.traces import TraceRequest
from tuner.windows import study_windows

STORAGE_ENV = "FAIRGATE_TUNE_STORAGE"  # the default --storage (a URL may hold a password)

# the workload options of `fairgate bench` that tune does not offer, at bench's defaults
BENCH_DEFAULTS = {"scale_tokens": 1.0, "max_prompt_tokens": None, "max_output_tokens": None,
                   "num_requests": None, "arrivals": None, "burstiness": None, "speed": None}


def register(parser: argparse.ArgumentParser) -> None:
    """The flags of tuner.options' table (no defaults here: a flag not given is the spec
    file's value or the one default), --spec, and the credentials (never in a spec)."""
    parser.description = "Search engine knobs with Optuna against p99 TTFT, TPOT and ITL SLOs."
    parser.add_argument("--spec", metavar="FILE", help="a tune spec (YAML, or JSON if it ends "
                        "in .json): the options' field names as keys (trials: 30, "
                        "slo_ttft_p99_s: 0.5, ...); flags given beside it win")
    for option in OPTIONS:
        parser.add_argument(*option.flags, **argparse_kwargs(option))
    parser.add_argument("--api-key", metavar="KEY", default=os.environ.get(ENGINE_KEY_ENV),
                        help="replay/launch/shadow: the engine's bearer key for /v1/*, /load "
                        f"and /stats (default: ${ENGINE_KEY_ENV})")
    parser.add_argument("--engine-admin-key", metavar="KEY",
                        default=os.environ.get(ENGINE_ADMIN_KEY_ENV),
                        help="replay/shadow: the engine's key for /admin/config and "
                        f"/admin/reconfigure (default: ${ENGINE_ADMIN_KEY_ENV}, else --api-key)")
    parser.add_argument("--admin-key", metavar="KEY", default=os.environ.get(ADMIN_KEY_ENV),
                        help=f"shadow: the gateway's admin key (default: ${ADMIN_KEY_ENV})")


@dataclass(frozen=True)
class Keys:
    """The credentials a study uses: from argv or the environment, never from a spec."""

    api_key: str | None = None  # replay/launch/shadow: the engine's bearer key
    admin_key: str | None = None  # shadow: the gateway's admin key
    engine_admin_key: str | None = None  # replay/shadow: the engine's /admin/*; None: api_key


def config_file(path: str | None) -> str | None:
    """-c FILE, else ./fairgate.yaml when it exists (as `fairgate tenants` and `keys` choose
    it), else None: the built-in defaults."""
    if path is not None or not Path(DEFAULT_CONFIG).is_file():
        return path
    return DEFAULT_CONFIG


def options_from_args(args: argparse.Namespace) -> tuple[TuneOptions, Surface]:
    """argv -> mapping -> TuneOptions (with --spec FILE: its mapping, the flags given on top);
    and the surface its messages name fields by (a flag given: its flag; a file's: its key)."""
    given: dict[str, Any] = {}
    for option in OPTIONS:
        value = getattr(args, option.dest or option.name, None)
        if value is not None:
            given[option.name] = parse_overrides(value) if option.name == "set" else value
    spec = getattr(args, "spec", None)
    if spec is None:
        return TuneOptions.from_mapping(given, CLI), CLI
    written = read_spec(spec)
    if "set" in given and isinstance(written.get("set"), dict):
        given["set"] = {**written["set"], **given["set"]}  # knob by knob
    mapping = {k: v for k, v in written.items() if ALIASES.get(k, k) not in given}
    surface = FILE.from_argv(given)
    try:
        return TuneOptions.from_mapping({**mapping, **given}, surface), surface
    except OptionError as exc:
        if exc.field in given:
            raise
        raise OptionError(exc.field, f"--spec {spec}: {exc}") from None


def workload_args(options: TuneOptions) -> argparse.Namespace:
    """The options as `fairgate bench`'s workload options (tuner.bench_cli.plan_requests and
    tuner.windows read these)."""
    return argparse.Namespace(
        **BENCH_DEFAULTS, workload=options.workload, trace=options.trace,
        workload_file=options.workload_file, trace_format=options.trace_format,
        rate=options.rate, duration=options.duration, start=options.start,
        window=options.window, seed=options.seed)


def build_spec(options: TuneOptions, surface: Surface = CLI, keys: Keys = Keys()) -> TuneSpec:
    """The study the options describe, with what needs the world checked (the config file,
    the tenants' SLOs, the space against the base config, the workload's files, a replay
    engine that must answer, the output folder); ValueError for the first mistake."""
    n = surface.name
    config = config_file(options.config)
    mode = check_mode(options.mode)
    objective = check_objective(options.objective)
    options = settled(options, config, surface)
    runner = runner_options(options, keys)
    base = base_config(config, options)
    if isinstance(options.space, str):
        space = load_space_file(options.space)
    elif options.space is not None:
        try:
            space = parse_space(options.space)
        except ValueError as exc:
            raise OptionError("space", f"{n('space')}: {exc}") from None
    else:
        space = default_space(base, RUNNERS[mode](runner).prepare(base))
    held: tuple[Window, ...] = ()
    if mode == "shadow":
        # the window's size: the study counts these, the traffic is the gateway's
        requests = [TraceRequest(0.0, 1, 1) for _ in range(runner.shadow_requests)]
    else:
        holdout = options.holdout_count
        train, held = study_windows(workload_args(options), holdout,
                                    min_samples(100 * options.slo.target), plan_requests,
                                    strict=options.holdout is not None)
        if len(held) < holdout:
            print(f"fairgate tune: the trace holds {len(held)} held-out windows beside the "
                  f"train window, not {holdout}: choosing on {len(held)}"
                  + (" (the recommendation is the study's own best)" if not held else ""),
                  file=sys.stderr)
        requests = list(train.requests)
    study = options.study or time.strftime("tune-%Y%m%d-%H%M%S")
    storage = options.storage or os.environ.get(STORAGE_ENV) or database_url(
        load_config_file(config))
    out_dir = check_out_dir(Path(options.out or study), n("out"))
    return TuneSpec(mode=mode, base=base, space=space, requests=tuple(requests),
                    slo=options.slo, storage=storage, study_name=study, out_dir=out_dir,
                    objective=objective, trials=options.trials, timeout_s=options.timeout_s,
                    seed=options.seed, workload=options.source
                    or f"requests mirrored by {options.gateway} to {options.shadow}",
                    runner=runner, baseline=options.baseline, workers=workers(options, surface),
                    urls=options.target, holdout=held, holdout_top=options.holdout_top,
                    heartbeat_s=options.heartbeat_s, recheck=options.recheck_count)


def settled(options: TuneOptions, config: str | None, surface: Surface) -> TuneOptions:
    """The SLOs settled: each one not given is the strictest an enabled tenant of the
    config's database sets (said on stderr), unless tenant_slos is off."""
    strictest: dict[str, tuple[float, str]] = {}
    if options.tenant_slos and any(getattr(options, f) is None for f in SLO_FIELDS.values()):
        strictest = tenant_slos(database_url(load_config_file(config)))
    result = settle_slos(options, {f: v for f, (v, _) in strictest.items()}, surface)
    for name in SLO_FIELDS.values():
        if getattr(options, name) is None and getattr(result, name) is not None:
            value, tenant = strictest[name]
            print(f"fairgate tune: {surface.name(name)} {value:g} s, the strictest tenant SLO "
                  f"({tenant})", file=sys.stderr)
    return result


def base_config(config: str | None, options: TuneOptions) -> EngineConfig:
    """The config file's engine section with the spec's knobs (and sim profile) on top."""
    knobs = dict(options.set)
    if options.sim_profile is not None:
        knobs["sim_profile"] = options.sim_profile
    try:
        return EngineConfig.from_dict({**section(load_config_file(config), "engine"), **knobs})
    except TypeError as exc:  # a wrongly typed value compared during validation
        raise ValueError(f"invalid engine setting: {exc}") from None


def check_out_dir(path: Path, flag: str = "--out") -> Path:
    """--out must be a directory that exists or can be made; said before any trial runs, so
    a study is not lost to an unwritable path at its end. Nothing is created here."""
    if path.exists() and not path.is_dir():
        raise ValueError(f"{flag} {path} exists and is not a directory")
    parent = path
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path}: cannot create it ({parent} is not a writable "
                         "directory)")
    return path


def workers(options: TuneOptions, surface: Surface) -> int:
    count = options.worker_count
    if options.mode == "replay" and count > len(options.target):
        raise OptionError("workers", f"{surface.name('workers')} {count} in replay mode needs "
                          f"{count} engines: give {surface.name('target')} once per engine "
                          f"({len(options.target)} given)")
    return count


def runner_options(options: TuneOptions, keys: Keys) -> RunnerOptions:
    """The mode's own options, checked up front (a replay --url must answer)."""
    from tuner.engines import engine_named
    from tuner.loadgen import Target
    from tuner.remote import check_reachable, check_template

    if options.mode == "replay":
        for url in options.target:
            Target(url)  # the URL's form
            check_reachable(url, keys.api_key)
    if options.mode == "launch" and options.command is not None:
        check_template(options.command)
    return RunnerOptions(url=options.target[0] if options.target else None,
                         command=options.command, engine=engine_named(options.engine).name,
                         apply=options.apply, api_key=keys.api_key,
                         engine_admin_key=keys.engine_admin_key,
                         launch_timeout_s=options.launch_timeout_s, gateway=options.gateway,
                         admin_key=keys.admin_key, shadow=options.shadow,
                         shadow_requests=options.shadow_requests,
                         shadow_window_s=options.shadow_window_s)


def tenant_slos(url: str) -> dict[str, tuple[float, str]]:
    """{SLO field (slo_ttft_p99_s, ...): (the strictest p99 target any enabled tenant sets,
    its tenant)};
    empty when the database does not exist yet or holds no tenants (it is never created
    here)."""
    import asyncio

    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import SQLAlchemyError

    from tenants import TenantStore
    from tenants.db import normalize_url
    from tenants.values import strictest_slos

    parsed = make_url(normalize_url(url))  # a URL that is none: one line (a TenantError)
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
    return strictest_slos(tenants)


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

    options, surface = options_from_args(args)
    spec = build_spec(options, surface, Keys(args.api_key or None, args.admin_key,
                                             args.engine_admin_key or None))
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
