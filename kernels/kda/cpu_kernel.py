"""KDA's recurrence on CPU as C++ ops (`kernels/kda/cpu/recurrent_step.cpp`) in place of the PyTorch recurrent
form's dozen ATen ops per call (fused_recurrent.py): one decode token (`recurrent_step_`, `fused_recurrent_step`),
the state of each head read once and written once, the gates and scaled keys computed inside — at decode those ops'
dispatch and the state's clone, not the arithmetic, were the cost (~0.6 ms a layer on the K3 peer model at one
sequence); and a prompt (`recurrent_steps_`): the same step token by token, a thread per head walking every token,
so the head's state stays in that core's cache — 4.2x the chunked form at 2,048 tokens on 2 cores
(bench/kernels_kda.py), and the bits of decoding the prompt token by token.

Numerics (see the C++ header): the same steps as the PyTorch form, each one fp32 rounding; the two sums over K run
in row order, the PyTorch form's bmm in its own, so the two agree to fp32 rounding, not bitwise. Threads split
(sequence, head) rows, never a row: a row's result is bitwise the same alone or in any batch, on any thread count.
A speculative verify then runs this op once per row too (kernels/kda `verify_recurrent_kda`), so its rows are the
decode calls' bits.

Built on first use (kernels/cpu_extension.py); without a compiler, or when the build fails, `available()` is False
after one warning and the PyTorch form runs. `EXPERTMESH_CPU_KDA_KERNEL=0` turns it off.
"""

from __future__ import annotations

from pathlib import Path

import torch

from expertmesh.kernels.backend import resolve
from expertmesh.kernels.cpu_extension import LazyExtension, switched_on
from expertmesh.kernels.kda.naive import check_kda_inputs

__all__ = [
    "available",
    "built",
    "enabled",
    "takes",
    "takes_prompt",
    "refresh",
    "fused_recurrent_step",
    "recurrent_step_",
    "recurrent_steps_",
    "EXTENSION",
]

EXTENSION = LazyExtension(
    "expertmesh_kda_cpu",
    Path(__file__).parent / "cpu" / "recurrent_step.cpp",
    "expertmesh_kda_cpu",
    what="CPU KDA recurrent-step kernel",
    probe="recurrent_step",
)


def enabled() -> bool:
    """False when `EXPERTMESH_CPU_KDA_KERNEL` is 0/off/false/no/torch."""
    return switched_on("EXPERTMESH_CPU_KDA_KERNEL")


def built() -> bool:
    """The extension is built (building it now if it was not tried yet), enabled or not."""
    return EXTENSION.load() is not None


def available() -> bool:
    """Enabled and built."""
    return enabled() and EXTENSION.load() is not None


_use: bool | None = None  # available(), asked once per process (refresh() asks again)


def refresh() -> None:
    """Make the next `takes` ask `available()` again (after changing EXPERTMESH_CPU_KDA_KERNEL in-process)."""
    global _use
    _use = None


def _usable(q: torch.Tensor) -> bool:
    """q [B, T, H, K] is a CPU tensor with no gradient to track, the kernel is available, and no Triton backend is
    forced for it (`backend.resolve`: EXPERTMESH_KERNEL_BACKEND=triton runs the Triton kernels on CPU under
    TRITON_INTERPRET)."""
    global _use
    if _use is None:
        _use = available()
    return (
        _use
        and q.device.type == "cpu"
        and q.dim() == 4
        and not (torch.is_grad_enabled() and q.requires_grad)
        and resolve(q) != "triton"
    )


def takes(q: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> bool:
    """Whether a recurrent call on q [B, T, H, K] runs this kernel: one token per sequence (T = 1, no packed
    sequences) and `_usable`."""
    return _usable(q) and q.shape[1] == 1 and cu_seqlens is None


def takes_prompt(q: torch.Tensor) -> bool:
    """Whether one sequence's run of tokens q [1, T, H, K] runs `recurrent_steps_` (the model's CPU prefill)."""
    return _usable(q) and q.shape[0] == 1


def fused_recurrent_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`fused_recurrent_kda` for one token per sequence: q, k, g [B, 1, H, K]; v [B, 1, H, V]; beta [B, 1, H];
    initial_state [B, H, K, V] or None (zeros) → o [B, 1, H, V] in v's dtype and the fp32 final state
    [B, H, K, V] (None unless output_final_state). Bad inputs raise ValueError naming the tensor."""
    info = check_kda_inputs(q, k, v, g, beta, scale, initial_state, None)
    if info.T != 1:
        raise ValueError(f"q: expected one token per sequence [B, 1, H, K], found {tuple(q.shape)}")
    B, H, K, V = info.B, info.H, info.K, info.V
    rows = B * H

    def flat(x: torch.Tensor, d: int) -> torch.Tensor:
        return x.float().reshape(rows, d).contiguous()

    state = (
        torch.zeros(rows, K, V, device=q.device)
        if initial_state is None
        else initial_state.float().reshape(rows, K, V).contiguous()
    )
    o, final = EXTENSION.load().recurrent_step(
        flat(q, K), flat(k, K), flat(v, V), flat(g, K), beta.float().reshape(rows).contiguous(), state, info.scale
    )
    return o.reshape(B, 1, H, V).to(v.dtype), final.reshape(B, H, K, V) if output_final_state else None


def recurrent_step_(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """One token of one sequence with its state updated in place (the model's decode: a new 1 MB state per layer
    and token cost more in fresh pages than the step's arithmetic): q, k, g [H, K]; v [H, V]; beta [H]; state
    [H, K, V] fp32 contiguous, modified → o [H, V] in v's dtype; the same bits as `fused_recurrent_step`."""
    _check_state(state)
    info = check_kda_inputs(
        q[None, None], k[None, None], v[None, None], g[None, None], beta[None, None], scale, state[None], None
    )
    return _in_place(EXTENSION.load().recurrent_step_, q, k, v, g, beta, state, info.scale)


def recurrent_steps_(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """T tokens of one sequence in order, the state updated in place (the model's CPU prefill): q, k, g [T, H, K];
    v [T, H, V]; beta [T, H]; state [H, K, V] fp32 contiguous, modified → o [T, H, V] in v's dtype. Token t is the
    one-token step on the state after t tokens — the bits of T `recurrent_step_` calls — so a prompt's KDA rows
    and final state do not depend on how it was cut into steps, and equal decoding it token by token."""
    _check_state(state)
    if q.dim() != 3:
        raise ValueError(f"q: expected [T, H, K], found {list(q.shape)}")
    info = check_kda_inputs(q[None], k[None], v[None], g[None], beta[None], scale, state[None], None)
    return _in_place(EXTENSION.load().recurrent_steps_, q, k, v, g, beta, state, info.scale)


def _check_state(state: torch.Tensor) -> None:
    if state.dtype != torch.float32 or state.dim() != 3 or not state.is_contiguous():
        raise ValueError(
            f"state: expected a contiguous float32 [H, K, V] tensor, found {state.dtype} {list(state.shape)}"
        )


def _in_place(op, q, k, v, g, beta, state: torch.Tensor, scale: float) -> torch.Tensor:
    """`op` (an in-place op of the extension) on the inputs as contiguous fp32 → o in v's dtype."""
    args = (t.float().contiguous() for t in (q, k, v, g, beta))
    return op(*args, state, scale).to(v.dtype)
