"""The Optuna study behind `fairgate tune`: one study interface, one trial runner per mode.

A trial: the space suggests knobs, `tuner.space.build_config` checks them before anything runs,
the mode's `TrialRunner` replays the workload under them, and the trial's pooled p99 TTFT and
p99 ITL (each request's TPOT, the measure `SLO.itl_s` bounds) become Optuna constraints
(`trial.set_constraint("p99_ttft" | "p99_itl", p99 - SLO)`, feasible when <= 0; the issue's
`constraints_func` is deprecated since Optuna 5).
The objective, maximised, is goodput (requests/s that met both SLOs at the workload's own rate)
or capacity (`tuner.capacity`: the highest arrival rate at which both p99s hold, probed per
trial by replaying the same requests time-compressed). For capacity the SLOs are inside the
objective: a trial's constraints are its p99s at the capacity point (met by construction), and
a config that misses them even at the lowest rate is infeasible like any other.

How infeasible trials reach Optuna: a trial is never pruned. A config known to be impossible
before running (an `EngineConfig` rule, the model's context length), or one the runner cannot
start (too little simulated memory), completes with goodput 0 and the largest violation of both
constraints, so TPE learns the region is bad; `user_attrs["infeasible"]` says why and
`user_attrs["ran"]` is False. A run stops early once more requests missed a target than its
error budget allows (1% of the planned requests for p99): it can no longer meet that p99.

p99 here is the nearest-rank order statistic, with a failed or refused request counted as an
infinite TTFT and TPOT: then "p99 <= SLO" holds exactly when at least 99% of the requests met
it, protocol.measures' SLO attainment definition (linear interpolation would let one failed
request in a hundred make the p99 infinite).

Modes: `RUNNERS` holds what is built: `sim` here, `replay` and `launch` in `tuner.remote` (real
time, over HTTP; their early stop cuts the load generator's run short); a shadow runner
implements the same `TrialRunner` protocol.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import optuna
from optuna.trial import FrozenTrial, TrialState

from engine.config import EngineConfig
from protocol.measures import SLO, RequestTiming, error_budget, goodput
from protocol.validators import check_choice, check_int, check_number, check_positive_int
from tuner.capacity import mean_rate, scale_arrivals, search_capacity
from tuner.progress import ProgressBar
from tuner.space import Space, build_config
from tuner.traces import TraceRequest

if TYPE_CHECKING:
    from tuner.recheck import Recheck

MODES = ("sim", "replay", "launch", "shadow")
OBJECTIVES = ("goodput", "capacity", "pareto")
BUILT_OBJECTIVES = OBJECTIVES
OBJECTIVE_TEXT = {"goodput": "requests/s meeting both SLOs at the workload's own rate",
                  "capacity": "the highest arrival rate, requests/s, at which both p99s hold",
                  "pareto": "output tokens/s against p99 TTFT, both SLOs as constraints"}
OBJECTIVE_UNIT = {"goodput": "req/s", "capacity": "req/s", "pareto": "tok/s"}
BASELINES = ("vllm-grid",)
MAX_RECHECK = 20  # re-checked configs: each is a real-time replay
HEARTBEAT_S = 10  # a killed worker's trial is retried once it missed two heartbeats
VIOLATION_CAP = 1e6  # seconds: an infinite p99 (or a trial that never ran) as a finite violation
BOOTSTRAP_RESAMPLES = 200
CONSTRAINTS = ("p99_ttft", "p99_itl")  # p99 - SLO, seconds
ASYNC_DRIVERS = {"aiosqlite": "sqlite", "asyncpg": "postgresql"}

StopRule = Callable[[list[RequestTiming]], str | None]


# ----------------------------------------------------------------------------- runners


class TrialRun(Protocol):
    """What a runner hands back (tuner.simulate.SimResult is one)."""

    @property
    def timings(self) -> list[RequestTiming]: ...  # one per planned request, in workload order
    @property
    def elapsed_s(self) -> float: ...
    @property
    def stopped(self) -> str | None: ...
    @property
    def wall_s(self) -> float: ...


class TrialRunner(Protocol):
    def prepare(self, config: EngineConfig) -> EngineConfig:
        """The config this runner actually runs for the user's `config`."""
        ...

    def run(self, config: EngineConfig, requests: Sequence[TraceRequest],
            stop: StopRule) -> TrialRun:
        """Replay `requests` under `config`; ValueError when it cannot start."""
        ...


@dataclass(frozen=True)
class RunnerOptions:
    """What the HTTP runners need beyond the config: the engine's --url (replay), the server
    --command template (launch), an API key, and the space's knobs (what replay reconfigures)."""

    url: str | None = None
    command: str | None = None
    api_key: str | None = None
    launch_timeout_s: float = 120.0
    knobs: tuple[str, ...] = ()
    gateway: str | None = None  # shadow: the gateway, its admin key and the target's name
    admin_key: str | None = None
    shadow: str | None = None
    shadow_requests: int = 100  # mirrored requests per trial
    shadow_window_s: float = 300.0  # the longest a trial waits for them


class SimRunner:
    """In process, on the simulated executor's virtual clock (`tuner.simulate`). The user's
    executor is kept in best.yaml; trials simulate `sim_model` on `sim_hardware`. No trial
    runs more than SIM_TRIAL_WALL_S of real time (one that does is infeasible, with why)."""

    def __init__(self, options: RunnerOptions | None = None) -> None:
        del options  # everything sim needs is in the config

    def prepare(self, config: EngineConfig) -> EngineConfig:
        return config.replace(executor="sim", sim_clock="virtual")

    def run(self, config: EngineConfig, requests: Sequence[TraceRequest],
            stop: StopRule) -> TrialRun:
        from tuner.simulate import simulate

        return simulate(config, requests, stop=stop, max_wall_s=SIM_TRIAL_WALL_S)


SIM_TRIAL_WALL_S = 300.0  # a 2,000-request trial takes about a second


def _replay_runner(options: RunnerOptions) -> TrialRunner:
    from tuner.remote import ReplayRunner

    if options.url is None:
        raise ValueError("--mode replay needs --url URL of a running fairgate engine")
    return ReplayRunner(options.url, options.api_key, options.knobs)


def _launch_runner(options: RunnerOptions) -> TrialRunner:
    from tuner.remote import LaunchRunner

    if options.command is None:
        raise ValueError("--mode launch needs --command '... --port {port} ...'")
    return LaunchRunner(options.command, options.api_key, options.launch_timeout_s)


def _shadow_runner(options: RunnerOptions) -> TrialRunner:
    from tuner.shadow_mode import ShadowRunner

    if options.gateway is None or options.shadow is None:
        raise ValueError("--mode shadow needs --gateway URL and --shadow NAME")
    return ShadowRunner(options.gateway, options.admin_key, options.shadow, options.knobs,
                        options.shadow_requests, options.shadow_window_s)


RUNNERS: dict[str, Callable[[RunnerOptions], TrialRunner]] = {
    "sim": SimRunner, "replay": _replay_runner, "launch": _launch_runner,
    "shadow": _shadow_runner}


def check_mode(mode: str) -> str:
    check_choice("--mode", mode, MODES)
    if mode not in RUNNERS:
        raise ValueError(f"--mode {mode} is not built yet; built: {', '.join(RUNNERS)}")
    return mode


def check_objective(objective: str) -> str:
    check_choice("--objective", objective, OBJECTIVES)
    if objective not in BUILT_OBJECTIVES:
        raise ValueError(f"--objective {objective} is not built yet; built: "
                         f"{', '.join(BUILT_OBJECTIVES)}")
    return objective


def optuna_storage_url(url: str) -> str:
    """The project's database URL for Optuna's synchronous SQLAlchemy engine:
    sqlite+aiosqlite:///x.db -> sqlite:///x.db, postgresql+asyncpg://... -> postgresql://..."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise ValueError(f"--storage must be a database URL (sqlite:///tune.db, "
                         f"postgresql://user@host/db), got {url!r}")
    dialect, _, driver = scheme.partition("+")
    sync = f"{ASYNC_DRIVERS[driver]}://{rest}" if driver in ASYNC_DRIVERS else url
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError

    try:
        make_url(sync).get_dialect()  # a scheme SQLAlchemy has no dialect for fails here
    except (ArgumentError, NoSuchModuleError):
        raise ValueError(f"--storage {url!r} is not a database URL SQLAlchemy knows "
                         "(sqlite:///tune.db, postgresql://user@host/db)") from None
    return sync


# ----------------------------------------------------------------------------- the spec


@dataclass(frozen=True)
class Variant:
    """Another slice or seed of the workload, for the robustness re-runs."""

    label: str  # "seed 1", "slice from 60 s"
    requests: tuple[TraceRequest, ...]


@dataclass(frozen=True)
class TuneSpec:
    mode: str
    base: EngineConfig  # the user's config (-c, --set); best.yaml is this plus the winner's knobs
    space: Space
    requests: tuple[TraceRequest, ...]
    slo: SLO  # both targets set
    storage: str
    study_name: str
    out_dir: Path
    objective: str = "goodput"
    trials: int | None = 30  # the study's size: trials finished, over every run and worker
    timeout_s: float | None = None
    seed: int = 0
    workload: str = ""  # how the requests were made, for the report
    runner: RunnerOptions = RunnerOptions()
    baseline: str | None = None  # "vllm-grid": vLLM auto_tune's 8 configs join the study
    workers: int = 1  # sim: processes; replay: one per --url
    urls: tuple[str, ...] = ()  # replay with several engines: worker i drives urls[i]
    variants: tuple[Variant, ...] = ()  # robustness: the top configs re-run on each
    robust_top: int = 3
    heartbeat_s: int = HEARTBEAT_S
    recheck: int = 3  # shadow: the best configs re-checked on the study's captured traffic

    def __post_init__(self) -> None:
        check_mode(self.mode)
        check_objective(self.objective)
        if self.objective == "capacity" and self.requests:
            mean_rate(self.requests)  # raises for a workload with no arrival span
        if self.slo.ttft_s is None or self.slo.itl_s is None:
            raise ValueError("both SLOs are needed: --slo-ttft-p99 S and --slo-itl-p99 S")
        if not self.requests:
            raise ValueError("the workload produced no requests; raise --duration or --rate")
        if self.trials is None and self.timeout_s is None:
            raise ValueError("give --trials N or --timeout S")
        if self.timeout_s is not None:
            check_number("--timeout", self.timeout_s, low=0, open_low=True)
        check_positive_int("--workers", self.workers)
        check_positive_int("--heartbeat", self.heartbeat_s)
        check_int("--recheck", self.recheck, low=0, high=MAX_RECHECK)
        if self.baseline is not None:
            check_choice("--baseline", self.baseline, BASELINES)
            missing = [k for k in VLLM_GRID_KNOBS if k not in self.space]
            if missing:
                raise ValueError(f"--baseline vllm-grid varies {', '.join(VLLM_GRID_KNOBS)}; "
                                 f"add {', '.join(missing)} to the space")
            if self.trials is not None and self.trials < 1 + len(VLLM_GRID):
                raise ValueError(f"--baseline vllm-grid adds {len(VLLM_GRID)} trials to the "
                                 f"default one: --trials must be at least {1 + len(VLLM_GRID)}")

    @property
    def multi_objective(self) -> bool:
        return self.objective == "pareto"

    def fingerprint(self, prepared_base: EngineConfig) -> dict[str, Any]:
        """What a resumed study must agree on (JSON-shaped, as Optuna stores it)."""
        digest = hashlib.sha256(json.dumps(
            [[r.arrival, r.prompt_tokens, r.output_tokens, r.tenant, r.priority]
             for r in self.requests]).encode()).hexdigest()[:16]
        value = {"mode": self.mode, "objective": self.objective,
                 "slo": [self.slo.ttft_s, self.slo.itl_s, self.slo.target],
                 "space": self.space.describe(), "requests": len(self.requests),
                 "requests_sha256": digest, "workload": self.workload,
                 "baseline": self.baseline, "base": prepared_base.to_dict()}
        loaded: dict[str, Any] = json.loads(json.dumps(value))
        return loaded


FINGERPRINT_TEXT = {"requests": "number of requests",
                    "requests_sha256": "workload (the same number of requests, other arrivals "
                                       "or lengths)",
                    "base": "base engine config"}


# vLLM's benchmarks/auto_tune: every max_num_seqs x max_num_batched_tokens pair, each at the
# highest gpu_memory_utilization from 0.98 down in steps of 0.01 at which the server starts
VLLM_GRID_KNOBS = ("max_num_seqs", "max_num_batched_tokens")
VLLM_GRID = tuple((seqs, tokens) for seqs in (128, 256) for tokens in (512, 1024, 2048, 4096))
VLLM_MEMORY_PROBE = tuple(round(0.98 - 0.01 * i, 2) for i in range(49))  # 0.98 .. 0.50


# ----------------------------------------------------------------------------- measures


@dataclass(frozen=True)
class TrialMeasures:
    p99_ttft_s: float
    p99_ttft_ci: tuple[float, float]
    p99_itl_s: float  # of each request's TPOT
    p99_itl_ci: tuple[float, float]
    goodput_rps: float
    good_fraction: float
    requests: int
    failed: int  # refused, failed or cut off by the early stop
    wall_s: float
    output_tokens_per_s: float = 0.0  # of every request that finished, met its SLOs or not
    engine_stats: dict[str, Any] | None = None  # replay/launch: the engine's own /stats window

    def violations(self, slo: SLO) -> list[float]:
        assert slo.ttft_s is not None and slo.itl_s is not None
        return [min(self.p99_ttft_s - slo.ttft_s, VIOLATION_CAP),
                min(self.p99_itl_s - slo.itl_s, VIOLATION_CAP)]

    def missed(self, slo: SLO) -> str | None:
        ttft, itl = self.violations(slo)
        misses = [f"p99 TTFT {_s(self.p99_ttft_s)} > {_s(slo.ttft_s)}"] if ttft > 0 else []
        misses += [f"p99 ITL {_s(self.p99_itl_s)} > {_s(slo.itl_s)}"] if itl > 0 else []
        if misses and self.failed:
            misses.append(f"{self.failed} of {self.requests} requests refused or failed")
        return ", ".join(misses) or None


def rank(n: int, target: float) -> int:
    """1-based nearest rank of the `target` quantile of n values."""
    return max(1, math.ceil(target * n - 1e-9))


def quantile_ci(values: Sequence[float], target: float, seed: int = 0,
                resamples: int = BOOTSTRAP_RESAMPLES) -> tuple[float, tuple[float, float]]:
    """The nearest-rank `target` quantile and its 95% bootstrap interval (NaN for no values)."""
    if not values:
        return math.nan, (math.nan, math.nan)
    data = np.asarray(values, dtype=float)
    k = rank(len(data), target) - 1
    point = float(np.partition(data, k)[k])
    samples = np.random.default_rng(seed).choice(data, size=(resamples, len(data)))
    estimates = np.sort(np.partition(samples, k, axis=1)[:, k])  # [resamples]
    low, high = estimates[rank(resamples, 0.025) - 1], estimates[rank(resamples, 0.975) - 1]
    return point, (float(low), float(high))


def measure(run: TrialRun, planned: int, slo: SLO, seed: int = 0) -> TrialMeasures:
    """Pooled over every planned request; a failed, refused or missing one is a miss."""
    timings = run.timings
    missing = [math.inf] * (planned - len(timings))
    ttfts = [t.ttft if t.ok and t.ttft is not None else math.inf for t in timings] + missing
    tpots = [math.inf if not t.ok else t.tpot for t in timings] + missing
    ttft = quantile_ci(ttfts, slo.target, seed)
    # no request with two tokens has no gap to miss: its p99 ITL is 0, not NaN
    itl = quantile_ci([v for v in tpots if v is not None] or [0.0], slo.target, seed)
    good = goodput(timings, run.elapsed_s, slo)
    tokens = sum(t.num_output_tokens for t in timings if t.ok)
    return TrialMeasures(p99_ttft_s=ttft[0], p99_ttft_ci=ttft[1], p99_itl_s=itl[0],
                         p99_itl_ci=itl[1], goodput_rps=good.requests_per_s,
                         good_fraction=good.requests / planned, requests=planned,
                         failed=sum(not t.ok for t in timings) + len(missing),
                         wall_s=run.wall_s, output_tokens_per_s=(
                             tokens / run.elapsed_s if run.elapsed_s > 0 else 0.0),
                         engine_stats=getattr(run, "engine_stats", None))


def early_stop(planned: int, slo: SLO) -> StopRule:
    """Stop once more requests missed a target than the p99 allows of the planned ones."""
    return EarlyStop(planned, slo)


class EarlyStop:
    """The early-stop rule, incremental: a run hands it its append-only list of finished
    timings, and only the new ones are counted (a new list starts the count afresh), so asking
    after every finished request costs O(1) each."""

    def __init__(self, planned: int, slo: SLO) -> None:
        self.planned, self.slo = planned, slo
        self.allowed = planned - rank(planned, slo.target)
        self._list: list[RequestTiming] | None = None
        self._seen = 0
        self._missed = {"TTFT": 0, "ITL": 0}

    def __call__(self, finished: list[RequestTiming]) -> str | None:
        if finished is not self._list or len(finished) < self._seen:
            self._list, self._seen, self._missed = finished, 0, {"TTFT": 0, "ITL": 0}
        for timing in finished[self._seen:]:
            self._missed["TTFT"] += not timing.meets_ttft(self.slo)
            self._missed["ITL"] += not timing.meets_tpot(self.slo)
        self._seen = len(finished)
        for name, missed in self._missed.items():
            if missed > self.allowed:
                return (f"stopped early: {missed} of {self.planned} requests missed the {name} "
                        f"SLO, more than the {error_budget(self.slo.target):.0%} a p99 allows")
        return None


# ----------------------------------------------------------------------------- the study


@dataclass(frozen=True)
class TrialRow:
    """One trial as the outputs show it."""

    number: int
    state: str
    params: dict[str, Any]
    baseline: str | None  # "default", "vllm-grid 128x2048", else None
    ran: bool
    measures: dict[str, Any] | None
    value: float | None  # the objective: goodput or capacity (req/s), pareto's tokens/s
    infeasible: str | None
    capacity: dict[str, Any] | None = None  # rate_rps, factor, probes, workload_rate_rps
    retried_from: int | None = None  # the trial of a killed worker this one re-ran
    objective: str = "goodput"

    @property
    def feasible(self) -> bool:
        return self.state == "COMPLETE" and self.infeasible is None

    @classmethod
    def of(cls, trial: FrozenTrial) -> TrialRow:
        attrs = trial.user_attrs
        values = trial.values
        baseline = attrs.get("baseline")
        # a stepped float comes back as 0.8799999999999999: as its step wrote it
        params = {k: round(v, 9) if isinstance(v, float) else v for k, v in trial.params.items()}
        return cls(number=trial.number, state=trial.state.name, params=params,
                   baseline=baseline if isinstance(baseline, str) else None,
                   ran=bool(attrs.get("ran")), measures=attrs.get("measures"),
                   value=values[0] if values else None, infeasible=attrs.get("infeasible"),
                   capacity=attrs.get("capacity"),
                   retried_from=trial.system_attrs.get("failed_trial"),
                   objective=str(attrs.get("objective", "goodput")))


@dataclass(frozen=True)
class Robustness:
    """One top config re-run on the workload's other slices and seeds."""

    number: int  # its trial
    value: float  # its objective in the study
    values: dict[str, float]  # variant label -> objective there
    missed: dict[str, str]  # variant label -> why it missed the SLOs there

    @property
    def worst(self) -> float:
        return min([self.value, *self.values.values()])

    @property
    def moved(self) -> float:
        """The worst case's relative change from the study's value (-0.1: 10% lower)."""
        return self.worst / self.value - 1 if self.value > 0 else 0.0

    def key(self) -> tuple[int, float, float]:
        """Fewest variants missed, then the best worst case, then the best study value."""
        return (-len(self.missed), self.worst, self.value)


@dataclass(frozen=True)
class StudyOutcome:
    study_name: str
    rows: list[TrialRow]
    best: TrialRow | None  # the recommendation: best worst case over the robustness re-runs
    default: TrialRow | None  # the base config's trial
    files: list[Path] = field(default_factory=list)
    robustness: list[Robustness] = field(default_factory=list)
    front: list[TrialRow] = field(default_factory=list)  # pareto: the feasible front
    recheck: Recheck | None = None  # shadow: the best configs on the captured trace

    @property
    def top(self) -> TrialRow | None:
        """The feasible trial with the best objective in the study itself."""
        return best_row(self.rows)

    @property
    def grid(self) -> list[TrialRow]:
        """vLLM's grid trials that ran to an end (a killed one counts by its re-run)."""
        labels = dict.fromkeys(r.baseline for r in self.rows
                               if (r.baseline or "").startswith("vllm-grid"))
        return [row for label in labels if label and (row := baseline_row(self.rows, label))
                and row.state == "COMPLETE"]


def baseline_row(rows: Sequence[TrialRow], label: str) -> TrialRow | None:
    """The trial of a baseline: its last that completed (a killed one's re-run copies its
    label), else its first."""
    mine = [r for r in rows if r.baseline == label]
    done = [r for r in mine if r.state == "COMPLETE"]
    return done[-1] if done else next(iter(mine), None)


Progress = ProgressBar  # tuner.progress: a bar on a terminal, one line per event elsewhere


def open_storage(spec: TuneSpec) -> optuna.storages.RDBStorage:
    """Optuna's RDB storage on the study's URL, with heartbeats: a trial whose worker stopped
    beating for two intervals is failed and re-run once, with the same knobs."""
    from sqlalchemy.exc import SQLAlchemyError

    url = optuna_storage_url(spec.storage)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            return optuna.storages.RDBStorage(
                url, heartbeat_interval=spec.heartbeat_s, grace_period=2 * spec.heartbeat_s,
                heartbeat_stale_trial_callback=optuna.storages.RetryHeartbeatStaleTrialCallback(
                    max_retry=1))
    except (SQLAlchemyError, ImportError) as exc:
        cause = str(getattr(exc, "orig", None) or exc).splitlines()[0]
        hint = "; does its directory exist?" if url.startswith("sqlite") else ""
        raise ValueError(f"--storage {spec.storage}: cannot open the database ({cause}){hint}") \
            from None


def run_study(spec: TuneSpec, progress: Progress | None = None) -> StudyOutcome:
    """Run the study named in `spec` until it holds `spec.trials` finished trials (or for
    `spec.timeout_s`), creating or resuming it, over `spec.workers` workers; then re-run the
    top configs on the other workload variants (shadow mode: re-check the best ones on the
    study's captured traffic, `tuner.recheck`) and write best.yaml, trials.csv and reports."""
    from tuner.recheck import run_recheck
    from tuner.study_report import write_outputs

    runner = _runner(spec, 0)
    prepared = runner.prepare(spec.base)
    baselines = baseline_params(spec, prepared)  # checked before the storage is touched
    study = _open_study(spec, prepared, open_storage(spec), baselines)
    if progress is not None:
        earlier = len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)))
        progress.started = progress.done = earlier
        progress.note(f"fairgate tune: study {spec.study_name} on {spec.storage}"
                 + (f", resumed with {earlier} trials done" if earlier else "")
                 + f"; {len(spec.requests)} requests per trial"
                 + (f"; {spec.workers} workers" if spec.workers > 1 else ""))
    _settle_running(spec, study, progress)
    children = _start_workers(spec)
    try:
        _optimize(spec, study, runner, prepared, worker=0, progress=progress)
    finally:
        failed = _join_workers(children)
    if failed:
        if progress is not None:
            progress.note(f"fairgate tune: {failed} worker(s) exited early; re-running what "
                          "they left")
        _settle_running(spec, study, progress)
        _optimize(spec, study, runner, prepared, worker=0, progress=progress)
    robustness = _robustness(spec, study, runner, prepared, progress)
    rows = [TrialRow.of(t) for t in study.get_trials(deepcopy=False)]
    outcome = StudyOutcome(spec.study_name, rows, recommend(rows, robustness),
                           baseline_row(rows, "default"),
                           robustness=robustness,
                           front=pareto_front(rows) if spec.multi_objective else [])
    if spec.mode == "shadow" and spec.recheck > 0:
        outcome = dataclasses.replace(outcome, recheck=run_recheck(
            spec, outcome, runner, progress, _started_at(study)))
    return dataclasses.replace(outcome, files=write_outputs(spec, outcome, study))


def _started_at(study: optuna.Study) -> float:
    """When the study's first trial started (epoch seconds; over every run of a resumed
    study): the start of the span whose captured traffic the re-check replays."""
    starts = [t.datetime_start.timestamp() for t in study.get_trials(deepcopy=False)
              if t.datetime_start is not None]
    return min(starts, default=time.time())


def _runner(spec: TuneSpec, worker: int) -> TrialRunner:
    options = dataclasses.replace(spec.runner, knobs=tuple(spec.space))
    if spec.urls:
        options = dataclasses.replace(options, url=spec.urls[worker % len(spec.urls)])
    return RUNNERS[spec.mode](options)


def baseline_params(spec: TuneSpec, prepared: EngineConfig) -> list[tuple[str, dict[str, Any]]]:
    """(label, knobs) of the trials enqueued before the search: the base config, then the vLLM
    grid; ValueError when the space cannot hold one of them."""
    out = [("default", _default_params(spec, prepared))]
    if spec.baseline == "vllm-grid":
        out += vllm_grid(spec, prepared)
    for label, params in out:
        spec.space.check_fixed(params, "the base config" if label == "default"
                               else f"--baseline {label}")
    return out


def _open_study(spec: TuneSpec, prepared: EngineConfig, storage: optuna.storages.BaseStorage,
                baselines: Sequence[tuple[str, dict[str, Any]]]) -> optuna.Study:
    directions: list[optuna.study.StudyDirection] = [optuna.study.StudyDirection.MAXIMIZE]
    if spec.multi_objective:
        directions.append(optuna.study.StudyDirection.MINIMIZE)
    study = optuna.create_study(storage=storage, study_name=spec.study_name,
                                directions=directions, load_if_exists=True)
    fingerprint = spec.fingerprint(prepared)
    stored = study.user_attrs.get("spec")
    if stored is None:
        study.set_user_attr("spec", fingerprint)
    elif stored != fingerprint:
        keys = [k for k in fingerprint if stored.get(k) != fingerprint[k]]
        if "requests" in keys and "requests_sha256" in keys:
            keys.remove("requests_sha256")
        differ = ", ".join(FINGERPRINT_TEXT.get(k, k) for k in keys)
        raise ValueError(f"study {spec.study_name!r} was made with a different {differ}; "
                         "resume it with the same options or pick a new --study name")
    for label, params in baselines:
        study.enqueue_trial(params, user_attrs={"baseline": label}, skip_if_exists=True)
    return study


def _sampler(spec: TuneSpec, study: optuna.Study, worker: int) -> optuna.samplers.BaseSampler:
    """TPE, reseeded past the study's trials (a resumed study does not replay the first run's
    samples) and per worker; the constant liar keeps parallel workers apart."""
    done = len(study.get_trials(deepcopy=False))
    return optuna.samplers.TPESampler(seed=spec.seed + done + 7919 * worker, multivariate=True,
                                      constant_liar=spec.workers > 1)


def _optimize(spec: TuneSpec, study: optuna.Study, runner: TrialRunner, prepared: EngineConfig,
              worker: int, progress: Progress | None) -> None:
    """This worker's share: trials until the study holds spec.trials, finished or running."""
    study.sampler = _sampler(spec, study, worker)
    n_trials = None
    callbacks: list[Callable[[optuna.Study, FrozenTrial], None]] = []
    if spec.trials is not None:
        n_trials = spec.trials - _taken(study)
        if n_trials <= 0:
            return
        callbacks.append(_StudySize(spec.trials))
    evaluate = _Evaluator(spec, runner, prepared, progress, worker)
    if progress is not None:
        callbacks.append(_ProgressLine(spec, progress))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        # the base config's values may lie outside a --space file's ranges: it runs as it is
        warnings.filterwarnings("ignore", "Fixed parameter .* is out of range", UserWarning)
        study.optimize(evaluate, n_trials=n_trials, timeout=spec.timeout_s,
                       callbacks=callbacks, gc_after_trial=False)


def _taken(study: optuna.Study) -> int:
    """Trials that count toward the study's size: finished, or running in some worker."""
    return len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,
                                                        TrialState.RUNNING)))


class _StudySize:
    """Stops a worker once the study's trials, finished or running anywhere, reach its size
    (a worker never starts a trial the others already fill)."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __call__(self, study: optuna.Study, trial: FrozenTrial) -> None:
        if _taken(study) >= self.size:
            study.stop()


def _settle_running(spec: TuneSpec, study: optuna.Study, progress: Progress | None) -> None:
    """Trials RUNNING when this worker starts belong to a live worker or to one that was
    killed. Wait until each finishes or misses its heartbeats for the grace period (then it is
    failed and queued again with the same knobs, `open_storage`), so a study restarted at once
    after a kill still re-runs the killed trial; a trial still beating after that is a live
    worker's, and counts toward the size."""
    if spec.trials is None:
        return
    running = {t.number for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))}
    if not running:
        return
    wait_s = 3 * spec.heartbeat_s  # the grace period (2 beats) and one more beat
    if progress is not None:
        progress.note(f"fairgate tune: trial(s) {', '.join(f'#{n}' for n in sorted(running))} "
                      f"running (another worker's, or a killed one's): waiting up to {wait_s} s "
                      "for their heartbeats")
    deadline = time.monotonic() + wait_s
    while True:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            optuna.storages.fail_stale_trials(study)
        still = running & {t.number for t in study.get_trials(
            deepcopy=False, states=(TrialState.RUNNING,))}
        if not still or time.monotonic() > deadline:
            break
        time.sleep(min(0.5, spec.heartbeat_s / 4))
    ended = running - still
    if progress is not None and ended:
        progress.note(f"fairgate tune: trial(s) {', '.join(f'#{n}' for n in sorted(ended))} "
                      "ended or stopped beating; one that stopped runs again with its knobs")


WORKER_START_S = 120.0  # how long the first worker waits for the others to load the study


def _start_workers(spec: TuneSpec) -> list[Any]:
    """Workers 1..N-1 as processes (spawned: no state shared but the storage). Returns once
    each has loaded the study (or WORKER_START_S passed), so all start sampling together."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    ready = [context.Event() for _ in range(1, spec.workers)]
    children = [context.Process(target=_worker_main, args=(spec, worker, ready[worker - 1]),
                                daemon=True, name=f"fairgate-tune-worker-{worker}")
                for worker in range(1, spec.workers)]
    for child in children:
        child.start()
    for child, event in zip(children, ready, strict=True):
        deadline = time.monotonic() + WORKER_START_S
        while not event.wait(0.1) and child.is_alive() and time.monotonic() < deadline:
            pass
    return children


def _join_workers(children: Sequence[Any]) -> int:
    for child in children:
        child.join()
    return sum(child.exitcode != 0 for child in children)


def _worker_main(spec: TuneSpec, worker: int, ready: Any) -> None:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    runner = _runner(spec, worker)
    prepared = runner.prepare(spec.base)
    study = optuna.load_study(study_name=spec.study_name, storage=open_storage(spec))
    ready.set()
    _optimize(spec, study, runner, prepared, worker, progress=None)


def _default_params(spec: TuneSpec, prepared: EngineConfig) -> dict[str, Any]:
    """The base config's values of the space's knobs; an unset max_model_len is the user's
    model's context length when known, else the runner's."""
    config = build_config(spec.base, {})
    if config.max_model_len is None:
        config = build_config(prepared, {})
    return spec.space.values_of(config)


def vllm_grid(spec: TuneSpec, prepared: EngineConfig) -> list[tuple[str, dict[str, Any]]]:
    """vLLM auto_tune's default grid as trials of this space: its max_num_seqs x
    max_num_batched_tokens pairs, max_model_len as the base config has it (auto_tune takes
    it as an input), and memory_fraction probed the way auto_tune does, from 0.98 down until
    the engine starts. The probe needs the simulator's memory model; against a real server
    (replay, launch) the grid keeps the base config's memory_fraction."""
    defaults = _default_params(spec, prepared)
    grid = []
    for seqs, tokens in VLLM_GRID:
        params = {**defaults, "max_num_seqs": seqs, "max_num_batched_tokens": tokens}
        if "memory_fraction" in spec.space and prepared.executor == "sim":
            params["memory_fraction"] = _probe_memory_fraction(prepared, params)
        grid.append((f"vllm-grid {seqs}x{tokens}", params))
    return grid


def _probe_memory_fraction(prepared: EngineConfig, params: dict[str, Any]) -> float:
    from engine.sim import SimExecutor

    for fraction in VLLM_MEMORY_PROBE:
        try:
            config = build_config(prepared, {**params, "memory_fraction": fraction})
            SimExecutor(config).plan_kv_capacity(config)
        except ValueError:
            continue
        return fraction
    return VLLM_MEMORY_PROBE[-1]  # starts nowhere: the trial records why


@dataclass(frozen=True)
class Scored:
    """A config's result on one set of requests."""

    value: float  # the objective (pareto: output tokens/s)
    measures: TrialMeasures
    missed: str | None  # why it missed the SLOs, None when it met both
    capacity: dict[str, Any] | None = None
    live: TrialMeasures | None = None  # shadow mode: the live side of the same requests


@dataclass(frozen=True)
class _Timings:
    """Timings as a TrialRun (the live side of a shadow trial)."""

    timings: list[RequestTiming]
    elapsed_s: float
    stopped: str | None = None
    wall_s: float = 0.0


class _Evaluator:
    """The objective: one trial, never raising for a config that cannot run."""

    def __init__(self, spec: TuneSpec, runner: TrialRunner, prepared: EngineConfig,
                 progress: Progress | None = None, worker: int = 0,
                 full_runs: bool = False) -> None:
        self.spec, self.runner, self.prepared = spec, runner, prepared
        self.progress, self.worker = progress, worker
        self.stop = early_stop(len(spec.requests), spec.slo)
        # re-checks compare figures between sources: every request runs, none is cut off
        self.full_runs = full_runs

    def __call__(self, trial: optuna.Trial) -> float | tuple[float, float]:
        _beat(trial)
        trial.set_user_attr("objective", "shadow" if self.spec.mode == "shadow"
                            else self.spec.objective)
        trial.set_user_attr("worker", self.worker)
        params = self.spec.space.suggest(trial)
        if self.progress is not None:
            self.progress.start(trial.number, ", ".join(f"{k}={_knob(v)}"
                                                        for k, v in params.items()))
        try:
            config = self.config(params)
        except ValueError as exc:
            return self._not_run(trial, f"not run: {exc}")
        try:
            scored = self.score(config, self.spec.requests)
        except ValueError as exc:
            return self._not_run(trial, f"did not start: {exc}")
        if scored.capacity is not None:
            trial.set_user_attr("capacity", scored.capacity)
        if scored.live is not None:
            trial.set_user_attr("live_measures", _json_safe(dataclasses.asdict(scored.live)))
        _record(trial, scored.measures, self.spec.slo, scored.missed)
        if self.spec.multi_objective:
            return scored.value, min(scored.measures.p99_ttft_s, VIOLATION_CAP)
        return scored.value

    def config(self, params: dict[str, Any]) -> EngineConfig:
        build_config(self.spec.base, params)  # what best.yaml would hold must load too
        return build_config(self.prepared, params)

    def score(self, config: EngineConfig, requests: Sequence[TraceRequest]) -> Scored:
        """The objective of `config` on `requests`; ValueError when it cannot start."""
        if self.spec.objective == "capacity":
            return self._capacity(config, requests)
        run = self.runner.run(config, requests, self._stop_for(requests))
        measures = measure(run, len(requests), self.spec.slo, self.spec.seed)
        missed = run.stopped or measures.missed(self.spec.slo)
        live_timings = getattr(run, "live_timings", None)
        if live_timings is not None:  # shadow mode: against the live engine, same requests
            live = measure(_Timings(live_timings, run.elapsed_s), len(requests), self.spec.slo,
                           self.spec.seed)
            return Scored(measures.good_fraction - live.good_fraction, measures, missed,
                          live=live)
        value = (measures.output_tokens_per_s if self.spec.multi_objective
                 else measures.goodput_rps)
        return Scored(value, measures, missed)

    def _stop_for(self, requests: Sequence[TraceRequest]) -> StopRule:
        if self.full_runs:
            return _never_stop
        return self.stop if requests is self.spec.requests else early_stop(
            len(requests), self.spec.slo)

    def _not_run(self, trial: optuna.Trial, reason: str) -> float | tuple[float, float]:
        _not_run(trial, reason)
        return (0.0, VIOLATION_CAP) if self.spec.multi_objective else 0.0

    def _replay(self, config: EngineConfig,
                requests: Sequence[TraceRequest]) -> tuple[TrialMeasures, str | None]:
        """The run's measures and why it missed the SLOs (None when it met both)."""
        run = self.runner.run(config, requests, self._stop_for(requests))
        measures = measure(run, len(requests), self.spec.slo, self.spec.seed)
        return measures, run.stopped or measures.missed(self.spec.slo)

    def _capacity(self, config: EngineConfig, requests: Sequence[TraceRequest]) -> Scored:
        """The SLOs are inside the objective: a config that holds at some rate is feasible."""
        misses: list[tuple[TrialMeasures, str]] = []

        def probe(factor: float) -> TrialMeasures | None:
            measures, missed = self._replay(config, scale_arrivals(requests, factor))
            if missed is not None:
                misses.append((measures, missed))
                return None
            return measures

        search = search_capacity(probe)
        workload_rate = mean_rate(requests)
        capacity = search.factor * workload_rate
        found = {"rate_rps": capacity, "factor": search.factor, "probes": len(search.probes),
                 "workload_rate_rps": workload_rate}
        if search.at is None:
            measures, missed = misses[-1]
            lowest = search.probes[-1][0]
            return Scored(capacity, measures, f"misses the SLOs even at {lowest:.3g}x the "
                          f"workload's rate ({lowest * workload_rate:.3g} req/s): {missed}",
                          found)
        return Scored(capacity, search.at, None, found)


def _never_stop(finished: list[RequestTiming]) -> str | None:
    return None


def _beat(trial: optuna.Trial) -> None:
    """The trial's first heartbeat, now: Optuna's heartbeat thread records it asynchronously,
    and a worker killed before that leaves a trial no heartbeat check ever finds stale (never
    retried, RUNNING forever). Optuna has no public handle for this (study and trial id)."""
    storage = trial.study._storage
    if isinstance(storage, optuna.storages.RDBStorage) and storage.get_heartbeat_interval():
        storage.record_heartbeat(trial._trial_id)


def _record(trial: optuna.Trial, measures: TrialMeasures, slo: SLO, missed: str | None) -> None:
    trial.set_user_attr("ran", True)
    trial.set_user_attr("measures", _json_safe(dataclasses.asdict(measures)))
    _set_constraints(trial, measures.violations(slo))
    trial.set_user_attr("infeasible", missed)


def _not_run(trial: optuna.Trial, reason: str) -> None:
    trial.set_user_attr("ran", False)
    _set_constraints(trial, [VIOLATION_CAP, VIOLATION_CAP])
    trial.set_user_attr("infeasible", " ".join(reason.split()))


def _set_constraints(trial: optuna.Trial, violations: Sequence[float]) -> None:
    for name, value in zip(CONSTRAINTS, violations, strict=True):
        trial.set_constraint(name, value)


def _json_safe(value: Any) -> Any:
    """inf and NaN as None: Optuna's storages keep user attributes as JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


# ----------------------------------------------------------------------------- robustness


def _robustness(spec: TuneSpec, study: optuna.Study, runner: TrialRunner,
                prepared: EngineConfig, progress: Progress | None) -> list[Robustness]:
    """The top `spec.robust_top` feasible configs on every variant of the workload. Results
    are kept in the study (user attribute "robustness"), so a resumed study re-runs only
    configs it has not checked yet."""
    if not spec.variants or spec.robust_top <= 0:
        return []
    rows = [TrialRow.of(t) for t in study.get_trials(deepcopy=False)]
    # pareto: only points of the front, so the recommendation is never a dominated config
    pool = pareto_front(rows) if spec.multi_objective else rows
    top = _distinct(sorted((r for r in pool if r.feasible and r.value is not None),
                           key=lambda r: (-(r.value or 0.0), r.number)))[:spec.robust_top]
    known = study.user_attrs.get("robustness", {})
    labels = [v.label for v in spec.variants]
    evaluator = _Evaluator(spec, runner, prepared)
    for i, row in enumerate(top):
        entry = known.get(str(row.number))
        if entry is not None and sorted(entry["values"]) == sorted(labels):
            continue
        values, missed = {}, {}
        for variant in spec.variants:
            try:
                scored = evaluator.score(evaluator.config(row.params), variant.requests)
            except ValueError as exc:
                values[variant.label], missed[variant.label] = 0.0, f"did not start: {exc}"
                continue
            values[variant.label] = scored.value
            if scored.missed is not None:
                missed[variant.label] = scored.missed
        known[str(row.number)] = {"values": values, "missed": missed}
        study.set_user_attr("robustness", known)
        if progress is not None:
            worst = min([row.value or 0.0, *values.values()])
            progress.note(f"robustness {i + 1}/{len(top)} (#{row.number}): worst case "
                     f"{worst:.4g} {OBJECTIVE_UNIT[spec.objective]} over "
                     f"{len(values)} variants" + (f", missed the SLOs on {', '.join(missed)}"
                                                 if missed else ""))
    return [Robustness(r.number, r.value or 0.0, known[str(r.number)]["values"],
                       known[str(r.number)]["missed"]) for r in top]


def _distinct(rows: Sequence[TrialRow]) -> list[TrialRow]:
    """The first row of each set of knobs (a retried or re-suggested config counts once)."""
    seen: set[str] = set()
    out = []
    for row in rows:
        key = json.dumps(row.params, sort_keys=True)
        if key not in seen:
            seen.add(key)
            out.append(row)
    return out


def recommend(rows: Sequence[TrialRow], robustness: Sequence[Robustness]) -> TrialRow | None:
    """The best worst case over the robustness re-runs (fewest variants missed first), or
    without re-runs the study's best trial."""
    if not robustness:
        return best_row(rows)
    chosen = max(robustness, key=lambda r: (r.key(), -r.number))
    return next(r for r in rows if r.number == chosen.number)


def best_row(rows: Sequence[TrialRow]) -> TrialRow | None:
    feasible = [r for r in rows if r.feasible and r.value is not None]
    return max(feasible, key=lambda r: (r.value, -r.number), default=None)


def pareto_front(rows: Sequence[TrialRow]) -> list[TrialRow]:
    """Feasible trials no other feasible trial beats on both output tokens/s and p99 TTFT,
    by ascending p99 TTFT (one per set of knobs)."""
    points = [(r, float(r.measures.get("output_tokens_per_s") or 0.0),
               float(r.measures["p99_ttft_s"])) for r in rows
              if r.feasible and r.measures is not None and r.measures.get("p99_ttft_s")
              is not None]
    front = [r for r, tps, ttft in points if not any(
        t2 >= tps and f2 <= ttft and (t2 > tps or f2 < ttft) for _, t2, f2 in points)]
    return sorted(_distinct(front), key=lambda r: (r.measures or {})["p99_ttft_s"])


# ----------------------------------------------------------------------------- progress


class _ProgressLine:
    """Each finished trial to the progress bar: its result and the study's best so far."""

    def __init__(self, spec: TuneSpec, progress: Progress) -> None:
        self.progress = progress

    def __call__(self, study: optuna.Study, trial: FrozenTrial) -> None:
        rows = [TrialRow.of(t) for t in study.get_trials(deepcopy=False, states=(
            TrialState.COMPLETE,))]
        best = best_row(rows)
        best_text = (f"best {value_text(best)} (#{best.number})" if best is not None
                     else "no feasible trial yet")
        self.progress.done = len(rows) - 1  # the study's, every worker's: finish adds this one
        self.progress.finish(trial.number, describe_result(TrialRow.of(trial)), best_text)


def _knob(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def describe_result(row: TrialRow) -> str:
    if row.state != "COMPLETE":
        return row.state.lower()
    if not row.ran:
        return f"infeasible ({row.infeasible})"
    m = row.measures or {}
    at = " at that rate" if row.capacity is not None else ""
    text = (f"{value_text(row)}, p99 TTFT {_s(m.get('p99_ttft_s'))}, "
            f"p99 ITL {_s(m.get('p99_itl_s'))}{at}")
    return text + (f", infeasible ({row.infeasible})" if row.infeasible else ", feasible")


def value_text(row: TrialRow) -> str:
    """The objective's value for people: 'goodput 9.2 req/s', 'throughput 812 tok/s' or
    'capacity 23.4 req/s (2.55x the workload's rate, 9 probes)'."""
    value = row.value or 0.0
    if row.capacity is not None:
        return (f"capacity {value:.4g} req/s ({row.capacity['factor']:.3g}x the workload's "
                f"rate, {row.capacity['probes']} probes)")
    if row.objective == "pareto":
        return f"throughput {value:.4g} tok/s"
    if row.objective == "shadow":
        return f"SLO attainment {value:+.3f} against live"
    return f"{row.objective} {value:.4g} {OBJECTIVE_UNIT.get(row.objective, 'req/s')}"


def _s(seconds: float | None) -> str:
    """Seconds for people; None (an infinite p99: a failed request) as 'inf'."""
    if seconds is None or not math.isfinite(seconds):
        return "inf"
    return f"{seconds * 1000:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"
