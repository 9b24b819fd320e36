"""The tuner's held-out capacity against the default and vLLM's grid, and Optuna against random
search on an exhaustive grid (issues 14 and 24).

    .venv/bin/python bench/tuner_vs_grid.py [--quick] [--seeds 3] [--trials 30] [--workers 2]
                                            [--itl 0.3] [--tpot S]

Sim mode: Llama-3-8B on the simulated 24 GB L4 (max_model_len 8192 as the base), the Azure
conversation trace (/work/shared/data/traces/azure_llm_2023_conv.csv, else the head in
tests/tuner/data with smaller windows), objective `capacity` (the highest arrival rate at which
every p99 holds, bracketed and bisected per trial by `tuner.capacity`), SLOs p99 TTFT <= 2 s and
per-gap p99 ITL <= --itl (every gap between two tokens pooled over the trial, vLLM's ITL; the
default 0.3 s binds the default config, whose per-gap p99 ITL at its TTFT-only capacity is
~0.55 s, while vLLM's 512-token-budget configs stay well under it), optionally p99 TPOT.
The windows are `fairgate tune`'s (`tuner.windows.study_windows`): a train window of 1,000
requests (`protocol.stats.min_samples(99)`) from the trace's start at --rate (the train
window's mean), then 3 held-out windows of the same trace-length replayed at the same speed.

1. Baselines: the default config and vLLM auto_tune's 8 configs (`tuner.baselines.vllm_grid`,
   memory_fraction probed from 0.98 down), each on the train window and every held-out window
   with its 95% interval (`Evaluator.score(..., interval=True)`, what `tuner.holdout` runs).
2. The tuner: a real `tuner.study.run_study` (baseline vllm-grid, holdout 3, --trials trials,
   one worker each) per seed in --seeds; its recommendation's held-out capacity against the
   better baseline's, in-sample (train window) beside held-out.
   Goals: (a) per seed, the recommendation's held-out value >= the better baseline's held-out
   lower bound (never worse beyond noise); (b) the median over seeds of the recommendation's
   held-out capacity over the grid's best (the one chosen on the train window, as the study
   does) >= 1.1x.
3. Trials to 95% of the grid's best, TPE against random search: every config of a 168-config
   grid (7 token budgets x 6 max_num_seqs x 4 memory_fractions, max_model_len 8192; the
   700-config grid of issue 14 would take about an hour on 2 shared cores at 1,000 requests a
   probe) is simulated once on the train window; the simulator is deterministic, so each
   sampler's trials are looked up in that table (checked by re-simulating two configs). The
   knobs are suggested as positions in the grid's sorted values (ordered, as `fairgate tune`'s
   ranges are) and, for comparison, as categorical choices; the default config first. TPE's
   first 10 trials are its random start-up draws, the same as the random sampler's of the same
   seed: a paired comparison, they part only where TPE's model takes over.
4. Speed: one goodput trial of 2,000 trace requests under the default config.

All simulations run in one pool of --workers spawned processes (studies first). Exit status 0
either way: a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import optuna  # noqa: E402

from engine.config import EngineConfig  # noqa: E402
from fairgate.tune_cli import BENCH_DEFAULTS  # noqa: E402
from protocol.measures import SLO  # noqa: E402
from protocol.stats import min_samples  # noqa: E402
from tuner.baselines import default_params, vllm_grid  # noqa: E402
from tuner.bench_cli import plan_requests  # noqa: E402
from tuner.evaluate import CI_PROBES, CI_STEP, Evaluator  # noqa: E402
from tuner.holdout import HeldOut  # noqa: E402
from tuner.measures import (  # noqa: E402
    VIOLATION_CAP,
    constraint_names,
    measure,
    slo_text,
)
from tuner.runners import SimRunner  # noqa: E402
from tuner.space import Choices, Space, default_space  # noqa: E402
from tuner.spec import TuneSpec, Window  # noqa: E402
from tuner.study import run_study  # noqa: E402
from tuner.traces import TraceRequest, load_trace  # noqa: E402
from tuner.windows import study_windows  # noqa: E402

HEAD_TRACE = ROOT / "tests" / "tuner" / "data" / "azure_conv_head.csv"
FULL_TRACE = Path("/work/shared/data/traces/azure_llm_2023_conv.csv")
BASE = EngineConfig(executor="sim", sim_hardware="l4", sim_model="llama-3-8b", max_model_len=8192)
TTFT_S, ITL_S = 2.0, 0.3
RATE = 0.5  # req/s, the train window's mean: near the configs' capacities, so few probes
HOLDOUT = 3
KNOBS = ("max_num_batched_tokens", "max_num_seqs", "max_model_len", "memory_fraction")
# max_model_len is fixed in the lookup grid: on this trace it changes nothing but which
# prompts start (the train window's longest is 4,145 tokens); the study's space varies it
Grid = dict[str, tuple[Any, ...]]  # knob -> its values, sorted
GRID: Grid = {"max_num_batched_tokens": (256, 384, 512, 768, 1024, 2048, 4096),
              "max_num_seqs": (16, 32, 64, 128, 256, 512),
              "max_model_len": (8192,),
              "memory_fraction": (0.80, 0.90, 0.95, 0.98)}
QUICK_GRID: Grid = {"max_num_batched_tokens": (512, 1024, 2048),
                    "max_num_seqs": (64, 128),
                    "max_model_len": (8192,),
                    "memory_fraction": (0.90, 0.98)}
QUICK_WINDOW = 150  # requests per window in --quick
REACH = 0.95  # of the grid's best
GAIN = 1.10  # goal (b): the recommendation over the grid's best, held out
SPEED_REQUESTS, SPEED_GOAL_S, SPEED_REPEATS = 2000, 3.0, 3

Key = tuple[Any, ...]  # a config's knob values in GRID order


# ----------------------------------------------------------------------------- scenario


@dataclass(frozen=True)
class Scenario:
    trace: Path
    slo: SLO
    train: Window
    held: tuple[Window, ...]
    window_requests: int  # what each window was cut to hold


def scenario(slo: SLO, quick: bool, rate: float) -> Scenario:
    """The train window and held-out windows `fairgate tune --trace ... --rate R` cuts."""
    trace = FULL_TRACE if FULL_TRACE.exists() else HEAD_TRACE
    wanted = min_samples(100 * slo.target)
    total = len(load_trace(trace, "auto"))
    if quick:
        wanted = QUICK_WINDOW
    if total < wanted * (1 + HOLDOUT):  # the head trace: as many as fit
        wanted = total // (1 + HOLDOUT) - 1
    args = argparse.Namespace(**{**BENCH_DEFAULTS, "trace": str(trace), "trace_format": "auto",
                                 "workload": None, "workload_file": None, "rate": rate,
                                 "duration": None, "start": 0.0, "window": None, "seed": 0})
    train, held = study_windows(args, HOLDOUT, wanted, plan_requests, strict=False)
    return Scenario(trace, slo, train, held, wanted)


def make_spec(sc: Scenario, space: Space | None = None, **changes: Any) -> TuneSpec:
    runner = SimRunner()
    if space is None:
        space = default_space(BASE, runner.prepare(BASE))
    fields: dict[str, Any] = {"mode": "sim", "base": BASE, "space": space,
                              "requests": sc.train.requests, "slo": sc.slo,
                              "storage": "sqlite:///:memory:", "study_name": "tuner-vs-grid",
                              "out_dir": Path("."), "objective": "capacity", "trials": 30}
    return TuneSpec(**{**fields, **changes})


def grid_space(grid: Grid) -> Space:
    return Space(tuple((knob, Choices(tuple(values))) for knob, values in grid.items()))


# ----------------------------------------------------------------------------- evaluating


@dataclass(frozen=True)
class Point:
    """One config's simulated result on the train window (no interval: a study's trial)."""

    params: dict[str, Any]
    value: float  # capacity, req/s; 0 when it cannot start or misses the SLOs at every rate
    violations: tuple[float, ...]  # p99 - SLO for each SLO set, as the study's constraints
    why: str | None  # why it is infeasible, None when feasible
    wall_s: float

    @property
    def feasible(self) -> bool:
        return self.why is None


def score(spec: TuneSpec, params: dict[str, Any]) -> Point:
    """What a `fairgate tune` trial of `params` records (runs in a worker process)."""
    started = time.perf_counter()
    runner = SimRunner()
    evaluator = Evaluator(spec, runner, runner.prepare(spec.base))
    try:
        scored = evaluator.score(evaluator.config(params), spec.requests)
    except ValueError as exc:
        why = " ".join(str(exc).split())
        return Point(params, 0.0, (VIOLATION_CAP,) * len(constraint_names(spec.slo)),
                     f"cannot start: {why}", time.perf_counter() - started)
    return Point(params, scored.value, tuple(scored.measures.violations(spec.slo)),
                 scored.missed, time.perf_counter() - started)


@dataclass(frozen=True)
class Figure:
    """One config on one window with its 95% interval, as `tuner.holdout` scores it."""

    value: float
    low: float
    high: float
    missed: str | None
    p99s: tuple[float, float, float]  # TTFT, TPOT, ITL at the capacity point, seconds
    wall_s: float


def figure(spec: TuneSpec, params: dict[str, Any], requests: tuple[TraceRequest, ...]) -> Figure:
    started = time.perf_counter()
    runner = SimRunner()
    evaluator = Evaluator(spec, runner, runner.prepare(spec.base))
    try:
        scored = evaluator.score(evaluator.config(params), requests, interval=True)
    except ValueError as exc:
        return Figure(0.0, 0.0, 0.0, f"did not start: {exc}", (math.inf,) * 3,
                      time.perf_counter() - started)
    low, high = scored.interval or (scored.value, scored.value)
    m = scored.measures
    return Figure(scored.value, low, high, scored.missed,
                  (m.p99_ttft_s, m.p99_tpot_s, m.p99_itl_s), time.perf_counter() - started)


@dataclass(frozen=True)
class StudyResult:
    """What one seed's `run_study` chose, and on what figures."""

    seed: int
    wall_s: float
    trials: int
    feasible: int
    not_run: int  # infeasible before running or out of memory
    top: int | None  # the study's own best trial (in-sample)
    checked: list[HeldOut] = field(default_factory=list)
    chosen: HeldOut | None = None
    baseline: HeldOut | None = None  # what the rule held the searched configs against
    params: dict[int, dict[str, Any]] = field(default_factory=dict)  # trial -> knobs
    verdict: str = ""
    error: str | None = None


def study(spec: TuneSpec) -> StudyResult:
    """One real study, in process (a worker of the pool), in a scratch directory."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="tuner-vs-grid-") as tmp:
        spec = _replace(spec, storage=f"sqlite:///{tmp}/study.db", out_dir=Path(tmp) / "out",
                        study_name=f"tuner-vs-grid-seed{spec.seed}")
        try:
            outcome = run_study(spec)
        except ValueError as exc:
            return StudyResult(spec.seed, time.perf_counter() - started, 0, 0, 0, None,
                               error=str(exc))
    rows = outcome.rows
    selection = outcome.selection
    top = outcome.top
    return StudyResult(
        seed=spec.seed, wall_s=time.perf_counter() - started, trials=len(rows),
        feasible=sum(r.feasible for r in rows), not_run=sum(not r.ran for r in rows),
        top=None if top is None else top.number,
        checked=[] if selection is None else list(selection.checked),
        chosen=None if selection is None else selection.chosen,
        baseline=None if selection is None else selection.baseline,
        params={r.number: r.params for r in rows},
        verdict="" if selection is None else selection.verdict("req/s"))


def _replace(spec: TuneSpec, **changes: Any) -> TuneSpec:
    import dataclasses

    return dataclasses.replace(spec, **changes)


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


def grid_configs(grid: Grid) -> list[dict[str, Any]]:
    return [dict(zip(grid, values, strict=True)) for values in itertools.product(*grid.values())]


def key_of(params: dict[str, Any]) -> Key:
    return tuple(params[k] for k in KNOBS)


def search(grid: Grid, table: dict[Key, Point], default: dict[str, Any],
           names: Sequence[str], sampler: optuna.samplers.BaseSampler, ordered: bool,
           budget: int, seed: int) -> Search:
    """`budget` trials of `sampler`, the default config first, each looked up in `table`."""

    def objective(trial: optuna.Trial) -> float:
        if ordered:  # positions in the sorted values: TPE sees which values are neighbours
            params = {k: v[trial.suggest_int(k, 0, len(v) - 1)] for k, v in grid.items()}
        else:
            params = {k: trial.suggest_categorical(k, tuple(v)) for k, v in grid.items()}
        point = table[key_of(params)]
        for name, violation in zip(names, point.violations, strict=True):
            trial.set_constraint(name, violation)
        return point.value if point.feasible else 0.0

    study_ = optuna.create_study(direction="maximize", sampler=sampler)
    study_.enqueue_trial({k: list(v).index(default[k]) if ordered else default[k]
                          for k, v in grid.items()})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        study_.optimize(objective, n_trials=budget)
    values = [t.value or 0.0 for t in study_.trials]
    distinct = len({tuple(sorted(t.params.items())) for t in study_.trials})
    return Search(seed, values, distinct)


def run_searches(grid: Grid, table: dict[Key, Point],
                 default: dict[str, Any], names: Sequence[str], budget: int,
                 seeds: int) -> dict[str, list[Search]]:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return {name: [search(grid, table, default, names, factory(seed), ordered, budget, seed)
                   for seed in range(seeds)]
            for name, (factory, ordered) in SAMPLERS.items()}


def median_best(runs: Sequence[Search], trials: int | None = None) -> float:
    return statistics.median(r.best(trials) for r in runs)


def median_reached(runs: Sequence[Search], target: float) -> str:
    """Median trials to reach `target`; a run that never did counts as beyond the budget."""
    middle = statistics.median(r.reached(target) or math.inf for r in runs)
    return "never" if math.isinf(middle) else f"{middle:g}"


# ----------------------------------------------------------------------------- speed


def speed_trial(slo: SLO) -> tuple[int, str, float, float, str | None]:
    """One goodput trial of SPEED_REQUESTS trace requests under the default config: the
    request count, the trace, wall seconds of the whole run (no early stop; the fastest of
    SPEED_REPEATS) and of the trial
    as `fairgate tune` runs it (with it), and why that trial stopped early, if it did."""
    trace = FULL_TRACE if FULL_TRACE.exists() else HEAD_TRACE
    args = argparse.Namespace(**{**BENCH_DEFAULTS, "trace": str(trace), "trace_format": "auto",
                                 "workload": None, "workload_file": None, "rate": None,
                                 "duration": None, "num_requests": SPEED_REQUESTS, "seed": 0})
    requests: list[TraceRequest] = plan_requests(args)
    spec = TuneSpec(mode="sim", base=BASE, space=Space((("max_num_seqs", Choices((64,))),)),
                    requests=tuple(requests), slo=slo, storage="sqlite:///:memory:",
                    study_name="speed", out_dir=Path("."), objective="goodput", trials=1)
    runner = SimRunner()
    config = runner.prepare(BASE)
    times = []
    for _ in range(SPEED_REPEATS):  # the fastest of a few: the machine is shared
        started = time.perf_counter()
        run = runner.run(config, requests, lambda finished: None)
        measure(run, len(requests), slo)
        times.append(time.perf_counter() - started)
    whole = min(times)
    evaluator = Evaluator(spec, runner, config)
    started = time.perf_counter()
    scored = evaluator.score(config, spec.requests)
    trial = time.perf_counter() - started
    stopped = scored.missed if scored.missed and scored.missed.startswith("stopped") else None
    return len(requests), trace.name, whole, trial, stopped


# ----------------------------------------------------------------------------- report


def knobs(params: dict[str, Any]) -> str:
    """'2048/64/8192/0.90': max_num_batched_tokens/max_num_seqs/max_model_len/memory_fraction."""
    return "/".join(f"{params[k]:.2f}" if isinstance(params[k], float) else str(params[k])
                    for k in KNOBS if k in params)


def cell(value: float, low: float, high: float) -> str:
    return f"{value:.3f} [{low:.3f}, {high:.3f}]"


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b > 0 else ("inf" if a > 0 else "-")


@dataclass(frozen=True)
class Baseline:
    label: str
    params: dict[str, Any]
    train: Figure
    held: list[Figure]

    @property
    def value(self) -> float:
        return statistics.fmean(f.value for f in self.held) if self.held else 0.0

    @property
    def low(self) -> float:
        return statistics.fmean(f.low for f in self.held) if self.held else 0.0

    @property
    def high(self) -> float:
        return statistics.fmean(f.high for f in self.held) if self.held else 0.0


def print_baselines(sc: Scenario, baselines: list[Baseline], grid_best: Baseline) -> None:
    labels = [w.label for w in sc.held]
    print("\n== 1. baselines: capacity, req/s [95% interval], train window (in-sample) and "
          "held-out ==")
    print("knobs: max_num_batched_tokens/max_num_seqs/max_model_len/memory_fraction; "
          "p99s (TTFT/TPOT/ITL, ms) at the train window's capacity point")
    header = ["config", "knobs", "train (in-sample)", *labels, "held-out mean",
              "p99s at train cap"]
    rows = []
    for b in baselines:
        p = b.train.p99s
        rows.append([b.label + (" *" if b is grid_best else ""), knobs(b.params),
                     cell(b.train.value, b.train.low, b.train.high),
                     *[cell(f.value, f.low, f.high) + ("!" if f.missed else "") for f in b.held],
                     cell(b.value, b.low, b.high),
                     "/".join(f"{x * 1000:.0f}" if math.isfinite(x) else "inf" for x in p)])
    print_table(header, rows)
    print(f"* the grid's best on the train window ({grid_best.label}, {grid_best.train.value:.3f}"
          " req/s), the one the study holds out; ! missed the SLOs at every probed rate there")
    for i, label in enumerate(labels):
        best = max(baselines[1:], key=lambda b: b.held[i].value)  # noqa: B023
        print(f"  {label}: the grid's best there (an oracle) is {best.label} "
              f"{best.held[i].value:.3f} req/s; the train-chosen one "
              f"{grid_best.held[i].value:.3f}")
    shares = [f.low / f.value for b in baselines for f in [b.train, *b.held] if f.value > 0]
    cap = CI_STEP ** -CI_PROBES
    capped = sum(math.isclose(x, cap, rel_tol=1e-6) for x in shares)
    print(f"interval width: low end / value median {statistics.median(shares):.2f} (lowest "
          f"{min(shares):.2f}); {capped} of {len(shares)} low ends are the last extra probe, "
          f"{cap:.3f}x the capacity ({CI_PROBES} steps of 1/{CI_STEP:g} found no rate with every "
          "p99 interval under its target); the rule replaces a baseline only when a config's "
          "mean low end beats the baseline's mean value")


def print_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=True)]
    for row in [header, *rows]:
        print("  ".join(str(x).ljust(w) for x, w in zip(row, widths, strict=True)).rstrip())


def print_studies(sc: Scenario, results: list[StudyResult], trials: int,
                  default: Baseline, grid_best: Baseline) -> tuple[list[bool], list[float]]:
    labels = [w.label for w in sc.held]
    print(f"\n== 2. the tuner: run_study(baseline vllm-grid, holdout {len(sc.held)}, "
          f"{trials} trials, holdout_top 3), one per seed ==")
    never_worse: list[bool] = []
    gains: list[float] = []
    for r in results:
        if r.error is not None or r.chosen is None:
            print(f"seed {r.seed}: no selection ({r.error or 'no feasible trial'})")
            never_worse.append(False)
            gains.append(0.0)
            continue
        print(f"\nseed {r.seed}: {r.trials} trials ({r.feasible} feasible, {r.not_run} not run "
              f"or out of memory), {r.wall_s:.0f} s; the study's own best is #{r.top}")
        header = ["role", "#", "knobs", "train", *labels, "held-out mean [low, high]", ""]
        rows = []
        for h in r.checked:
            mark = "<- recommended" if h.number == r.chosen.number else (
                "(held against)" if r.baseline is not None and h.number == r.baseline.number
                else "")
            rows.append([h.role, str(h.number), knobs(r.params[h.number]),
                         f"{h.train_value:.3f}",
                         *[f"{h.values.get(lbl, 0.0):.3f}" + ("!" if lbl in h.missed else "")
                           for lbl in labels],
                         cell(h.value, h.low, h.high), mark])
        print_table(header, rows)
        print(f"verdict: {r.verdict}")
        chosen = r.chosen
        grid = next((h for h in r.checked if h.role.startswith("vllm-grid")), None)
        base_ = next((h for h in r.checked if h.role == "default"), None)
        better = max((h for h in (grid, base_) if h is not None), key=lambda h: h.value)
        ok = chosen.value >= better.low
        never_worse.append(ok)
        gain = chosen.value / grid.value if grid is not None and grid.value > 0 else 0.0
        gains.append(gain)
        top = next((h for h in r.checked if h.number == r.top), None)
        shrink = "" if top is None or grid is None else (
            f"; the study's own best #{top.number}: {ratio(top.train_value, grid.train_value)} "
            f"the grid's best in-sample, {ratio(top.value, grid.value)} held out")
        print(f"recommendation #{chosen.number} ({chosen.role}): train {chosen.train_value:.3f}, "
              f"held-out {cell(chosen.value, chosen.low, chosen.high)}; over the grid's best: "
              f"{ratio(chosen.train_value, grid.train_value) if grid else '-'} in-sample, "
              f"{ratio(chosen.value, grid.value) if grid else '-'} held out{shrink}")
        for b in (default, grid_best):  # the study's baselines are the bench's own figures
            mine = next((c for c in r.checked if c.role == b.label), None)
            if mine is not None:
                same = all(abs(mine.values[lbl] - f.value) < 1e-9
                           for lbl, f in zip(labels, b.held, strict=True))
                print(f"  consistency: the study's held-out {b.label} figures equal the bench's "
                      f"own: {'yes' if same else 'NO'}")
    return never_worse, gains


def print_grid(grid: Grid, points: list[Point], wall_s: float) -> None:
    shape = " x ".join(str(len(v)) for v in grid.values())
    cannot = sum(p.why is not None and p.why.startswith("cannot start") for p in points)
    missed = sum(not p.feasible for p in points) - cannot
    print(f"grid: {len(points)} configs ({shape}: {', '.join(grid)}), each simulated once on "
          f"the train window; {cannot} cannot start (out of memory), {missed} miss the SLOs at "
          f"every rate; {sum(p.wall_s for p in points):.0f} s of simulation in all "
          f"({statistics.median(p.wall_s for p in points):.1f} s median per config, "
          f"{wall_s:.0f} s wall for the whole pool)")
    print("top configs (capacity, req/s):")
    for p in sorted(points, key=lambda p: -p.value)[:5]:
        print(f"  {p.value:7.3f}  {knobs(p.params)}")
    values = sorted(p.value for p in points if p.feasible)
    if values:
        print(f"feasible configs' capacity: min {values[0]:.3f}, median "
              f"{statistics.median(values):.3f}, max {values[-1]:.3f} req/s; "
              f"{sum(v >= REACH * values[-1] for v in values)} configs within {REACH:.0%} "
              "of the best")


def print_searches(results: dict[str, list[Search]], best: float, budget: int,
                   grid_size: int) -> None:
    target = REACH * best
    print(f"\nsearch: {budget} trials each ({budget / grid_size:.0%} of the grid), the default "
          "config first; trials are looked up in the grid table")
    print(f"{'sampler':20}{'seed':>5}{'best':>9}{'of grid':>9}{'trials to 95%':>15}"
          f"{'to 100%':>9}{'distinct':>10}")
    for name, runs in results.items():
        for run in runs:
            reached, top = run.reached(target), run.reached(best)
            print(f"{name:20}{run.seed:5d}{run.best():9.3f}{run.best() / best:9.1%}"
                  f"{reached if reached is not None else '-':>15}"
                  f"{top if top is not None else '-':>9}{run.distinct:10d}")
        print(f"{name + ' median':25}{median_best(runs):9.3f}{median_best(runs) / best:9.1%}"
              f"{median_reached(runs, target):>15}{median_reached(runs, best):>9}")


def search_goals(results: dict[str, list[Search]], best: float, vllm_best: float,
                 budget: int) -> list[str]:
    tpe, random = results["TPE (ordered)"], results["random"]
    tpe_best, random_best = median_best(tpe), median_best(random)
    target = REACH * best
    reach = median_reached(tpe, target)

    def middle(runs: Sequence[Search]) -> float:
        return statistics.median(r.reached(target) or math.inf for r in runs)

    checkpoints = sorted({max(1, budget // 4), max(1, budget // 2), budget})
    curve = ", ".join(f"{n}: {median_best(tpe, n):.3f} vs {median_best(random, n):.3f}"
                      for n in checkpoints)
    beats = tpe_best > random_best or (tpe_best == random_best and middle(tpe) < middle(random))
    margin = tpe_best / vllm_best - 1 if vllm_best > 0 else math.inf
    return [
        f"(c) TPE reaches >= {REACH:.0%} of the grid's best ({target:.3f}) in <= {budget} "
        f"trials: median best {tpe_best:.3f} ({tpe_best / best:.1%}), median trials {reach}: "
        f"{'PASS' if tpe_best >= target else 'FAIL'}",
        f"(d) TPE beats random search at equal trials: median best {tpe_best:.3f} vs "
        f"{random_best:.3f}, trials to 95% {reach} vs {median_reached(random, target)} "
        f"(median best after {curve}): {'PASS' if beats else 'FAIL'}",
        f"(e) in-sample, TPE's median best beats the best of vLLM's grid ({vllm_best:.3f}): "
        f"margin {margin:+.1%}: {'PASS' if tpe_best > vllm_best else 'FAIL'}",
    ]


def check_determinism(spec: TuneSpec, table: dict[Key, Point], keys: Sequence[Key]) -> str:
    again = [score(spec, table[k].params) for k in keys]
    same = all(p.value == table[k].value and p.why == table[k].why
               for p, k in zip(again, keys, strict=True))
    return (f"determinism: {len(keys)} grid configs re-simulated in this process, identical "
            f"results: {'yes' if same else 'NO: the grid-table lookup is not valid'}")


# ----------------------------------------------------------------------------- main


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"{QUICK_WINDOW}-request windows, 1 seed of 10 trials, a "
                             f"{math.prod(len(v) for v in QUICK_GRID.values())}-config grid: "
                             "a smoke run of a couple of minutes")
    parser.add_argument("--seeds", type=int, default=None,
                        help="studies, one per seed (default 3; quick: 1)")
    parser.add_argument("--trials", type=int, default=None,
                        help="each study's size (default 30; quick: 10)")
    parser.add_argument("--search-seeds", type=int, default=None,
                        help="seeds per sampler on the grid table (default 5; quick: 2)")
    parser.add_argument("--search-trials", type=int, default=None,
                        help="trials per sampler on the grid table (default 30; quick: 6)")
    parser.add_argument("--itl", type=float, default=ITL_S, help="per-gap p99 ITL target, s "
                        f"(default {ITL_S:g})")
    parser.add_argument("--tpot", type=float, default=None, help="p99 TPOT target, s (none)")
    parser.add_argument("--rate", type=float, default=RATE,
                        help=f"the train window's mean rate, req/s (default {RATE:g})")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    grid = QUICK_GRID if args.quick else GRID
    seeds = args.seeds or (1 if args.quick else 3)
    trials = args.trials or (10 if args.quick else 30)
    search_seeds = args.search_seeds or (2 if args.quick else 5)
    search_trials = args.search_trials or (6 if args.quick else 30)
    slo = SLO(ttft_s=TTFT_S, tpot_s=args.tpot, itl_s=args.itl)
    began = time.perf_counter()

    sc = scenario(slo, args.quick, args.rate)
    print(f"scenario: {BASE.sim_model} on the simulated {BASE.sim_hardware} (max_model_len "
          f"{BASE.max_model_len} base), {sc.trace.name}; SLOs {slo_text(slo)} (ITL: every gap "
          f"between tokens, pooled); objective capacity; load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs, {args.workers} workers")
    print(f"windows ({sc.window_requests} requests wanted each): train {sc.train.label}: "
          f"{len(sc.train.requests)} requests at {sc.train.rate:.3f} req/s; held-out: "
          + "; ".join(f"{w.label}: {len(w.requests)} at {w.rate:.3f} req/s" for w in sc.held))

    spec = make_spec(sc)
    runner = SimRunner()
    prepared = runner.prepare(BASE)
    default = default_params(spec, prepared)
    vllm = vllm_grid(_replace(spec, baseline="vllm-grid"), prepared)
    named = [("default", default), *vllm]
    grid_spec = make_spec(sc, grid_space(grid))
    configs = grid_configs(grid)
    windows = [sc.train, *sc.held]

    with ProcessPoolExecutor(args.workers, mp_context=get_context("spawn")) as pool:
        studies = [pool.submit(study, _replace(spec, baseline="vllm-grid", trials=trials,
                                               seed=seed, holdout=sc.held, holdout_top=3))
                   for seed in range(seeds)]
        figures = {(label, i): pool.submit(figure, spec, params, w.requests)
                   for label, params in named for i, w in enumerate(windows)}
        cells = [pool.submit(score, grid_spec, params) for params in configs]
        everything: list[Future[Any]] = [*studies, *figures.values(), *cells]
        for done, _ in enumerate(as_completed(everything), 1):
            if done % 10 == 0 or done == len(everything):
                print(f"[{time.perf_counter() - began:5.0f} s] {done}/{len(everything)} jobs done",
                      file=sys.stderr, flush=True)
        pool_wall = time.perf_counter() - began

    baselines = [Baseline(label, params, figures[label, 0].result(),
                          [figures[label, i].result() for i in range(1, len(windows))])
                 for label, params in named]
    feasible_grid = [b for b in baselines[1:] if b.train.missed is None]
    grid_best = max(feasible_grid or baselines[1:], key=lambda b: b.train.value)  # first of ties
    print_baselines(sc, baselines, grid_best)

    results = [f.result() for f in studies]
    never_worse, gains = print_studies(sc, results, trials, baselines[0], grid_best)

    print("\n== 3. trials to 95% of the grid's best: TPE against random search (train window) ==")
    points = [f.result() for f in cells]
    print_grid(grid, points, pool_wall)
    table = {key_of(p.params): p for p in points}
    best = max(points, key=lambda p: p.value)
    grid_default = {k: default[k] for k in grid}
    in_grid = key_of(grid_default) in table
    if in_grid:
        print(f"default config: capacity {table[key_of(grid_default)].value:.3f} req/s "
              f"({knobs(grid_default)})")
    print(check_determinism(grid_spec, table, [key_of(best.params)]
                            + ([key_of(grid_default)] if in_grid else [])))
    budget = search_trials
    searches = run_searches(grid, table, grid_default, constraint_names(slo), budget,
                            search_seeds)
    print_searches(searches, best.value, budget, len(points))
    vllm_best = max(b.train.value for b in baselines[1:])

    print("\n== 4. speed ==")
    count, trace, whole, trial, stopped = speed_trial(slo)
    print(f"speed: {count} requests of {trace} under the default config: {whole:.2f} s for the "
          f"whole replay (fastest of {SPEED_REPEATS}), {trial:.2f} s as a goodput trial"
          + (f" ({stopped[:60]}...)" if stopped else "")
          + f": {'PASS' if whole <= SPEED_GOAL_S else 'FAIL'} (goal <= {SPEED_GOAL_S:g} s)")

    print(f"\ngoals ({len(results)} seeds):")
    per_seed = ", ".join(f"seed {r.seed} {'yes' if ok else 'no'}"
                         for r, ok in zip(results, never_worse, strict=True))
    print(f"(a) the recommendation is never below the better baseline beyond noise (held-out "
          f"value >= the better baseline's held-out lower bound, per seed: {per_seed}): "
          f"{'PASS' if never_worse and all(never_worse) else 'FAIL'}")
    middle = statistics.median(gains) if gains else 0.0
    print(f"(b) median over seeds of the recommendation's held-out capacity / the grid's best's "
          f"(per seed {', '.join(f'{g:.2f}x' for g in gains)}): {middle:.2f}x >= {GAIN:.1f}x: "
          f"{'PASS' if middle >= GAIN else 'FAIL'}")
    for line in search_goals(searches, best.value, vllm_best, budget):
        print(line)
    print(f"\nwall time: {time.perf_counter() - began:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
