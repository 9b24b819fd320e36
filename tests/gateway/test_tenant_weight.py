"""The gateway tells the engine each tenant's weight (for the engine's `fair` policy)."""

from __future__ import annotations

import dataclasses
from typing import Any

from engine import LLMEngine
from engine.async_engine import AsyncEngine
from engine.policies import FairShareQueue
from engine.server import ENGINE_KEY
from engine.server import make_app as make_engine_app
from tests.gateway.helpers import SIM_ENGINE, collect, completion, start_gateway

FAIR_ENGINE = dataclasses.replace(SIM_ENGINE, policy="fair")
TENANTS = {"heavy": {"weight": 1.0}, "light": {"weight": 3.0}}


def fair_weights(engine: LLMEngine) -> dict[str, float]:
    queue = engine.scheduler.waiting
    assert isinstance(queue, FairShareQueue)
    return queue.weights


async def test_embedded_engine_receives_the_tenant_weight(aiohttp_client: Any,
                                                          db_url: str) -> None:
    h = await start_gateway(aiohttp_client, db_url, tenants=TENANTS, engine=FAIR_ENGINE)
    resp = await h.post("light", completion("hello", max_tokens=3))
    assert resp.status == 200, await resp.text()
    resp = await h.post("heavy", completion("hello", max_tokens=3, stream=True))
    assert [e async for e in collect(resp)]
    engine: LLMEngine = h.gateway.pool.primary.engine._engine
    assert engine.tenant_weights == {"light": 3.0, "heavy": 1.0}
    assert fair_weights(engine) == {"light": 3.0, "heavy": 1.0}


async def test_client_cannot_set_its_own_weight(aiohttp_client: Any, db_url: str) -> None:
    h = await start_gateway(aiohttp_client, db_url, tenants=TENANTS, engine=FAIR_ENGINE)
    resp = await h.post("heavy", completion("hello", max_tokens=3, tenant_weight=100.0))
    assert resp.status == 200, await resp.text()
    assert h.gateway.pool.primary.engine._engine.tenant_weights == {"heavy": 1.0}


async def test_fairgate_engine_server_receives_the_tenant_weight(
        aiohttp_client: Any, aiohttp_server: Any, db_url: str) -> None:
    app = make_engine_app(AsyncEngine(FAIR_ENGINE))
    server = await aiohttp_server(app)
    h = await start_gateway(aiohttp_client, db_url, tenants=TENANTS, gateway={
        "backends": [{"url": str(server.make_url("/v1"))}]})
    resp = await h.post("light", completion("hello", max_tokens=3, tenant_weight=100.0))
    assert resp.status == 200, await resp.text()
    resp = await h.post("heavy", completion("hello", max_tokens=3, stream=True))
    assert [e async for e in collect(resp)]
    engine: LLMEngine = app[ENGINE_KEY]._engine
    assert engine.tenant_weights == {"light": 3.0, "heavy": 1.0}
    assert fair_weights(engine) == {"light": 3.0, "heavy": 1.0}
