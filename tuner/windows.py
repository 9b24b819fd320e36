"""The windows of a study's workload: one the search trains on, others held out for choosing.

A trace is cut into windows of `window` trace-seconds from `start` (the train window first, the
held-out ones after it; past the trace's end, the windows before `start`). `rate` is the mean
arrival rate over the train window: its requests over its length, so `--rate 0.6` sends 0.6
req/s on average whatever the rest of the trace does. Held-out windows are replayed at the same
speed, so their load differs only as the trace does. Without `window`, the train window is the
stretch that holds `duration` x `rate` requests, or (neither given) `min_requests` of them.

A synthetic workload or tenant mix is drawn again with other seeds; without `duration`, each
draw lasts long enough for `min_requests`.

`min_requests` (1,000 for a p99: `protocol.stats.min_samples`) is what a p99 needs to rest on
ten requests beyond it; fewer is allowed, and the report says how many it rests on.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tuner.spec import Window
from tuner.traces import TraceRequest, load_trace

Plan = Callable[[argparse.Namespace], list[TraceRequest]]
DEFAULT_DURATION_S = 60.0


def study_windows(args: argparse.Namespace, holdout: int, min_requests: int,
                  plan: Plan, strict: bool = True) -> tuple[Window, tuple[Window, ...]]:
    """(the train window, `holdout` held-out windows) of the workload `args` describe
    (`fairgate bench`'s workload options plus `window`); ValueError when the trace cannot
    hold that many windows, unless not `strict` (a default count): then as many as it holds."""
    if args.trace:
        return _trace_windows(args, holdout, min_requests, plan, strict)
    return _seed_windows(args, holdout, min_requests, plan)


def _with(args: argparse.Namespace, **changes: Any) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(args), **changes})


def _seed_windows(args: argparse.Namespace, holdout: int, min_requests: int,
                  plan: Plan) -> tuple[Window, tuple[Window, ...]]:
    duration = args.duration
    if duration is None:
        duration = DEFAULT_DURATION_S
        drawn = len(plan(_with(args, duration=duration)))
        if 0 < drawn < min_requests:  # long enough for a p99 to rest on its tail
            duration *= math.ceil(min_requests / drawn * 1.02)
    train = Window(f"seed {args.seed}", tuple(plan(_with(args, duration=duration))))
    held = tuple(Window(f"seed {seed}", tuple(plan(_with(args, duration=duration, seed=seed))))
                 for seed in range(args.seed + 1, args.seed + 1 + holdout))
    return train, held


def _trace_windows(args: argparse.Namespace, holdout: int, min_requests: int,
                   plan: Plan, strict: bool) -> tuple[Window, tuple[Window, ...]]:
    arrivals = [r.arrival for r in load_trace(Path(args.trace), args.trace_format)]
    start = args.start or 0.0
    length = args.window if args.window is not None else _window_for(args, arrivals, start,
                                                                     min_requests)
    train_requests = plan(_with(args, start=start, window=length, duration=None))
    count = sum(start <= a < start + length for a in arrivals)
    # the held-out windows replay at the train window's speed: --rate sets that one's mean
    speed = args.rate / (count / length) if args.rate is not None else (args.speed or 1.0)
    train = Window(_label(start, length), tuple(train_requests))
    starts = _held_out_starts(arrivals, start, length, holdout, strict)
    held = tuple(Window(_label(s, length), tuple(plan(_with(
        args, start=s, window=length, duration=None, rate=None, speed=speed))))
        for s in starts)
    return train, held


def _window_for(args: argparse.Namespace, arrivals: list[float], start: float,
                min_requests: int) -> float:
    """Trace-seconds from `start` that hold the requests the options ask for."""
    after = [a for a in arrivals if a >= start]
    if not after:
        raise ValueError(f"--start {start:g}: the trace ends at {arrivals[-1]:.1f} s")
    if args.duration is not None and args.rate is None:
        return float(args.duration * (args.speed or 1.0))
    wanted = (math.ceil(args.rate * args.duration) if args.duration is not None
              else min_requests)
    last = after[min(wanted, len(after)) - 1]
    return max(last - start, 1e-6) * (1 + 1e-9) + 1e-9  # the last one inside the window


def _held_out_starts(arrivals: list[float], start: float, length: float,
                     count: int, strict: bool) -> list[float]:
    """Starts of `count` whole windows the train window does not overlap: after it, then
    before it."""
    # the trace lasts one mean gap past its last arrival
    end = arrivals[-1] + (arrivals[-1] - arrivals[0]) / max(1, len(arrivals) - 1) \
        if arrivals else 0.0
    after = [start + k * length for k in range(1, count + 1) if start + (k + 1) * length <= end]
    before = [start - k * length for k in range(1, count + 1) if start - k * length >= 0]
    starts = (after + before)[:count]
    if len(starts) < count and strict:
        raise ValueError(f"the trace ({end:.0f} s) holds {len(starts)} held-out windows of "
                         f"{length:.1f} s beside the one from {start:g} s, not {count}: lower "
                         "--holdout or --window, or move --start")
    return starts


def _label(start: float, length: float) -> str:
    return f"trace {start:.0f}-{start + length:.0f} s"
