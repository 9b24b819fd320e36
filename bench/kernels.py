"""Kernel benchmark (GPU only): paged decode/prefill attention at Llama-3-8B shapes.

Decode: achieved memory bandwidth (K/V bytes read / time) as a fraction of the device's peak,
for the Triton kernel, PyTorch SDPA over K/V already gathered into contiguous tensors (the
dense lower bound a paged kernel tries to match), and the PyTorch reference (gather + SDPA).
Prefill: causal attention TFLOP/s for the same three.

    python bench/kernels.py [--dtype float16] [--batch 64] [--context 4096] [--peak-gbps N]

On a machine without CUDA it says so and exits 0.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

# This file is named kernels.py: drop its folder from the path so `import kernels` finds the
# package, not this script.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import Tensor  # noqa: E402

# Llama-3-8B attention
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128
# Published peak HBM bandwidth (GB/s) where the driver's clock x bus width is unavailable.
PEAK_GBPS = {"H200": 4800.0, "H100 SXM": 3350.0, "H100 PCIe": 2000.0, "H100": 3350.0,
             "A100-SXM4-80GB": 2039.0, "A100": 1555.0, "L40S": 864.0, "L4": 300.0}


def peak_bandwidth_gbps(override: float | None) -> float:
    if override:
        return override
    props = torch.cuda.get_device_properties(0)
    clock_khz = getattr(props, "memory_clock_rate", 0)
    bus_bits = getattr(props, "memory_bus_width", 0)
    if clock_khz and bus_bits:
        return 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9  # double data rate
    for name, gbps in PEAK_GBPS.items():
        if name in props.name:
            return gbps
    raise SystemExit(f"unknown peak bandwidth for {props.name}; pass --peak-gbps")


def bench_ms(fn: Callable[[], object]) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=200))


def paged_kv(num_seqs: int, context: int, block_size: int, dtype: torch.dtype
             ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Caches with each sequence's blocks scattered at random, its table and lengths."""
    blocks_per_seq = context // block_size
    num_blocks = num_seqs * blocks_per_seq
    shape = (num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, device="cuda", dtype=dtype)
    v_cache = torch.randn(shape, device="cuda", dtype=dtype)
    tables = torch.randperm(num_blocks, device="cuda", dtype=torch.int32)
    tables = tables.view(num_seqs, blocks_per_seq)  # [S, max_blocks]
    seq_lens = torch.full((num_seqs,), context, device="cuda", dtype=torch.int32)
    return k_cache, v_cache, tables, seq_lens


def gathered(cache: Tensor, tables: Tensor) -> Tensor:
    """[S, Hkv, L, D] contiguous copy of each sequence's context, made outside the timing."""
    rows = cache[tables.long()].flatten(1, 2)  # [S, L, Hkv, D]
    return rows.transpose(1, 2).contiguous()


def bench_decode(args: argparse.Namespace, dtype: torch.dtype, peak: float) -> None:
    from kernels import get_ops

    triton_ops, ref_ops = get_ops("triton", "cuda"), get_ops("torch")
    k_cache, v_cache, tables, seq_lens = paged_kv(args.batch, args.context, args.block_size, dtype)
    query = torch.randn(args.batch, NUM_HEADS, HEAD_DIM, device="cuda", dtype=dtype)
    scale = HEAD_DIM ** -0.5
    k_dense, v_dense = gathered(k_cache, tables), gathered(v_cache, tables)
    group = NUM_HEADS // NUM_KV_HEADS
    # A KV head's query heads as its G "query rows": dense GQA without repeating K/V.
    q_dense = query.view(args.batch, NUM_KV_HEADS, group, HEAD_DIM)  # [S, Hkv, G, D]
    runs = {
        "triton": lambda: triton_ops.paged_decode_attention(query, k_cache, v_cache, tables,
                                                            seq_lens, scale),
        "sdpa (gathered K/V)": lambda: F.scaled_dot_product_attention(q_dense, k_dense, v_dense,
                                                                      scale=scale),
        "reference": lambda: ref_ops.paged_decode_attention(query, k_cache, v_cache, tables,
                                                            seq_lens, scale),
    }
    expected = runs["sdpa (gathered K/V)"]().reshape(args.batch, NUM_HEADS, HEAD_DIM)
    torch.testing.assert_close(runs["triton"](), expected, atol=2e-2, rtol=2e-2)
    kv_bytes = 2 * k_cache.numel() * k_cache.element_size()  # every cached K and V read once
    print(f"decode  batch {args.batch} x context {args.context}, {dtype}, block {args.block_size},"
          f" K/V {kv_bytes / 1e9:.2f} GB, peak {peak:.0f} GB/s")
    times = {name: bench_ms(fn) for name, fn in runs.items()}
    for name, ms in times.items():
        gbps = kv_bytes / (ms * 1e-3) / 1e9
        print(f"  {name:22s} {ms * 1e3:9.1f} us  {gbps:8.0f} GB/s  {gbps / peak:6.1%} of peak")
    print(f"  triton vs sdpa: {times['sdpa (gathered K/V)'] / times['triton']:.2f}x,"
          f" vs reference: {times['reference'] / times['triton']:.2f}x")


def bench_prefill(args: argparse.Namespace, dtype: torch.dtype) -> None:
    from kernels import get_ops

    triton_ops, ref_ops = get_ops("triton", "cuda"), get_ops("torch")
    num_seqs, length = args.prefill_batch, args.prefill_len
    k_cache, v_cache, tables, seq_lens = paged_kv(num_seqs, length, args.block_size, dtype)
    query = torch.randn(num_seqs * length, NUM_HEADS, HEAD_DIM, device="cuda", dtype=dtype)
    qsl = torch.arange(0, num_seqs + 1, device="cuda", dtype=torch.int32) * length
    scale = HEAD_DIM ** -0.5
    # K/V repeated per query head outside the timing: prefill is compute-bound, so the copy
    # costs the baseline nothing, and every SDPA backend takes it.
    group = NUM_HEADS // NUM_KV_HEADS
    k_dense = gathered(k_cache, tables).repeat_interleave(group, 1)  # [S, Hq, L, D]
    v_dense = gathered(v_cache, tables).repeat_interleave(group, 1)  # [S, Hq, L, D]
    q_dense = query.view(num_seqs, length, NUM_HEADS, HEAD_DIM).transpose(1, 2)  # [S, Hq, L, D]
    runs = {
        "triton": lambda: triton_ops.paged_attention(query, k_cache, v_cache, tables, qsl,
                                                     seq_lens, scale),
        "sdpa (gathered K/V)": lambda: F.scaled_dot_product_attention(
            q_dense, k_dense, v_dense, is_causal=True, scale=scale),
        "reference": lambda: ref_ops.paged_attention(query, k_cache, v_cache, tables, qsl,
                                                     seq_lens, scale),
    }
    expected = runs["sdpa (gathered K/V)"]().transpose(1, 2).reshape(-1, NUM_HEADS, HEAD_DIM)
    torch.testing.assert_close(runs["triton"](), expected, atol=2e-2, rtol=2e-2)
    # causal: query p sees p + 1 keys; QK^T and PV are 2 * D flops per (query, key, head) each
    flops = 4 * HEAD_DIM * NUM_HEADS * num_seqs * length * (length + 1) / 2
    print(f"prefill {num_seqs} x {length} tokens, {dtype}: {flops / 1e12:.2f} TFLOP")
    times = {name: bench_ms(fn) for name, fn in runs.items()}
    for name, ms in times.items():
        print(f"  {name:22s} {ms:9.3f} ms  {flops / (ms * 1e-3) / 1e12:7.1f} TFLOP/s")
    print(f"  triton vs sdpa: {times['sdpa (gathered K/V)'] / times['triton']:.2f}x,"
          f" vs reference: {times['reference'] / times['triton']:.2f}x")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=["float16", "bfloat16"], default="float16")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--prefill-batch", type=int, default=4)
    parser.add_argument("--prefill-len", type=int, default=2048)
    parser.add_argument("--peak-gbps", type=float, default=None,
                        help="the device's peak memory bandwidth, if it cannot be read")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/kernels.py needs a CUDA GPU (Triton kernels on GPU memory); none found, "
              "skipping.")
        return 0
    dtype = getattr(torch, args.dtype)
    print(f"device: {torch.cuda.get_device_name(0)}")
    bench_decode(args, dtype, peak_bandwidth_gbps(args.peak_gbps))
    bench_prefill(args, dtype)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
