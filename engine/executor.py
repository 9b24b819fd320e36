"""The executor interface: one forward pass over a scheduler plan.

`SimExecutor` (engine/sim.py) models the step time without a model; `TorchExecutor`
(engine/runner.py) runs a real Llama-family model. The engine sees only this interface.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from engine.clock import Clock
from engine.config import EngineConfig
from engine.tokenizer import Tokenizer

if TYPE_CHECKING:
    from engine.scheduler import SchedulerOutput


@dataclass
class ModelOutput:
    # request id -> the token sampled this step (only requests whose last known token ran)
    sampled: dict[str, int]
    # request id -> {token id: logprob} (the sampled token and the top alternatives), if asked
    logprobs: dict[str, dict[int, float]] = field(default_factory=dict)
    # seconds the step took: measured (torch) or modelled (sim)
    step_time: float = 0.0


@dataclass(frozen=True)
class KVCapacity:
    num_blocks: int  # device blocks
    num_host_blocks: int  # host swap blocks
    bytes_per_block: int


class Executor(Protocol):
    tokenizer: Tokenizer
    vocab_size: int
    max_position: int  # the model's own context limit
    eos_token_ids: tuple[int, ...]

    def plan_kv_capacity(self, config: EngineConfig) -> KVCapacity:
        """How many blocks fit under `config` (num_kv_blocks override, or memory sizing)."""
        ...

    def allocate_kv_cache(self, config: EngineConfig, capacity: KVCapacity) -> None:
        """(Re)allocate the device cache and host swap space; weights stay loaded."""
        ...

    def execute(self, plan: SchedulerOutput) -> ModelOutput:
        """Apply the plan's swaps, run its tokens through the model, sample."""
        ...


def make_executor(config: EngineConfig, clock: Clock | None = None) -> Executor:
    if config.executor == "sim":
        from engine.sim import SimExecutor

        return SimExecutor(config, clock)
    from engine.runner import TorchExecutor

    return TorchExecutor(config)
