"""The simulated engine the engine tests run, configured in one place: a test names only the
knobs it changes."""

from __future__ import annotations

from typing import Any

from engine import EngineConfig

# random:tiny on the simulated executor and its virtual clock: a step takes no real time
SIM_KNOBS: dict[str, Any] = {
    "executor": "sim", "sim_model": "tiny", "max_model_len": 256, "num_kv_blocks": 64,
    "max_num_batched_tokens": 256, "max_num_seqs": 16}
# the modelled CPU in real time (a step takes about a millisecond), with room for long outputs
REALTIME_KNOBS: dict[str, Any] = {
    "sim_clock": "realtime", "sim_hardware": "cpu", "max_model_len": 2048, "num_kv_blocks": 512,
    "max_num_batched_tokens": 2048}


def sim_config(**changes: Any) -> EngineConfig:
    """`SIM_KNOBS` with `changes` applied."""
    return EngineConfig(**{**SIM_KNOBS, **changes})


def realtime_config(**changes: Any) -> EngineConfig:
    """`sim_config` on the real-time clock (`REALTIME_KNOBS`), with `changes` applied."""
    return sim_config(**{**REALTIME_KNOBS, **changes})
