"""A stream goes to its client in as few sends as its backend's reads allow: the response's
headers leave with the first event (not alone at `prepare`), and the read that ends with
`[DONE]` leaves with the end of the chunked body. Nothing the backend sends after `[DONE]`
reaches the client, and the request is still read to its end and settled as served."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web

from gateway.app import make_app
from gateway.backends import Job, Outcome
from gateway.config import GatewayConfig
from gateway.state import GATEWAY
from tests.gateway.helpers import SIM_ENGINE, ControlledBackend, create_tenants, post_raw
from tests.support.sends import record_sends
from tests.support.waiting import wait_for


@dataclass
class TwoReads(ControlledBackend):
    """Its stream arrives in two reads: the first token alone, then the other tokens with
    `[DONE]`; and, when `after_done`, a third read of bytes past the end (an engine's stray
    comment, say), which no client may see."""

    after_done: bytes = b""
    ended: list[str] = field(default_factory=list)

    async def stream(self, job: Job, outcome: Outcome) -> AsyncGenerator[bytes, None]:
        writer = job.writer()
        events = []
        for i in range(self.tokens_per_request):
            outcome.completion_tokens += 1
            outcome.finish_reason = "length" if i == self.tokens_per_request - 1 else None
            outcome.chunk_times.append(asyncio.get_running_loop().time())
            events.append(writer.chunk(f"t{i}", outcome.finish_reason))
        yield events[0]
        yield b"".join(events[1:]) + b"data: [DONE]\n\n"
        if self.after_done:
            yield self.after_done
        self.ended.append(job.tenant)  # read to its end: its connection could be kept


async def _stream_raw(key: str, port: int, model: str = "test-model",
                      **extra: Any) -> tuple[Any, bytes]:
    """A streamed chat request on a raw socket, read to the end of the chunked body: (the
    client socket's own address, everything received)."""
    reader, writer = await post_raw(port, "/v1/chat/completions", key, {
        "model": model, "stream": True, "max_tokens": 3,
        "messages": [{"role": "user", "content": "hi"}], **extra})
    received = b""
    async with asyncio.timeout(30):
        while not received.endswith(b"\r\n0\r\n\r\n"):
            data = await reader.read(65536)
            assert data, received
            received += data
    address = writer.get_extra_info("sockname")
    writer.close()
    return address, received


async def _serve(app: web.Application) -> tuple[web.AppRunner, int]:
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, runner.addresses[0][1]


@pytest.mark.parametrize("after_done", [b"", b": the engine's stray comment\n\n"])
async def test_a_stream_leaves_in_one_send_per_backend_read(
        db_url: str, monkeypatch: pytest.MonkeyPatch, after_done: bytes) -> None:
    keys = await create_tenants(db_url, {"acme": {}})
    backend = TwoReads(after_done=after_done)
    app = make_app(GatewayConfig(demo_tenant=False), database=db_url, backends=[backend])
    runner, port = await _serve(app)
    sends = record_sends(monkeypatch)
    try:
        client, received = await _stream_raw(keys["acme"], port)
        to_client = sends[client]
        assert len(to_client) == 2, to_client
        head, tail = to_client
        assert head.startswith(b"HTTP/1.1 200 OK\r\n")
        assert b"text/event-stream" in head and b'"t0"' in head and b'"t1"' not in head
        assert b'"t1"' in tail and b'"t2"' in tail
        assert tail.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")
        assert b"".join(to_client) == received
        assert b"stray" not in received
        await wait_for(lambda: backend.ended == ["acme"])
        served = {s.labels["status"]: s.value
                  for family in app[GATEWAY].metrics.registry.collect()
                  if family.name == "fairgate_gateway_requests"
                  for s in family.samples if s.name.endswith("_total")}
        assert served == {"200": 1.0}
    finally:
        await runner.cleanup()


async def test_the_embedded_engines_stream_leaves_in_one_send_per_token(
        db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine in the gateway's process: the headers and the role chunk go with the first
    token, the last token with the usage, [DONE] and the body's end."""
    keys = await create_tenants(db_url, {"acme": {}})
    app = make_app(GatewayConfig(demo_tenant=False), engine=SIM_ENGINE, database=db_url)
    runner, port = await _serve(app)
    try:
        await _stream_raw(keys["acme"], port, "random:tiny")  # the engine warm
        sends = record_sends(monkeypatch)
        client, received = await _stream_raw(keys["acme"], port, "random:tiny",
                                             stream_options={"include_usage": True})
        to_client = sends[client]
        assert len(to_client) == 3, to_client  # max_tokens 3
        assert b'"role":"assistant"' in to_client[0] and to_client[0].count(b"data: ") == 2
        assert to_client[1].count(b"data: ") == 1
        assert b'"finish_reason":"length"' in to_client[2] and b'"usage":{' in to_client[2]
        assert to_client[2].endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")
        assert b"".join(to_client) == received
    finally:
        await runner.cleanup()
