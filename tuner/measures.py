"""A trial's measures: pooled p99s with their intervals, and the early-stop rule.

p99 is protocol.stats' percentile (the nearest rank), with a failed or refused request counted
as an infinite TTFT and TPOT: then "p99 <= SLO" holds exactly when at least 99% of the requests
met it, protocol.measures' SLO attainment definition.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from protocol.measures import SLO, RequestTiming, error_budget, goodput
from protocol.stats import nearest_rank, percentile_interval, tail_samples
from tuner.traces import TraceRequest

StopRule = Callable[[list[RequestTiming]], str | None]
VIOLATION_CAP = 1e6  # seconds: an infinite p99 (or a trial that never ran) as a finite violation
CONSTRAINTS = ("p99_ttft", "p99_tpot", "p99_itl")  # p99 - SLO, seconds; those the SLO sets


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
    p99_tpot_s: float  # each request's TPOT
    p99_tpot_ci: tuple[float, float]
    p99_itl_s: float  # every gap between two tokens, pooled over the run's requests
    p99_itl_ci: tuple[float, float]
    goodput_rps: float
    good_fraction: float
    requests: int
    failed: int  # refused, failed or cut off by the early stop
    wall_s: float
    output_tokens_per_s: float = 0.0  # of every request that finished, met its SLOs or not
    engine_stats: dict[str, Any] | None = None  # replay/launch: the engine's own /stats window
    gaps: int = 0  # the gaps the ITL p99 pools
    refused: int = 0  # of `failed`: refused by the engine before running
    refused_because: str | None = None  # the engine's reason for the first refusal
    target: float = 0.99
    elapsed_s: float = 0.0  # the run's span, first arrival to last finish

    @property
    def tail_samples(self) -> float:
        """How many requests lie beyond the p99: the sample its estimate rests on."""
        return tail_samples(self.requests, 100 * self.target)

    def p99(self, name: str) -> float:
        """The p99 of one constraint ("p99_ttft", "p99_tpot", "p99_itl"), seconds."""
        value: float = getattr(self, f"{name}_s")
        return value

    def interval(self, name: str) -> tuple[float, float]:
        low, high = getattr(self, f"{name}_ci")
        return float(low), float(high)

    def violations(self, slo: SLO) -> list[float]:
        """p99 - target for each constraint `slo` sets (`constraint_names`), seconds."""
        return [min(self.p99(name) - target, VIOLATION_CAP)
                for name, target in slo_targets(slo)]

    def uncertain(self, slo: SLO) -> list[str]:
        """The constraints whose p99 interval straddles their target: met or missed by chance."""
        return [name for name, target in slo_targets(slo)
                if self.interval(name)[0] <= target < self.interval(name)[1]]

    def refusal_text(self) -> str | None:
        """'318 of 362 requests (88%) refused: <the engine's reason>', or None."""
        if not self.refused:
            return None
        because = f": {self.refused_because}" if self.refused_because else ""
        return (f"{self.refused} of {self.requests} requests "
                f"({self.refused / self.requests:.0%}) refused{because}")

    def missed(self, slo: SLO) -> str | None:
        """Why the run missed its SLOs, its real cause first: the requests the engine refused,
        then each p99 over its target and by how much; None when it met them all."""
        misses = [f"{CONSTRAINT_TEXT[name]} {seconds_text(self.p99(name))} > "
                  f"{seconds_text(target)} ({margin_text(self.p99(name), target)})"
                  for (name, target), over in zip(slo_targets(slo), self.violations(slo),
                                                  strict=True) if over > 0]
        if not misses:
            return None
        unrefused = self.failed - self.refused
        if unrefused:
            misses.append(f"{unrefused} of {self.requests} requests failed or cut off")
        refusal = self.refusal_text()
        return ", ".join([refusal, *misses] if refusal else misses)


CONSTRAINT_TEXT = {"p99_ttft": "p99 TTFT", "p99_tpot": "p99 TPOT", "p99_itl": "p99 ITL"}


def slo_targets(slo: SLO) -> list[tuple[str, float]]:
    """(constraint name, target seconds) for each SLO that is set, in `CONSTRAINTS` order."""
    targets = {"p99_ttft": slo.ttft_s, "p99_tpot": slo.tpot_s, "p99_itl": slo.itl_s}
    return [(name, target) for name in CONSTRAINTS if (target := targets[name]) is not None]


def slo_text(slo: SLO) -> str:
    """'p99 TTFT <= 2.00 s, p99 ITL <= 150.0 ms': the SLOs that are set."""
    return ", ".join(f"{CONSTRAINT_TEXT[name]} <= {seconds_text(target)}"
                     for name, target in slo_targets(slo))


def constraint_names(slo: SLO) -> list[str]:
    return [name for name, _ in slo_targets(slo)]


def margin_text(value: float, target: float) -> str:
    if not math.isfinite(value):
        return "a request never finished"
    return f"{value / target - 1:+.0%}"


def measure(run: TrialRun, planned: int, slo: SLO) -> TrialMeasures:
    """Pooled over every planned request; a failed, refused or missing one is a miss (an
    infinite TTFT, TPOT and gap)."""
    timings = run.timings
    missing = planned - len(timings)
    failed = [t for t in timings if not t.ok]
    ttfts = [t.ttft if t.ok and t.ttft is not None else math.inf for t in timings]
    tpots = [v for t in timings if (v := t.tpot if t.ok else math.inf) is not None]
    q = 100 * slo.target
    ttft = percentile_interval(ttfts + [math.inf] * missing, q)
    # no request with two tokens has no gap to miss: its p99 TPOT and ITL are 0, not NaN
    tpot = percentile_interval(tpots + [math.inf] * missing or [0.0], q)
    gaps = _gaps(timings, len(failed) + missing)
    itl = percentile_interval(gaps if len(gaps) else [0.0], q)
    good = goodput(timings, run.elapsed_s, slo)
    tokens = sum(t.num_output_tokens for t in timings if t.ok)
    refused: Counter[str] = getattr(run, "refused", None) or Counter()
    return TrialMeasures(p99_ttft_s=ttft[0], p99_ttft_ci=ttft[1], p99_tpot_s=tpot[0],
                         p99_tpot_ci=tpot[1], p99_itl_s=itl[0], p99_itl_ci=itl[1],
                         goodput_rps=good.requests_per_s,
                         good_fraction=good.requests / planned, requests=planned,
                         failed=len(failed) + missing,
                         wall_s=run.wall_s, output_tokens_per_s=(
                             tokens / run.elapsed_s if run.elapsed_s > 0 else 0.0),
                         engine_stats=getattr(run, "engine_stats", None), gaps=len(gaps),
                         refused=sum(refused.values()),
                         refused_because=refused.most_common(1)[0][0] if refused else None,
                         target=slo.target, elapsed_s=run.elapsed_s)


def _gaps(timings: Sequence[RequestTiming], unfinished: int) -> np.ndarray:
    """Every gap between two tokens of a request that succeeded, and one infinite gap for each
    request that did not (`RequestTiming.gaps_within`'s count)."""
    parts = [np.diff(np.asarray(t.token_times, dtype=float)) for t in timings
             if t.ok and len(t.token_times) > 1]
    parts.append(np.full(unfinished, math.inf))
    return np.concatenate(parts)


def early_stop(requests: Sequence[TraceRequest], slo: SLO) -> StopRule:
    """Stop once more requests (or gaps) missed a target than its p99 allows of those planned."""
    return EarlyStop(requests, slo)


class EarlyStop:
    """The early-stop rule, incremental: a run hands it its append-only list of finished
    timings, and only the new ones are counted (a new list starts the count afresh), so asking
    after every finished request costs O(1) each. Requests the engine refused or that failed
    are said as such, not as a latency miss; gaps count against the planned gaps (each
    request's output tokens less one)."""

    def __init__(self, requests: Sequence[TraceRequest], slo: SLO) -> None:
        self.planned, self.slo = len(requests), slo
        self.allowed = allowed_misses(self.planned, slo.target)
        self.planned_gaps = sum(max(0, r.output_tokens - 1) for r in requests)
        self.allowed_gaps = allowed_misses(self.planned_gaps, slo.target)
        self._list: list[RequestTiming] | None = None
        self._reset([])

    def _reset(self, finished: list[RequestTiming]) -> None:
        self._list, self._seen = finished, 0
        self._missed = {"failed": 0, "TTFT": 0, "TPOT": 0}
        self._missed_gaps = 0

    def __call__(self, finished: list[RequestTiming]) -> str | None:
        if finished is not self._list or len(finished) < self._seen:
            self._reset(finished)
        for timing in finished[self._seen:]:
            self._missed["failed"] += not timing.ok
            self._missed["TTFT"] += not timing.meets_ttft(self.slo)
            self._missed["TPOT"] += not timing.meets_tpot(self.slo)
            if self.slo.itl_s is not None:
                met, gaps = timing.gaps_within(self.slo)
                self._missed_gaps += gaps - met
        self._seen = len(finished)
        budget = f"more than the {error_budget(self.slo.target):.0%} a p99 allows"
        for name, missed in self._missed.items():
            if missed > self.allowed:
                what = ("were refused or failed" if name == "failed"
                        else f"missed the {name} SLO")
                return f"stopped early: {missed} of {self.planned} requests {what}, {budget}"
        if self.slo.itl_s is not None and self._missed_gaps > self.allowed_gaps:
            return (f"stopped early: {self._missed_gaps} of {self.planned_gaps} planned gaps "
                    f"between tokens missed the ITL SLO, {budget}")
        return None


def allowed_misses(n: int, target: float) -> int:
    """How many of n requests (or gaps) may miss a target that `target` of them must meet
    while their p99 still meets it."""
    return n - nearest_rank(n, 100 * target) if n else 0


def never_stop(finished: list[RequestTiming]) -> str | None:
    return None


def seconds_text(seconds: float | None) -> str:
    """Seconds for people; None (an infinite p99: a failed request) as 'inf'."""
    if seconds is None or not math.isfinite(seconds):
        return "inf"
    return f"{seconds * 1000:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"

