"""Shadow traffic: copies of admitted live requests go to a candidate engine, their latencies
are paired with the live ones, and nothing about the shadow reaches live clients or tenants."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import signal
from collections.abc import Iterator
from typing import Any

import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry

from control.shadow import Pair, ShadowMirror, paired_stats
from control.shadow_metrics import ShadowMetrics
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.request import SamplingParams
from engine.server import make_app as make_engine_app
from gateway.backends import Job
from gateway.config import GatewayConfig, ShadowConfig
from protocol.measures import SLO, RequestTiming
from protocol.openai import parse_request
from tests.gateway.helpers import collect, completion, start_gateway
from tests.support.processes import fairgate_engine_process
from tests.support.waiting import wait_for
from tuner.fake_server import make_fake_app

ADMIN = {"Authorization": "Bearer admin-key-0123456789"}
REALTIME = EngineConfig(executor="sim", sim_clock="realtime", max_model_len=512,
                        max_num_batched_tokens=512)
SLOS = {"slo_ttft_p99_s": 0.15, "slo_tpot_p99_s": 0.1}


async def _engine(aiohttp_server: Any, **knobs: Any) -> str:
    server = await aiohttp_server(make_engine_app(AsyncEngine(REALTIME.replace(**knobs))))
    return str(server.make_url("/v1"))


async def _burst(h: Any, n: int, **extra: Any) -> list[int]:
    """n streamed requests at once; their statuses (each read to its end)."""
    async def one(i: int) -> int:
        resp = await h.post("acme", completion(f"request {i}", max_tokens=8, stream=True,
                                               **extra))
        [_ async for _ in collect(resp)]
        return int(resp.status)

    return list(await asyncio.gather(*(one(i) for i in range(n))))


async def test_paired_statistics_show_what_the_shadows_knobs_change(
        aiohttp_client: Any, aiohttp_server: Any, db_url: str) -> None:
    """The live engine runs one sequence at a time, the shadow eight: the same six requests
    queue on the live side and not on the shadow, and the pairs say so."""
    live, shadow = await _engine(aiohttp_server, max_num_seqs=1), await _engine(
        aiohttp_server, max_num_seqs=8)
    h = await start_gateway(aiohttp_client, db_url, tenants={"acme": SLOS}, gateway={
        "backends": [{"url": live}], "shadow": [{"name": "wide", "url": shadow}]})
    assert await _burst(h, 6) == [200] * 6
    mirror = h.shadows.mirrors["wide"]
    await wait_for(lambda: len(mirror.pairs) == 6, timeout=30)
    resp = await h.client.get("/admin/shadow/wide/stats?window=60", headers=ADMIN)
    assert resp.status == 200
    stats = await resp.json()
    assert stats["pairs"] == 6 and stats["live"]["ok"] == stats["shadow"]["ok"] == 6
    assert "sees 1 x the live load" in stats["note"]
    # queueing behind one seat: the live TTFT is far higher, and every pair but the one that
    # found the seat free (shadow/live near 1, either side of it) says so
    assert stats["shadow"]["ttft"]["p50"] < stats["live"]["ttft"]["p50"]
    assert stats["ratio"]["ttft"]["p50"] < 1
    diff = stats["p99_difference"]["ttft"]
    assert diff["pairs"] == 6 and diff["shadow_minus_live_s"] < 0 and diff["ci95"][1] < 0
    # each side against the tenant's SLO: the shadow meets more of it
    live_met = stats["live"]["slo_attainment"]["acme"]["fraction"]
    assert stats["shadow"]["slo_attainment"]["acme"]["fraction"] > live_met
    # copies are not the tenant's: one request each in its rate window and its usage
    assert h.gateway.limiter.usage("acme")[0] == 6
    assert h.gateway.metrics.registry.get_sample_value(
        "fairgate_gateway_requests_total", {"tenant": "acme", "status": "200"}) == 6
    assert h.gateway.metrics.registry.get_sample_value(
        "fairgate_gateway_shadow_sent_total", {"shadow": "wide"}) == 6
    assert h.gateway.metrics.registry.get_sample_value(
        "fairgate_gateway_shadow_ttft_seconds_count", {"shadow": "wide"}) == 6


async def test_shadow_targets_change_at_run_time_through_the_admin_api(
        aiohttp_client: Any, aiohttp_server: Any, db_url: str) -> None:
    live, shadow = await _engine(aiohttp_server), await _engine(aiohttp_server)
    h = await start_gateway(aiohttp_client, db_url, gateway={"backends": [{"url": live}]})
    created = await h.client.post("/admin/shadow", json={"name": "c", "url": shadow},
                                  headers=ADMIN)
    assert created.status == 201 and (await created.json())["sample"] == 1.0
    assert await _burst(h, 2) == [200, 200]
    mirror = h.shadows.mirrors["c"]
    await wait_for(lambda: len(mirror.pairs) == 2, timeout=30)
    changed = await h.client.patch("/admin/shadow/c", json={"sample": 0}, headers=ADMIN)
    assert changed.status == 200 and (await changed.json())["pairs"] == 2  # kept
    assert await _burst(h, 2) == [200, 200]
    listed = await (await h.client.get("/admin/shadow", headers=ADMIN)).json()
    assert [(s["name"], s["sent"], s["sample"]) for s in listed["shadows"]] == [("c", 2, 0.0)]
    bad = await h.client.patch("/admin/shadow/c", json={"url": "http://x:1"}, headers=ADMIN)
    assert bad.status == 400 and "POST /admin/shadow" in (await bad.json())["error"]["message"]
    bad = await h.client.post("/admin/shadow", json={"name": "d", "url": shadow,
                                                     "sample": 2}, headers=ADMIN)
    assert bad.status == 400 and (await bad.json())["error"]["param"] == "sample"
    gone = await h.client.delete("/admin/shadow/c", headers=ADMIN)
    assert gone.status == 200 and not h.shadows.mirrors
    assert (await h.client.get("/admin/shadow/c/stats", headers=ADMIN)).status == 404
    tenant = await h.client.get("/admin/shadow", headers=h.auth("acme"))
    assert tenant.status == 401


@pytest.fixture
def shadow_process() -> Iterator[tuple[str, int]]:
    """A real `fairgate engine` process to stop: its URL and pid."""
    with fairgate_engine_process("executor=sim", "sim_clock=realtime") as (url, proc):
        yield url, proc.pid


async def test_a_stopped_shadow_changes_nothing_for_live_clients(
        aiohttp_client: Any, aiohttp_server: Any, db_url: str,
        shadow_process: tuple[str, int]) -> None:
    url, pid = shadow_process
    live = await _engine(aiohttp_server)
    h = await start_gateway(aiohttp_client, db_url, gateway={
        "backends": [{"url": live}],
        "shadow": [{"name": "frozen", "url": url, "max_inflight": 1, "max_queue": 2,
                    "timeout_s": 600}]})
    os.kill(pid, signal.SIGSTOP)  # the kernel still accepts its connections; it answers none
    try:
        # every live request succeeds while the shadow answers nothing: the live path never
        # waits on it (it would hang here if it did)
        assert await _burst(h, 10) == [200] * 10
        mirror = h.shadows.mirrors["frozen"]
        # one copy is stuck in flight, two wait, the rest were dropped and counted
        await wait_for(lambda: (mirror.inflight, mirror.queued) == (1, 2), timeout=10)
        assert mirror.outstanding == 3 and mirror.dropped == 7
        assert h.gateway.metrics.registry.get_sample_value(
            "fairgate_gateway_shadow_dropped_total",
            {"shadow": "frozen", "reason": "queue_full"}) == mirror.dropped
        assert h.gateway.limiter.usage("acme")[0] == 10
    finally:
        os.kill(pid, signal.SIGCONT)


async def test_a_dead_shadow_fails_its_copies_and_live_requests_still_succeed(
        aiohttp_client: Any, aiohttp_server: Any, db_url: str) -> None:
    live, shadow_server = await _engine(aiohttp_server), await aiohttp_server(
        make_engine_app(AsyncEngine(REALTIME)))
    url = str(shadow_server.make_url("/v1"))
    await shadow_server.close()  # killed: connections are refused
    h = await start_gateway(aiohttp_client, db_url, gateway={
        "backends": [{"url": live}], "shadow": [{"name": "dead", "url": url}]})
    assert await _burst(h, 4) == [200] * 4
    mirror = h.shadows.mirrors["dead"]
    await wait_for(lambda: len(mirror.pairs) == 4, timeout=30)
    assert mirror.failed == 4
    stats = mirror.stats(60)
    assert stats["shadow"]["failed"] == 4 and stats["live"]["ok"] == 4


async def test_a_ten_times_slower_shadow_leaves_live_latency_alone(
        aiohttp_client: Any, aiohttp_server: Any, db_url: str) -> None:
    """The shadow takes 10x the live engine's time per token: live requests finish on their
    own engine's clock, the copies finish later, all of them paired."""
    live = await _engine(aiohttp_server)
    slow = await aiohttp_server(make_fake_app(ttft=0.1, itl=0.1, model="random:tiny"))
    h = await start_gateway(aiohttp_client, db_url, gateway={
        "backends": [{"url": live}],
        "shadow": [{"name": "slow", "url": str(slow.make_url("/v1")), "kind": "openai"}]})
    started = asyncio.get_running_loop().time()
    assert await _burst(h, 4) == [200] * 4
    live_done = asyncio.get_running_loop().time() - started
    mirror = h.shadows.mirrors["slow"]
    assert len(mirror.pairs) < 4  # the copies were still running when live answers were done
    await wait_for(lambda: len(mirror.pairs) == 4, timeout=30)
    stats = mirror.stats(60)
    # 8 tokens at 100 ms: every copy took longer than the whole live burst did
    assert stats["shadow"]["e2e"]["p50"] > live_done
    assert stats["p99_difference"]["e2e"]["shadow_minus_live_s"] > 0


def _job(request_id: str, tenant: str) -> Job:
    req = parse_request({"prompt": "x"}, "completions")
    return Job(request_id, req, tenant, "batch", 2, SamplingParams(max_tokens=16))


def test_completed_pairs_are_kept_out_of_the_collectors_walks_and_read_back_whole() -> None:
    """50,000 kept pairs walked by every full collection stalled a busy gateway's loop: they
    are kept as rows the collector stops tracking, and read back as they were paired."""
    mirror = ShadowMirror(ShadowConfig("s", "http://127.0.0.1:9"),
                          ShadowMetrics(CollectorRegistry()), lambda message: None)
    slo = SLO(ttft_s=0.2, itl_s=0.05, target=0.95)
    for i in range(20):
        mirror.offer(_job(f"r{i}", "acme"), slo)
        mirror.live_done(f"r{i}", RequestTiming(1.0, [1.1, 1.15 + i / 100], 2, 1.2 + i / 100))
        failure = None if i % 4 else (503, "overloaded", "busy")
        mirror.done(f"r{i}", 0.003 * i, 1000.0 + i, 2.0, [2.2, 2.3, 2.35], 3, 2.4,
                    failure is None, failure)
    gc.collect(0)  # a row's token times are let go in one collection, the row in the next:
    gc.collect(1)  # both before the rows reach the oldest generation
    assert len(mirror.pairs) == 20 and not any(gc.is_tracked(row) for row in mirror.pairs)
    pairs = mirror.completed()
    for i, pair in enumerate(pairs):
        assert (pair.tenant, pair.slo, pair.sent_at) == ("acme", slo, 1000.0 + i)
        assert pair.shadow_wait_s == pytest.approx(0.003 * i)
        assert pair.live is not None and pair.shadow is not None
        assert list(pair.live.token_times) == [1.1, 1.15 + i / 100]
        assert (pair.live.e2e, pair.live.ok) == (pytest.approx(0.2 + i / 100), True)
        assert (list(pair.shadow.token_times), pair.shadow.num_output_tokens) == (
            [2.2, 2.3, 2.35], 3)
        assert pair.shadow.ok == (i % 4 > 0) and pair.ended_at > 0
    assert mirror.failures[(503, "overloaded")].count == 5
    assert len(mirror.window(60, sent_after=1010.0)) == 10  # copies sent from then on
    stats = mirror.stats(60, mirror.window(60, sent_after=1010.0), detail=True)
    assert stats["pairs"] == 10 and stats["shadow"]["failed"] == 2  # r12 and r16
    assert stats["samples"]["live"][0][:4] == [pytest.approx(0.1), pytest.approx(0.15),
                                               pytest.approx(0.3), 2]


def test_sampling_and_tenant_filters_choose_the_copies() -> None:
    draws = iter([0.1, 0.9, 0.4, 0.6])
    sent: list[tuple[Any, ...]] = []
    mirror = ShadowMirror(ShadowConfig("s", "http://127.0.0.1:9", sample=0.5,
                                       tenants=("acme",)), ShadowMetrics(CollectorRegistry()), sent.append,
                          draw=lambda: next(draws))
    for i in range(4):
        mirror.offer(_job(f"r{i}", "acme"), SLO())
    mirror.offer(_job("other", "globex"), SLO())
    assert [copy[2] for copy in sent] == ["r0", "r2"]


def _recording(app: web.Application) -> list[dict[str, Any]]:
    """Every completion body `app` is sent, as it arrives (before its handler reads it)."""
    received: list[dict[str, Any]] = []

    @web.middleware
    async def record(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.method == "POST" and request.path.startswith("/v1/"):
            received.append(json.loads(await request.read()))  # read() keeps the bytes
        return await handler(request)

    app.middlewares.append(record)
    return received


# what a client may add to its body: its own tenant, weight and priority, a salt, a field the
# API does not know, the newer name of max_tokens
CLIENT_EXTRAS = {"tenant": "globex", "tenant_weight": 1_000_000, "priority": "batch",
                 "cache_salt": "mine", "user": "someone", "max_completion_tokens": 5}


@pytest.mark.parametrize("kind", ["fairgate", "openai"])
async def test_a_copy_carries_exactly_what_the_live_engine_got(
        aiohttp_client: Any, aiohttp_server: Any, db_url: str, kind: str) -> None:
    """The live engine's body and the shadow's are read where they arrive: equal, with the
    gateway's tenant and weight (fairgate) or none of them (openai), never the client's."""
    def server_app() -> web.Application:
        return (make_engine_app(AsyncEngine(REALTIME)) if kind == "fairgate" else
                make_fake_app(model="random:tiny"))

    live_app, shadow_app = server_app(), server_app()
    live_bodies, shadow_bodies = _recording(live_app), _recording(shadow_app)
    live, shadow = await aiohttp_server(live_app), await aiohttp_server(shadow_app)
    h = await start_gateway(aiohttp_client, db_url, tenants={"acme": {"weight": 2.0}}, gateway={
        "backends": [{"url": str(live.make_url("/v1")), "kind": kind}],
        "shadow": [{"name": "s", "url": str(shadow.make_url("/v1")), "kind": kind}]})
    streams = (True, False) if kind == "fairgate" else (True,)  # the fake server streams
    for stream in streams:
        resp = await h.post("acme", completion("hello", max_tokens=4, stream=stream,
                                               **CLIENT_EXTRAS))
        assert resp.status == 200, await resp.text()
        await resp.read()
    mirror = h.shadows.mirrors["s"]
    await wait_for(lambda: len(mirror.pairs) == len(streams), timeout=30)
    assert len(live_bodies) == len(shadow_bodies) == len(streams)
    # a copy is always streamed (its tokens are timed): the streamed live request's body is
    # the copies' body, field for field, and a whole answer's differs in that alone
    assert shadow_bodies[0] == live_bodies[0]
    if kind == "fairgate":
        assert shadow_bodies[1] == {**live_bodies[1], "stream": True,
                                    "stream_options": {"include_usage": True}}
    for body in shadow_bodies:
        # max_completion_tokens is chat's name: a completion's max_tokens is its own
        assert body["max_tokens"] == 4 and "max_completion_tokens" not in body
        assert body["user"] == "someone"
        if kind == "fairgate":
            assert (body["tenant"], body["tenant_weight"], body["priority"]) == (
                "acme", 2.0, "batch")
        else:
            assert "tenant" not in body and "tenant_weight" not in body
            assert "priority" not in body and body["cache_salt"] == "acme"


# a target as the config reads it and as POST /admin/shadow does: the same rules, one check
BAD_TARGETS = [
    ({"model": {}}, "model"), ({"model": ""}, "model"), ({"model": "a\x00b"}, "model"),
    ({"model": "m" * 257}, "model"), ({"tenants": ["ac\x01me"]}, "tenants"),
    ({"tenants": ["acme", ""]}, "tenants"), ({"tenants": [{}]}, "tenants"),
    ({"tenants": ["acme\n"]}, "tenants"), ({"name": "s\n"}, "name"),
    ({"url": "http://x:1\n"}, "url"),
]


async def test_bad_targets_are_refused_by_the_config_and_the_admin_api(
        aiohttp_client: Any, db_url: str) -> None:
    h = await start_gateway(aiohttp_client, db_url)
    for change, param in BAD_TARGETS:
        target = {"name": "s", "url": "http://127.0.0.1:9", **change}
        with pytest.raises(ValueError, match=r"gateway\.shadow"):
            GatewayConfig.from_dict({"shadow": [target]})
        resp = await h.client.post("/admin/shadow", json=target, headers=ADMIN)
        error = (await resp.json())["error"]
        assert (resp.status, error["param"]) == (400, param), (change, error)
    assert not h.shadows.mirrors
    good = {"name": "s", "url": "http://127.0.0.1:9", "model": "org/Model-7B v2",
            "tenants": ["acme"]}
    assert (await h.client.post("/admin/shadow", json=good, headers=ADMIN)).status == 201
    resp = await h.client.patch("/admin/shadow/s", json={"tenants": ["bad\x7f"]},
                                headers=ADMIN)
    assert resp.status == 400 and (await resp.json())["error"]["param"] == "tenants"


def test_config_rejects_bad_targets() -> None:
    for bad, message in (({"name": "s", "url": "ftp://x"}, "url must be"),
                         ({"name": "", "url": "http://x:1"}, "name must be"),
                         ({"name": "s", "url": "http://x:1", "sample": 1.5}, "sample"),
                         ({"name": "s", "url": "http://x:1", "tenants": []}, "tenants")):
        with pytest.raises(ValueError, match=message):
            GatewayConfig.from_dict({"shadow": [bad]})
    with pytest.raises(ValueError, match="unique"):
        GatewayConfig.from_dict({"shadow": [{"name": "s", "url": "http://x:1"}] * 2})


def test_paired_difference_interval_covers_the_true_shift() -> None:
    """Shadow = live + 50 ms on every request: the p99 difference is 50 ms, in its interval."""
    pairs = []
    for i in range(200):
        start = float(i)
        live = RequestTiming(start, [start + 0.1 + i * 0.0005, start + 0.2 + i * 0.0005], 2,
                             start + 0.3)
        shadow = RequestTiming(start, [t + 0.05 for t in live.token_times], 2, start + 0.35)
        pairs.append(Pair("acme", SLO(ttft_s=0.2), live, shadow))
    stats = paired_stats(pairs)
    diff = stats["p99_difference"]["ttft"]
    assert diff["shadow_minus_live_s"] == pytest.approx(0.05)
    assert diff["ci95"][0] - 1e-9 <= 0.05 <= diff["ci95"][1] + 1e-9
    assert stats["ratio"]["e2e"]["p50"] == pytest.approx(0.35 / 0.3)
    assert stats["live"]["slo_attainment"]["acme"]["fraction"] == 1.0
    assert stats["shadow"]["slo_attainment"]["acme"]["fraction"] < 1.0


def test_each_side_has_tpot_per_request_and_itl_over_every_gap() -> None:
    """Live streams evenly (gaps of 1/8 s); the shadow stalls 1 s before one request's last
    token: the shadow's ITL p99 and gap attainment show it, its TPOT hardly does, and the
    pooled ITL is no pair measure."""
    slo = SLO(ttft_s=1.0, tpot_s=0.5, itl_s=0.25)
    pairs = []
    for i in range(10):
        live = RequestTiming(0.0, (0.5, 0.625, 0.75, 0.875, 1.0), 5, 1.0)
        last = 1.875 if i == 0 else 1.0
        shadow = RequestTiming(0.0, (0.5, 0.625, 0.75, 0.875, last), 5, last)
        pairs.append(Pair("acme", slo, live, shadow))
    stats = paired_stats(pairs)
    live, shadow = stats["live"], stats["shadow"]
    assert live["itl"]["count"] == shadow["itl"]["count"] == 40  # gaps, not requests
    assert live["tpot"]["count"] == 10 and live["tpot"]["p99"] == pytest.approx(0.125)
    assert live["itl"]["max"] == pytest.approx(0.125) and shadow["itl"]["max"] == pytest.approx(1.0)
    assert live["itl_attainment"]["acme"] == {"met": 40, "gaps": 40, "fraction": 1.0}
    assert shadow["itl_attainment"]["acme"]["fraction"] == pytest.approx(39 / 40)
    # TTFT and TPOT per request: every request of both sides meets them
    assert live["slo_attainment"]["acme"]["fraction"] == 1.0
    assert shadow["slo_attainment"]["acme"]["fraction"] == 1.0
    assert set(stats["p99_difference"]) == set(stats["ratio"]) == {"ttft", "tpot", "e2e"}
    assert stats["p99_difference"]["tpot"]["shadow_minus_live_s"] > 0
