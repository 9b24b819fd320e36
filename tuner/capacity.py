"""Capacity: the highest arrival rate at which a config still meets both p99 SLOs.

The same requests replay time-compressed (`scale_arrivals`: arrival / factor, so factor 2 is
twice the workload's own rate); `search_capacity` brackets the largest factor that holds by
doubling up from 1 (or halving down), then bisects geometrically to `precision`. The probe is
the caller's: it runs one factor and returns what it measured when the SLOs held, else None.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from tuner.traces import TraceRequest

MIN_FACTOR, MAX_FACTOR = 1 / 64, 64.0
MAX_PROBES = 12
PRECISION = 0.05  # relative: the search ends once the failing factor is within 5% above

M = TypeVar("M")


def mean_rate(requests: Sequence[TraceRequest]) -> float:
    """The workload's own rate: requests over its arrival span (arrivals count from 0)."""
    span = max((r.arrival for r in requests), default=0.0)
    if span <= 0:
        raise ValueError("--objective capacity needs requests spread over time "
                         "(every arrival is at 0 s)")
    return len(requests) / span


def scale_arrivals(requests: Sequence[TraceRequest], factor: float) -> tuple[TraceRequest, ...]:
    """The same requests at `factor` times the rate: only the arrival times change."""
    assert factor > 0, factor
    return tuple(dataclasses.replace(r, arrival=r.arrival / factor) for r in requests)


@dataclass(frozen=True)
class CapacitySearch(Generic[M]):
    factor: float  # the largest factor that held; 0 when none did
    at: M | None  # what the probe measured at `factor`
    probes: tuple[tuple[float, bool], ...]  # (factor, held), in probe order
    failed_above: float | None  # the smallest factor that failed above `factor`, if any

    @property
    def held(self) -> bool:
        return self.at is not None


def search_capacity(probe: Callable[[float], M | None], *, low: float = MIN_FACTOR,
                    high: float = MAX_FACTOR, precision: float = PRECISION,
                    max_probes: int = MAX_PROBES) -> CapacitySearch[M]:
    """Bracket from 1.0 by doubling or halving within [low, high], then bisect."""
    probes: list[tuple[float, bool]] = []
    held: dict[float, M] = {}

    def run(factor: float) -> bool:
        result = probe(factor)
        probes.append((factor, result is not None))
        if result is not None:
            held[factor] = result
        return result is not None

    good, bad = _bracket(run, low, high, max_probes, probes)
    while (good is not None and bad is not None and bad / good > 1 + precision
           and len(probes) < max_probes):
        mid = math.sqrt(good * bad)
        good, bad = (mid, bad) if run(mid) else (good, mid)
    if good is None:
        return CapacitySearch(0.0, None, tuple(probes), bad)
    return CapacitySearch(good, held[good], tuple(probes), bad)


def _bracket(run: Callable[[float], bool], low: float, high: float, max_probes: int,
             probes: list[tuple[float, bool]]) -> tuple[float | None, float | None]:
    """(largest held, smallest failed) once they are neighbours by a factor of 2, or a
    bound or the probe budget is reached."""
    if run(1.0):
        good = 1.0
        while good * 2 <= high and len(probes) < max_probes:
            if not run(good * 2):
                return good, good * 2
            good *= 2
        return good, None
    bad = 1.0
    while bad / 2 >= low and len(probes) < max_probes:
        if run(bad / 2):
            return bad / 2, bad
        bad /= 2
    return None, bad
