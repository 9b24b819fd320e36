"""The server over the real executor (random:tiny weights, byte-level tokenizer)."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient

from engine import EngineConfig
from engine.async_engine import AsyncEngine
from engine.server import make_app

pytestmark = pytest.mark.skipif(
    not (Path(__file__).parents[2] / "engine" / "runner.py").exists(),
    reason="engine/runner.py (TorchExecutor) is not there yet")


async def test_torch_engine_streams_the_same_text_as_a_whole_response(
        aiohttp_client: Callable[..., Awaitable[TestClient[web.Request, web.Application]]]) -> None:
    config = EngineConfig(model="random:tiny", executor="torch", device="cpu", max_model_len=128,
                          num_kv_blocks=32, max_num_batched_tokens=128, max_num_seqs=4)
    engine = AsyncEngine(config)
    client = await aiohttp_client(make_app(engine))
    # greedy and ignore_eos: a random model emits arbitrary bytes, many not valid UTF-8 alone
    body = {"prompt": "hello", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    whole = await (await client.post("/v1/completions", json=body)).json()
    assert whole["usage"]["completion_tokens"] == 12
    resp = await client.post("/v1/completions", json={**body, "stream": True})
    deltas = []
    async for line in resp.content:
        if line.startswith(b"data: {"):
            deltas.append(json.loads(line[6:])["choices"][0]["text"])
    assert "".join(deltas) == whole["choices"][0]["text"]
    # a split character would surface as U+FFFD inside one delta but not in the whole text
    assert sum(d.count("\ufffd") for d in deltas) == whole["choices"][0]["text"].count("\ufffd")
    load = await (await client.get("/load")).json()
    assert load["free_blocks"] == load["num_blocks"] == 32
