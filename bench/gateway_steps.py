"""Where the gateway's own work per request goes: a request's steps through the real gateway,
in-process, each timed.

    .venv/bin/python bench/gateway_steps.py [--requests 5000] [--rounds 4] [--baseline DIR]

The gateway is built as `fairgate serve` builds it (`control.app.make_app`: a `kind: openai`
backend on `bench/gateway_cpu.py`'s mock, the usage ledger on SQLite, metrics, fair share, the
control plane's request observers) and started without a listening socket. Each request then
goes through the steps an HTTP request takes, without the HTTP: the key's check (`auth`), the
body read and validated (`parse`: `parse_json_body`, `parse_request`), admission (`admit`: the
estimate, the rate charge, the fair queue and the dispatch), `wait` for the backend, its
answer noted (`outcome`: a 16-token stream's token times, or a whole answer's counts) and
`settle` (the charges settled, the metrics, the usage row, the request events). Nothing goes
to the backend: the steps are the gateway's own, which `bench/gateway_cpu.py` can only show
as a whole (the gateway's CPU over the floor's). Each step's figure is the mean of its fastest
95% over the requests after the first fifth (a collection or a flush of the ledger lands in
the slowest few).

`--baseline DIR` runs the same steps from another checkout (`git worktree add --detach DIR
REV`), each round both trees one after the other in a rotated order, and prints this tree's
figures over the baseline's: per step, the median of the rounds' own ratios. On this project's
shared VM a run's figures move 20-50% from run to run, and a whole run can lean 5-8% towards
one tree, every step alike: read a changed step's ratio against those of the steps the change
did not touch in the same run (auth and parse, most often), not against 1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

WORKER = "--worker" in sys.argv
# A worker imports the gateway of the tree it measures (`TREE`); the driver, this repository.
sys.path.insert(0, os.environ["TREE"] if WORKER else str(Path(__file__).resolve().parent.parent))

STEPS = ("auth", "parse", "admit", "wait", "outcome", "settle")
MODES = ("streaming", "non-streaming")


# ---- the worker: one tree's gateway, in this process ------------------------------------------
async def measure(job: dict[str, Any], workdir: str) -> dict[str, dict[str, float]]:
    """Per mode: each step's µs per request. `job` (the driver's, on stdin): the mock's URL,
    the requests per mode, the modes in the order to measure them, each mode's request body
    (`bench/gateway_cpu.py`'s) and the answer's tokens."""
    from aiohttp import web
    from aiohttp.test_utils import make_mocked_request

    from control.app import make_app
    from fairgate.config import FairgateConfig
    from gateway.state import AUTH, GATEWAY

    config_path = Path(workdir, "fairgate.yaml")
    config_path.write_text(json.dumps({  # JSON is YAML
        "database": f"sqlite:///{workdir}/gateway.db",
        "gateway": {"demo_tenant": True, "dispatch": "fair", "usage_spill_dir": workdir,
                    "backends": [{"url": job["mock_url"], "kind": "openai", "max_inflight": 512,
                                  "max_model_len": 4096}]}}))
    config = FairgateConfig.load(config_path, os.environ)
    keys: list[str] = []
    app = make_app(config.gateway, engine=config.engine, database=config.database,
                   on_demo_key=keys.append)
    runner = web.AppRunner(app)
    await runner.setup()
    try:
        gw, auth = app[GATEWAY], app[AUTH]
        deadline = time.monotonic() + 30.0
        while not gw.pool.healthy:  # its first look at the backend
            if time.monotonic() > deadline:
                raise SystemExit(f"the gateway did not see its backend {job['mock_url']} "
                                 "healthy in 30 s")
            await asyncio.sleep(0.05)
        http = make_mocked_request("POST", "/v1/chat/completions", app=app,
                                   headers={"Authorization": f"Bearer {keys[0]}"})
        return {mode: await _steps(gw, auth, http, job["bodies"][mode].encode(),
                                   mode == "streaming", job["tokens"], job["requests"])
                for mode in job["modes"]}
    finally:
        await runner.cleanup()


async def _steps(gw: Any, auth: Any, http: Any, body: bytes, stream: bool, tokens: int,
                 requests: int) -> dict[str, float]:
    """`tokens`: the answer's; a stream's each in an event of its own."""
    from protocol.openai import parse_json_body, parse_request

    clock = time.perf_counter
    times: dict[str, list[float]] = {step: [] for step in STEPS}
    for i in range(requests):
        t0 = clock()
        principal = await auth.tenant(http)
        t1 = clock()
        req = parse_request(parse_json_body(body), "chat")
        req.token_ids = None  # as the proxy does: the engine extension is the gateway's to send
        t2 = clock()
        adm, future = await gw.admit(principal, req)
        t3 = clock()
        await adm.wait(future, 30.0)
        t4 = clock()
        out = adm.outcome
        if stream:
            out.chunk_times.extend([clock()] * tokens)
            adm.streamed()
        out.completion_tokens, out.usage_reported, out.finish_reason = tokens, True, "length"
        t5 = clock()
        adm.settle(200)
        t6 = clock()
        for step, start, end in zip(STEPS, (t0, t1, t2, t3, t4, t5), (t1, t2, t3, t4, t5, t6),
                                    strict=True):
            times[step].append((end - start) * 1e6)
        if i % 256 == 0:
            await asyncio.sleep(0)  # the ledger's flush and the gateway's timers get their turn
    warm = requests // 5
    return {step: statistics.fmean(sorted(values[warm:])[:int(0.95 * (requests - warm))])
            for step, values in times.items()}


def worker() -> None:
    import uvloop

    job = json.loads(sys.stdin.read())
    with tempfile.TemporaryDirectory() as workdir:
        print(json.dumps(uvloop.run(measure(job, workdir))))


# ---- the driver -------------------------------------------------------------------------------
def run_worker(tree: Path, job: dict[str, Any]) -> dict[str, dict[str, float]]:
    """One tree's steps in a process of their own. Both trees' processes get the same hash
    seed: the seed lays out every dict and set, and moved an A/A comparison by 10%."""
    from bench.common import PYTHON

    done = subprocess.run([PYTHON, __file__, "--worker"], cwd=tree, input=json.dumps(job),
                          env={**os.environ, "TREE": str(tree), "PYTHONHASHSEED": "0"},
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"the steps from {tree} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def show(label: str, figures: dict[str, float]) -> str:
    steps = "  ".join(f"{step} {figures[step]:6.2f}" for step in STEPS)
    return f"{label:10s} {steps}  total {sum(figures.values()):6.1f} µs"


def main() -> int:
    from bench.common import PYTHON, ROOT, free_port, machine, rotated, stop, wait_healthy
    from bench.gateway_cpu import CHUNKS, request_body

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=5000, help="per round, tree and mode")
    parser.add_argument("--rounds", type=int, default=4, help="each tree this many times")
    parser.add_argument("--baseline", type=Path, help="another checkout, measured beside this one")
    args = parser.parse_args()
    if args.requests < 100 or args.rounds < 1:
        parser.error("--requests must be >= 100 and --rounds >= 1")
    if args.baseline is not None and not (args.baseline / "control" / "app.py").is_file():
        parser.error(f"--baseline {args.baseline}: not a fairgate checkout with a control plane "
                     f"(no control/app.py); make one with `git worktree add --detach DIR REV`")
    trees = {"this tree": ROOT}
    if args.baseline is not None:
        trees["baseline"] = args.baseline.resolve()
    port = free_port()
    mock_url = f"http://127.0.0.1:{port}"
    mock = subprocess.Popen([PYTHON, str(ROOT / "bench" / "gateway_cpu.py"), "--mock", str(port)],
                            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        wait_healthy(mock_url, mock)
        print(f"{args.requests} requests a round, tree and mode, {args.rounds} rounds; "
              f"µs per request, each step; {machine()}")
        rounds: list[dict[str, dict[str, dict[str, float]]]] = []
        for r in range(args.rounds):
            job = {"mock_url": mock_url, "requests": args.requests, "tokens": CHUNKS,
                   # the mode measured first (the process's first requests) alternates too
                   "modes": MODES if r % 2 == 0 else MODES[::-1],
                   "bodies": {mode: request_body(mode == "streaming").decode()
                              for mode in MODES}}
            measured = {label: run_worker(trees[label], job)
                        for label in rotated(list(trees), r)}
            rounds.append(measured)
            for label in trees:
                print(f"round {r + 1} {label}: " + ", ".join(
                    f"{mode} {sum(f.values()):.1f}" for mode, f in measured[label].items()))
        for mode in MODES:
            print(f"\n== {mode}: the median of the rounds ==")
            for label in trees:
                print(show(label, {step: statistics.median(r[label][mode][step] for r in rounds)
                                   for step in STEPS}))
            if args.baseline is not None:
                ratios = {step: statistics.median(r["this tree"][mode][step]
                                                  / r["baseline"][mode][step] for r in rounds)
                          for step in STEPS}
                total = statistics.median(sum(r["this tree"][mode].values())
                                          / sum(r["baseline"][mode].values()) for r in rounds)
                print("this / baseline " + "  ".join(f"{s} {v:.3f}" for s, v in ratios.items())
                      + f"  total {total:.3f} (the median of the rounds' own ratios)")
        return 0
    finally:
        stop(mock)


if __name__ == "__main__":
    if WORKER:
        worker()
        sys.exit(0)
    sys.exit(main())
