"""A Llama-family transformer (Llama 2/3, Mistral, Qwen2) over one flat batch of tokens.

Prefill chunks and decodes of many requests are concatenated into one `[num_tokens]` batch.
New keys and values go into each request's KV blocks (`slot_mapping`); attention reads the
cached context through the block table. Attention, cache writes and norms go through
`kernels.get_ops(backend)`, so the same model runs the PyTorch reference or Triton kernels.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.model_config import ModelConfig

# ---------------------------------------------------------------------------------------------
# Rotary position embedding


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = config.rope_scaling
    if scaling.get("rope_type") == "linear":
        return (inv_freq / float(scaling["factor"])).float()
    if scaling.get("rope_type") == "llama3":
        return _llama3_inv_freq(inv_freq, scaling).float()
    return inv_freq.float()


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths slowed by `factor`, a smooth band between."""
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_medium, smoothed, scaled)


def rope_cos_sin(config: ModelConfig, max_position: int, device: torch.device) -> torch.Tensor:
    """`[max_position, head_dim]`: cos in the first half of the last axis, sin in the second."""
    inv_freq = rope_inv_freq(config).to(device)
    positions = torch.arange(max_position, dtype=torch.float32, device=device)
    freqs = torch.outer(positions, inv_freq)  # [max_position, head_dim // 2]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, num_heads, head_dim]; cos, sin: [num_tokens, 1, head_dim // 2]."""
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return rotated.to(x.dtype)


# ---------------------------------------------------------------------------------------------
# Batch metadata and KV cache views


@dataclass
class AttentionMetadata:
    """Where each token of the flat batch sits: built once per step by the runner."""

    positions: torch.Tensor  # [num_tokens] int64
    slot_mapping: torch.Tensor  # [num_tokens] int64, block_id * block_size + offset
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32, context length including this step's tokens
    decode_only: bool  # every sequence runs exactly one token


@dataclass
class LayerKV:
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    k_scale: torch.Tensor | None = None  # int8 cache: [num_blocks, block_size, num_kv_heads]
    v_scale: torch.Tensor | None = None


# ---------------------------------------------------------------------------------------------
# Layers


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, ops: Any) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.scale = config.head_dim**-0.5
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size,
                                  bias=config.attention_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        self.ops = ops

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: LayerKV,
                meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rope(q.view(num_tokens, self.num_heads, self.head_dim), cos, sin)
        k = apply_rope(k.view(num_tokens, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)  # [num_tokens, kv_heads, head_dim]
        self.ops.store_kv(k, v, kv.k_cache, kv.v_cache, meta.slot_mapping, kv.k_scale, kv.v_scale)
        if meta.decode_only:
            out = self.ops.paged_decode_attention(
                q, kv.k_cache, kv.v_cache, meta.block_tables, meta.seq_lens, self.scale,
                kv.k_scale, kv.v_scale)
        else:
            out = self.ops.paged_attention(
                q, kv.k_cache, kv.v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens,
                self.scale, kv.k_scale, kv.v_scale)
        return self.o_proj(out.reshape(num_tokens, self.q_size))  # [num_tokens, hidden]


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size,
                                      bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size,
                                   bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, ops: Any) -> None:
        super().__init__()
        self.self_attn = Attention(config, ops)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.ops = ops

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor, kv: LayerKV, meta: AttentionMetadata,
                ) -> tuple[torch.Tensor, torch.Tensor]:
        norm1, norm2 = self.input_layernorm, self.post_attention_layernorm
        x, residual = self.ops.fused_add_rms_norm(x, residual, norm1.weight, norm1.eps)
        x = self.self_attn(x, cos, sin, kv, meta)
        x, residual = self.ops.fused_add_rms_norm(x, residual, norm2.weight, norm2.eps)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, ops: Any) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, ops) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.ops = ops


class LlamaForCausalLM(nn.Module):
    """Parameter names follow Hugging Face's, except the fused `qkv_proj` and `gate_up_proj`
    (see `PACKED_WEIGHTS`). The rotary table is a plain attribute, built by `init_rope` after
    the weights are in place (it is not a checkpoint tensor)."""

    def __init__(self, config: ModelConfig, ops: Any) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, ops)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.ops = ops
        self.rope_cache = torch.empty(0)

    def init_rope(self, max_position: int) -> None:
        device = self.model.embed_tokens.weight.device
        self.rope_cache = rope_cos_sin(self.config, max_position, device)

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[LayerKV]) -> torch.Tensor:
        """input_ids: [num_tokens] -> final hidden states [num_tokens, hidden]."""
        cos, sin = self.rope_cache[meta.positions].unsqueeze(1).chunk(2, dim=-1)
        x = self.model.embed_tokens(input_ids)  # [num_tokens, hidden]
        residual: torch.Tensor | None = None
        for layer, kv in zip(self.model.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, cos, sin, kv, meta)
        norm = self.model.norm
        x, _ = self.ops.fused_add_rms_norm(x, residual, norm.weight, norm.eps)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [num_rows, hidden] -> float32 logits [num_rows, vocab]."""
        return self.lm_head(hidden).float()


# HF checkpoint name suffix -> (fused parameter suffix, shard index) for the fused projections
PACKED_WEIGHTS: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def packed_shard_rows(config: ModelConfig, fused: str, shard: int) -> tuple[int, int]:
    """(first row, number of rows) of one HF projection inside a fused weight."""
    if fused == "gate_up_proj":
        return shard * config.intermediate_size, config.intermediate_size
    q_size = config.num_heads * config.head_dim
    kv_size = config.num_kv_heads * config.head_dim
    starts = (0, q_size, q_size + kv_size)
    return starts[shard], (q_size, kv_size, kv_size)[shard]
