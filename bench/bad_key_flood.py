"""What does a flood of random bad keys cost legitimate tenants? The same legitimate load
through `fairgate serve`, without and with a flood of random API keys from another process,
interleaved in one run.

    .venv/bin/python bench/bad_key_flood.py [--rate 100] [--flood-rate 500] [--duration 8]
        [--postgres postgresql://postgres@127.0.0.1:5432]   # the tenant database (default SQLite)

The flood's keys are random but well-formed (`fg-` + 43 URL-safe characters: the shape the
gateway cannot reject without asking the database), all from one address. Two gateways share
one engine (`fairgate engine`, simulated executor, virtual clock): one as configured by default
(failed-lookup budget per address), one with the budget off (`auth_failures_per_s: 0`: every
random key is a database lookup, as before issue 13). A third condition aims the same flood at a
sink (a bare aiohttp server answering 401) instead: on a small machine the flood's own client
takes CPU from everyone, and that share is not the gateway's doing. Goal: with the budget,
legitimate median and p99 latency under the flood <= 1.2x the same gateway's without it.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository

from bench.common import (  # noqa: E402
    PYTHON,
    ROOT,
    add_load_options,
    free_port,
    machine,
    measure,
    open_loop,
    start_engine,
    start_gateway,
    stop,
)
from bench.gateway_overhead import latency_row, stats  # noqa: E402
from tuner.report import RequestResult  # noqa: E402

BUDGET, NO_BUDGET = "gateway (failed-lookup budget)", "gateway (budget off)"


async def flood(url: str, rate: float, duration: float) -> None:
    """Random well-formed keys at `rate`/s for `duration` s; prints the statuses it got."""
    import secrets

    import aiohttp

    statuses: collections.Counter[int] = collections.Counter()
    body = b'{"prompt": "hi", "max_tokens": 2}'

    async def one(session: aiohttp.ClientSession) -> None:
        key = "fg-" + secrets.token_urlsafe(32)
        try:
            async with session.post(f"{url}/v1/completions", data=body, headers={
                    "Authorization": f"Bearer {key}",
                    "Content-Type": "application/json"}) as resp:
                await resp.read()
                statuses[resp.status] += 1
        except aiohttp.ClientError:
            statuses[0] += 1

    connector = aiohttp.TCPConnector(limit=256)
    async with aiohttp.ClientSession(connector=connector) as session:
        tasks, start, n = set(), time.perf_counter(), 0
        while (now := time.perf_counter() - start) < duration:
            if n < now * rate:
                task = asyncio.ensure_future(one(session))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                n += 1
            else:
                await asyncio.sleep(max(0.0, (n / rate) - now))
        await asyncio.gather(*tasks)
    print(" ".join(f"{status}:{count}" for status, count in sorted(statuses.items())), flush=True)


SINK = """
import sys
from aiohttp import web
async def deny(request):
    return web.json_response({"error": {"message": "Incorrect API key provided."}}, status=401)
app = web.Application()
app.router.add_route("*", "/{tail:.*}", deny)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None, access_log=None)
"""


def start_flood(url: str, rate: float, duration: float) -> subprocess.Popen[str]:
    return subprocess.Popen([PYTHON, __file__, "--flood-only", url, "--flood-rate", str(rate),
                             "--duration", str(duration)], cwd=ROOT, stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})


async def run(args: argparse.Namespace, gateways: dict[str, tuple[str, str]],
              sink: str) -> int:
    load = open_loop(args)
    for url, key in gateways.values():
        await measure(url, key, load[:100], "random:tiny")  # warm connections and caches
    pooled: dict[tuple[str, str], list[RequestResult]] = collections.defaultdict(list)
    answers: dict[tuple[str, str], list[str]] = collections.defaultdict(list)
    print(f"\n== {args.rate:g} legitimate streamed requests/s for {args.duration:g} s, "
          f"{args.rounds} rounds; flood {args.flood_rate:g} random keys/s ==")
    conditions = [(label, flood_at) for label in gateways for flood_at in ("none", "sink", "it")]
    for round_ in range(args.rounds):
        k = round_ % len(conditions)
        for label, flood_at in conditions[k:] + conditions[:k]:
            url, key = gateways[label]
            target = {"none": None, "sink": sink, "it": url}[flood_at]
            flooder = None if target is None else start_flood(target, args.flood_rate,
                                                               args.duration + 1)
            if flooder is not None:
                time.sleep(0.5)  # the flood is under way before the measured load starts
            report = await measure(url, key, load, "random:tiny")
            pooled[(label, flood_at)].extend(report.results)
            if flooder is not None:
                out, _ = flooder.communicate(timeout=120)
                answers[(label, flood_at)].append(out.strip())
    names = {"none": "no flood", "sink": "flood at the sink", "it": "flood at the gateway"}
    for label in gateways:
        print(f"\n{label}:")
        for flood_at in ("none", "sink", "it"):
            print("  " + latency_row(names[flood_at], pooled[(label, flood_at)]))
        quiet = stats(pooled[(label, "none")], "e2e")
        for flood_at in ("sink", "it"):
            loud = stats(pooled[(label, flood_at)], "e2e")
            print(f"  {names[flood_at]} / no flood: e2e p50 "
                  f"{loud['median_ms'] / quiet['median_ms']:.2f}x, p99 "
                  f"{loud['p99_ms'] / quiet['p99_ms']:.2f}x;  flood answers (status:count): "
                  f"{' | '.join(answers[(label, flood_at)])}")
    print("\ngoal: with the budget, flood at the gateway / no flood <= 1.2x at p50 and p99")
    return 0


async def _pg(server: str, sql: str) -> None:
    import asyncpg

    conn = await asyncpg.connect(f"{server}/postgres")
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_load_options(parser, rate=100.0, duration=8.0, rounds=2, burst=False)
    parser.add_argument("--flood-rate", type=float, default=500.0)
    parser.add_argument("--postgres", metavar="SERVER_URL", default=None,
                        help="keep tenants in a new database on this PostgreSQL server "
                        "(dropped at the end) instead of SQLite files")
    parser.add_argument("--flood-only", metavar="URL", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.flood_only:
        asyncio.run(flood(args.flood_only, args.flood_rate, args.duration))
        return 0
    engine_port = free_port()
    engine = start_engine(engine_port, {"executor": "sim", "max_num_seqs": 256,
                                        "max_num_batched_tokens": 16384, "max_model_len": 2048})
    backend = {"url": f"http://127.0.0.1:{engine_port}"}
    sink_port = free_port()
    procs: list[subprocess.Popen[Any]] = [subprocess.Popen([PYTHON, "-c", SINK, str(sink_port)])]
    dropped: list[str] = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            gateways = {}
            for i, (label, extra) in enumerate(((BUDGET, {}),
                                                (NO_BUDGET, {"auth_failures_per_s": 0}))):
                database = None
                if args.postgres:
                    database = f"{args.postgres}/fg_bench_flood_{os.getpid()}_{i}"
                    asyncio.run(_pg(args.postgres, f'CREATE DATABASE "{database.rsplit("/", 1)[1]}"'))
                    dropped.append(database)
                proc, url, keys = start_gateway(
                    {"gateway": {"backends": [backend], **extra}}, Path(tmp),
                    tenants={"acme": {}}, database=database)
                procs.append(proc)
                gateways[label] = (url, keys["acme"])
            print(f"engine :{engine_port} (sim, instant tokens); gateways "
                  f"{', '.join(u for u, _ in gateways.values())}; {machine()}")
            return asyncio.run(run(args, gateways, f"http://127.0.0.1:{sink_port}"))
    finally:
        for proc in procs:
            stop(proc)
        stop(engine)
        for database in dropped:
            server, name = database.rsplit("/", 1)
            asyncio.run(_pg(server, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


if __name__ == "__main__":
    sys.exit(main())
