"""The engine HTTP server: OpenAI API (official client too), load, stats, metrics, admission,
disconnects and live reconfiguration."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Awaitable, Callable
from typing import Any

import openai
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient

from engine import EngineConfig
from engine.async_engine import AsyncEngine
from engine.server import ENGINE_KEY, make_app
from tests.support.engines import realtime_config, sim_config
from tests.support.waiting import wait_for

Client = TestClient[web.Request, web.Application]
MakeClient = Callable[..., Awaitable[Client]]


# room for the longer prompts and the many streams these tests send
ROOMY: dict[str, Any] = {"max_model_len": 1024, "num_kv_blocks": 256,
                         "max_num_batched_tokens": 1024, "max_num_seqs": 64}


def realtime(**changes: Any) -> EngineConfig:
    return realtime_config(**{**ROOMY, **changes})


@pytest.fixture
async def client(aiohttp_client: MakeClient) -> Client:
    return await aiohttp_client(make_app(AsyncEngine(sim_config(**ROOMY, metrics_compat="vllm"))))


def engine_of(client: Client) -> AsyncEngine:
    return client.app[ENGINE_KEY]  # type: ignore[index]


async def sse_events(response: Any) -> list[Any]:
    events = []
    async for line in response.content:
        if line.startswith(b"data: "):
            data = line[6:].strip()
            events.append("[DONE]" if data == b"[DONE]" else json.loads(data))
    return events


def running_and_waiting(engine: AsyncEngine) -> tuple[int, int]:
    load = engine.load()  # one snapshot: both counts from the same step
    return load["running"], load["waiting"]


async def wait_idle(engine: AsyncEngine) -> None:
    await wait_for(lambda: running_and_waiting(engine) == (0, 0))


def assert_blocks_free(engine: AsyncEngine) -> None:
    load = engine.load()
    assert load["free_blocks"] == load["num_blocks"] and load["kv_usage"] == 0.0


# ---- OpenAI API ------------------------------------------------------------------------------
async def test_completion_whole_response(client: Client) -> None:
    resp = await client.post("/v1/completions",
                             json={"model": "random:tiny", "prompt": "hello", "max_tokens": 7})
    assert resp.status == 200
    body = await resp.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length" and len(choice["text"]) == 7
    assert body["usage"] == {"prompt_tokens": 6, "completion_tokens": 7, "total_tokens": 13}


async def test_completion_token_prompt_and_vllm_fields(client: Client) -> None:
    resp = await client.post("/v1/completions", json={
        "prompt": [[72, 105]], "max_tokens": 4, "ignore_eos": True, "min_tokens": 2,
        "top_k": -1, "seed": 7, "priority": "batch", "tenant": "acme", "temperature": 0})
    assert resp.status == 200
    assert (await resp.json())["usage"]["prompt_tokens"] == 2


async def test_streamed_completion_framing_and_usage(client: Client) -> None:
    resp = await client.post("/v1/completions", json={
        "prompt": "hi", "max_tokens": 5, "stream": True,
        "stream_options": {"include_usage": True}})
    assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
    events = await sse_events(resp)
    assert events[-1] == "[DONE]"
    usage_chunk = events[-2]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 5
    chunks = events[:-2]
    assert all(c["usage"] is None for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert len("".join(c["choices"][0]["text"] for c in chunks)) == 5


async def test_streamed_chat_has_role_then_content(client: Client) -> None:
    resp = await client.post("/v1/chat/completions", json={
        "messages": [{"role": "system", "content": "be brief"},
                     {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        "max_tokens": 4, "stream": True})
    events = await sse_events(resp)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert events[-2]["choices"][0]["finish_reason"] == "length" and events[-1] == "[DONE]"
    assert "usage" not in events[0]


async def test_stop_strings_over_http(client: Client) -> None:
    # sim tokens are letters and spaces; one of five vowels in 200 tokens is all but certain
    stops = ["a", "e", "i", "o", "u"]
    out = await (await client.post("/v1/completions", json={
        "prompt": "abc", "max_tokens": 200, "stop": stops})).json()
    text = out["choices"][0]["text"]
    assert out["choices"][0]["finish_reason"] == "stop"
    assert not any(s in text for s in stops)
    assert out["usage"]["completion_tokens"] == len(text) + 1  # the stop's token is counted


async def test_chat_template_from_tokenizer_is_rendered(client: Client) -> None:
    tokenizer = engine_of(client).tokenizer
    tokenizer.chat_template = (  # type: ignore[attr-defined]
        "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
        "{% if add_generation_prompt %}[assistant]{% endif %}")
    resp = await client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hey"}], "max_tokens": 1})
    assert (await resp.json())["usage"]["prompt_tokens"] == len("[user]hey[assistant]")
    tokenizer.chat_template = "{{ raise_exception('no system role') }}"  # type: ignore[attr-defined]
    resp = await client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hey"}], "max_tokens": 1})
    assert resp.status == 400 and "no system role" in (await resp.json())["error"]["message"]


async def test_models_health_ready(client: Client) -> None:
    models = await (await client.get("/v1/models")).json()
    assert models["data"][0]["id"] == "random:tiny" and models["object"] == "list"
    assert (await client.get("/healthz")).status == 200
    ready = await (await client.get("/readyz")).json()
    assert ready["status"] == "ready" and ready["reconfiguring"] is False


async def test_official_openai_client(client: Client) -> None:
    api = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="x", max_retries=0)
    try:
        done = await api.completions.create(model="random:tiny", prompt="hello", max_tokens=5)
        assert done.choices[0].finish_reason == "length" and done.usage is not None
        assert done.usage.completion_tokens == 5
        chat = await api.chat.completions.create(
            model="random:tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6)
        assert chat.choices[0].message.role == "assistant"
        assert len(chat.choices[0].message.content or "") == 6
        stream = await api.chat.completions.create(
            model="random:tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6,
            stream=True, stream_options={"include_usage": True})
        parts = [c async for c in stream]
        assert len("".join(c.choices[0].delta.content or "" for c in parts if c.choices)) == 6
        assert parts[-1].usage is not None and parts[-1].usage.completion_tokens == 6
        text_stream = await api.completions.create(model="random:tiny", prompt="hello",
                                                   max_tokens=5, stream=True)
        assert len("".join([c.choices[0].text async for c in text_stream])) == 5
        with pytest.raises(openai.NotFoundError):
            await api.completions.create(model="gpt-4", prompt="x", max_tokens=1)
        with pytest.raises(openai.BadRequestError) as info:
            await api.completions.create(model="random:tiny", prompt="x", max_tokens=10**6)
        assert info.value.code == "context_length_exceeded"
        assert [m.id async for m in api.models.list()] == ["random:tiny"]
    finally:
        await api.close()


# ---- load, stats, metrics --------------------------------------------------------------------
async def test_load_stats_and_metrics(client: Client) -> None:
    for _ in range(3):
        await client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 5})
    load = await (await client.get("/load")).json()
    assert {"running", "waiting", "swapped", "kv_usage", "free_blocks", "num_blocks",
            "max_num_batched_tokens", "max_num_seqs"} <= set(load)
    assert load["free_blocks"] == load["num_blocks"] == 256
    stats = await (await client.get("/stats?window=60&slo_ttft=10&slo_tpot=10&slo_itl=10")
                   ).json()
    assert stats["ttft"]["count"] == 3 and stats["itl"]["count"] == 12
    assert stats["goodput"]["requests"] == 3 and stats["goodput"]["fraction"] == 1.0
    assert stats["itl_attainment"] == {"slo_itl": 10.0, "gaps": 12, "met": 12, "fraction": 1.0}
    gaps = await (await client.get("/stats?slo_itl=0")).json()  # per gap: no request's miss
    assert gaps["goodput"]["requests"] == 3 and gaps["itl_attainment"]["met"] == 0
    assert (await (await client.get("/stats?slo_tpot=0")).json())["goodput"]["requests"] == 0
    assert stats["throughput"]["output_tokens_per_s"] > 0
    assert {"e2e", "queue_time", "tpot", "preemptions", "rejections"} <= set(stats)
    strict = await (await client.get("/stats?slo_ttft=0")).json()
    assert strict["goodput"]["requests"] == 0
    for bad in ("window=abc", "window=-1", "window=0", "slo_ttft=nan", "slo_tpot=-1",
                "slo_itl=x"):
        resp = await client.get(f"/stats?{bad}")
        assert resp.status == 400 and "error" in await resp.json()
    text = await (await client.get("/metrics")).text()
    for name in ("fairgate_engine_requests_running", "fairgate_engine_kv_cache_usage_ratio",
                 "fairgate_engine_time_to_first_token_seconds_bucket",
                 "fairgate_engine_inter_token_latency_seconds_count",
                 "fairgate_engine_step_time_seconds_count", "fairgate_engine_tokens_per_step_sum",
                 "fairgate_engine_prefix_cache_queries_total", "fairgate_engine_preemptions_total",
                 'fairgate_engine_requests_finished_total{finished_reason="length"',
                 "vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:time_to_first_token_seconds_bucket",
                 "vllm:generation_tokens_total", "vllm:prompt_tokens_total"):
        assert name in text, name
    assert 'fairgate_engine_generation_tokens_total{model_name="random:tiny"} 15.0' in text


async def test_metrics_without_compat_and_apps_side_by_side(aiohttp_client: MakeClient) -> None:
    first = await aiohttp_client(make_app(AsyncEngine(sim_config(**ROOMY))))
    second = await aiohttp_client(make_app(AsyncEngine(sim_config(**ROOMY))))
    await first.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
    one, two = [await (await c.get("/metrics")).text() for c in (first, second)]
    assert "vllm:" not in one
    assert "fairgate_engine_prompt_tokens_total" in one
    assert 'fairgate_engine_requests_finished_total{finished_reason="length"' not in two


# ---- admission -------------------------------------------------------------------------------
async def test_full_queue_is_503_with_retry_after(aiohttp_client: MakeClient) -> None:
    engine = AsyncEngine(realtime(max_waiting_requests=1, max_num_seqs=1,
                                  max_num_batched_tokens=1024))
    client = await aiohttp_client(make_app(engine))
    body = {"prompt": "x", "max_tokens": 200}
    busy = []
    for _ in range(2):  # one running, then one waiting (each in before the next is sent)
        busy.append(asyncio.ensure_future(client.post("/v1/completions", json=body)))
        await wait_for(lambda: running_and_waiting(engine) == (1, len(busy) - 1))
    resp = await client.post("/v1/completions", json=body)
    assert resp.status == 503 and int(resp.headers["Retry-After"]) >= 1
    assert (await resp.json())["error"]["code"] == "engine_overloaded"
    assert [r.status for r in await asyncio.gather(*busy)] == [200, 200]
    stats = await (await client.get("/stats")).json()
    assert stats["rejections"]["by_reason"]["overloaded"] == 1


# ---- disconnects -----------------------------------------------------------------------------
async def test_hundred_streams_half_disconnect(aiohttp_client: MakeClient) -> None:
    engine = AsyncEngine(realtime(num_kv_blocks=512, max_num_seqs=128,
                                  max_num_batched_tokens=2048))
    client = await aiohttp_client(make_app(engine))
    rng = random.Random(5)

    async def one(i: int) -> str | None:
        resp = await client.post("/v1/completions", json={
            "prompt": f"request {i} " * rng.randint(1, 20), "max_tokens": 60, "stream": True})
        assert resp.status == 200
        leave_after = rng.randint(0, 30) if i % 2 else None
        events = 0
        async for line in resp.content:
            if line.startswith(b"data: "):
                events += 1
                if leave_after is not None and events > leave_after:
                    resp.close()  # drop the connection mid-stream
                    return None
                if line.strip() == b"data: [DONE]":
                    return "done"
        return "eof"

    results = await asyncio.gather(*(one(i) for i in range(100)))
    assert results.count("done") == 50
    await wait_idle(engine)
    assert_blocks_free(engine)
    resp = await client.post("/v1/completions", json={"prompt": "after", "max_tokens": 8})
    assert resp.status == 200 and (await resp.json())["usage"]["completion_tokens"] == 8
    reasons = (await (await client.get("/stats")).json())["requests"]["by_reason"]
    assert reasons["length"] >= 51 and 0 < reasons.get("abort", 0) <= 50, reasons


# ---- reconfiguration -------------------------------------------------------------------------
async def test_reconfigure_under_load(aiohttp_client: MakeClient) -> None:
    engine = AsyncEngine(realtime())
    client = await aiohttp_client(make_app(engine))

    async def stream(prompt: str, max_tokens: int) -> list[Any]:
        resp = await client.post("/v1/completions", json={
            "prompt": prompt, "max_tokens": max_tokens, "stream": True})
        assert resp.status == 200
        return await sse_events(resp)

    running = [asyncio.ensure_future(stream(f"old {i}", 80)) for i in range(20)]
    await wait_for(lambda: engine.load()["running"] == 20)  # all of them generating
    reconfig = asyncio.ensure_future(client.post("/admin/reconfigure", json={
        "changes": {"max_num_seqs": 4, "max_num_batched_tokens": 256}}))
    await wait_for(lambda: engine.load()["reconfiguring"])  # draining: newcomers wait
    newcomers = [asyncio.ensure_future(stream(f"new {i}", 10)) for i in range(10)]
    resp = await reconfig
    assert resp.status == 200, await resp.text()
    answer = await resp.json()
    assert answer["config"]["max_num_seqs"] == 4 and answer["drain_time_s"] > 0
    for events in await asyncio.gather(*running):
        assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
    for events in await asyncio.gather(*newcomers):
        assert events[-2]["choices"][0]["finish_reason"] == "length"
    load = await (await client.get("/load")).json()
    assert load["max_num_seqs"] == 4 and load["max_num_batched_tokens"] == 256
    assert_blocks_free(engine)


async def test_reconfigure_abort_running_ends_streams_cleanly(aiohttp_client: MakeClient) -> None:
    engine = AsyncEngine(realtime())
    client = await aiohttp_client(make_app(engine))
    resp = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 900,
                                                      "stream": True})
    await resp.content.readline()
    answer = await client.post("/admin/reconfigure", json={"max_num_seqs": 8,
                                                           "abort_running": True})
    assert answer.status == 200
    events = await sse_events(resp)
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "abort"
    assert_blocks_free(engine)


@pytest.mark.parametrize("body", [
    {"changes": {"no_such_knob": 1}},
    {"changes": {"model": "random:small"}},
    {"changes": {"max_num_seqs": -1}},
    {"changes": {"memory_fraction": "high"}},
    {"changes": {}},
    {"changes": [1]},
    {"max_num_seqs": 4, "abort_running": "yes"},
    {"max_num_seqs": 4, "drain_timeout": -1},
])
async def test_bad_reconfigure_is_400(client: Client, body: dict[str, Any]) -> None:
    resp = await client.post("/admin/reconfigure", json=body)
    assert resp.status == 400
    assert set((await resp.json())["error"]) == {"message", "type", "param", "code"}
