"""Shape, dtype, stride and device checks shared by the references and the Triton launchers.

They read tensor metadata only (no `.item()`), so they cost nothing on the GPU stream; a bad
argument fails here with a message rather than as a silent out-of-bounds read in a kernel.
"""

from __future__ import annotations

import torch
from torch import Tensor

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _check_cache(k_cache: Tensor, v_cache: Tensor, k_scale: Tensor | None,
                 v_scale: Tensor | None) -> None:
    _require(k_cache.dim() == 4, "k_cache must be [num_blocks, block_size, num_kv_heads, "
             f"head_dim], got shape {tuple(k_cache.shape)}")
    _require(v_cache.shape == k_cache.shape and v_cache.dtype == k_cache.dtype,
             f"v_cache {tuple(v_cache.shape)} {v_cache.dtype} must match k_cache "
             f"{tuple(k_cache.shape)} {k_cache.dtype}")
    _require(k_cache.is_contiguous() and v_cache.is_contiguous(), "k_cache/v_cache must be contiguous")
    _require((k_scale is None) == (v_scale is None), "pass both k_scale and v_scale, or neither")
    if k_scale is None or v_scale is None:
        _require(k_cache.dtype in FLOAT_DTYPES, f"cache dtype {k_cache.dtype} needs scales or a "
                 "float dtype")
        return
    _require(k_cache.dtype == torch.int8, f"scales given but the cache is {k_cache.dtype}, not int8")
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        _require(scale.shape == k_cache.shape[:3] and scale.dtype == torch.float32
                 and scale.is_contiguous(), f"{name} must be contiguous float32 "
                 f"{tuple(k_cache.shape[:3])}, got {tuple(scale.shape)} {scale.dtype}")


def _check_heads(query: Tensor, k_cache: Tensor) -> None:
    _require(query.dim() == 3, f"query must be [tokens, num_heads, head_dim], got "
             f"{tuple(query.shape)}")
    _require(query.dtype in FLOAT_DTYPES, f"query dtype {query.dtype} is not a float dtype")
    _require(query.stride(-1) == 1, "query's head_dim must be contiguous (stride 1)")
    _require(query.shape[2] == k_cache.shape[3], f"query head_dim {query.shape[2]} != cache "
             f"head_dim {k_cache.shape[3]}")
    num_heads, num_kv_heads = query.shape[1], k_cache.shape[2]
    _require(num_heads % num_kv_heads == 0, f"num_heads {num_heads} must be a multiple of "
             f"num_kv_heads {num_kv_heads}")
    _require(k_cache.dtype == torch.int8 or k_cache.dtype == query.dtype,
             f"cache dtype {k_cache.dtype} != query dtype {query.dtype}")


def _check_index(name: str, t: Tensor, dims: int, device: torch.device) -> None:
    _require(t.dim() == dims and t.dtype in INDEX_DTYPES, f"{name} must be a {dims}-d int32/int64 "
             f"tensor, got {tuple(t.shape)} {t.dtype}")
    _require(t.device == device, f"{name} is on {t.device}, the cache on {device}")
    _require(t.stride(-1) == 1, f"{name}'s last dim must be contiguous")


def check_store_kv(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor,
                   slot_mapping: Tensor, k_scale: Tensor | None, v_scale: Tensor | None) -> None:
    _check_cache(k_cache, v_cache, k_scale, v_scale)
    expected = (slot_mapping.shape[0], k_cache.shape[2], k_cache.shape[3])
    for name, t in (("key", key), ("value", value)):
        _require(tuple(t.shape) == expected, f"{name} must be [tokens, num_kv_heads, head_dim] = "
                 f"{expected}, got {tuple(t.shape)}")
        _require(t.stride(-1) == 1, f"{name}'s head_dim must be contiguous (stride 1)")
        _require(t.dtype in FLOAT_DTYPES, f"{name} dtype {t.dtype} is not a float dtype")
    _check_index("slot_mapping", slot_mapping, 1, k_cache.device)


def check_decode(query: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                 seq_lens: Tensor, k_scale: Tensor | None, v_scale: Tensor | None) -> None:
    _check_cache(k_cache, v_cache, k_scale, v_scale)
    _check_heads(query, k_cache)
    _check_index("block_tables", block_tables, 2, k_cache.device)
    _check_index("seq_lens", seq_lens, 1, k_cache.device)
    num_seqs = query.shape[0]
    _require(block_tables.shape[0] == num_seqs and seq_lens.shape[0] == num_seqs,
             f"decode: query has {num_seqs} sequences, block_tables {block_tables.shape[0]}, "
             f"seq_lens {seq_lens.shape[0]}")


def check_attention(query: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                    query_start_loc: Tensor, seq_lens: Tensor, k_scale: Tensor | None,
                    v_scale: Tensor | None) -> None:
    _check_cache(k_cache, v_cache, k_scale, v_scale)
    _check_heads(query, k_cache)
    _check_index("block_tables", block_tables, 2, k_cache.device)
    _check_index("query_start_loc", query_start_loc, 1, k_cache.device)
    _check_index("seq_lens", seq_lens, 1, k_cache.device)
    num_seqs = seq_lens.shape[0]
    _require(block_tables.shape[0] == num_seqs and query_start_loc.shape[0] == num_seqs + 1,
             f"{num_seqs} sequences need block_tables [{num_seqs}, max_blocks] and "
             f"query_start_loc [{num_seqs + 1}], got {tuple(block_tables.shape)} and "
             f"{tuple(query_start_loc.shape)}")


def check_rms_norm(x: Tensor, residual: Tensor | None, weight: Tensor) -> None:
    _require(x.dim() == 2 and x.dtype in FLOAT_DTYPES, f"x must be a float [tokens, hidden], got "
             f"{tuple(x.shape)} {x.dtype}")
    _require(x.stride(-1) == 1, "x's hidden dim must be contiguous")
    _require(tuple(weight.shape) == (x.shape[1],) and weight.is_contiguous(),
             f"weight must be contiguous [{x.shape[1]}], got {tuple(weight.shape)}")
    if residual is not None:
        _require(residual.shape == x.shape and residual.dtype == x.dtype
                 and residual.stride(-1) == 1, f"residual must match x {tuple(x.shape)} "
                 f"{x.dtype}, got {tuple(residual.shape)} {residual.dtype}")
