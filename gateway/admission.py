"""Admission: per-tenant requests/min and tokens/min, charged with an estimate, settled later.

Each tenant has a sliding one-minute log of charges. A request is charged its *estimated* cost
(prompt tokens + max_tokens, or the tenant's recent p90 output length) when it is admitted, so
a burst cannot overshoot the limit the way count-after-the-fact limiters do; when it finishes
the charge is settled to the actual tokens, and a request that never ran is refunded. When a
request does not fit, Retry-After is the time until enough of the oldest charges leave the
window for it to fit.

`RateLimiter` keeps the windows in this process; `gateway.shared.SharedRateLimiter` keeps them in
Redis for every replica (`gateway.redis`). Both are a `Limiter` and word their refusals here.
"""

from __future__ import annotations

import itertools
import time
from bisect import bisect_left, insort
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from protocol.stats import nearest_rank
from tenants import TenantLimits

PERIOD_S = 60.0


class RateLimited(Exception):
    """Over `reason` (requests_per_min | tokens_per_min); `retry_after` None: it never fits."""

    def __init__(self, reason: str, retry_after: float | None, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.retry_after = retry_after


@dataclass(eq=False)
class Charge:
    """One request's entry in its tenant's window, as the request holds it to settle it."""

    at: float
    tokens: int
    requests: int = 1
    window: RateWindow | None = field(default=None, repr=False)
    key: int = field(default=0, repr=False)  # its figures' key in its window (RateWindow.figures)


def check_fits(limits: TenantLimits, tokens: int) -> None:
    """RateLimited (never fits) when the request alone is over tokens_per_min."""
    tpm = limits.tokens_per_min
    if tpm is not None and tokens > tpm:
        raise RateLimited("tokens_per_min", None,
                          f"this request's estimated cost ({tokens} tokens) exceeds your "
                          f"tokens_per_min limit ({tpm}) by itself; lower max_tokens or "
                          "shorten the prompt")


def requests_limited(rpm: int, wait: float) -> RateLimited:
    return RateLimited("requests_per_min", wait, f"rate limit reached: {rpm} requests per minute")


def tokens_limited(tpm: int, tokens: int, wait: float) -> RateLimited:
    return RateLimited("tokens_per_min", wait, f"rate limit reached: {tpm} tokens per minute "
                       f"(this request is estimated at {tokens} tokens)")


class Limiter(Protocol):
    """What the request pipeline (gateway/service.py) asks of a rate limiter."""

    async def charge(self, tenant: str, limits: TenantLimits, tokens: int) -> Charge:
        """Charge `tokens` and one request, or raise RateLimited without charging anything."""
        ...

    def settle(self, charge: Charge, actual_tokens: int) -> None: ...

    def refund(self, charge: Charge) -> None: ...

    def shared_state_status(self) -> dict[str, Any]:
        """A /readyz check: whether the windows are shared by every replica right now."""
        ...


class RateWindow:
    """The charges of one tenant over the last `period` seconds, with running sums.

    What it keeps of each charge is tuples of numbers, which the garbage collector stops
    tracking: a log of `(at, key)` in time order and `figures[key] = (tokens, requests)`, as
    last settled, while the charge is in the window. A minute of a busy gateway's charges kept
    as objects (300,000 at 5,000 requests/s) was walked by every full collection of its heap,
    a stall of every request in flight (bench/gc_pause.py, bench/RESULTS.md, issue 28)."""

    def __init__(self, period: float = PERIOD_S) -> None:
        self.period = period
        self.log: deque[tuple[float, int]] = deque()  # oldest first
        self.figures: dict[int, tuple[int, int]] = {}
        self.tokens = 0
        self.requests = 0
        self._keys = itertools.count(1)

    def expire(self, now: float) -> None:
        horizon = now - self.period
        log = self.log
        while log and log[0][0] <= horizon:
            tokens, requests = self.figures.pop(log.popleft()[1])
            self.tokens -= tokens
            self.requests -= requests

    def wait_for(self, now: float, excess: int, attr: str) -> float:
        """Seconds until charges worth `excess` of `attr` have left the window."""
        index = 0 if attr == "tokens" else 1
        freed = 0
        for at, key in self.log:
            freed += self.figures[key][index]
            if freed >= excess:
                return max(0.0, at + self.period - now)
        return self.period

    def add(self, charge: Charge) -> None:
        charge.window, charge.key = self, next(self._keys)
        self.log.append((charge.at, charge.key))
        self.figures[charge.key] = (charge.tokens, charge.requests)
        self.tokens += charge.tokens
        self.requests += charge.requests

    def adjust(self, charge: Charge, tokens: int, requests: int) -> None:
        old = self.figures.get(charge.key)
        if old is not None:  # still in the window (settling one that left changes no sum)
            self.tokens += tokens - old[0]
            self.requests += requests - old[1]
            self.figures[charge.key] = (tokens, requests)
        charge.tokens, charge.requests = tokens, requests


class RateLimiter:
    """requests_per_min and tokens_per_min for every tenant."""

    def __init__(self, period_s: float = PERIOD_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.period = period_s
        self.clock = clock
        self._windows: dict[str, RateWindow] = {}

    def admit(self, tenant: str, limits: TenantLimits, tokens: int) -> Charge:
        """Charge `tokens` and one request, or raise RateLimited without charging anything."""
        now = self.clock()
        window = self._windows.get(tenant)
        if window is None:
            window = self._windows[tenant] = RateWindow(self.period)
        window.expire(now)
        rpm, tpm = limits.requests_per_min, limits.tokens_per_min
        check_fits(limits, tokens)
        if rpm is not None and window.requests + 1 > rpm:
            wait = window.wait_for(now, window.requests + 1 - rpm, "requests")
            raise requests_limited(rpm, wait)
        if tpm is not None and window.tokens + tokens > tpm:
            wait = window.wait_for(now, window.tokens + tokens - tpm, "tokens")
            raise tokens_limited(tpm, tokens, wait)
        charge = Charge(at=now, tokens=tokens)
        window.add(charge)
        return charge

    async def charge(self, tenant: str, limits: TenantLimits, tokens: int) -> Charge:
        """`admit` as a `Limiter` (it never waits)."""
        return self.admit(tenant, limits, tokens)

    def shared_state_status(self) -> dict[str, Any]:
        return {"ok": True, "detail": "rate limits are kept by this replica (no gateway.redis)"}

    def settle(self, charge: Charge, actual_tokens: int) -> None:
        """Replace the estimate with what the request really used."""
        if charge.window is not None:
            charge.window.adjust(charge, actual_tokens, charge.requests)

    def refund(self, charge: Charge) -> None:
        """The request never ran (queue timeout, disconnect while queued): charge nothing."""
        if charge.window is not None:
            charge.window.adjust(charge, 0, 0)

    def usage(self, tenant: str) -> tuple[int, int]:
        """(requests, tokens) in the tenant's current window."""
        window = self._windows.get(tenant)
        if window is None:
            return 0, 0
        window.expire(self.clock())
        return window.requests, window.tokens


class OutputEstimator:
    """Recent output lengths per tenant, for cost estimates of requests without max_tokens: the
    `percentile` of each tenant's last `samples` outputs.

    Kept in memory (the hot path must not query the database); seeded from the usage ledger the
    first time a tenant is seen, so a restart does not forget what a tenant usually asks for.
    Each tenant's window is also kept in order as it slides (an insort; the oldest removed by
    bisection), so the estimate, read at its rank, is the window's exact percentile after every
    request. (It was a sort of the window every 16 requests, 67 µs for 1,000 varied lengths, and
    never again once the window was full: its length stayed at 1,000, not a multiple of 16.)
    """

    def __init__(self, samples: int = 1000, percentile: float = 90.0) -> None:
        self.samples = samples
        self.percentile = percentile
        self._recent: dict[str, deque[int]] = {}  # arrival order: the oldest leaves first
        self._ordered: dict[str, list[int]] = {}  # the same lengths, ascending
        self._seeded: set[str] = set()

    def needs_seed(self, tenant: str) -> bool:
        return tenant not in self._seeded

    def seed(self, tenant: str, value: float | None) -> None:
        self._seeded.add(tenant)
        if value is not None and tenant not in self._recent:
            self._recent[tenant] = deque([round(value)])
            self._ordered[tenant] = [round(value)]

    def observe(self, tenant: str, output_tokens: int) -> None:
        recent = self._recent.get(tenant)
        if recent is None:
            recent = self._recent[tenant] = deque()
            self._ordered[tenant] = []
        ordered = self._ordered[tenant]
        if len(recent) >= self.samples:
            del ordered[bisect_left(ordered, recent.popleft())]
        recent.append(output_tokens)
        insort(ordered, output_tokens)

    def estimate(self, tenant: str) -> int | None:
        ordered = self._ordered.get(tenant)
        if not ordered:
            return None
        return ordered[nearest_rank(len(ordered), self.percentile) - 1]


@dataclass(frozen=True)
class CostEstimate:
    prompt_tokens: int
    output_tokens: int  # estimated: max_tokens, else the p90, capped by the context left

    @property
    def total(self) -> int:
        return self.prompt_tokens + self.output_tokens


def estimate_cost(prompt_tokens: int, max_tokens: int | None, recent_p90: int | None,
                  default_output: int, room: int) -> CostEstimate:
    """The admission cost of a request that fits its context (`protocol.openai.
    resolve_max_tokens` checked that): its max_tokens, else the tenant's recent p90 output
    length (or `default_output`), capped by the `room` the context leaves."""
    if max_tokens is not None:
        return CostEstimate(prompt_tokens, max_tokens)
    guess = recent_p90 if recent_p90 is not None else default_output
    return CostEstimate(prompt_tokens, max(1, min(guess, room)))


__all__ = ["Charge", "CostEstimate", "Limiter", "OutputEstimator", "RateLimited",
           "RateLimiter", "check_fits", "estimate_cost", "requests_limited", "tokens_limited"]
