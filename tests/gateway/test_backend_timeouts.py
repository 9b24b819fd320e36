"""Remote engines that stop answering (a hung or SIGSTOPped engine), and what the client sees
of a remote engine's stream. Two backends: an engine this test stops, listed first so that it
gets the first request, and a real simulated `fairgate engine`.

A stopped engine fails its request with 504 `backend_timeout` (or an error event once the
stream has started) within the backend's first-byte or stall timeout, its connection is
closed, it is marked down, and the next requests run on the other engine."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import uvloop
from aiohttp import web

from engine.async_engine import AsyncEngine
from engine.server import make_app as make_engine_app
from gateway.backends import RemoteBackend, remote
from gateway.config import BackendConfig, GatewayConfig
from gateway.upstream import UpstreamPool, UpstreamTimeout
from protocol.openai import ResponseWriter
from protocol.sse import DONE
from tests.gateway.helpers import SIM_ENGINE, Harness, completion, sse_events, start_gateway
from tests.support.waiting import wait_for

pytestmark = pytest.mark.timeout(30)

TIMEOUT = 0.3  # the backends' first-byte and stall timeouts here
SLACK = 1.5  # a loaded 2-core machine is late by this much at most
MODEL = "random:tiny"
ENGINE_LOAD = {"max_num_seqs": 8, "kv_usage": 0.0, "waiting": 0, "max_model_len": 512}


@dataclass
class Answer:
    """How the stoppable engine answers one completion: after `delay` s; `stop_after`: it
    stops after this many tokens (a whole answer: 0 stops before the head, more after part of
    the body). None: it answers in full."""

    delay: float = 0.0
    stop_after: int | None = None


@dataclass
class StoppableEngine:
    """A fairgate engine (/v1/models, /load, completions in the engine's own format) that, once
    stopped, takes connections and requests and answers nothing, health checks included: what
    a SIGSTOPped engine does. `resume()` (at the test's end) lets its handlers return."""

    answers: deque[Answer] = field(default_factory=deque)  # empty: answer in full
    stopped: asyncio.Event = field(default_factory=asyncio.Event)
    resumed: asyncio.Event = field(default_factory=asyncio.Event)
    connections: list[asyncio.BaseTransport] = field(default_factory=list)  # one a completion

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._stop_gate])
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/load", self._load)
        app.router.add_post("/v1/completions", self._completions)
        return app

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": MODEL}]})

    async def _load(self, request: web.Request) -> web.Response:
        return web.json_response(ENGINE_LOAD)

    def stop(self) -> None:
        self.stopped.set()

    def resume(self) -> None:
        self.resumed.set()

    async def _hang(self) -> None:
        self.stop()
        await self.resumed.wait()

    @web.middleware
    async def _stop_gate(self, request: web.Request,
                         handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                         ) -> web.StreamResponse:
        if self.stopped.is_set():
            await self.resumed.wait()
        return await handler(request)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        assert request.transport is not None
        self.connections.append(request.transport)
        body = json.loads(await request.read())
        answer = self.answers.popleft() if self.answers else Answer()
        await asyncio.sleep(answer.delay)  # a long answer (prefill, generation), not a test wait
        if answer.stop_after == 0:
            await self._hang()
        writer = ResponseWriter("stoppable", False, MODEL,
                                bool((body.get("stream_options") or {}).get("include_usage")))
        tokens = int(body["max_tokens"])
        prompt_tokens = len(body["prompt"].encode()) + 1
        if not body.get("stream"):
            return await self._whole(request, writer, answer, prompt_tokens, tokens)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(tokens):
            if i == answer.stop_after:
                await self._hang()
            await resp.write(writer.chunk("a", "length" if i == tokens - 1 else None))
        if writer.include_usage:
            await resp.write(writer.usage_chunk(prompt_tokens, tokens))
        await resp.write(DONE)
        return resp

    async def _whole(self, request: web.Request, writer: ResponseWriter, answer: Answer,
                     prompt_tokens: int, tokens: int) -> web.StreamResponse:
        data = json.dumps(writer.whole("a" * tokens, "length", prompt_tokens, tokens)).encode()
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        resp.content_length = len(data)
        await resp.prepare(request)
        if answer.stop_after is not None:
            await resp.write(data[:len(data) // 2])
            await self._hang()
        await resp.write(data)
        return resp


@pytest.fixture
async def stoppable() -> AsyncIterator[StoppableEngine]:
    engine = StoppableEngine()
    yield engine
    engine.resume()  # before the servers close: their handlers return


async def two_engines(aiohttp_client: Any, aiohttp_server: Any, db_url: str,
                      stoppable: StoppableEngine, **gateway: Any) -> Harness:
    stopping = await aiohttp_server(stoppable.app())
    live = await aiohttp_server(make_engine_app(AsyncEngine(SIM_ENGINE)))
    return await start_gateway(aiohttp_client, db_url, gateway={
        "backends": [{"url": str(stopping.make_url("/"))}, {"url": str(live.make_url("/"))}],
        "backend_first_byte_timeout_s": TIMEOUT, "backend_stall_timeout_s": TIMEOUT,
        **gateway})


def stopped_backend(h: Harness) -> RemoteBackend:
    backend = h.gateway.pool.backends[0]
    assert isinstance(backend, RemoteBackend)
    return backend


async def timed_post(h: Harness, body: dict[str, Any]) -> tuple[Any, bytes, float]:
    """The response, its whole body and the seconds it took."""
    start = time.monotonic()
    resp = await h.post("acme", body)
    raw = await resp.read()
    return resp, raw, time.monotonic() - start


async def assert_the_others_serve(h: Harness, stoppable: StoppableEngine) -> None:
    """The stopped engine is down, its request's connection closed; new requests run on the
    other engine (the stopped one gets none of them)."""
    assert not stopped_backend(h).healthy
    await wait_for(lambda: all(t.is_closing() for t in stoppable.connections), timeout=5)
    sent = len(stoppable.connections)
    for stream in (False, True):
        resp = await h.post("acme", completion(max_tokens=3, stream=stream))
        assert resp.status == 200, await resp.text()
        await resp.read()
    assert len(stoppable.connections) == sent


async def test_stream_from_an_engine_that_stops_before_its_first_token(
        aiohttp_client: Any, aiohttp_server: Any, db_url: str,
        stoppable: StoppableEngine, caplog: pytest.LogCaptureFixture) -> None:
    h = await two_engines(aiohttp_client, aiohttp_server, db_url, stoppable)
    stoppable.answers.append(Answer(stop_after=0))
    resp, raw, took = await timed_post(h, completion(stream=True))
    assert resp.status == 504, raw
    error = json.loads(raw)["error"]
    assert error["code"] == "backend_timeout"
    assert f"no answer to POST /v1/completions within {TIMEOUT:g} s" in error["message"]
    assert TIMEOUT <= took < TIMEOUT + SLACK
    assert any("is down: no answer to POST /v1/completions" in r.getMessage()
               for r in caplog.records)
    await assert_the_others_serve(h, stoppable)
    assert h.gateway.limiter.usage("acme")[0] == 3


async def test_stream_that_stalls_after_two_tokens_ends_in_an_error_event(
        aiohttp_client: Any, aiohttp_server: Any, db_url: str,
        stoppable: StoppableEngine) -> None:
    h = await two_engines(aiohttp_client, aiohttp_server, db_url, stoppable)
    stoppable.answers.append(Answer(stop_after=2))
    resp, raw, took = await timed_post(h, completion(max_tokens=5, stream=True))
    assert resp.status == 200 and raw.endswith(DONE), raw
    events = sse_events(raw)
    assert [e["choices"][0]["text"] for e in events[:-1]] == ["a", "a"]
    assert events[-1]["error"]["code"] == "backend_timeout"
    assert f"sent nothing for {TIMEOUT:g} s" in events[-1]["error"]["message"]
    assert TIMEOUT <= took < TIMEOUT + SLACK
    # settled with what was streamed: "hello" is 6 prompt tokens (bytes + BOS), 2 came out
    assert h.gateway.limiter.usage("acme") == (1, 6 + 2)
    assert h.gateway.metrics.registry.get_sample_value(
        "fairgate_gateway_requests_total", {"tenant": "acme", "status": "504"}) == 1
    await assert_the_others_serve(h, stoppable)


async def test_whole_answer_is_awaited_while_the_engine_lives_and_fails_once_it_stops(
        aiohttp_client: Any, aiohttp_server: Any, db_url: str, stoppable: StoppableEngine,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A non-streamed answer comes whole: one longer than the first-byte timeout from an engine
    that passes its health checks arrives; one from an engine that stopped fails soon after
    its health checks do."""
    monkeypatch.setattr(remote, "HEALTH_TIMEOUT_S", TIMEOUT)
    monkeypatch.setattr(remote, "HEALTH_INTERVAL_S", 0.05)
    h = await two_engines(aiohttp_client, aiohttp_server, db_url, stoppable)
    stoppable.answers.extend([Answer(delay=3 * TIMEOUT), Answer(stop_after=0)])
    resp, raw, took = await timed_post(h, completion())
    assert resp.status == 200 and took >= 3 * TIMEOUT, raw
    resp, raw, took = await timed_post(h, completion())
    assert resp.status == 504 and json.loads(raw)["error"]["code"] == "backend_timeout", raw
    assert took < 2 * TIMEOUT + SLACK  # its health check's timeout, then the next look
    await assert_the_others_serve(h, stoppable)


async def test_whole_answer_whose_body_stalls(aiohttp_client: Any, aiohttp_server: Any,
                                              db_url: str, stoppable: StoppableEngine) -> None:
    h = await two_engines(aiohttp_client, aiohttp_server, db_url, stoppable)
    stoppable.answers.append(Answer(stop_after=1))
    resp, raw, took = await timed_post(h, completion())
    assert resp.status == 504, raw
    assert f"sent nothing for {TIMEOUT:g} s" in json.loads(raw)["error"]["message"]
    assert TIMEOUT <= took < TIMEOUT + SLACK
    await assert_the_others_serve(h, stoppable)


async def test_a_backends_own_timeouts_win_over_the_gateways(
        aiohttp_client: Any, aiohttp_server: Any, db_url: str,
        stoppable: StoppableEngine) -> None:
    own = 2 * TIMEOUT
    stopping = await aiohttp_server(stoppable.app())
    h = await start_gateway(aiohttp_client, db_url, gateway={
        "backends": [{"url": str(stopping.make_url("/")), "first_byte_timeout_s": own}],
        "backend_first_byte_timeout_s": 100.0, "backend_stall_timeout_s": TIMEOUT})
    backend = stopped_backend(h)
    assert (backend.first_byte_timeout, backend.stall_timeout) == (own, TIMEOUT)
    stoppable.answers.append(Answer(stop_after=0))
    resp, raw, took = await timed_post(h, completion(stream=True))
    assert resp.status == 504 and own <= took < own + SLACK, raw


@pytest.mark.parametrize("value", [0, -1, float("inf"), "30", True])
@pytest.mark.parametrize("name", ["first_byte_timeout_s", "stall_timeout_s"])
def test_timeouts_must_be_positive_numbers(name: str, value: Any) -> None:
    with pytest.raises(ValueError, match=f"gateway.backends\\[\\].{name} must be"):
        BackendConfig(url="http://127.0.0.1:8100", **{name: value})
    with pytest.raises(ValueError, match=f"gateway.backend_{name} must be"):
        GatewayConfig.from_dict({f"backend_{name}": value})


async def test_backend_down_warning_says_why(aiohttp_client: Any, aiohttp_server: Any,
                                             db_url: str, stoppable: StoppableEngine,
                                             caplog: pytest.LogCaptureFixture,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A health check that times out names what went unanswered (a bare TimeoutError's text
    is empty)."""
    monkeypatch.setattr(remote, "HEALTH_TIMEOUT_S", TIMEOUT)
    server = await aiohttp_server(stoppable.app())
    h = await start_gateway(aiohttp_client, db_url,
                            gateway={"backends": [{"url": str(server.make_url("/"))}]})
    backend = stopped_backend(h)
    stoppable.stop()
    await wait_for(lambda: not backend.healthy, timeout=TIMEOUT + SLACK)
    down = [r.getMessage() for r in caplog.records if "is down" in r.getMessage()]
    assert down == [f"backend {backend.name} is down: "
                    f"no answer to GET /load within {TIMEOUT:g} s"]


# ---- what the client sees of a remote engine's stream ------------------------------------------
@pytest.mark.parametrize("path, body", [
    ("/v1/completions", completion(max_tokens=3)),
    ("/v1/chat/completions", {"model": MODEL, "max_tokens": 3,
                              "messages": [{"role": "user", "content": "hi"}]})])
async def test_stream_carries_usage_only_when_asked_as_openai_does(
        aiohttp_client: Any, aiohttp_server: Any, db_url: str, path: str,
        body: dict[str, Any]) -> None:
    """The gateway always asks the engine for usage; the client sees OpenAI's stream: without
    include_usage no chunk has a `usage` key, with it every chunk has `usage: null` and a last
    chunk has the counts and no choices."""
    server = await aiohttp_server(make_engine_app(AsyncEngine(SIM_ENGINE)))
    h = await start_gateway(aiohttp_client, db_url,
                            gateway={"backends": [{"url": str(server.make_url("/"))}]})
    plain = sse_events(await (await h.post("acme", {**body, "stream": True}, path)).read())
    assert plain and all("usage" not in e and e["choices"] for e in plain), plain
    asked = sse_events(await (await h.post("acme", {
        **body, "stream": True, "stream_options": {"include_usage": True}}, path)).read())
    *chunks, last = asked
    assert chunks and all(e["usage"] is None and e["choices"] for e in chunks), asked
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 3


# ---- the upstream client's deadlines, on both event loops --------------------------------------
LOOPS = [pytest.param(asyncio.new_event_loop, id="asyncio"),
         pytest.param(uvloop.new_event_loop, id="uvloop")]


def run_on(loop_factory: Callable[[], asyncio.AbstractEventLoop],
           test: Callable[[], Awaitable[None]]) -> None:
    async def bounded() -> None:
        async with asyncio.timeout(5):
            await test()

    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(bounded())


@contextlib.asynccontextmanager
async def raw_server(*parts: bytes) -> AsyncIterator[tuple[UpstreamPool, asyncio.Event]]:
    """A server that reads a request, writes `parts` and then says nothing more; a pool to it
    and an event set when the client closes the connection."""
    closed = asyncio.Event()
    writers: list[asyncio.StreamWriter] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        await reader.readuntil(b"\r\n\r\n")
        for part in parts:
            writer.write(part)
        await reader.read()  # b"" once the client closes
        closed.set()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    pool = UpstreamPool(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}")
    try:
        yield pool, closed
    finally:
        pool.close()
        for writer in writers:
            writer.close()
        server.close()
        await server.wait_closed()


SSE_HEAD = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"


@pytest.mark.parametrize("loop_factory", LOOPS)
def test_no_answer_in_time_closes_the_connection(
        loop_factory: Callable[[], asyncio.AbstractEventLoop]) -> None:
    async def test() -> None:
        async with raw_server() as (pool, closed):
            start = time.monotonic()
            with pytest.raises(UpstreamTimeout, match="no answer to GET /x within 0.2 s"):
                await pool.request("GET", "/x", timeout=0.2)
            assert time.monotonic() - start >= 0.19  # timers may fire a hair early
            await closed.wait()
            assert pool.idle == 0

    run_on(loop_factory, test)


@pytest.mark.parametrize("loop_factory", LOOPS)
def test_patience_extends_the_wait_until_it_runs_out(
        loop_factory: Callable[[], asyncio.AbstractEventLoop]) -> None:
    async def test() -> None:
        asked: list[float] = []

        def patience() -> float | None:
            asked.append(time.monotonic())
            return 0.05 if len(asked) < 3 else None

        async with raw_server() as (pool, closed):
            start = time.monotonic()
            with pytest.raises(UpstreamTimeout):
                await pool.request("GET", "/x", timeout=0.1, patience=patience)
            assert len(asked) == 3 and time.monotonic() - start >= 0.19  # timers may fire a hair early
            await closed.wait()

    run_on(loop_factory, test)


@pytest.mark.parametrize("loop_factory", LOOPS)
def test_a_stall_mid_body_closes_the_connection(
        loop_factory: Callable[[], asyncio.AbstractEventLoop]) -> None:
    async def test() -> None:
        async with raw_server(SSE_HEAD, b"3\r\nabc\r\n") as (pool, closed):
            resp = await pool.request("GET", "/x", timeout=5)
            resp.watch_stalls(0.1)
            assert await resp.next_chunk() == b"abc"
            start = time.monotonic()
            with pytest.raises(UpstreamTimeout, match="sent nothing for 0.1 s"):
                await resp.next_chunk()
            assert time.monotonic() - start >= 0.09
            resp.close()
            await closed.wait()

    run_on(loop_factory, test)


async def test_a_timed_out_engine_stays_down_while_its_web_side_still_answers(
        aiohttp_client: Any, aiohttp_server: Any, db_url: str,
        stoppable: StoppableEngine) -> None:
    """An engine whose executor hangs still answers /load: after a timeout it stays out of
    the pool for backend_retry_after_s, not until the next poll 20 ms later."""
    hold = 1.0
    h = await two_engines(aiohttp_client, aiohttp_server, db_url, stoppable,
                          backend_retry_after_s=hold)
    stoppable.answers.append(Answer(delay=30.0))  # generation stuck; /load still answers
    resp, raw, _ = await timed_post(h, completion(stream=True))
    assert resp.status == 504, raw
    backend = stopped_backend(h)
    down_at = time.monotonic()
    sent = len(stoppable.connections)
    for _ in range(3):  # requests meanwhile go to the other engine
        assert (await h.post("acme", completion(max_tokens=2))).status == 200
    assert not backend.healthy and len(stoppable.connections) == sent
    await wait_for(lambda: backend.healthy, timeout=hold + 5)
    assert time.monotonic() - down_at >= hold * 0.9
