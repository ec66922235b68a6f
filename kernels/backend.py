"""Which implementation of an op runs: the Triton kernel (GPU) or the PyTorch path (CPU).

`auto` (the default) picks Triton for CUDA tensors and PyTorch otherwise. The environment variable
`EXPERTMESH_KERNEL_BACKEND` (auto|torch|triton) or `set_backend()` forces one; forcing `triton` on CPU
tensors only works under Triton's interpreter (`TRITON_INTERPRET=1`), which is how CI tests the kernels.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Literal

import torch

Backend = Literal["auto", "torch", "triton"]
_VALID = ("auto", "torch", "triton")
_override: Backend | None = None


def _configured() -> Backend:
    if _override is not None:
        return _override
    value = os.environ.get("EXPERTMESH_KERNEL_BACKEND", "auto").strip().lower()
    if value not in _VALID:
        raise ValueError(f"EXPERTMESH_KERNEL_BACKEND={value!r}: expected one of {', '.join(_VALID)}")
    return value  # type: ignore[return-value]


def set_backend(backend: Backend | None) -> None:
    """Force a backend for the whole process (None returns to the environment / auto)."""
    global _override
    if backend is not None and backend not in _VALID:
        raise ValueError(f"backend={backend!r}: expected one of {', '.join(_VALID)}")
    _override = backend


@contextlib.contextmanager
def use_backend(backend: Backend) -> Iterator[None]:
    """Temporarily force a backend (tests, benchmarks)."""
    global _override
    previous = _override
    set_backend(backend)
    try:
        yield
    finally:
        _override = previous


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def triton_interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def resolve(*tensors: torch.Tensor) -> Literal["torch", "triton"]:
    """The backend an op should use for these input tensors."""
    choice = _configured()
    if choice == "auto":
        on_cuda = any(t.is_cuda for t in tensors)
        return "triton" if on_cuda and triton_available() else "torch"
    if choice == "triton" and not triton_available():
        raise RuntimeError("EXPERTMESH_KERNEL_BACKEND=triton but the triton package is not importable")
    return choice
