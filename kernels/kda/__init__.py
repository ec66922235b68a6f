"""Kimi Delta Attention ops: chunked form (prefill), recurrent form (decode), and the reference.

`chunk_kda` and `fused_recurrent_kda` pick the Triton kernels for CUDA tensors and the PyTorch paths
otherwise (`expertmesh.kernels.backend.resolve`; `use_backend` forces one); on CPU a one-token recurrent call
runs the C++ step (`cpu_kernel.py`) where it is built. The Triton module is imported only when first chosen,
so the PyTorch paths need no triton and TRITON_INTERPRET can be set before the kernels are decorated.
"""

from __future__ import annotations

import torch

from expertmesh.kernels.backend import resolve
from expertmesh.kernels.kda import cpu_kernel as kda_cpu
from expertmesh.kernels.kda.chunk import chunk_kda as chunk_kda_torch
from expertmesh.kernels.kda.fused_recurrent import fused_recurrent_kda as fused_recurrent_kda_torch
from expertmesh.kernels.kda.fused_recurrent import fused_recurrent_kda_states
from expertmesh.kernels.kda.naive import check_kda_inputs, kda_recurrent_reference

__all__ = [
    "chunk_kda",
    "fused_recurrent_kda",
    "verify_recurrent_kda",
    "verify_recurrent_kda_rows",
    "kda_recurrent_reference",
    "chunk_kda_torch",
    "fused_recurrent_kda_torch",
    "check_kda_inputs",
]


def chunk_kda(
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
    """Chunked KDA (prefill). Contract: `expertmesh.kernels.kda.chunk.chunk_kda`.

    Triton branch (`triton_kda.chunk_kda_triton`): the decayed Gram matrices and the chunk-to-chunk
    state passing are Triton kernels; the triangular solve and the products between them are batched
    PyTorch ops (on the GPU). chunk_size must then be a power of two >= 16.
    """
    args = (q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, chunk_size)
    if resolve(q) == "triton":
        from expertmesh.kernels.kda.triton_kda import chunk_kda_triton

        return chunk_kda_triton(*args)
    return chunk_kda_torch(*args)


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
    """Recurrent KDA (decode). Contract: `expertmesh.kernels.kda.fused_recurrent.fused_recurrent_kda`."""
    args = (q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, chunk_size)
    if resolve(q) == "triton":
        from expertmesh.kernels.kda.triton_kda import fused_recurrent_kda_triton

        return fused_recurrent_kda_triton(*args)
    if kda_cpu.takes(q, cu_seqlens):
        return kda_cpu.fused_recurrent_step(q, k, v, g, beta, scale, initial_state, output_final_state)
    return fused_recurrent_kda_torch(*args)


def verify_recurrent_kda(q, k, v, g, beta, initial_state) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A speculative verify's KDA rows of one sequence, keeping the state after each (q, k, g [1, T, H, K], v
    [1, T, H, V], beta [1, T, H], initial_state [H, K, V] → o [1, T, H, V], T fp32 states [H, K, V]): what T
    one-token decode calls give, bit for bit. PyTorch: one call (`fused_recurrent_kda_states`); Triton and the
    CPU step: the one-token kernel per row (`verify_recurrent_kda_rows`)."""
    if resolve(q) == "triton" or kda_cpu.takes(q[:, :1]):
        return verify_recurrent_kda_rows(q, k, v, g, beta, initial_state)
    return fused_recurrent_kda_states(q, k, v, g, beta, initial_state)


def verify_recurrent_kda_rows(q, k, v, g, beta, initial_state) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """`verify_recurrent_kda` as T one-token `fused_recurrent_kda` calls, each the call a decode step makes."""
    outs, states, state = [], [], initial_state
    for j in range(q.shape[1]):
        t = slice(j, j + 1)
        out, final = fused_recurrent_kda(
            q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], initial_state=state[None], output_final_state=True
        )
        state = final[0]
        outs.append(out)
        states.append(state)
    return torch.cat(outs, dim=1), states
