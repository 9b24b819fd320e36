"""A trial's measures: pooled p99s with bootstrap intervals, and the early-stop rule.

p99 here is the nearest-rank order statistic, with a failed or refused request counted as an
infinite TTFT and TPOT: then "p99 <= SLO" holds exactly when at least 99% of the requests met
it, protocol.measures' SLO attainment definition (linear interpolation would let one failed
request in a hundred make the p99 infinite).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from protocol.measures import SLO, RequestTiming, error_budget, goodput

StopRule = Callable[[list[RequestTiming]], str | None]
VIOLATION_CAP = 1e6  # seconds: an infinite p99 (or a trial that never ran) as a finite violation
BOOTSTRAP_RESAMPLES = 200
CONSTRAINTS = ("p99_ttft", "p99_itl")  # p99 - SLO, seconds


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
        misses = [f"p99 TTFT {seconds_text(self.p99_ttft_s)} > {seconds_text(slo.ttft_s)}"] if ttft > 0 else []
        misses += [f"p99 ITL {seconds_text(self.p99_itl_s)} > {seconds_text(slo.itl_s)}"] if itl > 0 else []
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


def never_stop(finished: list[RequestTiming]) -> str | None:
    return None


def seconds_text(seconds: float | None) -> str:
    """Seconds for people; None (an infinite p99: a failed request) as 'inf'."""
    if seconds is None or not math.isfinite(seconds):
        return "inf"
    return f"{seconds * 1000:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"

