"""KDA in recurrent form (decode: T = 1 .. a few), in PyTorch.

One step at a time like the reference, but with all (sequence, head) pairs in one [N*H, K, V] batch,
gates and scaled keys/queries computed for every step up front, and the state updated in place with
bmm/baddbmm. Packed sequences (cu_seqlens) are zero-padded to the longest one: a padded step has
k = 0, beta = 0 and g = 0, which leaves the state exactly unchanged.
"""

from __future__ import annotations

import torch

from expertmesh.kernels.kda.chunk import block_layout, from_blocks, to_blocks
from expertmesh.kernels.kda.naive import check_kda_inputs


def fused_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """KDA step by step (decode), PyTorch; same contract as `chunk_kda` (chunk_size is accepted for a
    common signature and ignored).

    q, k, g: [B, T, H, K]; v: [B, T, H, V]; beta: [B, T, H]; cu_seqlens: int32/int64 [N+1] with B == 1;
    initial_state: [N, H, K, V] or None. Returns o [B, T, H, V] in v's dtype and the fp32 final state
    [N, H, K, V] (None unless output_final_state).
    """
    info = check_kda_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens)
    N, H, K, V = info.N, info.H, info.K, info.V
    if cu_seqlens is None:
        L, layout = info.T, None

        def steps(x: torch.Tensor) -> torch.Tensor:  # [B, T, H, D] -> [T, B*H, D]
            return x.float().transpose(0, 1).reshape(L, N * H, x.shape[-1])
    else:
        L = max(info.lengths)
        layout = block_layout(info, max(L, 1), q.device, blocks_per_seq=[1] * N)

        def steps(x: torch.Tensor) -> torch.Tensor:  # [N, H, L, D] blocks -> [L, N*H, D]
            return to_blocks(x, layout).permute(2, 0, 1, 3).reshape(layout.C, N * H, x.shape[-1])

    qs, ks, vs = steps(q) * info.scale, steps(k), steps(v)
    decay = steps(g).exp()  # [L, NH, K]
    bk = steps(beta[..., None]) * ks  # beta_t k_t
    S = (
        torch.zeros(N * H, K, V, device=q.device)
        if initial_state is None
        else initial_state.float().reshape(N * H, K, V).clone()
    )
    outs = _steps(S, qs, ks, vs, decay, bk, L)
    final = S.reshape(N, H, K, V) if output_final_state else None
    if layout is None:
        o = torch.stack(outs).reshape(info.T, info.B, H, V).transpose(0, 1) if outs else v.new_zeros(info.B, 0, H, V)
        return o.to(v.dtype), final
    o_steps = torch.stack(outs) if outs else S.new_zeros(layout.C, N * H, V)  # [L, NH, V]
    o_blocks = o_steps.reshape(layout.C, N, H, V).permute(1, 2, 0, 3)  # [N, H, L, V]
    return from_blocks(o_blocks, layout, info, v.dtype), final


def _steps(S, qs, ks, vs, decay, bk, L: int, states: list | None = None) -> list[torch.Tensor]:
    """The recurrence over L steps, S [NH, K, V] updated in place → each step's output [NH, V]; `states`: a copy
    of S after each step appended to it."""
    outs = []
    for t in range(L):
        S.mul_(decay[t][:, :, None])
        err = vs[t] - torch.bmm(ks[t][:, None, :], S)[:, 0]  # v_t - k_t^T S   [NH, V]
        S.baddbmm_(bk[t][:, :, None], err[:, None, :])
        outs.append(torch.bmm(qs[t][:, None, :], S)[:, 0])
        if states is not None:
            states.append(S.clone())
    return outs


def fused_recurrent_kda_states(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor,
    scale: float | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A speculative verify's rows of one sequence in one call, keeping the state after every row (a rollback
    picks one): q, k, g [1, T, H, K], v [1, T, H, V], beta [1, T, H], initial_state [H, K, V] → (o [1, T, H, V] in
    v's dtype, T fp32 states [H, K, V]). Every row's arithmetic is the one-token call's — the same elementwise
    prologue and the same [H, 1, K] × [H, K, V] products from the same state — so o and the states equal T
    one-token `fused_recurrent_kda` calls bit for bit (tests/kernels/test_kda_verify_states.py)."""
    if q.dim() != 4 or q.shape[0] != 1:
        raise ValueError(f"q: expected one sequence [1, T, H, K] for a verify, found {tuple(q.shape)}")
    info = check_kda_inputs(q, k, v, g, beta, scale, initial_state[None], None)
    T, H, K, V = info.T, info.H, info.K, info.V

    def steps(x: torch.Tensor) -> torch.Tensor:  # [1, T, H, D] -> [T, H, D]
        return x.float()[0]

    qs, ks, vs = steps(q) * info.scale, steps(k), steps(v)
    decay = steps(g).exp()
    bk = steps(beta[..., None]) * ks
    S = initial_state.float().reshape(H, K, V).clone()
    states: list[torch.Tensor] = []
    outs = _steps(S, qs, ks, vs, decay, bk, T, states)
    return torch.stack(outs)[None].to(v.dtype), states
