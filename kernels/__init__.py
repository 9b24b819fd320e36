"""fairgate-package: kernels

Kernels for the engine's hot paths: each Triton kernel beside a PyTorch reference.

`get_ops("torch")` returns the references (CPU engine, and the contract the kernels are tested
against); `get_ops("triton")` the Triton launchers, which check shapes, dtypes and strides before
launching. Triton is imported only for "triton", so a CPU-only install never needs it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

BACKENDS = ("torch", "triton")


@dataclass(frozen=True)
class KernelOps:
    store_kv: Callable[..., None]
    paged_attention: Callable[..., torch.Tensor]
    paged_decode_attention: Callable[..., torch.Tensor]
    fused_add_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]


def triton_interpreted() -> bool:
    """TRITON_INTERPRET=1 runs Triton kernels on CPU tensors (slowly): how CI tests them."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def resolve_backend(backend: str, device: torch.device | str) -> str:
    """"auto" -> "triton" on CUDA when Triton imports, else "torch"; others pass through."""
    if backend != "auto":
        return backend
    if torch.device(device).type != "cuda":
        return "torch"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "torch"
    return "triton"


def get_ops(backend: str, device: torch.device | str | None = None) -> KernelOps:
    """The kernel set for `backend` ("torch" or "triton"). With `device`, also refuses Triton on
    CPU unless TRITON_INTERPRET=1 (set before this call: Triton reads it when kernels are defined)."""
    if backend == "torch":
        from kernels import reference as ops_module
    elif backend == "triton":
        ops_module = _import_triton_ops(device)
    else:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {BACKENDS}")
    return KernelOps(
        store_kv=ops_module.store_kv,
        paged_attention=ops_module.paged_attention,
        paged_decode_attention=ops_module.paged_decode_attention,
        fused_add_rms_norm=ops_module.fused_add_rms_norm,
    )


def _import_triton_ops(device: torch.device | str | None) -> Any:
    if device is not None and torch.device(device).type != "cuda" and not triton_interpreted():
        raise ValueError(f"the triton backend on {device} needs TRITON_INTERPRET=1 (set before "
                         "start-up); use attention_backend='torch' on CPU")
    try:
        from kernels import triton_ops
    except ImportError as exc:
        raise ValueError(f"attention_backend='triton' needs the triton package: {exc}") from exc
    return triton_ops


__all__ = ["BACKENDS", "KernelOps", "get_ops", "resolve_backend", "triton_interpreted"]
