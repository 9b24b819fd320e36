"""An engine SIGSTOPped mid-stream (alive, connection open, silent): the stall timeout ends
its client's stream with an SSE error long before request_timeout_s, the backend is marked
down, the next requests go to the other engine. The engines are resumed (SIGCONT) before they
are stopped, whatever happened."""

from __future__ import annotations

import asyncio
import signal
import time

import aiohttp
import pytest

from tests.faults.clients import (
    assert_usage_matches,
    check_clean,
    completion,
    first_engine_down_others_serve,
    streaming,
)
from tests.faults.cluster import (
    BACKEND_TIMEOUTS,
    STREAM_TOKENS,
    StartCluster,
)

pytestmark = pytest.mark.postgres
STALL_TIMEOUT_S = BACKEND_TIMEOUTS["stall_timeout_s"]
REQUEST_TIMEOUT_S = 20.0
SLACK_S = 2.0  # the stall timeout's error may come this much later on a loaded machine


async def test_engine_stopped_mid_stream_ends_on_the_stall_timeout(
        cluster: StartCluster, session: aiohttp.ClientSession, database_url: str) -> None:
    c = await cluster(engines=2, settings={"request_timeout_s": REQUEST_TIMEOUT_S})
    # On engine 0: both are idle, the first is picked.
    stream = await streaming(session, c.url, c.tenants["acme"], c.keys["acme"], completion())
    c.engines[0].send(signal.SIGSTOP)
    stopped_at = time.monotonic()
    async with asyncio.timeout(STALL_TIMEOUT_S + SLACK_S):
        victim = await stream
    waited = time.monotonic() - stopped_at

    check_clean(victim)
    assert victim.stream_error and victim.tokens < STREAM_TOKENS, victim
    assert waited < STALL_TIMEOUT_S + SLACK_S < REQUEST_TIMEOUT_S, waited

    after = await first_engine_down_others_serve(c, session, "stopped", 3)
    await assert_usage_matches(database_url, [victim, *after])


async def test_request_timeout_mid_stream_ends_with_an_error_event(
        cluster: StartCluster, session: aiohttp.ClientSession, database_url: str) -> None:
    """With the per-backend timeouts out of the way, request_timeout_s is what ends a stream
    from a silent engine: after the stream started, so as an SSE error event and [DONE] (it
    used to record 504 and leave the client's connection open with nothing more sent)."""
    backend = {name: 60.0 for name in BACKEND_TIMEOUTS}
    c = await cluster(settings={"request_timeout_s": 1.5}, backend=backend)
    stream = await streaming(session, c.url, c.tenants["acme"], c.keys["acme"], completion())
    c.engines[0].send(signal.SIGSTOP)
    async with asyncio.timeout(1.5 + SLACK_S):
        victim = await stream
    c.engines[0].send(signal.SIGCONT)

    check_clean(victim)
    assert victim.stream_error and victim.code == "timeout", victim
    rows = await assert_usage_matches(database_url, [victim])
    assert rows[0][1] == 504, rows
