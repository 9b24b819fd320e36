"""An engine SIGKILLed mid-stream: its client gets a clean SSE error event and [DONE], the
stream on the other engine is untouched, the next requests go to the other engine, and the
usage rows say exactly what the clients saw."""

from __future__ import annotations

import asyncio
import signal

import aiohttp
import pytest

from tests.faults.clients import (
    Seen,
    assert_usage_matches,
    check_clean,
    completion,
    first_engine_down_others_serve,
    send,
    streaming,
)
from tests.faults.cluster import STREAM_TOKENS, Cluster, StartCluster

pytestmark = pytest.mark.postgres


async def running(session: aiohttp.ClientSession, engine_url: str) -> int:
    async with session.get(f"{engine_url}/load") as resp:
        return int((await resp.json())["running"])


async def kill_mid_stream(c: Cluster, session: aiohttp.ClientSession) -> tuple[Seen, Seen]:
    """One stream on each engine, engine 0 SIGKILLed: (its stream, the other one)."""
    # One after the other: engine 0 takes the first, the idle engine 1 the second.
    streams = [await streaming(session, c.url, c.tenants[t], c.keys[t], completion())
               for t in ("acme", "beta")]
    assert [await running(session, u) for u in c.engine_urls] == [1, 1]
    c.engines[0].send(signal.SIGKILL)
    done, _ = await asyncio.wait(streams, return_when=asyncio.FIRST_COMPLETED, timeout=10)
    assert len(done) == 1, "no stream noticed its engine was killed"
    victim = done.pop()
    survivor = next(s for s in streams if s is not victim)
    return victim.result(), await survivor


async def test_engine_killed_mid_stream_ends_its_stream_cleanly(
        cluster: StartCluster, session: aiohttp.ClientSession, database_url: str) -> None:
    c = await cluster(engines=2)
    victim, survivor = await kill_mid_stream(c, session)
    check_clean(victim)
    assert victim.stream_error and 0 < victim.tokens < STREAM_TOKENS, victim
    assert survivor.ok and survivor.tokens == STREAM_TOKENS, survivor

    after = await first_engine_down_others_serve(c, session, "killed", 4)
    await assert_usage_matches(database_url, [victim, survivor, *after])


async def test_request_right_after_the_kill_goes_to_the_other_engine(
        cluster: StartCluster, session: aiohttp.ClientSession, database_url: str) -> None:
    # Health checks far apart: the request after the kill comes before any of them notices.
    c = await cluster(engines=2, settings={"backend_poll_interval_s": 5.0})
    victim, survivor = await kill_mid_stream(c, session)
    after = [await send(session, c.url, c.tenants["acme"], c.keys["acme"], completion(8))
             for _ in range(2)]
    await assert_usage_matches(database_url, [victim, survivor, *after])
    assert all(s.ok and s.tokens == 8 for s in after), after
