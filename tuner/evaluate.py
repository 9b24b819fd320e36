"""The objective: one config scored on one set of requests, and one trial recorded.

How infeasible trials reach Optuna: a trial is never pruned. A config known to be impossible
before running (an `EngineConfig` rule, the model's context length), or one the runner cannot
start (too little simulated memory), completes with goodput 0 and the largest violation of every
constraint, so TPE learns the region is bad; `user_attrs["infeasible"]` says why and
`user_attrs["ran"]` is False. A run stops early once more requests missed a target than its
error budget allows (1% of the planned requests for p99): it can no longer meet that p99.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import optuna
from optuna.storages._heartbeat import BaseHeartbeat, is_heartbeat_enabled
from optuna.study._constrained_optimization import _CONSTRAINTS_KEY

from engine.config import EngineConfig
from protocol.measures import SLO
from protocol.stats import bootstrap_interval
from tuner.capacity import MAX_FACTOR, mean_rate, scale_arrivals, search_capacity
from tuner.measures import (
    VIOLATION_CAP,
    StopRule,
    TrialMeasures,
    TrialRun,
    allowed_misses,
    constraint_names,
    early_stop,
    measure,
    never_stop,
    slo_targets,
)
from tuner.outcome import knob_text
from tuner.progress import Progress
from tuner.runners import Timings, TrialRunner
from tuner.space import build_config
from tuner.spec import TuneSpec
from tuner.traces import TraceRequest


@dataclass(frozen=True)
class Scored:
    """A config's result on one set of requests."""

    value: float  # the objective (pareto: output tokens/s)
    measures: TrialMeasures
    missed: str | None  # why it missed the SLOs, None when it met them
    capacity: dict[str, Any] | None = None
    live: TrialMeasures | None = None  # shadow mode: the live side of the same requests
    interval: tuple[float, float] | None = None  # the objective's 95% interval, when asked


class Evaluator:
    """The objective: one trial, never raising for a config that cannot run."""

    def __init__(self, spec: TuneSpec, runner: TrialRunner, prepared: EngineConfig,
                 progress: Progress | None = None, worker: int = 0,
                 full_runs: bool = False) -> None:
        self.spec, self.runner, self.prepared = spec, runner, prepared
        self.progress, self.worker = progress, worker
        self.stop = early_stop(spec.requests, spec.slo)
        # re-checks compare figures between sources: every request runs, none is cut off
        self.full_runs = full_runs

    def __call__(self, trial: optuna.Trial) -> float | tuple[float, float]:
        _beat(trial)
        trial.set_user_attr("objective", "shadow" if self.spec.mode == "shadow"
                            else self.spec.objective)
        trial.set_user_attr("worker", self.worker)
        params = self.spec.space.suggest(trial)
        if self.progress is not None:
            self.progress.start(trial.number, ", ".join(f"{k}={knob_text(v)}"
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
            trial.set_user_attr("live_measures", nonfinite_as_none(dataclasses.asdict(scored.live)))
        record_measures(trial, scored.measures, self.spec.slo, scored.missed)
        if scored.missed is None and self.spec.objective != "capacity":
            # capacity sits at the SLO by construction; its interval carries the doubt
            trial.set_user_attr("uncertain", scored.measures.uncertain(self.spec.slo))
        if self.spec.multi_objective:
            return scored.value, min(scored.measures.p99_ttft_s, VIOLATION_CAP)
        return scored.value

    def config(self, params: dict[str, Any]) -> EngineConfig:
        build_config(self.spec.base, params)  # what best.yaml would hold must load too
        return build_config(self.prepared, params)

    def score(self, config: EngineConfig, requests: Sequence[TraceRequest],
              interval: bool = False) -> Scored:
        """The objective of `config` on `requests`, with its interval when `interval`;
        ValueError when it cannot start."""
        if self.spec.objective == "capacity":
            return self._capacity(config, requests, interval)
        measures, missed, run = self._replay(config, requests)
        live_timings = getattr(run, "live_timings", None)
        if live_timings is not None:  # shadow mode: against the live engine, same requests
            live = measure(Timings(live_timings, run.elapsed_s), len(requests), self.spec.slo)
            return Scored(measures.good_fraction - live.good_fraction, measures, missed,
                          live=live)
        if self.spec.multi_objective:
            return Scored(measures.output_tokens_per_s, measures, missed,
                          interval=_tokens_interval(run) if interval else None)
        return Scored(measures.goodput_rps, measures, missed,
                      interval=_goodput_interval(measures) if interval else None)

    def _stop_for(self, requests: Sequence[TraceRequest]) -> StopRule:
        if self.full_runs:
            return never_stop
        return self.stop if requests is self.spec.requests else early_stop(
            requests, self.spec.slo)

    def _not_run(self, trial: optuna.Trial, reason: str) -> float | tuple[float, float]:
        record_not_run(trial, reason, self.spec.slo)
        return (0.0, VIOLATION_CAP) if self.spec.multi_objective else 0.0

    def _replay(self, config: EngineConfig, requests: Sequence[TraceRequest]
                ) -> tuple[TrialMeasures, str | None, TrialRun]:
        """The run's measures and why it missed the SLOs (None when it met them): the
        requests the engine refused first, since an early stop they cause reads as misses."""
        run = self.runner.run(config, requests, self._stop_for(requests))
        measures = measure(run, len(requests), self.spec.slo)
        missed = measures.missed(self.spec.slo)
        if run.stopped is not None:
            refusal = measures.refusal_text()
            missed = f"{refusal}; {run.stopped}" if refusal else run.stopped
        return measures, missed, run

    def _capacity(self, config: EngineConfig, requests: Sequence[TraceRequest],
                  interval: bool) -> Scored:
        """The SLOs are inside the objective: a config that holds at some rate is feasible."""
        probes: dict[float, tuple[TrialMeasures, str | None]] = {}

        def probe(factor: float) -> TrialMeasures | None:
            measures, missed, _ = self._replay(config, scale_arrivals(requests, factor))
            probes[factor] = (measures, missed)
            return measures if missed is None else None

        search = search_capacity(probe)
        workload_rate = mean_rate(requests)
        capacity = search.factor * workload_rate
        found: dict[str, Any] = {"rate_rps": capacity, "factor": search.factor,
                                 "probes": len(search.probes), "workload_rate_rps": workload_rate}
        if search.at is None:
            lowest = search.probes[-1][0]
            measures, missed = probes[lowest]
            return Scored(capacity, measures, f"misses the SLOs even at {lowest:.3g}x the "
                          f"workload's rate ({lowest * workload_rate:.3g} req/s): {missed}",
                          found, interval=(0.0, 0.0) if interval else None)
        bounds = None
        if interval:
            low, high = capacity_bounds(probe, probes, search.factor, self.spec.slo)
            bounds = (low * workload_rate, high * workload_rate)
            found["interval_rps"] = list(bounds)
        return Scored(capacity, search.at, None, found, interval=bounds)


CI_PROBES = 3  # extra probes, each way, to find a rate the SLOs surely hold or surely miss at
CI_STEP = 1.15


def capacity_bounds(probe: Callable[[float], TrialMeasures | None],
                    probes: dict[float, tuple[TrialMeasures, str | None]], factor: float,
                    slo: SLO) -> tuple[float, float]:
    """The interval of a capacity `factor` found by `search_capacity`, by inverting the p99s'
    intervals: its low end is the highest rate probed at which every p99's interval lies under
    its target (surely held), its high end the lowest at which some p99's interval lies over
    its target, or a request was refused or cut off (surely missed). Up to CI_PROBES more
    probes each way, CI_STEP apart, then CI_PROBES more, each twice as far, find them when the
    search's own probes do not; a low end still not found is 0, a high end the search's
    highest factor (MAX_FACTOR)."""
    def surely_met(m: TrialMeasures) -> bool:
        return not m.failed and all(m.interval(n)[1] <= t for n, t in slo_targets(slo))

    def surely_missed(m: TrialMeasures) -> bool:
        return m.failed > allowed_misses(m.requests, m.target) or any(
            m.interval(n)[0] > t for n, t in slo_targets(slo))

    def bound(sure: Callable[[TrialMeasures], bool], side: Callable[[float], bool],
              pick: Callable[..., float], step: float, unproven: float) -> float:
        found = [f for f, (m, _) in probes.items() if side(f) and sure(m)]
        edge = factor
        for i in range(2 * CI_PROBES):  # CI_STEP apart, then twice as far each time
            if found:
                break
            edge *= step if i < CI_PROBES else step ** (2 ** (i - CI_PROBES + 1))
            probe(edge)
            if sure(probes[edge][0]):
                found.append(edge)
        return pick(found) if found else unproven

    low = bound(surely_met, lambda f: f <= factor, max, 1 / CI_STEP, 0.0)
    high = bound(surely_missed, lambda f: f > factor, min, CI_STEP, MAX_FACTOR)
    return min(low, factor), max(high, factor)


def _goodput_interval(m: TrialMeasures) -> tuple[float, float]:
    """Goodput's 95% interval: the Wilson interval of the share of requests that met the
    SLOs, times the run's rate of requests."""
    rate = m.requests / m.elapsed_s if m.elapsed_s > 0 else 0.0
    low, high = wilson(round(m.good_fraction * m.requests), m.requests)
    return low * rate, high * rate


def wilson(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a proportion."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def _tokens_interval(run: TrialRun, resamples: int = 200) -> tuple[float, float]:
    """Output tokens/s's 95% interval, by bootstrap over the run's requests."""
    tokens = [t.num_output_tokens if t.ok else 0 for t in run.timings]
    if not tokens or run.elapsed_s <= 0:
        return 0.0, 0.0
    return bootstrap_interval(lambda rows: rows.sum(axis=1) / run.elapsed_s, tokens,
                              resamples=resamples)


def heartbeats(study: optuna.Study) -> BaseHeartbeat | None:
    """The study's storage where it keeps heartbeats, else None. (A study holds its RDB storage
    behind Optuna's cache, which is no RDBStorage but beats through to it.)"""
    storage = study._storage
    return storage if is_heartbeat_enabled(storage) else None  # type: ignore[return-value]


ORPHAN_BEAT = "fairgate_orphan_beat"  # a trial given its one heartbeat by beat_orphans


def beat_orphans(study: optuna.Study, now: datetime.datetime | None = None) -> None:
    """Give one heartbeat to each RUNNING trial that has none: its worker was killed while the
    sampler chose its knobs, before the objective's first beat (`_beat`), and Optuna never
    finds a trial without heartbeats stale. Such a trial is older than the grace period (by
    `now`, default the clock) and still lacks the attributes the objective sets right after
    its beat; it is beaten once only (one killed between its beat and those attributes is not
    kept alive), so it goes stale and is failed and re-run like any killed trial."""
    storage = heartbeats(study)
    interval = storage.get_heartbeat_interval() if storage is not None else None
    if storage is None or not interval:
        return
    oldest = (now or datetime.datetime.now()) - datetime.timedelta(seconds=2 * interval)
    for trial in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        started = trial.datetime_start
        if ("objective" not in trial.user_attrs and ORPHAN_BEAT not in trial.system_attrs
                and started is not None and started < oldest):
            study._storage.set_trial_system_attr(trial._trial_id, ORPHAN_BEAT, True)
            storage.record_heartbeat(trial._trial_id)


def _beat(trial: optuna.Trial) -> None:
    """The trial's first heartbeat, now: Optuna's heartbeat thread records it asynchronously,
    and a worker killed before that leaves a trial no heartbeat check ever finds stale (never
    retried, RUNNING forever). Optuna has no public handle for this (study and trial id)."""
    storage = heartbeats(trial.study)
    if storage is not None:
        storage.record_heartbeat(trial._trial_id)


def record_measures(trial: optuna.Trial, measures: TrialMeasures, slo: SLO,
                    missed: str | None) -> None:
    trial.set_user_attr("ran", True)
    trial.set_user_attr("measures", nonfinite_as_none(dataclasses.asdict(measures)))
    _set_constraints(trial, measures.violations(slo), slo)
    trial.set_user_attr("infeasible", missed)


def record_not_run(trial: optuna.Trial, reason: str, slo: SLO) -> None:
    trial.set_user_attr("ran", False)
    _set_constraints(trial, [VIOLATION_CAP] * len(constraint_names(slo)), slo)
    trial.set_user_attr("infeasible", " ".join(reason.split()))


def _set_constraints(trial: optuna.Trial, violations: Sequence[float], slo: SLO) -> None:
    """Named for people (`set_constraint`), and as the plain list under Optuna's
    "constraints" system attribute, the one form optuna-dashboard reads (without it every
    trial shows as feasible there)."""
    for name, value in zip(constraint_names(slo), violations, strict=True):
        trial.set_constraint(name, value)
    trial.storage.set_trial_system_attr(trial._trial_id, _CONSTRAINTS_KEY,
                                        [float(v) for v in violations])


def nonfinite_as_none(value: Any) -> Any:
    """`value` with every inf and NaN in it as None: Optuna's storages keep user attributes as
    JSON. (Not tenants.ledger's dead-letter values, which keep a bad number as text.)"""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: nonfinite_as_none(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [nonfinite_as_none(v) for v in value]
    return value

