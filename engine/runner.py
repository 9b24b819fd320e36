"""TorchExecutor: turn a scheduler plan into batch tensors, run the model, sample.

One step: apply the plan's swaps (out, then in), flatten every scheduled request's tokens into
one batch (positions, KV slots, block tables), run one forward pass, compute logits only for the
requests that sample this step, and sample them together.
"""

from __future__ import annotations

import logging
import mmap
import os
import time
from dataclasses import dataclass

import torch

from engine.config import EngineConfig
from engine.executor import KVCapacity, ModelOutput
from engine.host_memory import keep_step_memory
from engine.loader import load_model
from engine.model import AttentionMetadata, LayerKV
from engine.sampling import SamplingBatch, sample
from engine.scheduler import ScheduledRequest, SchedulerOutput
from kernels import get_ops, resolve_backend

logger = logging.getLogger("fairgate.engine")

GiB = 1 << 30
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
SCALE_BYTES = 4  # int8 cache: one float32 scale per token and KV head


def resolve_device(device: str) -> torch.device:
    """`device` (auto, cpu, cuda, cuda:N) as torch's; ValueError for a GPU torch cannot see."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"device {device}: torch sees no CUDA GPU here (a CPU build of "
                             "torch, or no driver); use device: auto or cpu")
        if resolved.index is not None and resolved.index >= count:
            raise ValueError(f"device {device}: torch sees {count} CUDA GPU(s), cuda:0 to "
                             f"cuda:{count - 1}")
    return resolved


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """"auto": float32 on CPU (fast and exact there), bfloat16 on GPUs."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[dtype]


def default_device_memory(device: torch.device) -> int:
    """Bytes the engine may treat as its device: the GPU's total, or on CPU a modest share of
    RAM (min(4 GiB, 25%)) so tests and demos stay light; `device_memory_gb` overrides both."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[1])
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return min(4 * GiB, ram // 4)


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor backed by anonymous mmap: pages cost RAM only once written, so a
    cache sized for a few GiB does not take them up front."""
    numel = 1
    for size in shape:
        numel *= size
    nbytes = max(1, numel * torch.empty(0, dtype=dtype).element_size())
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype, count=numel).view(shape)


@dataclass
class StepTimers:
    """Cumulative seconds spent in each part of `execute` (the benchmark's breakdown)."""

    swap: float = 0.0
    prepare: float = 0.0
    forward: float = 0.0
    sample: float = 0.0
    steps: int = 0


@dataclass
class StepBatch:
    input_ids: torch.Tensor  # [num_tokens]
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [num_sampling] rows of the hidden states to sample from
    sampling: SamplingBatch | None
    sampling_ids: list[str]


class KVCache:
    """All layers' K and V in one tensor per memory, so a swap is one index copy per tensor."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, quantized: bool,
                 device: torch.device, num_host_blocks: int, pin: bool) -> None:
        # shape: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
        host_shape = (*shape[:2], num_host_blocks, *shape[3:])
        self.data = self._zeros(shape, dtype, device)
        self.host = self._zeros(host_shape, dtype, torch.device("cpu"), pin)
        self.scales: torch.Tensor | None = None
        self.host_scales: torch.Tensor | None = None
        if quantized:  # [num_layers, 2, num_blocks, block_size, num_kv_heads]
            self.scales = self._zeros(shape[:-1], torch.float32, device)
            self.host_scales = self._zeros(host_shape[:-1], torch.float32, torch.device("cpu"), pin)
        self.layers = [self._layer(i) for i in range(shape[0])]

    @staticmethod
    def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
               pin: bool = False) -> torch.Tensor:
        # zeroed, not empty: attention reads whole blocks, and stale NaNs would poison its output
        if device.type == "cpu" and not pin:
            return lazy_zeros(shape, dtype)
        return torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin)

    def _layer(self, i: int) -> LayerKV:
        if self.scales is None:
            return LayerKV(self.data[i, 0], self.data[i, 1])
        return LayerKV(self.data[i, 0], self.data[i, 1], self.scales[i, 0], self.scales[i, 1])

    def swap(self, pairs: list[tuple[int, int]], to_host: bool) -> None:
        """Copy blocks (src, dst) device -> host (`to_host`) or host -> device."""
        if not pairs:
            return
        tensors = [(self.data, self.host)]
        if self.scales is not None and self.host_scales is not None:
            tensors.append((self.scales, self.host_scales))
        for device_t, host_t in tensors:
            src, dst = (device_t, host_t) if to_host else (host_t, device_t)
            src_ids = torch.tensor([p[0] for p in pairs], device=src.device)
            dst_ids = torch.tensor([p[1] for p in pairs], device=dst.device)
            dst.index_copy_(2, dst_ids, src.index_select(2, src_ids).to(dst.device))


class TorchExecutor:
    """Runs a Llama-family model (checkpoint folder or `random:<preset>`) on a paged KV cache."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        if self.device.type == "cpu":
            keep_step_memory()  # a step's activations are not faulted in afresh every step
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.attention_backend = resolve_backend(config.attention_backend, self.device)
        ops = get_ops(self.attention_backend, self.device)
        loaded = load_model(config.model, ops, self.device, self.dtype, config.seed)
        self.model = loaded.model
        self.model_config = loaded.config
        self.model.init_rope(max(loaded.config.max_position, config.max_model_len or 0))
        self.tokenizer = loaded.tokenizer
        self.eos_token_ids = loaded.eos_token_ids
        self.vocab_size = loaded.config.vocab_size
        self.max_position = loaded.config.max_position
        self.kv_cache: KVCache | None = None
        self.block_size = config.block_size  # of the allocated cache (reconfigure may change it)
        self.timers = StepTimers()

    # -- memory -----------------------------------------------------------------------------

    def kv_dtype(self, config: EngineConfig) -> torch.dtype:
        return torch.int8 if config.kv_cache_dtype == "int8" else self.dtype

    def bytes_per_block(self, config: EngineConfig) -> int:
        mc = self.model_config
        element = torch.empty(0, dtype=self.kv_dtype(config)).element_size()
        per_head = mc.head_dim * element + (SCALE_BYTES if config.kv_cache_dtype == "int8" else 0)
        return 2 * mc.num_layers * config.block_size * mc.num_kv_heads * per_head

    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    def plan_kv_capacity(self, config: EngineConfig) -> KVCapacity:
        per_block = self.bytes_per_block(config)
        num_host_blocks = int(config.swap_space_gb * GiB) // per_block
        if config.num_kv_blocks is not None:
            num_blocks = config.num_kv_blocks
        else:
            num_blocks = self._blocks_that_fit(config, per_block)
        capacity = KVCapacity(num_blocks, num_host_blocks, per_block)
        tokens, max_model_len = num_blocks * config.block_size, config.resolved_max_model_len
        logger.info("KV cache: %d blocks x %d = %d tokens (%.2f GiB, %s); maximum concurrency "
                    "at max_model_len %d: %.1f requests; %d host swap blocks",
                    num_blocks, config.block_size, tokens, num_blocks * per_block / GiB,
                    str(self.kv_dtype(config)).removeprefix("torch."), max_model_len,
                    tokens / max_model_len, num_host_blocks)
        return capacity

    def _blocks_that_fit(self, config: EngineConfig, per_block: int) -> int:
        """(device memory x memory_fraction - weights - activation peak) / bytes per block."""
        total = (int(config.device_memory_gb * GiB) if config.device_memory_gb is not None
                 else default_device_memory(self.device))
        weights, activations = self.weight_bytes(), self.activation_peak_bytes(config)
        budget = total * config.memory_fraction - weights - activations
        num_blocks = max(0, int(budget // per_block))
        if num_blocks * config.block_size < config.resolved_max_model_len:
            raise ValueError(
                f"not enough memory for the KV cache: {total / GiB:.2f} GiB of device memory x "
                f"memory_fraction {config.memory_fraction} minus {weights / GiB:.2f} GiB of "
                f"weights and ~{activations / GiB:.2f} GiB of activations at "
                f"max_num_batched_tokens={config.max_num_batched_tokens} leaves {num_blocks} "
                f"blocks ({num_blocks * config.block_size} tokens), fewer than max_model_len="
                f"{config.max_model_len}; raise device_memory_gb or memory_fraction, lower "
                "max_num_batched_tokens or max_model_len, use kv_cache_dtype='int8', "
                "or set num_kv_blocks")
        return num_blocks

    def activation_peak_bytes(self, config: EngineConfig) -> int:
        """Peak extra memory of a forward pass at `max_num_batched_tokens`: profiled on CUDA,
        estimated on CPU (no allocator statistics there)."""
        if self.device.type == "cuda":
            return self._profile_cuda(config)
        mc, tokens = self.model_config, config.max_num_batched_tokens
        element = torch.empty(0, dtype=self.dtype).element_size()
        per_token = 4 * mc.hidden_size + 3 * mc.intermediate_size  # residual, norms, MLP
        per_token += 2 * (mc.num_heads + 2 * mc.num_kv_heads) * mc.head_dim  # qkv, rope copies
        # the reference attention's float32 scores of one chunk against its whole context
        scores = mc.num_heads * tokens * min(config.resolved_max_model_len, tokens) * 4
        logits = 3 * config.max_num_seqs * mc.vocab_size * 4  # logits, probs, sort
        return tokens * per_token * element + scores + logits

    def _profile_cuda(self, config: EngineConfig) -> int:
        """Run a dummy max-size step (one chunk, sampled by max_num_seqs rows) on a scratch cache
        and measure the allocator's peak above the weights."""
        tokens, bs = config.max_num_batched_tokens, config.block_size
        num_blocks = -(-tokens // bs)
        scratch = KVCache(self._cache_shape(config, num_blocks), self.kv_dtype(config),
                          config.kv_cache_dtype == "int8", self.device, 0, pin=False)
        scratch_bytes = num_blocks * self.bytes_per_block(config)
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        baseline = torch.cuda.memory_allocated(self.device)
        meta = self._metadata([0], [tokens], torch.arange(num_blocks).view(1, -1), bs)
        with torch.inference_mode():
            ids = torch.zeros(tokens, dtype=torch.int64, device=self.device)
            hidden = self.model(ids, meta, scratch.layers)
            self.model.compute_logits(hidden[-config.max_num_seqs:]).softmax(-1).sort(-1)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - baseline + scratch_bytes
        del scratch
        torch.cuda.empty_cache()
        return int(peak * 1.1)  # headroom for allocator fragmentation

    def _cache_shape(self, config: EngineConfig, num_blocks: int) -> tuple[int, ...]:
        mc = self.model_config
        return (mc.num_layers, 2, num_blocks, config.block_size, mc.num_kv_heads, mc.head_dim)

    def allocate_kv_cache(self, config: EngineConfig, capacity: KVCapacity) -> None:
        self.kv_cache = None  # free the old cache before the new one is allocated
        pin = self.device.type == "cuda" and config.preemption == "swap"
        self.kv_cache = KVCache(self._cache_shape(config, capacity.num_blocks),
                                self.kv_dtype(config), config.kv_cache_dtype == "int8",
                                self.device, capacity.num_host_blocks, pin)
        self.block_size = config.block_size

    # -- one step ---------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> ModelOutput:
        assert self.kv_cache is not None, "allocate_kv_cache must run before execute"
        started = time.perf_counter()
        self.kv_cache.swap(plan.swap_out, to_host=True)  # out first: swap-in may reuse blocks
        self.kv_cache.swap(plan.swap_in, to_host=False)
        prepared = time.perf_counter()
        self.timers.swap += prepared - started
        if not plan.requests:
            return ModelOutput(sampled={}, step_time=time.perf_counter() - started)
        batch = self.prepare(plan.requests)
        forwarded = time.perf_counter()
        logits = self.forward(batch)
        sampled_at = time.perf_counter()
        output = ModelOutput(sampled={})
        if batch.sampling is not None:
            result = sample(logits, batch.sampling)
            output.sampled = dict(zip(batch.sampling_ids, result.token_ids, strict=True))
            output.logprobs = {rid: lp for rid, lp in zip(batch.sampling_ids, result.logprobs,
                                                          strict=True) if lp is not None}
        done = time.perf_counter()
        self._count(prepared, forwarded, sampled_at, done)
        output.step_time = done - started
        return output

    @torch.inference_mode()
    def forward(self, batch: StepBatch, all_tokens: bool = False) -> torch.Tensor:
        """Float32 logits of the sampling rows `[num_sampling, vocab]` (or of every token)."""
        assert self.kv_cache is not None, "allocate_kv_cache must run before forward"
        hidden = self.model(batch.input_ids, batch.meta, self.kv_cache.layers)
        logits = self.model.compute_logits(hidden if all_tokens else hidden[batch.logits_indices])
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # so the step timers see the kernels' time
        return logits

    def _count(self, prepared: float, forwarded: float, sampled_at: float, done: float) -> None:
        self.timers.prepare += forwarded - prepared
        self.timers.forward += sampled_at - forwarded
        self.timers.sample += done - sampled_at
        self.timers.steps += 1

    def prepare(self, scheduled: list[ScheduledRequest]) -> StepBatch:
        """The flat batch of one step: token ids, positions, KV slots, block tables."""
        starts = [s.start for s in scheduled]
        q_lens = [s.num_tokens for s in scheduled]
        token_ids: list[int] = []
        for s in scheduled:
            if s.num_tokens == 1:  # decode: avoid building the request's whole token list
                token_ids.append(s.request.token_id(s.start))
            else:
                token_ids.extend(s.request.token_slice(s.start, s.start + s.num_tokens))
        num_blocks = [-(-(s.start + s.num_tokens) // self.block_size) for s in scheduled]
        assert all(len(s.request.block_ids) >= n for s, n in zip(scheduled, num_blocks,
                                                                  strict=True)), "missing KV blocks"
        width = max(num_blocks)
        table = torch.tensor([_padded(s.request.block_ids, width) for s in scheduled],
                             dtype=torch.int32)  # [num_seqs, width]
        meta = self._metadata(starts, q_lens, table, self.block_size)
        rows = [i for i, s in enumerate(scheduled) if s.samples]
        ends = torch.tensor(q_lens).cumsum(0)  # [num_seqs] one past each sequence's last token
        requests = [scheduled[i].request for i in rows]
        return StepBatch(
            input_ids=torch.tensor(token_ids, dtype=torch.int64).to(self.device),
            meta=meta,
            logits_indices=(ends[rows] - 1).to(self.device),
            sampling=SamplingBatch.build(requests, self.vocab_size, self.config.seed,
                                         self.device) if requests else None,
            sampling_ids=[r.request_id for r in requests],
        )

    def _metadata(self, starts: list[int], q_lens: list[int], table: torch.Tensor,
                  bs: int) -> AttentionMetadata:
        """Positions and cache slots of every token of the flat batch, built on the CPU."""
        q_lens_t, starts_t = torch.tensor(q_lens), torch.tensor(starts)
        query_start_loc = torch.nn.functional.pad(q_lens_t.cumsum(0), (1, 0))  # [num_seqs + 1]
        seq_index = torch.repeat_interleave(torch.arange(len(q_lens)), q_lens_t)  # [num_tokens]
        offsets = torch.arange(int(query_start_loc[-1])) - query_start_loc[seq_index]
        positions = starts_t[seq_index] + offsets  # [num_tokens]
        slots = table[seq_index, positions // bs].long() * bs + positions % bs  # [num_tokens]
        device = self.device
        return AttentionMetadata(
            positions=positions.to(device),
            slot_mapping=slots.to(device),
            block_tables=table.to(device),
            query_start_loc=query_start_loc.to(torch.int32).to(device),
            seq_lens=(starts_t + q_lens_t).to(torch.int32).to(device),
            decode_only=max(q_lens) == 1,
        )


def _padded(block_ids: list[int], width: int) -> list[int]:
    return block_ids[:width] + [0] * (width - len(block_ids))
