"""Bad input is a 4xx in OpenAI's error shape, never a 500; a hypothesis fuzz proves it."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.async_engine import AsyncEngine
from engine.server import make_app
from tests.support.engines import sim_config

Client = TestClient[web.Request, web.Application]
ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture
async def client(aiohttp_client: Callable[..., Awaitable[Client]]) -> Client:
    return await aiohttp_client(make_app(AsyncEngine(sim_config()), client_max_size=4096))


async def assert_openai_error(resp: Any, status: int, param: str | None = None,
                              code: str | None = None) -> None:
    assert resp.status == status, await resp.text()
    error = (await resp.json())["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param
    if code is not None:
        assert error["code"] == code


@pytest.mark.parametrize(("path", "body", "status", "param"), [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", b'{"prompt": "\xff\xfe"}', 400, None),  # invalid UTF-8
    ("/v1/completions", b'{"prompt": "\\ud800"}', 400, None),  # lone surrogate
    ("/v1/completions", b'{"prompt": "x", "temperature": NaN}', 400, None),
    ("/v1/completions", b"[" * 5000 + b"]" * 5000, 413, None),  # over client_max_size
    ("/v1/completions", json.dumps({"max_tokens": 3}).encode(), 400, "prompt"),
    ("/v1/completions", json.dumps({"prompt": 5}).encode(), 400, "prompt"),
    ("/v1/completions", json.dumps({"prompt": []}).encode(), 400, "prompt"),
    ("/v1/completions", json.dumps({"prompt": ["a", "b"]}).encode(), 400, "prompt"),
    ("/v1/completions", json.dumps({"prompt": [-1]}).encode(), 400, None),
    ("/v1/completions", json.dumps({"prompt": "x", "max_tokens": -3}).encode(), 400, "max_tokens"),
    ("/v1/completions", json.dumps({"prompt": "x", "max_tokens": "9"}).encode(), 400, "max_tokens"),
    ("/v1/completions", json.dumps({"prompt": "x", "max_tokens": True}).encode(), 400,
     "max_tokens"),
    ("/v1/completions", json.dumps({"prompt": "x", "temperature": "hot"}).encode(), 400,
     "temperature"),
    ("/v1/completions", json.dumps({"prompt": "x", "top_p": 0}).encode(), 400, None),
    ("/v1/completions", json.dumps({"prompt": "x", "stop": [1]}).encode(), 400, "stop"),
    ("/v1/completions", json.dumps({"prompt": "x", "stream": "yes"}).encode(), 400, "stream"),
    ("/v1/completions", json.dumps({"prompt": "x", "stream_options": 3}).encode(), 400,
     "stream_options"),
    ("/v1/completions", json.dumps({"prompt": "x", "n": 2}).encode(), 400, "n"),
    ("/v1/completions", json.dumps({"prompt": "x", "logprobs": 3}).encode(), 400, "logprobs"),
    ("/v1/completions", json.dumps({"prompt": "x", "priority": "vip"}).encode(), 400, "priority"),
    ("/v1/completions", json.dumps({"prompt": "x", "tenant": 7}).encode(), 400, "tenant"),
    ("/v1/completions", json.dumps({"prompt": "x", "seed": 2**64}).encode(), 400, "seed"),
    ("/v1/completions", json.dumps({"prompt": "x", "min_tokens": 9, "max_tokens": 2}).encode(),
     400, None),
    ("/v1/chat/completions", json.dumps({"max_tokens": 3}).encode(), 400, "messages"),
    ("/v1/chat/completions", json.dumps({"messages": []}).encode(), 400, "messages"),
    ("/v1/chat/completions", json.dumps({"messages": ["hi"]}).encode(), 400, "messages[0]"),
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "king", "content": "x"}]}).encode(),
     400, "messages[0].role"),
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": 5}]}).encode(),
     400, "messages[0].content"),
])
async def test_bad_requests(client: Client, path: str, body: bytes, status: int,
                            param: str | None) -> None:
    resp = await client.post(path, data=body, headers={"Content-Type": "application/json"})
    await assert_openai_error(resp, status, param)


@pytest.mark.parametrize("path", ENDPOINTS)
async def test_unknown_model_is_404(client: Client, path: str) -> None:
    resp = await client.post(path, json={"model": "gpt-9", "prompt": "x", "messages": CHAT})
    await assert_openai_error(resp, 404, "model", "model_not_found")


@pytest.mark.parametrize("max_tokens", [256, 10**30])
async def test_too_long_is_context_length_exceeded(client: Client, max_tokens: int) -> None:
    resp = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": max_tokens})
    await assert_openai_error(resp, 400, "max_tokens", "context_length_exceeded")
    resp = await client.post("/v1/chat/completions", json={"messages": [
        {"role": "user", "content": "x" * 300}]})
    await assert_openai_error(resp, 400, None, "context_length_exceeded")


async def test_unknown_route_and_wrong_method(client: Client) -> None:
    await assert_openai_error(await client.get("/v1/nothing"), 404)
    resp = await client.get("/v1/completions")
    await assert_openai_error(resp, 405)
    assert "POST" in resp.headers["Allow"]


# ---- fuzz ------------------------------------------------------------------------------------
TEXTS = st.text(max_size=12) | st.text(alphabet=st.characters(categories=["Cs", "L", "N"]),
                                      max_size=12)  # lone surrogates: unencodable
JSON_LEAVES = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | TEXTS
JSON_VALUES = st.recursive(JSON_LEAVES, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
    st.text(max_size=8), inner, max_size=3), max_leaves=8)
FIELDS = ("model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature",
          "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos", "min_tokens",
          "presence_penalty", "frequency_penalty", "repetition_penalty", "stream",
          "stream_options", "n", "best_of", "echo", "logprobs", "priority", "tenant", "user")
PLAUSIBLE = {
    "model": st.just("random:tiny") | JSON_LEAVES,
    "prompt": st.text(max_size=20) | st.lists(st.integers(-5, 600), max_size=5) | JSON_VALUES,
    "messages": st.lists(st.fixed_dictionaries({
        "role": st.sampled_from(["user", "system", "assistant", "bot"]) | JSON_LEAVES,
        "content": st.text(max_size=10) | JSON_VALUES}), max_size=3) | JSON_VALUES,
    "max_tokens": st.integers(-2, 300) | JSON_LEAVES,
    "stream": st.booleans() | JSON_LEAVES,
    "stream_options": st.fixed_dictionaries({"include_usage": JSON_LEAVES}) | JSON_LEAVES,
}
BODIES = st.dictionaries(st.sampled_from(FIELDS), JSON_VALUES, max_size=8).flatmap(
    lambda extra: st.fixed_dictionaries(
        {}, optional={k: v for k, v in PLAUSIBLE.items()}).map(lambda b: {**extra, **b}))


def test_fuzzed_bodies_never_get_a_500() -> None:
    loop = asyncio.new_event_loop()
    client: Client = TestClient(TestServer(make_app(AsyncEngine(sim_config()))), loop=loop)
    loop.run_until_complete(client.start_server())

    async def post(path: str, body: Any) -> None:
        resp = await client.post(path, data=json.dumps(body, allow_nan=True).encode())
        text = await resp.text()
        assert resp.status != 500 and resp.status < 600, text
        if resp.status >= 400:
            error = json.loads(text)["error"]
            assert set(error) == {"message", "type", "param", "code"}

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
    @given(path=st.sampled_from(ENDPOINTS), body=BODIES | JSON_VALUES)
    def check(path: str, body: Any) -> None:
        loop.run_until_complete(post(path, body))

    try:
        check()
        load = loop.run_until_complete(client.get("/load"))
        assert loop.run_until_complete(load.json())["kv_usage"] == 0.0
    finally:
        loop.run_until_complete(client.close())
        loop.close()
