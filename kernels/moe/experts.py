"""`MXFP4Experts`: one shard's routed-expert weights in MXFP4, the one weight argument of every MoE kernel.

The layout is the checkpoint's (gpt-oss-like, gate and up CONCATENATED along the rows), E experts:
    gate_up_blocks uint8 [E, 2I, H/2], gate_up_scales uint8 [E, 2I, H/32]   rows 0..I-1 = gate, I..2I-1 = up
    down_blocks    uint8 [E, H, I/2],  down_scales    uint8 [E, H, I/32]
H the experts' width (the hidden size, or a latent MoE's latent), I their intermediate size. The shape facts every
backend needs (E, H, I, the device) are read off the bundle; `kernels.moe.naive.check_moe_inputs` checks the whole
contract against the activations. A NamedTuple: immutable, and `*experts` gives the four tensors where a C++ op or
a Triton launch takes them one by one.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from expertmesh.kernels.mxfp4.naive import dequantize_mxfp4, quantize_mxfp4


class MXFP4Experts(NamedTuple):
    gate_up_blocks: torch.Tensor  # uint8 [E, 2I, H/2]
    gate_up_scales: torch.Tensor  # uint8 [E, 2I, H/32]
    down_blocks: torch.Tensor  # uint8 [E, H, I/2]
    down_scales: torch.Tensor  # uint8 [E, H, I/32]

    @classmethod
    def quantize(cls, gate_up: torch.Tensor, down: torch.Tensor) -> MXFP4Experts:
        """Dense gate_up [E, 2I, H] and down [E, H, I] (floating) → the bundle (`quantize_mxfp4`, floor scales)."""
        return cls(*quantize_mxfp4(gate_up), *quantize_mxfp4(down))

    @property
    def n_experts(self) -> int:
        return self.gate_up_blocks.shape[0]

    @property
    def hidden_size(self) -> int:
        """H: the width of the experts' input and output."""
        return self.gate_up_blocks.shape[2] * 2

    @property
    def intermediate_size(self) -> int:
        """I: the width between the two projections."""
        return self.gate_up_blocks.shape[1] // 2

    @property
    def device(self) -> torch.device:
        return self.gate_up_blocks.device

    def contiguous(self) -> MXFP4Experts:
        return MXFP4Experts(*(t.contiguous() for t in self))

    def dequantize(self, expert: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert `expert` (a local index) decoded exactly: (gate_up [2I, H], down [H, I]) in `dtype`."""
        return (
            dequantize_mxfp4(self.gate_up_blocks[expert], self.gate_up_scales[expert], dtype),
            dequantize_mxfp4(self.down_blocks[expert], self.down_scales[expert], dtype),
        )
