"""What the benchmarks that run fairgate as processes share: the repository's root, a free port,
`fairgate engine` and `fairgate serve` started and stopped, the open-loop (Poisson) and
closed-loop (burst) loads with their command-line options, and the machine's banner.

A benchmark is a script (`.venv/bin/python bench/NAME.py`): it puts the repository on sys.path
itself, then imports this module.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from tuner.loadgen import RunOptions, Target, run_workload
from tuner.report import Report
from tuner.traces import TraceRequest

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable


def machine() -> str:
    """The load average and the CPU count: what a figure measured here depends on."""
    return f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"


def verdict(met: bool) -> str:
    return "PASS" if met else "FAIL"


# ---- processes ------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_healthy(url: str, proc: subprocess.Popen[Any], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: process exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/readyz", timeout=1) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"{url} did not become ready")


def start_engine(port: int, knobs: dict[str, Any]) -> subprocess.Popen[Any]:
    sets = [a for k, v in knobs.items() for a in ("--set", f"{k}={v}")]
    proc = subprocess.Popen([PYTHON, "-m", "fairgate", "engine", "--port", str(port),
                             "--log-level", "warning", *sets], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_healthy(f"http://127.0.0.1:{port}", proc)
    return proc


def start_gateway(config: dict[str, Any], workdir: Path,
                  tenants: dict[str, dict[str, Any]] | None = None, database: str | None = None,
                  tree: Path = ROOT) -> tuple[subprocess.Popen[Any], str, dict[str, str]]:
    """`fairgate serve` with `config` (a fairgate.yaml mapping); returns (process, url, keys).
    Tenants are created in its database (default: a new SQLite file in `workdir`) first;
    without any, the demo tenant's key is used. `tree`: the checkout whose fairgate runs (another
    revision's, for a baseline in the same run)."""
    port = free_port()
    db = database or f"sqlite:///{workdir / f'gateway-{port}.db'}"
    keys = asyncio.run(_create_tenants(db, tenants)) if tenants else {}
    config = {**config, "database": db}
    config["gateway"] = {**config.get("gateway", {}), "port": port, "demo_tenant": not tenants,
                         "metrics_port": 0}
    path = workdir / f"fairgate-{port}.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    proc = subprocess.Popen([PYTHON, "-m", "fairgate", "serve", "-c", str(path),
                             "--log-level", "WARNING"], cwd=tree, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True,
                            env=None if tree == ROOT else {**os.environ, "PYTHONPATH": str(tree)})
    assert proc.stdout is not None
    if not tenants:
        while not (line := proc.stdout.readline()).strip().startswith("fg-"):
            if not line:
                raise RuntimeError("fairgate serve exited before printing the demo key")
        keys["demo"] = line.strip()
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc)
    return proc, url, keys


async def _create_tenants(db: str, tenants: dict[str, dict[str, Any]]) -> dict[str, str]:
    from tenants import TenantLimits, TenantStore

    store = TenantStore(db)
    await store.init()
    keys = {}
    for name, spec in tenants.items():
        spec = dict(spec)
        await store.create_tenant(name, limits=TenantLimits(**spec.pop("limits", {})), **spec)
        keys[name] = (await store.create_key(name))[1]
    await store.close()
    return keys


def stop(proc: subprocess.Popen[Any]) -> None:
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()


# ---- load -----------------------------------------------------------------------------------
def add_load_options(parser: argparse.ArgumentParser, *, rate: float, duration: float,
                     rounds: int, rounds_help: str | None = None, burst: bool = True) -> None:
    """The load's options: open loop (--rate for --duration s), --rounds of it, the tokens of
    each request; with `burst`, the closed loop's --requests at --concurrency too."""
    parser.add_argument("--rate", type=float, default=rate)
    parser.add_argument("--duration", type=float, default=duration)
    if burst:
        parser.add_argument("--requests", type=int, default=6000)
        parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=rounds, help=rounds_help)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=8)


def poisson(rate: float, duration: float, prompt: int, output: int, seed: int = 0,
            **fields: Any) -> list[TraceRequest]:
    rng, t = random.Random(seed), 0.0
    out: list[TraceRequest] = []
    while True:
        t += rng.expovariate(rate)
        if t >= duration:
            return out
        out.append(TraceRequest(arrival=t, prompt_tokens=prompt, output_tokens=output, **fields))


def open_loop(args: argparse.Namespace) -> list[TraceRequest]:
    """Poisson arrivals at --rate for --duration s (add_load_options)."""
    return poisson(args.rate, args.duration, args.prompt_tokens, args.output_tokens)


def closed_loop(args: argparse.Namespace) -> list[TraceRequest]:
    """--requests requests all arriving at once: the concurrency cap is the only brake."""
    return [TraceRequest(arrival=0.0, prompt_tokens=args.prompt_tokens,
                         output_tokens=args.output_tokens) for _ in range(args.requests)]


async def measure(url: str, key: str | None, requests: list[TraceRequest], model: str,
                  **options: Any) -> Report:
    return await run_workload(requests, Target(url, api_key=key, model=model),
                              options=RunOptions(**options))


def rotated(labels: list[str], round_: int) -> list[str]:
    """Each round starts with a different target, so drift of the machine between the first and
    the last measurement of a round does not always land on the same one."""
    k = round_ % len(labels)
    return labels[k:] + labels[:k]
