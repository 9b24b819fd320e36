"""Contract tests for store_kv, fused_add_rms_norm and the launchers' argument checks."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from kernels import KernelOps, get_ops
from kernels.reference import quantize_int8

SENTINEL = 7.0


def _caches(num_blocks: int, block_size: int, heads: int, head_dim: int, dtype: torch.dtype,
            device: torch.device) -> tuple[Tensor, Tensor]:
    shape = (num_blocks, block_size, heads, head_dim)
    fill = 0 if dtype == torch.int8 else SENTINEL
    return (torch.full(shape, fill, dtype=dtype, device=device),
            torch.full(shape, fill, dtype=dtype, device=device))


def _slots(num_tokens: int, num_slots: int, gen: torch.Generator) -> Tensor:
    """Distinct random slots with every third token padding (-1)."""
    slots = torch.randperm(num_slots, generator=gen)[:num_tokens]
    slots[::3] = -1
    return slots


@pytest.mark.parametrize(("block_size", "head_dim", "dtype"), [
    (16, 64, torch.float32), (32, 128, torch.float16), (16, 128, torch.bfloat16)])
def test_store_kv_writes_slots_and_skips_padding(ops: KernelOps, device: torch.device,
                                                 block_size: int, head_dim: int,
                                                 dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    heads, num_blocks = 4, 5
    # K and V as strided views of one fused projection, as a model produces them
    kv = torch.randn(13, 2, heads, head_dim, generator=gen).to(dtype).to(device)
    key, value = kv[:, 0], kv[:, 1]  # [T, Hkv, D], token stride 2 * Hkv * D
    slots = _slots(13, num_blocks * block_size, gen).to(device)
    k_cache, v_cache = _caches(num_blocks, block_size, heads, head_dim, dtype, device)
    ops.store_kv(key, value, k_cache, v_cache, slots)
    keep = slots >= 0
    flat_k, flat_v = k_cache.view(-1, heads, head_dim), v_cache.view(-1, heads, head_dim)
    assert torch.equal(flat_k[slots[keep]], key[keep])
    assert torch.equal(flat_v[slots[keep]], value[keep])
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool, device=device)
    untouched[slots[keep]] = False
    assert bool((flat_k[untouched] == SENTINEL).all()) and bool((flat_v[untouched] == SENTINEL).all())


@pytest.mark.parametrize(("block_size", "head_dim"), [(16, 64), (32, 128)])
def test_store_kv_int8_quantises_per_token_and_head(ops: KernelOps, device: torch.device,
                                                    block_size: int, head_dim: int) -> None:
    gen = torch.Generator().manual_seed(1)
    heads, num_blocks = 2, 4
    key = torch.randn(11, heads, head_dim, generator=gen, device="cpu").to(device)
    value = (torch.randn(11, heads, head_dim, generator=gen) * 3).to(device)
    value[2] = 0.0  # an all-zero row must not divide by zero
    slots = _slots(11, num_blocks * block_size, gen).to(device)
    k_cache, v_cache = _caches(num_blocks, block_size, heads, head_dim, torch.int8, device)
    k_scale = torch.zeros(num_blocks, block_size, heads, device=device)
    v_scale = torch.zeros_like(k_scale)
    ops.store_kv(key, value, k_cache, v_cache, slots, k_scale, v_scale)
    keep = slots >= 0
    for rows, cache, scale in ((key, k_cache, k_scale), (value, v_cache, v_scale)):
        want_q, want_scale = quantize_int8(rows[keep])
        got_q = cache.view(-1, heads, head_dim)[slots[keep]]
        got_scale = scale.view(-1, heads)[slots[keep]]
        torch.testing.assert_close(got_scale, want_scale)
        # Ties may round differently only by float division error: one step at most.
        assert int((got_q.int() - want_q.int()).abs().max()) <= 1
        error = (got_q.float() * got_scale.unsqueeze(-1) - rows[keep]).abs()
        assert bool((error <= got_scale.unsqueeze(-1) * 0.5 + 1e-6).all())


def test_store_kv_then_attention_round_trip(ops: KernelOps, device: torch.device) -> None:
    """A prompt written with store_kv and read back by paged_attention equals dense attention."""
    gen = torch.Generator().manual_seed(2)
    seq_len, heads, group, head_dim, block_size = 37, 2, 4, 64, 16
    q = torch.randn(seq_len, heads * group, head_dim, generator=gen).to(device)
    k = torch.randn(seq_len, heads, head_dim, generator=gen).to(device)
    v = torch.randn(seq_len, heads, head_dim, generator=gen).to(device)
    k_cache, v_cache = _caches(6, block_size, heads, head_dim, torch.float32, device)
    table = torch.tensor([[4, 0, 5, 2]], dtype=torch.int32, device=device)
    pos = torch.arange(seq_len, device=device)
    ops.store_kv(k, v, k_cache, v_cache, table[0, pos // block_size].long() * block_size
                 + pos % block_size)
    qsl = torch.tensor([0, seq_len], dtype=torch.int32, device=device)
    lens = torch.tensor([seq_len], dtype=torch.int32, device=device)
    out = ops.paged_attention(q, k_cache, v_cache, table, qsl, lens, head_dim ** -0.5)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.repeat_interleave(group, 1).transpose(0, 1),
        v.repeat_interleave(group, 1).transpose(0, 1), is_causal=True).transpose(0, 1)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("hidden", [64, 256, 100])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("with_residual", [True, False], ids=["residual", "no-residual"])
def test_fused_add_rms_norm(ops: KernelOps, device: torch.device, hidden: int,
                            dtype: torch.dtype, with_residual: bool) -> None:
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(7, hidden, generator=gen) * 2).to(dtype).to(device)
    residual = torch.randn(7, hidden, generator=gen).to(dtype).to(device) if with_residual else None
    weight = torch.rand(hidden, generator=gen).to(dtype).to(device) + 0.5
    out, summed = ops.fused_add_rms_norm(x, residual, weight, 1e-6)
    s64 = x.double() + (residual.double() if residual is not None else 0.0)
    want = s64 * torch.rsqrt(s64.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.double()
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    assert out.dtype == dtype and summed.dtype == dtype
    torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)
    torch.testing.assert_close(summed.double(), s64, atol=tol, rtol=tol)


def test_launchers_reject_bad_arguments(ops: KernelOps, device: torch.device) -> None:
    cache = torch.zeros(4, 16, 2, 64, device=device)
    table = torch.zeros(1, 4, dtype=torch.int32, device=device)
    lens = torch.ones(1, dtype=torch.int32, device=device)
    bad_heads = torch.zeros(1, 3, 64, device=device)  # 3 query heads over 2 KV heads
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        ops.paged_decode_attention(bad_heads, cache, cache, table, lens, 1.0)
    with pytest.raises(ValueError, match="head_dim"):
        ops.paged_decode_attention(torch.zeros(1, 2, 32, device=device), cache, cache, table,
                                   lens, 1.0)
    with pytest.raises(ValueError, match="contiguous"):
        strided = cache.transpose(1, 2)
        ops.store_kv(torch.zeros(1, 16, 64, device=device), torch.zeros(1, 16, 64, device=device),
                     strided, strided, torch.zeros(1, dtype=torch.long, device=device))
    with pytest.raises(ValueError, match="both k_scale and v_scale"):
        ops.paged_decode_attention(torch.zeros(1, 2, 64, device=device), cache, cache, table,
                                   lens, 1.0, k_scale=torch.ones(4, 16, 2, device=device))
    with pytest.raises(ValueError, match="query_start_loc"):
        ops.paged_attention(torch.zeros(1, 2, 64, device=device), cache, cache, table,
                            lens, lens, 1.0)  # query_start_loc needs S + 1 entries
    with pytest.raises(ValueError, match="weight"):
        ops.fused_add_rms_norm(torch.zeros(2, 8, device=device), None,
                               torch.ones(4, device=device), 1e-6)


def test_get_ops_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_ops("cuda-graphs")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        get_ops("triton", "cpu")


def test_triton_launcher_refuses_cpu_tensors_without_interpreter(
        monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("triton")
    from kernels import triton_ops

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="CUDA tensors"):
        triton_ops.fused_add_rms_norm(torch.zeros(2, 8), None, torch.ones(8), 1e-6)
