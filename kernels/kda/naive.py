"""Kimi Delta Attention (KDA): the input contract and the plain recurrent reference.

KDA is a gated delta rule with a per-channel (fine-grained) decay. Per head, the state S is a [K, V]
matrix; at every step t, in fp32:

    S   <- diag(exp(g_t)) S                         decay each K-row of S (g_t <= 0, log space)
    S   <- S + (beta_t k_t) (v_t - k_t^T S)^T        delta-rule write of the prediction error
    o_t  = (scale q_t)^T S                           read with the updated state

`kda_recurrent_reference` is that loop, written to be obviously right; every fast path
(chunk.py, fused_recurrent.py, triton_kda.py) is tested against it. `check_kda_inputs` is the one
place the tensor contract is checked, shared by every path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(frozen=True)
class KDAInputs:
    """What `check_kda_inputs` found: the sizes, the scale to use, and the sequences (host ints)."""

    B: int
    T: int
    H: int
    K: int
    V: int
    scale: float
    # Sequence n covers flat token rows [starts[n], starts[n] + lengths[n]) of the [B*T] axis.
    starts: tuple[int, ...]
    lengths: tuple[int, ...]

    @property
    def N(self) -> int:
        return len(self.starts)


def _shape(t: torch.Tensor) -> str:
    return "[" + ",".join(str(s) for s in t.shape) + "]"


def check_kda_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> KDAInputs:
    """Check the KDA contract; raise ValueError naming the tensor, with expected vs found.

    q, k, g: [B, T, H, K]; v: [B, T, H, V]; beta: [B, T, H]; floating point, one device; q, k, v share
    a dtype. cu_seqlens: int32/int64 [N+1], starts at 0, non-decreasing, ends at T, and needs B == 1.
    initial_state: [N, H, K, V] (N = B without cu_seqlens). The values of g (<= 0) are not checked:
    that would cost a device sync on every call.
    """
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}: expected a torch.Tensor, found {type(t).__name__}")
        if t.dtype not in _FLOATS:
            raise ValueError(f"{name}: expected a floating-point dtype, found {t.dtype}")
    if q.dim() != 4:
        raise ValueError(f"q: expected rank 4 [B,T,H,K], found rank {q.dim()} {_shape(q)}")
    B, T, H, K = q.shape
    if k.shape != q.shape:
        raise ValueError(f"k: expected shape {_shape(q)} (as q), found {_shape(k)}")
    if g.shape != q.shape:
        raise ValueError(f"g: expected shape {_shape(q)} (as q, one log-decay per key channel), found {_shape(g)}")
    if v.dim() != 4 or tuple(v.shape[:3]) != (B, T, H):
        raise ValueError(f"v: expected shape [{B},{T},{H},V], found {_shape(v)}")
    V = v.shape[3]
    if tuple(beta.shape) != (B, T, H):
        raise ValueError(f"beta: expected shape [{B},{T},{H}], found {_shape(beta)}")
    if K == 0 or V == 0 or H == 0:
        raise ValueError(f"q/v: expected non-empty head dims, found K={K}, V={V}, H={H}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v: expected one dtype, found q={q.dtype}, k={k.dtype}, v={v.dtype}")
    for name, t in (("k", k), ("v", v), ("g", g), ("beta", beta)):
        if t.device != q.device:
            raise ValueError(f"{name}: expected device {q.device} (as q), found {t.device}")

    if cu_seqlens is None:
        starts = tuple(b * T for b in range(B))
        lengths = (T,) * B
    else:
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype not in (torch.int32, torch.int64):
            found = cu_seqlens.dtype if isinstance(cu_seqlens, torch.Tensor) else type(cu_seqlens).__name__
            raise ValueError(f"cu_seqlens: expected an int32/int64 tensor, found {found}")
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            raise ValueError(f"cu_seqlens: expected shape [N+1] with N >= 1, found {_shape(cu_seqlens)}")
        if B != 1:
            raise ValueError(f"q: expected B == 1 with cu_seqlens (sequences packed along T), found B={B}")
        cu = [int(x) for x in cu_seqlens.tolist()]
        if cu[0] != 0:
            raise ValueError(f"cu_seqlens: expected to start at 0, found {cu[0]}")
        if cu[-1] != T:
            raise ValueError(f"cu_seqlens: expected to end at T={T}, found {cu[-1]}")
        if any(b < a for a, b in zip(cu, cu[1:])):
            raise ValueError(f"cu_seqlens: expected non-decreasing offsets, found {cu}")
        starts = tuple(cu[:-1])
        lengths = tuple(b - a for a, b in zip(cu, cu[1:]))

    N = len(starts)
    if initial_state is not None:
        if not isinstance(initial_state, torch.Tensor) or initial_state.dtype not in _FLOATS:
            found = initial_state.dtype if isinstance(initial_state, torch.Tensor) else type(initial_state).__name__
            raise ValueError(f"initial_state: expected a floating-point tensor, found {found}")
        if tuple(initial_state.shape) != (N, H, K, V):
            raise ValueError(
                f"initial_state: expected shape [{N},{H},{K},{V}] ([N,H,K,V]), found {_shape(initial_state)}"
            )
        if initial_state.device != q.device:
            raise ValueError(f"initial_state: expected device {q.device} (as q), found {initial_state.device}")

    if scale is None:
        scale = K**-0.5
    return KDAInputs(B=B, T=T, H=H, K=K, V=V, scale=float(scale), starts=starts, lengths=lengths)


def kda_recurrent_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """KDA, one step at a time (fp32 math). The reference every fast path is tested against.

    q, k, g: [B, T, H, K]; v: [B, T, H, V]; beta: [B, T, H]; initial_state: [B, H, K, V] or None (zeros).
    scale defaults to K ** -0.5. Returns o [B, T, H, V] in v's dtype and the fp32 final state
    [B, H, K, V] (None unless output_final_state).
    """
    info = check_kda_inputs(q, k, v, g, beta, scale, initial_state)
    B, T, H, K, V = info.B, info.T, info.H, info.K, info.V
    out_dtype = v.dtype
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    S = torch.zeros(B, H, K, V, device=q.device) if initial_state is None else initial_state.float().clone()
    outputs = []
    for t in range(T):
        q_t, k_t, v_t, g_t, b_t = q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t]  # [B,H,K] / [B,H,V] / [B,H]
        S = S * torch.exp(g_t)[..., None]  # decay each K-row
        prediction = torch.einsum("bhk,bhkv->bhv", k_t, S)  # k_t^T S
        S = S + torch.einsum("bhk,bhv->bhkv", b_t[..., None] * k_t, v_t - prediction)
        outputs.append(torch.einsum("bhk,bhkv->bhv", info.scale * q_t, S))
    o = torch.stack(outputs, dim=1) if T else v.new_zeros(B, 0, H, V)
    return o.to(out_dtype), (S if output_final_state else None)
