"""/readyz during a database outage (issue 13, defect 6; issue 25, items 6 and 8). The gateway
keeps serving keys it has seen, so a database away is a degraded state the check reports, not a
reason to take every replica out of service: /readyz stays 200 and says "degraded: database"
and why, until the database answers again. A key not seen yet is a retryable 503 meanwhile, and
no usage is lost.

And /readyz answers within about a second (its ping's bound) whatever the database does, a
database that accepts connections and never answers included: the first answer used to take
3 s (the cancelled ping's connection was closed politely, with asyncpg's 2 s more)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from gateway.auth import PING_TIMEOUT_S
from gateway.state import GATEWAY
from tests.faults.proxy import TcpProxy
from tests.gateway.helpers import Harness, completion, start_gateway
from tests.support import postgres
from tests.support.waiting import wait_until

READYZ_BOUND_S = 1.5  # the ping's 1 s bound and room for a loaded machine


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


async def gateway(aiohttp_client: Any, database: str, proxy: TcpProxy) -> Harness:
    url = f"postgresql+asyncpg://{postgres.PG_USER}@127.0.0.1:{proxy.port}/{database}"
    return await start_gateway(aiohttp_client, url, tenants={"acme": {}, "beta": {}})


async def _database_check_becomes(client: Any, ok: bool, timeout: float = 10.0
                                  ) -> dict[str, Any]:
    """Ask /readyz (as a load balancer does) until its database check says `ok`; its last
    answer. Ready (200) all along."""
    answer: dict[str, Any] = {}

    async def says_it() -> bool:
        resp = await client.get("/readyz")
        answer.clear()
        answer.update(await resp.json(), status=resp.status)
        assert (answer["status"], answer["ready"]) == (200, True), answer
        return answer["checks"]["database"]["ok"] is ok

    await wait_until(says_it, timeout, f"/readyz's database check says ok={ok}")
    return answer


async def test_readyz_reports_the_database_away_as_degraded(
        aiohttp_client: Any, database: str, proxy: TcpProxy) -> None:
    h = await gateway(aiohttp_client, database, proxy)
    body = await _database_check_becomes(h.client, True)
    assert body["checks"]["database"] == {"ok": True}
    assert (await h.post("acme", completion())).status == 200  # acme's key is now cached

    proxy.down()
    body = await _database_check_becomes(h.client, False)
    assert body["checks"]["database"]["detail"].startswith("degraded: database"), body
    assert body["checks"]["backends"]["ok"] is True
    assert (await h.post("acme", completion())).status == 200  # cached keys still work
    resp = await h.post("beta", completion())  # a key not seen yet cannot be checked
    error = (await resp.json())["error"]
    assert (resp.status, error["code"]) == (503, "auth_unavailable"), error
    assert {"message", "type", "code"} <= set(error) and float(resp.headers["Retry-After"]) > 0

    proxy.up()
    await _database_check_becomes(h.client, True)
    assert (await h.post("beta", completion())).status == 200
    ledger = h.app[GATEWAY].ledger
    await ledger.flush()
    acme = await ledger.totals("acme")
    assert acme["by_status"] == {200: 2}  # the request served during the outage is recorded


@pytest.mark.parametrize("silence", ["partition", "hang"])
async def test_readyz_answers_within_its_bound_against_a_silent_database(
        aiohttp_client: Any, database: str, proxy: TcpProxy, silence: str) -> None:
    """partition: the pooled connections' bytes dropped, no reset; hang: new connections
    accepted and never answered. The gateway's start leaves connections in its pool, so the
    first ping takes one of those (the case that took 3 s)."""
    h = await gateway(aiohttp_client, database, proxy)
    getattr(proxy, silence)()
    began = time.monotonic()
    resp = await h.client.get("/readyz")
    took = time.monotonic() - began
    body = await resp.json()
    assert took < READYZ_BOUND_S, f"/readyz took {took:.2f} s ({silence})"
    assert resp.status == 200 and body["checks"]["database"]["ok"] is False, body
    assert f"within {PING_TIMEOUT_S:g} s" in body["checks"]["database"]["detail"], body
