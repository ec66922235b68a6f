"""The CPU row-norm / rotary kernel (`kernels/norm/cpu/norm_rotary.cpp`): RMSNorm, LayerNorm, KDA's L2
normalisation and RoPE, each one C++ op in place of the dozen ATen ops of its PyTorch form (`naive.py`) — at
small decode batches those ops' dispatch overhead, not their arithmetic, was the cost.

Numerics (see the C++ header comment): fp32 math, bf16 widened exactly and rounded once at the end; each row's sum
in one fixed order (16 lanes, a fixed tree) that depends only on D, rows split between threads but never a row,
so a row's result is bitwise the same alone or in any batch, at any position, on any thread count, and on the
AVX-512, AVX2 and baseline clones alike. Against the PyTorch forms: rotary is bitwise the same (the same fp32
operations on the same operands); the norms agree to fp32 rounding (their sums run in another order), so a bf16
output can differ by one bf16 ulp where the fp32 value sits near a rounding boundary.

x may be a strided view (any leading strides; a last dim without unit stride is copied); the output is a new
contiguous tensor in x's dtype (l2_normalize: fp32). Bad inputs raise TypeError / ValueError naming the tensor
(the checks run in C++, where they cost nothing per call).

Built on first use (kernels/cpu_extension.py); without a compiler, or when the build fails, `available()` is False
after one warning and the model keeps the PyTorch forms. `EXPERTMESH_CPU_NORM_KERNEL=0` turns it off.
"""

from __future__ import annotations

from pathlib import Path

import torch

from expertmesh.kernels.cpu_extension import LazyExtension, switched_on

__all__ = [
    "available",
    "built",
    "enabled",
    "takes",
    "refresh",
    "rms_norm",
    "layer_norm",
    "l2_normalize",
    "rotary",
    "residual_mix",
    "EXTENSION",
]

EXTENSION = LazyExtension(
    "expertmesh_norm_cpu",
    Path(__file__).parent / "cpu" / "norm_rotary.cpp",
    "expertmesh_norm_cpu",
    what="CPU norm / rotary kernel",
    probe="rms_norm",
)
DTYPES = (torch.float32, torch.bfloat16)


def enabled() -> bool:
    """False when `EXPERTMESH_CPU_NORM_KERNEL` is 0/off/false/no/torch."""
    return switched_on("EXPERTMESH_CPU_NORM_KERNEL")


def built() -> bool:
    """The extension is built (building it now if it was not tried yet), enabled or not."""
    return EXTENSION.load() is not None


def available() -> bool:
    """Enabled and built."""
    return enabled() and EXTENSION.load() is not None


_use: bool | None = None  # available(), as the model's first norm found it (refresh() asks again)
_OPS = None


def refresh() -> None:
    """Make the next `takes` ask `available()` again (after changing EXPERTMESH_CPU_NORM_KERNEL in-process)."""
    global _use
    _use = None


def takes(x: torch.Tensor, *params: torch.Tensor) -> bool:
    """Whether the model runs this kernel for `x` (with parameters `params`): a CPU fp32 / bf16 tensor, no gradient
    to track (the op has no backward), the kernel available — asked once per process (`refresh`), since reading
    the environment on every call cost as much as a small op. Otherwise the PyTorch form (naive.py) runs."""
    global _use
    if _use is None:
        _use = available()
    return (
        _use
        and x.is_cpu
        and x.dtype in DTYPES
        and not (torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in params)))
    )


def _ops():
    global _OPS
    if _OPS is None:
        ops = EXTENSION.load()
        if ops is None:
            raise RuntimeError(f"the CPU norm / rotary kernel is not available ({EXTENSION.build_error})")
        _OPS = ops
    return _OPS


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D] fp32 / bf16, weight [D] (any float dtype) → x · rsqrt(mean(x²) + eps) · weight in x's dtype."""
    return _ops().rms_norm(x, weight, float(eps))


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D], weight / bias [D] → (x − mean) · rsqrt(var + eps) · weight + bias in x's dtype."""
    return _ops().layer_norm(x, weight, bias, float(eps))


def l2_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D] → x · rsqrt(Σx² + eps), fp32."""
    return _ops().l2_normalize(x, float(eps))


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """x [T, ..., D] (D even), cos / sin [T, D/2] fp32 → [T, ..., D] in x's dtype: the pairs (x[j], x[j + D/2]),
    or (x[2j], x[2j+1]) when `interleaved`, rotated, the rotated firsts then the rotated seconds."""
    return _ops().rotary(x, cos, sin, bool(interleaved))


def residual_mix(
    sources: list[torch.Tensor], norm_weight: torch.Tensor, proj_weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """sources: J ≥ 1 tensors [N, D] of one dtype (fp32 / bf16), the banked blocks then the current stream;
    norm_weight / proj_weight [D] → Σ_j softmax_j((S_j · norm · proj) · rsqrt(mean(S_j²) + eps)) S_j, [N, D] in
    the sources' dtype (naive.residual_mix; the softmax and the sum over sources in source order)."""
    return _ops().residual_mix(list(sources), norm_weight, proj_weight, float(eps))
