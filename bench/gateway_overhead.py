"""What does the gateway add? The same load against an engine server directly and through
`fairgate serve` in front of it.

The engine is `fairgate engine` on the simulated executor with the virtual clock (tokens are
instant), so every millisecond measured is HTTP, JSON, admission, queueing and proxying. Three
processes share this machine's cores: the load generator (this one), the gateway, the engine.

    .venv/bin/python bench/gateway_overhead.py [--rate 200] [--duration 10] [--rounds 3]

Goals: added latency p50 <= 1 ms and p99 <= 5 ms at 200 requests/s; >= 1,000 non-streaming
requests/s through the gateway. Beside them runs bench/bare_proxy.py, an aiohttp reverse proxy
that only forwards bytes: the floor any Python gateway on this machine starts from.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository

from bench.common import (  # noqa: E402
    PYTHON,
    ROOT,
    add_load_options,
    closed_loop,
    free_port,
    machine,
    measure,
    open_loop,
    rotated,
    start_engine,
    start_gateway,
    stop,
)
from tuner.report import RequestResult, latency_stats  # noqa: E402

MODEL = {"engine": "random:tiny", "fake": "fake-model"}


def ms(x: float | None) -> str:
    return "   n/a" if x is None else f"{x:6.2f}"


def stats(results: list[RequestResult], measure: str) -> dict[str, float | None]:
    """latency_stats of `measure` ("ttft" or "e2e") over the successful requests."""
    values = [getattr(r, measure) for r in results if r.ok]
    return latency_stats([v for v in values if v is not None])


def latency_row(label: str, results: list[RequestResult]) -> str:
    ok = sum(r.ok for r in results)
    ttft, e2e = stats(results, "ttft"), stats(results, "e2e")
    return (f"{label:<22} ok {ok:>5}  fail {len(results) - ok:>4}  "
            f"TTFT p50 {ms(ttft['median_ms'])} p99 {ms(ttft['p99_ms'])} ms   "
            f"e2e p50 {ms(e2e['median_ms'])} p99 {ms(e2e['p99_ms'])} ms")


async def run(args: argparse.Namespace, urls: dict[str, str], key: str) -> int:
    model = MODEL[args.backend]
    load = open_loop(args)
    for label, url in urls.items():  # warm every path (connections, caches)
        await measure(url, key if label == GATEWAY else None, load[:200], model)
    print(f"\n== latency at {args.rate:g} requests/s, {args.rounds} rounds x {len(load)} streamed "
          f"requests per target, {args.prompt_tokens} -> {args.output_tokens} tokens ==")
    pooled: dict[str, list[RequestResult]] = {label: [] for label in urls}
    for round_ in range(args.rounds):
        for label in rotated(list(urls), round_):
            report = await measure(urls[label], key if label == GATEWAY else None, load, model)
            pooled[label].extend(report.results)
    for label, results in pooled.items():
        print(latency_row(label, results))
    direct = stats(pooled[DIRECT], "e2e")
    for label in (GATEWAY, BARE):
        e2e = stats(pooled[label], "e2e")
        print(f"added e2e latency, {label}: p50 {e2e['median_ms'] - direct['median_ms']:+.2f} ms"
              f"   p99 {e2e['p99_ms'] - direct['p99_ms']:+.2f} ms")
    print("goals: gateway added p50 <= 1 ms, p99 <= 5 ms")
    burst = closed_loop(args)
    # The fake server answers every request as one SSE body; the engine can answer plain JSON.
    streaming = args.backend == "fake"
    print(f"\n== throughput: {args.requests} {'streamed' if streaming else 'non-streaming'} "
          f"requests, {args.concurrency} concurrent, median of {args.rounds} rounds ==")
    rounds: dict[str, list[float]] = {label: [] for label in urls}
    for round_ in range(args.rounds):
        for label in rotated(list(urls), round_):
            report = await measure(urls[label], key if label == GATEWAY else None, burst, model,
                                   max_concurrency=args.concurrency,
                                   extra_body={"stream": streaming})
            rounds[label].append(report.total.request_throughput
                                 if not report.failed else 0.0)
    rates = {label: float(np.median(r)) for label, r in rounds.items()}
    for label, rate in rates.items():
        print(f"{label:<22} {rate:8.0f} requests/s   "
              f"(rounds: {', '.join(f'{r:.0f}' for r in rounds[label])})")
    print(f"gateway / direct: {rates[GATEWAY] / rates[DIRECT]:.2f}   gateway / bare proxy: "
          f"{rates[GATEWAY] / rates[BARE]:.2f}   goal >= 1,000 requests/s through the gateway")
    return 0


DIRECT, GATEWAY, BARE = "engine directly", "through the gateway", "bare aiohttp proxy"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_load_options(parser, rate=200.0, duration=10.0, rounds=3,
                     rounds_help="each target measured this many times, interleaved; latencies "
                     "pooled, throughput the median (this machine drifts between runs)")
    parser.add_argument("--backend", choices=("engine", "fake"), default="engine",
                        help="engine: `fairgate engine` on the sim executor (the goal's setup); "
                        "fake: tuner.fake_server, nearly free, isolating the gateway's own cost")
    args = parser.parse_args()
    engine_port = free_port()
    engine_url = f"http://127.0.0.1:{engine_port}"
    if args.backend == "engine":
        knobs = {"executor": "sim", "max_num_seqs": 256, "max_num_batched_tokens": 16384,
                 "max_model_len": 2048}
        engine = start_engine(engine_port, knobs)
        backend = {"url": engine_url}
    else:
        engine = subprocess.Popen([PYTHON, "-m", "tuner.fake_server", "--port", str(engine_port),
                                   "--no-record"], cwd=ROOT, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL)
        time.sleep(2)
        backend = {"url": engine_url, "kind": "openai", "max_inflight": 512,
                   "max_model_len": 4096}
    bare_port = free_port()
    bare = subprocess.Popen([PYTHON, str(ROOT / "bench" / "bare_proxy.py"), engine_url,
                             str(bare_port)], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    with tempfile.TemporaryDirectory() as tmp:
        gw, gw_url, keys = start_gateway({"gateway": {"backends": [backend]}}, Path(tmp))
        try:
            print(f"backend {engine_url} ({args.backend}, instant tokens); gateway {gw_url}; "
                  f"{machine()}")
            urls = {DIRECT: engine_url, GATEWAY: gw_url, BARE: f"http://127.0.0.1:{bare_port}"}
            return asyncio.run(run(args, urls, keys["demo"]))
        finally:
            stop(gw)
            stop(bare)
            stop(engine)


if __name__ == "__main__":
    sys.exit(main())
