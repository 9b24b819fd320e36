"""/readyz tells the truth during a database outage (issue 13, defect 6): without the tenant
database no new key can be authenticated, so the gateway says it is not ready (and why) until
the database answers again; cached keys keep working meanwhile and no usage is lost."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from gateway.state import GATEWAY
from tests.faults.proxy import TcpProxy
from tests.gateway.helpers import completion, start_gateway
from tests.support import postgres
from tests.support.waiting import wait_until


@pytest.fixture
def database() -> Iterator[str]:
    reason = postgres.unreachable()
    if reason is not None:
        pytest.skip(f"{reason}; the readiness test needs a database it can cut off")
    with postgres.fresh_database("fg_ready") as name:
        yield name


@pytest.fixture
def proxy() -> Iterator[TcpProxy]:
    with TcpProxy(postgres.PG_HOST, postgres.PG_PORT) as p:
        yield p


async def _ready_becomes(client: Any, want: bool, timeout: float = 10.0) -> dict[str, Any]:
    """Ask /readyz (as a load balancer does) until it says `want`; its last answer."""
    answer: dict[str, Any] = {}

    async def says_it() -> bool:
        resp = await client.get("/readyz")
        answer.update(await resp.json(), status=resp.status)
        return answer["ready"] is want

    await wait_until(says_it, timeout, f"/readyz says ready={want}")
    assert answer.pop("status") == (200 if want else 503)
    return answer


async def test_readyz_follows_the_database(aiohttp_client: Any, database: str,
                                           proxy: TcpProxy) -> None:
    url = f"postgresql+asyncpg://{postgres.PG_USER}@127.0.0.1:{proxy.port}/{database}"
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
