"""Kimi Delta Attention for training: the chunked form written with differentiable ops only, so autograd gives
its backward. The serving kernels (kernels/kda/chunk.py) write into preallocated outputs and are not
differentiable; this is the same maths (that module's docstring), at the cost of one [C, C, K] decay tensor per
chunk, which is small at the shapes trained here. `chunk_kda_train` is tested against
`kernels.kda.naive.kda_recurrent_reference` (outputs and gradients).

Shapes: B sequences, T steps, H heads, K key dim, V value dim, C the chunk length.
"""

from __future__ import annotations

import torch


def unit_lower_inverse(A: torch.Tensor) -> torch.Tensor:
    """(I + A)⁻¹ for strictly lower-triangular A [..., C, C]: with N = −A nilpotent (N^C = 0),
    (I − N)⁻¹ = Σ_j N^j = Π_k (I + N^(2^k)) over 2^k < C — log2(C) squarings, batched matmuls only (autograd's
    backward of a batched triangular solve was the slowest op of a training step on CPU)."""
    C = A.shape[-1]
    n = -A
    inv = torch.eye(C, dtype=A.dtype, device=A.device) + n
    power = 2
    while power < C:
        n = n @ n
        inv = inv + inv @ n
        power *= 2
    return inv


def chunk_kda_train(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    chunk_size: int = 32,
) -> torch.Tensor:
    """q, k, g [B, T, H, K] (g ≤ 0: log decay per key channel), v [B, T, H, V], beta [B, T, H] → o [B, T, H, V]
    fp32, from a zero state. Per chunk, with G the in-chunk cumulative sum of g:
    A[r, i] = β_r Σ_c k_rc k_ic e^(G_rc − G_ic) (i < r), u = (I + A)⁻¹ β (V − (K ∘ e^G) S₀),
    o = scale (Q ∘ e^G) S₀ + P u with P[r, i] = scale Σ_c q_rc k_ic e^(G_rc − G_ic) (i ≤ r),
    S₁ = e^(G_C) S₀ + (K ∘ e^(G_C − G))ᵀ u. Every exponent is a later G minus an earlier one (≤ 0)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K**-0.5 if scale is None else scale
    C = chunk_size
    pad = (-T) % C
    if pad:  # zero steps at the end: k = v = β = 0, g = 0 leave the state and the real outputs unchanged
        q, k, v, g = (torch.nn.functional.pad(t, (0, 0, 0, 0, 0, pad)) for t in (q, k, v, g))
        beta = torch.nn.functional.pad(beta, (0, 0, 0, pad))
    n = (T + pad) // C

    def chunks(t: torch.Tensor) -> torch.Tensor:  # [B, T, H, D] → [B, H, n, C, D]
        return t.float().reshape(B, n, C, H, -1).permute(0, 3, 1, 2, 4)

    q, k, v, g = chunks(q), chunks(k), chunks(v), chunks(g)
    beta = beta.float().reshape(B, n, C, H).permute(0, 3, 1, 2)  # [B, H, n, C]
    G = g.cumsum(-2)  # [B, H, n, C, K]
    diff = G[..., :, None, :] - G[..., None, :, :]  # [B, H, n, C(r), C(i), K]: G_r − G_i
    lower = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()  # i ≤ r
    decay = torch.exp(diff.masked_fill(~lower[..., None], float("-inf")))  # 0 above the diagonal
    strict = lower.clone().fill_diagonal_(False)
    A = torch.einsum("bhnrc,bhnic,bhnric->bhnri", k, k, decay) * beta[..., None] * strict
    P = torch.einsum("bhnrc,bhnic,bhnric->bhnri", q, k, decay) * scale
    inv = unit_lower_inverse(A)
    gam = torch.exp(G)  # e^G ≤ 1
    U0 = inv @ (beta[..., None] * v)  # [B, H, n, C, V]
    W = inv @ (beta[..., None] * k * gam)  # [B, H, n, C, K]
    Qeff = scale * q * gam - P @ W  # [B, H, n, C, K]
    Ointra = P @ U0
    G_last = G[..., -1:, :]  # [B, H, n, 1, K]
    k_tail = k * torch.exp(G_last - G)  # [B, H, n, C, K]
    S = q.new_zeros(B, H, K, V)
    outs = []
    for c in range(n):
        outs.append(Ointra[:, :, c] + Qeff[:, :, c] @ S)
        u = U0[:, :, c] - W[:, :, c] @ S  # [B, H, C, V]
        S = torch.exp(G_last[:, :, c, 0])[..., None] * S + k_tail[:, :, c].transpose(-1, -2) @ u
    o = torch.stack(outs, dim=2)  # [B, H, n, C, V]
    return o.permute(0, 2, 3, 1, 4).reshape(B, n * C, H, V)[:, :T]
