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
time, over HTTP; their early stop is applied after the run); a shadow runner implements the
same `TrialRunner` protocol.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import math
import os
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import optuna
import yaml
from optuna.trial import FrozenTrial, TrialState

from engine.config import EngineConfig
from protocol.measures import SLO, RequestTiming, error_budget, goodput
from protocol.validators import check_choice, check_number
from tuner.capacity import mean_rate, scale_arrivals, search_capacity
from tuner.space import Space, build_config
from tuner.traces import TraceRequest

MODES = ("sim", "replay", "launch", "shadow")
OBJECTIVES = ("goodput", "capacity", "pareto")
BUILT_OBJECTIVES = ("goodput", "capacity")
OBJECTIVE_TEXT = {"goodput": "requests/s meeting both SLOs at the workload's own rate",
                  "capacity": "the highest arrival rate, requests/s, at which both p99s hold"}
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


RUNNERS: dict[str, Callable[[RunnerOptions], TrialRunner]] = {
    "sim": SimRunner, "replay": _replay_runner, "launch": _launch_runner}


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
    trials: int | None = 30
    timeout_s: float | None = None
    seed: int = 0
    workload: str = ""  # how the requests were made, for the report
    runner: RunnerOptions = RunnerOptions()

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

    def fingerprint(self, prepared_base: EngineConfig) -> dict[str, Any]:
        """What a resumed study must agree on (JSON-shaped, as Optuna stores it)."""
        value = {"mode": self.mode, "objective": self.objective,
                 "slo": [self.slo.ttft_s, self.slo.itl_s, self.slo.target],
                 "space": self.space.describe(), "requests": len(self.requests),
                 "workload": self.workload, "base": prepared_base.to_dict()}
        loaded: dict[str, Any] = json.loads(json.dumps(value))
        return loaded


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
    itl = quantile_ci([v for v in tpots if v is not None], slo.target, seed)
    good = goodput(timings, run.elapsed_s, slo)
    return TrialMeasures(p99_ttft_s=ttft[0], p99_ttft_ci=ttft[1], p99_itl_s=itl[0],
                         p99_itl_ci=itl[1], goodput_rps=good.requests_per_s,
                         good_fraction=good.requests / planned, requests=planned,
                         failed=sum(not t.ok for t in timings) + len(missing),
                         wall_s=run.wall_s)


def early_stop(planned: int, slo: SLO) -> StopRule:
    """Stop once more requests missed a target than the p99 allows of the planned ones."""
    allowed = planned - rank(planned, slo.target)

    def stop(finished: list[RequestTiming]) -> str | None:
        for name, meets in (("TTFT", RequestTiming.meets_ttft), ("ITL", RequestTiming.meets_tpot)):
            missed = sum(not meets(t, slo) for t in finished)
            if missed > allowed:
                return (f"stopped early: {missed} of {planned} requests missed the {name} SLO, "
                        f"more than the {error_budget(slo.target):.0%} a p99 allows")
        return None

    return stop


# ----------------------------------------------------------------------------- the study


@dataclass(frozen=True)
class TrialRow:
    """One trial as the outputs show it."""

    number: int
    state: str
    params: dict[str, Any]
    baseline: bool
    ran: bool
    measures: dict[str, Any] | None
    value: float | None  # the objective: goodput or capacity, requests/s
    infeasible: str | None
    capacity: dict[str, Any] | None = None  # rate_rps, factor, probes, workload_rate_rps

    @property
    def feasible(self) -> bool:
        return self.state == "COMPLETE" and self.infeasible is None

    @classmethod
    def of(cls, trial: FrozenTrial) -> TrialRow:
        attrs = trial.user_attrs
        return cls(number=trial.number, state=trial.state.name, params=dict(trial.params),
                   baseline=attrs.get("baseline") == "default", ran=bool(attrs.get("ran")),
                   measures=attrs.get("measures"), value=trial.value,
                   infeasible=attrs.get("infeasible"), capacity=attrs.get("capacity"))


@dataclass(frozen=True)
class StudyOutcome:
    study_name: str
    rows: list[TrialRow]
    best: TrialRow | None  # the feasible trial with the highest goodput
    default: TrialRow | None  # the base config's trial
    files: list[Path] = field(default_factory=list)


Progress = Callable[[str], None]


def run_study(spec: TuneSpec, progress: Progress | None = None) -> StudyOutcome:
    """Run `spec.trials` more trials (or until `spec.timeout_s`) of the study named in `spec`,
    creating it or resuming it, then write best.yaml, trials.csv and report.md."""
    runner = RUNNERS[spec.mode](dataclasses.replace(spec.runner, knobs=tuple(spec.space)))
    prepared = runner.prepare(spec.base)
    study = _open_study(spec, prepared)
    if progress is not None:
        earlier = len(study.get_trials(deepcopy=False)) - 1  # the enqueued default counts
        progress(f"fairgate tune: study {spec.study_name} on {spec.storage}"
                 + (f", resumed after {earlier} trials" if earlier > 0 else "")
                 + f"; {len(spec.requests)} requests per trial")
    evaluate = _Evaluator(spec, runner, prepared)
    callbacks = [_ProgressLine(spec, progress)] if progress is not None else []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        # the base config's values may lie outside a --space file's ranges: it runs as it is
        warnings.filterwarnings("ignore", "Fixed parameter .* is out of range", UserWarning)
        study.optimize(evaluate, n_trials=spec.trials, timeout=spec.timeout_s,
                       callbacks=callbacks, gc_after_trial=False)
    rows = [TrialRow.of(t) for t in study.get_trials(deepcopy=False)]
    outcome = StudyOutcome(spec.study_name, rows, best_row(rows),
                           next((r for r in rows if r.baseline), None))
    return dataclasses.replace(outcome, files=write_outputs(spec, outcome))


def _open_study(spec: TuneSpec, prepared: EngineConfig) -> optuna.Study:
    study = optuna.create_study(storage=optuna_storage_url(spec.storage),
                                study_name=spec.study_name, direction="maximize",
                                load_if_exists=True)
    fingerprint = spec.fingerprint(prepared)
    stored = study.user_attrs.get("spec")
    if stored is None:
        study.set_user_attr("spec", fingerprint)
    elif stored != fingerprint:
        differ = ", ".join(k for k in fingerprint if stored.get(k) != fingerprint[k])
        raise ValueError(f"study {spec.study_name!r} was made with a different {differ}; "
                         "resume it with the same options or pick a new --study name")
    # a resumed study reseeds past its trials, so it does not replay the first run's samples
    study.sampler = optuna.samplers.TPESampler(
        seed=spec.seed + len(study.get_trials(deepcopy=False)), multivariate=True)
    study.enqueue_trial(_default_params(spec, prepared), user_attrs={"baseline": "default"},
                        skip_if_exists=True)
    return study


def _default_params(spec: TuneSpec, prepared: EngineConfig) -> dict[str, Any]:
    """The base config's values of the space's knobs; an unset max_model_len is the user's
    model's context length when known, else the runner's."""
    config = build_config(spec.base, {})
    if config.max_model_len is None:
        config = build_config(prepared, {})
    return spec.space.values_of(config)


class _Evaluator:
    """The objective: one trial, never raising for a config that cannot run."""

    def __init__(self, spec: TuneSpec, runner: TrialRunner, prepared: EngineConfig) -> None:
        self.spec, self.runner, self.prepared = spec, runner, prepared
        self.stop = early_stop(len(spec.requests), spec.slo)
        self.objective = {"goodput": self._goodput, "capacity": self._capacity}[spec.objective]

    def __call__(self, trial: optuna.Trial) -> float:
        params = self.spec.space.suggest(trial)
        try:
            build_config(self.spec.base, params)  # what best.yaml would hold must load too
            config = build_config(self.prepared, params)
        except ValueError as exc:
            return _not_run(trial, f"not run: {exc}")
        try:
            return self.objective(trial, config)
        except ValueError as exc:
            return _not_run(trial, f"did not start: {exc}")

    def _replay(self, config: EngineConfig,
                requests: Sequence[TraceRequest]) -> tuple[TrialMeasures, str | None]:
        """The run's measures and why it missed the SLOs (None when it met both)."""
        run = self.runner.run(config, requests, self.stop)
        measures = measure(run, len(requests), self.spec.slo, self.spec.seed)
        return measures, run.stopped or measures.missed(self.spec.slo)

    def _goodput(self, trial: optuna.Trial, config: EngineConfig) -> float:
        measures, missed = self._replay(config, self.spec.requests)
        _record(trial, measures, self.spec.slo, missed)
        return measures.goodput_rps

    def _capacity(self, trial: optuna.Trial, config: EngineConfig) -> float:
        """The SLOs are inside the objective: a trial that holds at some rate is feasible."""
        misses: list[tuple[TrialMeasures, str]] = []

        def probe(factor: float) -> TrialMeasures | None:
            measures, missed = self._replay(config, scale_arrivals(self.spec.requests, factor))
            if missed is not None:
                misses.append((measures, missed))
                return None
            return measures

        search = search_capacity(probe)
        workload_rate = mean_rate(self.spec.requests)
        capacity = search.factor * workload_rate
        trial.set_user_attr("capacity", {"rate_rps": capacity, "factor": search.factor,
                                         "probes": len(search.probes),
                                         "workload_rate_rps": workload_rate})
        if search.at is None:
            measures, missed = misses[-1]
            lowest = search.probes[-1][0]
            _record(trial, measures, self.spec.slo, f"misses the SLOs even at {lowest:.3g}x the "
                    f"workload's rate ({lowest * workload_rate:.3g} req/s): {missed}")
        else:
            _record(trial, search.at, self.spec.slo, None)
        return capacity


def _record(trial: optuna.Trial, measures: TrialMeasures, slo: SLO, missed: str | None) -> None:
    trial.set_user_attr("ran", True)
    trial.set_user_attr("measures", _json_safe(dataclasses.asdict(measures)))
    _set_constraints(trial, measures.violations(slo))
    trial.set_user_attr("infeasible", missed)


def _not_run(trial: optuna.Trial, reason: str) -> float:
    trial.set_user_attr("ran", False)
    _set_constraints(trial, [VIOLATION_CAP, VIOLATION_CAP])
    trial.set_user_attr("infeasible", " ".join(reason.split()))
    return 0.0


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


def best_row(rows: Sequence[TrialRow]) -> TrialRow | None:
    feasible = [r for r in rows if r.feasible and r.value is not None]
    return max(feasible, key=lambda r: (r.value, -r.number), default=None)


class _ProgressLine:
    """One stderr line per trial: trial i/N, its result, best so far."""

    def __init__(self, spec: TuneSpec, progress: Progress) -> None:
        self.total = str(spec.trials) if spec.trials is not None else f"{spec.timeout_s:g} s"
        self.progress = progress
        self.done = 0

    def __call__(self, study: optuna.Study, trial: FrozenTrial) -> None:
        self.done += 1
        rows = [TrialRow.of(t) for t in study.get_trials(deepcopy=False, states=(
            TrialState.COMPLETE,))]
        best = best_row(rows)
        best_text = (f"best {value_text(best)} (#{best.number})" if best is not None
                     else "no feasible trial yet")
        self.progress(f"trial {self.done}/{self.total} (#{trial.number}): "
                      f"{describe_result(TrialRow.of(trial))} | {best_text}")


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
    """The objective's value for people: 'goodput 9.2 req/s' or
    'capacity 23.4 req/s (2.55x the workload's rate, 9 probes)'."""
    value = row.value or 0.0
    if row.capacity is None:
        return f"goodput {value:.4g} req/s"
    return (f"capacity {value:.4g} req/s ({row.capacity['factor']:.3g}x the workload's rate, "
            f"{row.capacity['probes']} probes)")


def _s(seconds: float | None) -> str:
    """Seconds for people; None (an infinite p99: a failed request) as 'inf'."""
    if seconds is None or not math.isfinite(seconds):
        return "inf"
    return f"{seconds * 1000:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


# ----------------------------------------------------------------------------- outputs


def write_outputs(spec: TuneSpec, outcome: StudyOutcome) -> list[Path]:
    """best.yaml (only when a trial met both SLOs), trials.csv and report.md in spec.out_dir;
    each file appears whole or not at all."""
    files = {"trials.csv": trials_csv(spec, outcome.rows), "report.md": report_md(spec, outcome)}
    if outcome.best is not None:
        files = {"best.yaml": best_yaml(spec, outcome), **files}
    spec.out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, text in files.items():
        path = spec.out_dir / name
        partial = path.with_name(f".{name}.partial")
        partial.write_text(text, encoding="utf-8")
        os.replace(partial, path)
        paths.append(path)
    return paths


def engine_section(base: EngineConfig, params: dict[str, Any]) -> dict[str, Any]:
    """The knobs `base` sets away from the defaults, plus the tuned ones."""
    config = base.replace(**params)
    defaults = EngineConfig().to_dict()
    return {k: v for k, v in config.to_dict().items() if k in params or v != defaults[k]}


def best_yaml(spec: TuneSpec, outcome: StudyOutcome) -> str:
    best = outcome.best
    assert best is not None
    m = best.measures or {}
    header = (f"# fairgate tune --mode {spec.mode}: study {outcome.study_name}, trial "
              f"#{best.number}\n# {value_text(best)}, p99 TTFT "
              f"{_s(m.get('p99_ttft_s'))} (SLO {_s(spec.slo.ttft_s)}), p99 ITL "
              f"{_s(m.get('p99_itl_s'))} (SLO {_s(spec.slo.itl_s)})\n")
    body = yaml.safe_dump({"engine": engine_section(spec.base, best.params)}, sort_keys=False)
    return header + body


CAPACITY_COLUMNS = ("factor", "probes")  # the rate factor at capacity, probes run to find it
CSV_MEASURES = ("p99_ttft_s", "p99_ttft_ci", "p99_itl_s", "p99_itl_ci", "good_fraction",
                "failed", "wall_s")


def trials_csv(spec: TuneSpec, rows: Sequence[TrialRow]) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    knobs = list(spec.space)
    capacity = spec.objective == "capacity"
    writer.writerow(["number", "state", "baseline", "ran", *knobs, f"{spec.objective}_rps",
                     *(CAPACITY_COLUMNS if capacity else ()), *CSV_MEASURES, "infeasible"])
    for row in rows:
        m = row.measures or {}
        writer.writerow([row.number, row.state, row.baseline, row.ran,
                         *(row.params.get(k, "") for k in knobs),
                         "" if row.value is None else f"{row.value:.6g}",
                         *(_cell((row.capacity or {}).get(name, "")) for name in
                           (CAPACITY_COLUMNS if capacity else ())),
                         *(_cell(m.get(name)) for name in CSV_MEASURES), row.infeasible or ""])
    return out.getvalue()


def _cell(value: Any) -> str:
    if isinstance(value, list):
        return "..".join(_cell(v) for v in value)
    if isinstance(value, float):
        return f"{value:.6g}"
    return "inf" if value is None else str(value)


def report_md(spec: TuneSpec, outcome: StudyOutcome, top: int = 10) -> str:
    rows = outcome.rows
    feasible = sorted((r for r in rows if r.feasible), key=lambda r: -(r.value or 0))
    lines = [f"# fairgate tune: study {outcome.study_name}", "",
             f"- mode: {spec.mode}; objective: {spec.objective} ({OBJECTIVE_TEXT[spec.objective]})",
             f"- workload: {spec.workload} ({len(spec.requests)} requests over "
             f"{spec.requests[-1].arrival:.1f} s)",
             f"- SLOs: p99 TTFT <= {_s(spec.slo.ttft_s)}, p99 ITL (TPOT) <= {_s(spec.slo.itl_s)}",
             "- space: " + ", ".join(f"{k} {v}" for k, v in spec.space.describe().items()),
             f"- trials: {len(rows)}, feasible: {len(feasible)}", ""]
    lines += _best_vs_default(spec, outcome)
    lines += ["", f"## Top {min(top, len(feasible))} feasible trials", ""]
    lines += _table(spec, feasible[:top])
    infeasible = [r for r in rows if not r.feasible]
    if infeasible:
        lines += ["", "## Infeasible trials", ""] + [
            f"- #{r.number}: {r.infeasible or r.state.lower()}" for r in infeasible]
    return "\n".join(lines) + "\n"


def _best_vs_default(spec: TuneSpec, outcome: StudyOutcome) -> list[str]:
    if outcome.best is None:
        return ["**No trial met both SLOs**: no best.yaml was written. Loosen the SLOs, widen "
                "the space or lower the rate."]
    shown = [r for r in (outcome.best, outcome.default) if r is not None]
    return ["## Best vs default", ""] + _table(spec, shown, names=("best", "default"))


def _table(spec: TuneSpec, rows: Sequence[TrialRow], names: Sequence[str] = ()) -> list[str]:
    knobs = list(spec.space)
    extra = CAPACITY_COLUMNS[:1] if spec.objective == "capacity" else ()  # the rate factor
    cols = [*([""] if names else []), "trial", *knobs, f"{spec.objective} req/s",
            *(f"rate {name}" for name in extra), "p99 TTFT (95% CI)", "p99 ITL (95% CI)",
            "result"]
    lines = ["| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
    for i, row in enumerate(rows):
        m = row.measures or {}
        label = [names[i]] if names else []
        cells = [*label, f"#{row.number}", *(str(row.params.get(k, "")) for k in knobs),
                 f"{row.value or 0:.4g}", *(_cell((row.capacity or {}).get(n)) for n in extra),
                 _with_ci(m, "p99_ttft"), _with_ci(m, "p99_itl"),
                 "feasible" if row.feasible else (row.infeasible or row.state.lower())]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _with_ci(m: dict[str, Any], name: str) -> str:
    if f"{name}_s" not in m:
        return "-"
    low, high = m.get(f"{name}_ci") or (None, None)
    return f"{_s(m[f'{name}_s'])} ({_s(low)}..{_s(high)})"
