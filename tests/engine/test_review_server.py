"""Review of the async engine and the engine server: stream routing, bad input."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestClient

from engine import EngineConfig, SamplingParams
from engine.async_engine import AsyncEngine
from engine.server import make_app

Client = TestClient[web.Request, web.Application]


def sim_config(**changes: Any) -> EngineConfig:
    base: dict[str, Any] = dict(executor="sim", sim_model="tiny", max_model_len=2048,
                                num_kv_blocks=512, max_num_batched_tokens=2048, max_num_seqs=16,
                                sim_clock="realtime", sim_hardware="cpu")
    base.update(changes)
    return EngineConfig(**base)


async def test_reused_request_id_does_not_receive_the_abandoned_streams_outputs() -> None:
    # A client leaves "x" and a new "x" starts at once: the old request's abort (and any of
    # its outputs still on the way) must not land in the new stream.
    engine = AsyncEngine(sim_config())
    await engine.start()
    try:
        old = engine.generate("x", [1, 2, 3], SamplingParams(max_tokens=500))
        await anext(old)
        await old.aclose()
        outs = [o async for o in engine.generate("x", [1, 2, 3], SamplingParams(max_tokens=5))]
        assert [o.num_output_tokens for o in outs] == [1, 2, 3, 4, 5]
        assert outs[-1].finish_reason == "length"
    finally:
        await engine.shutdown()
    load = engine.load()
    assert load["free_blocks"] == load["num_blocks"]


async def test_seed_beyond_int64_is_a_400(
        aiohttp_client: Callable[..., Awaitable[Client]]) -> None:
    client = await aiohttp_client(make_app(AsyncEngine(sim_config(sim_clock="virtual"))))
    resp = await client.post("/v1/completions", json={"prompt": "x", "seed": 2**64})
    assert resp.status == 400, await resp.text()
    assert "seed" in (await resp.json())["error"]["message"]
