"""A stream the client closes as soon as it has read `[DONE]` was served: the usage ledger,
the metrics and the SLO counts record it as 200, not as a client that went away (499)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

import aiohttp
import pytest
from aiohttp import web

from gateway.app import make_app
from gateway.backends import Job, Outcome
from gateway.config import GatewayConfig
from gateway.state import GATEWAY
from tests.gateway.helpers import ControlledBackend, create_tenants, post_raw
from tests.support.waiting import wait_for


@dataclass
class EndsAfterDone(ControlledBackend):
    """Its stream ends only when the test says, after `[DONE]` went out (as a remote engine's
    stream ends with the bytes after it): the client's close then lands between the two."""

    ended: asyncio.Event = field(default_factory=asyncio.Event)

    async def stream(self, job: Job, outcome: Outcome) -> AsyncGenerator[bytes, None]:
        async for chunk in super().stream(job, outcome):
            yield chunk
        await self.ended.wait()


async def _read_to_done(key: str, port: int) -> bytes:
    """Send a streamed completion on a raw socket, read to `[DONE]`, close at once."""
    reader, writer = await post_raw(port, "/v1/completions", key, {
        "model": "test-model", "prompt": "hi", "max_tokens": 3, "stream": True})
    received = b""
    async with asyncio.timeout(30):
        while b"data: [DONE]\n\n" not in received:
            data = await reader.read(65536)
            assert data, received
            received += data
    writer.close()
    return received


def _recorded(app: web.Application) -> dict[str, float]:
    """Status -> requests, as the gateway's metrics count them."""
    return {sample.labels["status"]: sample.value
            for family in app[GATEWAY].metrics.registry.collect()
            if family.name == "fairgate_gateway_requests"
            for sample in family.samples if sample.name.endswith("_total")}


async def _serve(app: web.Application, handler_cancellation: bool) -> web.AppRunner:
    runner = web.AppRunner(app, handler_cancellation=handler_cancellation)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner


# with handler_cancellation (as `fairgate serve` runs) the close cancels the handler while the
# stream is still ending; without, the end of the chunked body meets a closing transport
@pytest.mark.parametrize("handler_cancellation", [True, False])
async def test_a_client_closing_right_after_done_is_recorded_as_served(
        db_url: str, handler_cancellation: bool) -> None:
    keys = await create_tenants(db_url, {"acme": {}})
    backend = EndsAfterDone()
    backend.release()
    app = make_app(GatewayConfig(demo_tenant=False), database=db_url, backends=[backend])
    runner = await _serve(app, handler_cancellation)
    try:
        port = runner.addresses[0][1]
        received = await _read_to_done(keys["acme"], port)
        assert received.startswith(b"HTTP/1.1 200") and received.count(b'"text":"x"') == 3
        # the gateway has seen the close (its connection has no transport left, or is gone)
        # before the stream ends
        server = runner.server
        assert server is not None
        await wait_for(lambda: all(c.transport is None for c in server.connections))
        backend.ended.set()
        await wait_for(lambda: _recorded(app) != {})
        assert _recorded(app) == {"200": 1.0}
        async with aiohttp.ClientSession() as session, session.get(
                f"http://127.0.0.1:{port}/v1/usage",
                headers={"Authorization": f"Bearer {keys['acme']}"}) as resp:
            usage = await resp.json()
        assert usage["by_status"] == {"200": 1}
    finally:
        await runner.cleanup()
