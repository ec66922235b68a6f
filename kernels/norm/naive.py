"""Row norms and rotary embeddings in PyTorch: the readable reference of the CPU kernel (cpu_kernel.py) and the
path everywhere it does not run (GPU, fp16 / fp64 inputs, autograd, the kernel off or not built). These are the
bodies `expertmesh/model/transformer.py` had before the kernel, moved as they were.

    rms_norm(x, weight, eps)           y = x · rsqrt(mean(x²) + eps) · weight          (fp32 math, x's dtype out)
    layer_norm(x, weight, bias, eps)   c = x − mean(x);  y = c · rsqrt(mean(c²) + eps) · weight + bias
    l2_normalize(x, eps)               y = x · rsqrt(Σx² + eps)                           (fp32 out)
    rotary(x, cos, sin, interleaved)   x [T, ..., D], cos / sin [T, D/2] fp32: the pairs (x[i], x[i + D/2]), or
                                       (x[2i], x[2i+1]) when interleaved, rotated; output [rotated firsts ‖ rotated
                                       seconds] in x's dtype
    residual_mix(sources, norm_weight,  Kimi K3's attention-residual mix: sources S_j [N, D] (the banked blocks, then
                 proj_weight, eps)     the current stream), w = norm · proj, score_j = (S_j · w) · rsqrt(mean(S_j²)
                                       + eps), p = softmax_j(score) → Σ_j p_j S_j in the last source's dtype

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


def residual_mix(
    sources: list[torch.Tensor], norm_weight: torch.Tensor, proj_weight: torch.Tensor, eps: float
) -> torch.Tensor:
    stacked = torch.stack(sources).float()  # [J, N, D]
    w = norm_weight.float() * proj_weight.float()  # [D]
    score = (stacked * w).sum(-1) * pointwise(torch.rsqrt, stacked.pow(2).mean(-1) + eps)  # [J, N]
    # the softmax over the sources and the weighted sum as elementwise ops in source order: ATen's softmax over dim 0
    # and its sum over dim 0 round a row differently by where it sits in the batch (and by thread count)
    top = score[0]
    for s in score[1:]:
        top = torch.maximum(top, s)
    e = pointwise(torch.exp, score - top)  # [J, N]
    total = e[0]
    for j in range(1, e.shape[0]):
        total = total + e[j]
    p = e / total
    out = p[0, :, None] * stacked[0]
    for j in range(1, stacked.shape[0]):
        out = out + p[j, :, None] * stacked[j]
    return out.to(sources[-1].dtype)
