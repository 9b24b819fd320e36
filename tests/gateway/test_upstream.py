"""UpstreamPool against real sockets: raw asyncio servers that send exact (also broken) bytes,
and an aiohttp server. Every test runs on asyncio's default loop and on uvloop's."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import pytest
import uvloop
from aiohttp import web

from gateway.upstream import _HIGH_WATER, UpstreamError, UpstreamPool
from tests.support.processes import free_port
from tests.support.waiting import next_loop_turn, wait_for

pytestmark = pytest.mark.timeout(10)

LoopFactory = Callable[[], asyncio.AbstractEventLoop]
LOOPS = [pytest.param(asyncio.new_event_loop, id="asyncio"),
         pytest.param(uvloop.new_event_loop, id="uvloop")]


def on_both_loops(test: Callable[[], Coroutine[Any, Any, None]]) -> Callable[[LoopFactory], None]:
    """Run the async test once per event loop, bounded by a timeout. uvloop matters: its
    transports are not asyncio.Transport subclasses, and a bug hid there once."""

    def run(loop_factory: LoopFactory) -> None:
        async def bounded() -> None:
            async with asyncio.timeout(5):
                await test()

        with asyncio.Runner(loop_factory=loop_factory) as runner:
            runner.run(bounded())

    run.__name__ = run.__qualname__ = test.__name__
    return pytest.mark.parametrize("loop_factory", LOOPS)(run)


# ---- raw HTTP servers -------------------------------------------------------------------------
@dataclass
class Received:
    line: str  # the request line
    headers: dict[str, str]  # lower-case names
    body: bytes


@dataclass
class Peer:
    """One connection a RawServer accepted (`index` counts from 1)."""

    server: RawServer
    index: int
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter

    async def request(self) -> Received | None:
        """The next request on this connection; None once the client has closed it."""
        try:
            head = await self.reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):
            self.server.eofs += 1
            return None
        line, *fields = head.decode("latin-1").split("\r\n")[:-2]
        headers = {name.lower(): value for name, value in (f.split(": ", 1) for f in fields)}
        body = await self.reader.readexactly(int(headers.get("content-length", "0")))
        self.server.requests.append(Received(line, headers, body))
        return self.server.requests[-1]

    async def send(self, *parts: bytes) -> None:
        """Each part in its own write, drained before the next."""
        for part in parts:
            self.writer.write(part)
            await self.writer.drain()


Handler = Callable[[Peer], Awaitable[None]]


class RawServer:
    """A TCP server on a free port that runs `handler` on every connection it accepts and
    counts connections, requests and connections closed by the client."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.eofs = 0
        self.requests: list[Received] = []
        self._writers: list[asyncio.StreamWriter] = []
        self._pools: list[UpstreamPool] = []

    async def __aenter__(self) -> RawServer:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        for pool in self._pools:
            pool.close()
        for writer in self._writers:
            writer.close()
        self._server.close()
        await self._server.wait_closed()

    def url(self, path: str = "") -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def pool(self, path: str = "", headers: dict[str, str] | None = None,
             **options: Any) -> UpstreamPool:
        self._pools.append(UpstreamPool(self.url(path), headers, **options))
        return self._pools[-1]

    async def eof_seen(self, count: int = 1) -> None:
        """Wait until the client has closed `count` connections."""
        await wait_for(lambda: self.eofs >= count, timeout=1)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._writers.append(writer)
        with contextlib.suppress(ConnectionError):
            await self.handler(Peer(self, self.connections, reader, writer))
        writer.close()


def head(status: str = "200 OK", *headers: str) -> bytes:
    return "".join(f"{line}\r\n" for line in (f"HTTP/1.1 {status}", *headers, "")).encode()


def ok(body: bytes = b"", *headers: str, status: str = "200 OK") -> bytes:
    """A whole response framed by Content-Length."""
    return head(status, f"Content-Length: {len(body)}", *headers) + body


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


CHUNKED = head("200 OK", "Transfer-Encoding: chunked")
LAST_CHUNK = b"0\r\n\r\n"


def answer_every(response: bytes) -> Handler:
    """A keep-alive server: every request gets `response`, until the client closes."""

    async def handler(peer: Peer) -> None:
        while await peer.request() is not None:
            await peer.send(response)

    return handler


def answer_once(*parts: bytes) -> Handler:
    """A server that answers the first request on a connection by writing `parts` one after
    another, then closes the connection (whatever the parts said)."""

    async def handler(peer: Peer) -> None:
        await peer.request()
        await peer.send(*parts)

    return handler


def answer_then_hold(*parts: bytes) -> Handler:
    """Like answer_once, but the connection stays open until the client closes it."""

    async def handler(peer: Peer) -> None:
        await peer.request()
        await peer.send(*parts)
        await peer.request()

    return handler


async def upstream_error(awaitable: Awaitable[object]) -> str:
    """Await something that must fail with an UpstreamError; its message. The proxy takes a
    ConnectionError for its own client going away, so an UpstreamError must never be one."""
    with pytest.raises(UpstreamError) as caught:
        await awaitable
    assert not isinstance(caught.value, ConnectionError)
    return str(caught.value)


async def get(pool: UpstreamPool, path: str = "/") -> bytes:
    """GET `path`, read the whole body and close the response."""
    resp = await pool.request("GET", path)
    try:
        return await resp.read()
    finally:
        resp.close()


# ---- requests and responses -------------------------------------------------------------------
@on_both_loops
async def test_get_returns_status_lowercased_headers_and_body() -> None:
    async with RawServer(answer_every(ok(b"hello", "X-Engine: Sim", status="201 Created"))
                         ) as server:
        resp = await server.pool().request("GET", "/health")
        assert resp.status == 201
        assert resp.headers["x-engine"] == "Sim" and resp.headers["content-length"] == "5"
        assert await resp.read() == b"hello"
        resp.close()
    [sent] = server.requests
    assert sent.line == "GET /health HTTP/1.1"
    assert sent.headers["host"] == f"127.0.0.1:{server.port}"
    assert sent.headers["content-length"] == "0" and sent.body == b""


@on_both_loops
async def test_post_sends_body_with_its_length_and_content_type() -> None:
    async def echo(peer: Peer) -> None:
        while (sent := await peer.request()) is not None:
            await peer.send(ok(sent.body[::-1]))

    body = b'{"prompt": "hi \xc3\xa9"}'
    async with RawServer(echo) as server:
        pool = server.pool()
        resp = await pool.request("POST", "/v1/completions", body)
        assert resp.status == 200 and await resp.read() == body[::-1]
        resp.close()
        resp = await pool.request("POST", "/tokenize", b"abc", content_type="text/plain")
        assert await resp.read() == b"cba"
        resp.close()
    first, second = server.requests
    assert first.line == "POST /v1/completions HTTP/1.1" and first.body == body
    assert first.headers["content-length"] == str(len(body))
    assert first.headers["content-type"] == "application/json"
    assert second.headers["content-type"] == "text/plain" and second.body == b"abc"


@on_both_loops
async def test_base_url_path_prefix_and_pool_headers_are_sent() -> None:
    async with RawServer(answer_every(ok(b"{}"))) as server:
        pool = server.pool("/prefix/", {"Authorization": "Bearer sk-123"})
        assert await get(pool, "/v1/models") == b"{}"
    [sent] = server.requests
    assert sent.line == "GET /prefix/v1/models HTTP/1.1"
    assert sent.headers["authorization"] == "Bearer sk-123"
    assert sent.headers["user-agent"] == "fairgate"


def test_non_http_base_urls_are_rejected() -> None:
    for url in ("ftp://127.0.0.1/", "http://", "127.0.0.1:8000"):
        with pytest.raises(ValueError, match="not an http"):
            UpstreamPool(url)


@on_both_loops
async def test_chunked_body_streams_each_chunk_as_it_arrives() -> None:
    first_read, second_read = asyncio.Event(), asyncio.Event()

    async def stream(peer: Peer) -> None:
        await peer.request()
        await peer.send(CHUNKED + chunk(b"first"))
        await first_read.wait()
        await peer.send(chunk(b"second"))
        await second_read.wait()
        await peer.send(LAST_CHUNK)

    async with RawServer(stream) as server:
        resp = await server.pool().request("POST", "/v1/completions", b"{}")
        assert resp.headers["transfer-encoding"] == "chunked"
        assert await resp.next_chunk() == b"first"  # the server is waiting for this
        first_read.set()
        assert await resp.next_chunk() == b"second"  # and the end is not sent yet
        second_read.set()
        assert await resp.next_chunk() == b""
        assert await resp.next_chunk() == b""
        resp.close()


@on_both_loops
async def test_response_split_into_single_bytes_is_parsed() -> None:
    response = head("200 OK", "X-Long-Header-Name: a long value",
                    "Transfer-Encoding: chunked") + chunk(b"abc") + chunk(b"def") + LAST_CHUNK

    single_bytes = (response[i:i + 1] for i in range(len(response)))
    async with RawServer(answer_once(*single_bytes)) as server:
        resp = await server.pool().request("GET", "/")
        assert resp.headers["x-long-header-name"] == "a long value"
        assert await resp.read() == b"abcdef"
        resp.close()


@on_both_loops
async def test_body_delimited_by_connection_close_is_read_whole() -> None:
    for status_line in (b"HTTP/1.0 200 OK\r\n", b"HTTP/1.1 200 OK\r\n"):
        response = (status_line + b"X-A: b\r\n\r\npart one, ", b"part two")
        async with RawServer(answer_once(*response)) as server:
            pool = server.pool()
            assert await get(pool) == b"part one, part two"
            assert pool.idle == 0
            assert await get(pool) == b"part one, part two"
            assert server.connections == 2


# ---- keep-alive -------------------------------------------------------------------------------
@on_both_loops
async def test_sequential_requests_reuse_one_connection() -> None:
    async with RawServer(answer_every(ok(b"x"))) as server:
        pool = server.pool()
        for path in ("/a", "/b", "/c"):
            assert await get(pool, path) == b"x"
            assert pool.idle == 1
        assert server.connections == 1 and len(server.requests) == 3
        pool.close()
        assert pool.idle == 0
        await server.eof_seen()


@on_both_loops
async def test_response_closed_before_its_end_closes_the_connection() -> None:
    async with RawServer(answer_then_hold(CHUNKED + chunk(b"first"))) as server:
        pool = server.pool()
        resp = await pool.request("POST", "/v1/completions", b"{}")
        assert await resp.next_chunk() == b"first"
        resp.close()
        assert pool.idle == 0
        await server.eof_seen()
        await pool.request("GET", "/")
        assert server.connections == 2


@on_both_loops
async def test_connection_close_response_is_not_reused() -> None:
    async with RawServer(answer_every(ok(b"bye", "Connection: close"))) as server:
        pool = server.pool()
        assert await get(pool) == b"bye"
        assert pool.idle == 0
        await server.eof_seen()  # the server kept it open: the client closed it
        assert await get(pool) == b"bye"
        assert server.connections == 2


@on_both_loops
async def test_bodyless_204_keeps_the_connection() -> None:
    async with RawServer(answer_every(head("204 No Content"))) as server:
        pool = server.pool()
        assert await get(pool) == b""
        assert await get(pool) == b""
        assert pool.idle == 1 and server.connections == 1


@on_both_loops
async def test_max_idle_bounds_the_pooled_connections() -> None:
    async with RawServer(answer_every(ok(b"x"))) as server:
        pool = server.pool(max_idle=1)
        first, second = await asyncio.gather(pool.request("GET", "/"), pool.request("GET", "/"))
        for resp in (first, second):
            assert await resp.read() == b"x"
            resp.close()
        assert server.connections == 2 and pool.idle == 1
        await server.eof_seen()


@on_both_loops
async def test_connection_idle_past_idle_timeout_is_replaced() -> None:
    async with RawServer(answer_every(ok(b"x"))) as server:
        pool = server.pool(idle_timeout=0.1)
        assert await get(pool) == b"x"
        assert await get(pool) == b"x"  # at once: reused
        assert server.connections == 1
        released = time.monotonic()  # the pool stamped the connection idle before this
        await wait_for(lambda: time.monotonic() - released > pool.idle_timeout)
        assert await get(pool) == b"x"
        assert server.connections == 2
        await server.eof_seen()  # the pool closed the stale one


@on_both_loops
async def test_bytes_sent_outside_a_response_drop_the_idle_connection() -> None:
    pooled = asyncio.Event()

    async def chatty(peer: Peer) -> None:
        await peer.request()
        await peer.send(ok(b"x"))
        if peer.index == 1:
            await pooled.wait()
            await peer.send(b"HTTP/1.1 200 OK\r\n")
        while await peer.request() is not None:
            await peer.send(ok(b"x"))

    async with RawServer(chatty) as server:
        pool = server.pool()
        assert await get(pool) == b"x"
        assert pool.idle == 1
        pooled.set()
        await server.eof_seen()
        assert pool.idle == 0
        assert await get(pool) == b"x"
        assert server.connections == 2


# ---- stale connections ------------------------------------------------------------------------
@on_both_loops
async def test_server_closing_a_kept_alive_connection_after_answering() -> None:
    # no Connection: close, and closed all the same
    async with RawServer(answer_once(ok(b"x"))) as server:
        pool = server.pool()
        for _ in range(3):
            assert await get(pool) == b"x"
        assert server.connections == 3


@on_both_loops
async def test_reused_connection_closed_before_answering_is_retried_once() -> None:
    async def answer_one_drop_next(peer: Peer) -> None:
        await peer.request()
        await peer.send(ok(b"x"))
        await peer.request()  # read, and the connection closed without a byte of answer

    async with RawServer(answer_one_drop_next) as server:
        pool = server.pool()
        assert await get(pool) == b"x"
        resp = await pool.request("POST", "/v1/completions", b'{"n": 2}')
        assert await resp.read() == b"x"
        resp.close()
        assert server.connections == 2
        assert [r.body for r in server.requests] == [b"", b'{"n": 2}', b'{"n": 2}']


@on_both_loops
async def test_reused_connection_broken_mid_answer_is_not_retried() -> None:
    async def break_second(peer: Peer) -> None:
        await peer.request()
        await peer.send(ok(b"x"))
        await peer.request()
        await peer.send(b"HTTP/1.1 200 OK\r\n")  # the request may have been acted on

    async with RawServer(break_second) as server:
        pool = server.pool()
        assert await get(pool) == b"x"
        assert "closed" in await upstream_error(pool.request("POST", "/", b"{}"))
        assert server.connections == 1 and len(server.requests) == 2


@on_both_loops
async def test_fresh_connection_closed_without_answer_is_an_error() -> None:
    async with RawServer(answer_once()) as server:
        assert "closed" in await upstream_error(server.pool().request("GET", "/"))
        assert server.connections == 1


# ---- errors -----------------------------------------------------------------------------------
@on_both_loops
async def test_connection_refused_is_an_upstream_error() -> None:
    pool = UpstreamPool(f"http://127.0.0.1:{free_port()}")
    assert "cannot connect" in await upstream_error(pool.request("GET", "/"))


@on_both_loops
async def test_malformed_responses_are_upstream_errors() -> None:
    for junk in (b"HELLO WORLD\r\n\r\n", b"HTTP/1.1 2x0 OK\r\n\r\n",
                 b"HTTP/1.1 200 OK\r\nNo Colon Here\r\n\r\n",
                 CHUNKED + b"zz\r\nabc\r\n"):
        async with RawServer(answer_every(junk)) as server:
            pool = server.pool()
            assert "malformed" in await upstream_error(get(pool)), junk
            assert pool.idle == 0


@on_both_loops
async def test_connection_closed_before_headers_end() -> None:
    async with RawServer(answer_once(b"HTTP/1.1 200 OK\r\nContent-Le")) as server:
        assert "closed" in await upstream_error(server.pool().request("GET", "/"))


@on_both_loops
async def test_connection_closed_mid_body_fails_read() -> None:
    async with RawServer(answer_once(head("200 OK", "Content-Length: 10") + b"abcd")) as server:
        pool = server.pool()
        resp = await pool.request("GET", "/")
        assert "closed" in await upstream_error(resp.read())
        resp.close()
        resp = await pool.request("GET", "/")
        await wait_for(lambda: resp.ended, timeout=1)  # the close seen: what arrived comes first
        assert await resp.next_chunk() == b"abcd"
        assert "closed" in await upstream_error(resp.next_chunk())
        resp.close()
        assert pool.idle == 0


@on_both_loops
async def test_chunked_stream_closed_mid_body_fails_next_chunk() -> None:
    async with RawServer(answer_once(CHUNKED + chunk(b"data: 1\n\n"))) as server:
        resp = await server.pool().request("POST", "/v1/completions", b"{}")
        assert await resp.next_chunk() == b"data: 1\n\n"
        assert "closed" in await upstream_error(resp.next_chunk())
        resp.close()


@on_both_loops
async def test_cut_stream_with_capitalised_chunked_encoding_is_an_error() -> None:
    cut_stream = head("200 OK", "Transfer-Encoding: Chunked") + chunk(b"data: 1\n\n")
    async with RawServer(answer_once(cut_stream)) as server:
        resp = await server.pool().request("POST", "/v1/completions", b"{}")
        assert await resp.next_chunk() == b"data: 1\n\n"
        await upstream_error(resp.next_chunk())
        resp.close()


# ---- cancellation and closing -----------------------------------------------------------------
@on_both_loops
async def test_cancelled_next_chunk_then_close_closes_the_connection() -> None:
    async with RawServer(answer_then_hold(CHUNKED + chunk(b"first"))) as server:
        pool = server.pool()
        resp = await pool.request("POST", "/v1/completions", b"{}")
        assert await resp.next_chunk() == b"first"
        waiting = asyncio.create_task(resp.next_chunk())
        await next_loop_turn()  # it is waiting for more of the body
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        resp.close()
        await server.eof_seen()  # the engine sees its client go away
        assert pool.idle == 0


@on_both_loops
async def test_cancelled_request_closes_the_connection() -> None:
    asked = asyncio.Event()

    async def never_answers(peer: Peer) -> None:
        await peer.request()
        asked.set()
        await peer.request()

    async with RawServer(never_answers) as server:
        pool = server.pool()
        waiting = asyncio.create_task(pool.request("POST", "/v1/completions", b"{}"))
        await asked.wait()
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await server.eof_seen()
        assert pool.idle == 0


@on_both_loops
async def test_closed_pool_closes_idle_connections_and_refuses_requests() -> None:
    async with RawServer(answer_every(ok(b"x"))) as server:
        pool = server.pool()
        first = await pool.request("GET", "/")
        second = await pool.request("GET", "/")
        for resp in (first, second):
            assert await resp.read() == b"x"
        first.close()
        assert pool.idle == 1
        pool.close()
        assert pool.idle == 0
        await server.eof_seen(1)
        second.close()  # in use while the pool closed: closed, not pooled
        assert pool.idle == 0
        await server.eof_seen(2)
        assert "closed" in await upstream_error(pool.request("GET", "/"))
        assert server.connections == 2


# ---- flow control -----------------------------------------------------------------------------
BIG = bytes(range(256)) * (8 * 1024)  # 2 MiB


@on_both_loops
async def test_large_body_read_slowly_arrives_whole_without_unbounded_buffering() -> None:
    async with RawServer(answer_every(ok(BIG))) as server:
        pool = server.pool()
        resp = await pool.request("GET", "/")
        parts = []
        while part := await resp.next_chunk():
            parts.append(part)
            await asyncio.sleep(0.01)
        resp.close()
        assert b"".join(parts) == BIG
        assert max(map(len, parts)) < len(BIG) // 2  # reading paused while the reader slept
        assert await get(pool) == BIG  # and resumed: the connection is whole and reused
        assert server.connections == 1


@on_both_loops
async def test_unread_large_body_does_not_stall_the_reused_connection() -> None:
    """A body whose last read takes the unread bytes past the high-water mark: the reading is
    paused with the body whole, and the connection, kept, reads again when reused. (The body
    comes in two writes, the second once the first is buffered: in one, whether a read before
    the last crossed the mark, leaving the body unfinished, was up to the kernel.)"""
    body = BIG[:_HIGH_WATER + 1]
    buffered = asyncio.Event()

    async def handler(peer: Peer) -> None:
        await peer.request()
        await peer.send(ok(body)[:-1])  # all but the last byte: up to the mark, not past it
        await buffered.wait()
        await peer.send(body[-1:])
        while await peer.request() is not None:
            await peer.send(ok(body))

    async with RawServer(handler) as server:
        pool = server.pool()
        resp = await pool.request("GET", "/")
        await wait_for(lambda: resp._conn.buffered == _HIGH_WATER, timeout=1)
        buffered.set()
        await wait_for(lambda: resp.ended, timeout=1)  # the whole body arrives, unread
        assert resp._conn.paused  # its last byte took the unread bytes past the mark
        resp.close()
        assert pool.idle == 1  # it was complete, so it was kept
        async with asyncio.timeout(0.5):
            assert await get(pool) == body


# ---- a real aiohttp server --------------------------------------------------------------------
@contextlib.asynccontextmanager
async def serving(app: web.Application) -> AsyncIterator[str]:
    """`app` on a free port; its base URL."""
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


def peer_port(request: web.Request) -> int:
    assert request.transport is not None
    return int(request.transport.get_extra_info("peername")[1])


@on_both_loops
async def test_aiohttp_server_echo_over_one_kept_alive_connection() -> None:
    async def echo(request: web.Request) -> web.Response:
        return web.json_response({"body": await request.text(), "peer": peer_port(request),
                                  "auth": request.headers.get("Authorization")})

    app = web.Application()
    app.router.add_post("/v1/echo", echo)
    async with serving(app) as url:
        pool = UpstreamPool(f"{url}/v1", {"Authorization": "Bearer k"})
        replies = []
        for body in (b'{"a": 1}', b'{"b": 2}'):
            resp = await pool.request("POST", "/echo", body)
            assert resp.status == 200
            assert resp.headers["content-type"].startswith("application/json")
            replies.append(json.loads(await resp.read()))
            resp.close()
            assert pool.idle == 1
        pool.close()
    assert [r["body"] for r in replies] == ['{"a": 1}', '{"b": 2}']
    assert replies[0]["auth"] == replies[1]["auth"] == "Bearer k"
    assert replies[0]["peer"] == replies[1]["peer"]  # the same client socket


@on_both_loops
async def test_aiohttp_streaming_response_arrives_chunk_by_chunk() -> None:
    first_read = asyncio.Event()

    async def stream(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(request)
        await resp.write(b"data: 1\n\n")
        await first_read.wait()
        await resp.write(b"data: 2\n\n")
        return resp

    app = web.Application()
    app.router.add_get("/stream", stream)
    async with serving(app) as url:
        pool = UpstreamPool(url)
        resp = await pool.request("GET", "/stream")
        assert resp.headers["transfer-encoding"] == "chunked"
        assert await resp.next_chunk() == b"data: 1\n\n"
        first_read.set()
        assert await resp.read() == b"data: 2\n\n"
        resp.close()
        assert pool.idle == 1
        pool.close()
