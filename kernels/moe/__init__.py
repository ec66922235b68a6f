"""Routed-expert MoE over MXFP4 weights: per-(token, slot) expert outputs and the canonical combine.

The weights of a shard come as one `MXFP4Experts` (kernels/moe/experts.py); every backend takes
`(x, topk_ids, experts, *, out=None, activation=SWIGLU)`. `moe_expert_outputs` picks the Triton grouped kernel
for CUDA tensors; on CPU (backend `auto`) the fused C++ kernel (`expertmesh.kernels.moe.cpu_kernel`: MXFP4 decoded
in registers, built on first use) and, when it cannot
be built or `EXPERTMESH_CPU_KERNEL=0`, the grouped PyTorch path, which is also what a forced `torch` backend runs
(`expertmesh.kernels.backend.resolve`; `use_backend` forces one). The reference model and the expert worker both
call this function, so they run the same kernel. The Triton module is imported only when first chosen.
`moe_combine` is one elementwise loop in rank order, the same on every device.
Contracts and the batch-invariance notes: `expertmesh.kernels.moe.naive`.
"""

from __future__ import annotations

import torch

from expertmesh.kernels.activation import SWIGLU, GatedActivation
from expertmesh.kernels.backend import _configured, resolve
from expertmesh.kernels.moe import cpu_kernel
from expertmesh.kernels.moe.experts import MXFP4Experts
from expertmesh.kernels.moe.grouped import (
    dequant_cache,
    moe_expert_outputs_dense,
    set_dequant_cache_bytes,
)
from expertmesh.kernels.moe.grouped import moe_expert_outputs as moe_expert_outputs_grouped
from expertmesh.kernels.moe.naive import (
    check_combine_inputs,
    check_moe_inputs,
    moe_combine,
    moe_reference,
)
from expertmesh.kernels.moe.naive import moe_expert_outputs as moe_expert_outputs_reference

moe_expert_outputs_cpu = cpu_kernel.moe_expert_outputs

__all__ = [
    "MXFP4Experts",
    "GatedActivation",
    "SWIGLU",
    "moe_expert_outputs",
    "cpu_kernel_runs",
    "cpu_activation_runs",
    "moe_combine",
    "moe_forward",
    "moe_reference",
    "moe_expert_outputs_reference",
    "moe_expert_outputs_grouped",
    "moe_expert_outputs_dense",
    "moe_expert_outputs_cpu",
    "check_moe_inputs",
    "check_combine_inputs",
    "dequant_cache",
    "set_dequant_cache_bytes",
]


def cpu_kernel_runs(x: torch.Tensor, experts: MXFP4Experts) -> bool:
    """Whether `moe_expert_outputs` runs the fused CPU kernel for these tensors: both on the CPU, the backend not
    forced, the kernel built."""
    return (
        x.device.type == "cpu" and experts.device.type == "cpu" and _configured() == "auto" and cpu_kernel.available()
    )


def cpu_activation_runs(gate: torch.Tensor) -> bool:
    """Whether a dense MLP's or shared experts' activation on `gate` runs the CPU kernel's vector activation
    (`cpu_kernel.gated_activation`: the routed experts' own, within a few ulp of `kernels.activation.gated_act`,
    elementwise so batch-invariant; at decode one call instead of a dozen pointwise ops): a CPU tensor, no gradient
    to track, the backend not forced, the kernel built."""
    return (
        gate.device.type == "cpu"
        and not (torch.is_grad_enabled() and gate.requires_grad)
        and _configured() == "auto"
        and cpu_kernel.available()
    )


def moe_expert_outputs(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    experts: MXFP4Experts,
    *,
    out: torch.Tensor | None = None,
    activation: GatedActivation = SWIGLU,
) -> torch.Tensor:
    """x [T,H], topk_ids int64 [T,K] (local ids, -1 = skip) → unweighted expert outputs [T,K,H] in x.dtype;
    each expert W2 · act(W_gate x, W_up x) with act = `activation` (SwiGLU by default, or SiTU)."""
    if resolve(x, experts.gate_up_blocks) == "triton":
        from expertmesh.kernels.moe.triton_moe import moe_expert_outputs as moe_expert_outputs_triton

        return moe_expert_outputs_triton(x, topk_ids, experts, out=out, activation=activation)
    if cpu_kernel_runs(x, experts):
        return cpu_kernel.moe_expert_outputs(x, topk_ids, experts, out=out, activation=activation)
    return moe_expert_outputs_grouped(x, topk_ids, experts, out=out, activation=activation)


def moe_forward(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    experts: MXFP4Experts,
    *,
    activation: GatedActivation = SWIGLU,
) -> torch.Tensor:
    """x [T,H] → Σ_k topk_weights[t,k] · expert_{topk_ids[t,k]}(x_t) [T,H] in x.dtype (dispatching path)."""
    return moe_combine(
        moe_expert_outputs(x, topk_ids, experts, activation=activation),
        topk_weights,
    )
