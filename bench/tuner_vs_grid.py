"""Optuna against an exhaustive grid, random search and vLLM's default grid (issue 14).

    .venv/bin/python bench/tuner_vs_grid.py [--quick] [--seeds 5] [--workers 2]

Sim mode, the memory-bound scenario: Llama-3-8B on the simulated 24 GB L4 (max_model_len 8192
as the base), the Azure conversation trace head at --rate 1 for --duration 450 s (362
requests), SLOs p99 TTFT <= 2 s and p99 ITL (TPOT) <= 0.15 s, objective `capacity` (the highest
arrival rate at which both p99s hold, bracketed and bisected per trial by `tuner.capacity`).

1. The grid: every combination of the four knobs below is simulated once (in --workers spawned
   processes), through the same `Evaluator.score` a `fairgate tune` trial runs.
2. The simulator is deterministic, so a config's objective is a pure function of its knobs:
   Optuna and random search look their trials up in the grid table instead of re-simulating
   (checked by re-simulating a few configs). Each suggestion is a grid point: the knobs are
   suggested as positions in the grid's sorted values (ordered ints, as `fairgate tune`'s
   ranges are), and, for comparison, as categorical choices.
3. TPE (multivariate, the trial's p99 violations as constraints, as `tuner.study` sets them)
   and Optuna's RandomSampler, each with the default config enqueued first, a budget of 10% of
   the grid's trials and --seeds seeds. vLLM auto_tune's 8 configs (`tuner.study.vllm_grid`,
   memory_fraction probed from 0.98 down) are simulated, since some fractions are off-grid.
4. Speed: one goodput trial of 2,000 trace requests (the full shared Azure trace when present).

Goals: Optuna's median best reaches >= 95% of the grid's best within the budget; it beats random
search at equal trials; it beats the best of vLLM's grid (margin printed). Exit status 0 either
way: a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from functools import partial
from multiprocessing import get_context
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import optuna  # noqa: E402

from engine.config import EngineConfig  # noqa: E402
from fairgate.tune_cli import _BENCH_DEFAULTS  # noqa: E402
from protocol.measures import SLO  # noqa: E402
from tuner.baselines import vllm_grid  # noqa: E402
from tuner.bench_cli import plan_requests  # noqa: E402
from tuner.evaluate import Evaluator  # noqa: E402
from tuner.measures import CONSTRAINTS, VIOLATION_CAP, measure  # noqa: E402
from tuner.runners import SimRunner  # noqa: E402
from tuner.space import Choices, Space  # noqa: E402
from tuner.spec import TuneSpec  # noqa: E402
from tuner.traces import TraceRequest  # noqa: E402

HEAD_TRACE = ROOT / "tests" / "tuner" / "data" / "azure_conv_head.csv"
FULL_TRACE = Path("/work/shared/data/traces/azure_llm_2023_conv.csv")
BASE = EngineConfig(executor="sim", sim_hardware="l4", sim_model="llama-3-8b", max_model_len=8192)
SLOS = SLO(ttft_s=2.0, itl_s=0.15)
GRID = {"max_num_batched_tokens": (256, 384, 512, 768, 1024, 2048, 4096),
        "max_num_seqs": (16, 32, 64, 128, 256),
        "max_model_len": (4096, 8192, 16384, 32768),
        "memory_fraction": (0.80, 0.85, 0.90, 0.95, 0.98)}
QUICK_GRID = {"max_num_batched_tokens": (512, 1024, 2048),
              "max_num_seqs": (32, 64, 128),
              "max_model_len": (8192, 32768),
              "memory_fraction": (0.85, 0.90)}
BUDGET = 0.10  # of the grid's trials
REACH = 0.95  # of the grid's best
SPEED_REQUESTS, SPEED_GOAL_S = 2000, 3.0

Key = tuple[Any, ...]  # a config's knob values in GRID order


# ----------------------------------------------------------------------------- evaluating


@dataclass(frozen=True)
class Point:
    """One config's simulated result."""

    params: dict[str, Any]
    value: float  # capacity, req/s; 0 when it cannot start or misses the SLOs at every rate
    violations: tuple[float, float]  # p99 - SLO for TTFT and ITL, as the study's constraints
    why: str | None  # why it is infeasible, None when feasible
    wall_s: float

    @property
    def feasible(self) -> bool:
        return self.why is None


def make_spec(grid: dict[str, Sequence[Any]], duration: float) -> TuneSpec:
    args = argparse.Namespace(**{**_BENCH_DEFAULTS, "trace": str(HEAD_TRACE),
                                 "trace_format": "auto", "workload": None,
                                 "workload_file": None, "rate": 1.0, "duration": duration,
                                 "seed": 0})
    space = Space(tuple((knob, Choices(tuple(values))) for knob, values in grid.items()))
    return TuneSpec(mode="sim", base=BASE, space=space, requests=tuple(plan_requests(args)),
                    slo=SLOS, storage="sqlite:///:memory:", study_name="tuner-vs-grid",
                    out_dir=Path("."), objective="capacity", trials=1)


def score(spec: TuneSpec, params: dict[str, Any]) -> Point:
    """What a `fairgate tune` trial of `params` records (runs in a worker process)."""
    started = time.perf_counter()
    runner = SimRunner()
    evaluator = Evaluator(spec, runner, runner.prepare(spec.base))
    try:
        scored = evaluator.score(evaluator.config(params), spec.requests)
    except ValueError as exc:
        why = " ".join(str(exc).split())
        return Point(params, 0.0, (VIOLATION_CAP, VIOLATION_CAP), f"cannot start: {why}",
                     time.perf_counter() - started)
    ttft, itl = scored.measures.violations(spec.slo)
    return Point(params, scored.value, (ttft, itl), scored.missed, time.perf_counter() - started)


def score_all(spec: TuneSpec, configs: Sequence[dict[str, Any]], workers: int) -> list[Point]:
    if workers <= 1:
        return [score(spec, params) for params in configs]
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
        return list(pool.map(partial(score, spec), configs, chunksize=4))


def grid_configs(grid: dict[str, Sequence[Any]]) -> list[dict[str, Any]]:
    return [dict(zip(grid, values, strict=True)) for values in itertools.product(*grid.values())]


def key_of(params: dict[str, Any]) -> Key:
    return tuple(params.values())


# ----------------------------------------------------------------------------- searching


@dataclass(frozen=True)
class Search:
    """One sampler's run over the grid table."""

    seed: int
    values: list[float]  # each trial's objective, 0 for an infeasible one
    distinct: int  # grid points tried

    def best(self, trials: int | None = None) -> float:
        return max(self.values[:trials], default=0.0)

    def reached(self, target: float) -> int | None:
        """1-based trial at which the best so far first reached `target`."""
        return next((i + 1 for i, v in enumerate(self.values) if v >= target), None)


SamplerFactory = Callable[[int], optuna.samplers.BaseSampler]
SAMPLERS: dict[str, tuple[SamplerFactory, bool]] = {  # name -> (sampler, ordered positions)
    "TPE (ordered)": (lambda seed: optuna.samplers.TPESampler(seed=seed, multivariate=True), True),
    "TPE (categorical)": (
        lambda seed: optuna.samplers.TPESampler(seed=seed, multivariate=True), False),
    "random": (lambda seed: optuna.samplers.RandomSampler(seed=seed), True),
}


def search(grid: dict[str, Sequence[Any]], table: dict[Key, Point], default: dict[str, Any],
           sampler: optuna.samplers.BaseSampler, ordered: bool, budget: int, seed: int) -> Search:
    """`budget` trials of `sampler`, the default config first, each looked up in `table`."""

    def objective(trial: optuna.Trial) -> float:
        if ordered:  # positions in the sorted values: TPE sees which values are neighbours
            params = {k: v[trial.suggest_int(k, 0, len(v) - 1)] for k, v in grid.items()}
        else:
            params = {k: trial.suggest_categorical(k, tuple(v)) for k, v in grid.items()}
        point = table[key_of(params)]
        for name, violation in zip(CONSTRAINTS, point.violations, strict=True):
            trial.set_constraint(name, violation)
        return point.value if point.feasible else 0.0

    study = optuna.create_study(direction="maximize", sampler=sampler)
    study.enqueue_trial({k: list(v).index(default[k]) if ordered else default[k]
                         for k, v in grid.items()})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        study.optimize(objective, n_trials=budget)
    values = [t.value or 0.0 for t in study.trials]
    distinct = len({tuple(sorted(t.params.items())) for t in study.trials})
    return Search(seed, values, distinct)


def run_searches(grid: dict[str, Sequence[Any]], table: dict[Key, Point],
                 default: dict[str, Any], budget: int, seeds: int) -> dict[str, list[Search]]:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    results = {}
    for name, (factory, ordered) in SAMPLERS.items():
        results[name] = [search(grid, table, default, factory(seed), ordered, budget, seed)
                         for seed in range(seeds)]
    return results


# ----------------------------------------------------------------------------- speed


def speed_trial() -> tuple[int, str, float, float, str | None]:
    """One goodput trial of SPEED_REQUESTS trace requests under the default config: the
    request count, the trace, wall seconds of the whole run (no early stop) and of the trial
    as `fairgate tune` runs it (with it), and why that trial stopped early, if it did."""
    trace = FULL_TRACE if FULL_TRACE.exists() else HEAD_TRACE
    args = argparse.Namespace(**{**_BENCH_DEFAULTS, "trace": str(trace), "trace_format": "auto",
                                 "workload": None, "workload_file": None, "rate": None,
                                 "duration": None, "num_requests": SPEED_REQUESTS, "seed": 0})
    requests: list[TraceRequest] = plan_requests(args)
    spec = TuneSpec(mode="sim", base=BASE, space=Space((("max_num_seqs", Choices((64,))),)),
                    requests=tuple(requests), slo=SLOS, storage="sqlite:///:memory:",
                    study_name="speed", out_dir=Path("."), objective="goodput", trials=1)
    runner = SimRunner()
    config = runner.prepare(BASE)
    started = time.perf_counter()
    run = runner.run(config, requests, lambda finished: None)
    measure(run, len(requests), SLOS)
    whole = time.perf_counter() - started
    evaluator = Evaluator(spec, runner, config)
    started = time.perf_counter()
    scored = evaluator.score(config, spec.requests)
    trial = time.perf_counter() - started
    stopped = scored.missed if scored.missed and scored.missed.startswith("stopped") else None
    return len(requests), trace.name, whole, trial, stopped


# ----------------------------------------------------------------------------- report


def describe(params: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}"
                     for k, v in params.items())


def print_grid(grid: dict[str, Sequence[Any]], points: list[Point], wall_s: float,
               workers: int, requests: int) -> None:
    shape = " x ".join(str(len(v)) for v in grid.values())
    cannot = sum(p.why is not None and p.why.startswith("cannot start") for p in points)
    missed = sum(not p.feasible for p in points) - cannot
    print(f"grid: {len(points)} configs ({shape}: {', '.join(grid)}); {requests} requests per "
          f"probe; {cannot} cannot start (out of memory), {missed} miss the SLOs at every rate; "
          f"simulated in {wall_s:.0f} s on {workers} processes "
          f"({statistics.median(p.wall_s for p in points):.2f} s median per config)")
    ranked = sorted(points, key=lambda p: -p.value)
    print("top configs (capacity, req/s):")
    for p in ranked[:5]:
        print(f"  {p.value:7.3f}  {describe(p.params)}")
    values = sorted(p.value for p in points if p.feasible)
    if values:
        print(f"feasible configs' capacity: min {values[0]:.3f}, median "
              f"{statistics.median(values):.3f}, max {values[-1]:.3f} req/s; "
              f"{sum(v >= REACH * values[-1] for v in values)} configs within {REACH:.0%} "
              "of the best")


def print_searches(results: dict[str, list[Search]], best: float, budget: int) -> None:
    target = REACH * best
    print(f"\nsearch: {budget} trials each ({BUDGET:.0%} of the grid), the default config first; "
          "trials are looked up in the grid table")
    print(f"{'sampler':20}{'seed':>5}{'best':>9}{'of grid':>9}{'trials to 95%':>15}"
          f"{'distinct':>10}")
    for name, runs in results.items():
        for run in runs:
            reached = run.reached(target)
            print(f"{name:20}{run.seed:5d}{run.best():9.3f}{run.best() / best:9.1%}"
                  f"{reached if reached is not None else '-':>15}{run.distinct:10d}")
        print(f"{name + ' median':25}{median_best(runs):9.3f}{median_best(runs) / best:9.1%}"
              f"{median_reached(runs, target):>15}")


def median_best(runs: Sequence[Search], trials: int | None = None) -> float:
    return statistics.median(r.best(trials) for r in runs)


def median_reached(runs: Sequence[Search], target: float) -> str:
    """Median trials to reach `target`; a run that never did counts as beyond the budget."""
    reached = sorted(r.reached(target) or math.inf for r in runs)
    middle = statistics.median(reached)
    return "never" if math.isinf(middle) else f"{middle:g}"


def print_vllm(points: list[Point]) -> None:
    print("\nvLLM auto_tune's default grid (simulated; memory_fraction probed from 0.98 down):")
    for p in points:
        state = "feasible" if p.feasible else f"infeasible: {p.why}"
        print(f"  {p.value:7.3f}  {describe(p.params)}  ({state[:90]})")


def print_goals(results: dict[str, list[Search]], best: float, vllm_best: float,
                budget: int) -> None:
    tpe, random = results["TPE (ordered)"], results["random"]
    tpe_best, random_best = median_best(tpe), median_best(random)
    target = REACH * best
    reach = median_reached(tpe, target)
    print("\ngoals (Optuna = TPE over the ordered grid positions, median of "
          f"{len(tpe)} seeds):")
    print(f"  reaches >= {REACH:.0%} of the grid's best ({target:.3f}) in <= {budget} trials: "
          f"median best {tpe_best:.3f} ({tpe_best / best:.1%}), median trials {reach}: "
          f"{'PASS' if tpe_best >= target else 'FAIL'}")
    checkpoints = [budget // 4, budget // 2, budget]
    curve = ", ".join(f"{n}: {median_best(tpe, n):.3f} vs {median_best(random, n):.3f}"
                      for n in checkpoints)
    beats = tpe_best > random_best or (tpe_best == random_best and _sooner(tpe, random, target))
    print(f"  beats random search at equal trials: median best {tpe_best:.3f} vs "
          f"{random_best:.3f}, trials to 95% {reach} vs {median_reached(random, target)} "
          f"(median best after {curve}): {'PASS' if beats else 'FAIL'}")
    margin = tpe_best / vllm_best - 1 if vllm_best > 0 else math.inf
    print(f"  beats the best of vLLM's 8-config grid ({vllm_best:.3f}): margin {margin:+.1%}: "
          f"{'PASS' if tpe_best > vllm_best else 'FAIL'}")


def _sooner(a: Sequence[Search], b: Sequence[Search], target: float) -> bool:
    def middle(runs: Sequence[Search]) -> float:
        return statistics.median(r.reached(target) or math.inf for r in runs)

    return middle(a) < middle(b)


def check_determinism(spec: TuneSpec, table: dict[Key, Point], keys: Sequence[Key]) -> None:
    again = [score(spec, table[k].params) for k in keys]
    same = all(p.value == table[k].value and p.why == table[k].why
               for p, k in zip(again, keys, strict=True))
    print(f"determinism: {len(keys)} configs re-simulated in this process, identical results: "
          f"{'yes' if same else 'NO: the grid-table lookup is not valid'}")


# ----------------------------------------------------------------------------- main


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"a {math.prod(len(v) for v in QUICK_GRID.values())}-config grid, "
                             "2 seeds, 150 s of workload: a smoke run")
    parser.add_argument("--seeds", type=int, default=None, help="default 5 (quick: 2)")
    parser.add_argument("--duration", type=float, default=None,
                        help="seconds of the workload at 1 req/s (default 450; quick: 150)")
    parser.add_argument("--memory-fractions", type=float, nargs="+", metavar="F",
                        help="the grid's memory_fraction values (default "
                             f"{' '.join(map(str, GRID['memory_fraction']))}: up to the 0.98 "
                             "vLLM's probe starts from)")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    grid = QUICK_GRID if args.quick else GRID
    if args.memory_fractions:
        grid = {**grid, "memory_fraction": tuple(sorted(args.memory_fractions))}
    seeds = args.seeds or (2 if args.quick else 5)
    spec = make_spec(grid, args.duration or (150.0 if args.quick else 450.0))
    print(f"scenario: {BASE.sim_model} on the simulated {BASE.sim_hardware}, "
          f"{HEAD_TRACE.name} at 1 req/s: {len(spec.requests)} requests; SLOs p99 TTFT <= "
          f"{SLOS.ttft_s:g} s, p99 ITL <= {SLOS.itl_s:g} s; objective capacity; load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    started = time.perf_counter()
    points = score_all(spec, grid_configs(grid), args.workers)
    print_grid(grid, points, time.perf_counter() - started, args.workers, len(spec.requests))
    table = {key_of(p.params): p for p in points}
    best = max(points, key=lambda p: p.value)
    default = {k: getattr(BASE, k) for k in grid}
    print(f"default config: capacity {table[key_of(default)].value:.3f} req/s "
          f"({describe(default)})")
    check_determinism(spec, table, [key_of(best.params), key_of(default),
                                    key_of(points[len(points) // 3].params)])
    runner = SimRunner()
    vllm = score_all(spec, [params for _, params in vllm_grid(spec, runner.prepare(BASE))],
                     args.workers)
    budget = max(1, round(BUDGET * len(points)))
    results = run_searches(grid, table, default, budget, seeds)
    print_searches(results, best.value, budget)
    print_vllm(vllm)
    print_goals(results, best.value, max(p.value for p in vllm), budget)
    count, trace, whole, trial, stopped = speed_trial()
    print(f"\nspeed: {count} requests of {trace} under the default config: {whole:.2f} s for the "
          f"whole replay, {trial:.2f} s as a goodput trial"
          + (f" ({stopped[:60]}...)" if stopped else "")
          + f": {'PASS' if whole <= SPEED_GOAL_S else 'FAIL'} (goal <= {SPEED_GOAL_S:g} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
