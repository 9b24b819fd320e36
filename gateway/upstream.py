"""A lean HTTP/1.1 client (GET and POST) for the gateway's requests to its engine backends.

Every proxied request crosses this hop, so it is kept to what the hop needs: a pool of
keep-alive connections per backend, one write per request (head and body together, nothing
scheduled on a separate task), and llhttp (`httptools`) parsing responses straight into a
buffer the proxy drains. aiohttp's client does much more per request (timers, tracing, cookie
and redirect handling, a task to write the body); on a 2-core machine that was a third of the
gateway's time per request (`bench/gateway_overhead.py`).

Semantics the proxy relies on:
- Every failure to reach the backend or to get a well-formed response is an `UpstreamError`
  (never a `ConnectionError`: to the proxy that means its own client went away).
- `Response.close()` puts the connection back in the pool only when the response was read to
  its end on a keep-alive connection; otherwise it closes it, so an engine sees a disconnect and
  aborts the request (a client that went away, a timeout).
- A connection that sat idle longer than `idle_timeout` is not reused (servers close idle
  connections: uvicorn after 5 s), and a request whose reused connection turns out to have been
  closed before any byte of a response came back is sent once more on a new connection.
- A request's `timeout` bounds its wait for the answer, head and body, until the caller says
  `Response.watch_stalls(s)`: from then on only a silence of `s` seconds fails it. Either ends
  in an `UpstreamTimeout` with the connection closed, so a hung backend holds nothing. Both are
  one timer per request, moved lazily: receiving bytes costs a clock read, not a new timer.
"""

from __future__ import annotations

import asyncio
import math
import ssl
import time
from collections.abc import Callable
from typing import cast
from urllib.parse import urlsplit

import httptools

_HIGH_WATER = 1 << 18  # buffered response bytes before the socket stops being read
_LOW_WATER = 1 << 16


class UpstreamError(Exception):
    """The backend could not be reached, or broke the HTTP exchange."""


class UpstreamConnectError(UpstreamError):
    """No connection to the backend could be made: nothing of the request was sent."""


class UpstreamTimeout(UpstreamError):
    """The backend did not answer, or went silent mid-answer, within the caller's limit."""


# Asked when a request's deadline passes: seconds more to wait, or None to give up.
Patience = Callable[[], float | None]


class _Connection(asyncio.Protocol):
    def __init__(self, pool: UpstreamPool) -> None:
        self.pool = pool
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf
        self.parser = httptools.HttpResponseParser(self)
        self.lost = False
        self.idle_since = 0.0
        self.busy = False
        self.paused = False
        self._reset()

    def _reset(self) -> None:
        if self.paused and self.transport is not None:
            self.transport.resume_reading()  # a body left unread stopped the reading
        self.status = 0
        self.headers: dict[str, str] = {}
        self.headers_done = False
        self.complete = False
        self.keep_alive = False
        self.received = False
        self.error: UpstreamError | None = None
        self.body: list[bytes] = []
        self.buffered = 0
        self.paused = False
        self.waiter: asyncio.Future[None] | None = None
        self.deadline = math.inf  # loop time: the answer (or, when stalls are watched, more of it)
        self.stall: float | None = None  # watching stalls: each read moves the deadline this far
        self.patience: Patience | None = None
        self.timeout_message: Callable[[], str] = str  # what UpstreamTimeout says, built then

    # ---- asyncio.Protocol ---------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        if not self.busy:  # bytes nobody asked for: the connection cannot be trusted
            self._fail(UpstreamError("the backend sent data outside a response"))
            return
        self.received = True
        if self.stall is not None:
            self.deadline = self.loop.time() + self.stall
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(UpstreamError(f"malformed HTTP response from the backend: {exc}"))
            return
        if self.body:  # once per read, not per chunk of a chunked body (a stream's every event)
            if self.buffered > _HIGH_WATER and not self.paused and self.transport is not None:
                self.paused = True
                self.transport.pause_reading()
            self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.pool.forget(self)
        if self.busy and not self.complete and self.error is None:
            if self.headers_done and "content-length" not in self.headers and (
                    "chunked" not in self.headers.get("transfer-encoding", "").lower()):
                self.complete = True  # a body delimited by the end of the connection
            else:
                reason = f": {exc}" if exc else ""
                self.error = UpstreamError(f"the backend closed the connection{reason}")
        self._wake()

    # ---- httptools callbacks ------------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.headers_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        self.body.append(body)
        self.buffered += len(body)

    def on_message_complete(self) -> None:
        self.complete = True
        self.keep_alive = self.parser.should_keep_alive()
        self._wake()

    # ---- used by the pool and Response --------------------------------------------------------
    def _wake(self) -> None:
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fail(self, error: UpstreamError) -> None:
        if self.error is None and not self.complete:
            self.error = error
        self.abort()
        self._wake()

    async def _wait(self) -> None:
        self.waiter = self.loop.create_future()
        await self.waiter

    async def headers_received(self) -> None:
        while not self.headers_done:
            if self.error is not None:
                raise self.error
            if self.complete:
                raise UpstreamError("the backend ended the response before its headers")
            await self._wait()

    async def next_body(self) -> bytes:
        while True:
            if self.body:
                data = self.body[0] if len(self.body) == 1 else b"".join(self.body)
                self.body.clear()
                self.buffered = 0
                if self.paused and self.transport is not None:
                    self.paused = False
                    self.transport.resume_reading()
                return data
            if self.complete:
                return b""
            if self.error is not None:
                raise self.error
            await self._wait()

    # ---- deadlines ------------------------------------------------------------------------------
    def expect_by(self, deadline: float, message: Callable[[], str],
                  patience: Patience | None = None) -> None:
        """Fail the exchange with UpstreamTimeout(`message()`) unless it is over by `deadline`
        (loop time); `patience` may grant more time when it passes. The message is built only
        when it is needed, not for every request."""
        self.deadline, self.timeout_message, self.patience = deadline, message, patience
        self._arm(deadline)

    def watch_stalls(self, seconds: float) -> None:
        self.stall = seconds
        self.expect_by(self.loop.time() + seconds, self._stalled)

    def _stalled(self) -> str:
        return f"the backend sent nothing for {self.stall:g} s mid-answer"

    def _arm(self, when: float) -> None:
        if self._timer is not None:
            if self._timer_at <= when:
                return  # it fires first and re-arms for the later deadline then
            self._timer.cancel()
        self._timer, self._timer_at = self.loop.call_at(when, self._on_deadline), when

    def disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._timer_at = None, math.inf

    def _on_deadline(self) -> None:
        self._timer, self._timer_at = None, math.inf
        if not self.busy or self.complete or self.error is not None:
            return
        now = self.loop.time()
        if self.stall is not None and (self.body or self.paused):
            self.deadline = now + self.stall  # the reader is behind, not the backend
        elif now >= self.deadline and self.patience is not None:
            more = self.patience()
            if more is not None:
                self.deadline = now + more
        if now < self.deadline:
            self._arm(self.deadline)
            return
        self._fail(UpstreamTimeout(self.timeout_message()))

    def abort(self) -> None:
        """Close now: data not yet sent is dropped (a stopped backend may never read it)."""
        self.lost = True
        self.disarm()
        if self.transport is not None:
            self.transport.abort()


class Response:
    """A response whose head has arrived; its body is read with `next_chunk` or `read`."""

    __slots__ = ("_conn", "status", "headers")

    def __init__(self, conn: _Connection) -> None:
        self._conn = conn
        self.status = conn.status
        self.headers = conn.headers  # lower-case names

    async def next_chunk(self) -> bytes:
        """The body bytes that arrived since the last call (waiting for some); b"" at its end."""
        return await self._conn.next_body()

    async def read(self) -> bytes:
        parts = []
        while data := await self._conn.next_body():
            parts.append(data)
        return b"".join(parts)

    @property
    def ended(self) -> bool:
        """The backend has sent all it will: the whole body is here (read or not), or the
        connection ended or failed (what arrived before is still read first)."""
        conn = self._conn
        return conn.complete or conn.lost or conn.error is not None

    def watch_stalls(self, seconds: float) -> None:
        """From now on, UpstreamTimeout only when the backend sends nothing for `seconds`
        (instead of the request's `timeout` running on)."""
        conn = self._conn
        if not conn.complete:  # a whole answer already here (the usual one) needs no timer
            conn.watch_stalls(seconds)

    def close(self) -> None:
        """Back to the pool if read to the end on a keep-alive connection, else closed."""
        conn = self._conn
        if not conn.busy:
            return
        conn.busy = False
        conn.disarm()
        if conn.complete and conn.keep_alive and conn.error is None and not conn.lost:
            self._conn.pool.release(conn)
        else:
            conn.abort()


class UpstreamPool:
    """Keep-alive connections to one backend (`base_url`: scheme, host, port, path prefix)."""

    def __init__(self, base_url: str, headers: dict[str, str] | None = None, *,
                 connect_timeout: float = 5.0, idle_timeout: float = 4.0,
                 max_idle: int = 512) -> None:
        url = urlsplit(base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"not an http(s) URL: {base_url!r}")
        self.host = url.hostname
        self.port = url.port or (443 if url.scheme == "https" else 80)
        self.prefix = url.path.rstrip("/")
        self.ssl: ssl.SSLContext | None = (ssl.create_default_context()
                                           if url.scheme == "https" else None)
        host = url.netloc.rpartition("@")[2]
        fixed = {"Host": host, "User-Agent": "fairgate", **(headers or {})}
        self._head_tail = "".join(f"{k}: {v}\r\n" for k, v in fixed.items()).encode("latin-1")
        self.connect_timeout = connect_timeout
        self.idle_timeout = idle_timeout
        self.max_idle = max_idle
        self._idle: list[_Connection] = []
        self._closed = False

    async def request(self, method: str, path: str, body: bytes = b"",
                      content_type: str = "application/json", *, timeout: float | None = None,
                      patience: Patience | None = None) -> Response:
        """Send a request and wait for the response's head. The caller must `close()` it.

        `timeout`: seconds for the whole answer from now (connecting included), until the
        caller watches stalls instead; when it passes, `patience` may grant more."""
        head = (f"{method} {self.prefix}{path} HTTP/1.1\r\nContent-Length: {len(body)}\r\n"
                f"Content-Type: {content_type}\r\n").encode("latin-1")
        payload = head + self._head_tail + b"\r\n" + body
        limit = _Limit(method, path, timeout, patience)
        conn, reused = self._acquire()
        if conn is None:
            conn, reused = await self._connect(limit.left()), False
        try:
            return await self._exchange(conn, payload, limit)
        except UpstreamTimeout:
            raise  # the backend has it and says nothing: sending it again would not help
        except UpstreamError:
            if not (reused and not conn.received):
                raise
        # The reused connection was closed by the backend before it answered: once more.
        return await self._exchange(await self._connect(limit.left()), payload, limit)

    async def _exchange(self, conn: _Connection, payload: bytes, limit: _Limit) -> Response:
        conn._reset()
        conn.busy = True
        try:
            assert conn.transport is not None
            if conn.lost or conn.transport.is_closing():
                raise UpstreamError("the backend closed the connection")
            conn.transport.write(payload)
            if limit.deadline is not None:
                conn.expect_by(limit.deadline, limit.message, limit.patience)
            await conn.headers_received()
        except BaseException:
            conn.busy = False
            conn.abort()
            raise
        return Response(conn)

    def _acquire(self) -> tuple[_Connection | None, bool]:
        if self._closed:
            raise UpstreamError("the connection pool is closed")
        now = time.monotonic()
        while self._idle:
            conn = self._idle.pop()
            if not conn.lost and now - conn.idle_since < self.idle_timeout:
                return conn, True
            conn.abort()
        return None, False

    async def _connect(self, within: float | None = None) -> _Connection:
        loop = asyncio.get_running_loop()
        timeout = self.connect_timeout if within is None else min(within, self.connect_timeout)
        try:
            async with asyncio.timeout(timeout):
                _, conn = await loop.create_connection(
                    lambda: _Connection(self), self.host, self.port, ssl=self.ssl)
        except TimeoutError:
            raise UpstreamConnectError(f"connecting to {self.host}:{self.port} timed out after "
                                       f"{timeout:g} s") from None
        except OSError as exc:
            raise UpstreamConnectError(f"cannot connect to {self.host}:{self.port}: "
                                       f"{exc.strerror or exc}") from None
        return conn

    def release(self, conn: _Connection) -> None:
        if self._closed or len(self._idle) >= self.max_idle:
            conn.abort()
            return
        conn.idle_since = time.monotonic()
        self._idle.append(conn)

    def forget(self, conn: _Connection) -> None:
        """A connection closed (by either side) leaves the idle list."""
        if conn in self._idle:
            self._idle.remove(conn)

    @property
    def idle(self) -> int:
        return len(self._idle)

    def close(self) -> None:
        """Close the idle connections; those in use close when their responses do."""
        self._closed = True
        while self._idle:
            self._idle.pop().abort()


class _Limit:
    """One request's `timeout`, as a deadline on the loop's clock from when it was asked."""

    __slots__ = ("deadline", "method", "path", "timeout", "patience")

    def __init__(self, method: str, path: str, timeout: float | None,
                 patience: Patience | None) -> None:
        self.deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout
        self.method, self.path, self.timeout = method, path, timeout
        self.patience = patience

    def message(self) -> str:
        """What UpstreamTimeout says when the deadline passes (formatted then, not per request)."""
        return f"no answer to {self.method} {self.path} within {self.timeout:g} s"

    def left(self) -> float | None:
        if self.deadline is None:
            return None
        return max(0.0, self.deadline - asyncio.get_running_loop().time())
