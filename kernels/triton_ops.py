"""Launchers for the Triton kernels: same signatures as `kernels.reference`.

Each checks shapes, dtypes and strides (kernels.checks), that the tensors can run Triton at all
(CUDA, or CPU under TRITON_INTERPRET=1), picks tile sizes and launches. Nothing here reads tensor
data on the host, so a launch never waits for the GPU.
"""

from __future__ import annotations

import torch
import triton
from torch import Tensor

from kernels import triton_interpreted
from kernels.checks import check_attention, check_decode, check_rms_norm, check_store_kv
from kernels.triton_attention import (
    combine_splits_kernel,
    paged_attention_kernel,
    paged_decode_kernel,
)
from kernels.triton_norm import fused_add_rms_norm_kernel
from kernels.triton_store_kv import store_kv_kernel

# Rows of (token, head) pairs a prefill program handles: 64 fills a tensor-core tile without
# wasting many rows on the last, partial tile of a short chunk.
PREFILL_ROWS = 64
# tl.dot's smallest M dimension.
MIN_ROWS = 16
# Decode: split a context only while (sequences x kv heads) leaves the GPU under-occupied
# (~2 programs per SM on an H100), and never below this many blocks per split, so combining the
# partials stays cheap next to reading the K/V.
TARGET_DECODE_PROGRAMS = 256
MIN_BLOCKS_PER_SPLIT = 4
# Elements per program for the row-wise kernels (store_kv, RMSNorm): one row of a large model,
# several rows of a small one, so tiny hidden sizes do not launch thousands of idle programs.
ROW_TILE_ELEMENTS = 4096


def _rows_per_program(row_elements: int) -> int:
    return max(1, ROW_TILE_ELEMENTS // triton.next_power_of_2(row_elements))


def _check_device(*tensors: Tensor | None) -> None:
    for t in tensors:
        if t is not None and t.device.type != "cuda" and not triton_interpreted():
            raise ValueError(f"Triton kernels need CUDA tensors (got {t.device}); on CPU set "
                             "TRITON_INTERPRET=1 before start-up or use the torch backend")


def _check_dot_shapes(k_cache: Tensor) -> None:
    # tl.dot needs every dimension >= 16: block_size is the PV product's inner dimension.
    block_size, head_dim = k_cache.shape[1], k_cache.shape[3]
    if block_size < MIN_ROWS or head_dim < MIN_ROWS:
        raise ValueError(f"Triton attention needs block_size and head_dim >= {MIN_ROWS}, got "
                         f"{block_size} and {head_dim}; use the torch backend")


def _dot_precision(dtype: torch.dtype) -> str | None:
    # float32 models expect float32 attention; the default would round operands to tf32.
    return "ieee" if dtype == torch.float32 else None


def _cache_strides(k_cache: Tensor, k_scale: Tensor | None) -> tuple[int, ...]:
    """(block, token, head) strides of the cache and (block, token) strides of its scales."""
    scale_strides = (k_scale.stride(0), k_scale.stride(1)) if k_scale is not None else (0, 0)
    return (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), *scale_strides)


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
    _check_device(key, k_cache)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    quant = k_scale is not None
    heads_pad, head_dim_pad = triton.next_power_of_2(num_kv_heads), triton.next_power_of_2(head_dim)
    tokens = _rows_per_program(heads_pad * head_dim_pad)
    store_kv_kernel[(triton.cdiv(num_tokens, tokens),)](
        key, value, k_cache, v_cache, k_scale if quant else k_cache,
        v_scale if quant else v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        *_cache_strides(k_cache, k_scale), num_tokens, num_kv_heads, head_dim,
        TOKENS=tokens, BLOCK_SIZE=k_cache.shape[1], HEADS_PAD=heads_pad,
        HEAD_DIM_PAD=head_dim_pad, QUANT=quant,
    )


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
    _check_device(query, k_cache)
    _check_dot_shapes(k_cache)
    num_tokens, num_heads, head_dim = query.shape
    num_seqs, num_kv_heads = seq_lens.shape[0], k_cache.shape[2]
    out = torch.empty_like(query, memory_format=torch.contiguous_format)
    if num_tokens == 0:
        return out
    group = num_heads // num_kv_heads
    block_m = max(1, PREFILL_ROWS // group)
    quant = k_scale is not None
    # Each sequence may leave one partial tile, hence "+ num_seqs" (see _find_seq).
    grid = (num_tokens // block_m + num_seqs, num_kv_heads)
    paged_attention_kernel[grid](
        out, query, k_cache, v_cache, k_scale if quant else k_cache, v_scale if quant else v_cache,
        block_tables, query_start_loc, seq_lens, scale, num_seqs, head_dim,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        *_cache_strides(k_cache, k_scale),
        GROUP=group, BLOCK_M=block_m,
        BLOCK_R=max(MIN_ROWS, triton.next_power_of_2(block_m * group)),
        BLOCK_SIZE=k_cache.shape[1], HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        QUANT=quant, DOT_PRECISION=_dot_precision(query.dtype),
        UPCAST_DOT=triton_interpreted() and query.dtype == torch.bfloat16,
    )
    return out


def decode_num_splits(num_seqs: int, num_kv_heads: int, max_blocks: int) -> int:
    """How many pieces each context is split into, from shapes alone (no host sync)."""
    programs = num_seqs * num_kv_heads
    if programs >= TARGET_DECODE_PROGRAMS:
        return 1
    by_occupancy = triton.cdiv(TARGET_DECODE_PROGRAMS, programs)
    return max(1, min(by_occupancy, max_blocks // MIN_BLOCKS_PER_SPLIT))


def paged_decode_attention(
    query: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    scale: float,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
    num_splits: int | None = None,
) -> Tensor:
    """One query per sequence at position seq_len - 1, over its whole context. -> [S, Hq, D].
    `num_splits` overrides the split-K heuristic (tests use it to cover both paths)."""
    check_decode(query, k_cache, v_cache, block_tables, seq_lens, k_scale, v_scale)
    _check_device(query, k_cache)
    _check_dot_shapes(k_cache)
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads, max_blocks = k_cache.shape[2], block_tables.shape[1]
    out = torch.empty_like(query, memory_format=torch.contiguous_format)
    if num_seqs == 0:
        return out
    splits = num_splits or decode_num_splits(num_seqs, num_kv_heads, max_blocks)
    head_dim_pad = triton.next_power_of_2(head_dim)
    # Partials exist only when splitting; with one split the kernel writes `out` directly.
    part_acc = query.new_empty((num_seqs, num_heads, splits, head_dim_pad) if splits > 1 else (1,),
                               dtype=torch.float32)
    part_ml = query.new_empty((num_seqs, num_heads, splits, 2) if splits > 1 else (1,),
                              dtype=torch.float32)
    quant = k_scale is not None
    group = num_heads // num_kv_heads
    paged_decode_kernel[(num_seqs, num_kv_heads, splits)](
        out, part_acc, part_ml, query, k_cache, v_cache, k_scale if quant else k_cache,
        v_scale if quant else v_cache, block_tables, seq_lens, scale, head_dim,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        *_cache_strides(k_cache, k_scale),
        GROUP=group, BLOCK_R=max(MIN_ROWS, triton.next_power_of_2(group)),
        BLOCKS_PER_SPLIT=triton.cdiv(max_blocks, splits), NUM_SPLITS=splits,
        BLOCK_SIZE=k_cache.shape[1], HEAD_DIM_PAD=head_dim_pad, QUANT=quant,
        DOT_PRECISION=_dot_precision(query.dtype),
        UPCAST_DOT=triton_interpreted() and query.dtype == torch.bfloat16,
    )
    if splits > 1:
        combine_splits_kernel[(num_seqs, num_heads)](
            out, part_acc, part_ml, head_dim, out.stride(0), out.stride(1),
            NUM_SPLITS=splits, SPLITS_PAD=triton.next_power_of_2(splits),
            HEAD_DIM_PAD=head_dim_pad,
        )
    return out


def fused_add_rms_norm(
    x: Tensor, residual: Tensor | None, weight: Tensor, eps: float
) -> tuple[Tensor, Tensor]:
    """(rmsnorm(x + residual) * weight, x + residual); with no residual, (rmsnorm(x) * weight, x)."""
    check_rms_norm(x, residual, weight)
    _check_device(x)
    num_tokens, hidden = x.shape
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    summed = x if residual is None else torch.empty_like(out)
    if num_tokens == 0:
        return out, summed
    rows = _rows_per_program(hidden)
    fused_add_rms_norm_kernel[(triton.cdiv(num_tokens, rows),)](
        x, x if residual is None else residual, weight, out, summed,
        x.stride(0), 0 if residual is None else residual.stride(0), out.stride(0),
        summed.stride(0), num_tokens, hidden, eps,
        ROWS=rows, BLOCK_H=triton.next_power_of_2(hidden), HAS_RESIDUAL=residual is not None,
    )
    return out, summed
