"""/readyz tells the truth during a database outage (issue 13, defect 6): without the tenant
database no new key can be authenticated, so the gateway says it is not ready (and why) until
the database answers again; cached keys keep working meanwhile and no usage is lost."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from gateway.state import GATEWAY
from tests.faults.proxy import TcpProxy
from tests.gateway.helpers import completion, start_gateway

PG = "postgres@127.0.0.1:5432"


async def _pg(sql: str) -> None:
    import asyncpg

    conn = await asyncpg.connect(f"postgresql://{PG}/postgres", timeout=3)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


@pytest.fixture
async def database() -> AsyncIterator[str]:
    name = f"fg_ready_{uuid.uuid4().hex[:12]}"
    try:
        await _pg(f'CREATE DATABASE "{name}"')
    except Exception as exc:
        pytest.skip(f"PostgreSQL at {PG} is unreachable ({type(exc).__name__}); the readiness "
                    "test needs a database it can cut off")
    yield name
    await _pg(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def proxy() -> Iterator[TcpProxy]:
    with TcpProxy("127.0.0.1", 5432) as p:
        yield p


async def _ready_becomes(client: Any, want: bool, timeout: float = 10.0) -> dict[str, Any]:
    """Poll /readyz (what a load balancer does) until it says `want`."""
    deadline = time.monotonic() + timeout
    while True:
        resp = await client.get("/readyz")
        body = await resp.json()
        if body["ready"] is want:
            assert resp.status == (200 if want else 503)
            return body
        assert time.monotonic() < deadline, f"/readyz still says {body}"
        await asyncio.sleep(0.05)


async def test_readyz_follows_the_database(aiohttp_client: Any, database: str,
                                           proxy: TcpProxy) -> None:
    url = f"postgresql+asyncpg://postgres@127.0.0.1:{proxy.port}/{database}"
    h = await start_gateway(aiohttp_client, url, tenants={"acme": {}, "beta": {}})
    body = await _ready_becomes(h.client, True)
    assert body["checks"]["database"] == {"ok": True}
    assert (await h.post("acme", completion())).status == 200  # acme's key is now cached

    proxy.down()
    body = await _ready_becomes(h.client, False)
    assert body["checks"]["database"]["ok"] is False
    assert "database" in body["checks"]["database"]["detail"]
    assert body["checks"]["backends"]["ok"] is True
    assert (await h.post("acme", completion())).status == 200  # cached keys still work
    resp = await h.post("beta", completion())  # a key not seen yet cannot be checked
    assert resp.status == 503 and (await resp.json())["error"]["code"] == "auth_unavailable"

    proxy.up()
    await _ready_becomes(h.client, True)
    assert (await h.post("beta", completion())).status == 200
    ledger = h.app[GATEWAY].ledger
    await ledger.flush()
    acme = await ledger.totals("acme")
    assert acme["by_status"] == {200: 2}  # the request served during the outage is recorded
