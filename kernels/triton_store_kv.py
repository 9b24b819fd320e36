"""Triton kernel: scatter the step's new K/V rows into their paged cache slots.

A program writes TOKENS tokens with all their KV heads (a [TOKENS, heads, head_dim] tile);
padding tokens (slot -1) are masked out. With an int8 cache it quantises each (token, head) row
symmetrically, rounding half to even like `torch.round`, so it agrees with the reference.
"""

from __future__ import annotations

import triton
import triton.language as tl

INT8_MAX = tl.constexpr(127.0)
MIN_SCALE = tl.constexpr(1e-8)  # must match kernels.reference.MIN_SCALE


@triton.jit
def _round_half_even(x):
    r = tl.floor(x + 0.5)
    is_tie = (r - x) == 0.5
    is_odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    return tl.where(is_tie & is_odd, r - 1.0, r)


@triton.jit
def _store_rows(rows, dst_ptr, scale_ptr, cache_offs, scale_offs, mask, scale_mask,
                QUANT: tl.constexpr):
    """Write a [TOKENS, heads, head_dim] tile into the cache (quantised when QUANT)."""
    if QUANT:
        rows32 = rows.to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(rows32), axis=2) / INT8_MAX, MIN_SCALE)
        # div_rn: the correctly rounded division torch does; the fast one could flip a rounding
        quant = _round_half_even(tl.div_rn(rows32, scale[:, :, None]))
        quant = tl.minimum(tl.maximum(quant, -INT8_MAX), INT8_MAX)
        tl.store(dst_ptr + cache_offs, quant.to(tl.int8), mask=mask)
        tl.store(scale_ptr + scale_offs, scale, mask=scale_mask)
    else:
        tl.store(dst_ptr + cache_offs, rows.to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_ct, stride_ch, stride_sb, stride_st,
    num_tokens, num_kv_heads, head_dim,
    TOKENS: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEADS_PAD: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr, QUANT: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64) * TOKENS + tl.arange(0, TOKENS)
    slot = tl.load(slot_mapping_ptr + tok, mask=tok < num_tokens, other=-1).to(tl.int64)
    block, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    scale_mask = (slot >= 0)[:, None] & (heads < num_kv_heads)[None, :]  # [TOKENS, HEADS_PAD]
    mask = scale_mask[:, :, None] & (dims < head_dim)[None, None, :]
    row = (block * stride_cb + offset * stride_ct)[:, None] + heads[None, :] * stride_ch
    cache_offs = row[:, :, None] + dims[None, None, :]  # [TOKENS, HEADS_PAD, HEAD_DIM_PAD]
    scale_offs = (block * stride_sb + offset * stride_st)[:, None] + heads[None, :]
    k = tl.load(key_ptr + (tok[:, None] * stride_kt + heads[None, :] * stride_kh)[:, :, None]
                + dims[None, None, :], mask=mask, other=0.0)
    _store_rows(k, k_cache_ptr, k_scale_ptr, cache_offs, scale_offs, mask, scale_mask, QUANT)
    v = tl.load(value_ptr + (tok[:, None] * stride_vt + heads[None, :] * stride_vh)[:, :, None]
                + dims[None, None, :], mask=mask, other=0.0)
    _store_rows(v, v_cache_ptr, v_scale_ptr, cache_offs, scale_offs, mask, scale_mask, QUANT)
