"""The `ops` fixture: every kernel implementation the contract suite runs against the oracle."""

from __future__ import annotations

import pytest
import torch

from kernels import KernelOps, get_ops, triton_interpreted


def _triton_runnable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available() or triton_interpreted()


IMPLEMENTATIONS = [
    pytest.param("torch", id="reference"),
    pytest.param("triton", id="triton", marks=pytest.mark.skipif(
        not _triton_runnable(), reason="Triton needs CUDA or TRITON_INTERPRET=1")),
]


@pytest.fixture(scope="session")
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(params=IMPLEMENTATIONS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def ops(backend: str, device: torch.device) -> KernelOps:
    return get_ops(backend, device)
