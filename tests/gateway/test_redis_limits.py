"""Rate windows shared by gateway replicas through Redis (gateway/replicas/redis_limits.py), against the real
Redis at 127.0.0.1:6379: limits over two gateways, settle exactness read back from Redis, the
Lua scripts under concurrent charges, and Redis going away and coming back."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.admission import RateLimited, RateLimiter
from gateway.app import make_app
from gateway.config import GatewayConfig
from gateway.replicas.redis_limits import SharedRateLimiter, split_redis_url
from gateway.state import GATEWAY
from tenants import TenantLimits
from tests.gateway.helpers import SIM_ENGINE, Harness, completion, start_gateway
from tests.support.processes import free_port
from tests.support.waiting import next_loop_turn, wait_for

redis = pytest.importorskip("redis", reason="the redis package (redis-py) is not installed")

REDIS_HOST, REDIS_PORT = "127.0.0.1", 6379


def _redis_reachable() -> bool:
    try:
        with socket.create_connection((REDIS_HOST, REDIS_PORT), timeout=1):
            return True
    except OSError:
        return False


@pytest.fixture
def prefix() -> Iterator[str]:
    """A key prefix of this test's own; every key under it is deleted afterwards."""
    if not _redis_reachable():
        pytest.skip(f"no Redis server at {REDIS_HOST}:{REDIS_PORT} (these tests need a real one)")
    name = f"fgtest-{uuid.uuid4().hex[:12]}"
    yield name
    client = redis.Redis(host=REDIS_HOST, port=REDIS_PORT)
    try:
        keys = list(client.scan_iter(match=f"{name}:*"))
        if keys:
            client.delete(*keys)
    finally:
        client.close()


def redis_url(prefix: str, port: int = REDIS_PORT) -> str:
    # redis-py's own URL options override the live path's 0.25 s: a loaded test machine must
    # not time a charge out (it would fall back to a local window, as it should in production)
    return (f"redis://{REDIS_HOST}:{port}/0?key_prefix={prefix}&socket_timeout=5"
            "&socket_connect_timeout=5")


def shared(h: Harness) -> SharedRateLimiter:
    limiter = h.gateway.limiter
    assert isinstance(limiter, SharedRateLimiter)
    return limiter


async def two_gateways(aiohttp_client: Any, db_url: str, url: str, limits: dict[str, Any],
                       **gateway: Any) -> tuple[Harness, Harness]:
    """Two replicas: one tenant database, one Redis."""
    first = await start_gateway(aiohttp_client, db_url, tenants={"acme": {"limits": limits}},
                                gateway={"redis": url, **gateway})
    second = await start_gateway(aiohttp_client, db_url, tenants={},
                                 gateway={"redis": url, **gateway})
    second.keys = first.keys
    assert shared(first).up and shared(second).up
    return first, second


async def test_requests_per_min_is_one_limit_over_two_replicas(
        aiohttp_client: Any, db_url: str, prefix: str) -> None:
    gateways = await two_gateways(aiohttp_client, db_url, redis_url(prefix),
                                  {"requests_per_min": 60})
    # a flood of 90 at once over both: exactly 60 admitted (the charge is atomic: no tolerance)
    responses = await asyncio.gather(*(gateways[i % 2].post("acme", completion())
                                       for i in range(90)))
    statuses = [r.status for r in responses]
    assert statuses.count(200) == 60 and statuses.count(429) == 30, statuses
    used = 0
    for resp in responses:
        if resp.status == 429:
            assert (await resp.json())["error"]["code"] == "requests_per_min"
            assert 1 <= int(resp.headers["Retry-After"]) <= 60
        else:
            used += (await resp.json())["usage"]["total_tokens"]
    # without Redis each replica would have admitted all 45 of its own
    for h in gateways:
        await shared(h).flush()
    assert await shared(gateways[0]).window("acme") == (60, used)
    assert shared(gateways[0]).errors == shared(gateways[1]).errors == 0


async def test_tokens_per_min_shared_and_settled_to_the_actual_tokens(
        aiohttp_client: Any, db_url: str, prefix: str) -> None:
    # chat without max_tokens: estimated at default_output_tokens (5) or the recent p90, run to
    # the tenant's max_tokens (20): every settle changes the charge
    gateways = await two_gateways(aiohttp_client, db_url, redis_url(prefix),
                                  {"tokens_per_min": 300, "max_tokens": 20},
                                  default_output_tokens=5)
    chat = {"model": "random:tiny", "messages": [{"role": "user", "content": "hi"}]}
    used, admitted, refused = 0, [0, 0], None
    for i in range(30):
        resp = await gateways[i % 2].post("acme", chat, "/v1/chat/completions")
        if resp.status == 429:
            refused = resp
            break
        assert resp.status == 200, await resp.text()
        usage = (await resp.json())["usage"]
        assert usage["completion_tokens"] == 20
        used += usage["total_tokens"]
        admitted[i % 2] += 1
    assert refused is not None and (await refused.json())["error"]["code"] == "tokens_per_min"
    assert int(refused.headers["Retry-After"]) >= 1
    assert min(admitted) >= 1 and used <= 300 + 15 * sum(admitted)
    for h in gateways:
        await shared(h).flush()
    assert await shared(gateways[0]).window("acme") == (sum(admitted), used)


async def test_settle_changes_a_charge_in_place_and_refund_removes_it(prefix: str) -> None:
    limiter = SharedRateLimiter(redis_url(prefix))
    await limiter.start()
    try:
        limits = TenantLimits(tokens_per_min=100, requests_per_min=3)
        first = await limiter.charge("t", limits, 90)
        with pytest.raises(RateLimited) as info:  # the estimate blocks at once
            await limiter.charge("t", limits, 20)
        assert info.value.reason == "tokens_per_min" and 59 <= info.value.retry_after <= 60
        limiter.settle(first, 10)
        await limiter.flush()
        second = await limiter.charge("t", limits, 80)
        limiter.settle(first, 10)  # again (a retry whose reply was lost): nothing twice
        limiter.refund(second)
        limiter.refund(second)
        await limiter.flush()
        assert await limiter.window("t") == (1, 10)
        with pytest.raises(RateLimited) as info:
            await limiter.charge("t", limits, 101)
        assert info.value.retry_after is None  # never fits: Redis is not even asked
    finally:
        await limiter.close()


ops = st.lists(st.tuples(st.integers(0, 2), st.integers(1, 60), st.integers(0, 90),
                         st.booleans()), min_size=1, max_size=40)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=ops, tpm=st.integers(1, 1500), rpm=st.one_of(st.none(), st.integers(1, 40)))
def test_lua_scripts_lose_no_update_under_concurrent_charges(
        prefix: str, ops: list[tuple[int, int, int, bool]], tpm: int, rpm: int | None) -> None:
    """Three replicas charge concurrently, then settle or refund concurrently: the window
    admits within the limits, and ends holding exactly the settled amounts."""
    asyncio.run(_charge_and_settle(prefix, ops, TenantLimits(requests_per_min=rpm,
                                                             tokens_per_min=tpm)))


async def _charge_and_settle(prefix: str, ops: list[tuple[int, int, int, bool]],
                             limits: TenantLimits) -> None:
    replicas = [SharedRateLimiter(redis_url(prefix)) for _ in range(3)]
    for replica in replicas:
        await replica.start()
    tenant = uuid.uuid4().hex  # a fresh window per example

    async def charge(replica: int, cost: int) -> Any:
        try:
            return await replicas[replica].charge(tenant, limits, cost)
        except RateLimited as exc:
            return exc

    try:
        results = await asyncio.gather(*(charge(r, cost) for r, cost, _, _ in ops))
        admitted = [(op, c) for op, c in zip(ops, results, strict=True)
                    if not isinstance(c, RateLimited)]
        charged = sum(op[1] for op, _ in admitted)
        # the oracle: totals only grew while charging, so each refusal was over at its time
        assert charged <= (limits.tokens_per_min or charged)
        assert len(admitted) <= (limits.requests_per_min or len(admitted))
        for (_, cost, _, _), c in zip(ops, results, strict=True):
            if isinstance(c, RateLimited) and c.reason == "tokens_per_min":
                assert c.retry_after is None or charged + cost > (limits.tokens_per_min or 0)
            elif isinstance(c, RateLimited):
                assert len(admitted) == limits.requests_per_min
        assert await replicas[0].window(tenant) == (len(admitted), charged)

        async def finish(op: tuple[int, int, int, bool], c: Any) -> None:
            await next_loop_turn()  # every finish starts before any of them lands
            if op[3]:
                replicas[op[0]].refund(c)
            else:
                replicas[op[0]].settle(c, op[2])

        await asyncio.gather(*(finish(op, c) for op, c in admitted))
        for replica in replicas:
            await replica.flush()
        kept = [op for op, _ in admitted if not op[3]]
        assert await replicas[0].window(tenant) == (len(kept), sum(op[2] for op in kept))
        assert [r.errors for r in replicas] == [0, 0, 0]
    finally:
        for replica in replicas:
            await replica.close()


class Proxy:
    """A TCP proxy to Redis that the test can cut and restore."""

    def __init__(self) -> None:
        self.port = free_port()
        self.server: asyncio.Server | None = None
        self.writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._handle, REDIS_HOST, self.port)

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()
        for writer in list(self.writers):
            writer.close()
        self.writers.clear()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(REDIS_HOST, REDIS_PORT)
        self.writers |= {writer, up_writer}
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer),
                             return_exceptions=True)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    finally:
        writer.close()


async def test_redis_away_falls_back_to_local_limits_and_comes_back(
        aiohttp_client: Any, db_url: str, prefix: str) -> None:
    proxy = Proxy()
    await proxy.start()
    h = await start_gateway(aiohttp_client, db_url, tenants={"acme": {"limits": {
        "requests_per_min": 6}}}, gateway={"redis": redis_url(prefix, proxy.port)})
    limiter = shared(h)
    for _ in range(2):
        assert (await h.post("acme", completion())).status == 200
    assert (await limiter.window("acme"))[0] == 2
    assert "fairgate_gateway_redis_up 1.0" in h.metrics()

    await proxy.stop()
    # every request is served, under this replica's own window at the tenant's full limit
    for _ in range(6):
        resp = await h.post("acme", completion())
        assert resp.status == 200, await resp.text()
    resp = await h.post("acme", completion())
    assert resp.status == 429 and (await resp.json())["error"]["code"] == "requests_per_min"
    assert not limiter.up and limiter.local.usage("acme")[0] == 6
    metrics = h.metrics()
    assert "fairgate_gateway_redis_up 0.0" in metrics
    assert "fairgate_gateway_redis_errors_total 0.0" not in metrics
    status = limiter.shared_state_status()
    assert status["ok"] is False and "full rate limits" in status["detail"]
    assert (await h.client.get("/readyz")).status == 200  # degraded, not unready

    await proxy.start()
    await wait_for(lambda: limiter.up, timeout=10)
    assert limiter.shared_state_status()["ok"] is True
    assert (await h.post("acme", completion())).status == 200  # the shared window again
    assert (await limiter.window("acme"))[0] == 3
    assert "fairgate_gateway_redis_up 1.0" in h.metrics()
    await proxy.stop()


async def test_settles_wait_for_redis_to_come_back(prefix: str) -> None:
    proxy = Proxy()
    await proxy.start()
    limiter = SharedRateLimiter(redis_url(prefix, proxy.port))
    await limiter.start()
    try:
        charge = await limiter.charge("t", TenantLimits(tokens_per_min=1000), 500)
        await proxy.stop()
        limiter.settle(charge, 7)
        await wait_for(lambda: not limiter.up, timeout=10)  # the settle found Redis away
        await proxy.start()
        await limiter.flush(10)
        assert await limiter.window("t") == (1, 7) and limiter.dropped == 0
    finally:
        await limiter.close()
        with contextlib.suppress(AssertionError):
            await proxy.stop()


def test_no_redis_keeps_the_in_process_limiter() -> None:
    app = make_app(GatewayConfig(demo_tenant=False), engine=SIM_ENGINE,
                   database="sqlite+aiosqlite:///:memory:")
    assert type(app[GATEWAY].limiter) is RateLimiter


@pytest.mark.parametrize(("url", "message"), [
    ("http://127.0.0.1:6379", "must be a Redis URL"),
    ("redis://127.0.0.1:port/0", "numeric port"),
    ("redis:///0", "needs a host"),
    ("redis://127.0.0.1:6379/0?key_prefix=a b", "key_prefix"),
    (6379, "must be a Redis URL"),
])
def test_redis_url_is_checked_at_start(url: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        GatewayConfig.from_dict({"redis": url})


def test_key_prefix_is_not_sent_to_redis() -> None:
    assert split_redis_url("redis://h:1/2?key_prefix=eu&db=3") == ("redis://h:1/2?db=3", "eu")
    assert split_redis_url("redis://h:1/2") == ("redis://h:1/2", "fairgate")
