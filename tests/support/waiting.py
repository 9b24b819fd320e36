"""Waiting on a condition with a deadline: tests wait on events, never on sleeps."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


async def wait_for(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    """Wait until `condition()` holds (checked every millisecond); fail after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition still false after {timeout} s")
        await asyncio.sleep(0.001)
