"""What does the gateway cost in CPU per request, against the backend it fronts?

A mock OpenAI backend (a bare aiohttp server: /v1/models, /v1/chat/completions non-streaming
and streaming in 16 token chunks plus the usage chunk) and `fairgate serve` in front of it, as
a user runs it: the mock as a `kind: openai` backend, the usage ledger on SQLite, metrics and
fair share on. The same closed-loop load (the same requests over the same number of keep-alive
connections) goes to the mock directly and through the gateway; each process's CPU time (utime
+ stime from /proc/<pid>/stat, all threads) over the run, divided by the requests, is its cost
per request. The load generator is this process: its CPU is counted for neither.

Beside them runs the floor: `bench/bare_proxy.py --client lean`, aiohttp's server and the
gateway's own upstream client (`gateway.upstream.UpstreamPool`) forwarding bytes and nothing else.
No proxy built on these two can cost less, so `gateway - floor` is the gateway's own work per
request (auth, parsing, admission, fair share, metrics, the ledger, the SSE pass-through), and
`goal x mock - floor` is what the goal leaves it.

And beside them (unless `--token-interval-ms` paces the mock) the minimal server: the mock's
answers from an asyncio protocol and httptools, nothing else. The mock's cost over it is what
aiohttp's server takes per request before a handler does anything; the mock, the floor and the
gateway all pay it.

    .venv/bin/python bench/gateway_cpu.py [--requests 4000] [--concurrency 16] [--rounds 3]
                                          [--baseline DIR] [--token-interval-ms MS]

`--baseline DIR` runs a second gateway from another checkout (`git worktree add --detach DIR
REV`) in the same rounds, rotated with the others, and prints this tree's CPU per request over
its, and the median and middle half of the rounds' own ratios: on a shared machine whose speed
drifts between runs, a change of a few percent shows only when both run side by side, and only
where the middle half of the ratios sits clear of 1.

`--token-interval-ms MS` has the mock pause between a stream's token events, so each reaches
the gateway in a read of its own, as from an engine generating: the gateway's cost per token
read and written, which the default shape (the whole answer in about one read) leaves out.

Goals (issue 28): the gateway at most 1.6x the mock's CPU per request non-streaming, 1.4x
streaming. The ratio is taken within one run, so the machine's speed cancels out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, cast

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository

from bench.common import (  # noqa: E402
    PYTHON,
    ROOT,
    free_port,
    machine,
    rotated,
    start_gateway,
    stop,
    verdict,
    wait_healthy,
)

MODEL = "mock-model"
CHUNKS = 16  # token events per streamed answer
GOALS = {False: 1.6, True: 1.4}  # gateway / mock CPU per request: non-streaming, streaming
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


# ---- the mock backend (its own process: `gateway_cpu.py --mock PORT`) ------------------------
def mock_answer(body: dict[str, Any]) -> dict[str, Any] | list[bytes]:
    """The mock's answer to a chat request: the completion, or a stream's events (CHUNKS token
    events, the usage event when asked for, [DONE])."""
    prompt = sum(len(m.get("content") or "") for m in body.get("messages", []))
    usage = {"prompt_tokens": prompt // 4 + 1, "completion_tokens": CHUNKS,
             "total_tokens": prompt // 4 + 1 + CHUNKS}
    base = {"id": "chatcmpl-mock", "created": int(time.time()), "model": body["model"]}
    if not body.get("stream"):
        return {**base, "object": "chat.completion", "usage": usage,
                "choices": [{"index": 0, "finish_reason": "length", "message": {
                    "role": "assistant", "content": " tok" * CHUNKS}}]}
    chunk = {**base, "object": "chat.completion.chunk"}
    events = [{**chunk, "choices": [{"index": 0, "delta": {"content": " tok"},
                                     "finish_reason": "length" if i == CHUNKS - 1 else None}]}
              for i in range(CHUNKS)]
    if (body.get("stream_options") or {}).get("include_usage"):
        events.append({**chunk, "choices": [], "usage": usage})
    return [b"data: " + json.dumps(event).encode() + b"\n\n" for event in events] + [
        b"data: [DONE]\n\n"]


def serve_mock(port: int, token_interval_s: float = 0.0) -> None:
    from aiohttp import web

    from engine.server import install_fast_event_loop

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def chat(request: web.Request) -> web.StreamResponse:
        answer = mock_answer(await request.json())
        if isinstance(answer, dict):
            return web.json_response(answer)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
        await resp.prepare(request)
        for i, event in enumerate(answer):
            await resp.write(event)
            if token_interval_s and i < CHUNKS - 1:  # an engine's pace: one event per read
                await asyncio.sleep(token_interval_s)
        await resp.write_eof()
        return resp

    async def ready(request: web.Request) -> web.Response:
        return web.json_response({"ready": True})

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/readyz", ready)
    install_fast_event_loop()
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


# ---- the same answers from a minimal server (`gateway_cpu.py --raw-mock PORT`) -------------------
def serve_raw_mock(port: int) -> None:
    """The mock's answers from the least a Python HTTP/1.1 server can be: an asyncio protocol,
    llhttp (`httptools`) for the request, each answer written as bytes. No routing, no request
    object, no timeouts, no error handling: what aiohttp's server (the mock's) costs over this
    is the share of a request any aiohttp server pays before its handler does anything."""
    import httptools

    from engine.server import install_fast_event_loop

    class Connection(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.transport = cast(asyncio.Transport, transport)
            self.parser = httptools.HttpRequestParser(self)
            self.body: list[bytes] = []

        def data_received(self, data: bytes) -> None:
            self.parser.feed_data(data)

        def on_body(self, body: bytes) -> None:
            self.body.append(body)

        def on_message_complete(self) -> None:
            body, self.body = b"".join(self.body), []
            write = self.transport.write
            if not body:  # GET /readyz (and anything else without a body)
                answer = b'{"ready": true}'
                write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n%b" % (len(answer), answer))
                return
            events = mock_answer(json.loads(body))
            if isinstance(events, dict):
                answer = json.dumps(events).encode()
                write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n%b" % (len(answer), answer))
                return
            write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                  b"Cache-Control: no-cache\r\nTransfer-Encoding: chunked\r\n\r\n")
            for event in events:  # one write an event, as the mock's
                write(b"%x\r\n%b\r\n" % (len(event), event))
            write(b"0\r\n\r\n")

    async def main() -> None:
        server = await asyncio.get_running_loop().create_server(Connection, "127.0.0.1", port)
        await server.serve_forever()

    install_fast_event_loop()
    asyncio.run(main())


# ---- CPU of a process --------------------------------------------------------------------------
def cpu_seconds(pid: int) -> float:
    """utime + stime of `pid` (all its threads) so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # fields 14 and 15 of stat(5)


# ---- the load: fixed keep-alive connections, closed loop ---------------------------------------
def request_body(stream: bool) -> bytes:
    return json.dumps({"model": MODEL, "stream": stream, "max_tokens": CHUNKS, "messages": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Say something about the weather in a few words."}]}).encode()


async def drive(url: str, key: str | None, stream: bool, requests: int,
                concurrency: int) -> float:
    """`requests` chat requests over `concurrency` connections; the wall time. Every answer
    must be a 200 (and a stream must end with [DONE])."""
    from gateway.upstream import UpstreamPool

    pool = UpstreamPool(url, {"Authorization": f"Bearer {key}"} if key else None)
    body, left = request_body(stream), [requests]

    async def worker() -> None:
        while left[0] > 0:
            left[0] -= 1
            resp = await pool.request("POST", "/v1/chat/completions", body, timeout=30)
            try:
                data = await resp.read()
            finally:
                resp.close()
            if resp.status != 200 or (stream and not data.endswith(b"data: [DONE]\n\n")):
                raise SystemExit(f"{url}: HTTP {resp.status}: {data[:300]!r}")

    start = time.perf_counter()
    try:
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    finally:
        pool.close()
    return time.perf_counter() - start


async def measure(pid: int, url: str, key: str | None, stream: bool,
                  args: argparse.Namespace) -> tuple[float, float]:
    """(CPU µs per request of `pid`, requests/s) over one run of the load."""
    before = cpu_seconds(pid)
    wall = await drive(url, key, stream, args.requests, args.concurrency)
    return (cpu_seconds(pid) - before) / args.requests * 1e6, args.requests / wall


def median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def middle_half(values: list[float]) -> tuple[float, float]:
    """The first and third quartiles, by the project's percentile rule (protocol.stats)."""
    from protocol.stats import percentile_of_sorted

    ordered = sorted(values)
    return percentile_of_sorted(ordered, 25), percentile_of_sorted(ordered, 75)


async def run(args: argparse.Namespace, targets: dict[str, tuple[int, str, str | None]]) -> int:
    """Each target's CPU per request, rounds rotated; the verdicts. `targets`: label ->
    (pid, url, API key)."""
    met = True
    for stream in (False, True):
        for _, url, k in targets.values():  # warm: connections, caches, the estimator's seed
            await drive(url, k, stream, min(500, args.requests), args.concurrency)
        cpu: dict[str, list[float]] = {label: [] for label in targets}
        rate: dict[str, list[float]] = {label: [] for label in targets}
        for round_ in range(args.rounds):
            for label in rotated(list(targets), round_):
                pid, url, k = targets[label]
                us, rps = await measure(pid, url, k, stream, args)
                cpu[label].append(us)
                rate[label].append(rps)
        kind = f"streaming, {CHUNKS} chunks" if stream else "non-streaming"
        print(f"\n== {kind}: {args.requests} chat requests x {args.rounds} rounds, "
              f"{args.concurrency} connections; median of the rounds ==")
        for label in targets:
            print(f"{label:<22} {median(cpu[label]):6.0f} µs CPU per request   "
                  f"{median(rate[label]):6.0f} requests/s   (rounds: "
                  f"{', '.join(f'{us:.0f}' for us in cpu[label])} µs)")
        mock, floor, gateway = median(cpu[MOCK]), median(cpu[FLOOR]), median(cpu[GATEWAY])
        ratio = gateway / mock
        print(f"lean proxy / mock: {floor / mock:.2f} (the floor)   gateway / lean proxy: "
              f"{gateway / floor:.2f}   gateway's own work: {gateway - floor:.0f} µs per request")
        # What the goal leaves the gateway's own work (auth, parsing, admission, fair share,
        # metrics, the ledger) once a proxy on aiohttp's server and this client is paid for.
        server = (f"; aiohttp's server (the mock's) over the minimal one: "
                  f"{mock - median(cpu[RAW]):.0f} µs per request" if RAW in cpu else "")
        print(f"the goal leaves the gateway's own work {GOALS[stream] * mock - floor:.0f} µs "
              f"({GOALS[stream]:g} x the mock - the floor){server}")
        if BASELINE in cpu:
            ratios = [a / b for a, b in zip(cpu[GATEWAY], cpu[BASELINE], strict=True)]
            low, high = middle_half(ratios)
            print(f"gateway / baseline gateway: "
                  f"{median(cpu[GATEWAY]) / median(cpu[BASELINE]):.3f}; the rounds' own ratios: "
                  f"median {median(ratios):.3f}, middle half {low:.3f}-{high:.3f} (round by "
                  f"round: {', '.join(f'{r:.3f}' for r in ratios)})")
        print(f"gateway / mock CPU per request: {ratio:.2f}   goal <= {GOALS[stream]:g}   "
              f"{verdict(ratio <= GOALS[stream])}")
        met = met and ratio <= GOALS[stream]
    return 0 if met else 1


MOCK, FLOOR, GATEWAY = "mock backend", "lean proxy (floor)", "gateway (fairgate serve)"
RAW = "minimal server"
BASELINE = "baseline gateway"


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--requests", type=int, default=4000, help="per round and target")
    parser.add_argument("--concurrency", type=int, default=16, help="keep-alive connections")
    parser.add_argument("--rounds", type=int, default=3,
                        help="each target measured this many times, interleaved (median)")
    parser.add_argument("--baseline", type=Path, metavar="DIR",
                        help="another checkout whose gateway runs beside this one's, rotated")
    parser.add_argument("--token-interval-ms", type=float, default=0.0, metavar="MS",
                        help="the mock's pause between a stream's token events (default 0: the "
                             "whole answer at once, read by the gateway in about one read; "
                             "1 or more: one event per read, as from an engine generating)")
    parser.add_argument("--mock", type=int, metavar="PORT", help=argparse.SUPPRESS)
    parser.add_argument("--raw-mock", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not 0 <= args.token_interval_ms < 1000:
        parser.error("--token-interval-ms must be at least 0 and below 1000")
    if args.mock is not None:
        serve_mock(args.mock, args.token_interval_ms / 1000)
        return 0
    if args.raw_mock is not None:
        serve_raw_mock(args.raw_mock)
        return 0
    if args.baseline is not None and not (args.baseline / "fairgate" / "__main__.py").is_file():
        parser.error(f"--baseline {args.baseline}: not a fairgate checkout (no "
                     f"fairgate/__main__.py); make one with `git worktree add --detach DIR REV`")
    mock_port = free_port()
    mock_url = f"http://127.0.0.1:{mock_port}"
    mock = subprocess.Popen([PYTHON, str(Path(__file__).resolve()), "--mock", str(mock_port),
                             "--token-interval-ms", str(args.token_interval_ms)],
                            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    raw_port = free_port()
    raw_url = f"http://127.0.0.1:{raw_port}"
    paced = args.token_interval_ms > 0  # the minimal server does not pace: left out then
    raw = None if paced else subprocess.Popen(
        [PYTHON, str(Path(__file__).resolve()), "--raw-mock", str(raw_port)], cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    floor_port = free_port()
    floor_url = f"http://127.0.0.1:{floor_port}"
    floor = subprocess.Popen([PYTHON, str(ROOT / "bench" / "bare_proxy.py"), mock_url,
                              str(floor_port), "--client", "lean"], cwd=ROOT)
    try:
        wait_healthy(mock_url, mock)
        if raw is not None:
            wait_healthy(raw_url, raw)
        wait_healthy(floor_url, floor)
        backend = {"url": mock_url, "kind": "openai", "max_inflight": 512,
                   "max_model_len": 4096}
        with tempfile.TemporaryDirectory() as tmp:
            config = {"gateway": {"backends": [backend], "dispatch": "fair",
                                  "usage_spill_dir": tmp}}
            gw, gw_url, keys = start_gateway(config, Path(tmp))
            targets: dict[str, tuple[int, str, str | None]] = {
                MOCK: (mock.pid, mock_url, None),
                **({} if raw is None else {RAW: (raw.pid, raw_url, None)}),
                FLOOR: (floor.pid, floor_url, None),
                GATEWAY: (gw.pid, gw_url, keys["demo"])}
            base = None
            try:
                if args.baseline is not None:
                    base, base_url, base_keys = start_gateway(config, Path(tmp),
                                                              tree=args.baseline.resolve())
                    targets[BASELINE] = (base.pid, base_url, base_keys["demo"])
                print(f"mock backend {mock_url} (bare aiohttp); minimal server {raw_url} (the "
                      f"mock's answers from an asyncio protocol and httptools); lean proxy {floor_url} "
                      f"(bench/bare_proxy.py --client lean: aiohttp's server, the gateway's "
                      f"upstream client, nothing else); gateway {gw_url} (ledger on SQLite, "
                      f"metrics, fair share); load generator: this process; {machine()}")
                if base is not None:
                    print(f"baseline gateway {targets[BASELINE][1]} (from {args.baseline})")
                import uvloop

                return uvloop.run(run(args, targets))
            finally:
                stop(gw)
                if base is not None:
                    stop(base)
    finally:
        stop(floor)
        if raw is not None:
            stop(raw)
        stop(mock)


if __name__ == "__main__":
    sys.exit(main())
