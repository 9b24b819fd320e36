"""Model names across the shadow seam: a live request for the default alias (or for no model)
reaches each shadow target under the name that target serves (its /v1/models) or under its
configured `model`; a copy that fails says why (status, error code, count per reason) in
GET /admin/shadow."""

from __future__ import annotations

import asyncio
from typing import Any

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.server import make_app as make_engine_app
from tests.gateway.helpers import Harness, collect, start_gateway
from tests.support.waiting import wait_for
from tuner.fake_server import SCRIPT, make_fake_app

ADMIN = {"Authorization": "Bearer admin-key-0123456789"}
ENGINE = EngineConfig(executor="sim", sim_clock="realtime", max_model_len=512,
                      max_num_batched_tokens=512)


async def _engine(aiohttp_server: Any, model: str = "random:tiny") -> str:
    server = await aiohttp_server(make_engine_app(AsyncEngine(ENGINE.replace(model=model))))
    return str(server.make_url("/v1"))


async def _send(h: Harness, bodies: list[dict[str, Any]]) -> list[int]:
    """Each body streamed by acme, read to its end; their statuses."""
    async def one(body: dict[str, Any]) -> int:
        resp = await h.post("acme", {"prompt": "hello", "max_tokens": 4, "stream": True, **body})
        [_ async for _ in collect(resp)]
        return int(resp.status)

    return list(await asyncio.gather(*(one(b) for b in bodies)))


async def _listed(h: Harness) -> dict[str, dict[str, Any]]:
    resp = await h.client.get("/admin/shadow", headers=ADMIN)
    assert resp.status == 200
    return {s["name"]: s for s in (await resp.json())["shadows"]}


ALIASED = [{"model": "default"}, {}]  # the alias, and no model at all


async def test_the_default_alias_reaches_each_shadow_under_the_model_it_serves(
        aiohttp_client: Any, aiohttp_server: Any, db_url: str) -> None:
    live, other = await _engine(aiohttp_server), await _engine(aiohttp_server, "random:small")
    fake = await aiohttp_server(make_fake_app(model="fake-model"))
    h = await start_gateway(aiohttp_client, db_url, gateway={"backends": [{"url": live}],
        "shadow": [{"name": "other", "url": other},
                   {"name": "openai", "url": str(fake.make_url("/v1")), "kind": "openai"},
                   {"name": "named", "url": other, "model": "random:small"}]})
    assert await _send(h, ALIASED) == [200, 200]
    mirrors = h.shadows.mirrors
    await wait_for(lambda: all(len(m.pairs) == 2 for m in mirrors.values()), timeout=30)
    listed = await _listed(h)
    for name in ("other", "openai", "named"):
        assert (listed[name]["sent"], listed[name]["failed"]) == (2, 0), listed[name]
        assert listed[name]["failures"] == []
        assert all(p.shadow is not None and p.shadow.ok for p in mirrors[name].completed())
    # what each target says it serves, learnt from its /v1/models (or configured)
    assert [listed[n]["model"] for n in ("other", "openai", "named")] == [
        "random:small", "fake-model", "random:small"]
    assert [body["model"] for body in fake.app[SCRIPT].received] == ["fake-model"] * 2


async def test_a_failing_shadow_says_why_in_the_admin_api(
        aiohttp_client: Any, aiohttp_server: Any, db_url: str) -> None:
    live = await _engine(aiohttp_server)
    broken = await aiohttp_server(make_fake_app(statuses=(500,), model="random:tiny"))
    h = await start_gateway(aiohttp_client, db_url, gateway={"backends": [{"url": live}],
        "shadow": [{"name": "wrong", "url": live, "model": "no-such-model"},
                   {"name": "broken", "url": str(broken.make_url("/v1")), "kind": "openai"}]})
    assert await _send(h, [*ALIASED, {"model": "random:tiny"}]) == [200] * 3
    mirrors = h.shadows.mirrors
    await wait_for(lambda: all(len(m.pairs) == 3 for m in mirrors.values()), timeout=30)
    listed = await _listed(h)
    wrong, failed = listed["wrong"], listed["broken"]
    assert wrong["failed"] == 3 and [(f["status"], f["code"], f["count"])
                                     for f in wrong["failures"]] == [(404, "model_not_found", 3)]
    assert "no-such-model" in wrong["failures"][0]["message"]
    assert failed["failed"] == 3 and [(f["status"], f["count"])
                                      for f in failed["failures"]] == [(500, 3)]
    assert "scripted status 500" in failed["failures"][0]["message"]
