"""How long does a tenant's usage query take while the gateway is saturated?

`GET /v1/usage` first waits for the usage ledger's flush (so it counts every request the
tenant made before asking), under the admin API's 5 s database timeout: past it, a 503. The
flush writes from SQLite's own thread (aiosqlite), which must take the GIL back from the event
loop's thread after every statement step; a saturated loop gives it up only for moments, so a
flush of one-row statements (an executemany: a step per row) waits on the GIL thousands of
times. `tenants.ledger.RowInsert` writes SQLite's rows in multi-row blocks instead (a step per
block of up to 256 rows), and the per-tenant rollups (a row per tenant and minute, and per
tenant and hour) the same way.

This starts `bench/gateway_cpu.py`'s mock backend and `fairgate serve` in front of it (the
ledger on SQLite), saturates the gateway with a closed-loop load (16 workers of non-streamed
chat requests, a keep-alive connection per worker and key), and asks `/v1/usage` every
`--every` seconds while it lasts. `--tenants N` spreads the load over N tenants (each worker
takes turns with its share of their keys), so each flush has N tenants' rollups to write and
each key a first lookup; the load's answers that were not 200 are counted by status and error
code. `--baseline DIR` runs another checkout's gateway in the same rounds, rotated.

    .venv/bin/python bench/usage_under_load.py [--requests 40000] [--rounds 2] [--tenants 1]
                                               [--baseline DIR]
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
from collections import Counter
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
    wait_healthy,
)
from bench.gateway_cpu import request_body  # noqa: E402
from gateway.upstream import UpstreamPool  # noqa: E402
from protocol.stats import percentile_of_sorted  # noqa: E402

THIS, BASELINE = "this tree", "baseline"


async def drive(url: str, keys: list[str], requests: int, concurrency: int) -> Counter[str]:
    """`requests` non-streamed chat requests over `concurrency` workers, each taking turns
    with its share of `keys` (a keep-alive connection a key); the answers' statuses and error
    codes that were not 200, counted."""
    pools = [UpstreamPool(url, {"Authorization": f"Bearer {key}"}) for key in keys]
    body, left, failed = request_body(False), [requests], Counter[str]()

    async def worker(mine: list[UpstreamPool]) -> None:
        turn = 0
        while left[0] > 0:
            left[0] -= 1
            resp = await mine[turn % len(mine)].request("POST", "/v1/chat/completions", body,
                                                        timeout=30)
            turn += 1
            try:
                data = await resp.read()
            finally:
                resp.close()
            if resp.status != 200:
                try:
                    code = json.loads(data)["error"]["code"]
                except (ValueError, KeyError, TypeError):
                    code = None
                failed[f"{resp.status} {code}"] += 1

    try:
        await asyncio.gather(*(worker(pools[w::concurrency] or [pools[w % len(pools)]])
                               for w in range(concurrency)))
    finally:
        for pool in pools:
            pool.close()
    return failed


async def queries(url: str, key: str, load: asyncio.Future[Counter[str]],
                  every: float) -> list[tuple[int, float]]:
    """(status, seconds) of each usage query made while `load` runs."""
    import aiohttp

    found: list[tuple[int, float]] = []
    async with aiohttp.ClientSession() as session:
        await asyncio.sleep(every)  # the load's connections first
        while not load.done():
            start = time.perf_counter()
            async with session.get(f"{url}/v1/usage",
                                   headers={"Authorization": f"Bearer {key}"}) as resp:
                await resp.read()
            found.append((resp.status, time.perf_counter() - start))
            await asyncio.sleep(every)
    return found


async def one_round(url: str, keys: list[str], args: argparse.Namespace
                    ) -> tuple[list[tuple[int, float]], Counter[str]]:
    """The usage queries' (status, seconds) and the load's answers that were not 200."""
    load = asyncio.ensure_future(drive(url, keys, args.requests, args.concurrency))
    try:
        found = await queries(url, keys[0], load, args.every)
    finally:
        failed = await load
    return found, failed


async def run(args: argparse.Namespace, targets: dict[str, tuple[str, list[str]]]) -> None:
    found: dict[str, list[tuple[int, float]]] = {label: [] for label in targets}
    failed: dict[str, Counter[str]] = {label: Counter() for label in targets}
    for round_ in range(args.rounds):
        for label in rotated(list(targets), round_):
            url, keys = targets[label]
            answers, refused = await one_round(url, keys, args)
            found[label] += answers
            failed[label] += refused
    print(f"\n{args.requests} non-streamed chat requests a round from {args.tenants} "
          f"tenant(s), {args.concurrency} workers, {args.rounds} rounds; a usage query every "
          f"{args.every:g} s")
    medians = {}
    for label, answers in found.items():
        times = sorted(seconds for _, seconds in answers)
        errors = sum(status != 200 for status, _ in answers)
        if not times:
            raise SystemExit(f"{label}: no query made; raise --requests")
        medians[label] = percentile_of_sorted(times, 50)
        print(f"{label:<10} {len(times):3d} queries   p50 {medians[label]:6.3f} s   p90 "
              f"{percentile_of_sorted(times, 90):6.3f} s   max {times[-1]:6.3f} s   not 200: "
              f"{errors}")
    for label, refused in failed.items():
        print(f"{label:<10} the load's answers that were not 200: "
              f"{', '.join(f'{n} x {what}' for what, n in refused.most_common()) or 'none'}")
    if BASELINE in medians:
        print(f"this tree / baseline, the queries' p50: {medians[THIS] / medians[BASELINE]:.3f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--requests", type=int, default=40_000, help="a round's load, per target")
    parser.add_argument("--concurrency", type=int, default=16, help="keep-alive connections")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tenants", type=int, default=1,
                        help="tenants the load comes from (a rollup row each a flush)")
    parser.add_argument("--every", type=float, default=0.5, metavar="S",
                        help="seconds between usage queries")
    parser.add_argument("--baseline", type=Path, metavar="DIR",
                        help="another checkout whose gateway runs beside this one's, rotated")
    args = parser.parse_args()
    if min(args.requests, args.concurrency, args.rounds, args.tenants) < 1 or not args.every > 0:
        parser.error("--requests, --concurrency, --rounds and --tenants must be at least 1, "
                     "--every above 0")
    if args.baseline is not None and not (args.baseline / "fairgate" / "__main__.py").is_file():
        parser.error(f"--baseline {args.baseline}: not a fairgate checkout (no "
                     f"fairgate/__main__.py); make one with `git worktree add --detach DIR REV`")
    mock_port = free_port()
    mock_url = f"http://127.0.0.1:{mock_port}"
    mock = subprocess.Popen([PYTHON, str(ROOT / "bench" / "gateway_cpu.py"), "--mock",
                             str(mock_port)], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    gateways: list[subprocess.Popen[str]] = []
    try:
        wait_healthy(mock_url, mock)
        backend = {"url": mock_url, "kind": "openai", "max_inflight": 512, "max_model_len": 4096}
        with tempfile.TemporaryDirectory() as tmp:
            config = {"gateway": {"backends": [backend], "dispatch": "fair",
                                  "usage_spill_dir": tmp}}
            tenants = ({f"tenant-{i:04d}": {} for i in range(args.tenants)}
                       if args.tenants > 1 else None)  # else the demo tenant
            targets = {}
            for label, tree in ((THIS, ROOT), (BASELINE, args.baseline)):
                if tree is not None:
                    proc, url, keys = start_gateway(config, Path(tmp), tenants=tenants,
                                                    tree=tree.resolve())
                    gateways.append(proc)
                    targets[label] = (url, list(keys.values()))
            print(f"mock backend {mock_url}; gateway {targets[THIS][0]} (ledger on SQLite)"
                  + (f"; baseline {targets[BASELINE][0]} (from {args.baseline})"
                     if args.baseline else "") + f"; {machine()}")
            import uvloop

            uvloop.run(run(args, targets))
    finally:
        for proc in gateways:
            stop(proc)
        stop(mock)
    return 0


if __name__ == "__main__":
    sys.exit(main())
