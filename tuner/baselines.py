"""The trials a study enqueues before its search: the base config and vLLM's grid."""

from __future__ import annotations

from typing import Any

from engine.config import EngineConfig
from tuner.space import build_config
from tuner.spec import VLLM_GRID, VLLM_MEMORY_PROBE, TuneSpec


def baseline_params(spec: TuneSpec, prepared: EngineConfig) -> list[tuple[str, dict[str, Any]]]:
    """(label, knobs) of the trials enqueued before the search: the base config, then the vLLM
    grid; ValueError when the space cannot hold one of them."""
    out = [("default", default_params(spec, prepared))]
    if spec.baseline == "vllm-grid":
        out += vllm_grid(spec, prepared)
    for label, params in out:
        spec.space.check_fixed(params, "the base config" if label == "default"
                               else f"--baseline {label}")
    return out


def default_params(spec: TuneSpec, prepared: EngineConfig) -> dict[str, Any]:
    """The base config's values of the space's knobs; an unset max_model_len is the user's
    model's context length when known, else the runner's."""
    config = build_config(spec.base, {})
    if config.max_model_len is None:
        config = build_config(prepared, {})
    return spec.space.values_of(config)


def vllm_grid(spec: TuneSpec, prepared: EngineConfig) -> list[tuple[str, dict[str, Any]]]:
    """vLLM auto_tune's default grid as trials of this space: its max_num_seqs x
    max_num_batched_tokens pairs, max_model_len as the base config has it (auto_tune takes
    it as an input), and memory_fraction probed the way auto_tune does, from 0.98 down until
    the engine starts. The probe needs the simulator's memory model; against a real server
    (replay, launch) the grid keeps the base config's memory_fraction."""
    defaults = default_params(spec, prepared)
    grid = []
    for seqs, tokens in VLLM_GRID:
        params = {**defaults, "max_num_seqs": seqs, "max_num_batched_tokens": tokens}
        if "memory_fraction" in spec.space and prepared.executor == "sim":
            params["memory_fraction"] = _probe_memory_fraction(prepared, params)
        grid.append((f"vllm-grid {seqs}x{tokens}", params))
    return grid


def _probe_memory_fraction(prepared: EngineConfig, params: dict[str, Any]) -> float:
    from engine.sim import SimExecutor

    for fraction in VLLM_MEMORY_PROBE:
        try:
            config = build_config(prepared, {**params, "memory_fraction": fraction})
            SimExecutor(config).plan_kv_capacity(config)
        except ValueError:
            continue
        return fraction
    return VLLM_MEMORY_PROBE[-1]  # starts nowhere: the trial records why

