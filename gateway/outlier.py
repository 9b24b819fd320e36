"""Outlier ejection: a replica whose requests fail is taken out of dispatch for a while (Envoy's
outlier detection, a passive health check beside the active one of /load and /health).

Each remote backend says how each request it ran ended (`Verdict`): OK (an answer, a 4xx
included: the client's mistake shows the engine works) or FAILED (a 5xx other than overload, no
connection, a reset, a timeout). Overload (429, 503) and a client that left say nothing: overload
has its own path (BackendUnavailable, Retry-After), and neither tells how healthy the engine is.

A replica is ejected after `consecutive_5xx` failures in a row, or when at least
`failure_percentage_threshold` % of at least `failure_percentage_request_volume` requests over
the last `interval_s` failed. It is out for `base_ejection_time_s` x the number of times it has
been ejected, at most `max_ejection_time_s`; back in service, each `base_ejection_time_s` in which
it answers without being ejected again takes one off that number. At most
`max_ejection_percent` % of a model's replicas are out at once (rounded down, but one of two or
more may always go): the rest keep the traffic, failing or not, rather than none serving it.
"""

from __future__ import annotations

import enum
import math
import time
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

from gateway.config import OutlierDetectionConfig


class Verdict(enum.Enum):
    OK = "ok"
    FAILED = "failed"


def max_ejected(replicas: int, percent: float) -> int:
    """How many of a model's `replicas` may be out at once: `percent` of them rounded down, but
    at least one of two or more (Envoy ejects one host whatever the percentage says)."""
    allowed = math.floor(replicas * percent / 100)
    return max(allowed, 1) if replicas > 1 and percent > 0 else allowed


@dataclass
class ReplicaRecord:
    """One replica's recent outcomes and its ejections (times monotonic)."""

    consecutive_failures: int = 0
    ejections: int = 0  # the multiplier of its next ejection; decays while it serves
    ejections_total: int = 0
    ejected_until: float = -math.inf
    settled_at: float = -math.inf  # its last ejection ended, or its multiplier last decayed
    # per whole second of the window: [second, requests, failures], oldest first
    buckets: deque[list[int]] = field(default_factory=deque)

    def ejected(self, now: float) -> bool:
        return now < self.ejected_until

    def note(self, verdict: Verdict, now: float, interval_s: float) -> None:
        self.consecutive_failures = self.consecutive_failures + 1 if (
            verdict is Verdict.FAILED) else 0
        second = int(now)
        if not self.buckets or self.buckets[-1][0] != second:
            self.buckets.append([second, 0, 0])
        self.buckets[-1][1] += 1
        self.buckets[-1][2] += verdict is Verdict.FAILED
        self.forget_before(now - interval_s)

    def forget_before(self, t: float) -> None:
        while self.buckets and self.buckets[0][0] < math.floor(t):
            self.buckets.popleft()

    def window(self) -> tuple[int, int]:
        """(requests, failures) in the window, as of the last `forget_before`."""
        return sum(b[1] for b in self.buckets), sum(b[2] for b in self.buckets)


class OutlierDetector:
    """The ejection rules over every replica's record, by backend name."""

    def __init__(self, config: OutlierDetectionConfig,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock
        self.records: dict[str, ReplicaRecord] = {}

    def record(self, name: str, verdict: Verdict, replicas: Collection[str]) -> bool:
        """One request on `name` ended; `replicas`: its model's replicas, itself included.
        True when this ejected it."""
        now, config = self.clock(), self.config
        rec = self.records.setdefault(name, ReplicaRecord())
        if rec.ejected(now):  # a request that was under way: it is judged once back
            return False
        rec.note(verdict, now, config.interval_s)
        if verdict is Verdict.OK:
            self._decay(rec, now)
            return False
        if not self._failing(rec):
            return False
        out = sum(self.ejected(r) for r in replicas if r != name)
        if out >= max_ejected(len(replicas), config.max_ejection_percent):
            return False
        rec.ejections += 1
        rec.ejections_total += 1
        rec.ejected_until = now + min(config.base_ejection_time_s * rec.ejections,
                                      config.max_ejection_time_s)
        rec.settled_at = rec.ejected_until
        rec.consecutive_failures = 0  # back in service, it starts a new count
        return True

    def _failing(self, rec: ReplicaRecord) -> bool:
        config = self.config
        if config.consecutive_5xx and rec.consecutive_failures >= config.consecutive_5xx:
            return True
        requests, failures = rec.window()
        return (requests >= config.failure_percentage_request_volume
                and 100 * failures >= config.failure_percentage_threshold * requests)

    def _decay(self, rec: ReplicaRecord, now: float) -> None:
        if rec.ejections and not rec.ejected(now) and (
                now - rec.settled_at >= self.config.base_ejection_time_s):
            rec.ejections -= 1
            rec.settled_at = now

    def ejected(self, name: str) -> bool:
        rec = self.records.get(name)
        return rec is not None and rec.ejected(self.clock())

    def state(self, name: str) -> dict[str, Any]:
        """What /admin/engines shows of `name`: ejected or not, until when (epoch seconds),
        its ejection count (the multiplier) and total, failures in a row, and its error rate
        over the window (None without requests)."""
        now = self.clock()
        rec = self.records.get(name) or ReplicaRecord()
        rec.forget_before(now - self.config.interval_s)
        requests, failures = rec.window()
        ejected = rec.ejected(now)
        return {"ejected": ejected,
                "ejected_until": time.time() + (rec.ejected_until - now) if ejected else None,
                "ejections": rec.ejections, "ejections_total": rec.ejections_total,
                "consecutive_failures": rec.consecutive_failures,
                "window_s": self.config.interval_s, "window_requests": requests,
                "error_rate": failures / requests if requests else None}
