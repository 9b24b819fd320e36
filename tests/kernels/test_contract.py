"""One contract suite for every kernel implementation (reference, Triton under the interpreter).

Each test builds dense per-sequence K/V, scatters it over shuffled cache blocks and compares the
implementation with a float64 oracle computed from the dense tensors, so the reference is checked
as strictly as the kernels. Shapes stay small because the Triton interpreter is slow.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from torch import Tensor

from kernels import KernelOps
from kernels.reference import quantize_int8

NUM_KV_HEADS = 2
# Out-of-range on purpose: kernels must never read a block table entry past a sequence's end.
UNUSED_BLOCK = 10**6
TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}


@dataclass
class PagedBatch:
    query: Tensor  # [T, Hq, D]
    k_cache: Tensor  # [num_blocks, block_size, Hkv, D]
    v_cache: Tensor
    k_scale: Tensor | None  # [num_blocks, block_size, Hkv] when int8
    v_scale: Tensor | None
    block_tables: Tensor  # [S, max_blocks] int32
    query_start_loc: Tensor  # [S + 1] int32
    seq_lens: Tensor  # [S] int32
    expected: Tensor  # [T, Hq, D] float64
    scale: float


def oracle(query: Tensor, keys: list[Tensor], values: list[Tensor], q_lens: list[int],
           scale: float) -> Tensor:
    """Dense causal attention in float64, sequence by sequence, with K/V repeated for GQA."""
    outs, start = [], 0
    for k, v, q_len in zip(keys, values, q_lens, strict=True):
        q = query[start:start + q_len].double()  # [q_len, Hq, D]
        start += q_len
        group = q.shape[1] // k.shape[1]
        k_rep, v_rep = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # [L, Hq, D]
        scores = torch.einsum("qhd,khd->hqk", q, k_rep) * scale
        q_pos = torch.arange(k.shape[0] - q_len, k.shape[0]).unsqueeze(1)
        scores = scores.masked_fill(torch.arange(k.shape[0]).unsqueeze(0) > q_pos, -math.inf)
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v_rep))
    return torch.cat(outs)


def _dense_kv(shape: tuple[int, ...], dtype: torch.dtype, kv_int8: bool,
              gen: torch.Generator) -> tuple[Tensor, Tensor | None, Tensor]:
    """Random K or V rows: (cache values, their scales or None, float64 values the cache holds)."""
    rows = torch.randn(shape, generator=gen)
    if kv_int8:
        quant, scale = quantize_int8(rows)
        return quant, scale, quant.double() * scale.double().unsqueeze(-1)
    rows = rows.to(dtype)
    return rows, None, rows.double()


def make_batch(seq_lens: list[int], q_lens: list[int], *, block_size: int, head_dim: int,
               group: int, dtype: torch.dtype = torch.float32, kv_int8: bool = False,
               device: torch.device | str = "cpu", seed: int = 0) -> PagedBatch:
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3  # a few blocks nobody owns
    owner = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.full((len(seq_lens), max(blocks_per_seq) + 1), UNUSED_BLOCK, dtype=torch.int32)
    cache_dtype = torch.int8 if kv_int8 else dtype
    shape = (num_blocks, block_size, NUM_KV_HEADS, head_dim)
    caches = [torch.zeros(shape, dtype=cache_dtype) for _ in range(2)]
    scales = [torch.ones(shape[:3]) for _ in range(2)] if kv_int8 else None
    dense: list[list[Tensor]] = [[], []]
    for s, (seq_len, n_blocks) in enumerate(zip(seq_lens, blocks_per_seq, strict=True)):
        tables[s, :n_blocks] = torch.tensor([owner.pop() for _ in range(n_blocks)])
        pos = torch.arange(seq_len)
        slots = tables[s, pos // block_size].long() * block_size + pos % block_size
        for i in range(2):
            values, scale, exact = _dense_kv((seq_len, NUM_KV_HEADS, head_dim), dtype, kv_int8, gen)
            caches[i].view(-1, NUM_KV_HEADS, head_dim)[slots] = values
            if scales is not None and scale is not None:
                scales[i].view(-1, NUM_KV_HEADS)[slots] = scale
            dense[i].append(exact)
    query = torch.randn(sum(q_lens), NUM_KV_HEADS * group, head_dim, generator=gen).to(dtype)
    scale = head_dim ** -0.5
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return PagedBatch(
        query.to(device), caches[0].to(device), caches[1].to(device),
        scales[0].to(device) if scales else None, scales[1].to(device) if scales else None,
        tables.to(device), qsl.to(device), torch.tensor(seq_lens, dtype=torch.int32).to(device),
        oracle(query, dense[0], dense[1], q_lens, scale), scale)


def assert_close(actual: Tensor, expected: Tensor, dtype: torch.dtype) -> None:
    assert actual.dtype == dtype
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(actual.cpu().double(), expected, atol=tol, rtol=tol)


def run_attention(ops: KernelOps, b: PagedBatch) -> Tensor:
    return ops.paged_attention(b.query, b.k_cache, b.v_cache, b.block_tables, b.query_start_loc,
                               b.seq_lens, b.scale, b.k_scale, b.v_scale)


def run_decode(ops: KernelOps, b: PagedBatch) -> Tensor:
    return ops.paged_decode_attention(b.query, b.k_cache, b.v_cache, b.block_tables, b.seq_lens,
                                      b.scale, b.k_scale, b.v_scale)


def decode_lens(block_size: int) -> list[int]:
    """Context lengths around block boundaries: 1, one short of, at and one past a boundary,
    and several blocks in."""
    return [1, block_size - 1, block_size, block_size + 1, 4 * block_size + 3]


def mixed_lens(block_size: int) -> tuple[list[int], list[int]]:
    """(seq_lens, q_lens) of a ragged mixed batch: a 1-token prompt, a whole prompt crossing a
    boundary, a chunk after a cached prefix that starts mid-block, and decodes."""
    seq_lens = [1, block_size + 3, 3 * block_size + 7, 2 * block_size, block_size - 1]
    q_lens = [1, block_size + 3, 9, 1, 1]
    return seq_lens, q_lens


SHAPES = [
    pytest.param(bs, hd, g, id=f"bs{bs}-d{hd}-gqa{g}")
    for bs in (16, 32) for hd in (64, 128) for g in (1, 4, 8)
]


@pytest.mark.parametrize(("block_size", "head_dim", "group"), SHAPES)
def test_decode_attention(ops: KernelOps, device: torch.device, block_size: int, head_dim: int,
                          group: int) -> None:
    seq_lens = decode_lens(block_size)
    b = make_batch(seq_lens, [1] * len(seq_lens), block_size=block_size, head_dim=head_dim,
                   group=group, device=device)
    assert_close(run_decode(ops, b), b.expected, torch.float32)


@pytest.mark.parametrize(("block_size", "head_dim", "group"), SHAPES)
def test_paged_attention_mixed_batch(ops: KernelOps, device: torch.device, block_size: int,
                                     head_dim: int, group: int) -> None:
    seq_lens, q_lens = mixed_lens(block_size)
    b = make_batch(seq_lens, q_lens, block_size=block_size, head_dim=head_dim, group=group,
                   device=device)
    assert_close(run_attention(ops, b), b.expected, torch.float32)


@pytest.mark.parametrize("q_len", [1, 5, 16, 40])
def test_prefill_chunk_after_prefix(ops: KernelOps, device: torch.device, q_len: int) -> None:
    """Chunked prefill: the chunk's queries see the whole cached prefix and themselves causally."""
    seq_lens = [q_len + 21, q_len]
    b = make_batch(seq_lens, [q_len, q_len], block_size=16, head_dim=64, group=4, device=device)
    assert_close(run_attention(ops, b), b.expected, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_half_precision(ops: KernelOps, device: torch.device, dtype: torch.dtype) -> None:
    seq_lens, q_lens = mixed_lens(16)
    b = make_batch(seq_lens, q_lens, block_size=16, head_dim=64, group=4, dtype=dtype,
                   device=device)
    assert_close(run_attention(ops, b), b.expected, dtype)
    d = make_batch(decode_lens(16), [1] * 5, block_size=16, head_dim=64, group=4, dtype=dtype,
                   device=device, seed=1)
    assert_close(run_decode(ops, d), d.expected, dtype)


@pytest.mark.parametrize(("block_size", "head_dim", "group"),
                         [(16, 64, 4), (32, 128, 8), (16, 128, 1)])
def test_int8_kv_cache(ops: KernelOps, device: torch.device, block_size: int, head_dim: int,
                       group: int) -> None:
    seq_lens, q_lens = mixed_lens(block_size)
    b = make_batch(seq_lens, q_lens, block_size=block_size, head_dim=head_dim, group=group,
                   kv_int8=True, device=device)
    assert_close(run_attention(ops, b), b.expected, torch.float32)
    d = make_batch(decode_lens(block_size), [1] * 5, block_size=block_size, head_dim=head_dim,
                   group=group, kv_int8=True, device=device, seed=1)
    assert_close(run_decode(ops, d), d.expected, torch.float32)


@pytest.mark.parametrize("num_splits", [2, 3, 7])
def test_decode_split_k(backend: str, ops: KernelOps, device: torch.device,
                        num_splits: int) -> None:
    """Long contexts split across programs: every split count combines to the same answer,
    including splits that lie wholly past a short sequence's end."""
    if backend != "triton":
        pytest.skip("split-K is a Triton launcher option")
    b = make_batch(decode_lens(16), [1] * 5, block_size=16, head_dim=64, group=4, device=device)
    out = ops.paged_decode_attention(b.query, b.k_cache, b.v_cache, b.block_tables, b.seq_lens,
                                     b.scale, num_splits=num_splits)
    assert_close(out, b.expected, torch.float32)
