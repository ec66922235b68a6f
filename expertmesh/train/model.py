"""The K3+DSA model in a form autograd can train: the maths of expertmesh/model/ (which is written for serving —
batch-invariant kernels, caches, no gradients) over a [B, T] batch of whole sequences, with the same parameter
names and shapes as the serving `Transformer`'s state dict, so a trained model exports to K3's Hugging Face layout
through checkpoint/hf_layout's name map and the serving code loads it as it loads Kimi K3.

What training adds:
- routed experts held as float masters (`experts.gate_up` [E, 2I, W], `experts.down` [E, W, I]) and, with `qat`,
  seen through MXFP4 in the forward (the OCP floor rule of kernels/mxfp4, straight-through gradient), so the model
  learns under the quantization it ships in, as K3's experts were trained;
- the DSA indexer trained as DeepSeek-V3.2 trained it: its inputs detached from the model, a KL loss towards the
  main attention's distribution (summed over heads) — over every causal key while dense (`sparse=False`, the
  warm-up), over the selected top-k once sparse, where the main attention sees only the top-k keys;
- one multi-token-prediction layer (DeepSeek-V3's layout, as K3 ships it): from the main model's final normed
  hidden state at t and the embedding of token t+1, eh_proj(cat(enorm(emb), hnorm(h))) → one decoder block (DSA
  attention + MoE, no attention residuals) → shared_head (norm, head), trained to predict token t+2;
- the router's correction bias updated without a loss (DeepSeek-V3's auxiliary-loss-free balancing).

Shapes: B sequences, T tokens, H hidden, E routed experts, K top-k, W the experts' width (the latent), I their
intermediate size, nH heads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from expertmesh.kernels.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from expertmesh.model.config import ActivationConfig, ModelConfig
from expertmesh.train.kda import chunk_kda_train


# ----------------------------------------------------------------------------------------------- building blocks
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class LayerNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.ones(dim)), nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)


class Linear(nn.Module):
    def __init__(self, d_in: int, d_out: int, std: float | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d_out, d_in) * (std if std is not None else d_in**-0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


def situ(gate: torch.Tensor, up: torch.Tensor, a: ActivationConfig) -> torch.Tensor:
    """Kimi K3's SiTU (kernels/activation.py): β·tanh(g/β)·σ(g) · β_lin·tanh(u/β_lin)."""
    act = a.beta * torch.tanh(gate / a.beta) * torch.sigmoid(gate)
    return act * (a.linear_beta * torch.tanh(up / a.linear_beta) if a.linear_beta > 0 else up)


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, activation: ActivationConfig):
        super().__init__()
        self.gate, self.up = Linear(hidden, intermediate), Linear(hidden, intermediate)
        self.down = Linear(intermediate, hidden, std=intermediate**-0.5 / 2)
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(situ(self.gate(x), self.up(x), self.activation))


class ShortConv(nn.Module):
    def __init__(self, dim: int, kernel: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(dim, 1, kernel) * kernel**-0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, D] → SiLU(causal depthwise conv) [B, T, D]: out[t] = Σ_j w[:, j] · x[t − (k−1) + j], written as
        k shifted multiply-adds (autograd's depthwise conv1d backward took seconds per call on CPU)."""
        k = self.weight.shape[-1]
        padded = F.pad(x, (0, 0, k - 1, 0))  # [B, k-1+T, D]
        t = x.shape[1]
        y = sum(padded[:, j : j + t] * self.weight[:, 0, j] for j in range(k))
        return F.silu(y)


def fake_mxfp4(w: torch.Tensor) -> torch.Tensor:
    """w fp32 [..., K] seen through MXFP4 along K (blocks of 32, the serving quantizer) with a straight-through
    gradient: the forward uses exactly the values the exported checkpoint will hold."""
    with torch.no_grad():
        q = dequantize_mxfp4(*quantize_mxfp4(w.detach()), torch.float32)
    return w + (q - w).detach()


# ----------------------------------------------------------------------------------------------- attention
class KDAttention(nn.Module):
    """Kimi Delta Attention, K3's form (model/attention.KDAttention): full-rank output gate, gate lb·σ(A·f)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        a, h = cfg.kda, cfg.hidden_size
        self.n_heads, self.head_dim, inner = a.n_heads, a.head_dim, a.n_heads * a.head_dim
        self.q_proj, self.k_proj, self.v_proj = Linear(h, inner), Linear(h, inner), Linear(h, inner)
        self.q_conv, self.k_conv, self.v_conv = (ShortConv(inner, a.conv_kernel_size) for _ in range(3))
        self.f_a, self.f_b = Linear(h, a.gate_low_rank), Linear(a.gate_low_rank, inner)
        self.A_log = nn.Parameter(torch.log(torch.empty(a.n_heads).uniform_(1.0, 16.0)))
        self.dt_bias = nn.Parameter(torch.empty(inner).uniform_(-4.0, -1.0))
        self.b_proj = Linear(h, a.n_heads)
        self.g_proj = Linear(h, inner)
        self.o_norm = RMSNorm(a.head_dim, cfg.rms_norm_eps)
        self.o_proj = Linear(inner, h, std=inner**-0.5 / 2)
        self.lower_bound, self.l2_eps = a.gate_lower_bound, a.l2_norm_eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        nh, d = self.n_heads, self.head_dim

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(B, T, nh, d)

        def l2(t: torch.Tensor) -> torch.Tensor:
            return t * torch.rsqrt(t.pow(2).sum(-1, keepdim=True) + self.l2_eps)

        q = l2(heads(self.q_conv(self.q_proj(x))))
        k = l2(heads(self.k_conv(self.k_proj(x))))
        v = heads(self.v_conv(self.v_proj(x)))
        a = self.A_log.exp().repeat_interleave(d)  # [inner]
        g = self.lower_bound * torch.sigmoid(a * (self.f_b(self.f_a(x)) + self.dt_bias))  # [B, T, inner] in (lb, 0)
        beta = torch.sigmoid(self.b_proj(x))  # [B, T, nH]
        o = chunk_kda_train(q, k, v, heads(g), beta)  # [B, T, nH, d]
        return self.o_proj(self.o_norm(o).reshape(B, T, -1) * torch.sigmoid(self.g_proj(x)))


class LatentAttention(nn.Module):
    """NoPE gated MLA in the absorbed form (model/attention.LatentAttention), and with `indexed` DeepSeek-V3.2's
    lightning indexer choosing `index_topk` keys per query once training is sparse."""

    def __init__(self, cfg: ModelConfig, indexed: bool):
        super().__init__()
        m, ix, h = cfg.mla, cfg.indexer, cfg.hidden_size
        self.m, self.ix, self.indexed = m, ix, indexed
        self.qk_dim = m.qk_nope_head_dim + m.qk_rope_head_dim
        self.q_a, self.q_a_norm = Linear(h, m.q_lora_rank), RMSNorm(m.q_lora_rank, m.norm_eps)
        self.q_b = Linear(m.q_lora_rank, m.n_heads * self.qk_dim)
        self.kv_a = Linear(h, m.kv_lora_rank + m.qk_rope_head_dim)
        self.kv_a_norm = RMSNorm(m.kv_lora_rank, m.norm_eps)
        self.kv_b = Linear(m.kv_lora_rank, m.n_heads * (m.qk_nope_head_dim + m.v_head_dim))
        self.gate = Linear(h, m.n_heads * m.v_head_dim)
        self.o_proj = Linear(m.n_heads * m.v_head_dim, h, std=(m.n_heads * m.v_head_dim) ** -0.5 / 2)
        if indexed:
            self.index_q = Linear(m.q_lora_rank, ix.n_heads * ix.head_dim)
            self.index_k = Linear(h, ix.head_dim)
            self.index_k_norm = LayerNorm(ix.head_dim)
            self.index_w = Linear(h, ix.n_heads)

    def index_scores(self, x: torch.Tensor, q_lat: torch.Tensor) -> torch.Tensor:
        """The lightning indexer on detached inputs: I[b, t, s] = Σ_h w[b,t,h]·ReLU(q[b,t,h]·k[b,s]) [B, T, T]."""
        ix = self.ix
        B, T, _ = x.shape
        iq = self.index_q(q_lat.detach()).view(B, T, ix.n_heads, ix.head_dim)
        ik = self.index_k_norm(self.index_k(x.detach()))  # [B, T, Di]
        iw = self.index_w(x.detach()) * (ix.n_heads * ix.head_dim) ** -0.5  # [B, T, Hi]
        return torch.einsum("bthd,bsd->btsh", iq, ik).relu().mul(iw[:, :, None, :]).sum(-1)

    def forward(self, x: torch.Tensor, topk: int | None, losses: list[torch.Tensor]) -> torch.Tensor:
        """`topk`: the keys each query sees (None: dense). An indexed layer appends its indexer loss."""
        m = self.m
        B, T, _ = x.shape
        q_lat = self.q_a_norm(self.q_a(x))
        q = self.q_b(q_lat).view(B, T, m.n_heads, self.qk_dim)
        kv = self.kv_a(x)
        c_kv = self.kv_a_norm(kv[..., : m.kv_lora_rank])  # [B, T, kv_lora]
        latent = torch.cat([c_kv, kv[..., m.kv_lora_rank :]], dim=-1)  # NoPE: the rope slice unrotated
        w_kvb = self.kv_b.weight.view(m.n_heads, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
        w_uk, w_uv = w_kvb[:, : m.qk_nope_head_dim], w_kvb[:, m.qk_nope_head_dim :]
        q_full = torch.cat(
            [torch.einsum("bthn,hnc->bthc", q[..., : m.qk_nope_head_dim], w_uk), q[..., m.qk_nope_head_dim :]], -1
        )
        logits = torch.einsum("bthc,bsc->bhts", q_full, latent) * self.qk_dim**-0.5  # [B, nH, T, T]
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        visible = causal
        if self.indexed:
            scores = self.index_scores(x, q_lat).masked_fill(~causal, float("-inf"))  # [B, T, T]
            if topk is not None and topk < T:
                # ties to the lower position, as the serving kernels choose (kernels/dsa/naive.py)
                chosen = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :topk]
                visible = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, chosen, True) & causal
            p_index = torch.log_softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        probs = torch.softmax(
            logits.masked_fill(~visible[:, None] if visible.dim() == 3 else ~visible, float("-inf")), -1
        )
        if self.indexed:
            target = probs.detach().sum(1)  # [B, T, T]: over heads, then L1-normalised
            target = target / target.sum(-1, keepdim=True)
            kl = (target * (torch.log(target.clamp_min(1e-12)) - p_index.clamp_min(-1e4))).masked_fill(~visible, 0)
            losses.append(kl.sum(-1).mean())
        o_lat = torch.einsum("bhts,bsc->bthc", probs, c_kv)  # [B, T, nH, kv_lora]
        o = torch.einsum("bthc,hvc->bthv", o_lat, w_uv).reshape(B, T, -1)
        return self.o_proj(o * torch.sigmoid(self.gate(x)))


# ----------------------------------------------------------------------------------------------- MoE
class RoutedExperts(nn.Module):
    """Float masters of a layer's routed experts, seen through MXFP4 when `qat`."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        e, w, i = cfg.moe.n_routed_experts, cfg.expert_hidden_size, cfg.moe.expert_intermediate_size
        self.gate_up = nn.Parameter(torch.randn(e, 2 * i, w) * w**-0.5)
        self.down = nn.Parameter(torch.randn(e, w, i) * i**-0.5 / 2)
        self.activation = cfg.activation
        self.qat = True

    def forward(self, z: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """z [N, W], ids / weights [N, K] → Σ_k weights·expert_k(z) [N, W]."""
        gate_up = fake_mxfp4(self.gate_up) if self.qat else self.gate_up
        down = fake_mxfp4(self.down) if self.qat else self.down
        i = down.shape[-1]
        out = torch.zeros_like(z)
        flat = ids.reshape(-1)
        rows = torch.arange(z.shape[0], device=z.device).repeat_interleave(ids.shape[1])
        for e in torch.unique(flat).tolist():
            sel = (flat == e).nonzero().squeeze(1)
            r = rows[sel]
            gu = z[r] @ gate_up[e].t()
            y = situ(gu[:, :i], gu[:, i:], self.activation) @ down[e].t()
            out = out.index_add(0, r, y * weights.reshape(-1)[sel, None])
        return out


class MoE(nn.Module):
    """Router (sigmoid, correction bias for selection only, ungrouped top-k, renormalised, scaled), shared experts,
    and the latent routed experts (model/moe.MoE)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        moe, h = cfg.moe, cfg.hidden_size
        self.cfg = cfg
        self.router = Linear(h, moe.n_routed_experts)
        self.register_parameter("router_bias", nn.Parameter(torch.zeros(moe.n_routed_experts), requires_grad=False))
        self.shared = GatedMLP(h, moe.n_shared_experts * moe.expert_intermediate_size, cfg.activation)
        self.latent_down, self.latent_up = Linear(h, moe.latent_size), Linear(moe.latent_size, h)
        self.latent_norm = RMSNorm(moe.latent_size, cfg.rms_norm_eps)
        self.experts = RoutedExperts(cfg)
        self.load = torch.zeros(moe.n_routed_experts)  # tokens per expert since the last bias update

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        moe = self.cfg.moe
        shape = h.shape
        h = h.reshape(-1, shape[-1])
        scores = torch.sigmoid(self.router(h))  # [N, E]
        ids = (scores.detach() + self.router_bias).topk(moe.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20) * moe.routed_scaling_factor
        if self.training:
            self.load += torch.bincount(ids.reshape(-1), minlength=moe.n_routed_experts).float()
        routed = self.experts(self.latent_down(h), ids, weights)
        out = self.shared(h) + self.latent_up(self.latent_norm(routed))
        return out.reshape(shape)

    @torch.no_grad()
    def balance_(self, rate: float) -> None:
        """Auxiliary-loss-free balancing: raise the bias of under-loaded experts, lower the over-loaded ones."""
        if self.load.sum() > 0:
            self.router_bias += rate * torch.sign(self.load.mean() - self.load)
        self.load.zero_()


# ----------------------------------------------------------------------------------------------- the model
class ResidualMix(nn.Module):
    """Kimi K3's attention-residual mix (model/transformer.ResidualMix) over [B, T, H] sources."""

    def __init__(self, hidden: int, eps: float):
        super().__init__()
        self.norm, self.proj = RMSNorm(hidden, eps), Linear(hidden, 1, std=0.0)

    def forward(self, blocks: list[torch.Tensor], current: torch.Tensor) -> torch.Tensor:
        if not blocks:
            return current
        sources = torch.stack([*blocks, current])  # [J, B, T, H]
        w = self.norm.weight * self.proj.weight[0]
        score = (sources * w).sum(-1) * torch.rsqrt(sources.pow(2).mean(-1) + self.norm.eps)
        return (torch.softmax(score, dim=0)[..., None] * sources).sum(0)


class Layer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int, attn_res: bool = True, kind: str | None = None):
        super().__init__()
        self.index, self.kind = index, kind or cfg.layer_types[index]
        self.attn_norm, self.ffn_norm = (
            RMSNorm(cfg.hidden_size, cfg.rms_norm_eps),
            RMSNorm(cfg.hidden_size, cfg.rms_norm_eps),
        )
        self.attn = KDAttention(cfg) if self.kind == "kda" else LatentAttention(cfg, indexed=self.kind == "dsa")
        self.block_size = cfg.attn_res_block_size if attn_res else None
        if self.block_size is not None:
            self.attn_res = ResidualMix(cfg.hidden_size, cfg.rms_norm_eps)
            self.ffn_res = ResidualMix(cfg.hidden_size, cfg.rms_norm_eps)
        self.is_moe = index >= cfg.first_k_dense
        if self.is_moe:
            self.moe = MoE(cfg)
        else:
            self.mlp = GatedMLP(cfg.hidden_size, cfg.dense_intermediate_size, cfg.activation)

    def attend(self, x: torch.Tensor, topk: int | None, losses: list[torch.Tensor]) -> torch.Tensor:
        x = self.attn_norm(x)
        return self.attn(x) if self.kind == "kda" else self.attn(x, topk, losses)

    def forward(self, blocks: list[torch.Tensor], current: torch.Tensor, topk, losses) -> torch.Tensor:
        """One layer over the residual stream (model/transformer.Layer): returns the new `current`; a layer that
        starts a block of attention residuals banks the stream it received in `blocks`."""
        if self.block_size is None:
            current = current + self.attend(current, topk, losses)
        else:
            out = self.attend(self.attn_res(blocks, current), topk, losses)
            if self.index % self.block_size == 0:
                blocks.append(current)
                current = out
            else:
                current = current + out
        h = self.ffn_norm(self.ffn_res(blocks, current) if self.block_size is not None else current)
        return current + (self.moe(h) if self.is_moe else self.mlp(h))


class MTPLayer(nn.Module):
    """One multi-token-prediction layer (published names under model.layers.<n_layers>.: enorm, hnorm, eh_proj,
    the block's own tensors, shared_head.norm / shared_head.head)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h = cfg.hidden_size
        self.enorm, self.hnorm = RMSNorm(h, cfg.rms_norm_eps), RMSNorm(h, cfg.rms_norm_eps)
        self.eh_proj = Linear(2 * h, h)
        kind = "dsa" if "dsa" in cfg.layer_types else "mla"
        self.block = Layer(cfg, cfg.n_layers, attn_res=False, kind=kind)
        self.head_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.head = Linear(h, cfg.vocab_size)

    def forward(self, emb_next: torch.Tensor, hidden: torch.Tensor, topk, losses) -> torch.Tensor:
        """emb_next [B, T, H] the embeddings of tokens t+1, hidden [B, T, H] the main model's normed final states
        at t → logits [B, T, V] for tokens t+2."""
        x = self.eh_proj(torch.cat([self.enorm(emb_next), self.hnorm(hidden)], dim=-1))
        x = self.block([], x, topk, losses)
        return self.head(self.head_norm(x))


def total(losses: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """The indexer losses of one forward (one scalar per DSA layer) summed; zero without DSA layers."""
    return torch.stack(losses).sum() if losses else like.new_zeros(())


@dataclass
class Output:
    logits: torch.Tensor  # [B, T, V] next-token logits
    hidden: torch.Tensor  # [B, T, H] final normed hidden states (what the LM head and the MTP layer read)
    indexer_kl: torch.Tensor  # scalar: the indexer losses summed


class TrainModel(nn.Module):
    """The trainable K3+DSA model: the serving Transformer's state-dict names, float expert masters, MTP."""

    def __init__(self, cfg: ModelConfig, mtp: bool = True, seed: int = 0, tie_embeddings: bool = False):
        """`tie_embeddings`: the LM head is the embedding (one tensor while training, initialised at std h^-½ so
        its logits start small): copying a token from the context is then moving its embedding to the output —
        the copy task learns it several times faster. Exported as two equal tensors (K3 does not tie)."""
        super().__init__()
        torch.manual_seed(seed)
        self.cfg = cfg
        h = cfg.hidden_size
        self.embed = nn.Embedding(cfg.vocab_size, h)
        nn.init.normal_(self.embed.weight, std=h**-0.5 if tie_embeddings else 1.0)
        self.layers = nn.ModuleList(Layer(cfg, i) for i in range(cfg.n_layers))
        if cfg.attn_res_block_size is not None:
            self.out_res = ResidualMix(h, cfg.rms_norm_eps)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = Linear(h, cfg.vocab_size)
        if tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.mtp = MTPLayer(cfg) if mtp else None

    def moe_layers(self) -> list[MoE]:
        mods = [layer.moe for layer in self.layers if layer.is_moe]
        return mods + ([self.mtp.block.moe] if self.mtp is not None else [])

    def set_qat(self, on: bool) -> None:
        for moe in self.moe_layers():
            moe.experts.qat = on

    def forward(self, tokens: torch.Tensor, topk: int | None = None) -> Output:
        """tokens [B, T] → Output; `topk` None: DSA layers attend densely (the indexer's warm-up)."""
        losses: list[torch.Tensor] = []
        blocks: list[torch.Tensor] = []
        current = self.embed(tokens)
        for layer in self.layers:
            current = layer(blocks, current, topk, losses)
        final = self.out_res(blocks, current) if self.cfg.attn_res_block_size is not None else current
        hidden = self.norm(final)
        kl = total(losses, hidden)
        return Output(self.lm_head(hidden), hidden, kl)

    def mtp_logits(
        self, tokens: torch.Tensor, out: Output, topk: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The MTP layer's logits for tokens t+2 at positions t = 0 .. T-2 [B, T-1, V], and its indexer loss."""
        losses: list[torch.Tensor] = []
        logits = self.mtp(self.embed(tokens[:, 1:]), out.hidden[:, :-1], topk, losses)
        kl = total(losses, logits)
        return logits, kl
