"""A TCP proxy the test controls, in front of PostgreSQL: `down()` cuts every open connection
and resets new ones at once (a database that went away), `up()` forwards again.

It runs its own event loop in a thread, so it keeps forwarding while a test's loop is blocked
and its controls are plain calls that return once the change took effect.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")
_RESET = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() sends RST, not FIN


def _reset(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET)
    writer.transport.abort()


class TcpProxy:
    """127.0.0.1:`port` -> `target_host`:`target_port`."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.forwarding = True
        self.holding = False  # while down: accept and keep new connections silent
        self.dropping = False  # partitioned: open connections forward nothing, reset nothing
        self.accepted = 0  # connections forwarded so far
        self.refused = 0  # connections reset because the proxy was down
        self._pairs: set[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = set()
        self._held: list[asyncio.StreamWriter] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="pg-proxy",
                                        daemon=True)
        self._server: asyncio.Server | None = None

    def __enter__(self) -> TcpProxy:
        self._thread.start()
        self._server = self._call(asyncio.start_server(self._accept, "127.0.0.1", 0))
        return self

    def __exit__(self, *exc: object) -> None:
        self._call(self._close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    @property
    def port(self) -> int:
        assert self._server is not None
        return int(self._server.sockets[0].getsockname()[1])

    def down(self) -> None:
        """Cut every open connection (RST) and reset every new one until `up()`."""
        self._call(self._down(hold=False))

    def up(self) -> None:
        self._call(self._up())

    def partition(self) -> None:
        """Every byte dropped from now on, on open connections too, with no reset: a database
        behind a partition that the open connections learn of only by their timeouts. New
        connections are held unanswered. `up()` ends it (the connections it stranded reset)."""
        self._call(self._partition())

    def hang(self) -> None:
        """Cut every open connection and hold new ones open without answering (a database
        behind a network partition) until `up()`."""
        self._call(self._down(hold=True))

    # ---- on the proxy's own loop --------------------------------------------------------------
    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)

    async def _down(self, hold: bool) -> None:
        self.forwarding, self.holding = False, hold
        for client, upstream in list(self._pairs):
            _reset(client)
            _reset(upstream)
        self._pairs.clear()

    async def _partition(self) -> None:
        self.forwarding, self.holding, self.dropping = False, True, True

    async def _up(self) -> None:
        if self.dropping:
            for client, upstream in list(self._pairs):
                _reset(client)
                _reset(upstream)
            self._pairs.clear()
        self.forwarding, self.holding, self.dropping = True, False, False
        for writer in self._held:
            _reset(writer)
        self._held.clear()

    async def _close(self) -> None:
        await self._up()
        await self._down(hold=False)
        assert self._server is not None
        self._server.close()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError):
            while data := await reader.read(65536):
                if self.dropping:
                    continue  # lost in the partition
                writer.write(data)
                await writer.drain()
            if writer.can_write_eof():
                writer.write_eof()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self.forwarding:
            self.refused += 1
            if self.holding:
                self._held.append(writer)
            else:
                _reset(writer)
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            _reset(writer)
            return
        self.accepted += 1
        pair = (writer, up_writer)
        self._pairs.add(pair)
        try:
            await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))
        finally:
            self._pairs.discard(pair)
            writer.transport.abort()
            up_writer.transport.abort()

