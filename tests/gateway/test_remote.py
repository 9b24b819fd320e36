"""Remote backends: a `fairgate engine` server (with /load) and a plain OpenAI server."""

from __future__ import annotations

import json
from typing import Any

import pytest
from aiohttp import web

from engine.async_engine import AsyncEngine
from engine.server import make_app as make_engine_app
from tests.gateway.helpers import SIM_ENGINE, collect, completion, sse_events, start_gateway
from tests.support.processes import free_port
from tuner.fake_server import SCRIPT, make_fake_app


async def test_fairgate_engine_backend(aiohttp_client: Any, aiohttp_server: Any,
                                       db_url: str) -> None:
    server = await aiohttp_server(make_engine_app(AsyncEngine(SIM_ENGINE)))
    h = await start_gateway(aiohttp_client, db_url,
                            gateway={"backends": [{"url": str(server.make_url("/v1"))}]})
    backend = h.gateway.pool.primary
    assert backend.healthy and backend.load["max_num_seqs"] == 8
    resp = await h.post("acme", completion("hello", max_tokens=5))
    assert resp.status == 200, await resp.text()
    body = await resp.json()
    assert body["usage"]["completion_tokens"] == 5 and body["model"] == "random:tiny"
    resp = await h.post("acme", completion("hello", max_tokens=5, stream=True))
    events = [e async for e in collect(resp)]
    assert all(e["choices"] for e in events)  # the forced usage event is not passed on
    assert h.gateway.limiter.usage("acme") == (2, 22)  # settled with the engine's usage
    bad = await h.post("acme", completion(max_tokens=600))
    assert bad.status == 400  # counted with the byte tokenizer, checked before dispatch


async def test_openai_backend_passthrough_gets_salt(aiohttp_client: Any, aiohttp_server: Any,
                                                    db_url: str) -> None:
    fake = make_fake_app(model="fake-model")
    server = await aiohttp_server(fake)
    h = await start_gateway(aiohttp_client, db_url, gateway={
        "backends": [{"url": str(server.make_url("/")), "kind": "openai", "max_inflight": 2}]})
    resp = await h.post("acme", completion(model="fake-model", max_tokens=3, stream=True,
                                           stream_options={"include_usage": True}))
    events = [e async for e in collect(resp)]
    assert events[-1]["usage"]["completion_tokens"] == 3
    sent = fake[SCRIPT].received[-1]
    assert sent["cache_salt"] == "acme" and "priority" not in sent


@pytest.mark.parametrize("answered", ["fake-model", "fake-model-2025-01-01"])
async def test_a_whole_answer_names_the_model_the_client_asked_for(
        aiohttp_client: Any, aiohttp_server: Any, db_url: str, answered: str) -> None:
    """An answer that names the asked-for model goes on byte for byte as the backend wrote it
    (not decoded and encoded again); one naming another (an upstream's dated snapshot) is
    rewritten to the asked-for name, the rest of it unchanged."""
    sent = json.dumps({"id": "cmpl-1", "object": "text_completion", "model": answered,
                       "choices": [{"index": 0, "text": "héllo", "finish_reason": "length"}],
                       "usage": {"prompt_tokens": 2, "completion_tokens": 3,
                                 "total_tokens": 5}}).encode()  # spaced, \u-escaped

    async def completions(request: web.Request) -> web.Response:
        return web.Response(body=sent, content_type="application/json")

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake-model"}]})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    server = await aiohttp_server(app)
    h = await start_gateway(aiohttp_client, db_url, gateway={
        "backends": [{"url": str(server.make_url("/")), "kind": "openai",
                      "model": "fake-model"}]})
    resp = await h.post("acme", completion(model="fake-model", max_tokens=3))
    raw = await resp.read()
    assert resp.status == 200, raw
    if answered == "fake-model":
        assert raw == sent
    else:
        assert json.loads(raw) == {**json.loads(sent), "model": "fake-model"}
    assert h.gateway.limiter.usage("acme") == (1, 5)  # settled with the backend's usage


@pytest.mark.parametrize("line_end", ["\r\n", "\r"])
async def test_stream_from_a_backend_with_crlf_or_cr_line_ends(
        aiohttp_client: Any, aiohttp_server: Any, db_url: str, line_end: str) -> None:
    """sse-starlette (llama-cpp-python's server) ends SSE lines with CRLF: the client still gets
    every token and [DONE], and the tenant is charged the backend's reported usage."""
    fake = make_fake_app(model="fake-model", ttft=0.001, itl=0.001, line_end=line_end)
    server = await aiohttp_server(fake)
    h = await start_gateway(aiohttp_client, db_url, gateway={
        "backends": [{"url": str(server.make_url("/")), "kind": "openai"}]})
    for path, body in (("/v1/completions", completion(model="fake-model", max_tokens=4)),
                       ("/v1/chat/completions", {"model": "fake-model", "max_tokens": 4,
                                                 "messages": [{"role": "user", "content": "x"}]})):
        resp = await h.post("acme", {**body, "stream": True,
                                     "stream_options": {"include_usage": True}}, path=path)
        raw = await resp.read()
        assert resp.status == 200 and raw.endswith(b"data: [DONE]\n\n"), raw
        events = sse_events(raw)
        texts = [c.get("text") or c.get("delta", {}).get("content") or ""
                 for e in events for c in e["choices"]]
        assert "".join(texts) == "aaaa" and events[-1]["usage"]["completion_tokens"] == 4
    assert h.gateway.limiter.usage("acme")[0] == 2
    assert h.gateway.metrics.registry.get_sample_value(
        "fairgate_gateway_tokens_total", {"tenant": "acme", "direction": "out"}) == 8


async def test_backend_down_is_503_with_retry_after(aiohttp_client: Any, db_url: str) -> None:
    h = await start_gateway(aiohttp_client, db_url, gateway={
        "backends": [{"url": f"http://127.0.0.1:{free_port()}"}], "backend_retry_after_s": 7})
    resp = await h.post("acme", completion())
    assert resp.status == 503 and resp.headers["Retry-After"] == "7"
    assert (await resp.json())["error"]["code"] == "backend_unavailable"


async def test_backend_dies_mid_flight(aiohttp_client: Any, aiohttp_server: Any,
                                       db_url: str) -> None:
    server = await aiohttp_server(make_engine_app(AsyncEngine(SIM_ENGINE)))
    h = await start_gateway(aiohttp_client, db_url,
                            gateway={"backends": [{"url": str(server.make_url("/"))}]})
    await server.close()
    resp = await h.post("acme", completion())
    assert resp.status == 503 and "Retry-After" in resp.headers


async def test_stream_cut_mid_response_is_an_error_event_and_the_backend_stays_up(
        aiohttp_client: Any, aiohttp_server: Any, db_url: str) -> None:
    async def models(request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "m"}]})

    async def cut_off(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"id":"x","object":"text_completion","choices":[{"index":0,'
                         b'"text":"a","finish_reason":null}]}\n\n')
        assert request.transport is not None
        request.transport.close()  # the engine dies after the first token
        return resp

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", cut_off)
    server = await aiohttp_server(app)
    h = await start_gateway(aiohttp_client, db_url, gateway={
        "backends": [{"url": str(server.make_url("/")), "kind": "openai"}]})
    resp = await h.post("acme", completion(model="m", stream=True))
    events = [e async for e in collect(resp)]
    assert resp.status == 200 and events[0]["choices"][0]["text"] == "a"
    assert "failed mid-response" in events[-1]["error"]["message"]
    assert h.gateway.pool.primary.healthy  # one cut response does not turn everyone away
