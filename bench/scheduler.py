"""Scheduler cost per step: schedule() + update() with many running and waiting requests.

    python bench/scheduler.py [--steps 300] [--repeats 3] [--baseline REV | --baseline none]
                              [--equal-prompts]

Sim executor, prefix caching on, every running request decoding; the garbage collector set as
`fairgate engine` sets it (`engine.heap.size_young_generation`) where the tree has it. Prompts
of 128-143 tokens, so that each step some of the requests fill a block and commit it to the
prefix cache, as in serving (`--equal-prompts`: all 128, as before 2026-12-05). Prints the
median, mean and p99 per step at 256 running / 1,024 waiting and at 1,024 running / 1,024
waiting, microseconds per running request, and the 1,024/256 cost ratio (4.0 = linear), for
this tree and for a baseline: the engine at REV (default: the commit before issue 28's
scheduler work), unpacked with `git archive` into a temporary folder. Each measurement runs in
its own subprocess, the two trees interleaved, so both see the same machine; each size reports
the best median of its runs (the machine is shared). Goals (issue 28): median <= 0.5 ms at 256
running, ratio 1,024/256 <= 4.4."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BASELINE = "c1c5226"  # the engine before issue 28's scheduler work
SIZES = (256, 1024)
WAITING = 1024
GOAL_MEDIAN_S = 0.5e-3  # at 256 running
GOAL_RATIO = 4.4  # 1,024 running / 256 running; 4.0 is linear
BLOCK_PHASES = 16  # the engine's default block_size: prompt lengths spread over one block


def measure(running: int, waiting: int, steps: int, equal_prompts: bool = False) -> list[float]:
    """Seconds of schedule() + update() per step; the executor's part is not timed.
    `equal_prompts`: every prompt 128 tokens, as this bench had them before 2026-12-05."""
    from engine import EngineConfig, LLMEngine, SamplingParams

    config = EngineConfig(
        executor="sim",
        sim_model="llama-3-8b",
        sim_hardware="h100",
        max_num_seqs=running,
        max_num_batched_tokens=max(8192, running),
        max_model_len=8192,
        enable_prefix_caching=True,
    )
    engine = LLMEngine(config)
    try:  # the collector as `fairgate engine` sets it, in trees that set it
        from engine.heap import size_young_generation
    except ImportError:
        pass
    else:
        size_young_generation(config.max_num_seqs)
    for i in range(running + waiting):
        # shared 64-token prefixes; 128-143 tokens, so that a sixteenth of the requests fill a
        # block (a prefix-cache commit) in each step, as requests arriving at their own times
        # do. With equal lengths the warm-up's admission waves lined them up: at 256 running
        # every 16th step made all the commits and the median step none of them.
        spread = 0 if equal_prompts else i % BLOCK_PHASES
        prompt = [1 + (i % 7)] * 64 + [100 + (i % 500)] * 64 + [7] * spread
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=4000, ignore_eos=True))
    while len(engine.scheduler.running) < running or any(
        r.is_prefill for r in engine.scheduler.running.values()
    ):
        engine.step()
    scheduler, executor = engine.scheduler, engine.executor
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        plan = scheduler.schedule()
        scheduled = time.perf_counter()
        sampled = executor.execute(plan).sampled  # the model's part: not timed
        resumed = time.perf_counter()
        scheduler.update(plan, sampled)
        times.append(scheduled - started + time.perf_counter() - resumed)
        assert len(plan.requests) == running
    return times


def run_worker(root: Path, running: int, steps: int, equal_prompts: bool) -> list[float]:
    """measure() in a fresh interpreter that imports the engine from `root`."""
    code = (f"import json, sys; sys.path[:0] = [{str(root)!r}, {str(ROOT / 'bench')!r}]; "
            f"import scheduler; print(json.dumps(scheduler.measure("
            f"{running}, {WAITING}, {steps}, {equal_prompts})))")
    out = subprocess.run([sys.executable, "-c", code], cwd=root, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.splitlines()[-1])


def unpack(rev: str, into: Path) -> Path:
    """The engine and what it imports, as they were at `rev`."""
    archive = subprocess.run(["git", "archive", rev, "engine", "protocol", "kernels"], cwd=ROOT,
                             check=True, capture_output=True).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into


def summary(runs: list[list[float]]) -> tuple[float, float, float, str]:
    """The best run's median, mean and p99, and every run's median in ms."""
    from protocol.stats import percentile_of_sorted

    best = sorted(min(runs, key=statistics.median))
    medians = ", ".join(f"{statistics.median(t) * 1e3:.3f}" for t in runs)
    return statistics.median(best), statistics.fmean(best), percentile_of_sorted(best, 99), medians


def report(name: str, runs: dict[int, list[list[float]]]) -> dict[int, float]:
    medians = {}
    for running in SIZES:
        median, mean, p99, all_medians = summary(runs[running])
        medians[running] = median
        print(f"{name:9s} running={running:5d} waiting={WAITING}  median {median * 1e3:.3f} ms  "
              f"mean {mean * 1e3:.3f} ms  p99 {p99 * 1e3:.3f} ms  "
              f"{median / running * 1e6:.2f} us/running request  "
              f"(medians of {len(runs[running])} runs: {all_medians} ms)")
    print(f"{name:9s} ratio 1024/256 running: {medians[1024] / medians[256]:.2f} (4.00 = linear)")
    return medians


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs per size and tree; the best median is reported")
    parser.add_argument("--equal-prompts", action="store_true",
                        help="every prompt 128 tokens (the bench before 2026-12-05): at 256 running "
                             "the prefix-cache commits fall in every 16th step, out of the median")
    parser.add_argument("--baseline", default=BASELINE,
                        help="git revision to compare with, or 'none' (default: %(default)s)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="fairgate-sched-base-") as folder:
        trees = {"current": ROOT}
        if args.baseline != "none":
            trees[f"@{args.baseline}"] = unpack(args.baseline, Path(folder))
        runs: dict[str, dict[int, list[list[float]]]] = {t: {n: [] for n in SIZES} for t in trees}
        for _ in range(args.repeats):  # interleaved: both trees see the same machine
            for running in SIZES:
                for name, root in trees.items():
                    runs[name][running].append(
                        run_worker(root, running, args.steps, args.equal_prompts))
    medians = {name: report(name, runs[name]) for name in trees}
    current = medians["current"]
    for name in trees.keys() - {"current"}:
        speedups = ", ".join(f"{medians[name][n] / current[n]:.2f}x at {n}" for n in SIZES)
        print(f"current vs {name}: median step {speedups} faster")
    ratio = current[1024] / current[256]
    print(f"goal median <= 0.5 ms at 256 running: "
          f"{'met' if current[256] <= GOAL_MEDIAN_S else 'NOT met'} ({current[256] * 1e3:.3f} ms)")
    print(f"goal ratio 1024/256 <= {GOAL_RATIO}: "
          f"{'met' if ratio <= GOAL_RATIO else 'NOT met'} ({ratio:.2f})")


if __name__ == "__main__":
    main()
