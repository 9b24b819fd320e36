"""The fault suite's own tools, without servers: the proxy cuts and restores connections, the
usage matcher pairs rows with requests, the leak check finds a key's secret part."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from tests.faults.clients import Seen, unmatched
from tests.faults.cluster import leaked
from tests.faults.proxy import TcpProxy


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(ConnectionError):
        while data := await reader.read(1024):
            writer.write(data)
            await writer.drain()
    writer.close()


@pytest.fixture
async def echo_port() -> AsyncIterator[int]:
    server = await asyncio.start_server(_echo, "127.0.0.1", 0)
    async with server:
        yield int(server.sockets[0].getsockname()[1])


async def roundtrip(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"ping")
    assert await reader.readexactly(4) == b"ping"
    return reader, writer


async def test_proxy_cuts_refuses_and_comes_back(echo_port: int) -> None:
    with TcpProxy("127.0.0.1", echo_port) as proxy:
        reader, writer = await roundtrip(proxy.port)
        proxy.down()
        assert await _closed(reader), "an open connection survived down()"
        writer.close()
        assert await _refused(proxy.port) and proxy.refused == 1
        proxy.up()
        _, writer = await roundtrip(proxy.port)
        writer.close()
        assert proxy.accepted == 2


async def _refused(port: int) -> bool:
    """A new connection is reset, while connecting or at its first read."""
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except ConnectionError:
        return True
    try:
        return await _closed(reader)
    finally:
        writer.close()


async def _closed(reader: asyncio.StreamReader) -> bool:
    try:
        return await asyncio.wait_for(reader.read(1), 5) == b""
    except ConnectionError:
        return True


def test_rows_pair_with_what_clients_saw() -> None:
    seen = [Seen("a", 200, 8), Seen("a", 200, 3, {"code": "backend_error"}, done=True),
            Seen("a", 404, 0, {"code": "model_not_found"}),
            Seen("a", 503, 0, {"code": "auth_unavailable"})]  # no tenant known: no row
    assert unmatched(seen, [("a", 200, 8), ("a", 503, 3), ("a", 404, 0)]) == ([], [])
    missing, extra = unmatched(seen, [("a", 200, 8), ("a", 200, 3), ("a", 404, 0),
                                      ("b", 200, 8)])
    assert missing == [seen[1]] and extra == [("a", 200, 3), ("b", 200, 8)]


def test_leak_check_finds_a_keys_secret_part() -> None:
    class Printed:
        name = "gateway"
        output = "ok\nkey=fg-abcdefgHIJKLMNOPQRSTUVWXYZ0123 here\nprefix fg-abcdefg... only\n"

    found = leaked([Printed()], ["fg-abcdefgHIJKLMNOPQRSTUVWXYZ0123"])  # type: ignore[list-item]
    assert found == ["gateway: key=<KEY> here"]
