"""Which implementation of an op runs: the Triton kernel (GPU) or the PyTorch path (CPU).

`auto` (the default) picks Triton for CUDA tensors and PyTorch otherwise. The environment variable
`EXPERTMESH_KERNEL_BACKEND` (auto|torch|triton) or `set_backend()` forces one; forcing `triton` on CPU
tensors only works under Triton's interpreter (`TRITON_INTERPRET=1`), which is how CI tests the kernels.

`triton_kernels()` names every Triton kernel the project launches and `record_triton_launches()` counts the ones a
block of code launched: how CI (tests/kernels/test_k3_triton_forward.py) and scripts/gpu_smoke.py show that a
model's forward ran each of them.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import pkgutil
import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
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


def _kernel_name(module: str, kernel: str) -> str:
    """'expertmesh.kernels.kda.triton_kda', '_chunk_state_kernel' → 'kda.triton_kda._chunk_state_kernel'."""
    return f"{module.removeprefix('expertmesh.kernels.')}.{kernel}"


def triton_kernels() -> list[str]:
    """Every Triton kernel this project launches (`kernel[grid](...)` in a `kernels/<op>/triton_*.py` module), as
    'op.module.kernel', sorted. Imports those modules (and triton): set TRITON_INTERPRET before calling."""
    from triton.runtime.jit import KernelInterface

    names = []
    for op in pkgutil.iter_modules([str(Path(__file__).parent)]):
        if not op.ispkg:
            continue
        for mod in pkgutil.iter_modules([str(Path(__file__).parent / op.name)]):
            if not mod.name.startswith("triton_"):
                continue
            module = importlib.import_module(f"expertmesh.kernels.{op.name}.{mod.name}")
            source = Path(module.__file__).read_text()
            for attr, value in vars(module).items():
                # launched here, not a helper only other kernels call
                if isinstance(value, KernelInterface) and re.search(rf"\b{re.escape(attr)}\[", source):
                    names.append(_kernel_name(module.__name__, attr))
    return sorted(names)


@contextlib.contextmanager
def record_triton_launches() -> Iterator[Counter]:
    """Count the Triton kernels launched inside the block, compiled or interpreted: {'op.module.kernel': launches}.
    Wraps triton's launch (`KernelInterface.__getitem__`) for the whole process while the block runs."""
    import triton
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction, KernelInterface

    overriding = [c.__name__ for c in (JITFunction, InterpretedFunction) if "__getitem__" in c.__dict__]
    if overriding:  # launches would bypass the wrapper: say so rather than count nothing
        raise RuntimeError(f"triton {triton.__version__}: {overriding} launch without KernelInterface.__getitem__")
    launches: Counter = Counter()
    launch = KernelInterface.__getitem__

    def counted(kernel, grid):
        fn = getattr(kernel, "fn", kernel)
        launches[_kernel_name(fn.__module__, fn.__name__)] += 1
        return launch(kernel, grid)

    KernelInterface.__getitem__ = counted
    try:
        yield launches
    finally:
        KernelInterface.__getitem__ = launch
