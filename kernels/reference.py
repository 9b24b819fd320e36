"""PyTorch references for every kernel: the contract the Triton kernels are tested against.

They also run in the CPU engine's hot path, so they gather whole blocks with one index op and
hand the math to `scaled_dot_product_attention`; the only Python loop is over prefill sequences.

Cache layout per layer: `k_cache`, `v_cache` are `[num_blocks, block_size, num_kv_heads, head_dim]`;
slot = block_id * block_size + offset. With an int8 cache, `k_scale`/`v_scale` are float32
`[num_blocks, block_size, num_kv_heads]` and a value dequantises as `int8 * scale`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels.checks import check_attention, check_decode, check_rms_norm, check_store_kv

INT8_MAX = 127.0
# Smallest scale a quantised row gets: an all-zero row must not divide by zero.
MIN_SCALE = 1e-8


def quantize_int8(x: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric per-row int8 over the last dim: returns (int8 values, float32 scale = absmax/127)."""
    x32 = x.float()
    scale = (x32.abs().amax(dim=-1) / INT8_MAX).clamp_min(MIN_SCALE)
    q = torch.round(x32 / scale.unsqueeze(-1)).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def store_kv(
    key: Tensor,
    value: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_mapping: Tensor,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
) -> None:
    """Write token t's K/V rows into cache slot `slot_mapping[t]` (-1: padding, skipped)."""
    check_store_kv(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    num_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_rows, v_rows = key[keep], value[keep]  # [kept, num_kv_heads, head_dim]
    if k_scale is not None and v_scale is not None:
        k_rows, k_s = quantize_int8(k_rows)
        v_rows, v_s = quantize_int8(v_rows)
        k_scale.view(-1, num_heads).index_copy_(0, slots, k_s)
        v_scale.view(-1, num_heads).index_copy_(0, slots, v_s)
    k_cache.view(-1, num_heads, head_dim).index_copy_(0, slots, k_rows.to(k_cache.dtype))
    v_cache.view(-1, num_heads, head_dim).index_copy_(0, slots, v_rows.to(v_cache.dtype))


def _gather(cache: Tensor, scale: Tensor | None, blocks: Tensor) -> Tensor:
    """Blocks `[..., n]` of one cache -> float32 `[..., n * block_size, num_kv_heads, head_dim]`."""
    rows = cache[blocks].float()  # [..., n, block_size, num_kv_heads, head_dim]
    if scale is not None:
        rows = rows * scale[blocks].unsqueeze(-1)
    return rows.flatten(-4, -3)  # [..., n * block_size, num_kv_heads, head_dim]


def _used_blocks(block_tables: Tensor, seq_lens: Tensor, block_size: int) -> Tensor:
    """The first max-needed columns of the table, with unused tail entries replaced by block 0
    (the caller promises nothing about them, so they may be out of range)."""
    max_blocks = int((seq_lens.max().item() + block_size - 1) // block_size)
    table = block_tables[:, :max_blocks].long()  # [num_seqs, max_blocks]
    needed = (seq_lens.long().unsqueeze(1) + block_size - 1) // block_size
    column = torch.arange(max_blocks, device=table.device)
    return torch.where(column < needed, table, 0)


def paged_decode_attention(
    query: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    scale: float,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
) -> Tensor:
    """One query per sequence at position seq_len - 1, over its whole context. -> [S, Hq, D]."""
    check_decode(query, k_cache, v_cache, block_tables, seq_lens, k_scale, v_scale)
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    blocks = _used_blocks(block_tables, seq_lens, block_size)
    k = _gather(k_cache, k_scale, blocks).transpose(1, 2)  # [S, Hkv, L, D]
    v = _gather(v_cache, v_scale, blocks).transpose(1, 2)  # [S, Hkv, L, D]
    positions = torch.arange(k.shape[2], device=query.device)
    valid = positions.unsqueeze(0) < seq_lens.long().unsqueeze(1)  # [S, L]
    # The query heads of one KV head become that head's rows, so no K/V is repeated for GQA.
    q = query.float().view(num_seqs, num_kv_heads, group, head_dim)  # [S, Hkv, G, D]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=valid[:, None, None, :], scale=scale)
    return out.reshape(num_seqs, num_heads, head_dim).to(query.dtype)  # [S, Hq, D]


def _prefill_one(query: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """Causal attention of q_len queries that are the last q_len of `k`'s positions."""
    q_len, num_heads, head_dim = query.shape
    ctx_len, num_kv_heads = k.shape[0], k.shape[1]
    group = num_heads // num_kv_heads
    q_pos = torch.arange(ctx_len - q_len, ctx_len, device=query.device)
    mask = torch.arange(ctx_len, device=query.device).unsqueeze(0) <= q_pos.unsqueeze(1)
    # [Hkv, G * q_len, D]: a KV head's query heads stacked along the query axis
    q = query.float().view(q_len, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
    q = q.reshape(num_kv_heads, group * q_len, head_dim)
    out = F.scaled_dot_product_attention(
        q, k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask.repeat(group, 1), scale=scale
    )  # [Hkv, G * q_len, D]
    out = out.view(num_kv_heads, group, q_len, head_dim).permute(2, 0, 1, 3)
    return out.reshape(q_len, num_heads, head_dim)  # [q_len, Hq, D]


def paged_attention(
    query: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    query_start_loc: Tensor,
    seq_lens: Tensor,
    scale: float,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
) -> Tensor:
    """Mixed prefill/decode batch: the q_len queries of sequence s sit at positions
    seq_len - q_len .. seq_len - 1 and attend causally to its cached keys. -> [T, Hq, D]."""
    check_attention(query, k_cache, v_cache, block_tables, query_start_loc, seq_lens,
                    k_scale, v_scale)
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    out = torch.empty_like(query)
    is_decode = q_lens == 1
    if bool(is_decode.any()):
        # Decodes run batched; their queries are the single rows at their start offsets.
        rows = query_start_loc[:-1][is_decode].long()
        out[rows] = paged_decode_attention(
            query[rows], k_cache, v_cache, block_tables[is_decode], seq_lens[is_decode], scale,
            k_scale, v_scale)
    block_size = k_cache.shape[1]
    starts, ends, lens = query_start_loc.tolist(), query_start_loc[1:].tolist(), seq_lens.tolist()
    for s, (start, end, seq_len) in enumerate(zip(starts, ends, lens, strict=False)):
        if end - start <= 1:
            continue
        blocks = block_tables[s, : (seq_len + block_size - 1) // block_size].long()
        k = _gather(k_cache, k_scale, blocks)[:seq_len]  # [seq_len, Hkv, D]
        v = _gather(v_cache, v_scale, blocks)[:seq_len]  # [seq_len, Hkv, D]
        out[start:end] = _prefill_one(query[start:end], k, v, scale).to(query.dtype)
    return out


def fused_add_rms_norm(
    x: Tensor, residual: Tensor | None, weight: Tensor, eps: float
) -> tuple[Tensor, Tensor]:
    """(rmsnorm(x + residual) * weight, x + residual); with no residual, (rmsnorm(x) * weight, x).
    The sum is formed in float32 and normalised before rounding; the returned sum is rounded."""
    check_rms_norm(x, residual, weight)
    s32 = x.float() if residual is None else x.float() + residual.float()
    normed = s32 * torch.rsqrt(s32.pow(2).mean(dim=-1, keepdim=True) + eps)
    summed = x if residual is None else s32.to(x.dtype)
    return (normed * weight.float()).to(x.dtype), summed
