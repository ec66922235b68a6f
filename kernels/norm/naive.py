"""Row norms and rotary embeddings in PyTorch: the readable reference of the CPU kernel (cpu_kernel.py) and the
path everywhere it does not run (GPU, fp16 / fp64 inputs, autograd, the kernel off or not built). These are the
bodies `expertmesh/model/transformer.py` had before the kernel, moved as they were.

    rms_norm(x, weight, eps)           y = x · rsqrt(mean(x²) + eps) · weight          (fp32 math, x's dtype out)
    layer_norm(x, weight, bias, eps)   c = x − mean(x);  y = c · rsqrt(mean(c²) + eps) · weight + bias
    l2_normalize(x, eps)               y = x · rsqrt(Σx² + eps)                           (fp32 out)
    rotary(x, cos, sin, interleaved)   x [T, ..., D], cos / sin [T, D/2] fp32: the pairs (x[i], x[i + D/2]), or
                                       (x[2i], x[2i+1]) when interleaved, rotated; output [rotated firsts ‖ rotated
                                       seconds] in x's dtype

Each over the last dim, row by row; `pointwise` keeps ATen's rsqrt on the same code path for every row.
"""

from __future__ import annotations

import torch

from expertmesh.kernels.batch_invariant import pointwise


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    normed = x32 * pointwise(torch.rsqrt, x32.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * weight.float()).to(x.dtype)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    centred = x32 - x32.mean(-1, keepdim=True)
    normed = centred * pointwise(torch.rsqrt, centred.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * weight.float() + bias.float()).to(x.dtype)


def l2_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return x32 * pointwise(torch.rsqrt, x32.pow(2).sum(-1, keepdim=True) + eps)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    d = x.shape[-1]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (d // 2,)
    cos, sin = cos.view(shape), sin.view(shape)
    xf = x.float()
    if interleaved:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
    else:
        x1, x2 = xf[..., : d // 2], xf[..., d // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
