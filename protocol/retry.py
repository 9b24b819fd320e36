"""Retrying an operation that fails for a while (a locked SQLite file, a database or Redis
away): capped exponential backoff with jitter, bounded by a number of tries or a deadline.

The pause after the n-th failure is first_s * 2**(n-1), capped at max_s, then shortened by a
random fraction of up to `jitter`: two processes that collided do not collide again in lock
step, and no pause is ever longer than max_s. A failure that is not of the types to retry (or
that `when` refuses) passes through at once; so does the last one, when the tries are used up
or the next pause would end past the deadline.

`retry_async` is the one to use; `retry_sync` is for the one caller that cannot await (SQLite's
connect hook, which runs in the driver's thread).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from protocol.validators import check_number, check_positive_int

T = TypeVar("T")
Errors = type[BaseException] | tuple[type[BaseException], ...]
OnRetry = Callable[[BaseException, float], None]  # the failure and the pause before the next try
_MAX_DOUBLINGS = 64  # 2**64 times any first pause is past any cap


@dataclass(frozen=True)
class Backoff:
    first_s: float  # the pause after the first failure
    max_s: float  # no pause is longer
    attempts: int | None = None  # tries in all, the first included; None: no bound but time
    jitter: float = 0.5  # each pause is shortened by a random fraction of up to this

    def __post_init__(self) -> None:
        check_number("Backoff.first_s", self.first_s, low=0)
        check_number("Backoff.max_s", self.max_s, low=self.first_s)
        if self.attempts is not None:
            check_positive_int("Backoff.attempts", self.attempts)
        check_number("Backoff.jitter", self.jitter, 0.0, 1.0, open_high=True)

    def pause(self, failures: int, rand: float) -> float:
        """The pause after `failures` failures in a row; `rand` uniform in [0, 1)."""
        doubled = self.first_s * 2.0 ** min(failures - 1, _MAX_DOUBLINGS)
        return min(self.max_s, doubled) * (1.0 - self.jitter * rand)


def _pause_or_give_up(backoff: Backoff, exc: BaseException, failures: int,
                      when: Callable[[BaseException], bool] | None, deadline: float | None,
                      clock: Callable[[], float], rand: Callable[[], float]) -> float | None:
    """The pause before the next try, or None: `exc` goes to the caller."""
    if when is not None and not when(exc):
        return None
    if backoff.attempts is not None and failures >= backoff.attempts:
        return None
    pause = backoff.pause(failures, rand())
    if deadline is not None and clock() + pause > deadline:
        return None
    return pause


async def retry_async(attempt: Callable[[], Awaitable[T]], backoff: Backoff, *,
                      retry_on: Errors = Exception,
                      when: Callable[[BaseException], bool] | None = None,
                      deadline: float | None = None, on_retry: OnRetry | None = None,
                      sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
                      clock: Callable[[], float] = time.monotonic,
                      rand: Callable[[], float] = random.random) -> T:
    """`await attempt()` until it returns, retrying failures of `retry_on` (those `when`
    accepts) after backoff's pauses; no pause ends past `deadline` (on `clock`, monotonic
    seconds). A cancellation is never retried. `sleep`, `clock`, `rand`: for tests."""
    failures = 0
    while True:
        try:
            return await attempt()
        except asyncio.CancelledError:
            raise
        except retry_on as exc:
            failures += 1
            pause = _pause_or_give_up(backoff, exc, failures, when, deadline, clock, rand)
            if pause is None:
                raise
            if on_retry is not None:
                on_retry(exc, pause)
        await sleep(pause)


def retry_sync(attempt: Callable[[], T], backoff: Backoff, *, retry_on: Errors = Exception,
               when: Callable[[BaseException], bool] | None = None,
               deadline: float | None = None, on_retry: OnRetry | None = None,
               sleep: Callable[[float], object] = time.sleep,
               clock: Callable[[], float] = time.monotonic,
               rand: Callable[[], float] = random.random) -> T:
    """`retry_async` for a caller that cannot await: the pauses block its thread."""
    failures = 0
    while True:
        try:
            return attempt()
        except retry_on as exc:
            failures += 1
            pause = _pause_or_give_up(backoff, exc, failures, when, deadline, clock, rand)
            if pause is None:
                raise
            if on_retry is not None:
                on_retry(exc, pause)
        sleep(pause)
