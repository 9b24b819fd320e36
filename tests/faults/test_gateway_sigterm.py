"""SIGTERM to `fairgate serve` while streams are in flight: they finish or end cleanly, the
process exits 0, and every request has its usage row once it has gone."""

from __future__ import annotations

import asyncio
import signal

import aiohttp
import pytest

from tests.faults.clients import (
    check_clean,
    completion,
    send,
    streaming,
    unmatched,
    usage_rows,
)
from tests.faults.cluster import STREAM_TOKENS, StartCluster

pytestmark = pytest.mark.postgres


async def test_sigterm_lets_streams_end_and_records_every_request(
        cluster: StartCluster, session: aiohttp.ClientSession, database_url: str) -> None:
    c = await cluster()
    seen = [await send(session, c.url, c.tenants["acme"], c.keys["acme"], completion(8))]
    streams = await asyncio.gather(*(
        streaming(session, c.url, c.tenants[t], c.keys[t], completion(), timeout=15)
        for t in ["acme", "beta"] * 3))

    c.gateway.send(signal.SIGTERM)
    exit_code = await c.gateway.exited(timeout=30)
    seen += await asyncio.gather(*streams)

    assert exit_code == 0, c.gateway.tail()
    for s in seen:
        check_clean(s)
    assert all(s.ok and s.tokens == STREAM_TOKENS for s in seen[1:]), seen
    # It exited: its last flush is done, nothing is left to wait for.
    missing, extra = unmatched(seen, await usage_rows(database_url, sorted(c.tenants.values())))
    assert not missing and not extra, (missing, extra)
