"""Routed-expert MoE over MXFP4 weights: the input contract, the batch-invariant building blocks, the reference.

One shard of E experts comes as one `MXFP4Experts` bundle (`kernels/moe/experts.py`: gate_up and down blocks and
scales, gate and up concatenated along the rows):
    expert_e(x) = W_down,e · act(W_gate,e · x, W_up,e · x), in fp32 from the dequantised weights,
with act the keyword `activation` (`kernels.activation.GatedActivation`) every entry point takes: SwiGLU
silu(g) ⊙ u by default (`SWIGLU`), or Kimi K3's SiTU β·tanh(g/β)·σ(g) ⊙ β_lin·tanh(u/β_lin) (u uncapped
when β_lin = 0).

Every backend (this reference, grouped.py, cpu_kernel.py, triton_moe.py) has the same signature
`moe_expert_outputs(x, topk_ids, experts, *, out=None, activation=SWIGLU)`:
x [T,H], topk_ids [T,K] → [T,K,H] in x.dtype: the UNWEIGHTED output of expert
topk_ids[t,k] (a LOCAL index in [0,E), or -1: not on this shard → exactly 0) for token t.
`moe_combine(outputs [T,K,H], topk_weights [T,K])` → [T,H]: Σ_k w[t,k]·out[t,k] in fp32, in rank order k = 0..K-1.

Batch invariance (docs/architecture.md, "Determinism"): a token's rows must be bitwise the same whatever other tokens
share the call. On torch 2.13 CPU both the GEMM kernel (picked by row count) and the elementwise kernels
(SIMD body vs scalar tails) depend on the batch; `invariant_linear` and `swiglu` (the activation) go through
`kernels/batch_invariant.py` (row-tiled GEMMs, pointwise ops on whole vectors in single-threaded chunks),
the same helpers the model's dense layers use.
The reference below and the grouped fast path use both, so they agree bitwise with each other too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from expertmesh.kernels.activation import SWIGLU, GatedActivation, check_activation, gated_act
from expertmesh.kernels.batch_invariant import linear
from expertmesh.kernels.linear.naive import matmul_in_tile_order_fp32
from expertmesh.kernels.moe.experts import MXFP4Experts

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _shape(t: torch.Tensor) -> str:
    return "[" + ",".join(str(s) for s in t.shape) + "]"


@dataclass(frozen=True)
class MoEShapes:
    T: int  # tokens
    K: int  # top-k slots per token
    E: int  # experts on this shard
    H: int  # hidden size
    I: int  # expert intermediate size


def _check_tensor(name: str, t, dtype: torch.dtype | None, shape: tuple[int, ...] | None, device) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, found {type(t).__name__}")
    if dtype is not None and t.dtype != dtype:
        raise ValueError(f"{name}: expected dtype {dtype}, found {t.dtype}")
    if shape is not None and tuple(t.shape) != shape:
        raise ValueError(f"{name}: expected shape [{','.join(map(str, shape))}], found {_shape(t)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: expected device {device} (as x), found {t.device}")


def check_moe_inputs(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    experts: MXFP4Experts,
    out: torch.Tensor | None = None,
) -> MoEShapes:
    """Check the contract of `moe_expert_outputs`; raise ValueError naming the tensor, expected vs found.

    x floating [T, H] with H a multiple of 32; topk_ids int64 [T, K] with values in [-1, E) (checked: one
    host sync); experts an `MXFP4Experts` of E experts, width H, I a multiple of 32; out (optional) [T, K, H]
    contiguous, x's dtype; one device.
    """
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"x: expected a torch.Tensor, found {type(x).__name__}")
    if x.dtype not in _FLOATS:
        raise ValueError(f"x: expected a floating-point dtype, found {x.dtype}")
    if x.dim() != 2:
        raise ValueError(f"x: expected rank 2 [T,H], found rank {x.dim()} {_shape(x)}")
    T, H = x.shape
    if H == 0 or H % 32:
        raise ValueError(f"x: hidden size H={H} must be a positive multiple of 32 (MXFP4 blocks), shape {_shape(x)}")
    dev = x.device
    if not isinstance(topk_ids, torch.Tensor):
        raise ValueError(f"topk_ids: expected a torch.Tensor, found {type(topk_ids).__name__}")
    if topk_ids.dtype != torch.int64:
        raise ValueError(f"topk_ids: expected dtype torch.int64, found {topk_ids.dtype}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != T:
        raise ValueError(f"topk_ids: expected shape [{T},K] (T as x), found {_shape(topk_ids)}")
    _check_tensor("topk_ids", topk_ids, None, None, dev)
    K = topk_ids.shape[1]
    if not isinstance(experts, MXFP4Experts):
        raise ValueError(f"experts: expected an MXFP4Experts bundle, found {type(experts).__name__}")
    w = experts
    _check_tensor("experts.gate_up_blocks", w.gate_up_blocks, torch.uint8, None, dev)
    if w.gate_up_blocks.dim() != 3 or w.gate_up_blocks.shape[1] % 2 or w.gate_up_blocks.shape[2] != H // 2:
        raise ValueError(
            f"experts.gate_up_blocks: expected shape [E,2I,{H // 2}] (H/2 = {H // 2}, 2I even), "
            f"found {_shape(w.gate_up_blocks)}"
        )
    E, I = w.n_experts, w.intermediate_size
    if I == 0 or I % 32:
        raise ValueError(
            f"experts.gate_up_blocks: intermediate size I={I} (rows / 2) must be a positive multiple of 32, "
            f"found shape {_shape(w.gate_up_blocks)}"
        )
    _check_tensor("experts.gate_up_scales", w.gate_up_scales, torch.uint8, (E, 2 * I, H // 32), dev)
    _check_tensor("experts.down_blocks", w.down_blocks, torch.uint8, (E, H, I // 2), dev)
    _check_tensor("experts.down_scales", w.down_scales, torch.uint8, (E, H, I // 32), dev)
    if out is not None:
        _check_tensor("out", out, x.dtype, (T, K, H), dev)
        if not out.is_contiguous():
            raise ValueError(f"out: expected a contiguous tensor, found strides {tuple(out.stride())}")
    if topk_ids.numel():
        lo, hi = int(topk_ids.min()), int(topk_ids.max())
        if lo < -1 or hi >= E:
            raise ValueError(
                f"topk_ids: expected values in [-1, {E}) (local expert ids, -1 = not on this "
                f"shard), found min {lo} max {hi}"
            )
    return MoEShapes(T=T, K=K, E=E, H=H, I=I)


def check_combine_inputs(outputs: torch.Tensor, topk_weights: torch.Tensor, out: torch.Tensor | None = None) -> None:
    """outputs floating [T, K, H]; topk_weights floating [T, K]; out (optional) contiguous [T, H] outputs.dtype."""
    if not isinstance(outputs, torch.Tensor):
        raise ValueError(f"outputs: expected a torch.Tensor, found {type(outputs).__name__}")
    if outputs.dtype not in _FLOATS:
        raise ValueError(f"outputs: expected a floating-point dtype, found {outputs.dtype}")
    if outputs.dim() != 3:
        raise ValueError(f"outputs: expected rank 3 [T,K,H], found rank {outputs.dim()} {_shape(outputs)}")
    T, K, H = outputs.shape
    if not isinstance(topk_weights, torch.Tensor):
        raise ValueError(f"topk_weights: expected a torch.Tensor, found {type(topk_weights).__name__}")
    if topk_weights.dtype not in _FLOATS:
        raise ValueError(f"topk_weights: expected a floating-point dtype, found {topk_weights.dtype}")
    _check_tensor("topk_weights", topk_weights, None, (T, K), outputs.device)
    if out is not None:
        _check_tensor("out", out, outputs.dtype, (T, H), outputs.device)
        if not out.is_contiguous():
            raise ValueError(f"out: expected a contiguous tensor, found strides {tuple(out.stride())}")


# ------------------------------------------------------------------------------ batch-invariant building blocks
def invariant_linear(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """a [M, Kd] fp32 @ w [N, Kd]^T → [M, N] fp32, each row's bits independent of the other rows and of M
    (`kernels.batch_invariant.linear`: 16-row tiles, at most 1024 rows a call; plain F.linear off the CPU)."""
    return linear(a, w)


def swiglu(gate_up: torch.Tensor, *, activation: GatedActivation = SWIGLU) -> torch.Tensor:
    """gate_up [M, 2I] fp32 (gate | up) → act(gate, up) [M, I] fp32 (silu(gate) ⊙ up by default), each element
    through the same SIMD path (`kernels.activation.gated_act` over `kernels.batch_invariant.pointwise`)."""
    i = gate_up.shape[1] // 2
    return gated_act(gate_up[:, :i], gate_up[:, i:], activation)


def expert_mlp(
    xe: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, *, activation: GatedActivation = SWIGLU
) -> torch.Tensor:
    """xe [M, H] rows, w13 [2I, H], w2 [H, I] (fp32, or bf16 GEMMs) → W2 · act(gate, up) [M, H], batch-invariant.
    The activation runs in fp32 (`gated_act`) and is rounded back to the GEMMs' dtype."""
    gate_up = invariant_linear(xe, w13)
    return invariant_linear(swiglu(gate_up, activation=activation).to(gate_up.dtype), w2)


# ------------------------------------------------------------------------------------------------- reference
def _expert_slots(topk_ids: torch.Tensor, n_experts: int):
    """(e, token indices, slot indices) of every expert with slots in topk_ids, ascending e."""
    for e in range(n_experts):
        t_idx, k_idx = (topk_ids == e).nonzero(as_tuple=True)
        if t_idx.numel():
            yield e, t_idx, k_idx


def moe_expert_outputs(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    experts: MXFP4Experts,
    *,
    out: torch.Tensor | None = None,
    activation: GatedActivation = SWIGLU,
) -> torch.Tensor:
    """Reference: for each expert, find its (token, k) slots, dequantise its weights, run the MLP on those rows.

    x [T, H] floating; topk_ids int64 [T, K] local ids in [-1, E) → [T, K, H] in x.dtype (into `out` if given);
    slots with id -1 are exactly 0. fp32 throughout, one rounding to x.dtype at the end.
    """
    s = check_moe_inputs(x, topk_ids, experts, out)
    check_activation(activation)
    result = torch.zeros(s.T, s.K, s.H, dtype=torch.float32, device=x.device)
    xf = x.float()
    for e, t_idx, k_idx in _expert_slots(topk_ids, s.E):
        w13, w2 = experts.dequantize(e, torch.float32)  # [2I, H], [H, I]
        result[t_idx, k_idx] = expert_mlp(xf[t_idx], w13, w2, activation=activation)
    if out is None:
        return result.to(x.dtype)
    out.copy_(result)
    return out


def moe_combine(outputs: torch.Tensor, topk_weights: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """outputs [T, K, H] + topk_weights [T, K] → Σ_k w[t,k] · outputs[t,k] [T, H] in outputs.dtype.

    The one canonical order: fp32, k = 0, 1, …, K-1, each step a separate multiply then add (no fused or
    reordered reduction), so a token's sum depends only on its own rows. K = 0 gives zeros."""
    check_combine_inputs(outputs, topk_weights, out)
    T, K, H = outputs.shape
    acc = torch.zeros(T, H, dtype=torch.float32, device=outputs.device)
    w = topk_weights.float()
    for k in range(K):
        acc = acc + outputs[:, k].float() * w[:, k : k + 1]
    if out is None:
        return acc.to(outputs.dtype)
    out.copy_(acc)
    return out


def moe_reference(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    experts: MXFP4Experts,
    *,
    activation: GatedActivation = SWIGLU,
) -> torch.Tensor:
    """x [T, H] → Σ_k topk_weights[t,k] · expert_{topk_ids[t,k]}(x_t) [T, H] in x.dtype (reference path)."""
    return moe_combine(
        moe_expert_outputs(x, topk_ids, experts, activation=activation),
        topk_weights,
    )


def moe_expert_outputs_tile_order(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    experts: MXFP4Experts,
    *,
    activation: GatedActivation = SWIGLU,
) -> torch.Tensor:
    """What the CPU kernel's isa amx computes, spelled out (slow: tests only): x bf16 [T, H] → fp32 [T, K, H].
    Each expert's weights decoded to bf16 (the exact MXFP4 values), gate | up = the tile-order sum of x's row and
    each weight row (`kernels.linear.naive.matmul_in_tile_order_fp32`), h = act(gate, up) in fp32 rounded to bf16,
    out = the tile-order sum of h and W2's rows. Slots with id -1 are exactly 0."""
    s = check_moe_inputs(x, topk_ids, experts)
    check_activation(activation)
    if x.dtype != torch.bfloat16:
        raise ValueError(f"x: expected bfloat16 (the tile unit's operand), found {x.dtype}")
    result = torch.zeros(s.T, s.K, s.H, dtype=torch.float32, device=x.device)
    for e, t_idx, k_idx in _expert_slots(topk_ids, s.E):
        w13, w2 = experts.dequantize(e, torch.bfloat16)  # [2I, H], [H, I]
        gate_up = matmul_in_tile_order_fp32(x[t_idx], w13)
        i = gate_up.shape[1] // 2
        h = gated_act(gate_up[:, :i], gate_up[:, i:], activation).to(torch.bfloat16)
        result[t_idx, k_idx] = matmul_in_tile_order_fp32(h, w2)
    return result
