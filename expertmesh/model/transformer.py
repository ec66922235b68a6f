"""The single-process reference model's stack: the decoder layer, the layer loop, the LM head, initialisation
and generation. The math of the published Kimi K3 where its config asks for it: attention residuals
(`ResidualStream`), the latent MoE, SiTU in every gated MLP, the full-rank KDA output gate, NoPE gated MLA.

Its parts: model/layers.py (norms, projections, rotary, gated MLP), model/attention.py (KDA, MLA / DSA),
model/moe.py (routing, routed experts, the MoE and its `RoutedExpertsBackend`), model/cache.py (per-sequence
caches, segments). Every op a token goes through works either row by row through `kernels.batch_invariant`
(projections, gate, shared experts, LM head) or per sequence (attention, conv, recurrent state), so a sequence
gets the same numbers alone or in any batch.

The distributed engine runs this same loop: an attention worker calls `Transformer.hidden_states` with its
expert exchange as the `RoutedExpertsBackend` (worker/exchange.ExchangeExperts), and expert workers run
`RoutedExperts` with the partial sums of kernels/moe/combine.py — so it produces the same greedy tokens.

Shapes: N tokens of a step (all sequences' new tokens concatenated), H hidden, V vocabulary, E routed experts,
K top-k.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from expertmesh.kernels.mxfp4 import quantize_mxfp4
from expertmesh.kernels.norm import cpu_kernel as norm_kernel
from expertmesh.kernels.norm import naive as norm_naive
from expertmesh.model.attention import KDAttention, LatentAttention
from expertmesh.model.cache import Segment, SequenceCache
from expertmesh.model.config import FP32_PARAMETERS, ModelConfig
from expertmesh.model.layers import GatedMLP, Linear, RMSNorm
from expertmesh.model.moe import LOCAL_EXPERTS, MoE, RoutedExperts, RoutedExpertsBackend
from expertmesh.model.sampling import Sampler
from expertmesh.model.vision import Projector, VisionTower, init_vision_
from expertmesh.wire.sampling_params import SamplingParams


# ----------------------------------------------------------------------------------------------- residuals
class ResidualMix(nn.Module):
    """One attention-residual mix (Kimi K3): over the sources S_j — the banked blocks, then the current stream —
    score_j = (S_j · w) / rms(S_j) per token with w = norm ⊙ proj, p = softmax_j(score), → Σ_j p_j S_j (the raw
    sources). The published names keep the norm [H] and the projection [1, H] apart; only their product acts."""

    def __init__(self, hidden: int, eps: float):
        super().__init__()
        self.norm = RMSNorm(hidden, eps)
        self.proj = Linear(hidden, 1)

    def forward(self, blocks: list[torch.Tensor], current: torch.Tensor) -> torch.Tensor:
        if not blocks:
            return current  # nothing banked yet: the stream itself
        sources = [*blocks, current]  # each [N, H]
        proj = self.proj.weight[0]
        if norm_kernel.takes(current, self.norm.weight, proj) and all(
            b.dtype == current.dtype and b.dim() == 2 for b in blocks
        ):  # CPU: one C++ op per mix, rows batch-invariant (the PyTorch form's ~40 ATen ops a call cost more at decode)
            return norm_kernel.residual_mix(sources, self.norm.weight, proj, self.norm.eps)
        return norm_naive.residual_mix(sources, self.norm.weight, proj, self.norm.eps)


@dataclass
class ResidualStream:
    """What flows between layers for N rows. Plain models: `current` is x. With attention residuals
    (`attn_res_block_size` B): `blocks` holds the banked block inputs (the embeddings first, then the sum of each
    finished block of B layers) and `current` the sum of every output since the last block start."""

    current: torch.Tensor  # [N, H]
    blocks: list[torch.Tensor] = field(default_factory=list)


# ----------------------------------------------------------------------------------------------- the model
class Layer(nn.Module):
    """One decoder layer over a ResidualStream: attention, then a dense gated MLP or an MoE, each on an RMS-normed
    input — the stream itself, or (attention residuals) its mix with the banked blocks; a layer that starts a
    block banks the stream it received and restarts it from its attention output."""

    def __init__(
        self,
        cfg: ModelConfig,
        index: int,
        dense_attention: bool = False,
        routed_experts: bool = True,
        mtp: bool = False,
    ):
        """`mtp`: an MTP layer's block (index n_layers + j): `cfg.mtp_layer_type` attention, an MoE, no attention
        residuals, its cache the one entry of its MTP layer's own SequenceCache."""
        super().__init__()
        self.index, self.kind = index, cfg.mtp_layer_type if mtp else cfg.layer_types[index]
        self.cache_slot = 0 if mtp else index  # which entry of the cache's layers this layer reads
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = (
            KDAttention(cfg)
            if self.kind == "kda"
            else LatentAttention(cfg, indexed=self.kind == "dsa", dense=dense_attention)
        )
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.block_size = None if mtp else cfg.attn_res_block_size
        if self.block_size is not None:
            self.attn_res = ResidualMix(cfg.hidden_size, cfg.rms_norm_eps)
            self.ffn_res = ResidualMix(cfg.hidden_size, cfg.rms_norm_eps)
        self.is_moe = mtp or cfg.is_moe_layer(index)
        if self.is_moe:
            self.moe = MoE(cfg, routed_experts)
        else:
            self.mlp = GatedMLP(cfg.hidden_size, cfg.dense_intermediate_size, cfg.activation)

    def attention_block(self, r: ResidualStream, segments: list[Segment]) -> None:
        if self.block_size is None:
            r.current = r.current + self.attn(self.attn_norm(r.current), segments, self.cache_slot)
            return
        h = self.attn_res(r.blocks, r.current)  # mixed before this layer banks anything
        out = self.attn(self.attn_norm(h), segments, self.cache_slot)
        if self.index % self.block_size == 0:  # a block starts: bank the stream, restart it
            r.blocks.append(r.current)
            r.current = out
        else:
            r.current = r.current + out

    def ffn_input(self, r: ResidualStream) -> torch.Tensor:
        """The MLP's / MoE's normed input [N, H]."""
        return self.ffn_norm(self.ffn_res(r.blocks, r.current) if self.block_size is not None else r.current)

    def forward(
        self, r: ResidualStream, segments: list[Segment], experts: RoutedExpertsBackend = LOCAL_EXPERTS
    ) -> None:
        """Advance the stream by this layer; an MoE layer's routed experts are computed by `experts`."""
        self.attention_block(r, segments)
        h = self.ffn_input(r)
        if self.is_moe:
            r.current = r.current + self.moe(h, self.index, experts, r.current.dtype).to(r.current.dtype)
        else:
            r.current = r.current + self.mlp(h)


class MTPLayer(nn.Module):
    """One multi-token-prediction layer (DeepSeek-V3's layout, as Kimi K3 ships it under model.layers.<n_layers+j>.):
    from h_t, the main model's final normed hidden state at t, and the embedding of token t+1,
    eh_proj(cat(enorm(emb), hnorm(h))) → one decoder block (`cfg.mtp_layer_type` attention over its own cache, an
    MoE, no attention residuals) → its output hidden state, which `logits` reads through shared_head (norm, head)
    as the prediction of token t+2. Chained drafting feeds that output hidden state back in as the next h."""

    def __init__(self, cfg: ModelConfig, slot: int, dense_attention: bool = False, routed_experts: bool = True):
        super().__init__()
        h = cfg.hidden_size
        self.enorm, self.hnorm = RMSNorm(h, cfg.rms_norm_eps), RMSNorm(h, cfg.rms_norm_eps)
        self.eh_proj = Linear(2 * h, h)
        self.block = Layer(cfg, cfg.n_layers + slot, dense_attention, routed_experts, mtp=True)
        self.head_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.head = Linear(h, cfg.vocab_size)

    def new_cache(self) -> SequenceCache:
        """The layer's own cache: one entry, its block's (positions as the main model's: entry p from h_p)."""
        return SequenceCache(layers=[self.block.attn.new_cache()])

    @torch.no_grad()
    def forward(
        self,
        emb_next: torch.Tensor,
        hidden: torch.Tensor,
        segments: list[Segment],
        experts: RoutedExpertsBackend = LOCAL_EXPERTS,
    ) -> torch.Tensor:
        """emb_next [N, H] the embeddings of tokens t+1, hidden [N, H] the main model's normed final states at t
        (or this layer's own output, chained) → this layer's output hidden states [N, H]. Advancing the caches'
        lengths is the caller's, as for `Transformer.hidden_states`."""
        x = self.eh_proj(torch.cat([self.enorm(emb_next), self.hnorm(hidden.to(emb_next.dtype))], dim=-1))
        r = ResidualStream(x)
        self.block(r, segments, experts)
        return r.current

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Output hidden states [N, H] → fp32 logits [N, V] of the token after next."""
        return self.head(self.head_norm(x)).float()


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, dense_attention: bool = False, routed_experts: bool = True, mtp: bool = False):
        """`routed_experts=False` builds no routed-expert buffers (what an attention worker holds). `mtp=True` also
        builds the config's MTP layers as `mtp` (speculative decoding's drafter; the default state dict has none)."""
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Layer(cfg, i, dense_attention, routed_experts) for i in range(cfg.n_layers))
        if cfg.attn_res_block_size is not None:
            self.out_res = ResidualMix(cfg.hidden_size, cfg.rms_norm_eps)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight  # one tensor: the checkpoint holds embed.weight only
        if cfg.vision is not None:  # image input (expertmesh/model/vision.py): kimi_k25's names
            self.vision_tower = VisionTower(cfg.vision)
            self.mm_projector = Projector(cfg.vision, cfg.hidden_size)
        if mtp:  # registered last: the main model's parameters keep their order (and init_random_'s draws)
            if not cfg.n_mtp_layers:
                raise ValueError(f"mtp: the model {cfg.name!r} has no MTP layers (n_mtp_layers = 0)")
            self.mtp = nn.ModuleList(MTPLayer(cfg, j, dense_attention, routed_experts) for j in range(cfg.n_mtp_layers))

    def new_cache(self) -> SequenceCache:
        return SequenceCache(layers=[layer.attn.new_cache() for layer in self.layers])

    def output(self, r: ResidualStream) -> torch.Tensor:
        """The last layer's stream → the final hidden state [N, H] (before the final norm): attention residuals mix
        it with every banked block once more."""
        return self.out_res(r.blocks, r.current) if self.cfg.attn_res_block_size is not None else r.current

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Final hidden states [N, H] → fp32 logits [N, V]."""
        return self.lm_head(self.norm(x)).float()

    @torch.no_grad()
    def hidden_states(
        self, x: torch.Tensor, segments: list[Segment], experts: RoutedExpertsBackend = LOCAL_EXPERTS
    ) -> torch.Tensor:
        """The layer loop: x [N, H] (the step's embedded tokens, images spliced in) → the final hidden states
        [N, H] before the final norm. Every layer's cache takes the step's entries; advancing the caches' lengths
        is the caller's (`forward` does; an attention worker only for the sequences whose step succeeded).
        `experts`: where the MoE layers' routed experts are computed (an attention worker: its expert exchange)."""
        r = ResidualStream(x)
        for layer in self.layers:
            layer(r, segments, experts)
        return self.output(r)

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, segments: list[Segment]) -> torch.Tensor:
        """tokens [N] (the new tokens of every segment, concatenated) → logits [N, V]; advances the caches."""
        x = self.hidden_states(self.embed(tokens), segments)
        for seg in segments:
            seg.cache.length += seg.length
        return self.logits(x)

    @torch.no_grad()
    def step(self, token_ids: list[int], cache: SequenceCache) -> torch.Tensor:
        """One sequence: feed `token_ids` after what `cache` has seen → logits [len, V]."""
        tokens = torch.tensor(token_ids, dtype=torch.int64, device=self.embed.weight.device)
        return self.forward(tokens, [Segment(0, len(token_ids), cache)])


# ----------------------------------------------------------------------------------------------- init
# FP32_PARAMETERS (model/config.py) are kept in fp32 whatever the compute dtype; everything else is stored in bf16.
def stored_dtype(name: str) -> torch.dtype:
    """The dtype a native checkpoint stores parameter `name` (a state-dict name, not a routed expert) in."""
    return torch.float32 if name.endswith(FP32_PARAMETERS) else torch.bfloat16


def compute_dtype_of(name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype parameter `name` is held in when the model computes in `dtype`: FP32_PARAMETERS stay fp32."""
    return torch.float32 if name.endswith(FP32_PARAMETERS) else dtype


def materialize_(model: nn.Module, device: torch.device | str, dtype: torch.dtype) -> nn.Module:
    """Give a model built on the meta device uninitialised storage on `device` (meta: still none), parameters in
    `dtype` except the FP32_PARAMETERS; the routed experts' index tables rewritten. Load weights afterwards."""
    new: dict[int, nn.Parameter] = {}  # by the old parameter: a tied one stays one tensor
    for name, p in model.named_parameters():
        new[id(p)] = nn.Parameter(
            torch.empty(p.shape, dtype=compute_dtype_of(name, dtype), device=device), requires_grad=p.requires_grad
        )
    for mod in model.modules():
        for pname, p in list(mod._parameters.items()):
            if p is not None:
                mod._parameters[pname] = new[id(p)]
        for bname, b in list(mod._buffers.items()):
            if b is not None:
                mod._buffers[bname] = torch.empty(b.shape, dtype=b.dtype, device=device)
        if isinstance(mod, RoutedExperts):
            mod.reset_index()
    return model


@torch.no_grad()
def init_random_(model: Transformer, seed: int) -> Transformer:
    """Seeded random weights with scales that keep activations O(1) through the stack."""
    cfg = model.cfg
    gen = torch.Generator().manual_seed(seed)
    std = cfg.init_std
    for name, p in model.named_parameters():
        if name.startswith(("vision_tower.", "mm_projector.")):
            continue  # their own generator below: text weights stay as they were
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif name.endswith("norm.bias"):
            p.zero_()
        elif name.endswith("A_log"):
            p.copy_(torch.log(torch.empty_like(p).uniform_(1.0, 16.0, generator=gen)))
        elif name.endswith("dt_bias"):
            p.copy_(torch.empty_like(p).uniform_(-4.0, -1.0, generator=gen))  # softplus → slow-ish decay
        elif name.endswith("router_bias"):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.01)
        elif name.endswith("_conv.weight"):
            p.copy_(torch.randn(p.shape, generator=gen) * (1.0 / math.sqrt(p.shape[-1])))
        else:
            p.copy_(torch.randn(p.shape, generator=gen) * std)
    mtp_blocks = [m.block for m in model.mtp] if hasattr(model, "mtp") else []
    for layer in [*model.layers, *mtp_blocks]:
        if not layer.is_moe:
            continue
        ex = layer.moe.experts
        e = ex.gate_up_blocks.shape[0]
        h, i = cfg.expert_hidden_size, cfg.moe.expert_intermediate_size
        gate_up = torch.randn(e, 2 * i, h, generator=gen) * std
        down = torch.randn(e, h, i, generator=gen) * std
        ex.gate_up_blocks, ex.gate_up_scales = quantize_mxfp4(gate_up)
        ex.down_blocks, ex.down_scales = quantize_mxfp4(down)
    if cfg.vision is not None:
        init_vision_(model, seed + 1)
    # round to the stored dtype once, so a model made here equals one loaded from disk
    for name, p in model.named_parameters():
        p.copy_(p.to(stored_dtype(name)).float())
    return model


def module_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every state-dict tensor of the model for `cfg` and its shape, built on the meta device (no memory). A tied
    LM head appears once, as embed.weight."""
    with torch.device("meta"):
        model = Transformer(cfg)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        del shapes["lm_head.weight"]
    return shapes


# ----------------------------------------------------------------------------------------------- generation
@dataclass
class Generation:
    tokens: list[int] = field(default_factory=list)
    finish_reason: str = "length"


@torch.no_grad()
def generate(
    model: Transformer, prompt: list[int], params: SamplingParams, prefill_chunk: int | None = None
) -> Generation:
    """Prefill the prompt (in chunks of `prefill_chunk` tokens when given), then decode token by token."""
    if not prompt:
        raise ValueError("prompt: expected at least one token")
    cache = model.new_cache()
    chunk = prefill_chunk or len(prompt)
    logits = None
    for start in range(0, len(prompt), chunk):
        logits = model.step(prompt[start : start + chunk], cache)
    sampler = Sampler(params)
    out = Generation()
    for _ in range(params.max_tokens):
        token = sampler.sample(logits[-1])
        sampler.observe(token)
        out.tokens.append(token)
        if token in params.stop_token_ids:
            out.finish_reason = "stop"
            break
        if cache.length >= model.cfg.max_context:
            break
        logits = model.step([token], cache)
    return out
