"""What a test's aiohttp servers send, send by send: each connection's transport is wrapped as
it is made, and its `write` and `writelines` calls (each one send) recorded by the peer they go
to. It works on any event loop (asyncio's selector loop, or uvloop's, once a test has made that
the policy)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

import pytest
from aiohttp.web_protocol import RequestHandler


class _Recording:
    """A transport that notes what it is asked to send, and is the transport otherwise."""

    def __init__(self, transport: asyncio.Transport, sent: list[bytes]) -> None:
        self._transport = transport
        self._sent = sent

    def write(self, data: bytes) -> None:
        self._sent.append(bytes(data))
        self._transport.write(data)

    def writelines(self, chunks: Iterable[bytes]) -> None:
        chunks = list(chunks)
        self._sent.append(b"".join(chunks))
        self._transport.writelines(chunks)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def record_sends(monkeypatch: pytest.MonkeyPatch) -> dict[Any, list[bytes]]:
    """From now on (until the test ends), every send of the connections aiohttp's servers
    accept, by the client's address: one entry per `write` or `writelines` call."""
    sends: dict[Any, list[bytes]] = {}
    made = RequestHandler.connection_made

    def connection_made(handler: RequestHandler, transport: asyncio.BaseTransport) -> None:
        sent = sends.setdefault(transport.get_extra_info("peername"), [])
        made(handler, _Recording(transport, sent))  # type: ignore[arg-type]

    monkeypatch.setattr(RequestHandler, "connection_made", connection_made)
    return sends
