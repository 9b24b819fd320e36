"""A scripted OpenAI-compatible streaming server whose delays are known: the truth that the load
generator's measurements are checked against, and an instant server for load-generator benches.

    app = make_fake_app(ttft=0.05, itl=0.01)        # in-process (aiohttp_client fixture)
    python -m tuner.fake_server --port 8123 --ttft 0.05 --itl 0.01 --status 200,429

Every answer streams `max_tokens` tokens (or `output_tokens` when set), the first `ttft` seconds
after the request, then one every `itl` seconds on a fixed schedule (no drift from late wakeups).
`statuses` is cycled per completion request: a non-200 entry answers with OpenAI's error shape.
`line_end` writes every SSE line end as LF (the default), CRLF (sse-starlette's default) or CR.
Prompt tokens are counted like fairgate's byte tokenizer: UTF-8 bytes + 1 (BOS).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import itertools
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from protocol.sse import DONE, sse_json

LINE_ENDS = {"lf": "\n", "crlf": "\r\n", "cr": "\r"}  # --line-end names: the spec's three


@dataclass
class FakeScript:
    ttft: float = 0.0
    itl: float = 0.0
    statuses: Sequence[int] = (200,)
    output_tokens: int | None = None  # None = honour max_tokens
    api_keys: frozenset[str] | None = None  # None = any key (or none) is accepted
    model: str = "fake-model"
    tokens_per_chunk: int = 1
    record: bool = True
    send_usage: bool = True  # False: never send the usage chunk, even when asked
    line_end: str = "\n"  # written for every SSE line end: one of LINE_ENDS' values
    received: list[dict[str, Any]] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0

    def __post_init__(self) -> None:
        if self.line_end not in LINE_ENDS.values():
            raise ValueError(f"line_end must be LF, CRLF or CR, got {self.line_end!r}")
        self._statuses = itertools.cycle(self.statuses or (200,))

    def next_status(self) -> int:
        return next(self._statuses)


SCRIPT = web.AppKey("fake_script", FakeScript)


def make_fake_app(
    ttft: float = 0.0,
    itl: float = 0.0,
    statuses: Sequence[int] = (200,),
    output_tokens: int | None = None,
    api_keys: Sequence[str] | None = None,
    model: str = "fake-model",
    tokens_per_chunk: int = 1,
    record: bool = True,
    send_usage: bool = True,
    line_end: str = "\n",
) -> web.Application:
    """The fake server; `app[SCRIPT].received` holds every completion body it got."""
    app = web.Application()
    app[SCRIPT] = FakeScript(
        ttft,
        itl,
        tuple(statuses),
        output_tokens,
        frozenset(api_keys) if api_keys is not None else None,
        model,
        max(1, tokens_per_chunk),
        record,
        send_usage,
        line_end=line_end,
    )
    app.router.add_get("/v1/models", _models)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/chat/completions", _completions)
    return app


def _error(status: int, message: str) -> web.Response:
    headers = {"Retry-After": "1"} if status == 429 else None
    body = {"error": {"message": message, "type": "fake_error", "code": status}}
    return web.json_response(body, status=status, headers=headers)


def _authorized(request: web.Request, script: FakeScript) -> bool:
    if script.api_keys is None:
        return True
    auth = request.headers.get("Authorization", "")
    return auth.startswith("Bearer ") and auth[7:] in script.api_keys


async def _models(request: web.Request) -> web.Response:
    script = request.app[SCRIPT]
    if not _authorized(request, script):
        return _error(401, "invalid API key")
    return web.json_response({"object": "list", "data": [{"id": script.model, "object": "model"}]})


async def _completions(request: web.Request) -> web.StreamResponse:
    script = request.app[SCRIPT]
    script.in_flight += 1
    script.max_in_flight = max(script.max_in_flight, script.in_flight)
    try:
        return await _answer(request, script)
    finally:
        script.in_flight -= 1


async def _answer(request: web.Request, script: FakeScript) -> web.StreamResponse:
    arrived = time.perf_counter()
    if not _authorized(request, script):
        return _error(401, "invalid API key")
    body = json.loads(await request.read())
    if script.record:
        script.received.append(body)
    status = script.next_status()
    if status != 200:
        return _error(status, f"scripted status {status}")
    chat = request.path.endswith("/chat/completions")
    prompt = body["messages"][-1]["content"] if chat else body["prompt"]
    n = script.output_tokens or int(body.get("max_tokens") or 16)
    prompt_tokens = len(prompt.encode()) + 1
    usage = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": n,
        "total_tokens": prompt_tokens + n,
    }
    tail = DONE
    if _wants_usage(script, body):
        tail = sse_json({"id": "fake", "choices": [], "usage": usage}) + DONE
    tail = _with_line_end(tail, script.line_end)
    writes = _schedule(script, n, chat)
    if script.ttft == 0 and script.itl == 0:  # instant: one plain response, the cheapest answer
        return web.Response(body=writes[0][1] + tail, content_type="text/event-stream")
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for due, payload in writes:
        delay = arrived + due - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        await resp.write(payload)
    await resp.write(tail)
    return resp


def _wants_usage(script: FakeScript, body: dict[str, Any]) -> bool:
    options = body.get("stream_options") or {}
    return script.send_usage and bool(options.get("include_usage"))


def _with_line_end(sse: bytes, line_end: str) -> bytes:
    """`sse` (as protocol.sse writes it, LF line ends) with each line end written as `line_end`:
    its only raw LFs are line ends, since JSON escapes the newlines inside strings."""
    return sse if line_end == "\n" else sse.replace(b"\n", line_end.encode())


def _schedule(script: FakeScript, n: int, chat: bool) -> list[tuple[float, bytes]]:
    """(seconds after arrival, bytes) per write; without delays everything is one write."""
    return _schedule_cached(
        script.ttft, script.itl, script.tokens_per_chunk, n, chat, script.line_end
    )


@functools.lru_cache(maxsize=256)  # benches send the same lengths again and again
def _schedule_cached(
    ttft: float, itl: float, per_chunk: int, n: int, chat: bool, line_end: str
) -> list[tuple[float, bytes]]:
    chunks = []
    if chat:  # OpenAI opens a chat stream with an empty, role-only delta
        chunks.append(
            sse_json(
                {
                    "id": "fake",
                    "choices": [
                        {
                            "index": 0,
                            "delta": {"role": "assistant", "content": ""},
                            "finish_reason": None,
                        }
                    ],
                }
            )
        )
    sizes = [min(per_chunk, n - i) for i in range(0, n, per_chunk)]
    for k, size in enumerate(sizes):
        finish = "length" if k == len(sizes) - 1 else None
        text = "a" * size
        choice: dict[str, Any] = (
            {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
        )
        choice["finish_reason"] = finish
        chunks.append(sse_json({"id": "fake", "object": "fake", "choices": [choice]}))
    chunks = [_with_line_end(c, line_end) for c in chunks]
    if itl == 0:
        return [(ttft, b"".join(chunks))]
    head = len(chunks) - len(sizes)  # the role preamble goes out with the first token
    first = b"".join(chunks[: head + 1])
    rest = [(ttft + k * itl, c) for k, c in enumerate(chunks[head + 1 :], 1)]
    return [(ttft, first), *rest]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tuner.fake_server",
        description="scripted OpenAI-compatible streaming server",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 = any free port (printed)")
    parser.add_argument("--ttft", type=float, default=0.0, help="seconds to the first token")
    parser.add_argument("--itl", type=float, default=0.0, help="seconds between tokens")
    parser.add_argument("--status", default="200", help="comma-separated statuses, cycled")
    parser.add_argument("--output-tokens", type=int, default=None)
    parser.add_argument("--api-key", action="append", default=None, help="accepted key(s)")
    parser.add_argument("--no-record", action="store_true", help="do not keep request bodies")
    parser.add_argument(
        "--line-end", choices=LINE_ENDS, default="lf", help="SSE line ends (default: lf)"
    )
    args = parser.parse_args(argv)
    app = make_fake_app(
        args.ttft,
        args.itl,
        [int(s) for s in args.status.split(",")],
        args.output_tokens,
        args.api_key,
        record=not args.no_record,
        line_end=LINE_ENDS[args.line_end],
    )
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve(app, args.host, args.port))
    return 0


async def _serve(app: web.Application, host: str, port: int) -> None:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=4096)
    await site.start()
    bound = runner.addresses[0][1]
    # The first stdout line tells a parent process where to connect.
    print(f"fake server listening on http://{host}:{bound}", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


if __name__ == "__main__":
    sys.exit(main())
