"""How long does a full garbage collection stall a busy gateway, with the requests it keeps?

A gateway keeps records of recent requests for minutes: its canary window (the last 200,000
requests served: control/canary.py's ServedWindow), each tenant's rate window (a minute of
charges: gateway/admission.py's RateWindow) and each shadow target's completed pairs (50,000:
control/shadow.py). A full collection walks every object the collector tracks, and the event
loop stands still while it does: every request in flight waits.

This fills those three with a busy gateway's records through the real classes (`--rate`
requests/s: the canary window full, a minute of charges, the shadow's pairs full), with the
heap as a server has it (what was there before frozen: engine/server.py), and times
`gc.collect()`. The baseline, in the same process: the same records kept as the objects they
were kept as before issue 28 (Served with its RequestTiming and list of token times, Charge,
Pair), built from the same classes. (What keeping them costs per request is in the gateway's
CPU per request: bench/gateway_cpu.py.)

    .venv/bin/python bench/gc_pause.py [--rate 5000] [--tokens 16] [--repeats 5]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository

from bench.common import machine  # noqa: E402
from control.canary import MAX_SERVED, Served, ServedWindow  # noqa: E402
from control.shadow import MAX_PAIRS, Pair, ShadowMirror  # noqa: E402
from control.shadow_metrics import ShadowMetrics  # noqa: E402
from engine.request import SamplingParams  # noqa: E402
from gateway.admission import PERIOD_S, Charge, RateLimiter  # noqa: E402
from gateway.backends import Job  # noqa: E402
from gateway.config import ShadowConfig  # noqa: E402
from protocol.measures import SLO, RequestTiming  # noqa: E402
from protocol.openai import parse_request  # noqa: E402
from tenants import TenantLimits  # noqa: E402

TENANTS = 8


def timing(i: int, tokens: int) -> RequestTiming:
    start = i * 1e-4
    times = [start + 0.05 + k * 0.01 for k in range(tokens)]  # a fresh list, as the gateway's
    return RequestTiming(start, times, tokens, times[-1] + 0.001)


def keep_as_now(args: argparse.Namespace) -> list[Any]:
    """The records, kept by the gateway's classes as they are now."""
    slos = [SLO(ttft_s=0.5, tpot_s=0.05) for _ in range(TENANTS)]
    window = ServedWindow()
    for i in range(MAX_SERVED):
        window.record(f"replica-{i % 4}", f"t{i % TENANTS}", slos[i % TENANTS],
                      timing(i, args.tokens))
    clock = [0.0]
    limiter = RateLimiter(clock=lambda: clock[0])
    limits = TenantLimits()
    for i in range(int(args.rate * PERIOD_S) - 1):
        clock[0] = i / args.rate
        charge = limiter.admit(f"t{i % TENANTS}", limits, 400)
        limiter.settle(charge, 300)
    mirror = ShadowMirror(ShadowConfig("s", "http://127.0.0.1:9", max_queue=MAX_PAIRS),
                          ShadowMetrics(CollectorRegistry()), lambda message: None)
    req = parse_request({"messages": [{"role": "user", "content": "hi"}]}, "chat")
    for i in range(MAX_PAIRS):
        rid = f"r{i}"
        mirror.offer(Job(rid, req, f"t{i % TENANTS}", "batch", 10, SamplingParams(max_tokens=16)),
                     slos[i % TENANTS])
        mirror.live_done(rid, timing(i, args.tokens))
        live = timing(i, args.tokens)
        mirror.done(rid, 0.001, 0.0, live.start, list(live.token_times), args.tokens, live.end,
                    True)
    return [window, limiter, mirror]


def keep_as_objects(args: argparse.Namespace) -> list[Any]:
    """The same records as the objects the gateway kept before (the baseline)."""
    served: deque[Served] = deque(maxlen=MAX_SERVED)
    for i in range(MAX_SERVED):
        served.append(Served(i * 1e-4, f"replica-{i % 4}", f"t{i % TENANTS}",
                             SLO(ttft_s=0.5, tpot_s=0.05), timing(i, args.tokens)))
    charges: dict[str, deque[Charge]] = {}
    for i in range(int(args.rate * PERIOD_S) - 1):
        charge = Charge(at=i / args.rate, tokens=400)
        charges.setdefault(f"t{i % TENANTS}", deque()).append(charge)
        charge.tokens = 300
    pairs: deque[Pair] = deque(maxlen=MAX_PAIRS)
    for i in range(MAX_PAIRS):
        pairs.append(Pair(f"t{i % TENANTS}", SLO(ttft_s=0.5, tpot_s=0.05), timing(i, args.tokens),
                          timing(i, args.tokens), 0.001, 0.0, 1.0))
    return [served, charges, pairs]


def measure(keep: Callable[[argparse.Namespace], list[Any]],
            args: argparse.Namespace) -> tuple[float, int]:
    """(median ms of a full collection, objects the collector tracks beyond the frozen
    heap)."""
    kept = keep(args)
    gc.collect()
    pauses = []
    for _ in range(args.repeats):
        t = time.perf_counter()
        gc.collect()
        pauses.append((time.perf_counter() - t) * 1e3)
    tracked = len(gc.get_objects())
    del kept
    gc.collect()
    return statistics.median(pauses), tracked


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rate", type=float, default=5000.0,
                        help="requests/s: a minute of them is in the rate windows")
    parser.add_argument("--tokens", type=int, default=16, help="tokens per request")
    parser.add_argument("--repeats", type=int, default=5, help="collections timed, median")
    args = parser.parse_args()
    if args.rate <= 0 or args.tokens < 1 or args.repeats < 1:
        parser.error("--rate must be > 0, --tokens and --repeats at least 1")
    gc.collect()
    gc.freeze()  # the startup heap, as a server freezes it
    gc.disable()  # only the timed collections run
    print(f"{machine()}; canary window {MAX_SERVED:,} requests, rate windows "
          f"{args.rate * PERIOD_S:,.0f} charges ({args.rate:g}/s for {PERIOD_S:g} s), "
          f"shadow {MAX_PAIRS:,} pairs; {args.tokens} tokens a request")
    empty, base_tracked = measure(lambda a: [], args)
    print(f"nothing kept:          full collection {empty:7.2f} ms   ({base_tracked:,} objects "
          "tracked beyond the frozen heap)")
    results = {}
    for name, keep in (("kept as objects", keep_as_objects), ("kept as now", keep_as_now)):
        pause, tracked = measure(keep, args)
        results[name] = pause
        print(f"{name + ':':22s} full collection {pause:7.2f} ms   "
              f"({tracked - base_tracked:,} more objects tracked)")
    print(f"full-collection pause, as now / as objects: "
          f"{results['kept as now'] / results['kept as objects']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
