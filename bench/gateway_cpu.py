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
request (auth, parsing, admission, fair share, metrics, the ledger, the SSE pass-through).

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
def serve_mock(port: int, token_interval_s: float = 0.0) -> None:
    from aiohttp import web

    from engine.server import install_fast_event_loop

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        prompt = sum(len(m.get("content") or "") for m in body.get("messages", []))
        usage = {"prompt_tokens": prompt // 4 + 1, "completion_tokens": CHUNKS,
                 "total_tokens": prompt // 4 + 1 + CHUNKS}
        base = {"id": "chatcmpl-mock", "created": int(time.time()), "model": body["model"]}
        if not body.get("stream"):
            return web.json_response({
                **base, "object": "chat.completion", "usage": usage,
                "choices": [{"index": 0, "finish_reason": "length", "message": {
                    "role": "assistant", "content": " tok" * CHUNKS}}]})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
        await resp.prepare(request)
        chunk = {**base, "object": "chat.completion.chunk"}
        for i in range(CHUNKS):
            last = i == CHUNKS - 1
            event = {**chunk, "choices": [{"index": 0, "delta": {"content": " tok"},
                                           "finish_reason": "length" if last else None}]}
            await resp.write(b"data: " + json.dumps(event).encode() + b"\n\n")
            if token_interval_s and not last:  # an engine's pace: one event per read
                await asyncio.sleep(token_interval_s)
        if (body.get("stream_options") or {}).get("include_usage"):
            event = {**chunk, "choices": [], "usage": usage}
            await resp.write(b"data: " + json.dumps(event).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
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
        ratio = median(cpu[GATEWAY]) / median(cpu[MOCK])
        print(f"lean proxy / mock: {median(cpu[FLOOR]) / median(cpu[MOCK]):.2f} (the floor)   "
              f"gateway / lean proxy: {median(cpu[GATEWAY]) / median(cpu[FLOOR]):.2f}   gateway's "
              f"own work: {median(cpu[GATEWAY]) - median(cpu[FLOOR]):.0f} µs per request")
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
    args = parser.parse_args()
    if not 0 <= args.token_interval_ms < 1000:
        parser.error("--token-interval-ms must be at least 0 and below 1000")
    if args.mock is not None:
        serve_mock(args.mock, args.token_interval_ms / 1000)
        return 0
    if args.baseline is not None and not (args.baseline / "fairgate" / "__main__.py").is_file():
        parser.error(f"--baseline {args.baseline}: not a fairgate checkout (no "
                     f"fairgate/__main__.py); make one with `git worktree add --detach DIR REV`")
    mock_port = free_port()
    mock_url = f"http://127.0.0.1:{mock_port}"
    mock = subprocess.Popen([PYTHON, str(Path(__file__).resolve()), "--mock", str(mock_port),
                             "--token-interval-ms", str(args.token_interval_ms)],
                            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    floor_port = free_port()
    floor_url = f"http://127.0.0.1:{floor_port}"
    floor = subprocess.Popen([PYTHON, str(ROOT / "bench" / "bare_proxy.py"), mock_url,
                              str(floor_port), "--client", "lean"], cwd=ROOT)
    try:
        wait_healthy(mock_url, mock)
        wait_healthy(floor_url, floor)
        backend = {"url": mock_url, "kind": "openai", "max_inflight": 512,
                   "max_model_len": 4096}
        with tempfile.TemporaryDirectory() as tmp:
            config = {"gateway": {"backends": [backend], "dispatch": "fair",
                                  "usage_spill_dir": tmp}}
            gw, gw_url, keys = start_gateway(config, Path(tmp))
            targets: dict[str, tuple[int, str, str | None]] = {
                MOCK: (mock.pid, mock_url, None), FLOOR: (floor.pid, floor_url, None),
                GATEWAY: (gw.pid, gw_url, keys["demo"])}
            base = None
            try:
                if args.baseline is not None:
                    base, base_url, base_keys = start_gateway(config, Path(tmp),
                                                              tree=args.baseline.resolve())
                    targets[BASELINE] = (base.pid, base_url, base_keys["demo"])
                print(f"mock backend {mock_url} (bare aiohttp); lean proxy {floor_url} "
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
        stop(mock)


if __name__ == "__main__":
    sys.exit(main())
