"""Is the load generator fast enough not to be the bottleneck it measures?

Starts `python -m tuner.fake_server` (answers instantly) in its own process, then drives it from
this process with `tuner.loadgen.run_workload` as fast as the concurrency cap allows and prints
the sustained request and streamed-token rates against the targets (1,000 req/s, 20,000 tok/s).

    .venv/bin/python bench/loadgen.py [--requests 6000] [--concurrency 16] [--output-tokens 20]
    .venv/bin/python bench/loadgen.py --itl 0.005 --concurrency 128 --output-tokens 100
        (token by token: one network read per token, the per-token path)
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository

from bench.common import ROOT, machine  # noqa: E402
from tuner.loadgen import RunOptions, Target, run_workload  # noqa: E402
from tuner.traces import TraceRequest  # noqa: E402

TARGET_REQ_S = 1_000.0
TARGET_TOK_S = 20_000.0


def start_server(itl: float) -> tuple[subprocess.Popen[str], str]:
    cmd = [sys.executable, "-m", "tuner.fake_server", "--port", "0", "--no-record"]
    cmd += ["--itl", str(itl)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()  # "fake server listening on http://127.0.0.1:PORT"
    if "listening on" not in line:
        proc.kill()
        raise SystemExit(f"the fake server did not start: {line!r}")
    return proc, line.rsplit(" ", 1)[-1].strip()


@dataclass
class Figures:
    req_s: float
    tok_s: float
    cpu_us_per_req: float  # this process's CPU time per request (the load generator's cost)


async def measure(url: str, n: int, concurrency: int, output_tokens: int) -> Figures:
    # Everything arrives at t=0: the concurrency cap is the only brake, as in a closed loop.
    requests = [TraceRequest(0.0, 16, output_tokens) for _ in range(n)]
    options = RunOptions(max_concurrency=concurrency, salt=0)
    target = Target(url, model="fake-model")
    await run_workload(requests[: min(300, n)], target, options=options)  # warm connections
    cpu = time.process_time()
    report = await run_workload(requests, target, options=options)
    cpu = time.process_time() - cpu
    if report.failed:
        raise SystemExit(f"{report.failed} requests failed: {report.errors}")
    t = report.total
    return Figures(t.request_throughput, t.output_throughput, cpu / n * 1e6)


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--requests", type=int, default=6000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--output-tokens", type=int, default=20)
    parser.add_argument(
        "--itl", type=float, default=0.0, help="server gap between tokens (0: all at once)"
    )
    args = parser.parse_args()
    proc, url = start_server(args.itl)
    try:
        fig = asyncio.run(measure(url, args.requests, args.concurrency, args.output_tokens))
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    # On a shared machine the wall-clock rates depend on who else runs; the CPU cost per
    # request does not, and bounds what one free core sustains.
    per_core = 1e6 / fig.cpu_us_per_req
    print(
        f"loadgen vs fake server ({args.requests} requests, concurrency "
        f"{args.concurrency}, {args.output_tokens} tokens each, server ITL {args.itl:g} s, "
        "separate processes, "
        f"{machine()})"
    )
    _row("requests/s", fig.req_s, TARGET_REQ_S)
    _row("streamed tokens/s", fig.tok_s, TARGET_TOK_S)
    print(f"  loadgen CPU per request: {fig.cpu_us_per_req:.0f} us")
    _row("requests/s per free core", per_core, TARGET_REQ_S)
    _row("tokens/s per free core", per_core * args.output_tokens, TARGET_TOK_S)
    ok = fig.req_s >= TARGET_REQ_S and fig.tok_s >= TARGET_TOK_S
    print("  PASS" if ok else "  BELOW TARGET (wall clock)")
    return 0


def _row(name: str, value: float, target: float) -> None:
    print(f"  {name + ':':<26}{value:10.0f}   target {target:7.0f}   ratio {value / target:.2f}x")


if __name__ == "__main__":
    sys.exit(main())
