"""PostgreSQL made unreachable through the proxy and back, under traffic: keys the gateway has
cached keep working, a key it has not seen is a retryable 503 (not a 401 or a 500), every usage
row written while the database was away arrives once it is back, and /readyz says not-ready
while new keys cannot be authenticated. Also: the endpoints that need the database answer 503
promptly whether it refuses connections or leaves them hanging, and SIGTERM during a short
outage loses no usage."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from pathlib import Path

import aiohttp
import pytest

from tests.faults.clients import (
    Seen,
    assert_usage_matches,
    check_clean,
    completion,
    send,
    unmatched,
    usage_rows,
)
from tests.faults.cluster import Cluster, StartCluster
from tests.faults.proxy import TcpProxy
from tests.support.waiting import wait_until

pytestmark = pytest.mark.postgres
KEY_CACHE_TTL_S = 5.0  # TenantStore's cache of authenticated keys (tenants.store)


class Traffic:
    """`workers` clients of tenant `acme` sending short streams back to back until `stop()`."""

    def __init__(self, c: Cluster, session: aiohttp.ClientSession, workers: int = 3) -> None:
        self.seen: list[Seen] = []
        self._stopping = asyncio.Event()
        self._tasks = [asyncio.create_task(self._run(c, session)) for _ in range(workers)]

    async def _run(self, c: Cluster, session: aiohttp.ClientSession) -> None:
        while not self._stopping.is_set():
            self.seen.append(await send(session, c.url, c.tenants["acme"], c.keys["acme"],
                                        completion(8)))

    def ok_count(self) -> int:
        return sum(s.ok for s in self.seen)

    async def more_ok(self, n: int, what: str) -> None:
        target = self.ok_count() + n

        async def reached() -> bool:
            return self.ok_count() >= target

        await wait_until(reached, 10, f"{n} more successful requests {what}")

    async def stop(self) -> list[Seen]:
        self._stopping.set()
        await asyncio.gather(*self._tasks)
        return self.seen


async def readyz(session: aiohttp.ClientSession, c: Cluster) -> int:
    async with session.get(f"{c.url}/readyz") as resp:
        body = await resp.json()
        assert body["ready"] is (resp.status == 200), body
        return resp.status


async def test_outage_keeps_cached_keys_working_and_loses_no_usage(
        cluster: StartCluster, session: aiohttp.ClientSession, pg_proxy: TcpProxy,
        database_url: str) -> None:
    c = await cluster()
    unseen_key = await c.new_key(session, "beta")  # never used: not in the gateway's cache
    traffic = Traffic(c, session)
    cached_at = time.monotonic()  # acme's key is looked up by the first request, from now on
    await traffic.more_ok(3, "before the outage")

    pg_proxy.down()
    during = await send(session, c.url, c.tenants["beta"], unseen_key, completion(8))
    assert (during.status, during.code) == (503, "auth_unavailable"), during
    refused = pg_proxy.refused  # the key lookup's

    async def retried() -> bool:  # the usage flusher (every 1 s) found the database away
        return pg_proxy.refused > refused

    await wait_until(retried, 5, "the gateway tries the database during the outage")
    await traffic.more_ok(5, "while the database is away")
    assert time.monotonic() - cached_at < KEY_CACHE_TTL_S, "the outage outlived the key cache"
    pg_proxy.up()

    back = await send(session, c.url, c.tenants["beta"], unseen_key, completion(8))
    await traffic.more_ok(3, "after the database is back")
    seen = await traffic.stop()
    assert back.ok, back
    for s in seen:
        check_clean(s)
    assert all(s.ok and s.tokens == 8 for s in seen), [s for s in seen if not s.ok]
    await assert_usage_matches(database_url, [*seen, during, back])


async def test_readyz_is_not_ready_while_new_keys_cannot_be_authenticated(
        cluster: StartCluster, session: aiohttp.ClientSession, pg_proxy: TcpProxy) -> None:
    c = await cluster()
    assert await readyz(session, c) == 200
    pg_proxy.down()
    unseen = await send(session, c.url, c.tenants["beta"], c.keys["beta"], completion(8))
    assert unseen.code == "auth_unavailable", unseen

    async def not_ready() -> bool:
        return await readyz(session, c) == 503

    await wait_until(not_ready, 4, "/readyz answers 503 while the database is away")
    pg_proxy.up()

    async def ready() -> bool:
        return await readyz(session, c) == 200

    await wait_until(ready, 10, "/readyz answers 200 once the database is back")


async def test_usage_and_admin_during_an_outage_are_retryable_503s(
        cluster: StartCluster, session: aiohttp.ClientSession, pg_proxy: TcpProxy) -> None:
    """Endpoints that need the database say so (503, Retry-After), not 500: the driver's
    ConnectionResetError used to pass the error middleware as a client that went away."""
    c = await cluster()
    assert (await send(session, c.url, c.tenants["acme"], c.keys["acme"], completion(8))).ok
    pg_proxy.down()
    for path, headers in (("/v1/usage", c.auth("acme")), ("/admin/tenants", c.admin)):
        async with session.get(f"{c.url}{path}", headers=headers) as resp:
            body = await resp.json()
            assert resp.status == 503 and "Retry-After" in resp.headers, (path, body)


async def usage_while_hanging(c: Cluster, session: aiohttp.ClientSession,
                              pg_proxy: TcpProxy) -> int:
    """GET /v1/usage (a cached key) while the database hangs: its status, within 10 s."""
    assert (await send(session, c.url, c.tenants["acme"], c.keys["acme"], completion(8))).ok
    pg_proxy.hang()
    try:
        async with asyncio.timeout(10), session.get(f"{c.url}/v1/usage",
                                                    headers=c.auth("acme")) as resp:
            return resp.status
    finally:
        pg_proxy.up()  # before the gateway's SIGTERM: its last flush gets through


async def test_usage_while_the_database_hangs_is_a_prompt_503(
        cluster: StartCluster, session: aiohttp.ClientSession, pg_proxy: TcpProxy) -> None:
    """A partitioned database (connections accepted, never answered) is a bounded 503, not
    a wait on the driver's 60 s connect timeout."""
    c = await cluster()
    assert await usage_while_hanging(c, session, pg_proxy) == 503


async def test_a_usage_query_given_up_on_leaves_no_orphaned_task(
        cluster: StartCluster, session: aiohttp.ClientSession, pg_proxy: TcpProxy) -> None:
    """The flush a GET /v1/usage gave up on is not left behind with nobody to retrieve its
    exception (it used to log "Task exception was never retrieved" and a traceback)."""
    c = await cluster()
    await usage_while_hanging(c, session, pg_proxy)
    c.gateway.send(signal.SIGTERM)
    assert await c.gateway.exited(timeout=30) == 0, c.gateway.tail()
    assert "Traceback" not in c.gateway.output, c.gateway.tail()


async def test_sigterm_during_a_short_outage_loses_no_usage(
        cluster: StartCluster, session: aiohttp.ClientSession, pg_proxy: TcpProxy,
        database_url: str) -> None:
    """The last flush at SIGTERM outlasts a short outage: exit 0, every row written (it used
    to exit 2 at once, the buffered rows lost)."""
    c = await cluster()
    seen = [await send(session, c.url, c.tenants["acme"], c.keys["acme"], completion(8))
            for _ in range(2)]
    pg_proxy.down()
    seen += [await send(session, c.url, c.tenants["acme"], c.keys["acme"], completion(8))
             for _ in range(2)]
    refused = pg_proxy.refused
    c.gateway.send(signal.SIGTERM)

    async def flush_tried() -> bool:  # its last flush found the database away
        return pg_proxy.refused > refused or c.gateway.proc.poll() is not None

    await wait_until(flush_tried, 5, "the gateway's last flush tries the database")
    pg_proxy.up()
    assert await c.gateway.exited(timeout=20) == 0, c.gateway.tail()
    await assert_usage_matches(database_url, seen, timeout=2)


async def test_sigterm_during_a_partition_spills_and_loses_nothing(
        cluster: StartCluster, session: aiohttp.ClientSession, pg_proxy: TcpProxy,
        database_url: str, tmp_path: Path) -> None:
    """The database gone silent (no reset: open connections learn of it only by timeouts) at
    SIGTERM: the gateway still exits 0 within usage_shutdown_flush_s and a little more, and
    every row is either in the database or in the spill file the next start writes."""
    spill_dir = tmp_path / "spill"
    spill_dir.mkdir()
    c = await cluster(settings={"usage_shutdown_flush_s": 2.0,
                                "usage_spill_dir": str(spill_dir)})
    seen = [await send(session, c.url, c.tenants["acme"], c.keys["acme"], completion(8))
            for _ in range(2)]
    pg_proxy.partition()
    seen += [await send(session, c.url, c.tenants["acme"], c.keys["acme"], completion(8))
             for _ in range(2)]  # cached keys still work; their rows wait in the buffer
    assert all(s.ok for s in seen), seen
    c.gateway.send(signal.SIGTERM)
    assert await c.gateway.exited(timeout=20) == 0, c.gateway.tail()
    pg_proxy.up()
    spilled = [json.loads(line) for f in spill_dir.glob("fairgate-usage-spill-*.jsonl")
               for line in f.read_text().splitlines()]
    rows = await usage_rows(database_url, [c.tenants["acme"]])
    rows += [(r["tenant"], r["status"], r["completion_tokens"]) for r in spilled]
    missing, extra = unmatched(seen, rows)
    assert not missing and not extra, (missing, extra, c.gateway.tail())
    assert spilled, "the partition held some rows back: they are in the spill file"
