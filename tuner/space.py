"""The search space of `fairgate tune`: which engine knobs vary, over what, and which
combinations are known to be impossible before a trial runs.

A space file (`--space space.yaml`) maps engine knobs (vLLM's names, as in `EngineConfig`) to a
range or a list of choices::

    max_num_batched_tokens: {low: 256, high: 16384, log: true}
    max_num_seqs: {low: 8, high: 512, step: 8}
    memory_fraction: {low: 0.7, high: 0.95}
    policy: {choices: [fcfs, sjf]}

Without a file the space is `default_space(base)`: the token budget, max_num_seqs, max_model_len
and memory_fraction, each range widened to hold the base config's own value (the base config is
the study's first trial).

`build_config` is the before-running check: the base config with a trial's knobs on top goes
through `EngineConfig`'s own validation (max_num_batched_tokens >= max_num_seqs, ...) and the
model's context length. Chunked prefill is always on in this engine (a prompt longer than the
token budget is scheduled in chunks), so max_num_batched_tokens < max_model_len is allowed.
The study tells Optuna such a trial is infeasible without running it (see `tuner.study`).
"""

from __future__ import annotations

import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna

from engine.config import KNOBS, EngineConfig
from engine.presets import model_preset
from protocol.validators import check_bool, check_known_keys, check_number, check_positive_int
from protocol.yaml_files import load_yaml

# what a trial may not vary: which model runs, and on what
FIXED_KNOBS = ("model", "executor", "device", "sim_clock")
TUNABLE_KNOBS = tuple(k for k in KNOBS if k not in FIXED_KNOBS)
RANGE_KEYS = ("low", "high", "log", "step")


@dataclass(frozen=True)
class IntRange:
    low: int
    high: int
    log: bool = False
    step: int = 1

    def suggest(self, trial: optuna.Trial, name: str) -> int:
        return trial.suggest_int(name, self.low, self.high, log=self.log, step=self.step)

    def describe(self) -> str:
        return f"{self.low}..{self.high}" + (" log" if self.log else "") + (
            f" step {self.step}" if self.step != 1 else "")


@dataclass(frozen=True)
class FloatRange:
    low: float
    high: float
    log: bool = False
    step: float | None = None

    def suggest(self, trial: optuna.Trial, name: str) -> float:
        return trial.suggest_float(name, self.low, self.high, log=self.log, step=self.step)

    def describe(self) -> str:
        return f"{self.low:g}..{self.high:g}" + (" log" if self.log else "") + (
            f" step {self.step:g}" if self.step is not None else "")


@dataclass(frozen=True)
class Choices:
    values: tuple[Any, ...]

    def suggest(self, trial: optuna.Trial, name: str) -> Any:
        return trial.suggest_categorical(name, self.values)

    def describe(self) -> str:
        return "{" + ", ".join(map(str, self.values)) + "}"


Dimension = IntRange | FloatRange | Choices


@dataclass(frozen=True)
class Space(Mapping[str, Dimension]):
    """knob -> dimension, in the order the knobs are suggested."""

    dimensions: tuple[tuple[str, Dimension], ...]

    def __post_init__(self) -> None:
        if not self.dimensions:
            raise ValueError("the search space is empty: name at least one engine knob with a "
                             "range ({low, high}) or a list of choices ({choices: [...]})")

    def __getitem__(self, knob: str) -> Dimension:
        return dict(self.dimensions)[knob]

    def __iter__(self) -> Iterator[str]:
        return (knob for knob, _ in self.dimensions)

    def __len__(self) -> int:
        return len(self.dimensions)

    def suggest(self, trial: optuna.Trial) -> dict[str, Any]:
        return {knob: dim.suggest(trial, knob) for knob, dim in self.dimensions}

    def describe(self) -> dict[str, str]:
        return {knob: dim.describe() for knob, dim in self.dimensions}

    def check_fixed(self, params: Mapping[str, Any], what: str) -> None:
        """ValueError unless Optuna can run `params` (a trial enqueued with fixed knobs: the
        base config's, a baseline's) in this space: every value set, a choice among the
        choices. A number outside a range is allowed (it runs as it is)."""
        for knob, value in params.items():
            dim = dict(self.dimensions).get(knob)
            if dim is None:
                continue
            if value is None:
                raise ValueError(f"space.{knob}: {what} leaves {knob} unset; set it (--set "
                                 f"{knob}=VALUE) or drop {knob} from the space")
            if isinstance(dim, Choices) and value not in dim.values:
                raise ValueError(f"space.{knob}: {what} has {knob} {value!r}, not among the "
                                 f"choices {dim.describe()}; add it to the choices")

    def values_of(self, config: EngineConfig) -> dict[str, Any]:
        """The space's knobs as `config` sets them (the base config's trial)."""
        return {knob: getattr(config, knob) for knob in self}


# ----------------------------------------------------------------------------- defaults


def context_length(config: EngineConfig) -> int | None:
    """The model's context length when it is known without loading it: the sim model's or the
    random:<preset>'s (or a sim_profile's); None for a checkpoint (read from its config.json
    at start)."""
    if config.executor == "sim":
        if config.sim_profile is not None:
            from engine.sim_profile import load_profile

            return load_profile(config.sim_profile).max_position
        return model_preset(config.sim_model).max_position
    if config.model.startswith("random:"):
        return model_preset(config.model.removeprefix("random:")).max_position
    return None


def default_space(base: EngineConfig, run_as: EngineConfig | None = None) -> Space:
    """The four knobs of the issue, each range holding the base config's value. max_model_len
    goes up to the smallest known context of `base`'s model and of `run_as` (the config a
    runner actually runs, e.g. the simulator's sim_model), so the winner starts on both, and,
    when `run_as` is simulated, no further than the most KV the space's roomiest corner leaves
    (a longer max_model_len could never start). A checkpoint's context is unknown before it
    loads: then the base's own max_model_len is the top."""
    dims: list[tuple[str, Dimension]] = [
        ("max_num_batched_tokens", _log_ints(256, 16384, base.max_num_batched_tokens)),
        ("max_num_seqs", _log_ints(8, 512, base.max_num_seqs)),
    ]
    fraction = FloatRange(min(0.7, base.memory_fraction), max(0.98, base.memory_fraction),
                          step=0.01)
    known = [c for c in (context_length(base) or base.max_model_len,
                         None if run_as is None else context_length(run_as)) if c is not None]
    if known:
        context = min(known)
        if run_as is not None and run_as.executor == "sim":
            context = min(context, max(_sim_kv_tokens(run_as, dims, fraction), 1024))
        base_len = base.max_model_len or context
        dims.append(("max_model_len", _log_ints(min(1024, context), context, base_len)))
    dims.append(("memory_fraction", fraction))
    return Space(tuple(dims))


def _sim_kv_tokens(run_as: EngineConfig, dims: list[tuple[str, Dimension]],
                   fraction: FloatRange) -> int:
    """KV tokens the simulated device holds at the space's roomiest corner: the highest
    memory_fraction with the smallest token budget and sequence count."""
    from engine.sim import SimExecutor
    from engine.sim_profile import load_profile

    if run_as.sim_profile is not None:  # the profiled engine's cache, whatever the knobs
        return load_profile(run_as.sim_profile).kv_tokens
    lows = {knob: dim.low for knob, dim in dims if isinstance(dim, IntRange)}
    config = run_as.replace(memory_fraction=fraction.high, max_model_len=1, **lows)
    try:
        executor = SimExecutor(config)
    except ValueError:
        return 0
    plan = executor.cost.memory_plan(config)
    return int(max(plan.kv, 0) // executor.cost.kv_bytes_per_token)


def _log_ints(low: int, high: int, base: int) -> IntRange:
    return IntRange(min(low, base), max(high, base), log=True)


# ----------------------------------------------------------------------------- space files


def load_space_file(path: str | Path) -> Space:
    """A `--space` YAML file; ValueError naming the file and the knob for any mistake."""
    path = Path(path)
    try:
        data = load_yaml(path)  # YamlError names the file and the line itself
    except FileNotFoundError:
        raise ValueError(f"space file {path} not found") from None
    except OSError as exc:
        raise ValueError(f"cannot read space file {path}: {exc}") from None
    try:
        return parse_space(data)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


def parse_space(data: Any) -> Space:
    """`{knob: {low, high, log?, step?} | {choices: [...]}}` -> Space."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ValueError("the space must be a mapping of engine knob: {low, high} or "
                         "{choices: [...]}")
    check_known_keys("space", data, TUNABLE_KNOBS)
    return Space(tuple((str(knob), parse_dimension(str(knob), spec))
                       for knob, spec in data.items()))


def parse_dimension(knob: str, spec: Any) -> Dimension:
    if not isinstance(spec, dict):
        raise ValueError(f"space.{knob} must be {{low: L, high: H}} or {{choices: [...]}}, "
                         f"got {spec!r}")
    if "choices" in spec:
        check_known_keys(f"space.{knob}", spec, ("choices",))
        values = spec["choices"]
        if not isinstance(values, list) or not values:
            raise ValueError(f"space.{knob}.choices must be a non-empty list, got {values!r}")
        return Choices(tuple(values))
    check_known_keys(f"space.{knob}", spec, RANGE_KEYS)
    if "low" not in spec or "high" not in spec:
        raise ValueError(f"space.{knob} needs both low and high (or choices: [...])")
    kind = _knob_type(knob)
    if kind is int:
        return _int_range(knob, spec)
    if kind is float:
        return _float_range(knob, spec)
    raise ValueError(f"space.{knob} is not numeric: give {{choices: [...]}} instead of a range")


def _knob_type(knob: str) -> type | None:
    """int or float for a numeric knob (`int | None` counts as int), else None."""
    hint = typing.get_type_hints(EngineConfig)[knob]
    for kind in (bool, int, float):  # bool first: it is no range
        if hint is kind or kind in typing.get_args(hint):
            return None if kind is bool else kind
    return None


def _int_range(knob: str, spec: dict[str, Any]) -> IntRange:
    low = check_positive_int(f"space.{knob}.low", spec["low"])
    high = check_positive_int(f"space.{knob}.high", spec["high"])
    log = check_bool(f"space.{knob}.log", spec.get("log", False))
    step = check_positive_int(f"space.{knob}.step", spec.get("step", 1))
    _check_order(knob, low, high, log, step != 1)
    return IntRange(low, high, log, step)


def _float_range(knob: str, spec: dict[str, Any]) -> FloatRange:
    low = check_number(f"space.{knob}.low", spec["low"])
    high = check_number(f"space.{knob}.high", spec["high"])
    log = check_bool(f"space.{knob}.log", spec.get("log", False))
    step = spec.get("step")
    if step is not None:
        step = check_number(f"space.{knob}.step", step, low=0, open_low=True)
    _check_order(knob, low, high, log, step is not None)
    if log and low <= 0:
        raise ValueError(f"space.{knob}: a log range needs low > 0, got {low}")
    return FloatRange(float(low), float(high), log, None if step is None else float(step))


def _check_order(knob: str, low: float, high: float, log: bool, stepped: bool) -> None:
    if low > high:
        raise ValueError(f"space.{knob}: low ({low}) must be <= high ({high})")
    if log and stepped:
        raise ValueError(f"space.{knob}: a log range cannot have a step; drop one of them")


# ----------------------------------------------------------------------------- before running


def build_config(base: EngineConfig, params: Mapping[str, Any]) -> EngineConfig:
    """`base` with a trial's knobs, checked as the engine would check it at start, as far as
    that is known before running: ValueError with the engine's message when it cannot start."""
    try:
        config = base.replace(**params)
    except TypeError as exc:  # a wrongly typed choice compared during validation
        raise ValueError(f"invalid engine setting: {exc}") from None
    context = context_length(config)
    return config if context is None else config.with_context_length(context)
