"""What a test's servers send, send by send: the loop's socket transports' `write` and
`writelines` recorded by the peer they send to (the tests run on asyncio's selector loop)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

import pytest

_TRANSPORT = asyncio.selector_events._SelectorSocketTransport


def record_sends(monkeypatch: pytest.MonkeyPatch) -> dict[Any, list[bytes]]:
    """From now on (until the test ends), every send of a socket transport, by its peer's
    address: one entry per `write` or `writelines` call, each one send."""
    sends: dict[Any, list[bytes]] = {}
    write, writelines = _TRANSPORT.write, _TRANSPORT.writelines

    def recorded(transport: Any, data: bytes) -> None:
        sends.setdefault(transport.get_extra_info("peername"), []).append(bytes(data))

    def write_recorded(transport: Any, data: bytes) -> None:
        recorded(transport, data)
        write(transport, data)

    def writelines_recorded(transport: Any, chunks: Iterable[bytes]) -> None:
        chunks = list(chunks)
        recorded(transport, b"".join(chunks))
        writelines(transport, chunks)

    monkeypatch.setattr(_TRANSPORT, "write", write_recorded)
    monkeypatch.setattr(_TRANSPORT, "writelines", writelines_recorded)
    return sends
