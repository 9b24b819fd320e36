"""Triton kernels: paged attention (mixed prefill/decode) and split-K paged decode attention.

Both walk a sequence's block table one KV block per iteration with an online softmax, and both
give one program all the query heads that share a KV head (GQA), so each K/V block is read once
per group rather than once per query head. Rows of a program's query tile are (token, head)
pairs: row r is token r // G, head kv_head * G + r % G. tl.dot needs >= 16 rows, so small groups
are padded with masked rows.

int8 caches: K's per-token scale is applied to the scores and V's to the probabilities, so the
int8 tiles only need a cast (exact in every float dtype) before the matmuls.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _dot(a, b, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr):
    # The interpreter's bf16 x bf16 dot returns garbage (triton 3.9), so interpreted bf16 runs
    # its matmuls in float32; compiled kernels always take the native path.
    if UPCAST_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=DOT_PRECISION)


@triton.jit
def _attend_blocks(
    acc, m_i, l_i, q, q_pos, kv_head, table_ptr, blk_start, blk_end,
    k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
    stride_cb, stride_ct, stride_ch, stride_sb, stride_st, head_dim, scale,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, QUANT: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
):
    """Online-softmax accumulation over KV blocks [blk_start, blk_end) of one block table row.
    Key j is visible to a row iff j <= that row's q_pos (causal, and bounds the context)."""
    offs_n = tl.arange(0, BLOCK_SIZE)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = offs_d[None, :] < head_dim
    for blk in range(blk_start, blk_end):
        block_id = tl.load(table_ptr + blk).to(tl.int64)
        kv_offs = block_id * stride_cb + offs_n[:, None] * stride_ct + kv_head * stride_ch
        k = tl.load(k_cache_ptr + kv_offs + offs_d[None, :], mask=d_mask, other=0.0)
        v = tl.load(v_cache_ptr + kv_offs + offs_d[None, :], mask=d_mask, other=0.0)
        s = _dot(q, tl.trans(k.to(q.dtype)), DOT_PRECISION, UPCAST_DOT) * scale  # [R, N]
        if QUANT:
            scale_offs = block_id * stride_sb + offs_n * stride_st + kv_head
            s = s * tl.load(k_scale_ptr + scale_offs)[None, :]
        key_pos = blk * BLOCK_SIZE + offs_n
        s = tl.where(key_pos[None, :] <= q_pos[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if QUANT:
            p = p * tl.load(v_scale_ptr + scale_offs)[None, :]
        acc = acc * alpha[:, None] + _dot(p.to(q.dtype), v.to(q.dtype), DOT_PRECISION, UPCAST_DOT)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _find_seq(query_start_loc_ptr, tile, num_seqs, BLOCK_M: tl.constexpr):
    """Binary search for the sequence owning query tile `tile`: sequence s owns tiles from
    query_start_loc[s] // BLOCK_M + s, which is increasing in s, so no host sync is needed."""
    # Annotated so both start as int32 values: loop-carried variables must keep one type, and
    # an int argument equal to 1 is specialised to a constant.
    lo: tl.int32 = 0
    hi: tl.int32 = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_M + mid
        if first_tile <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def paged_attention_kernel(
    out_ptr, query_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
    block_tables_ptr, query_start_loc_ptr, seq_lens_ptr, scale, num_seqs, head_dim,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
    stride_cb, stride_ct, stride_ch, stride_sb, stride_st,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, QUANT: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
):
    """Grid (T // BLOCK_M + S, Hkv): a tile of up to BLOCK_M query tokens of one sequence."""
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_seq(query_start_loc_ptr, tile, num_seqs, BLOCK_M)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    first_tok = (tile - (q_start // BLOCK_M + seq)) * BLOCK_M
    if first_tok >= q_len:
        return  # a spare tile: the grid is sized without reading the query lengths
    ctx_start = tl.load(seq_lens_ptr + seq) - q_len  # tokens cached before this chunk
    rows = tl.arange(0, BLOCK_R)
    tok = first_tok + rows // GROUP
    row_mask = (rows < BLOCK_M * GROUP) & (tok < q_len)
    tok = tl.minimum(tok, q_len - 1)  # padded rows repeat a real one: no all-masked rows
    head = kv_head * GROUP + rows % GROUP
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = offs_d[None, :] < head_dim
    q_offs = (q_start + tok).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh
    q = tl.load(query_ptr + q_offs + offs_d[None, :], mask=d_mask, other=0.0)
    acc = tl.zeros([BLOCK_R, HEAD_DIM_PAD], dtype=tl.float32)
    m_i = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_R], dtype=tl.float32)
    last_pos = ctx_start + tl.minimum(first_tok + BLOCK_M, q_len) - 1
    acc, m_i, l_i = _attend_blocks(
        acc, m_i, l_i, q, ctx_start + tok, kv_head, block_tables_ptr + seq * stride_bt,
        0, last_pos // BLOCK_SIZE + 1, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
        stride_cb, stride_ct, stride_ch, stride_sb, stride_st, head_dim, scale,
        BLOCK_SIZE, HEAD_DIM_PAD, QUANT, DOT_PRECISION, UPCAST_DOT)
    o_offs = (q_start + tok).to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh
    tl.store(out_ptr + o_offs + offs_d[None, :], (acc / l_i[:, None]).to(q.dtype),
             mask=row_mask[:, None] & d_mask)


@triton.jit
def paged_decode_kernel(
    out_ptr, part_acc_ptr, part_ml_ptr, query_ptr, k_cache_ptr, v_cache_ptr,
    k_scale_ptr, v_scale_ptr, block_tables_ptr, seq_lens_ptr, scale, head_dim,
    stride_qs, stride_qh, stride_os, stride_oh, stride_bt,
    stride_cb, stride_ct, stride_ch, stride_sb, stride_st,
    GROUP: tl.constexpr, BLOCK_R: tl.constexpr, BLOCKS_PER_SPLIT: tl.constexpr,
    NUM_SPLITS: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    QUANT: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
):
    """Grid (S, Hkv, NUM_SPLITS): one split of one sequence's context for one head group.
    With one split it writes the output; otherwise unnormalised partials for the combine."""
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    blk_start = split * BLOCKS_PER_SPLIT
    blk_end = tl.minimum(blk_start + BLOCKS_PER_SPLIT, tl.cdiv(seq_len, BLOCK_SIZE))
    rows = tl.arange(0, BLOCK_R)
    row_mask = rows < GROUP
    head = kv_head * GROUP + tl.minimum(rows, GROUP - 1)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = offs_d[None, :] < head_dim
    q = tl.load(query_ptr + seq * stride_qs + head[:, None] * stride_qh + offs_d[None, :],
                mask=d_mask, other=0.0)
    acc = tl.zeros([BLOCK_R, HEAD_DIM_PAD], dtype=tl.float32)
    m_i = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_R], dtype=tl.float32)
    q_pos = tl.zeros([BLOCK_R], dtype=tl.int32) + seq_len - 1
    acc, m_i, l_i = _attend_blocks(
        acc, m_i, l_i, q, q_pos, kv_head, block_tables_ptr + seq * stride_bt, blk_start, blk_end,
        k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
        stride_cb, stride_ct, stride_ch, stride_sb, stride_st, head_dim, scale,
        BLOCK_SIZE, HEAD_DIM_PAD, QUANT, DOT_PRECISION, UPCAST_DOT)
    mask = row_mask[:, None] & d_mask
    if NUM_SPLITS == 1:
        o_offs = seq * stride_os + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(out_ptr + o_offs, (acc / l_i[:, None]).to(q.dtype), mask=mask)
    else:
        # partials: acc [S, Hq, NUM_SPLITS, HEAD_DIM_PAD], (m, l) [S, Hq, NUM_SPLITS, 2]
        part = (seq * tl.num_programs(1) * GROUP + head) * NUM_SPLITS + split
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM_PAD + offs_d[None, :], acc, mask=mask)
        tl.store(part_ml_ptr + part * 2, m_i, mask=row_mask)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=row_mask)


@triton.jit
def combine_splits_kernel(
    out_ptr, part_acc_ptr, part_ml_ptr, head_dim, stride_os, stride_oh,
    NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
):
    """Grid (S, Hq): rescale each split's partial by exp(m_split - m_max) and normalise.
    A split past the context end has m = -inf and l = 0, so it weighs nothing."""
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    part = (seq * tl.num_programs(1) + head) * NUM_SPLITS
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    s_mask = offs_s < NUM_SPLITS
    m = tl.load(part_ml_ptr + (part + offs_s) * 2, mask=s_mask, other=float("-inf"))
    l_split = tl.load(part_ml_ptr + (part + offs_s) * 2 + 1, mask=s_mask, other=0.0)
    weight = tl.exp(m - tl.max(m, axis=0))  # [SPLITS_PAD]
    acc = tl.load(part_acc_ptr + (part + offs_s)[:, None] * HEAD_DIM_PAD + offs_d[None, :],
                  mask=s_mask[:, None], other=0.0)
    out = tl.sum(acc * weight[:, None], axis=0) / tl.sum(l_split * weight, axis=0)
    tl.store(out_ptr + seq * stride_os + head * stride_oh + offs_d,
             out.to(out_ptr.dtype.element_ty), mask=offs_d < head_dim)
