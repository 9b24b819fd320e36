"""Waiting on a condition with a deadline: tests wait on events, never on sleeps."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable


async def wait_for(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    """Wait until `condition()` holds (checked every millisecond); fail after `timeout` s."""

    async def check() -> bool:
        return condition()

    await wait_until(check, timeout, "condition", every=0.001)


async def wait_until(check: Callable[[], Awaitable[bool]], timeout: float, what: str, *,
                     every: float = 0.02) -> None:
    """Wait until `await check()` holds (asked every `every` s: it may be a request to a
    server); AssertionError naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"still not true after {timeout} s: {what}")
        await asyncio.sleep(every)

