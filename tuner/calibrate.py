"""Calibration: fit the simulated executor's step times to the real engine.

`calibrate(config)` runs the real engine (`TorchExecutor`, whatever `config` says) over a designed
set of phases (`default_design`): grid `Phase`s, `batch` requests of `prompt_tokens` each, added
at once (a batched prefill, then decodes of that batch at that context) or one per step
(`staggered`: prefill chunks beside a growing decode batch), at irregular batch sizes and prompt
lengths (CPU and GPU kernels are fastest at round sizes such as 4, 16 or 512, which a grid of
round sizes would measure and serving mostly does not run); and `Mix`es, serving-like phases:
requests of random lengths, a fixed number of them in flight, so decode batches of every size
and context run beside prefill chunks of every size, as under live traffic. Every step's wall
time (schedule, forward pass, sampling, update: what the real-time replay and the sim's virtual
clock both count) is paired with its plan's `step_features`; the phases run several rounds and
each step keeps the median of its rounds' times (another process on the machine slows one round,
not all). A non-negative least-squares fit, relative to each step's time so short decode steps
count as much as long prefills, gives the coefficients of a `SimProfile`
(engine/sim_profile.py).

Last, `measure_wake` times what the first steps after an idle spell cost beyond the same steps
straight after other work (the profile's `wake`): the phases run back to back, a server does not.

The fit never sees the design's held-out `Mix` (measured in the same rounds); the R² and median
relative error the profile reports are the fitted model's on those steps, and `check_fit` holds
them to `MIN_R2` and `MAX_MEDIAN_ERROR`.
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from engine.config import EngineConfig
from engine.executor import Executor, KVCapacity, ModelOutput
from engine.heap import serving_heap
from engine.llm_engine import LLMEngine
from engine.request import SamplingParams
from engine.scheduler import SchedulerOutput
from engine.sim_profile import FEATURES, SimProfile, StepNoise, Wake, step_features
from protocol.stats import percentile
from tuner.simulate import PromptBuilder
from tuner.traces import TraceRequest

Progress = Callable[[str], None]
Sample = tuple[tuple[float, ...], float]  # (step features, measured seconds)

# a profile that predicts its held-out steps worse than this is refused (`check_fit`)
MIN_R2 = 0.95
MAX_MEDIAN_ERROR = 0.15
# irregular sizes on purpose (see the module docstring); capped by max_num_seqs / max_model_len
GRID_BATCHES = (1, 2, 3, 5, 8, 13, 21, 34)
GRID_PROMPTS = (24, 90, 250, 500, 1000)
MIX_CONCURRENCY = (2, 6, 16)  # the mixes fitted
HELD_OUT_CONCURRENCY = 4  # the mix held out
DISTURBED_ROUND = 1.25  # a round's p99 step ratio over the median round's: disturbed, left out
MIN_PROMPT, MIN_OUTPUT = 16, 4  # a mix's shortest request
# Outputs long enough that most decodes are measured in their steady state: the few decode
# steps right after a prefill run slower (the prefill's activations have left the caches), and
# with 12-token grid outputs and mixes to 48 they were most of what the fit saw, so it read
# serving's decodes 4-12% long (bench/RESULTS.md, issue 24). Twice the steps, about a minute.
GRID_OUTPUT, STAGGERED_OUTPUT, MIX_OUTPUT = 32, 40, 96
# the wake measurement: pairs of one request straight after work and after this much idle (the
# extra had not levelled off at 0.1 s in the probes, and it had by 0.2 s); a mid-size prompt
# and a few decodes after it, whose extra falls step by step
WAKE_IDLE_S, WAKE_PAIRS, WAKE_PROMPT, WAKE_STEPS = 0.2, 24, 128, 4


@dataclass(frozen=True)
class Phase:
    batch: int  # requests in the phase
    prompt_tokens: int
    output_tokens: int = 16
    staggered: bool = False  # add one request per step instead of all at once

    def lengths(self) -> list[tuple[int, int]]:
        """(prompt tokens, output tokens) of each request, in the order they are added."""
        return [(self.prompt_tokens, self.output_tokens)] * self.batch

    def admit(self, in_flight: int) -> int:
        """How many more requests join before the next step."""
        return 1 if self.staggered else self.batch

    def describe(self) -> str:
        return (f"{self.batch} x {self.prompt_tokens} tokens"
                f"{', staggered' if self.staggered else ''}")


@dataclass(frozen=True)
class Mix:
    """Serving-like steps: `requests` requests of random lengths (prompts 16 to
    `max_prompt_tokens`, outputs 4 to `max_output_tokens`, fixed by `seed`), `concurrency` of
    them in flight (one joins as one finishes)."""

    requests: int
    concurrency: int
    max_prompt_tokens: int
    max_output_tokens: int = MIX_OUTPUT
    seed: int = 0

    def lengths(self) -> list[tuple[int, int]]:
        rng = random.Random(self.seed)
        return [(rng.randint(MIN_PROMPT, max(self.max_prompt_tokens, MIN_PROMPT)),
                 rng.randint(MIN_OUTPUT, max(self.max_output_tokens, MIN_OUTPUT)))
                for _ in range(self.requests)]

    def admit(self, in_flight: int) -> int:
        return max(self.concurrency - in_flight, 0)

    def describe(self) -> str:
        return (f"mix of {self.requests}, {self.concurrency} in flight, prompts to "
                f"{self.max_prompt_tokens}")


CalibrationPhase = Phase | Mix


@dataclass(frozen=True)
class Design:
    train: Sequence[CalibrationPhase]  # what the coefficients are fitted on
    held_out: Sequence[CalibrationPhase]  # what the fit is judged on

    @property
    def phases(self) -> list[CalibrationPhase]:
        return [*self.train, *self.held_out]


def default_design(config: EngineConfig, max_position: int,
                   max_phase_tokens: int = 4096) -> Design:
    """Grid phases of `GRID_BATCHES` x `GRID_PROMPTS` (within max_num_seqs and max_model_len),
    at once and staggered, each at most `max_phase_tokens` of prompt, plus mixes at
    `MIX_CONCURRENCY`; held out, a mix at `HELD_OUT_CONCURRENCY`. About two thousand steps a
    round; three take about a minute on 2 idle CPU cores with random:tiny at the default knobs
    (minutes when other processes share the cores)."""
    limit = min(config.max_model_len or max_position, max_position)
    prompts = [p for p in GRID_PROMPTS if p + 24 <= limit] or [max(limit // 2, 1)]
    batches = sorted({min(b, config.max_num_seqs) for b in GRID_BATCHES})
    train: list[CalibrationPhase] = [Phase(b, p, output_tokens=GRID_OUTPUT) for p in prompts
                                     for b in batches if b * p <= max_phase_tokens]
    for p in prompts:
        batch = max(1, min(max(batches), max_phase_tokens // p))
        train.append(Phase(batch, p, output_tokens=STAGGERED_OUTPUT, staggered=True))
    max_output = max(MIN_OUTPUT, min(MIX_OUTPUT, limit // 4))
    mixes = [_mix(c, max(prompts), max_output, max_phase_tokens, config.max_num_seqs, seed)
             for seed, c in enumerate((HELD_OUT_CONCURRENCY, *MIX_CONCURRENCY))]
    return Design([*train, *mixes[1:]], mixes[:1])


def _mix(concurrency: int, top_prompt: int, max_output: int, max_phase_tokens: int,
         max_num_seqs: int, seed: int) -> Mix:
    """A mix whose prompts total about `max_phase_tokens`: the more in flight, the shorter the
    prompts, so that two to four times `concurrency` requests pass through it."""
    concurrency = min(concurrency, max_num_seqs)
    max_prompt = max(MIN_PROMPT, min(top_prompt, 2 * max_phase_tokens // (3 * concurrency)))
    requests = max(2 * concurrency, max_phase_tokens * 2 // (MIN_PROMPT + max_prompt))
    requests = min(requests, 4 * concurrency + 4)  # short prompts (a small max_model_len)
    return Mix(requests, concurrency, max_prompt, max_output, seed=seed)


class RecordingExecutor:
    """An executor that notes the features of each plan it runs (the engine sees no change)."""

    def __init__(self, inner: Executor) -> None:
        self.inner = inner
        self.tokenizer = inner.tokenizer
        self.vocab_size = inner.vocab_size
        self.max_position = inner.max_position
        self.eos_token_ids = inner.eos_token_ids
        self.last_features: tuple[float, ...] | None = None

    def plan_kv_capacity(self, config: EngineConfig) -> KVCapacity:
        return self.inner.plan_kv_capacity(config)

    def allocate_kv_cache(self, config: EngineConfig, capacity: KVCapacity) -> None:
        self.inner.allocate_kv_cache(config, capacity)

    def execute(self, plan: SchedulerOutput) -> ModelOutput:
        self.last_features = step_features(plan) if plan.requests else None
        return self.inner.execute(plan)


class Calibrator:
    """One real engine, measured phase by phase."""

    def __init__(self, config: EngineConfig, executor: Executor | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        """`clock` times each step: wall time, what the engine serves at (a test on a shared
        machine may pass time.process_time: the engine's own CPU, whatever else runs)."""
        self.clock = clock
        if executor is None:
            from engine.executor import make_executor

            executor = make_executor(config)
        self.recorder = RecordingExecutor(executor)
        self.engine = LLMEngine(config, executor=self.recorder)
        self.prompts = PromptBuilder(self.recorder.vocab_size)
        self._ids = itertools.count()

    def run(self, phase: CalibrationPhase) -> list[Sample]:
        """Every step of one phase that ran the model, with its wall time."""
        engine = self.engine
        samples: list[Sample] = []
        pending = [self._add_args(p, o) for p, o in reversed(phase.lengths())]
        in_flight = 0
        while pending or in_flight:
            for _ in range(min(phase.admit(in_flight), len(pending))):
                engine.add_request(*pending.pop())
                in_flight += 1
            self.recorder.last_features = None
            started = self.clock()
            output = engine.step()
            elapsed = self.clock() - started
            in_flight -= len(output.finished)
            if self.recorder.last_features is not None:
                samples.append((self.recorder.last_features, elapsed))
        return samples

    def steps_of_one(self, prompt_tokens: int, output_tokens: int) -> list[float]:
        """The times of every step of one request alone, in order."""
        engine, times = self.engine, []
        engine.add_request(*self._add_args(prompt_tokens, output_tokens))
        while engine.has_unfinished():
            started = self.clock()
            engine.step()
            times.append(self.clock() - started)
        return times

    def _add_args(self, prompt_tokens: int,
                  output_tokens: int) -> tuple[str, list[int], SamplingParams]:
        index = next(self._ids)  # a fresh prompt every time: no prefix-cache hits
        trace = TraceRequest(0.0, prompt_tokens, output_tokens)
        params = SamplingParams(max_tokens=output_tokens, ignore_eos=True)
        return f"calibrate-{index}", self.prompts.build(index, trace), params


def nnls(a: np.ndarray, b: np.ndarray, tol: float = 1e-12) -> np.ndarray:
    """min ||a x - b|| subject to x >= 0 (Lawson and Hanson's active-set method)."""
    n = a.shape[1]
    passive = np.zeros(n, dtype=bool)
    x = np.zeros(n)
    gradient = a.T @ (b - a @ x)
    for _ in range(3 * n):
        candidates = np.where(passive, -np.inf, gradient)
        if passive.all() or candidates.max() <= tol:
            break
        passive[int(np.argmax(candidates))] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > tol).all():
                break
            negative = passive & (z <= tol)
            step = np.min(x[negative] / (x[negative] - z[negative]))
            x = x + step * (z - x)
            passive &= x > tol
        x = z
        gradient = a.T @ (b - a @ x)
    return x


def fit(samples: Sequence[Sample]) -> tuple[np.ndarray, dict[str, float]]:
    """Coefficients (seconds per unit of each feature) and the fit's quality on the steps it
    was fitted on. Each step is weighted by 1 / its time (relative error); steps the first fit
    misses by far (a GC pause, the OS taking the core) are dropped before the second."""
    x = np.array([f for f, _ in samples], dtype=float)  # [num_steps, num_features]
    y = np.array([t for _, t in samples], dtype=float)  # [num_steps]
    keep = np.ones(len(y), dtype=bool)
    for _ in range(2):
        coefficients = _relative_fit(x[keep], y[keep])
        relative = np.abs(x @ coefficients - y) / y
        keep = relative <= max(4 * float(np.median(relative)), 0.25)
    predicted = x @ coefficients
    relative = np.abs(predicted - y) / y
    quality = {"steps": len(y), "outliers_dropped": int((~keep).sum()),
               # R^2 of the steps the fit describes
               "r2": round(r_squared(y[keep], predicted[keep]), 4),
               "median_rel_error": round(float(np.median(relative)), 4),
               "p90_rel_error": round(float(percentile(relative, 90)), 4)}
    return coefficients, quality


def r_squared(measured: np.ndarray, predicted: np.ndarray) -> float:
    residual = float(np.sum((measured - predicted) ** 2))
    return 1 - residual / max(float(np.sum((measured - measured.mean()) ** 2)), 1e-30)


def _relative_fit(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    a = x / y[:, None]  # rows scaled by 1 / y: the residual is a relative error
    scale = np.linalg.norm(a, axis=0)
    scale[scale == 0] = 1.0  # a feature the phases never exercised: coefficient 0
    return nnls(a / scale, np.ones(len(y))) / scale


def calibrate(config: EngineConfig, design: Design | None = None, repeats: int = 3,
              max_phase_tokens: int = 4096, progress: Progress | None = None,
              after_round: Callable[[int], None] | None = None) -> SimProfile:
    """Measure the real engine under `config` over `design` (default: `default_design`),
    `repeats` rounds, fit a profile of it on the design's training phases and judge the fit on
    its held-out ones (the profile's `fit`: `r2`, `median_rel_error` and `p90_rel_error` of
    the held-out steps, `train_r2` and `train_median_rel_error` of the fitted ones).

    `after_round(i)` runs after round i (0-based) is measured: other work interleaved with the
    rounds, so a machine whose speed drifts over minutes drifts under both alike (what
    bench/sim_fidelity.py does with its replay)."""
    say = progress or (lambda _: None)
    say(f"loading {config.model} ...")
    calibrator = Calibrator(config)
    engine = calibrator.engine
    design = design or default_design(engine.config, calibrator.recorder.max_position,
                                      max_phase_tokens)
    calibrator.run(Phase(4, 64, 4))  # warm-up: first calls allocate and pick kernels
    with serving_heap(engine.config.max_num_seqs):  # the collector as `fairgate engine` has it
        rounds = measure(calibrator, design.phases, repeats, say, after_round)
        say(f"wake: {WAKE_PAIRS} pairs of one request, straight after work and after "
            f"{WAKE_IDLE_S:g} s idle ...")
        wake = measure_wake(calibrator, prompt_tokens=min(
            WAKE_PROMPT, engine.config.resolved_max_model_len - WAKE_STEPS))
    split = len(design.train)
    train = [round_[:split] for round_ in rounds]
    coefficients, in_sample = fit(median_over_rounds(train))
    scale = mean_scale(coefficients, train)
    coefficients = coefficients * scale
    held_out = evaluate(coefficients, median_over_rounds([r[split:] for r in rounds]))
    noise = step_noise(coefficients, rounds, say)
    quality = {"steps": in_sample["steps"], "held_out_steps": held_out["steps"],
               "outliers_dropped": in_sample["outliers_dropped"], "r2": held_out["r2"],
               "median_rel_error": held_out["median_rel_error"],
               "p90_rel_error": held_out["p90_rel_error"], "train_r2": in_sample["r2"],
               "train_median_rel_error": in_sample["median_rel_error"],
               "mean_scale": round(scale, 4)}
    say(f"fit over {quality['steps']} steps (R^2 {in_sample['r2']:.3f}, median relative error "
        f"{in_sample['median_rel_error']:.1%}), scaled x{scale:.3f} to a round's total; on "
        f"{quality['held_out_steps']} held-out steps: R^2 {quality['r2']:.3f}, median relative "
        f"error {quality['median_rel_error']:.1%}, p90 {quality['p90_rel_error']:.1%}")
    say(f"step noise: {noise.describe()}")
    say(f"wake: {wake.describe()} ({WAKE_PAIRS} pairs)")
    return _profile(config, engine, coefficients, quality, noise, wake)


def measure_wake(calibrator: Calibrator, idle_s: float = WAKE_IDLE_S, pairs: int = WAKE_PAIRS,
                 prompt_tokens: int = WAKE_PROMPT, steps: int = WAKE_STEPS,
                 sleep: Callable[[float], None] = time.sleep) -> Wake:
    """What the first `steps` steps of a request cost after `idle_s` of idle beyond the same
    steps straight after other work: `pairs` times one request right after the last, then the
    same request after `sleep(idle_s)`; step by step, the median after idle minus the median
    straight after (never below 0). A request before each straight one, not measured, takes
    the steps that still carry the last idle's wake."""
    straight: list[list[float]] = []
    after_idle: list[list[float]] = []
    for _ in range(pairs):
        calibrator.steps_of_one(prompt_tokens, steps)
        straight.append(calibrator.steps_of_one(prompt_tokens, steps))
        sleep(idle_s)
        after_idle.append(calibrator.steps_of_one(prompt_tokens, steps))
    count = min(steps, *(len(t) for t in straight + after_idle))
    extra = [max(0.0, float(np.median([t[k] for t in after_idle]))
                 - float(np.median([t[k] for t in straight]))) for k in range(count)]
    return Wake(idle_s, tuple(round(e, 6) for e in extra))


def measure(calibrator: Calibrator, phases: Sequence[CalibrationPhase], repeats: int,
            say: Progress, after_round: Callable[[int], None] | None = None,
            ) -> list[list[list[Sample]]]:
    """round -> phase -> steps: every phase once a round, `repeats` rounds; `after_round(i)`
    after round i."""
    rounds: list[list[list[Sample]]] = []
    started = time.perf_counter()
    for round_ in range(repeats):
        rounds.append([])
        for i, phase in enumerate(phases, 1):
            rounds[-1].append(calibrator.run(phase))
            say(f"round {round_ + 1}/{repeats}, phase {i}/{len(phases)} ({phase.describe()}): "
                f"{sum(map(len, rounds[-1]))} steps, {time.perf_counter() - started:.1f} s")
        if after_round is not None:
            after_round(round_)
    return rounds


def step_noise(coefficients: np.ndarray, rounds: Sequence[Sequence[Sequence[Sample]]],
               say: Progress | None = None) -> StepNoise:
    """Every measured step's time over what that step costs on an even machine, round after
    round and phase after phase in the order they ran (the phases run back to back, so a slow
    stretch of the machine spans them), as the profile's `StepNoise`. Raw times, not the
    median over rounds: the unevenness is what it records.

    What a step costs on an even machine is the median of its rounds' times, when there are
    three or more and the phase ran the same plans in each (the scheduler is deterministic, so
    it does unless the KV cache ran differently); otherwise the fit's prediction. Against the
    prediction alone, the fit's own misses (a shape of step it reads 20% short, every round)
    would count as unevenness: runs of them, as correlated as the phase's steps, which the
    simulator would then replay at random places (on 2026-12-05 they made the noise's lag-1
    autocorrelation 0.8 and its p99 1.6, and the simulated p99s read 25-50% high).

    A round that another process disturbed (`disturbed_rounds`) is left out, as the median
    over rounds leaves it out of the fit; `say` names it."""
    typical = [median_times(runs) if len(runs) >= 3 else None
               for runs in zip(*rounds, strict=True)]  # one phase, every round
    per_round: list[list[float]] = []
    for round_ in rounds:
        per_round.append([])
        for run, medians in zip(round_, typical, strict=True):
            for j, (features, elapsed) in enumerate(run):
                expected = medians[j] if medians is not None else float(np.dot(features, coefficients))
                if expected > 0:
                    per_round[-1].append(elapsed / expected)
    p99s = [percentile(r, 99) if r else 1.0 for r in per_round]
    left_out = disturbed_rounds(p99s)
    if left_out and say is not None:
        say("step noise: " + "; ".join(
            f"round {i + 1} left out, disturbed (its p99 step ran {p99s[i]:.2f}x the step's "
            f"median over the rounds, the typical round's {np.median(p99s):.2f}x)"
            for i in left_out))
    kept = [r for i, round_ratios in enumerate(per_round) if i not in left_out for r in round_ratios]
    return StepNoise.measured(kept or [1.0])


def disturbed_rounds(p99s: Sequence[float], tolerance: float = DISTURBED_ROUND) -> list[int]:
    """The rounds (0-based) whose p99 step ratio (`p99s`, one a round) is above `tolerance`
    times the median round's, given three or more rounds: on a calm machine the rounds' p99s
    lie within about 10% of each other (1.06-1.17 on 2026-12-05), and a round that another
    process shared the cores with reads far above them. Its slow stretches are that process's,
    not the engine's."""
    if len(p99s) < 3:
        return []
    limit = tolerance * float(np.median(p99s))
    return [i for i, p99 in enumerate(p99s) if p99 > limit]


def check_fit(fit: dict[str, float], min_r2: float = MIN_R2,
              max_median_error: float = MAX_MEDIAN_ERROR) -> str | None:
    """Why a profile with this `fit` should not be used (held-out R^2 below `min_r2` or median
    relative error above `max_median_error`), or None when it fits well."""
    r2, error = fit.get("r2", float("nan")), fit.get("median_rel_error", float("nan"))
    if r2 >= min_r2 and error <= max_median_error:  # NaN (a fit not reported) fails
        return None
    return (f"the fit is poor: held-out R^2 {r2:.3f} (at least {min_r2:g} needed), median "
            f"relative step error {error:.1%} (at most {max_median_error:.0%})")


def mean_scale(coefficients: np.ndarray, rounds: Sequence[Sequence[Sequence[Sample]]]) -> float:
    """The measured total of a round's steps over what the fit predicts for them (nothing
    dropped), the median over the rounds. The fit follows the typical step (medians, outliers
    out), so it is robust to a noisy round; but a request's TPOT is the mean of its steps,
    pauses and interference included, which the real engine pays too. Scaling the coefficients
    by this keeps the shape of the fit and makes its total right; the median over rounds keeps
    one round that another process slowed throughout from scaling the whole profile. Bounded
    to [0.5, 2]: beyond that the calibration was disturbed."""
    ratios = []
    for round_ in rounds:
        samples = [s for run in round_ for s in run]
        x = np.array([f for f, _ in samples], dtype=float).reshape(len(samples), -1)
        predicted = float((x @ coefficients).sum()) if len(samples) else 0.0
        if predicted > 0:
            ratios.append(sum(t for _, t in samples) / predicted)
    return min(max(float(np.median(ratios)), 0.5), 2.0) if ratios else 1.0


def median_over_rounds(rounds: Sequence[Sequence[Sequence[Sample]]]) -> list[Sample]:
    """One sample per step of each phase, its time the median over the rounds. The scheduler is
    deterministic, so a phase runs the same plans every round; the median drops a round that
    another process slowed down. A phase whose rounds differ keeps every round's steps."""
    merged: list[Sample] = []
    for runs in zip(*rounds, strict=True):  # one phase, every round
        times = median_times(runs)
        if times is None:
            merged += [s for run in runs for s in run]
        else:
            merged += list(zip([f for f, _ in runs[0]], times, strict=True))
    return merged


def median_times(runs: Sequence[Sequence[Sample]]) -> list[float] | None:
    """Each step's median time over `runs` (one phase's rounds), or None when the rounds ran
    different plans (their steps' features differ)."""
    features = [[f for f, _ in run] for run in runs]
    if any(f != features[0] for f in features):
        return None
    return np.median(np.array([[t for _, t in run] for run in runs]), axis=0).tolist()


def _profile(config: EngineConfig, engine: LLMEngine, coefficients: np.ndarray,
             quality: dict[str, float], noise: StepNoise | None = None,
             wake: Wake | None = None) -> SimProfile:
    capacity, block_size = engine.capacity, engine.config.block_size
    inner = engine.executor.inner if isinstance(engine.executor, RecordingExecutor) else None
    device, dtype = getattr(inner, "device", config.device), getattr(inner, "dtype", config.dtype)
    return SimProfile(
        coefficients={name: float(c) for name, c in zip(FEATURES, coefficients, strict=True)},
        kv_tokens=capacity.num_blocks * block_size,
        kv_bytes_per_token=max(1, capacity.bytes_per_block // block_size),
        max_position=engine.executor.max_position, model=config.model,
        device=str(device), dtype=str(dtype).removeprefix("torch."), fit=quality,
        calibration={k: v for k, v in config.to_dict().items() if v != getattr(
            EngineConfig(), k)}, noise=noise, wake=wake)


def evaluate(model: SimProfile | np.ndarray, samples: Sequence[Sample]) -> dict[str, float]:
    """How well `model` (a profile, or coefficients in `FEATURES` order) predicts measured
    steps it was not fitted on: R^2 and the median and p90 relative error, nothing dropped."""
    weights = np.asarray(model.weights if isinstance(model, SimProfile) else model, dtype=float)
    x = np.array([f for f, _ in samples], dtype=float).reshape(len(samples), len(weights))
    y = np.array([t for _, t in samples], dtype=float)
    if not len(y):
        return {"steps": 0, "r2": float("nan"), "median_rel_error": float("nan"),
                "p90_rel_error": float("nan")}
    predicted = x @ weights
    relative = np.abs(predicted - y) / y
    return {"steps": len(y), "r2": round(r_squared(y, predicted), 4),
            "median_rel_error": round(float(np.median(relative)), 4),
            "p90_rel_error": round(float(percentile(relative, 90)), 4)}
