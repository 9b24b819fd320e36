"""SimExecutor: tokens without a model, step times from a cost model of real hardware.

A step's time is a roofline estimate: reading the weights and every scheduled request's KV
context from memory, against the matmul and attention FLOPs, plus a fixed launch overhead.
With the virtual clock what-if studies run at CPU speed; with the real-time clock the engine
sleeps the modelled time, so a CPU machine serves with GPU-like timing.

Memory is modelled the way a GPU engine (vLLM) sizes its KV cache, so `memory_fraction`,
`max_num_batched_tokens`, `max_num_seqs` and `max_model_len` are real trade-offs:

- inside the budget (`memory_fraction` x device memory): the weights, the activation peak of a
  profiling forward pass at `max_num_batched_tokens` (plus the sampler's fp32 logits for
  `max_num_seqs` rows), and the non-torch reserve (CUDA context, cuBLAS workspaces); the KV
  cache gets what is left, and must hold one `max_model_len` request;
- outside the budget: CUDA graphs, captured after the KV cache is allocated, for batch sizes up
  to `max_num_seqs`. A budget that leaves too little of the device for them starts and then
  runs out of memory, as vLLM users see with a high gpu_memory_utilization.

Both failures raise `OutOfMemory` (a ValueError) naming the knobs, before any request runs.

With `sim_profile` set, step times and the KV capacity come from a calibration profile of a real
engine instead (engine/sim_profile.py, written by `fairgate tune calibrate`), and a profile that
recorded how uneven the real steps were (`noise`) makes the simulated steps as uneven: each
step's time times the next ratio of a block bootstrap seeded by `seed`, so two runs with one seed
(a tuner's trials) see the same unevenness. A profile that measured what the first steps after an
idle spell cost (`wake`) adds that to them.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

from engine.clock import Clock, RealClock
from engine.config import EngineConfig
from engine.executor import KVCapacity, ModelOutput
from engine.model_config import ModelConfig
from engine.presets import model_preset
from engine.scheduler import SchedulerOutput
from engine.sim_profile import WAKE_MIN_IDLE_S, Wake, load_profile
from engine.tokenizer import ByteTokenizer, Tokenizer

GIB = 1 << 30
ACTIVATION_BYTES = 2  # bf16 activations
LOGIT_BYTES = 8  # fp32 logits and the sampler's fp32 probabilities, per vocabulary entry


class OutOfMemory(ValueError):
    """The simulated device cannot hold this config (at start, or when capturing graphs)."""


@dataclass(frozen=True)
class Hardware:
    memory_gb: float  # GiB the device reports (nvidia-smi's total)
    bandwidth: float  # bytes/s, peak
    flops: float  # dense 16-bit FLOP/s, peak
    bandwidth_efficiency: float = 0.8
    flops_efficiency: float = 0.5
    step_overhead: float = 0.002  # seconds: launches, scheduling, sampling
    non_torch_gb: float = 0.0  # CUDA context and workspaces, inside the memory_fraction budget
    graph_gb: float = 0.0  # CUDA graphs, outside the budget: a fixed part ...
    graph_gb_per_seq: float = 0.0  # ... and one per captured batch size up to max_num_seqs


_GPU = {"non_torch_gb": 0.5, "graph_gb": 0.2, "graph_gb_per_seq": 0.0015}
HARDWARE_PRESETS: dict[str, Hardware] = {
    "h100": Hardware(memory_gb=79.6, bandwidth=3.35e12, flops=989e12, **_GPU),
    "h200": Hardware(memory_gb=140.4, bandwidth=4.8e12, flops=989e12, **_GPU),
    "a100": Hardware(memory_gb=80, bandwidth=2.04e12, flops=312e12, **_GPU),
    # memory-bound: Llama-3-8B's 15 GiB of bf16 weights leave about 5 GiB for everything else
    "l4": Hardware(memory_gb=22.5, bandwidth=300e9, flops=121e12, **_GPU),
    "a10g": Hardware(memory_gb=22.5, bandwidth=600e9, flops=70e12, **_GPU),
    "cpu": Hardware(memory_gb=16, bandwidth=50e9, flops=1e12, flops_efficiency=0.3,
                    step_overhead=0.001),
}


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes of the simulated device, as the engine would spend them under one config."""

    device: float
    budget: float  # memory_fraction x device
    weights: float
    activation_peak: float
    non_torch: float
    graphs: float  # outside the budget
    kv: float  # what the budget leaves for the KV cache (may be negative)

    def describe(self) -> str:
        return (f"{self.budget / GIB:.2f} GiB budget = {self.weights / GIB:.2f} weights + "
                f"{self.activation_peak / GIB:.2f} activation peak + {self.non_torch / GIB:.2f} "
                f"non-torch + {self.kv / GIB:.2f} KV cache")


class CostModel:
    def __init__(self, shape: ModelConfig, hardware: Hardware, kv_dtype_bytes: float,
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

    def activation_peak(self, config: EngineConfig) -> float:
        """Bytes of a profiling forward pass over max_num_batched_tokens tokens: one layer's
        live tensors (residual and normed hidden states, q/k/v, gate, up and the activated
        MLP input) plus fp32 logits and probabilities for max_num_seqs sampled rows."""
        shape = self.shape
        qkv = (shape.num_heads + 2 * shape.num_kv_heads) * shape.head_dim
        per_token = (4 * shape.hidden_size + qkv + 3 * shape.intermediate_size) * ACTIVATION_BYTES
        logits = config.max_num_seqs * shape.vocab_size * LOGIT_BYTES
        return config.max_num_batched_tokens * per_token + logits

    def memory_plan(self, config: EngineConfig) -> MemoryPlan:
        hw = self.hardware
        device = hw.memory_gb * GIB
        budget = device * config.memory_fraction
        activation = self.activation_peak(config)
        non_torch = hw.non_torch_gb * GIB
        graphs = (hw.graph_gb + hw.graph_gb_per_seq * config.max_num_seqs) * GIB
        return MemoryPlan(device=device, budget=budget, weights=self.weight_bytes,
                          activation_peak=activation, non_torch=non_torch, graphs=graphs,
                          kv=budget - self.weight_bytes - activation - non_torch)

    def kv_capacity(self, config: EngineConfig) -> KVCapacity:
        """Blocks the budget leaves (or num_kv_blocks); OutOfMemory when the config cannot
        start: too little KV for one max_model_len request, or no room left for the graphs."""
        bytes_per_block = int(self.kv_bytes_per_token * config.block_size)
        if config.num_kv_blocks is not None:
            num_blocks = config.num_kv_blocks
        else:
            plan = self.memory_plan(config)
            num_blocks = max(int(plan.kv // bytes_per_block), 0)
            max_model_len = config.resolved_max_model_len
            if num_blocks * config.block_size < max_model_len:
                raise OutOfMemory(
                    f"out of memory: the simulated {config.sim_hardware} has room for "
                    f"{num_blocks} KV blocks ({num_blocks * config.block_size} tokens), fewer "
                    f"than one max_model_len ({max_model_len}) request needs ({plan.describe()}); "
                    "raise memory_fraction, lower max_model_len or max_num_batched_tokens, or "
                    "pick a larger sim_hardware")
            if plan.budget + plan.graphs > plan.device:
                raise OutOfMemory(
                    f"out of memory capturing CUDA graphs: max_num_seqs {config.max_num_seqs} "
                    f"needs {plan.graphs / GIB:.2f} GiB beyond the memory_fraction budget, and "
                    f"memory_fraction {config.memory_fraction:g} leaves "
                    f"{(plan.device - plan.budget) / GIB:.2f} GiB of the simulated "
                    f"{config.sim_hardware}'s {plan.device / GIB:.1f} GiB; lower "
                    "memory_fraction or max_num_seqs")
        num_host = int(config.swap_space_gb * GIB // bytes_per_block)
        return KVCapacity(num_blocks, num_host, bytes_per_block)


class StepCostModel(Protocol):
    """What SimExecutor asks of a cost model: `CostModel`'s roofline or a `SimProfile`."""

    def step_time(self, plan: SchedulerOutput) -> float: ...

    def kv_capacity(self, config: EngineConfig) -> KVCapacity: ...


class SimExecutor:
    """Executor that samples deterministic printable tokens and reports modelled step times."""

    def __init__(self, config: EngineConfig, clock: Clock | None = None) -> None:
        self.shape = model_preset(config.sim_model)
        self.cost = CostModel(self.shape, HARDWARE_PRESETS[config.sim_hardware],
                              kv_dtype_bytes=1.0 if config.kv_cache_dtype == "int8" else 2.0)
        # what times the steps and sizes the cache: the roofline, or a calibration profile
        self.step_model: StepCostModel = self.cost
        self.max_position = self.shape.max_position
        self.noise: Iterator[float] | None = None  # a step's time is multiplied by the next
        self.wake: Wake | None = None  # the first steps after idle cost more
        if config.sim_profile is not None:
            profile = load_profile(config.sim_profile)
            self.step_model, self.max_position = profile, profile.max_position
            if profile.noise is not None:
                self.noise = profile.noise.stream(config.seed)
            self.wake = profile.wake
        # the end of the last step, the idle spell before the steps since, and their count
        self._last_end: float | None = None
        self._idle_s = 0.0
        self._since_idle = 0
        self.clock = clock or RealClock()
        self.realtime = config.sim_clock == "realtime"
        self.tokenizer: Tokenizer = ByteTokenizer(vocab_size=max(self.shape.vocab_size, 258))
        self.vocab_size = self.tokenizer.vocab_size
        self.eos_token_ids = self.tokenizer.eos_token_ids
        self.seed = config.seed

    def plan_kv_capacity(self, config: EngineConfig) -> KVCapacity:
        return self.step_model.kv_capacity(config)

    def allocate_kv_cache(self, config: EngineConfig, capacity: KVCapacity) -> None:
        pass  # nothing to hold

    def execute(self, plan: SchedulerOutput) -> ModelOutput:
        started = time.monotonic()
        sampled = {s.request.request_id: self._token(s.request.request_id, s.request.num_tokens)
                   for s in plan.requests if s.samples}
        step_time = self.step_model.step_time(plan)
        if self.noise is not None:
            step_time *= next(self.noise)
        if self.wake is not None:
            step_time += self._wake_extra()
        if self.realtime:
            self.clock.sleep(step_time - (time.monotonic() - started))
        else:
            self.clock.sleep(step_time)
        if self.wake is not None:
            self._last_end = self.clock.now()
        return ModelOutput(sampled=sampled, step_time=step_time)

    def _wake_extra(self) -> float:
        """What this step adds for the idle spell before it (the time since the last step
        ended) or, within a few steps of one, for that spell."""
        assert self.wake is not None
        now = self.clock.now()
        if self._last_end is None:  # a fresh engine starts cold
            self._idle_s, self._since_idle = self.wake.idle_s, 0
        elif now - self._last_end >= WAKE_MIN_IDLE_S:
            self._idle_s, self._since_idle = now - self._last_end, 0
        else:
            self._since_idle += 1
        return self.wake.extra(self._since_idle, self._idle_s)

    def _token(self, request_id: str, position: int) -> int:
        """Lower-case letters and spaces, a pure function of (seed, request, position), so a
        recomputed request produces the same tokens. Never EOS: outputs run to max_tokens."""
        mixed = (zlib.crc32(request_id.encode()) ^ (position * 0x9E3779B97F4A7C15) ^ self.seed) & 0xFFFFFFFF
        mixed = (mixed * 2654435761) & 0xFFFFFFFF
        value = (mixed >> 8) % 27
        return 32 if value == 26 else 97 + value
