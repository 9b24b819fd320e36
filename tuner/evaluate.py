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
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import optuna

from engine.config import EngineConfig
from protocol.measures import SLO
from tuner.capacity import mean_rate, scale_arrivals, search_capacity
from tuner.measures import (
    CONSTRAINTS,
    VIOLATION_CAP,
    StopRule,
    TrialMeasures,
    early_stop,
    measure,
    never_stop,
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
    missed: str | None  # why it missed the SLOs, None when it met both
    capacity: dict[str, Any] | None = None
    live: TrialMeasures | None = None  # shadow mode: the live side of the same requests


class Evaluator:
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
            trial.set_user_attr("live_measures", json_safe(dataclasses.asdict(scored.live)))
        record_measures(trial, scored.measures, self.spec.slo, scored.missed)
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
            live = measure(Timings(live_timings, run.elapsed_s), len(requests), self.spec.slo,
                           self.spec.seed)
            return Scored(measures.good_fraction - live.good_fraction, measures, missed,
                          live=live)
        value = (measures.output_tokens_per_s if self.spec.multi_objective
                 else measures.goodput_rps)
        return Scored(value, measures, missed)

    def _stop_for(self, requests: Sequence[TraceRequest]) -> StopRule:
        if self.full_runs:
            return never_stop
        return self.stop if requests is self.spec.requests else early_stop(
            len(requests), self.spec.slo)

    def _not_run(self, trial: optuna.Trial, reason: str) -> float | tuple[float, float]:
        record_not_run(trial, reason)
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


def _beat(trial: optuna.Trial) -> None:
    """The trial's first heartbeat, now: Optuna's heartbeat thread records it asynchronously,
    and a worker killed before that leaves a trial no heartbeat check ever finds stale (never
    retried, RUNNING forever). Optuna has no public handle for this (study and trial id)."""
    storage = trial.study._storage
    if isinstance(storage, optuna.storages.RDBStorage) and storage.get_heartbeat_interval():
        storage.record_heartbeat(trial._trial_id)


def record_measures(trial: optuna.Trial, measures: TrialMeasures, slo: SLO, missed: str | None) -> None:
    trial.set_user_attr("ran", True)
    trial.set_user_attr("measures", json_safe(dataclasses.asdict(measures)))
    _set_constraints(trial, measures.violations(slo))
    trial.set_user_attr("infeasible", missed)


def record_not_run(trial: optuna.Trial, reason: str) -> None:
    trial.set_user_attr("ran", False)
    _set_constraints(trial, [VIOLATION_CAP, VIOLATION_CAP])
    trial.set_user_attr("infeasible", " ".join(reason.split()))


def _set_constraints(trial: optuna.Trial, violations: Sequence[float]) -> None:
    for name, value in zip(CONSTRAINTS, violations, strict=True):
        trial.set_constraint(name, value)


def json_safe(value: Any) -> Any:
    """inf and NaN as None: Optuna's storages keep user attributes as JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value

