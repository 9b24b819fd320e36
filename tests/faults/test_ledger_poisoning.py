"""Requests whose fields PostgreSQL cannot store as they are (a NUL in the model name, a model
name longer than the column, a lone surrogate) must not poison the usage ledger: each still gets
its row, the traffic after them too, and /v1/usage keeps answering with the right counts."""

from __future__ import annotations

import json
from collections import Counter

import aiohttp
import pytest

from tests.faults.clients import Seen, assert_usage_matches, check_clean, completion, send
from tests.faults.cluster import Cluster, StartCluster

pytestmark = pytest.mark.postgres
POISON: list[bytes] = [
    json.dumps({"model": "a\u0000b", "prompt": "hello", "max_tokens": 4}).encode(),
    json.dumps({"model": "m" * 300, "prompt": "hello", "max_tokens": 4}).encode(),
    b'{"model": "\\ud800", "prompt": "hello", "max_tokens": 4}',  # the escape, as sent
    json.dumps({"prompt": "hello", "max_tokens": 4, "priority": "a\u0000b"}).encode(),
]


async def round_of(c: Cluster, session: aiohttp.ClientSession) -> list[Seen]:
    """The poison, then normal streams, all from tenant acme."""
    tenant, key = c.tenants["acme"], c.keys["acme"]
    seen = [await send(session, c.url, tenant, key, body) for body in POISON]
    assert all(400 <= s.status < 500 for s in seen), seen
    return seen + [await send(session, c.url, tenant, key, completion(8)) for _ in range(3)]


async def test_poisonous_fields_do_not_stop_usage_recording(
        cluster: StartCluster, session: aiohttp.ClientSession, database_url: str) -> None:
    c = await cluster()
    seen = await round_of(c, session)
    for s in seen:
        check_clean(s)
    assert all(s.ok for s in seen[len(POISON):]), seen
    await assert_usage_matches(database_url, seen)

    async with session.get(f"{c.url}/v1/usage", headers=c.auth("acme")) as resp:
        assert resp.status == 200, await resp.text()
        totals = await resp.json()
    assert totals["requests"] == len(seen), totals
    assert totals["completion_tokens"] == sum(s.tokens for s in seen if s.ok), totals
    assert totals["by_status"] == {str(k): v for k, v in Counter(s.status for s in seen).items()}

    seen += await round_of(c, session)  # and it keeps recording
    await assert_usage_matches(database_url, seen)
