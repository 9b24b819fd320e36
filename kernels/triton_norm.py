"""Triton kernel: residual add fused with RMSNorm over a tile of token rows.

Fusing saves a full read and write of the hidden state per layer: the sum is formed in float32,
written once (the next residual) and normalised from registers. A program takes ROWS rows so
that small hidden sizes still give it a few thousand elements of work.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def fused_add_rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, summed_ptr,
    stride_x, stride_r, stride_o, stride_s, num_rows, hidden, eps,
    ROWS: tl.constexpr, BLOCK_H: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_H)
    col_mask = cols < hidden
    mask = (rows < num_rows)[:, None] & col_mask[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    x = x.to(tl.float32)  # [ROWS, BLOCK_H]
    if HAS_RESIDUAL:
        x += tl.load(residual_ptr + rows[:, None] * stride_r + cols[None, :], mask=mask,
                     other=0.0).to(tl.float32)
        tl.store(summed_ptr + rows[:, None] * stride_s + cols[None, :],
                 x.to(summed_ptr.dtype.element_ty), mask=mask)
    inv_rms = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / hidden + eps)  # [ROWS]
    weight = tl.load(weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    normed = x * inv_rms[:, None] * weight[None, :]
    tl.store(out_ptr + rows[:, None] * stride_o + cols[None, :],
             normed.to(out_ptr.dtype.element_ty), mask=mask)
