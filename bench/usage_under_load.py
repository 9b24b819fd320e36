"""How long does a tenant's usage query take while the gateway is saturated?

`GET /v1/usage` first waits for the usage ledger's flush (so it counts every request the
tenant made before asking), under the admin API's 5 s database timeout: past it, a 503. The
flush writes from SQLite's own thread (aiosqlite), which must take the GIL back from the event
loop's thread after every statement step; a saturated loop gives it up only for moments, so a
flush of one-row statements (an executemany: a step per row) waits on the GIL thousands of
times. `tenants.ledger.RowInsert` writes SQLite's rows in multi-row blocks instead (a step per
block of up to 256 rows).

This starts `bench/gateway_cpu.py`'s mock backend and `fairgate serve` in front of it (the
ledger on SQLite), saturates the gateway with the same closed-loop load (16 keep-alive
connections of chat requests), and asks `/v1/usage` every `--every` seconds while it lasts.
`--baseline DIR` runs another checkout's gateway in the same rounds, rotated.

    .venv/bin/python bench/usage_under_load.py [--requests 40000] [--rounds 2] [--baseline DIR]
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
from bench.gateway_cpu import drive  # noqa: E402
from protocol.stats import percentile_of_sorted  # noqa: E402

THIS, BASELINE = "this tree", "baseline"


async def queries(url: str, key: str, load: asyncio.Future[float],
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


async def one_round(url: str, key: str, args: argparse.Namespace) -> list[tuple[int, float]]:
    load = asyncio.ensure_future(drive(url, key, False, args.requests, args.concurrency))
    try:
        return await queries(url, key, load, args.every)
    finally:
        await load  # every answer a 200, or the round fails


async def run(args: argparse.Namespace, targets: dict[str, tuple[str, str]]) -> None:
    found: dict[str, list[tuple[int, float]]] = {label: [] for label in targets}
    for round_ in range(args.rounds):
        for label in rotated(list(targets), round_):
            url, key = targets[label]
            found[label] += await one_round(url, key, args)
    print(f"\n{args.requests} non-streamed chat requests a round, {args.concurrency} "
          f"connections, {args.rounds} rounds; a usage query every {args.every:g} s")
    medians = {}
    for label, answers in found.items():
        times = sorted(seconds for _, seconds in answers)
        failed = sum(status != 200 for status, _ in answers)
        if not times:
            raise SystemExit(f"{label}: no query made; raise --requests")
        medians[label] = percentile_of_sorted(times, 50)
        print(f"{label:<10} {len(times):3d} queries   p50 {medians[label]:6.3f} s   p90 "
              f"{percentile_of_sorted(times, 90):6.3f} s   max {times[-1]:6.3f} s   not 200: "
              f"{failed}")
    if BASELINE in medians:
        print(f"this tree / baseline, the queries' p50: {medians[THIS] / medians[BASELINE]:.3f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--requests", type=int, default=40_000, help="a round's load, per target")
    parser.add_argument("--concurrency", type=int, default=16, help="keep-alive connections")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--every", type=float, default=0.5, metavar="S",
                        help="seconds between usage queries")
    parser.add_argument("--baseline", type=Path, metavar="DIR",
                        help="another checkout whose gateway runs beside this one's, rotated")
    args = parser.parse_args()
    if args.requests < 1 or args.concurrency < 1 or args.rounds < 1 or not args.every > 0:
        parser.error("--requests, --concurrency and --rounds must be at least 1, --every above 0")
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
            targets = {}
            for label, tree in ((THIS, ROOT), (BASELINE, args.baseline)):
                if tree is not None:
                    proc, url, keys = start_gateway(config, Path(tmp), tree=tree.resolve())
                    gateways.append(proc)
                    targets[label] = (url, keys["demo"])
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
