"""Queue bounds and fair share over gateway replicas through the real Redis at 127.0.0.1:6379
(gateway/replicas/redis_fair_share.py): one tenant's queue bound holds across two replicas, and two
backlogged tenants that each reach the engine through a different replica share it by their
weights."""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from typing import Any

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.server import make_app as make_engine_app
from gateway.replicas.redis_fair_share import SharedFairState
from tests.gateway.helpers import ControlledBackend, Harness, collect, completion, start_gateway
from tests.gateway.test_redis_limits import Proxy, prefix, redis_url
from tests.support.waiting import wait_for

__all__ = ["prefix"]  # the fixture: a key prefix of the test's own, deleted afterwards


def fair(h: Harness) -> SharedFairState:
    state = h.gateway.replica_fair_share
    assert state is not None
    return state


async def test_a_queue_bound_holds_over_two_replicas(
        aiohttp_client: Any, db_url: str, prefix: str) -> None:
    url = redis_url(prefix)
    limits = {"max_queued_requests": 6}
    first = await start_gateway(aiohttp_client, db_url, tenants={"acme": {"limits": limits}},
                                gateway={"redis": url}, backends=[ControlledBackend()])
    second = await start_gateway(aiohttp_client, db_url, tenants={},
                                 gateway={"redis": url}, backends=[ControlledBackend()])
    second.keys = first.keys
    await wait_for(lambda: fair(first).replicas == fair(second).replicas == 1, timeout=10)
    # four on the first: one runs (its backend holds one), three queue
    body = {**completion(), "model": "test-model"}  # the controlled backend's
    held = [asyncio.create_task(first.post("acme", body)) for _ in range(4)]
    try:
        await wait_for(lambda: first.gateway.queue.depth("acme")[0] == 3, timeout=10)
        await wait_for(lambda: second.gateway.queue.remote.get("acme") is not None
                       and second.gateway.queue.remote["acme"].queued_requests == 3, timeout=10)
        # five on the second: one runs, three fill the bound of six, the fifth is refused
        held += [asyncio.create_task(second.post("acme", body)) for _ in range(4)]
        await wait_for(lambda: second.gateway.queue.depth("acme")[0] == 3, timeout=10)
        refused = await second.post("acme", body)
        error = (await refused.json())["error"]
        assert refused.status == 429 and error["code"] == "queue_requests", error
        assert int(refused.headers["Retry-After"]) >= 1
        # alone (no Redis), the second would have queued up to six of its own
        ready = await (await second.client.get("/readyz")).json()
        assert "over 2 gateway replicas" in ready["checks"]["shared_state"]["detail"]
    finally:
        for task in held:
            task.cancel()
        await asyncio.gather(*held, return_exceptions=True)


async def test_redis_away_each_replica_queues_alone_and_then_shares_again(
        aiohttp_client: Any, db_url: str, prefix: str) -> None:
    proxy = Proxy()
    await proxy.start()
    limits = {"max_queued_requests": 4}
    first = await start_gateway(aiohttp_client, db_url, tenants={"acme": {"limits": limits}},
                                gateway={"redis": redis_url(prefix)},
                                backends=[ControlledBackend()])
    second = await start_gateway(aiohttp_client, db_url, tenants={},
                                 gateway={"redis": redis_url(prefix, proxy.port)},
                                 backends=[ControlledBackend()])
    second.keys = first.keys
    body = {**completion(), "model": "test-model"}
    held = [asyncio.create_task(first.post("acme", body)) for _ in range(4)]  # 1 runs, 3 wait
    try:
        await wait_for(lambda: "acme" in second.gateway.queue.remote
                       and second.gateway.queue.remote["acme"].queued_requests == 3, timeout=10)
        await proxy.stop()
        # alone: the second no longer counts the first's queue (a full bound of its own)
        await wait_for(lambda: not second.gateway.queue.remote, timeout=10)
        assert fair(second).replicas == 0
        ready = await (await second.client.get("/readyz")).json()
        assert ready["ready"] and "alone" in ready["checks"]["shared_state"]["detail"]
        # alone it queues a full bound of its own would allow: 2 here + 3 there would pass 4
        held += [asyncio.create_task(second.post("acme", body)) for _ in range(3)]
        await wait_for(lambda: second.gateway.queue.depth("acme")[0] == 2, timeout=10)
        await proxy.start()
        await wait_for(lambda: fair(second).replicas == 1
                       and second.gateway.queue.remote.get("acme") is not None, timeout=10)
        refused = await second.post("acme", body)  # 2 + 3 queued over both: past the bound
        assert refused.status == 429
    finally:
        for task in held:
            task.cancel()
        await asyncio.gather(*held, return_exceptions=True)
        await proxy.stop()


async def test_two_tenants_each_behind_its_own_replica_share_the_engine_by_weight(
        aiohttp_client: Any, aiohttp_server: Any, db_url: str, prefix: str) -> None:
    """`light` (weight 1) floods through the first replica only, `heavy` (weight 3) through the
    second only: each replica alone would fill the engine as fast as seats free (about half
    each); sharing their counts, the tokens streamed split 1:3 (within 10%)."""
    engine = AsyncEngine(EngineConfig(
        executor="sim", sim_model="tiny", sim_clock="realtime", sim_hardware="cpu",
        max_model_len=512, num_kv_blocks=512, max_num_batched_tokens=512, max_num_seqs=4))
    server = await aiohttp_server(make_engine_app(engine))
    url = redis_url(prefix)
    backends = {"backends": [{"url": str(server.make_url("/"))}], "redis": url}
    first = await start_gateway(aiohttp_client, db_url, gateway=backends, tenants={
        "light": {"weight": 1.0}, "heavy": {"weight": 3.0}})
    second = await start_gateway(aiohttp_client, db_url, gateway=backends, tenants={})
    second.keys = first.keys
    await wait_for(lambda: fair(first).replicas == fair(second).replicas == 1, timeout=10)
    await wait_for(lambda: all(b.healthy for h in (first, second)
                               for b in h.gateway.pool.backends), timeout=10)

    tokens: dict[str, list[float]] = defaultdict(list)  # tenant -> when each token came
    finished: dict[str, int] = defaultdict(int)
    stop = asyncio.Event()

    async def flood(h: Harness, tenant: str) -> None:
        while not stop.is_set():
            resp = await h.post(tenant, {**completion("x", stream=True), "max_tokens": 96})
            assert resp.status == 200, await resp.text()
            async for event in collect(resp):
                if event["choices"] and event["choices"][0].get("text"):
                    tokens[tenant].append(time.monotonic())
            finished[tenant] += 1

    clients = [asyncio.create_task(flood(first, "light")) for _ in range(10)] + [
        asyncio.create_task(flood(second, "heavy")) for _ in range(10)]
    try:
        # past the start: before the first sync the first replica let light fill the engine,
        # and the requests it sent then run to their end...
        await wait_for(lambda: min(finished["light"], finished["heavy"]) >= 12, timeout=90)
        start = time.monotonic()
        # ...then about 4,000 tokens' worth of steady state
        await wait_for(lambda: sum(t >= start for ts in tokens.values() for t in ts) >= 4000,
                       timeout=90)
        end = time.monotonic()
    finally:
        stop.set()
        for task in clients:
            task.cancel()
        await asyncio.gather(*clients, return_exceptions=True)
        # the clients hung up: every gateway request ends (queued ones leave, running ones
        # abort) before the servers are torn down
        await wait_for(lambda: all(not h.gateway.queue.size and not any(
            b.inflight for b in h.gateway.pool.backends) for h in (first, second)),
            timeout=30)
    got = {name: sum(start <= t <= end for t in tokens[name]) for name in ("light", "heavy")}
    ratio = got["heavy"] / max(1, got["light"])
    assert 2.7 <= ratio <= 3.3, (got, ratio)
    assert fair(first).syncs > 0 and fair(second).syncs > 0


def test_service_elsewhere_is_counted_once_signed_and_bad_rows_are_skipped() -> None:
    """Service elsewhere moves the counters here by its exact (signed: settles take some back)
    change; a replica's first report is its baseline; a row of another format is skipped."""
    import json

    from gateway.fairqueue import FairQueue
    from gateway.replicas.redis_limits import SharedRateLimiter
    from tests.gateway.test_fairqueue import item

    queue = FairQueue()
    queue.push(item("t"))
    state = SharedFairState(SharedRateLimiter("redis://127.0.0.1:6379/0"), queue)
    counter = queue.tenants["t"].counter

    def sync(served: float, extra: dict[str, object] | None = None) -> None:
        rows = {"t": [1, 10, 2, 1.0, served, 1, 0], **(extra or {})}
        state._apply(["me", "{}", "other", json.dumps(rows)])

    sync(100)  # the first report: a baseline, nothing added
    assert queue.tenants["t"].counter == counter and queue.remote["t"].running == 2
    sync(40)  # a settle took 60 back there
    sync(140)
    assert queue.tenants["t"].counter == counter + 40
    sync(140, {"bad": [1, "x", None, 1, 0, 0, 0], "short": [1, 2]})
    assert set(queue.remote) == {"t"}
    state._apply(["other", "not json"])
    assert queue.remote == {} and state.replicas == 1
