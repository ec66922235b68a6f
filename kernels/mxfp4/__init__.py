"""MXFP4 (OCP MX v1.0: E2M1 elements, one E8M0 scale per 32) quantisation and dequantisation.

`quantize_mxfp4` is the PyTorch reference on every device (checkpoint conversion, not a hot path).
`dequantize_mxfp4` picks the Triton kernel for CUDA tensors and the PyTorch path otherwise
(`expertmesh.kernels.backend.resolve`; `use_backend` forces one). The Triton module is imported only
when first chosen. Contracts: `expertmesh.kernels.mxfp4.naive`.
"""

from __future__ import annotations

import torch

from expertmesh.kernels.backend import resolve
from expertmesh.kernels.mxfp4.naive import (
    E8M0_BIAS,
    FP4_VALUES,
    check_mxfp4,
    e8m0_lut,
    fp4_lut,
    quantize_mxfp4,
)
from expertmesh.kernels.mxfp4.naive import dequantize_mxfp4 as dequantize_mxfp4_torch

__all__ = [
    "FP4_VALUES",
    "E8M0_BIAS",
    "quantize_mxfp4",
    "dequantize_mxfp4",
    "dequantize_mxfp4_torch",
    "check_mxfp4",
    "fp4_lut",
    "e8m0_lut",
]


def dequantize_mxfp4(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16, *, block_size: int = 32
) -> torch.Tensor:
    """blocks uint8 [..., K/2] + scales uint8 [..., K/32] → [..., K] `dtype`, exact.

    Contract: `expertmesh.kernels.mxfp4.naive.dequantize_mxfp4`."""
    if resolve(blocks, scales) == "triton":
        from expertmesh.kernels.mxfp4.triton_mxfp4 import dequantize_mxfp4 as dequantize_mxfp4_triton

        return dequantize_mxfp4_triton(blocks, scales, dtype, block_size=block_size)
    return dequantize_mxfp4_torch(blocks, scales, dtype, block_size=block_size)
