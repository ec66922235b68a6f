"""The model's building blocks: norms, the batch-invariant projection, rotary embedding, the gated MLP and the
short convolution's parameters. Each works row by row (a row's numbers never depend on the other rows), the
property every module above relies on for batch invariance.

Shapes: T (or N) token rows, D a head or feature width.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

from expertmesh.kernels.activation import GatedActivation, gated_act
from expertmesh.kernels.batch_invariant import linear, linear_fused
from expertmesh.kernels.moe import cpu_activation_runs
from expertmesh.kernels.moe import cpu_kernel as moe_kernel
from expertmesh.kernels.norm import cpu_kernel as norm_kernel
from expertmesh.kernels.norm import naive as norm_naive
from expertmesh.model.config import ActivationConfig, RopeConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if norm_kernel.takes(x, self.weight):  # CPU: one C++ op (kernels/norm), rows batch-invariant
            return norm_kernel.rms_norm(x, self.weight, self.eps)
        return norm_naive.rms_norm(x, self.weight, self.eps)


class LayerNorm(nn.Module):
    """LayerNorm with weight and bias over the last dim, row by row in fp32 (the DSA indexer's key norm)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if norm_kernel.takes(x, self.weight, self.bias):
            return norm_kernel.layer_norm(x, self.weight, self.bias, self.eps)
        return norm_naive.layer_norm(x, self.weight, self.bias, self.eps)


class Linear(nn.Module):
    """A projection through the batch-invariant matmul (bias optional)."""

    def __init__(self, d_in: int, d_out: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(d_out, d_in))
        self.bias = nn.Parameter(torch.zeros(d_out)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # inputs take the weight's dtype: an fp32 weight (FP32_PARAMETERS: routing, indexer head weights) computes
        # in fp32 under bf16 activations, as the published models do; a no-op on the fp32 reference path
        y = linear(x if x.dtype == self.weight.dtype else x.to(self.weight.dtype), self.weight)
        return y + self.bias.to(y.dtype) if self.bias is not None else y


def project(x: torch.Tensor, *layers: Linear) -> list[torch.Tensor]:
    """[layer(x) for layer in layers] for projections that share their input: those in x's dtype without a bias as
    one fused call where the kernel takes them (bf16 on CPU: the same bits as separate calls, the weights streamed
    as one), the others (fp32 weights, biases) one by one."""
    fuse = [i for i, l in enumerate(layers) if l.bias is None and l.weight.dtype == x.dtype]
    if len(fuse) < 2:
        return [l(x) for l in layers]
    out: list = [None] * len(layers)
    for i, y in zip(fuse, linear_fused(x, [layers[i].weight for i in fuse])):
        out[i] = y
    return [y if y is not None else l(x) for y, l in zip(out, layers)]


class RotaryTable:
    """cos / sin of every position for a `dim`-wide rotary slice, computed once per block of positions and kept
    (least recently used first out): angles in float64 (exact at 1M positions), cos/sin scaled by YaRN's attention
    factor, stored fp32. An entry depends only on its position, never on the batch that first asked for it."""

    BLOCK = 4096  # positions per cached block (fp32 cos+sin of 32 frequencies: 1 MiB)
    MAX_BLOCKS = 16

    def __init__(self, rope: RopeConfig, dim: int):
        self.rope, self.dim = rope, dim
        self.blocks: OrderedDict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor]] = OrderedDict()

    def _block(self, b: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        key = (b, device)
        if key in self.blocks:
            self.blocks.move_to_end(key)
            return self.blocks[key]
        with torch.device("cpu"):  # also when the model was built under a meta-device context
            inv_freq = self.rope.inv_freq(self.dim)  # [dim/2] float64
            pos = torch.arange(b * self.BLOCK, (b + 1) * self.BLOCK, dtype=torch.float64)
        angles = pos[:, None] * inv_freq[None, :]  # [BLOCK, dim/2]
        factor = self.rope.attention_factor
        entry = (
            (angles.cos() * factor).to(torch.float32).to(device),
            (angles.sin() * factor).to(torch.float32).to(device),
        )
        self.blocks[key] = entry
        if len(self.blocks) > self.MAX_BLOCKS:
            self.blocks.popitem(last=False)
        return entry

    def at(self, start: int, length: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each [length, dim/2] fp32, of positions start .. start + length - 1."""
        device = torch.device(device)
        parts = []
        for b in range(start // self.BLOCK, (start + length - 1) // self.BLOCK + 1):
            cos, sin = self._block(b, device)
            base = b * self.BLOCK
            lo, hi = max(start, base) - base, min(start + length, base + self.BLOCK) - base
            parts.append((cos[lo:hi], sin[lo:hi]))
        if len(parts) == 1:
            return parts[0]
        return torch.cat([c for c, _ in parts]), torch.cat([s for _, s in parts])


def rotary(x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], style: str) -> torch.Tensor:
    """Rotary embedding on the last dim of x [T, ..., D] with (cos, sin) [T, D/2] of its positions
    (`RotaryTable.at`).

    style "half": pairs (i, i + D/2) (rotate-half); "interleaved": pairs (2i, 2i+1) as DeepSeek lays them out,
    written back de-interleaved (rotated evens, then rotated odds) — a fixed permutation of the dims applied to
    queries and keys alike, so their dot products are those of the interleaved rotation; "none": unchanged."""
    if style == "none":
        return x
    cos, sin = cos_sin
    if norm_kernel.takes(x):  # CPU: one C++ op (kernels/norm), bitwise the PyTorch form
        return norm_kernel.rotary(x, cos, sin, style == "interleaved")
    return norm_naive.rotary(x, cos, sin, style == "interleaved")


def l2_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(Σx² + eps) in fp32 (the KDA q/k normalisation as FLA and transformers define it)."""
    if norm_kernel.takes(x):
        return norm_kernel.l2_normalize(x, eps)
    return norm_naive.l2_normalize(x, eps)


def gated_activation(a: ActivationConfig) -> GatedActivation:
    """The kernels' description of the config's MLP activation."""
    return GatedActivation(a.kind, a.beta, a.linear_beta)


class GatedMLP(nn.Module):
    """Dense gated MLP (dense layers and shared experts): down(act(gate(x), up(x))), act SwiGLU or SiTU."""

    def __init__(self, hidden: int, intermediate: int, activation: ActivationConfig):
        super().__init__()
        self.gate, self.up = Linear(hidden, intermediate), Linear(hidden, intermediate)
        self.down = Linear(intermediate, hidden)
        self.activation = gated_activation(activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = project(x, self.gate, self.up)
        if cpu_activation_runs(gate):  # CPU: the routed experts' vector activation (kernels/moe), one C++ op
            h = moe_kernel.gated_activation(
                gate.reshape(-1, gate.shape[-1]), up.reshape(-1, up.shape[-1]), self.activation
            )
            return self.down(h.reshape(gate.shape).to(x.dtype))
        return self.down(gated_act(gate, up, self.activation).to(x.dtype))


class ShortConv(nn.Module):
    """A depthwise causal convolution's parameters: weight [D, 1, kernel] (the published layout), bias [D]."""

    def __init__(self, dim: int, kernel: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, 1, kernel))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None
