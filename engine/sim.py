"""SimExecutor: tokens without a model, step times from a cost model of real hardware.

A step's time is a roofline estimate: reading the weights and every scheduled request's KV
context from memory, against the matmul and attention FLOPs, plus a fixed launch overhead.
With the virtual clock what-if studies run at CPU speed; with the real-time clock the engine
sleeps the modelled time, so a CPU machine serves with GPU-like timing.
"""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass

from engine.clock import Clock, RealClock
from engine.config import EngineConfig
from engine.executor import KVCapacity, ModelOutput
from engine.presets import ModelShape, model_preset
from engine.scheduler import SchedulerOutput
from engine.tokenizer import ByteTokenizer, Tokenizer

GIB = 1 << 30


@dataclass(frozen=True)
class Hardware:
    memory_gb: float
    bandwidth: float  # bytes/s, peak
    flops: float  # dense 16-bit FLOP/s, peak
    bandwidth_efficiency: float = 0.8
    flops_efficiency: float = 0.5
    step_overhead: float = 0.002  # seconds: launches, scheduling, sampling


HARDWARE_PRESETS: dict[str, Hardware] = {
    "h100": Hardware(memory_gb=80, bandwidth=3.35e12, flops=989e12),
    "h200": Hardware(memory_gb=141, bandwidth=4.8e12, flops=989e12),
    "a100": Hardware(memory_gb=80, bandwidth=2.04e12, flops=312e12),
    "cpu": Hardware(memory_gb=16, bandwidth=50e9, flops=1e12, flops_efficiency=0.3,
                    step_overhead=0.001),
}


class CostModel:
    def __init__(self, shape: ModelShape, hardware: Hardware, kv_dtype_bytes: float,
                 weight_dtype_bytes: float = 2.0) -> None:
        self.shape = shape
        self.hardware = hardware
        self.weight_bytes = shape.num_params * weight_dtype_bytes
        self.kv_bytes_per_token = shape.kv_bytes_per_token(kv_dtype_bytes)

    def step_time(self, plan: SchedulerOutput) -> float:
        hw, shape = self.hardware, self.shape
        tokens = plan.num_batched_tokens
        context_tokens = 0.0  # KV entries read
        attention_flops = 0.0
        for scheduled in plan.requests:
            end = scheduled.start + scheduled.num_tokens
            context_tokens += end
            # each query attends to its causal prefix: QK^T and PV, 2 FLOPs per MAC
            mean_context = scheduled.start + (scheduled.num_tokens + 1) / 2
            attention_flops += 4 * shape.num_layers * shape.hidden_size * scheduled.num_tokens * mean_context
        memory = (self.weight_bytes + context_tokens * self.kv_bytes_per_token) / (
            hw.bandwidth * hw.bandwidth_efficiency)
        compute = (2 * shape.num_params * tokens + attention_flops) / (hw.flops * hw.flops_efficiency)
        swap_bytes = (len(plan.swap_in) + len(plan.swap_out)) * self.kv_bytes_per_token
        return hw.step_overhead + max(memory, compute) + swap_bytes / 25e9  # PCIe ~25 GB/s

    def kv_capacity(self, config: EngineConfig) -> KVCapacity:
        bytes_per_block = int(self.kv_bytes_per_token * config.block_size)
        if config.num_kv_blocks is not None:
            num_blocks = config.num_kv_blocks
        else:
            free = self.hardware.memory_gb * GIB * config.memory_fraction - self.weight_bytes
            num_blocks = int(free // bytes_per_block)
            num_blocks = max(num_blocks, 0)
            max_model_len = config.resolved_max_model_len
            if num_blocks * config.block_size < max_model_len:
                raise ValueError(
                    f"the simulated {config.sim_hardware} has room for {num_blocks} KV blocks "
                    f"({num_blocks * config.block_size} tokens) after "
                    f"{self.weight_bytes / GIB:.1f} GiB of weights, fewer than one max_model_len "
                    f"({max_model_len}) request needs; raise memory_fraction, lower "
                    "max_model_len or pick a larger sim_hardware")
        num_host = int(config.swap_space_gb * GIB // bytes_per_block)
        return KVCapacity(num_blocks, num_host, bytes_per_block)


class SimExecutor:
    """Executor that samples deterministic printable tokens and reports modelled step times."""

    def __init__(self, config: EngineConfig, clock: Clock | None = None) -> None:
        self.shape = model_preset(config.sim_model)
        self.cost = CostModel(self.shape, HARDWARE_PRESETS[config.sim_hardware],
                              kv_dtype_bytes=1.0 if config.kv_cache_dtype == "int8" else 2.0)
        self.clock = clock or RealClock()
        self.realtime = config.sim_clock == "realtime"
        self.tokenizer: Tokenizer = ByteTokenizer(vocab_size=max(self.shape.vocab_size, 258))
        self.vocab_size = self.tokenizer.vocab_size
        self.eos_token_ids = self.tokenizer.eos_token_ids
        self.max_position = self.shape.max_position
        self.seed = config.seed

    def plan_kv_capacity(self, config: EngineConfig) -> KVCapacity:
        return self.cost.kv_capacity(config)

    def allocate_kv_cache(self, config: EngineConfig, capacity: KVCapacity) -> None:
        pass  # nothing to hold

    def execute(self, plan: SchedulerOutput) -> ModelOutput:
        started = time.monotonic()
        sampled = {s.request.request_id: self._token(s.request.request_id, s.request.num_tokens)
                   for s in plan.requests if s.samples}
        step_time = self.cost.step_time(plan)
        if self.realtime:
            self.clock.sleep(step_time - (time.monotonic() - started))
        else:
            self.clock.sleep(step_time)
        return ModelOutput(sampled=sampled, step_time=step_time)

    def _token(self, request_id: str, position: int) -> int:
        """Lower-case letters and spaces, a pure function of (seed, request, position), so a
        recomputed request produces the same tokens. Never EOS: outputs run to max_tokens."""
        mixed = (zlib.crc32(request_id.encode()) ^ (position * 0x9E3779B97F4A7C15) ^ self.seed) & 0xFFFFFFFF
        mixed = (mixed * 2654435761) & 0xFFFFFFFF
        value = (mixed >> 8) % 27
        return 32 if value == 26 else 97 + value
