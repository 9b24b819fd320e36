"""A key revoked through the admin API (DELETE /admin/keys/{id}) stops at once: on the gateway
that revoked it (it leaves the key cache), and on another gateway process through Redis, even
while that one cannot reach the database and serves the keys it knows from their last known
tenants (the outage grace must not keep a revoked key alive)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from tests.faults.cluster import Cluster, Fleet, StartCluster, accepts, gateway_config
from tests.faults.proxy import TcpProxy
from tests.faults.services import Service
from tests.support.postgres import PG_HOST, PG_PORT, PG_USER
from tests.support.processes import free_port
from tests.support.waiting import wait_for, wait_until

pytestmark = pytest.mark.postgres
REDIS_HOST, REDIS_PORT = "127.0.0.1", 6379


@pytest.fixture
def redis_url() -> Iterator[str]:
    """Redis with a key prefix of this test's own (its keys deleted afterwards)."""
    redis = pytest.importorskip("redis", reason="the redis package (redis-py) is not installed")
    client = redis.Redis(host=REDIS_HOST, port=REDIS_PORT, socket_connect_timeout=1)
    try:
        client.ping()
    except redis.RedisError:
        client.close()
        pytest.skip(f"no Redis server at {REDIS_HOST}:{REDIS_PORT} (this test needs a real one)")
    prefix = f"fgtest-{uuid.uuid4().hex[:12]}"
    # redis-py's own timeouts, longer than the live path's 0.25 s: a loaded test machine
    yield (f"redis://{REDIS_HOST}:{REDIS_PORT}/0?key_prefix={prefix}&socket_timeout=5"
           "&socket_connect_timeout=5")
    try:
        keys = list(client.scan_iter(match=f"{prefix}:*"))
        if keys:
            client.delete(*keys)
    finally:
        client.close()


async def new_key(session: aiohttp.ClientSession, c: Cluster, tenant: str) -> tuple[str, str]:
    """(id, key) of another key for `tenant` (short name), through the admin API."""
    async with session.post(f"{c.url}/admin/tenants/{c.tenants[tenant]}/keys",
                            headers=c.admin) as resp:
        assert resp.status == 201, await resp.text()
        body = await resp.json()
    c.fleet.secrets.append(body["key"])
    return body["id"], body["key"]


async def revoke(session: aiohttp.ClientSession, c: Cluster, key_id: str) -> None:
    async with session.delete(f"{c.url}/admin/keys/{key_id}", headers=c.admin) as resp:
        body = await resp.json()
        assert resp.status == 200 and body["id"] == key_id and body["revoked_at"], body


async def status(session: aiohttp.ClientSession, url: str, key: str) -> tuple[int, str | None]:
    """(HTTP status, error code) of a short non-streamed completion with `key`."""
    async with session.post(f"{url}/v1/completions", headers={"Authorization": f"Bearer {key}"},
                            json={"prompt": "hello", "max_tokens": 4}) as resp:
        body = await resp.json()
        return resp.status, (body.get("error") or {}).get("code")


async def start_second_gateway(fleet: Fleet, c: Cluster, tmp: Path, database_url: str,
                               settings: dict[str, Any]) -> str:
    """Another `fairgate serve` in front of the cluster's engines, on `database_url`; its URL."""
    port = free_port()
    folder = tmp / "second"
    folder.mkdir()
    path = folder / "fairgate.yaml"
    path.write_text(yaml.safe_dump(gateway_config(database_url, c.engine_urls, port,
                                                  c.admin_key, settings, {})))
    gateway = Service("gateway", ["serve", "-c", str(path)], folder)
    fleet.services.append(gateway)
    await gateway.wait_line("fairgate gateway on")
    await wait_for(lambda: gateway.proc.poll() is not None or accepts(port), timeout=30)
    assert gateway.proc.poll() is None, gateway.tail()
    return f"http://127.0.0.1:{port}"


async def test_a_revoked_key_stops_at_once_on_the_gateway_that_revoked_it(
        cluster: StartCluster, session: aiohttp.ClientSession) -> None:
    c = await cluster()
    key_id, key = await new_key(session, c, "acme")
    assert await status(session, c.url, key) == (200, None)  # now in the key cache
    await revoke(session, c, key_id)
    assert await status(session, c.url, key) == (401, "invalid_api_key")
    assert await status(session, c.url, c.keys["acme"]) == (200, None)  # its other key: still


async def test_a_revocation_reaches_another_gateway_through_redis(
        cluster: StartCluster, session: aiohttp.ClientSession, fleet: Fleet, database: str,
        tmp_path: Path, redis_url: str) -> None:
    """The other gateway's database is cut before the revoke: it cannot learn of it there, and
    would serve the key from its cache and then its outage grace for minutes. Only Redis can
    tell it, and does at once."""
    settings = {"redis": redis_url}
    c = await cluster(settings=settings)
    with TcpProxy(PG_HOST, PG_PORT) as other_db:
        other = await start_second_gateway(
            fleet, c, tmp_path, f"postgresql://{PG_USER}@127.0.0.1:{other_db.port}/{database}",
            settings)
        key_id, key = await new_key(session, c, "acme")
        assert await status(session, other, key) == (200, None)  # cached there
        assert await status(session, other, c.keys["acme"]) == (200, None)
        other_db.down()
        await revoke(session, c, key_id)

        async def refused() -> bool:
            return (await status(session, other, key))[0] != 200

        await wait_until(refused, 10, "the other gateway refuses the revoked key")
        assert await status(session, other, key) == (503, "auth_unavailable")  # unknown there
        assert await status(session, other, c.keys["acme"]) == (200, None)  # others still work
        assert await status(session, c.url, key) == (401, "invalid_api_key")
