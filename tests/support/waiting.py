"""Waiting on a condition with a deadline: tests wait on events, never on sleeps."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any


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



def poll_until(check: Callable[[], Any], timeout: float, what: str, *,
               every: float = 0.1, unreachable: tuple[type[BaseException], ...] = (OSError,)
               ) -> Any:
    """The blocking twin of `wait_until`, for a test that talks to a server process: ask
    `check()` every `every` s until it returns something true (that is returned; an
    `unreachable` error counts as not yet); AssertionError naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            found = check()
        except unreachable:
            found = None
        if found:
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"still not true after {timeout} s: {what}")
        time.sleep(every)


async def next_loop_turn() -> None:
    """Return once every callback already scheduled with call_soon has run (they run in
    order): the event "this turn's work is done", not a wait for time to pass."""
    turned = asyncio.get_running_loop().create_future()
    asyncio.get_running_loop().call_soon(turned.set_result, None)
    await turned
