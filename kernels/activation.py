"""The gated MLP activation act(gate, up): SwiGLU, or Kimi K3's SiTU, and its plain PyTorch reference.

    swiglu(g, u) = silu(g) · u
    situ(g, u)   = β·tanh(g/β) · σ(g) · (β_lin·tanh(u/β_lin) if β_lin > 0 else u)

σ takes the raw gate g; only the multiplier is soft-capped by β·tanh(g/β), so |situ| ≤ β·|u'|. (vLLM's
`SituAndMul` and llama.cpp's kimi-k3 compute the same function; K3 publishes β = `activation_situ_beta` = 4.0
and β_lin = `activation_situ_linear_beta` = 25.0.) Every MoE expert kernel takes one `GatedActivation`
(keyword `activation`, default `SWIGLU`) and evaluates it in fp32 in this order: a = β·tanh(g/β), a = a·σ(g),
u' = β_lin·tanh(u/β_lin), h = a·u'. The reference below runs each transcendental through
`kernels.batch_invariant.pointwise`, so a row's result never depends on the other rows of the batch. On CPU the
MoE kernel's own vector exp / tanh (`kernels.moe.cpu_kernel.gated_activation`, a few ulp from this) also serves
the dense MLPs and shared experts (`expertmesh.model.layers.GatedMLP`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from expertmesh.kernels.batch_invariant import pointwise

KINDS = ("swiglu", "situ")


def _number(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name}: expected a real number, found {type(value).__name__} {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name}: expected a finite number, found {value}")
    return value


@dataclass(frozen=True)
class GatedActivation:
    """Which act(gate, up) a gated MLP applies. `beta` / `linear_beta` are SiTU's soft caps (ignored by swiglu);
    linear_beta = 0 leaves the up projection uncapped. Invalid values raise ValueError naming the field."""

    kind: Literal["swiglu", "situ"] = "swiglu"
    beta: float = 4.0
    linear_beta: float = 25.0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind: expected one of {', '.join(KINDS)}, found {self.kind!r}")
        beta = _number("beta", self.beta)
        linear_beta = _number("linear_beta", self.linear_beta)
        if self.kind == "situ" and beta <= 0:
            raise ValueError(f"beta: expected > 0 for kind 'situ' (the gate's soft cap), found {beta}")
        if linear_beta < 0:
            raise ValueError(f"linear_beta: expected ≥ 0 (0 = the up projection is not capped), found {linear_beta}")
        object.__setattr__(self, "beta", beta)
        object.__setattr__(self, "linear_beta", linear_beta)

    @property
    def caps_up(self) -> bool:
        """SiTU with β_lin > 0: the up projection is soft-capped too."""
        return self.kind == "situ" and self.linear_beta > 0


SWIGLU = GatedActivation()


def check_activation(activation) -> GatedActivation:
    """`activation` itself when it is a GatedActivation; ValueError naming the argument otherwise."""
    if not isinstance(activation, GatedActivation):
        raise ValueError(f"activation: expected a GatedActivation, found {type(activation).__name__}")
    return activation


def gated_act(gate: torch.Tensor, up: torch.Tensor, activation: GatedActivation = SWIGLU) -> torch.Tensor:
    """gate, up [..., I] (same shape) → act(gate, up) [..., I] in fp32; each transcendental goes through
    `pointwise` (whole SIMD vectors, single-threaded chunks), the multiplies are plain IEEE fp32.

    SwiGLU keeps its arithmetic from before SiTU bit for bit: silu in the gate's own dtype (ATen evaluates a bf16
    silu in fp32 and rounds it; only the benchmarks' bf16 GEMMs feed bf16 here), the product in fp32."""
    act = check_activation(activation)
    if gate.shape != up.shape:
        raise ValueError(f"up: expected the shape of gate {list(gate.shape)}, found {list(up.shape)}")
    if act.kind == "swiglu":
        return pointwise(F.silu, gate).float() * up.float()  # IEEE multiply: the same bits on every path
    g, u = gate.float(), up.float()
    beta, lin = act.beta, act.linear_beta
    a = pointwise(lambda t: beta * torch.tanh(t / beta) * torch.sigmoid(t), g)
    if lin > 0:
        u = pointwise(lambda t: lin * torch.tanh(t / lin), u)
    return a * u
