"""A connection whose request headers do not arrive within gateway.header_timeout_s is closed:
a client dribbling a header line every few seconds cannot hold a connection (and its slot)
for as long as it likes. A request whose headers came is the body timeout's from then on."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web

from gateway.app import make_app, server_options
from gateway.config import GatewayConfig
from protocol.serving import DEFAULT_HEADER_TIMEOUT_S, Runner
from tests.gateway.helpers import SIM_ENGINE, create_tenants

HEADER_TIMEOUT_S = 0.3
# uvloop (libuv) starts a timer from the loop's clock as it read it at the top of the
# iteration, in milliseconds, so a timer may fire a few ms before its time by a fresh clock
TIMER_EARLY_S = 0.005


@pytest.fixture
async def gateway(db_url: str) -> AsyncIterator[tuple[int, str]]:
    """The gateway served as `fairgate serve` serves it, with a short header timeout: its
    port, and a tenant's key."""
    keys = await create_tenants(db_url, {"acme": {}})
    config = GatewayConfig(demo_tenant=False, header_timeout_s=HEADER_TIMEOUT_S,
                           client_timeout_s=2.0)
    runner = Runner(make_app(config, engine=SIM_ENGINE, database=db_url),
                    **server_options(config))
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield runner.addresses[0][1], keys["acme"]
    finally:
        await runner.cleanup()


async def _closed(reader: asyncio.StreamReader) -> bytes:
    """Everything the server sends until it closes the connection (a guard of 30 s)."""
    async with asyncio.timeout(30):
        return await reader.read()


async def _response(reader: asyncio.StreamReader) -> tuple[bytes, Any]:
    """One response read off the connection: its head and its JSON body."""
    async with asyncio.timeout(30):
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        return head, json.loads(await reader.readexactly(length))


async def test_a_connection_that_stops_sending_headers_is_closed(
        gateway: tuple[int, str]) -> None:
    port, _ = gateway
    # before the connect: the server's timer starts when it accepts, which can come before
    # open_connection returns here; the timer may fire TIMER_EARLY_S early
    opened = time.monotonic()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /healthz HTTP/1.1\r\nHost: gateway\r\n")  # and never the blank line
    assert await _closed(reader) == b""
    assert time.monotonic() - opened >= HEADER_TIMEOUT_S - TIMER_EARLY_S
    writer.close()


async def test_a_header_line_now_and_then_does_not_keep_it_open(
        gateway: tuple[int, str]) -> None:
    port, _ = gateway
    opened = time.monotonic()  # before the connect, as above
    reader, writer = await asyncio.open_connection("127.0.0.1", port)

    closed = asyncio.Event()

    async def dribble() -> None:  # a line every 50 ms: the timer is not restarted by data
        writer.write(b"GET /healthz HTTP/1.1\r\n")
        for i in range(200):
            # the pace of the dribble, cut short by the close it waits for
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0.05):
                    await closed.wait()
            if closed.is_set():
                return
            writer.write(f"X-Line-{i}: {i}\r\n".encode())

    task = asyncio.create_task(dribble())
    try:
        assert await _closed(reader) == b""
        closed.set()
        closed_after = time.monotonic() - opened
        assert HEADER_TIMEOUT_S - TIMER_EARLY_S <= closed_after < 200 * 0.05  # long before it ends
    finally:
        task.cancel()
        writer.close()


async def test_a_kept_alive_connection_gets_the_timeout_for_each_request(
        gateway: tuple[int, str]) -> None:
    port, _ = gateway
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /healthz HTTP/1.1\r\nHost: gateway\r\n\r\n")
    head, answer = await _response(reader)
    assert head.startswith(b"HTTP/1.1 200") and answer == {"status": "ok"}
    started = time.monotonic()
    writer.write(b"GET /healthz HTTP/1.1\r\n")  # the next request begins, and stalls
    assert await _closed(reader) == b""
    assert time.monotonic() - started >= HEADER_TIMEOUT_S - TIMER_EARLY_S
    writer.close()


async def test_a_slow_body_is_the_body_timeouts_not_the_header_timeouts(
        gateway: tuple[int, str]) -> None:
    """Headers complete, half the body: the answer is the body timeout's 408 (2 s), not a
    close at the header timeout (0.3 s)."""
    port, key = gateway
    body = json.dumps({"model": "random:tiny", "prompt": "hello", "max_tokens": 2}).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: gateway\r\n"
                 b"Authorization: Bearer " + key.encode() + b"\r\n"
                 b"Content-Type: application/json\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n"
                 + body[:len(body) // 2])
    head, answer = await _response(reader)
    assert head.startswith(b"HTTP/1.1 408") and answer["error"]["code"] == "client_timeout"
    writer.close()


def test_the_header_timeout_is_a_gateway_setting() -> None:
    assert GatewayConfig().header_timeout_s == DEFAULT_HEADER_TIMEOUT_S == 20.0
    assert server_options(GatewayConfig(header_timeout_s=5))["header_timeout"] == 5
    for bad in (0, -1, "soon", float("inf")):
        with pytest.raises(ValueError, match="gateway.header_timeout_s"):
            GatewayConfig.from_dict({"header_timeout_s": bad})

