"""Calibration: fit the simulated executor's step times to the real engine.

`calibrate(config)` runs the real engine (`TorchExecutor`, whatever `config` says) over a designed
set of phases: `batch` requests of `prompt_tokens` each, added at once (a batched prefill, then
decodes of that batch at that context) or one per step (`staggered`: prefill chunks beside a
growing decode batch, the mixed steps of live serving). Every step's wall time (schedule, forward
pass, sampling, update: what the real-time replay and the sim's virtual clock both count) is
paired with its plan's `step_features`; the phases run several rounds and each step keeps the
median of its rounds' times (another process on the machine slows one round, not all). A
non-negative least-squares fit, relative to each step's time so short decode steps count as much
as long prefills, gives the coefficients of a `SimProfile` (engine/sim_profile.py).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from engine.config import EngineConfig
from engine.executor import Executor, KVCapacity, ModelOutput
from engine.llm_engine import LLMEngine
from engine.request import SamplingParams
from engine.scheduler import SchedulerOutput
from engine.sim_profile import FEATURES, SimProfile, step_features
from tuner.simulate import PromptBuilder
from tuner.traces import TraceRequest

Progress = Callable[[str], None]
Sample = tuple[tuple[float, ...], float]  # (step features, measured seconds)


@dataclass(frozen=True)
class Phase:
    batch: int  # requests in the phase
    prompt_tokens: int
    output_tokens: int = 16
    staggered: bool = False  # add one request per step instead of all at once


def default_phases(config: EngineConfig, max_position: int,
                   max_phase_tokens: int = 8192) -> list[Phase]:
    """Batches of 1 to max_num_seqs requests at contexts of 16 to 1,024 tokens (within
    max_model_len), at once and staggered, each phase at most `max_phase_tokens` of prompt:
    a few hundred steps, seconds on a CPU with random:tiny."""
    limit = min(config.max_model_len or max_position, max_position)
    prompts = sorted({p for p in (16, 128, 512, 1024) if p + 24 <= limit} or {limit // 2})
    batches = sorted({min(b, config.max_num_seqs) for b in (1, 4, 16, 32)})
    phases = [Phase(b, p) for b in batches for p in prompts if b * p <= max_phase_tokens]
    for p in prompts:
        batch = max(1, min(max(batches), max_phase_tokens // p))
        phases.append(Phase(batch, p, output_tokens=24, staggered=True))
    return phases


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

    def run(self, phase: Phase) -> list[Sample]:
        """Every step of one phase that ran the model, with its wall time."""
        engine = self.engine
        samples: list[Sample] = []
        pending = [self._add_args(phase) for _ in range(phase.batch)]
        if not phase.staggered:
            for args in pending:
                engine.add_request(*args)
            pending = []
        while pending or engine.has_unfinished():
            if pending:
                engine.add_request(*pending.pop())
            self.recorder.last_features = None
            started = self.clock()
            engine.step()
            elapsed = self.clock() - started
            if self.recorder.last_features is not None:
                samples.append((self.recorder.last_features, elapsed))
        return samples

    def _add_args(self, phase: Phase) -> tuple[str, list[int], SamplingParams]:
        index = next(self._ids)  # a fresh prompt every time: no prefix-cache hits
        trace = TraceRequest(0.0, phase.prompt_tokens, phase.output_tokens)
        params = SamplingParams(max_tokens=phase.output_tokens, ignore_eos=True)
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
    """Coefficients (seconds per unit of each feature) and the fit's quality. Each step is
    weighted by 1 / its time (relative error); steps the first fit misses by far (a GC pause,
    the OS taking the core) are dropped before the second."""
    x = np.array([f for f, _ in samples], dtype=float)  # [num_steps, num_features]
    y = np.array([t for _, t in samples], dtype=float)  # [num_steps]
    keep = np.ones(len(y), dtype=bool)
    for _ in range(2):
        coefficients = _relative_fit(x[keep], y[keep])
        relative = np.abs(x @ coefficients - y) / y
        keep = relative <= max(4 * float(np.median(relative)), 0.25)
    predicted = x @ coefficients
    relative = np.abs(predicted - y) / y
    kept_y, kept_predicted = y[keep], predicted[keep]  # R^2 of the steps the fit describes
    r2 = 1 - float(np.sum((kept_y - kept_predicted) ** 2)
                   / max(np.sum((kept_y - kept_y.mean()) ** 2), 1e-30))
    quality = {"steps": len(y), "outliers_dropped": int((~keep).sum()), "r2": round(r2, 4),
               "median_rel_error": round(float(np.median(relative)), 4),
               "p90_rel_error": round(float(np.percentile(relative, 90)), 4)}
    return coefficients, quality


def _relative_fit(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    a = x / y[:, None]  # rows scaled by 1 / y: the residual is a relative error
    scale = np.linalg.norm(a, axis=0)
    scale[scale == 0] = 1.0  # a feature the phases never exercised: coefficient 0
    return nnls(a / scale, np.ones(len(y))) / scale


def calibrate(config: EngineConfig, phases: Sequence[Phase] | None = None, repeats: int = 3,
              max_phase_tokens: int = 8192, progress: Progress | None = None) -> SimProfile:
    """Measure the real engine under `config` over `phases` (default: `default_phases`),
    `repeats` rounds, and fit a profile of it."""
    say = progress or (lambda _: None)
    say(f"loading {config.model} ...")
    calibrator = Calibrator(config)
    engine = calibrator.engine
    phases = list(phases or default_phases(engine.config, calibrator.recorder.max_position,
                                           max_phase_tokens))
    calibrator.run(Phase(4, 64, 4))  # warm-up: first calls allocate and pick kernels
    rounds: list[list[list[Sample]]] = []  # round -> phase -> steps
    started = time.perf_counter()
    for round_ in range(repeats):
        rounds.append([])
        for i, phase in enumerate(phases, 1):
            rounds[-1].append(calibrator.run(phase))
            say(f"round {round_ + 1}/{repeats}, phase {i}/{len(phases)} ({phase.batch} x "
                f"{phase.prompt_tokens} tokens{', staggered' if phase.staggered else ''}): "
                f"{sum(map(len, rounds[-1]))} steps, {time.perf_counter() - started:.1f} s")
    coefficients, quality = fit(median_over_rounds(rounds))
    scale = mean_scale(coefficients, [s for round_ in rounds for run in round_ for s in run])
    coefficients, quality = coefficients * scale, {**quality, "mean_scale": round(scale, 4)}
    say(f"fit over {quality['steps']} steps: R^2 {quality['r2']:.3f}, median relative error "
        f"{quality['median_rel_error']:.1%}, p90 {quality['p90_rel_error']:.1%}; scaled "
        f"x{scale:.3f} to the steps' mean")
    return _profile(config, engine, coefficients, quality)


def mean_scale(coefficients: np.ndarray, samples: Sequence[Sample]) -> float:
    """The every-step total over what the fit predicts for it (every round, nothing dropped).
    The fit follows the typical step (medians, outliers out), so it is robust to a noisy
    round; but a request's TPOT is the mean of its steps, pauses and interference included,
    which the real engine pays too. Scaling the coefficients by this keeps the shape of the fit
    and makes its total right. Bounded to [0.5, 2]: beyond that the calibration was disturbed."""
    x = np.array([f for f, _ in samples], dtype=float)
    y = np.array([t for _, t in samples], dtype=float)
    predicted = float((x @ coefficients).sum())
    return min(max(float(y.sum()) / predicted, 0.5), 2.0) if predicted > 0 else 1.0


def median_over_rounds(rounds: Sequence[Sequence[Sequence[Sample]]]) -> list[Sample]:
    """One sample per step of each phase, its time the median over the rounds. The scheduler is
    deterministic, so a phase runs the same plans every round; the median drops a round that
    another process slowed down. A phase whose rounds differ keeps every round's steps."""
    merged: list[Sample] = []
    for runs in zip(*rounds, strict=True):  # one phase, every round
        features = [[f for f, _ in run] for run in runs]
        if any(f != features[0] for f in features):
            merged += [s for run in runs for s in run]
            continue
        times = np.median(np.array([[t for _, t in run] for run in runs]), axis=0)
        merged += list(zip(features[0], times.tolist(), strict=True))
    return merged


def _profile(config: EngineConfig, engine: LLMEngine, coefficients: np.ndarray,
             quality: dict[str, float]) -> SimProfile:
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
            EngineConfig(), k)})


def evaluate(profile: SimProfile, samples: Sequence[Sample]) -> dict[str, float]:
    """How well `profile` predicts measured steps it was not fitted on."""
    relative = sorted(abs(profile.predict(f) - t) / t for f, t in samples)
    return {"steps": len(relative), "median_rel_error": float(np.median(relative)),
            "p90_rel_error": float(np.percentile(relative, 90))}
