"""The load generator reads every SSE line-end style (CRLF is sse-starlette's default) through
protocol.sse: tokens counted, TTFT and gaps measured, one timestamp per network read."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from protocol.sse import DONE, sse_json
from tuner.fake_server import FakeScript, make_fake_app
from tuner.loadgen import RunOptions, Target, _read_stream, run_workload
from tuner.report import RequestResult
from tuner.traces import TraceRequest

ServerFactory = Callable[[web.Application], Awaitable[TestServer]]
StartServer = Callable[..., str]  # the fake_server_process fixture (conftest.py)
LINE_ENDS = pytest.mark.parametrize("line_end", ["\r\n", "\r", "\n"], ids=["crlf", "cr", "lf"])


EARLY = 0.002  # seconds a timer may fire early


async def _url(aiohttp_server: ServerFactory, app: web.Application) -> str:
    server = await aiohttp_server(app)
    return str(server.make_url("")).rstrip("/")


def _requests(n: int, output: int) -> list[TraceRequest]:
    return [TraceRequest(0.01 * i, 20, output) for i in range(n)]


@LINE_ENDS
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
async def test_streamed_tokens_and_ttft(
    aiohttp_server: ServerFactory, line_end: str, endpoint: str
) -> None:
    ttft, itl, n_out = 0.05, 0.01, 6
    app = make_fake_app(ttft=ttft, itl=itl, line_end=line_end, send_usage=False)
    target = Target(await _url(aiohttp_server, app), endpoint=endpoint, model="m")
    report = await run_workload(_requests(3, n_out), target, options=RunOptions(salt=0))
    assert report.failed == 0 and report.total.completed == 3
    for r in report.results:
        assert r.output_tokens == n_out and len(r.itl) == n_out - 1  # counted, not from usage
        # asyncio may wake a timer up to its clock resolution early: allow 2 ms
        assert r.ttft is not None and ttft - EARLY <= r.ttft < ttft + 1.0  # a cold start stalls
        assert r.e2e is not None and r.e2e >= ttft + (n_out - 1) * itl - EARLY


@LINE_ENDS
async def test_one_read_answer_with_usage(aiohttp_server: ServerFactory, line_end: str) -> None:
    app = make_fake_app(line_end=line_end)  # no delays: the whole stream in one body
    report = await run_workload(_requests(2, 9), await _url(aiohttp_server, app))
    assert [r.output_tokens for r in report.results] == [9, 9]  # the usage event was read
    assert [r.prompt_tokens for r in report.results] == [20, 20]
    assert all(r.ttft is not None and r.ttft > 0 for r in report.results)


async def test_cli_line_end_flag(fake_server_process: StartServer) -> None:
    url = fake_server_process("--itl", "0.001", "--line-end", "cr")
    report = await run_workload(_requests(2, 4), Target(url, model="m"))
    assert [r.output_tokens for r in report.results] == [4, 4]
    with pytest.raises(ValueError, match="line_end must be LF, CRLF or CR"):
        FakeScript(line_end="\n\n")


class _Content:
    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks

    async def iter_any(self) -> AsyncIterator[bytes]:
        for chunk in self.chunks:
            yield chunk


class _Response:
    """What `_read_stream` reads: `content.iter_any()`, the reads given exactly."""

    def __init__(self, chunks: list[bytes]) -> None:
        self.content = _Content(chunks)


def _token(text: str, finish: str | None = None) -> bytes:
    return sse_json({"choices": [{"index": 0, "text": text, "finish_reason": finish}]})


STREAM = (
    b": keep-alive\n\n"
    + _token("a")
    + _token("\u20ac\n")  # a multi-byte character, and an escaped newline
    + _token("", "length")
    + sse_json({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2}})
    + DONE
)


async def _read(chunks: list[bytes]) -> RequestResult:
    result = RequestResult(0, "default", None, 0.0)
    await _read_stream(_Response(chunks), 0.0, result)  # type: ignore[arg-type]
    return result


@LINE_ENDS
async def test_reads_split_anywhere(line_end: str) -> None:
    stream = STREAM.replace(b"\n", line_end.encode())
    whole = await _read([stream])
    assert (whole.status, whole.output_tokens, whole.prompt_tokens) == ("ok", 2, 5)
    assert whole.itl == [0.0]  # events of one read share its timestamp
    by_byte = await _read([stream[i : i + 1] for i in range(len(stream))])
    assert (by_byte.status, by_byte.output_tokens, by_byte.prompt_tokens) == ("ok", 2, 5)
    assert len(by_byte.itl) == 1 and by_byte.itl[0] > 0  # the two tokens: different reads


async def test_error_event_and_multi_line_data() -> None:
    # A spec reader joins data lines: one JSON object may span several of them.
    multi = b'data: {"choices":[{"text":"a",\r\ndata: "finish_reason":null}]}\r\n\r\n'
    result = await _read([multi, b'data: {"error": {"message": "engine died"}}\r\n', b"\r\n"])
    assert (result.status, result.error) == ("stream error", "engine died")
    result = await _read([multi, multi, DONE])
    assert (result.status, result.output_tokens) == ("ok", 2)
