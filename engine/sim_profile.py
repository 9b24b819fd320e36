"""A calibrated cost model: step times fitted to the real engine's measured steps.

`fairgate tune calibrate` (tuner/calibrate.py) runs the real engine over a designed set of step
shapes, measures each whole step (schedule, forward pass, sampling, update) and fits the
non-negative coefficients of `FEATURES`; the `sim_profile` knob points the simulated executor at
the file it writes, and the executor then models a step as the fitted sum instead of the
roofline of engine/sim.py. The profile YAML::

    version: 1
    model: random:tiny            # what was measured, on which device and dtype
    device: cpu
    dtype: float32
    max_position: 4096            # the model's context: the sim resolves max_model_len from it
    kv_tokens: 937264             # the real engine's KV cache (blocks x block_size), see below
    kv_bytes_per_token: 4096
    coefficients:                 # seconds per unit of each feature (one missing: 0)
      step: 0.0012
      tokens: 6.1e-05
      ...
    fit: {steps: 812, held_out_steps: 90, r2: 0.98, median_rel_error: 0.05, ...}
    calibration: {max_num_seqs: 32, ...}   # the knobs it ran under
    noise:                        # optional: how uneven the measured steps were, see below
      block: 256
      ratios: [0.97, 1.02, 0.91, ...]
    wake:                         # optional: what the first steps after idle cost, see below
      idle_s: 0.2
      extra_s: [0.0021, 0.0006, 0.0003, 0.0001]

`fit` is the calibration's report: `r2`, `median_rel_error` and `p90_rel_error` of the fitted
model on steps it was not fitted on (`held_out_steps` of them), `train_r2` and
`train_median_rel_error` on the `steps` it was fitted on, `mean_scale` (tuner/calibrate.py).

Memory: the sim serves with the KV cache the real engine had under the calibration config
(`kv_tokens`, re-cut into blocks of the running config's `block_size`); `num_kv_blocks` still
overrides it. The other memory knobs (`memory_fraction`, `device_memory_gb`) do not change it, so
calibrate under the memory settings the simulation should reproduce.

Noise: a real engine's steps are uneven, and unevenly in stretches (a core shared with another
process, the CPU's clock, the caches): on a 2-core VM the calibration's measured over predicted
step times ran p10 0.89, p90 1.21, p99 1.53, with a lag-1 autocorrelation of 0.54 that was still
0.07 a hundred steps on. A simulator that gives every step of one shape the same time gets the
p50s right and reads the p99s low (bench/RESULTS.md, issue 24). `noise.ratios` are the
calibration's own step times over what each step costs on an even machine (the median of its
rounds' times; the fit's prediction where a phase's rounds ran other plans, so the fit's own
misses are not counted as unevenness; a round another process disturbed left out), in the
order they ran, scaled to a mean of 1 (so the coefficients still set the total); the sim
executor multiplies each step's time by the next ratio of a circular block bootstrap over them
(`StepNoise.stream`: runs of `block` consecutive ratios from random starts, seeded by the
engine's `seed`), which keeps both their spread and their stretches. A profile without
`noise` simulates every step at its predicted time.

Wake: the calibration runs its steps back to back, but a server is often idle between requests,
and the first steps after an idle spell run slower (caches and the CPU gone cold: on a 2-core
VM a 64-token prefill took 6.4 ms straight after other work and 8.6 ms after 0.2 s of nothing,
the two decodes after it +25% and +13%). Those are the steps a request that arrives at a quiet
engine waits for, so without them the simulator read TTFT p50 5-11% low in every fidelity run.
`wake.extra_s[k]` is what the calibration measured the k-th step after `wake.idle_s` of idle
to cost beyond the same step straight after work (medians of paired runs); the sim executor
adds it to the steps after each idle spell, in proportion to the spell up to `idle_s`.
"""

from __future__ import annotations

import functools
import itertools
import math
import os
import random
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from engine.executor import KVCapacity
from protocol.yaml_files import load_yaml

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.scheduler import SchedulerOutput

PROFILE_VERSION = 1
GIB = 1 << 30
# what one step costs on a CPU/GPU engine: a fixed part, per-token matmuls, per-request
# bookkeeping, the logits and sampling of each sampled row, the Python loop over prefills, and
# attention: prefills over their causal context, decodes batched and padded to the longest one.
# A prefill chunk can cost more than its causal part: an attention that computes the whole
# masked rectangle of chunk x context (the CPU reference: the causal part plus chunk^2 / 2) and
# gathers the chunk's whole cached context each step (`prefill_context`); the last two let the
# fit see that a chunk late in a long prompt costs more than a fresh prefill of its size.
FEATURES = ("step", "tokens", "seqs", "sampled", "prefills", "prefill_attention",
            "decode_attention", "prefill_square", "prefill_context")


def step_features(plan: SchedulerOutput) -> tuple[float, ...]:
    """The values of `FEATURES` for one plan, in that order."""
    sampled = prefills = 0
    prefill_attention = prefill_square = prefill_context = 0.0
    decode_contexts: list[int] = []
    for scheduled in plan.requests:
        end = scheduled.start + scheduled.num_tokens
        sampled += scheduled.samples
        if scheduled.num_tokens == 1:
            decode_contexts.append(end)
        else:
            prefills += 1
            prefill_attention += scheduled.num_tokens * (scheduled.start + end) / 2
            prefill_square += scheduled.num_tokens**2
            prefill_context += end
    decode_attention = len(decode_contexts) * max(decode_contexts, default=0)
    return (1.0, float(plan.num_batched_tokens), float(len(plan.requests)), float(sampled),
            float(prefills), prefill_attention, float(decode_attention), prefill_square,
            prefill_context)


NOISE_BLOCK = 256  # steps: the measured stretches were still correlated 100 steps on
WAKE_MIN_IDLE_S = 1e-3  # a gap between steps shorter than this is the engine's own loop, not idle
MAX_WAKE_STEPS = 16


@dataclass(frozen=True)
class StepNoise:
    """Measured over predicted step times, in the order they were measured (see the module
    docstring); replayed in blocks of `block` consecutive ratios."""

    ratios: tuple[float, ...]
    block: int = NOISE_BLOCK

    def __post_init__(self) -> None:
        if not self.ratios:
            raise ValueError("noise.ratios is empty; recalibrate, or delete `noise`")
        if not all(_finite(r) and r > 0 for r in self.ratios):
            raise ValueError("noise.ratios must all be numbers > 0")
        if isinstance(self.block, bool) or not isinstance(self.block, int) or self.block < 1:
            raise ValueError(f"noise.block must be a positive integer, got {self.block!r}")

    @classmethod
    def measured(cls, ratios: Sequence[float], block: int = NOISE_BLOCK) -> StepNoise:
        """From raw measured / predicted ratios: clipped to [1/4, 4] (a step stalled 10x is a
        disturbed calibration, not the engine) and scaled to a mean of 1."""
        clipped = [min(max(float(r), 0.25), 4.0) for r in ratios]
        mean = sum(clipped) / len(clipped) if clipped else 1.0
        return cls(tuple(round(r / mean, 4) for r in clipped), block)

    def stream(self, seed: int) -> Iterator[float]:
        """An endless circular block bootstrap of `ratios`: `block` consecutive ratios (wrapping
        at the end) from a start drawn by a generator seeded with `seed`, then another block."""
        rng, ratios = random.Random(seed), self.ratios
        while True:
            start = rng.randrange(len(ratios))
            for i in range(start, start + self.block):
                yield ratios[i % len(ratios)]

    def summary(self) -> dict[str, float]:
        """The ratios' spread and stretches, for a listing (the gateway's GET
        /admin/sim-profiles) and for `describe`."""
        ordered = sorted(self.ratios)
        at = {f"p{round(q * 100)}": ordered[min(int(q * len(ordered)), len(ordered) - 1)]
              for q in (0.1, 0.5, 0.9, 0.99)}
        return {"steps": len(ordered), "block": self.block, **at,
                "lag1_autocorrelation": round(lag_one_autocorrelation(self.ratios), 4)}

    def describe(self) -> str:
        s = self.summary()
        return (f"measured / predicted step time over {s['steps']} steps: p10 {s['p10']:.2f}, "
                f"p50 {s['p50']:.2f}, p90 {s['p90']:.2f}, p99 {s['p99']:.2f}, lag-1 "
                f"autocorrelation {s['lag1_autocorrelation']:.2f}")


@dataclass(frozen=True)
class Wake:
    """What the first steps after an idle spell cost beyond their predicted time (see the
    module docstring): `extra_s[k]` seconds for the k-th step after `idle_s` of idle."""

    idle_s: float
    extra_s: tuple[float, ...]

    def __post_init__(self) -> None:
        if not (_finite(self.idle_s) and self.idle_s > 0):
            raise ValueError(f"wake.idle_s must be a number > 0, got {self.idle_s!r}")
        if not 1 <= len(self.extra_s) <= MAX_WAKE_STEPS:
            raise ValueError(f"wake.extra_s must list 1 to {MAX_WAKE_STEPS} steps' extra seconds")
        if not all(_finite(e) and e >= 0 for e in self.extra_s):
            raise ValueError("wake.extra_s must all be numbers >= 0")

    def extra(self, step: int, idle_s: float) -> float:
        """Seconds added to the `step`-th step (0: the first) after `idle_s` of idle."""
        if step >= len(self.extra_s):
            return 0.0
        return self.extra_s[step] * min(1.0, idle_s / self.idle_s)

    def to_dict(self) -> dict[str, Any]:
        return {"idle_s": self.idle_s, "extra_s": list(self.extra_s)}

    def describe(self) -> str:
        steps = ", ".join(f"{e * 1e3:.2f}" for e in self.extra_s)
        return f"after {self.idle_s:g} s idle, the first steps take +[{steps}] ms"


def _finite(value: Any) -> bool:
    """A real number, not a bool, not NaN or infinite (YAML's .inf and .nan load as floats)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def lag_one_autocorrelation(values: Sequence[float]) -> float:
    """How much one value predicts the next (0 for independent values, 1 for one level)."""
    if len(values) < 3:
        return 0.0
    mean = sum(values) / len(values)
    centred = [v - mean for v in values]
    variance = sum(c * c for c in centred)
    if variance == 0:
        return 0.0
    return sum(a * b for a, b in itertools.pairwise(centred)) / variance


@dataclass(frozen=True)
class SimProfile:
    coefficients: dict[str, float]  # feature -> seconds per unit
    kv_tokens: int
    kv_bytes_per_token: int
    max_position: int
    model: str = ""
    device: str = ""
    dtype: str = ""
    fit: dict[str, float] = field(default_factory=dict)
    calibration: dict[str, Any] = field(default_factory=dict)
    noise: StepNoise | None = None
    wake: Wake | None = None

    def __post_init__(self) -> None:
        unknown = sorted(set(self.coefficients) - set(FEATURES))
        if unknown:
            raise ValueError(f"unknown coefficient(s) {', '.join(unknown)}; features are: "
                             f"{', '.join(FEATURES)}")
        for name, value in self.coefficients.items():
            if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
                raise ValueError(f"coefficient {name} must be a number >= 0, got {value!r}")
        for name in ("kv_tokens", "kv_bytes_per_token", "max_position"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

    @property
    def weights(self) -> tuple[float, ...]:
        return tuple(float(self.coefficients.get(name, 0.0)) for name in FEATURES)

    def predict(self, features: Sequence[float]) -> float:
        return sum(w * x for w, x in zip(self.weights, features, strict=True))

    # the cost-model interface SimExecutor uses (engine/sim.py's CostModel has the same two)
    def step_time(self, plan: SchedulerOutput) -> float:
        return self.predict(step_features(plan))

    def kv_capacity(self, config: EngineConfig) -> KVCapacity:
        bytes_per_block = self.kv_bytes_per_token * config.block_size
        num_host = int(config.swap_space_gb * GIB // bytes_per_block)
        if config.num_kv_blocks is not None:
            return KVCapacity(config.num_kv_blocks, num_host, bytes_per_block)
        num_blocks = self.kv_tokens // config.block_size
        if num_blocks * config.block_size < config.resolved_max_model_len:
            raise ValueError(
                f"out of memory: the profiled engine's KV cache ({self.kv_tokens} tokens, "
                f"sim_profile) holds fewer than one max_model_len "
                f"({config.resolved_max_model_len}) request; lower max_model_len, set "
                "num_kv_blocks, or calibrate with more device memory")
        return KVCapacity(num_blocks, num_host, bytes_per_block)

    def to_dict(self) -> dict[str, Any]:
        return {"version": PROFILE_VERSION, "model": self.model, "device": self.device,
                "dtype": self.dtype, "max_position": self.max_position,
                "kv_tokens": self.kv_tokens, "kv_bytes_per_token": self.kv_bytes_per_token,
                "coefficients": {k: float(self.coefficients.get(k, 0.0)) for k in FEATURES},
                "fit": dict(self.fit), "calibration": dict(self.calibration),
                **({"wake": self.wake.to_dict()} if self.wake is not None else {}),
                **({"noise": {"block": self.noise.block, "ratios": list(self.noise.ratios)}}
                   if self.noise is not None else {})}

    @classmethod
    def from_dict(cls, data: Any) -> SimProfile:
        if not isinstance(data, dict) or not isinstance(data.get("coefficients"), dict):
            raise ValueError("not a calibration profile (a mapping with `coefficients`); "
                             "write one with `fairgate tune calibrate`")
        if data.get("version") != PROFILE_VERSION:
            raise ValueError(f"profile version {data.get('version')!r} is not "
                             f"{PROFILE_VERSION}; recalibrate")
        missing = [k for k in ("kv_tokens", "kv_bytes_per_token", "max_position") if k not in data]
        if missing:
            raise ValueError(f"the profile lacks {', '.join(missing)}")
        noise = data.get("noise")
        if noise is not None and (not isinstance(noise, dict)
                                  or not isinstance(noise.get("ratios"), list)):
            raise ValueError("noise must be a mapping with a list `ratios`")
        wake = data.get("wake")
        if wake is not None and (not isinstance(wake, dict) or set(wake) != {"idle_s", "extra_s"}
                                 or not isinstance(wake["extra_s"], list)):
            raise ValueError("wake must be a mapping with `idle_s` and a list `extra_s`")
        return cls(coefficients=dict(data["coefficients"]), kv_tokens=data["kv_tokens"],
                   kv_bytes_per_token=data["kv_bytes_per_token"],
                   max_position=data["max_position"], model=str(data.get("model", "")),
                   device=str(data.get("device", "")), dtype=str(data.get("dtype", "")),
                   fit=dict(data.get("fit") or {}),
                   calibration=dict(data.get("calibration") or {}),
                   noise=None if noise is None else StepNoise(
                       tuple(noise["ratios"]), noise.get("block", NOISE_BLOCK)),
                   wake=None if wake is None else Wake(wake["idle_s"], tuple(wake["extra_s"])))


def load_profile(path: str | os.PathLike[str]) -> SimProfile:
    """The profile at `path`; ValueError naming the file when it is missing or malformed."""
    path = Path(path)
    try:
        stat = path.stat()
    except OSError as exc:
        raise ValueError(f"{path}: cannot read the profile ({exc.strerror})") from None
    # configs are rebuilt often (every tuner trial validates its knobs): read a file once
    return _load(str(path.resolve()), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=16)
def _load(path: str, mtime_ns: int, size: int) -> SimProfile:
    try:
        data = load_yaml(path)  # YamlError names the file and the line itself
    except OSError as exc:
        raise ValueError(f"{path}: {exc}") from None
    try:
        return SimProfile.from_dict(data)
    except (ValueError, TypeError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ValueError(f"{path}: {reason}") from None


def profile_text(profile: SimProfile) -> str:
    """The profile's YAML, as `save_profile` writes it and `load_profile` reads it."""
    data = profile.to_dict()
    noise = data.pop("noise", None)
    text = yaml.safe_dump(data, sort_keys=False)
    if noise is not None:  # thousands of ratios: a wrapped flow list, not a line each
        text += yaml.safe_dump({"noise": noise}, sort_keys=False, default_flow_style=None,
                               width=100)
    return text


def save_profile(profile: SimProfile, path: str | os.PathLike[str]) -> None:
    """Write atomically: a temporary file beside `path`, then os.replace, so a reader never
    sees half a profile."""
    path = Path(path)
    text = profile_text(profile)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent or ".")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(text)
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600; a profile is no secret
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
