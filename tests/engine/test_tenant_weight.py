"""A tenant's fair-share weight given with its requests (`tenant_weight`): LLMEngine, AsyncEngine
and the engine's HTTP API."""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.async_engine import AsyncEngine
from engine.policies import FairShareQueue
from engine.server import ENGINE_KEY, make_app
from tests.engine.test_policies import admission_order, engine_with

Client = TestClient[web.Request, web.Application]
MakeClient = Callable[..., Awaitable[Client]]


def fair_engine(**knobs: Any) -> LLMEngine:
    return engine_with("fair", **knobs)


def add(engine: LLMEngine, rid: str, tenant: str, at: float,
        tenant_weight: float | None = None) -> None:
    engine.add_request(rid, [7] * 10, SamplingParams(max_tokens=1), tenant=tenant,
                       arrival_time=at, tenant_weight=tenant_weight)


def fair_queue(engine: LLMEngine) -> FairShareQueue:
    queue = engine.scheduler.waiting
    assert isinstance(queue, FairShareQueue)
    return queue


def test_weight_given_with_requests_sets_the_fair_share() -> None:
    engine = fair_engine()
    for i in range(12):
        add(engine, f"a{i}", "a", i * 0.01, tenant_weight=1.0)
        add(engine, f"b{i}", "b", i * 0.01 + 0.001, tenant_weight=3.0)
    assert engine.tenant_weights == {"a": 1.0, "b": 3.0}
    assert fair_queue(engine).weights == {"a": 1.0, "b": 3.0}
    order = admission_order(engine)[:16]
    served_b = sum(1 for rid in order if rid.startswith("b"))
    assert 11 <= served_b <= 13  # ~3:1 while both are backlogged


def test_without_a_weight_the_share_is_even() -> None:
    engine = fair_engine()
    for i in range(12):
        add(engine, f"a{i}", "a", i * 0.01)
        add(engine, f"b{i}", "b", i * 0.01 + 0.001)
    assert engine.tenant_weights == {}
    order = admission_order(engine)[:16]
    assert sum(1 for rid in order if rid.startswith("b")) == 8


def test_the_latest_weight_wins_and_requests_without_one_keep_it() -> None:
    engine = fair_engine()
    add(engine, "r1", "a", 0.0, tenant_weight=2.0)
    add(engine, "r2", "a", 0.1, tenant_weight=5.0)
    add(engine, "r3", "a", 0.2)
    assert engine.tenant_weights == {"a": 5.0}
    assert fair_queue(engine).weights == {"a": 5.0}


def test_weights_survive_a_reconfiguration() -> None:
    engine = fair_engine()
    add(engine, "r1", "a", 0.0, tenant_weight=4.0)
    admission_order(engine)
    engine.reconfigure(EngineConfig(executor="sim", sim_model="tiny", policy="fair",
                                    max_num_seqs=2, max_num_batched_tokens=4096,
                                    max_model_len=4096, num_kv_blocks=1024))
    assert fair_queue(engine).weights == {"a": 4.0}


@pytest.mark.parametrize("weight", [0, 0.0, -1.0, math.inf, -math.inf, math.nan, True, "3",
                                    10**400, [2.0]])
def test_bad_weight_is_a_value_error_and_changes_nothing(weight: Any) -> None:
    engine = fair_engine()
    add(engine, "ok", "a", 0.0, tenant_weight=2.0)
    with pytest.raises(ValueError, match="tenant weight"):
        add(engine, "bad", "a", 0.1, tenant_weight=weight)
    assert engine.get_request("bad") is None
    assert engine.tenant_weights == {"a": 2.0}
    assert fair_queue(engine).weights == {"a": 2.0}
    assert admission_order(engine) == ["ok"]


def test_other_policies_record_the_weight() -> None:
    engine = engine_with("priority")
    add(engine, "r1", "a", 0.0, tenant_weight=2.0)
    assert engine.tenant_weights == {"a": 2.0}  # applied if the policy becomes `fair`


async def test_async_engine_passes_the_weight_through() -> None:
    engine = AsyncEngine(EngineConfig(executor="sim", sim_model="tiny", policy="fair",
                                      max_model_len=1024, num_kv_blocks=256))
    await engine.start()
    try:
        outputs = [o async for o in engine.generate("r1", [5, 6], SamplingParams(max_tokens=2),
                                                    tenant="t", tenant_weight=2.5)]
        assert outputs[-1].finished
        with pytest.raises(ValueError, match="tenant weight"):
            async for _ in engine.generate("r2", [5, 6], SamplingParams(max_tokens=2),
                                           tenant="t", tenant_weight=-1.0):
                pass
        llm = engine._engine
        assert llm.tenant_weights == {"t": 2.5}
        assert fair_queue(llm).weights == {"t": 2.5}
    finally:
        await engine.shutdown()


# ---- HTTP ------------------------------------------------------------------------------------
@pytest.fixture
async def client(aiohttp_client: MakeClient) -> Client:
    config = EngineConfig(executor="sim", sim_model="tiny", policy="fair", max_model_len=1024,
                          num_kv_blocks=256, max_num_batched_tokens=1024, max_num_seqs=64)
    return await aiohttp_client(make_app(AsyncEngine(config)))


def llm_of(client: Client) -> LLMEngine:
    return client.app[ENGINE_KEY]._engine  # type: ignore[index, no-any-return]


@pytest.mark.parametrize("weight", [0, -2, -0.5, "3", True, [1], {"w": 1}, 10**400])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_bad_tenant_weight_is_400(client: Client, path: str, weight: Any) -> None:
    body = {"prompt": "x", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
            "tenant": "t", "tenant_weight": weight}
    resp = await client.post(path, json=body)
    assert resp.status == 400, await resp.text()
    error = (await resp.json())["error"]
    assert error["param"] == "tenant_weight" and error["type"] == "invalid_request_error"
    assert error["message"]
    assert llm_of(client).tenant_weights == {}


@pytest.mark.parametrize("body", [b'{"prompt": "x", "tenant_weight": NaN}',
                                  b'{"prompt": "x", "tenant_weight": Infinity}'])
async def test_non_finite_tenant_weight_is_400(client: Client, body: bytes) -> None:
    resp = await client.post("/v1/completions", data=body,
                             headers={"Content-Type": "application/json"})
    assert resp.status == 400
    assert "error" in await resp.json()
    assert llm_of(client).tenant_weights == {}


@pytest.mark.parametrize("stream", [False, True])
async def test_good_tenant_weight_is_accepted(client: Client, stream: bool) -> None:
    resp = await client.post("/v1/completions", json={
        "prompt": "x", "max_tokens": 2, "tenant": "t", "tenant_weight": 2.5, "stream": stream})
    assert resp.status == 200, await resp.text()
    await resp.read()
    resp = await client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "tenant": "u",
        "tenant_weight": 3})
    assert resp.status == 200, await resp.text()
    llm = llm_of(client)
    assert llm.tenant_weights == {"t": 2.5, "u": 3.0}
    assert fair_queue(llm).weights == {"t": 2.5, "u": 3.0}


async def test_null_tenant_weight_is_no_weight(client: Client) -> None:
    resp = await client.post("/v1/completions", json={
        "prompt": "x", "max_tokens": 2, "tenant": "t", "tenant_weight": None})
    assert resp.status == 200, await resp.text()
    assert llm_of(client).tenant_weights == {}
