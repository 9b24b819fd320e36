"""Routing over engine replicas: a request goes only to backends serving its model; a backend
that fails before any byte of an answer hands the request to another replica, once."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.server import make_app as make_engine_app
from tests.gateway.helpers import collect, completion, start_gateway
from tests.support.waiting import wait_for
from tuner.fake_server import SCRIPT, make_fake_app

REALTIME = EngineConfig(executor="sim", max_model_len=512)
HUNG_UP = web.AppKey("hung_up", list[int])


async def _fake(aiohttp_server: Any, model: str) -> Any:
    return await aiohttp_server(make_fake_app(model=model, output_tokens=4))


async def _ready(h: Any, n: int) -> None:
    await wait_for(lambda: sum(b.healthy and bool(b.model_name)
                               for b in h.gateway.pool.backends) == n, timeout=10)


async def test_each_request_goes_to_a_backend_serving_its_model(
        aiohttp_client: Any, aiohttp_server: Any, db_url: str) -> None:
    a, b = await _fake(aiohttp_server, "model-a"), await _fake(aiohttp_server, "model-b")
    h = await start_gateway(aiohttp_client, db_url, gateway={"backends": [
        {"url": str(a.make_url("/")), "kind": "openai"},
        {"url": str(b.make_url("/")), "kind": "openai"}]})
    await _ready(h, 2)
    models = await (await h.client.get("/v1/models", headers={
        "Authorization": f"Bearer {h.keys['acme']}"})).json()
    assert sorted(m["id"] for m in models["data"]) == ["model-a", "model-b"]

    async def ask(model: str) -> int:  # the fake server always streams
        resp = await h.post("acme", {**completion("hi", stream=True), "model": model})
        [_ async for _ in collect(resp)]
        return int(resp.status)

    # 12 for one model, 4 for the other, all at once: by load alone they would split evenly
    statuses = await asyncio.gather(*(ask(m) for m in ["model-a"] * 12 + ["model-b"] * 4))
    assert statuses == [200] * 16
    got_a, got_b = a.app[SCRIPT].received, b.app[SCRIPT].received
    assert len(got_a) == 12 and len(got_b) == 4
    assert {r["prompt"] for r in got_a} == {r["prompt"] for r in got_b} == {"hi"}
    unknown = await h.post("acme", {**completion("hi"), "model": "model-c"})
    assert unknown.status == 404 and (await unknown.json())["error"]["code"] == "model_not_found"
    # model-b's only backend goes away: its requests are a 503 that says so, model-a serves on
    await b.close()
    backend_b = h.gateway.pool.backends[1]
    await wait_for(lambda: not backend_b.healthy, timeout=10)
    down = await h.post("acme", {**completion("hi"), "model": "model-b"})
    body = await down.json()
    assert down.status == 503 and body["error"]["code"] == "model_unavailable"
    assert "Retry-After" in down.headers and "model-b" in body["error"]["message"]
    assert await ask("model-a") == 200


async def test_a_backend_unreachable_before_answering_hands_the_request_on_once(
        aiohttp_client: Any, aiohttp_server: Any, db_url: str) -> None:
    engines = [await aiohttp_server(make_engine_app(AsyncEngine(REALTIME))) for _ in range(2)]
    gone, live = engines
    h = await start_gateway(aiohttp_client, db_url, gateway={
        "backend_poll_interval_s": 5.0, "backends": [
            {"url": str(gone.make_url("/"))}, {"url": str(live.make_url("/"))}]})
    await _ready(h, 2)
    await gone.close()  # refused from now on; the next health check is seconds away
    first = h.gateway.pool.backends[0]
    assert first.healthy
    statuses = []
    for stream in (True, False, True):
        resp = await h.post("acme", completion("hi", stream=stream))
        if stream:
            [_ async for _ in collect(resp)]
        else:
            await resp.read()
        statuses.append(resp.status)
    assert statuses == [200, 200, 200]
    assert h.gateway.metrics.registry.get_sample_value(
        "fairgate_gateway_failovers_total", {"backend": first.name}) == 1  # then it was down
    assert not first.healthy
    # both gone: one retry at most, then the 503 says why
    await live.close()
    second = h.gateway.pool.backends[1]
    second.healthy = first.healthy = True  # as if the health checks had not noticed either
    resp = await h.post("acme", completion("hi"))
    assert resp.status == 503 and (await resp.json())["error"]["code"] == "backend_unavailable"
    assert h.gateway.metrics.registry.get_sample_value(
        "fairgate_gateway_failovers_total", {"backend": first.name}) == 2


async def test_prefix_routing_keeps_a_prefix_on_one_replica_within_a_load_bound(
        aiohttp_client: Any, aiohttp_server: Any, db_url: str) -> None:
    fakes = [await aiohttp_server(make_fake_app(model="m", output_tokens=4, ttft=0.05))
             for _ in range(2)]
    h = await start_gateway(aiohttp_client, db_url, gateway={
        "routing": "prefix", "prefix_load_factor": 1.25, "backends": [
            {"url": str(f.make_url("/")), "kind": "openai", "max_inflight": 64}
            for f in fakes]})
    await _ready(h, 2)

    async def ask(prompt: str) -> int:
        resp = await h.post("acme", {**completion(prompt, stream=True), "model": "m"})
        [_ async for _ in collect(resp)]
        return int(resp.status)

    prompts = [f"system prompt {i}: you are a helpful assistant. " * 4 for i in range(12)]
    for _ in range(3):  # one at a time: every replica is lightly loaded
        assert [await ask(p) for p in prompts] == [200] * 12

    def where(prompt: str) -> set[int]:
        return {i for i, f in enumerate(fakes) if any(r["prompt"] == prompt
                                                      for r in f.app[SCRIPT].received)}

    assert all(len(where(p)) == 1 for p in prompts)  # each prefix stuck to one replica
    # and the prefixes spread over both (least-loaded routing would put every one of these
    # sequential requests on the first replica; 12 keys all hashing to one is 1 in 2,048)
    assert {i for p in prompts for i in where(p)} == {0, 1}
    # a hot prefix, 16 at once: the bound (1.25 x the average) spreads it over both
    for f in fakes:
        f.app[SCRIPT].received.clear()
    assert await asyncio.gather(*(ask(prompts[0]) for _ in range(16))) == [200] * 16
    counts = [len(f.app[SCRIPT].received) for f in fakes]
    assert sum(counts) == 16 and min(counts) >= 4, counts


def test_routing_settings_are_checked() -> None:
    from gateway.config import GatewayConfig

    for bad, message in (({"routing": "random"}, "routing"),
                         ({"prefix_load_factor": 0.5}, "prefix_load_factor")):
        try:
            GatewayConfig.from_dict(bad)
        except ValueError as exc:
            assert message in str(exc)
        else:
            raise AssertionError(f"{bad} was accepted")


def _hang_up_app(model: str) -> Any:
    """An OpenAI server whose completions accept the request and hang up without a byte."""
    async def models(_: Any) -> Any:
        return web.json_response({"object": "list", "data": [{"id": model}]})

    async def hang_up(request: Any) -> Any:
        await request.read()
        request.transport.abort()
        return web.Response()

    app = web.Application()
    app[HUNG_UP] = [0]
    app.router.add_get("/v1/models", models)

    async def counted(request: Any) -> Any:
        app[HUNG_UP][0] += 1
        return await hang_up(request)

    app.router.add_post("/v1/completions", counted)
    return app


async def test_a_connection_cut_before_the_first_byte_is_retried_on_another_replica(
        aiohttp_client: Any, aiohttp_server: Any, db_url: str) -> None:
    """The engine took the request and died before answering (not just a refused connect):
    the client has seen nothing, so another replica serves it."""
    broken = await aiohttp_server(_hang_up_app("m"))
    fine = await _fake(aiohttp_server, "m")
    h = await start_gateway(aiohttp_client, db_url, gateway={
        "backend_poll_interval_s": 5.0, "backends": [
            {"url": str(broken.make_url("/")), "kind": "openai", "max_inflight": 64},
            {"url": str(fine.make_url("/")), "kind": "openai", "max_inflight": 1}]})
    await _ready(h, 2)
    # the fine one is full (max_inflight 1) while this runs: the retry goes there anyway
    full = h.gateway.pool.backends[1]
    full.inflight += 1
    resp = await h.post("acme", {**completion("hi", stream=True), "model": "m"})
    events = [e async for e in collect(resp)]
    full.inflight -= 1
    assert resp.status == 200 and events[-1]["choices"][0]["finish_reason"] == "length"
    # (twice there when the first try went on a kept-alive connection: that one is resent)
    assert broken.app[HUNG_UP][0] >= 1 and len(fine.app[SCRIPT].received) == 1
    assert h.gateway.metrics.registry.get_sample_value(
        "fairgate_gateway_failovers_total", {"backend": h.gateway.pool.backends[0].name}) == 1


def test_least_loaded_is_by_outstanding_tokens_per_seat() -> None:
    from gateway.backends import BackendPool

    small, big = Replica("small", seats_=4, tokens=800), Replica("big", seats_=16, tokens=1600)
    pool = BackendPool([small, big])
    assert pool.pick() is big  # 100 tokens a seat against 200, though it holds more work
    big.tokens = 4000
    assert pool.pick() is small
    small.tokens = big.tokens = 0  # no token figures (an OpenAI server idle): by requests
    small.inflight, big.inflight = 1, 2
    assert pool.pick() is big  # 2 of its room of 18 against 1 of 6
    assert pool.pick(model="other") is None  # neither serves it
    big.healthy = False
    assert pool.pick() is small and pool.fallback(small, None) is None
    small.room = False  # full: a request that failed elsewhere still goes to a healthy one
    assert pool.pick() is None and pool.fallback(big, None) is small


def test_prefix_routing_keeps_the_headroom_when_asked() -> None:
    from gateway.backends import BackendPool

    a, b = Replica("a", seats_=4), Replica("b", seats_=4)
    pool = BackendPool([a, b], headroom=0.25)  # one seat of each kept for tenants under share
    pool.homes.record((7,), "a")
    a.inflight = 3  # its seats outside the headroom are taken
    assert pool.pick_affine((7,), None, 2.0) is a  # under its share: the headroom is its
    assert pool.pick_affine((7,), None, 2.0, keep_headroom=True) is b


def test_a_prefix_goes_home_within_the_bound_and_a_new_one_near_the_least_loaded() -> None:
    from gateway.backends import PREFIX_LOAD_SLACK, BackendPool, PrefixHomes

    replicas = [Replica(name) for name in "abcd"]
    pool = BackendPool(list(replicas))
    a, b, c, d = replicas
    pool.homes.record((1, 2), "c")
    assert pool.pick_affine((1, 2, 3), None, 1.25) is c  # its longest known prefix's home
    assert pool.pick_affine((5,), None, 1.25) is not None
    # c is past the bound: 1.25 x the average after this one (5 / 4), plus the slack
    c.inflight = 2 + PREFIX_LOAD_SLACK
    a.inflight = b.inflight = d.inflight = 0
    assert pool.pick_affine((1, 2), None, 1.25) is not c
    # a new prefix: only among those within 1.25 x of the least outstanding work per seat
    c.inflight = 0
    a.tokens, b.tokens, c.tokens, d.tokens = 1000, 1000, 100, 1000
    assert all(pool.pick_affine((k,), None, 1.25) is c for k in range(100, 150))
    a.tokens = b.tokens = d.tokens = 110  # all near the least: the hash spreads them
    assert {pool.pick_affine((k,), None, 1.25).name for k in range(100, 150)} == set("abcd")
    # the same order on every gateway replica: a second pool agrees
    other = BackendPool([Replica(r.name, tokens=r.tokens) for r in replicas])
    assert all(pool.pick_affine((k,), None, 1.25).name == other.pick_affine(
        (k,), None, 1.25).name for k in range(100, 150))  # prefixes neither has seen
    # the table: four homes a prefix at most, most recent first; the oldest prefix forgotten
    homes = PrefixHomes(capacity=2)
    for name in "abcde":
        homes.record((9,), name)
    assert homes.lookup((9,)) == ["e", "d", "c", "b"]
    homes.record((10,), "a")
    homes.record((11,), "a")
    assert homes.lookup((9,)) == [] and len(homes) == 2


@dataclass
class Replica:
    name: str
    seats_: int = 8
    tokens: int = 0
    inflight: int = 0
    healthy: bool = True
    room: bool = True
    model_name: str = "m"
    max_model_len: int = 512
    handed: list[int] = field(default_factory=list)

    def seats(self) -> int:
        return self.seats_

    def capacity(self) -> int:
        return self.seats_ + 2

    def has_room(self) -> bool:
        return self.healthy and self.room

    def outstanding_tokens(self) -> int:
        return self.tokens

    def dispatched(self, tokens: int) -> None:
        self.handed.append(tokens)
