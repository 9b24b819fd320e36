"""Fair share under overload: the gateway with `dispatch: fair` beside `dispatch: fcfs`.

The gateway runs an embedded engine on the simulated executor in real time (h100 preset,
llama-3-8b shapes; max_num_seqs 8 keeps capacity small enough to overload from one core).
Every request is 256 prompt tokens -> 64 output tokens, Poisson arrivals.

1. B alone at --rate-b: B's TTFT p99 when alone.
2. A at 10x B's rate (well over capacity) + B, weights 1:1 and then A:B = 1:3: B's TTFT p99
   (goal: <= 1.5x alone).
3. A and B both backlogged (each over capacity alone), weights 1:1 and 1:3: the ratio of output
   tokens served (goal: within 10% of the weights).
4. An interactive tenant alone, then beside a batch tenant's backlog (goal: TTFT p99 within
   1.5x).

    .venv/bin/python bench/fairness.py [--duration 12] [--rate-b 3]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.gateway_overhead import poisson, start_gateway, stop  # noqa: E402
from tuner.loadgen import RunOptions, Target, run_workload  # noqa: E402
from tuner.report import Report  # noqa: E402

ENGINE = {"executor": "sim", "sim_clock": "realtime", "sim_hardware": "h100",
          "sim_model": "llama-3-8b", "max_num_seqs": 8, "max_num_batched_tokens": 2048,
          "max_model_len": 4096}
PROMPT, OUTPUT = 256, 64


def tenants(weight_b: float) -> dict[str, dict[str, Any]]:
    return {"A": {"weight": 1.0}, "B": {"weight": weight_b}, "I": {},
            "X": {"default_priority": "batch", "allowed_priorities": ["batch"]}}


async def load(url: str, keys: dict[str, str], rates: dict[str, float], duration: float,
               timeout: float) -> Report:
    requests = []
    for i, (name, rate) in enumerate(rates.items()):
        requests += poisson(rate, duration, PROMPT, OUTPUT, seed=i, tenant=name,
                            api_key=keys[name])
    requests.sort(key=lambda r: r.arrival)
    return await run_workload(requests, Target(url, model="random:tiny"),
                              options=RunOptions(request_timeout=timeout))


def p99(report: Report, tenant: str) -> float:
    summary = report.tenants.get(tenant) or report.total
    return float(summary.ttft["p99_ms"] or float("nan"))


def served(report: Report, tenant: str) -> int:
    return report.tenants[tenant].output_tokens


async def scenarios(url: str, keys: dict[str, str], args: argparse.Namespace,
                    weight_b: float, full: bool) -> dict[str, float]:
    d, t, rb = args.duration, args.timeout, args.rate_b
    out: dict[str, float] = {}
    if full:
        out["B alone p99"] = p99(await load(url, keys, {"B": rb}, d, t), "B")
        out["I alone p99"] = p99(await load(url, keys, {"I": rb}, d, t), "I")
        both = await load(url, keys, {"I": rb, "X": 10 * rb}, d, t)
        out["I + batch X p99"] = p99(both, "I")
    mixed = await load(url, keys, {"A": 10 * rb, "B": rb}, d, t)
    out["B with A p99"] = p99(mixed, "B")
    out["A ok"] = mixed.tenants["A"].completed
    backlog = await load(url, keys, {"A": 10 * rb, "B": 10 * rb}, d, t)
    out["served B/A"] = served(backlog, "B") / max(1, served(backlog, "A"))
    return out


def run_policy(policy: str, weight_b: float, args: argparse.Namespace, tmp: Path,
               full: bool) -> dict[str, float]:
    config = {"engine": ENGINE, "gateway": {"dispatch": policy, "queue_timeout_s": args.timeout}}
    proc, url, keys = start_gateway(config, tmp, tenants(weight_b))
    try:
        return asyncio.run(scenarios(url, keys, args, weight_b, full))
    finally:
        stop(proc)


def report(weight_b: float, fair: dict[str, float], fcfs: dict[str, float],
           alone: dict[str, dict[str, float]]) -> None:
    print(f"\n== weights A:B = 1:{weight_b:g}; A sends {10}x B's rate ==")
    print(f"{'':<34}{'fair':>12}{'fcfs':>12}   goal")
    for label, pol in (("fair", fair), ("fcfs", fcfs)):
        pol["B ratio"] = pol["B with A p99"] / alone[label]["B alone p99"]
    rows = [("B TTFT p99 alone (ms)", lambda r, a: a["B alone p99"], ""),
            ("B TTFT p99 beside A (ms)", lambda r, a: r["B with A p99"], ""),
            ("  ratio to alone", lambda r, a: r["B ratio"], "<= 1.5"),
            ("backlogged service ratio B/A", lambda r, a: r["served B/A"],
             f"{weight_b:g} +/- 10%")]
    for label, get, goal in rows:
        print(f"{label:<34}{get(fair, alone['fair']):>12.2f}{get(fcfs, alone['fcfs']):>12.2f}"
              f"   {goal}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=float, default=12.0)
    parser.add_argument("--rate-b", type=float, default=3.0)
    parser.add_argument("--timeout", type=float, default=10.0,
                        help="gateway queue timeout and client timeout, seconds")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = {(p, w): run_policy(p, w, args, Path(tmp), w == 1.0)
                   for w in (1.0, 3.0) for p in ("fair", "fcfs")}
    alone = {p: results[(p, 1.0)] for p in ("fair", "fcfs")}
    for w in (1.0, 3.0):
        report(w, results[("fair", w)], results[("fcfs", w)], alone)
    print("\n== interactive tenant I beside batch tenant X's backlog (X at 10x I's rate) ==")
    print(f"{'':<34}{'fair':>12}{'fcfs':>12}   goal")
    for label, key in (("I TTFT p99 alone (ms)", "I alone p99"),
                       ("I TTFT p99 beside X (ms)", "I + batch X p99")):
        print(f"{label:<34}{alone['fair'][key]:>12.2f}{alone['fcfs'][key]:>12.2f}")
    ratios = [alone[p]["I + batch X p99"] / alone[p]["I alone p99"] for p in ("fair", "fcfs")]
    print(f"{'  ratio to alone':<34}{ratios[0]:>12.2f}{ratios[1]:>12.2f}   <= 1.5")
    return 0


if __name__ == "__main__":
    sys.exit(main())
