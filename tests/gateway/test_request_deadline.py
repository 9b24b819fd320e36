"""The gateway's own deadline (`request_timeout_s`) over a stream whose backend goes quiet: one
deadline covers the wait for the first event and every write after it (gateway/proxy.py's
`_stream`). Before the first byte it is an HTTP 504; after it, an SSE error event and [DONE].
Either way the backend's stream is closed and usage records a 504."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

import pytest

from gateway.backends import Job, Outcome
from tests.gateway.helpers import ControlledBackend, sse_events, start_gateway

pytestmark = pytest.mark.timeout(30)
DEADLINE = 0.3


@dataclass
class QuietAfter(ControlledBackend):
    """Streams `tokens` tokens, then waits for a release that never comes."""

    tokens: int = 0

    async def stream(self, job: Job, outcome: Outcome) -> AsyncGenerator[bytes, None]:
        writer = job.writer()
        self.started.append(job.tenant)
        try:
            for _ in range(self.tokens):
                outcome.completion_tokens += 1
                outcome.chunk_times.append(asyncio.get_running_loop().time())
                yield writer.chunk("x", None)
            await asyncio.Event().wait()  # quiet from here on
            yield b"data: [DONE]\n\n"
        finally:
            self.closed.append(job.tenant)


async def _stream(aiohttp_client: Any, db_url: str, backend: QuietAfter) -> tuple[Any, bytes, Any]:
    h = await start_gateway(aiohttp_client, db_url, backends=[backend],
                            gateway={"request_timeout_s": DEADLINE})
    resp = await h.client.post("/v1/completions", headers={
        "Authorization": f"Bearer {h.keys['acme']}"}, json={
        "model": "test-model", "prompt": "hi", "stream": True, "max_tokens": 8})
    return resp, await resp.read(), h


async def _settled_as_504(h: Any, backend: QuietAfter) -> None:
    assert backend.closed == ["acme"]  # the backend's stream was closed, its seat given back
    assert h.gateway.queue.tenants["acme"].running == 0
    await h.gateway.ledger.flush()
    assert (await h.gateway.ledger.totals("acme"))["by_status"] == {504: 1}
    assert h.gateway.metrics.registry.get_sample_value(
        "fairgate_gateway_requests_total", {"tenant": "acme", "status": "504"}) == 1


async def test_a_stream_with_no_first_event_by_the_deadline_is_an_http_504(
        aiohttp_client: Any, db_url: str) -> None:
    backend = QuietAfter(capacity_=2, tokens=0)
    resp, raw, h = await _stream(aiohttp_client, db_url, backend)
    assert resp.status == 504, raw
    assert resp.content_type == "application/json"  # no stream was started
    error = json.loads(raw)["error"]
    assert error["code"] == "timeout"
    assert f"within {DEADLINE:g} s" in error["message"]
    await _settled_as_504(h, backend)


async def test_a_stream_that_goes_quiet_after_its_first_token_ends_in_an_error_event(
        aiohttp_client: Any, db_url: str) -> None:
    backend = QuietAfter(capacity_=2, tokens=2)
    resp, raw, h = await _stream(aiohttp_client, db_url, backend)
    assert resp.status == 200 and resp.content_type == "text/event-stream", raw
    assert raw.endswith(b"data: [DONE]\n\n"), raw
    events = sse_events(raw)
    assert [e["choices"][0]["text"] for e in events[:-1]] == ["x", "x"]
    assert events[-1]["error"]["code"] == "timeout"
    assert f"within {DEADLINE:g} s" in events[-1]["error"]["message"]
    await _settled_as_504(h, backend)
