"""Every rejection path: 400, 401, 403, 404, 413, 429 (rate, tokens, queue full) with
Retry-After, queue timeout, disconnect while queued, disconnect while streaming."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tests.gateway.helpers import ControlledBackend, completion, start_gateway
from tests.support.waiting import wait_for


def body(**extra: Any) -> dict[str, Any]:
    return completion(model="test-model", **extra)


async def controlled(aiohttp_client: Any, db_url: str, limits: dict[str, Any] | None = None,
                     capacity: int = 1, **gateway: Any) -> Any:
    backend = ControlledBackend(capacity_=capacity)
    h = await start_gateway(aiohttp_client, db_url, backends=[backend], gateway=gateway,
                            tenants={"acme": {"limits": limits or {}}, "other": {}})
    return h, backend


async def error_of(resp: Any, status: int, code: str | None = None) -> dict[str, Any]:
    assert resp.status == status, await resp.text()
    err = (await resp.json())["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if code is not None:
        assert err["code"] == code
    return err


async def test_401_missing_and_invalid_key(aiohttp_client: Any, db_url: str) -> None:
    h, _ = await controlled(aiohttp_client, db_url)
    await error_of(await h.post(None, body()), 401, "missing_api_key")
    resp = await h.client.post("/v1/completions", json=body(),
                               headers={"Authorization": "Bearer fg-not-a-real-key"})
    err = await error_of(resp, 401, "invalid_api_key")
    assert err["type"] == "authentication_error"


@pytest.mark.parametrize(("payload", "code", "param"), [
    (b"{not json", "invalid_json", None),
    (b"", "invalid_json", None),
    (b"[1, 2]", "invalid_value", None),
    ({"model": 3, "prompt": "x"}, "invalid_value", "model"),
    ({"model": "m" * 300, "prompt": "x"}, "invalid_value", "model"),
    ({"model": "test-model"}, "invalid_value", "prompt"),
    ({"model": "test-model", "prompt": "x", "max_tokens": "5"}, "invalid_value", "max_tokens"),
    ({"model": "test-model", "prompt": "x", "max_tokens": 0}, "invalid_value", "max_tokens"),
    ({"model": "test-model", "prompt": "x", "temperature": 900}, "invalid_value", "temperature"),
    ({"model": "test-model", "prompt": "x", "stream": "yes"}, "invalid_value", "stream"),
    ({"model": "test-model", "prompt": "x", "n": 2}, "invalid_value", "n"),
    ({"model": "test-model", "prompt": "x", "stop": [1]}, "invalid_value", "stop"),
    ({"model": "test-model", "prompt": "x", "max_tokens": 600}, "context_length_exceeded",
     "max_tokens"),
    ({"model": "test-model", "prompt": "x" * 600}, "context_length_exceeded", "prompt"),
    ({"model": "test-model", "prompt": "x", "max_tokens": 3, "min_tokens": 4}, "invalid_value",
     "min_tokens"),
])
async def test_400s_name_the_problem(aiohttp_client: Any, db_url: str, payload: Any, code: str,
                                     param: str | None) -> None:
    h, _ = await controlled(aiohttp_client, db_url)
    err = await error_of(await h.post("acme", payload), 400, code)
    assert err["param"] == param and err["type"] == "invalid_request_error"


async def test_chat_400s(aiohttp_client: Any, db_url: str) -> None:
    h, _ = await controlled(aiohttp_client, db_url)
    for messages in ([], "hi", [{"role": "wizard", "content": "x"}], [{"role": "user",
                                                                      "content": 5}]):
        resp = await h.post("acme", {"model": "test-model", "messages": messages},
                            "/v1/chat/completions")
        await error_of(resp, 400)


async def test_404_unknown_model_and_413_huge_body(aiohttp_client: Any, db_url: str) -> None:
    h, _ = await controlled(aiohttp_client, db_url, max_body_bytes=1000)
    await error_of(await h.post("acme", completion(model="gpt-9")), 404, "model_not_found")
    await error_of(await h.post("acme", body(prompt="x" * 5000)), 413, "request_too_large")
    await error_of(await h.client.get("/nowhere"), 404)
    await error_of(await h.client.get("/v1/completions"), 405)


async def test_tenant_max_tokens_limit(aiohttp_client: Any, db_url: str) -> None:
    h, _ = await controlled(aiohttp_client, db_url, {"max_tokens": 10})
    await error_of(await h.post("acme", body(max_tokens=11)), 400, "max_tokens_exceeded")


async def test_429_requests_per_min_with_retry_after(aiohttp_client: Any, db_url: str) -> None:
    h, backend = await controlled(aiohttp_client, db_url, {"requests_per_min": 2})
    backend.release()
    for _ in range(2):
        assert (await h.post("acme", body())).status == 200
    resp = await h.post("acme", body())
    await error_of(resp, 429, "requests_per_min")
    assert 1 <= int(resp.headers["Retry-After"]) <= 60
    assert (await h.post("other", body())).status == 200  # other tenants are unaffected
    metrics = h.metrics()
    assert 'fairgate_gateway_rejections_total{reason="requests_per_min",tenant="acme"} 1.0' in metrics


async def test_429_tokens_per_min_charged_by_estimate(aiohttp_client: Any, db_url: str) -> None:
    h, backend = await controlled(aiohttp_client, db_url, {"tokens_per_min": 100})
    backend.release()
    assert (await h.post("acme", body(prompt="x" * 9, max_tokens=40))).status == 200
    # the first used 10 + 3 tokens: settled down from its estimate of 50
    assert h.gateway.limiter.usage("acme") == (1, 13)
    assert (await h.post("acme", body(prompt="x" * 9, max_tokens=70))).status == 200
    resp = await h.post("acme", body(prompt="x" * 9, max_tokens=80))  # 26 used + 90 > 100
    await error_of(resp, 429, "tokens_per_min")
    assert int(resp.headers["Retry-After"]) >= 1
    resp = await h.post("acme", body(prompt="x" * 9, max_tokens=200))
    await error_of(resp, 429, "request_too_large")  # more than the whole limit: never fits


async def test_429_queue_full_requests_and_tokens(aiohttp_client: Any, db_url: str) -> None:
    h, backend = await controlled(aiohttp_client, db_url,
                                  {"max_queued_requests": 2, "max_queued_tokens": 100})
    running = [asyncio.create_task(h.post("acme", body())) for _ in range(3)]
    await wait_for(lambda: h.gateway.queue.depth("acme")[0] == 2)
    resp = await h.post("acme", body())
    await error_of(resp, 429, "queue_requests")
    assert int(resp.headers["Retry-After"]) >= 1
    backend.release()
    assert [r.status for r in await asyncio.gather(*running)] == [200, 200, 200]
    backend.gate.clear()
    first = asyncio.create_task(h.post("acme", body(max_tokens=4)))
    await wait_for(lambda: backend.inflight == 1)
    queued = asyncio.create_task(h.post("acme", body(prompt="x" * 10, max_tokens=50)))
    await wait_for(lambda: h.gateway.queue.depth("acme")[0] == 1)
    assert h.gateway.queue.depth("acme")[1] > 50
    resp = await h.post("acme", body(prompt="x" * 10, max_tokens=50))  # over 100 with it
    await error_of(resp, 429, "queue_tokens")
    assert int(resp.headers["Retry-After"]) >= 1
    # alone over the bound: it never fits, so no Retry-After that cannot help
    resp = await h.post("acme", body(prompt="x" * 40, max_tokens=70))
    err = await error_of(resp, 429, "request_too_large")
    assert "max_queued_tokens (100)" in err["message"] and "Retry-After" not in resp.headers
    backend.release()
    assert [(await t).status for t in (first, queued)] == [200, 200]


async def test_queue_timeout_is_an_error_saying_so(aiohttp_client: Any, db_url: str) -> None:
    h, backend = await controlled(aiohttp_client, db_url, {"queue_timeout_s": 0.2})
    blocker = asyncio.create_task(h.post("acme", body()))
    await wait_for(lambda: backend.inflight == 1)
    resp = await h.post("acme", body())
    err = await error_of(resp, 503, "queue_timeout")
    assert "queue" in err["message"] and "Retry-After" in resp.headers
    assert h.gateway.queue.depth("acme") == (0, 0)
    backend.release()
    assert (await blocker).status == 200


async def test_disconnect_while_queued_removes_and_charges_nothing(
        aiohttp_client: Any, db_url: str) -> None:
    h, backend = await controlled(aiohttp_client, db_url, {"tokens_per_min": 1000})
    blocker = asyncio.create_task(h.post("acme", body()))
    await wait_for(lambda: backend.inflight == 1)
    waiting = asyncio.create_task(h.post("acme", body(max_tokens=100)))
    await wait_for(lambda: h.gateway.queue.depth("acme")[0] == 1)
    assert h.gateway.limiter.usage("acme") == (2, 2 * 6 + 104)
    waiting.cancel()  # the client hangs up
    await wait_for(lambda: h.gateway.queue.depth("acme")[0] == 0)
    assert h.gateway.limiter.usage("acme") == (1, 10)  # only the blocker, nothing for it
    backend.release()
    assert (await blocker).status == 200
    assert backend.started == ["acme"]  # the abandoned request never ran


async def test_disconnect_while_streaming_aborts_the_backend(
        aiohttp_client: Any, db_url: str) -> None:
    h, backend = await controlled(aiohttp_client, db_url)
    backend.tokens_per_request = 10_000
    backend.release()
    resp = await h.post("acme", body(stream=True))
    assert resp.status == 200
    await resp.content.readline()
    resp.close()  # hang up mid-stream
    await wait_for(lambda: backend.closed == ["acme"] and backend.inflight == 0)


async def test_embedded_engine_request_aborted_on_disconnect(
        aiohttp_client: Any, db_url: str) -> None:
    from engine import EngineConfig

    slow = EngineConfig(executor="sim", sim_clock="realtime", max_model_len=4096)
    h = await start_gateway(aiohttp_client, db_url, engine=slow)
    resp = await h.post("acme", completion(max_tokens=4000, stream=True))
    await resp.content.readline()
    engine = h.gateway.pool.primary.engine
    assert engine.load()["running"] == 1
    resp.close()
    await wait_for(lambda: engine.load()["running"] == 0, timeout=5)


async def test_backend_failure_is_503_with_retry_after(aiohttp_client: Any, db_url: str) -> None:
    h, backend = await controlled(aiohttp_client, db_url)
    backend.healthy = False
    resp = await h.post("acme", body())
    await error_of(resp, 503, "backend_unavailable")
    assert "Retry-After" in resp.headers
    assert (await h.client.get("/readyz")).status == 503


async def test_slow_client_body_times_out(aiohttp_client: Any, db_url: str) -> None:
    h, _ = await controlled(aiohttp_client, db_url, client_timeout_s=0.3)
    reader, writer = await asyncio.open_connection("127.0.0.1", h.client.server.port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n"
                 b"Authorization: Bearer " + h.keys["acme"].encode() + b"\r\n\r\n{\"mo")
    await writer.drain()  # ...and never sends the rest
    async with asyncio.timeout(5):
        status_line = await reader.readline()
    assert b" 408 " in status_line
    writer.close()
