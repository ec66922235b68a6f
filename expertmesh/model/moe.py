"""The mixture of experts: routing (sigmoid, group-limited top-k), the routed experts in MXFP4, the canonical
routed sum, and the layer's MoE (router, shared experts, routed experts; a latent MoE's down / up projection).

Where the routed experts are computed is the `RoutedExpertsBackend`'s business: `LocalExperts` (the default)
runs the layer's own `RoutedExperts`; an attention worker passes its expert exchange (worker/exchange.py), which
sends the rows to the expert workers. Either way the routed sum is folded in kernels/moe/combine.py's canonical
order, so the bits do not depend on the backend.

Shapes: N token rows, H hidden, W the experts' width (H, or the latent of a latent MoE), E routed experts,
K top-k, I the experts' intermediate size.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Protocol

import torch
from torch import nn

from expertmesh.kernels import moe as moe_ops
from expertmesh.kernels.batch_invariant import pointwise
from expertmesh.kernels.moe.combine import grouped_combine
from expertmesh.model.config import ModelConfig
from expertmesh.model.layers import GatedMLP, Linear, RMSNorm, gated_activation


def route_tokens(
    scores_logits: torch.Tensor, correction_bias: torch.Tensor, cfg: ModelConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid gating with group-limited top-k (DeepSeek-V3 style).

    scores_logits [N, E] → (topk_ids [N, K] int64, topk_weights [N, K] fp32). The correction bias steers
    selection only; weights are the unbiased sigmoid scores, renormalised over the K chosen when
    `norm_topk_prob`, times `routed_scaling_factor`. Ties go to the lower expert id (torch.topk, stable input).
    """
    moe = cfg.moe
    scores = pointwise(torch.sigmoid, scores_logits.float())  # [N, E]
    choice = scores + correction_bias.float()
    if moe.n_group > 1:
        grouped = choice.view(-1, moe.n_group, moe.n_routed_experts // moe.n_group)
        group_score = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)  # [N, G]
        keep = group_score.topk(moe.topk_group, dim=-1).indices
        dropped = torch.ones_like(group_score, dtype=torch.bool).scatter_(1, keep, False)
        choice = grouped.masked_fill(dropped[..., None], float("-inf")).view_as(choice)
    topk_ids = choice.topk(moe.top_k, dim=-1).indices  # [N, K], best first
    weights = scores.gather(1, topk_ids)
    if moe.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return topk_ids, weights * moe.routed_scaling_factor


class RoutedExperts(nn.Module):
    """A layer's routed experts (all of them, or the shard an expert worker holds) in MXFP4.

    Buffers follow the checkpoint layout: gate_up blocks [E, 2I, W/2] + scales [E, 2I, W/32], down blocks
    [E, W, I/2] + scales [E, W, I/32], W the experts' width (cfg.expert_hidden_size: the hidden size, or the
    latent of a latent MoE). `expert_ids` lists which global experts the rows are."""

    def __init__(self, cfg: ModelConfig, expert_ids: list[int] | None = None):
        super().__init__()
        h, i = cfg.expert_hidden_size, cfg.moe.expert_intermediate_size
        self.activation = gated_activation(cfg.activation)
        ids = list(range(cfg.moe.n_routed_experts)) if expert_ids is None else list(expert_ids)
        e = len(ids)
        self.n_global = cfg.moe.n_routed_experts
        self.ids = ids
        self.register_buffer("expert_ids", torch.empty(e, dtype=torch.int64), persistent=False)
        self.register_buffer("gate_up_blocks", torch.zeros(e, 2 * i, h // 2, dtype=torch.uint8))
        self.register_buffer("gate_up_scales", torch.zeros(e, 2 * i, h // 32, dtype=torch.uint8))
        self.register_buffer("down_blocks", torch.zeros(e, h, i // 2, dtype=torch.uint8))
        self.register_buffer("down_scales", torch.zeros(e, h, i // 32, dtype=torch.uint8))
        self.register_buffer("global_to_local", torch.empty(self.n_global, dtype=torch.int64), persistent=False)
        self.reset_index()

    def reset_index(self, device: torch.device | str | None = None) -> None:
        """(Re)write the index tables from `ids` on `device` (default: where they are), e.g. after `to_empty`,
        which leaves non-persistent buffers unset."""
        device = self.expert_ids.device if device is None else device
        local = torch.full((self.n_global,), -1, dtype=torch.int64, device="cpu")
        local[torch.tensor(self.ids, dtype=torch.int64, device="cpu")] = torch.arange(len(self.ids), device="cpu")
        self.expert_ids = torch.tensor(self.ids, dtype=torch.int64, device="cpu").to(device)
        self.global_to_local = local.to(device)

    def forward(self, h: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """h [N, W], topk_ids [N, K] GLOBAL expert ids (−1: skip) → [N, K, W] unweighted outputs (0 where
        the expert is not held here or the id is −1)."""
        return moe_ops.moe_expert_outputs(
            h,
            self._local_ids(topk_ids),
            self.weights,
            activation=self.activation,
        )

    @property
    def weights(self) -> moe_ops.MXFP4Experts:
        """The four buffers as the kernels' one weight argument (built per call: the buffers may be replaced)."""
        return moe_ops.MXFP4Experts(self.gate_up_blocks, self.gate_up_scales, self.down_blocks, self.down_scales)

    def _local_ids(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """GLOBAL expert ids [N, K] (−1: skip) → this shard's local ids (−1 where skipped or not held)."""
        return torch.where(topk_ids >= 0, self.global_to_local[topk_ids.clamp(min=0)], -1)

    def outputs_fp32(self, h: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """`forward(h.float(), topk_ids)` — fp32 [N, K, W] — with a bf16 h read as it is where the CPU kernel runs
        (its AVX512-BF16 path; the same bits, kernels/moe/cpu_kernel.py)."""
        if h.dtype == torch.bfloat16 and h.device.type == "cpu" and moe_ops.cpu_kernel_runs(h, self.weights):
            return moe_ops.cpu_kernel.moe_expert_outputs(
                h,
                self._local_ids(topk_ids),
                self.weights,
                activation=self.activation,
                fp32_output=True,
            )
        return self(h.float(), topk_ids)


def routed_sum(
    cfg: ModelConfig, routed: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """routed [N, K, W] expert outputs of ids [N, K] with gate weights [N, K] → fp32 [N, W], the canonical grouped
    combine (per combine group in ascending expert id, then the groups ascending, each rounded through `dtype`)."""
    return grouped_combine(
        routed, ids, weights, n_experts=cfg.moe.n_routed_experts, n_groups=cfg.moe.combine_groups, dtype=dtype
    )


class MoE(nn.Module):
    """Router, shared experts and routed experts of one layer. A latent MoE (Kimi K3, `moe.latent_size`): the
    router and the shared experts read the full-width input h, the routed experts a down-projection z of it, and
    their weighted sum is RMS-normed and projected back up before the shared output is added."""

    def __init__(self, cfg: ModelConfig, routed_experts: bool = True):
        """`routed_experts=False`: the routed experts are left out (an empty `RoutedExperts`: attention workers)."""
        super().__init__()
        self.cfg = cfg
        e, h, lt = cfg.moe.n_routed_experts, cfg.hidden_size, cfg.moe.latent_size
        self.router = Linear(h, e)
        self.router_bias = nn.Parameter(torch.zeros(e))  # selection-only correction bias
        self.shared = (
            GatedMLP(h, cfg.moe.n_shared_experts * cfg.moe.expert_intermediate_size, cfg.activation)
            if cfg.moe.n_shared_experts
            else None
        )
        if lt is not None:
            self.latent_down, self.latent_up = Linear(h, lt), Linear(lt, h)
            self.latent_norm = RMSNorm(lt, cfg.rms_norm_eps) if cfg.moe.latent_norm else None
        self.experts = RoutedExperts(cfg, None if routed_experts else [])

    def forward(self, h: torch.Tensor, layer: int, experts: RoutedExpertsBackend, dtype: torch.dtype) -> torch.Tensor:
        """h = ffn_norm(x) [N, H] of layer `layer` → the MoE's output fp32 [N, H]: the routed experts through
        `experts` (the routed sum rounded through `dtype`, the stream's), the shared experts meanwhile."""
        z, ids, weights = self.select(h)  # z: the routed experts' input (the latent of a latent MoE)
        pending = experts.start(layer, self, z, ids, weights, dtype)
        with experts.overlap(h.shape[0]):
            shared = self.shared_out(h)  # while the routed experts compute elsewhere
        return self.output(shared, experts.finish(pending))

    def select(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """h [N, H] → (the routed experts' input [N, W], topk_ids [N, K], topk_weights [N, K]): what an attention
        worker sends to the expert workers before it computes the shared experts."""
        ids, weights = route_tokens(self.router(h), self.router_bias, self.cfg)
        z = self.latent_down(h) if self.cfg.moe.latent_size is not None else h
        return z, ids, weights

    def shared_out(self, h: torch.Tensor) -> torch.Tensor:
        """The shared experts' output [N, H] (zeros without shared experts)."""
        return self.shared(h) if self.shared is not None else torch.zeros_like(h)

    def output(self, shared: torch.Tensor, routed: torch.Tensor) -> torch.Tensor:
        """shared_out [N, H] + the routed sum fp32 [N, W] (kernels/moe/combine.py's canonical order, here or from
        an attention worker's expert exchange), back at the full width for a latent MoE → fp32 [N, H]."""
        if self.cfg.moe.latent_size is not None:
            y = routed.to(shared.dtype)
            y = self.latent_norm(y) if self.latent_norm is not None else y
            routed = self.latent_up(y).float()
        return shared.float() + routed


class RoutedExpertsBackend(Protocol):
    """Where an MoE layer's routed experts are computed. `start` sends (or computes) them, the MoE then computes
    its shared experts inside `overlap(rows)`, and `finish` returns the routed sum fp32 [N, W] (on z's device) in
    kernels/moe/combine.py's canonical order — which is what keeps every backend's bits the same."""

    def start(
        self, layer: int, moe: MoE, z: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype
    ) -> object:
        """z [N, W] the experts' input, ids / weights [N, K] → a handle for `finish`; `dtype`: the stream's."""
        ...

    def overlap(self, rows: int) -> AbstractContextManager:
        """The context the shared experts of `rows` token rows run in while the routed ones compute."""
        ...

    def finish(self, pending: object) -> torch.Tensor: ...


class LocalExperts:
    """The default backend: the layer's own `RoutedExperts` (all of them: the single-process model)."""

    def start(self, layer, moe, z, ids, weights, dtype):
        return routed_sum(moe.cfg, moe.experts(z, ids), ids, weights, dtype)

    def overlap(self, rows: int) -> AbstractContextManager:
        return nullcontext()

    def finish(self, pending: torch.Tensor) -> torch.Tensor:
        return pending


LOCAL_EXPERTS = LocalExperts()
