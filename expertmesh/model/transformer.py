"""The single-process reference model: KDA + gated-DSA attention, MoE with MXFP4 routed experts — and the math
of the published Kimi K3 where its config asks for it: attention residuals (`ResidualStream`), the latent MoE,
SiTU in every gated MLP, the full-rank KDA output gate and gate lower bound, NoPE gated MLA.

Plain PyTorch, fp32 by default. Every op a token goes through either works row by row through
`kernels.batch_invariant.linear` (projections, gate, shared experts, LM head) or per sequence (attention, conv,
recurrent state), so a sequence gets the same numbers alone or in any batch — the distributed engine reuses
these modules piece by piece (attention workers: `Layer.attention_block` / `Layer.route`; expert workers:
`RoutedExperts` and the partial sums of kernels/moe/combine.py; attention workers again: the group fold and
`combine_moe`) and must produce the same greedy tokens.

Shapes: N tokens of a step (all sequences' new tokens concatenated), H hidden, E routed experts, K top-k.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from expertmesh.kernels import dsa as dsa_ops
from expertmesh.kernels import kda as kda_ops
from expertmesh.kernels import moe as moe_ops
from expertmesh.kernels.activation import GatedActivation, gated_act
from expertmesh.kernels.batch_invariant import bmm, linear, linear_fused, pointwise
from expertmesh.kernels.moe.combine import grouped_combine
from expertmesh.kernels.mxfp4 import quantize_mxfp4
from expertmesh.kernels.norm import cpu_kernel as norm_kernel
from expertmesh.kernels.norm import naive as norm_naive
from expertmesh.model.config import ActivationConfig, ModelConfig, RopeConfig
from expertmesh.model.sampling import Sampler
from expertmesh.model.vision import Projector, VisionTower, init_vision_
from expertmesh.wire.sampling_params import SamplingParams

# A KDA prefill of at least this many tokens runs the chunked form, shorter ones the recurrent form.
# The rule depends only on the token count, so every deployment makes the same choice.
KDA_CHUNKED_MIN_TOKENS = 2


# ----------------------------------------------------------------------------------------------- small ops
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
        return self.down(gated_act(gate, up, self.activation).to(x.dtype))


class ShortConv(nn.Module):
    """A depthwise causal convolution's parameters: weight [D, 1, kernel] (the published layout), bias [D]."""

    def __init__(self, dim: int, kernel: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, 1, kernel))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None


# ----------------------------------------------------------------------------------------------- caches
@dataclass
class DSACache:
    """One sequence's MLA / DSA-layer cache in token order: latent entries (c_kv ‖ roped k) and, for DSA layers,
    the indexer keys (None for MLA layers)."""

    latent: torch.Tensor  # [L, kv_lora + rope]
    index_k: torch.Tensor | None = None  # [L, Di]

    def append(self, latent: torch.Tensor, index_k: torch.Tensor | None) -> None:
        self.latent = torch.cat([self.latent, latent])
        if index_k is not None:
            self.index_k = torch.cat([self.index_k, index_k])

    def pages(self) -> CachePages:
        """The cache as one page (what the paged decode kernels read; same bits as any paging of it)."""
        n, dev = self.latent.shape[0], self.latent.device
        return CachePages(
            self.latent[None],
            None if self.index_k is None else self.index_k[None],
            torch.zeros(1, 1, dtype=torch.int32, device=dev),
            torch.tensor([n], dtype=torch.int32, device=dev),
        )


@dataclass
class CachePages:
    """A latent cache as the paged decode kernels take it (kernels/dsa: dsa_decode_paged, mla_decode_paged)."""

    latent: torch.Tensor  # [num_blocks, block_size, kv_lora + rope]
    index_k: torch.Tensor | None  # [num_blocks, block_size, Di] (DSA layers)
    block_table: torch.Tensor  # [1, n_pages] int32
    context_lens: torch.Tensor  # [1] int32


@dataclass
class KDACache:
    """One sequence's KDA-layer state: the recurrent state and the short convolutions' last inputs."""

    state: torch.Tensor  # [nH, Dk, Dv] fp32
    conv: torch.Tensor  # [kernel - 1, 3 · nH · D]: q, k, v projections before the conv


@dataclass
class SequenceCache:
    """Everything a sequence keeps between steps: one entry per layer and the number of tokens seen."""

    layers: list
    length: int = 0


@dataclass
class Segment:
    """One sequence's run of tokens inside a step's flat batch: rows [start, start + length), cache positions
    cache.length .. cache.length + length - 1."""

    start: int
    length: int
    cache: SequenceCache


# ----------------------------------------------------------------------------------------------- attention
class KDAttention(nn.Module):
    """Kimi Delta Attention: short conv + SiLU on q/k/v, L2-normalised q/k, per-channel forget gate in log
    space, sigmoid β, output RMS-normalised per head and sigmoid-gated.

    Forget gate, f = f_b(f_a(x)) + dt_bias, A = exp(A_log) per head: Kimi Linear −A·softplus(f); Kimi K3
    (`kda.gate_lower_bound` lb) lb·σ(A·f) ∈ (lb, 0). Output gate: low-rank g_b(g_a(x)) (Kimi Linear) or one
    full-rank g_proj (K3)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        a, h = cfg.kda, cfg.hidden_size
        self.n_heads, self.head_dim, self.kernel = a.n_heads, a.head_dim, a.conv_kernel_size
        inner = a.n_heads * a.head_dim
        self.inner = inner
        self.q_proj, self.k_proj, self.v_proj = Linear(h, inner), Linear(h, inner), Linear(h, inner)
        self.q_conv, self.k_conv, self.v_conv = (ShortConv(inner, a.conv_kernel_size, a.conv_bias) for _ in range(3))
        self.f_a, self.f_b = Linear(h, a.gate_low_rank), Linear(a.gate_low_rank, inner)
        self.A_log = nn.Parameter(torch.empty(a.n_heads))
        self.dt_bias = nn.Parameter(torch.empty(inner))
        self.b_proj = Linear(h, a.n_heads)
        if a.output_gate == "full_rank":
            self.g_proj = Linear(h, inner, bias=a.output_gate_bias)
        else:
            self.g_a, self.g_b = Linear(h, a.gate_low_rank), Linear(a.gate_low_rank, inner, bias=a.output_gate_bias)
        self.full_rank_gate = a.output_gate == "full_rank"
        self.gate_lower_bound, self.l2_eps = a.gate_lower_bound, a.l2_norm_eps
        self.o_norm = RMSNorm(a.head_dim, cfg.rms_norm_eps)
        self.o_proj = Linear(inner, h)

    def new_cache(self) -> KDACache:
        """On the weights' device, in fp32: the recurrent state (the published recurrence's dtype) and the conv
        tail (so the short conv accumulates in fp32 and q, k, v enter the kernels in fp32 under bf16 weights)."""
        dev = self.A_log.device
        return KDACache(
            state=torch.zeros(self.n_heads, self.head_dim, self.head_dim, device=dev),
            conv=torch.zeros(self.kernel - 1, 3 * self.inner, device=dev),
        )

    def _short_conv(
        self, x: torch.Tensor, cache: KDACache, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """Causal depthwise conv over time for q, k, v at once. x [T, 3·inner], weight [3·inner, kernel],
        bias [3·inner] or None → SiLU(conv) [T, 3·inner]; updates cache."""
        window = torch.cat([cache.conv, x])  # [kernel-1+T, 3·inner]
        t = x.shape[0]
        out = torch.zeros_like(x) if bias is None else bias.to(x.dtype).expand_as(x).clone()
        for tap in range(self.kernel):  # fixed order: kernel taps
            out = out + window[tap : tap + t] * weight[:, tap]
        cache.conv = window[t:].clone() if self.kernel > 1 else cache.conv
        return F.silu(out)

    def forward(self, x: torch.Tensor, segments: list[Segment], layer: int) -> torch.Tensor:
        n, nh, d = x.shape[0], self.n_heads, self.head_dim
        gate_in = self.g_proj if self.full_rank_gate else self.g_a
        q, k, v, f_a, b, g_in = project(x, self.q_proj, self.k_proj, self.v_proj, self.f_a, self.b_proj, gate_in)
        qkv = torch.cat([q, k, v], dim=-1)  # [N, 3·inner]
        a = self.A_log.float().exp().repeat_interleave(d)  # [inner]
        f = self.f_b(f_a).float() + self.dt_bias.float()  # [N, inner]
        if self.gate_lower_bound is None:
            g = -a * pointwise(F.softplus, f)
        else:
            g = self.gate_lower_bound * pointwise(torch.sigmoid, a * f)
        beta = pointwise(torch.sigmoid, b)  # [N, nH]
        out_gate = pointwise(torch.sigmoid, g_in if self.full_rank_gate else self.g_b(g_in))
        convs = (self.q_conv, self.k_conv, self.v_conv)
        conv_weight = torch.cat([c.weight[:, 0] for c in convs])  # [3·inner, kernel]
        conv_bias = torch.cat([c.bias for c in convs]) if convs[0].bias is not None else None
        o = x.new_empty(n, nh, d)
        for seg in segments:
            rows = slice(seg.start, seg.start + seg.length)
            cache: KDACache = seg.cache.layers[layer]
            q, k, v = self._short_conv(qkv[rows], cache, conv_weight, conv_bias).split(self.inner, dim=-1)
            q = l2_normalize(q.view(-1, nh, d), self.l2_eps)[None]  # [1, T, nH, D]
            k = l2_normalize(k.view(-1, nh, d), self.l2_eps)[None]
            v = v.view(-1, nh, d)[None]
            kda = kda_ops.chunk_kda if seg.length >= KDA_CHUNKED_MIN_TOKENS else kda_ops.fused_recurrent_kda
            out, state = kda(
                q,
                k,
                v,
                g[rows].view(1, -1, nh, d),
                beta[rows][None],
                initial_state=cache.state[None],
                output_final_state=True,
            )
            cache.state = state[0]
            o[rows] = out[0]
        o = self.o_norm(o).reshape(n, self.inner) * out_gate
        return self.o_proj(o)


class LatentAttention(nn.Module):
    """Multi-head latent attention (MLA: low-rank or full q, one shared latent KV with a decoupled rope key) over
    the latent cache in the absorbed form (q_nope·W_uk against c_kv, output through W_uv).

    `indexed` (DSA layers): each query attends only to the `index_topk` past tokens the lightning indexer
    scores highest. `mla.gated_output`: a sigmoid gate on the output (gated DSA). RoPE per `mla.rope`."""

    def __init__(self, cfg: ModelConfig, indexed: bool, dense: bool = False):
        super().__init__()
        m, ix, h = cfg.mla, cfg.indexer, cfg.hidden_size
        self.m, self.ix, self.rope, self.dense, self.indexed = m, ix, cfg.rope, dense, indexed
        self.rotary = RotaryTable(cfg.rope, m.qk_rope_head_dim)  # the MLA rope and the indexer's share it
        self.qk_dim = m.qk_nope_head_dim + m.qk_rope_head_dim
        self.scale = self.qk_dim**-0.5 * cfg.rope.softmax_mscale
        if m.q_lora_rank is None:
            self.q_proj = Linear(h, m.n_heads * self.qk_dim)
        else:
            self.q_a, self.q_a_norm = Linear(h, m.q_lora_rank), RMSNorm(m.q_lora_rank, m.norm_eps)
            self.q_b = Linear(m.q_lora_rank, m.n_heads * self.qk_dim)
        self.kv_a = Linear(h, m.kv_lora_rank + m.qk_rope_head_dim)
        self.kv_a_norm = RMSNorm(m.kv_lora_rank, m.norm_eps)
        self.kv_b = Linear(m.kv_lora_rank, m.n_heads * (m.qk_nope_head_dim + m.v_head_dim))
        self.gate = Linear(h, m.n_heads * m.v_head_dim) if m.gated_output else None
        self.o_proj = Linear(m.n_heads * m.v_head_dim, h)
        if indexed:
            self.index_q = Linear(m.q_lora_rank, ix.n_heads * ix.head_dim)
            self.index_k = Linear(h, ix.head_dim)
            self.index_k_norm = LayerNorm(ix.head_dim)
            self.index_w = Linear(h, ix.n_heads)

    def new_cache(self) -> DSACache:
        """Empty, in the weights' dtype on their device (what the paged pool of a worker holds)."""
        like = dict(dtype=self.kv_a.weight.dtype, device=self.kv_a.weight.device)
        return DSACache(
            latent=torch.zeros(0, self.m.kv_lora_rank + self.m.qk_rope_head_dim, **like),
            index_k=torch.zeros(0, self.ix.head_dim, **like) if self.indexed else None,
        )

    def _index_rope(self, t: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The indexer's RoPE: rotate-half on the first qk_rope_head_dim dims of t [T, ..., Di]."""
        if not self.ix.rope:
            return t
        r = self.m.qk_rope_head_dim
        return torch.cat([rotary(t[..., :r], cos_sin, "half"), t[..., r:]], dim=-1)

    def _absorbed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b's two halves for the absorbed form: W_uk [nH, nope, kv_lora] and W_uvᵀ [nH, kv_lora, v]. On a GPU,
        views of kv_b. On CPU, contiguous copies (one more kv_b per MLA/DSA layer in host memory): ATen's bf16 bmm
        copies a strided operand on every call, and W_uvᵀ as a view ran 3.7× slower. The copies are kept while
        kv_b's weight is the same tensor at the same version (a load or an in-place write rebuilds them)."""
        w, m = self.kv_b.weight.detach(), self.m
        w_kvb = w.view(m.n_heads, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
        w_uk, w_uv_t = w_kvb[:, : m.qk_nope_head_dim], w_kvb[:, m.qk_nope_head_dim :].transpose(1, 2)
        if w.device.type != "cpu":
            return w_uk, w_uv_t
        key = (w.data_ptr(), w._version, w.dtype)
        if getattr(self, "_absorbed_key", None) != key:
            self._absorbed_weights = (w_uk.contiguous(), w_uv_t.contiguous())
            self._absorbed_key = key
        return self._absorbed_weights

    def _rows_cos_sin(self, segments: list[Segment], n: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [N, rope/2] of every row of the step: each segment's rows at its cache's next positions."""
        parts = [self.rotary.at(seg.cache.length, seg.length, device) for seg in segments]
        if len(parts) == 1 and segments[0].start == 0 and segments[0].length == n:
            return parts[0]
        cos = torch.empty(n, self.m.qk_rope_head_dim // 2, device=device)
        sin = torch.empty_like(cos)
        for seg, (c, s) in zip(segments, parts):
            cos[seg.start : seg.start + seg.length], sin[seg.start : seg.start + seg.length] = c, s
        return cos, sin

    def _decode_together(
        self,
        decodes: list[Segment],
        layer: int,
        topk: int,
        q_full: torch.Tensor,
        index_q: torch.Tensor | None,
        index_w: torch.Tensor | None,
        o_lat: torch.Tensor,
    ) -> set[int]:
        """One decode call for every decoding sequence whose pages share one pool, where that gives each the bits
        it gets alone (kernels.dsa.decode_rows_are_batch_invariant, top-k covering every context); writes their
        rows of o_lat and returns their segments' start rows (the others decode one by one)."""
        if (
            len(decodes) < 2
            or max(seg.cache.length + 1 for seg in decodes) > topk
            or not dsa_ops.decode_rows_are_batch_invariant(q_full)
        ):
            return set()
        pages = [seg.cache.layers[layer].pages() for seg in decodes]
        pool = pages[0].latent
        if any(p.latent.data_ptr() != pool.data_ptr() or p.latent.shape != pool.shape for p in pages):
            return set()  # the reference model's per-sequence caches: one by one
        lens = torch.cat([p.context_lens for p in pages])
        table = torch.zeros(len(pages), max(p.block_table.shape[1] for p in pages), dtype=torch.int32)
        for i, p in enumerate(pages):
            table[i, : p.block_table.shape[1]] = p.block_table[0]
        rows = torch.tensor([seg.start for seg in decodes])
        if self.indexed:
            o_lat[rows] = dsa_ops.dsa_decode_paged(
                q_full[rows],
                pool,
                pages[0].index_k,
                table,
                lens,
                index_q[rows],
                index_w[rows],
                topk,
                scale=self.scale,
                v_dim=self.m.kv_lora_rank,
            )
        else:
            o_lat[rows] = dsa_ops.mla_decode_paged(
                q_full[rows], pool, table, lens, scale=self.scale, v_dim=self.m.kv_lora_rank
            )
        return {seg.start for seg in decodes}

    def forward(self, x: torch.Tensor, segments: list[Segment], layer: int) -> torch.Tensor:
        m, ix = self.m, self.ix
        n = x.shape[0]
        # the projections of x (and below of q_lat) as one call each where the kernel fuses them (same bits)
        first = self.q_proj if m.q_lora_rank is None else self.q_a
        from_x = project(
            x,
            first,
            self.kv_a,
            *((self.index_k,) if self.indexed else ()),
            *((self.gate,) if self.gate is not None else ()),
        )
        kv = from_x[1]  # [N, kv_lora + rope]
        if m.q_lora_rank is None:
            q_lat, q, index_q = None, from_x[0], None
        else:
            q_lat = self.q_a_norm(from_x[0])  # [N, q_lora]
            q, *index_q = project(q_lat, self.q_b, *((self.index_q,) if self.indexed else ()))
            index_q = index_q[0] if index_q else None
        q = q.view(n, m.n_heads, self.qk_dim)
        c_kv = self.kv_a_norm(kv[:, : m.kv_lora_rank])  # [N, kv_lora]
        k_pe = kv[:, m.kv_lora_rank :]  # [N, rope]
        index_k = index_w = None
        if self.indexed:
            index_q = index_q.reshape(n, ix.n_heads, ix.head_dim)
            index_k = self.index_k_norm(from_x[2])  # [N, Di]
            # the indexer's softmax scale (Di^-1/2) and head weighting (Hi^-1/2) folded into the weights
            index_w = self.index_w(x).float() * (ix.n_heads * ix.head_dim) ** -0.5  # [N, Hi]
        gate = pointwise(torch.sigmoid, from_x[-1]) if self.gate is not None else None  # [N, nH·v]
        w_uk, w_uv_t = self._absorbed()
        # every row of the step at once (rows stay batch-invariant: the absorbed projection pads to fixed tiles,
        # the rotations are elementwise): q_nope·W_uk per head, then RoPE at each row's own position
        q_abs = bmm(q[:, :, : m.qk_nope_head_dim].transpose(0, 1), w_uk).transpose(0, 1)  # [N, nH, kv_lora]
        cos_sin = self._rows_cos_sin(segments, n, x.device)  # [N, rope/2] each
        q_full = torch.cat([q_abs, rotary(q[:, :, m.qk_nope_head_dim :], cos_sin, m.rope)], dim=-1)
        latent = torch.cat([c_kv, rotary(k_pe, cos_sin, m.rope)], dim=-1)  # [N, kv_lora + rope]
        if self.indexed:
            index_q, index_k = self._index_rope(index_q, cos_sin), self._index_rope(index_k, cos_sin)
        topk = 1 << 62 if self.dense else ix.index_topk
        o_lat_all = x.new_empty(n, m.n_heads, m.kv_lora_rank)
        for seg in segments:
            rows = slice(seg.start, seg.start + seg.length)
            seg.cache.layers[layer].append(latent[rows], index_k[rows] if self.indexed else None)
        done = self._decode_together(
            [s for s in segments if s.length == 1], layer, topk, q_full, index_q, index_w, o_lat_all
        )
        for seg in segments:
            if seg.start in done:
                continue
            rows = slice(seg.start, seg.start + seg.length)
            cache: DSACache = seg.cache.layers[layer]
            if seg.length == 1:
                # decode: read the pages where they are (indexer over the paged keys, top-k, attention over
                # at most index_topk gathered entries): no copy of the whole cache, cost flat in context length
                pg = cache.pages()
                if self.indexed:  # written in place: [1, nH, kv_lora]
                    dsa_ops.dsa_decode_paged(
                        q_full[rows],
                        pg.latent,
                        pg.index_k,
                        pg.block_table,
                        pg.context_lens,
                        index_q[rows],
                        index_w[rows],
                        topk,
                        scale=self.scale,
                        v_dim=m.kv_lora_rank,
                        out=o_lat_all[rows],
                    )
                    continue
                o_lat = dsa_ops.mla_decode_paged(
                    q_full[rows], pg.latent, pg.block_table, pg.context_lens, scale=self.scale, v_dim=m.kv_lora_rank
                )
            elif self.indexed:  # written in place: [T, nH, kv_lora]
                dsa_ops.dsa_prefill(
                    q_full[rows][None],
                    cache.latent[None],
                    index_q[rows][None],
                    cache.index_k[None],
                    index_w[rows][None],
                    topk,
                    causal=True,
                    scale=self.scale,
                    v_dim=m.kv_lora_rank,
                    out=o_lat_all[rows][None],
                )
                continue
            else:
                o_lat = dsa_ops.mla_prefill(
                    q_full[rows][None], cache.latent[None], scale=self.scale, v_dim=m.kv_lora_rank
                )[0]
            o_lat_all[rows] = o_lat
        o = bmm(o_lat_all.transpose(0, 1), w_uv_t).transpose(0, 1).reshape(n, -1)  # through W_uv: [N, nH·v]
        return self.o_proj(o * gate if gate is not None else o)


# ----------------------------------------------------------------------------------------------- MoE
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
            self.gate_up_blocks,
            self.gate_up_scales,
            self.down_blocks,
            self.down_scales,
            activation=self.activation,
        )

    def _local_ids(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """GLOBAL expert ids [N, K] (−1: skip) → this shard's local ids (−1 where skipped or not held)."""
        return torch.where(topk_ids >= 0, self.global_to_local[topk_ids.clamp(min=0)], -1)

    def outputs_fp32(self, h: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """`forward(h.float(), topk_ids)` — fp32 [N, K, W] — with a bf16 h read as it is where the CPU kernel runs
        (its AVX512-BF16 path; the same bits, kernels/moe/cpu_kernel.py)."""
        if h.dtype == torch.bfloat16 and h.device.type == "cpu" and moe_ops.cpu_kernel_runs(h, self.gate_up_blocks):
            return moe_ops.cpu_kernel.moe_expert_outputs(
                h,
                self._local_ids(topk_ids),
                self.gate_up_blocks,
                self.gate_up_scales,
                self.down_blocks,
                self.down_scales,
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

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """h = ffn_norm(x) [N, H] → (the routed experts' input [N, W] (h, or its latent), topk_ids [N, K],
        topk_weights [N, K], shared_out [N, H])."""
        return *self.select(h), self.shared_out(h)

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
        sources = torch.stack([*blocks, current]).float()  # [J, N, H]
        w = self.norm.weight.float() * self.proj.weight[0].float()  # [H]
        score = (sources * w).sum(-1) * pointwise(torch.rsqrt, sources.pow(2).mean(-1) + self.norm.eps)  # [J, N]
        p = torch.softmax(score, dim=0)
        return (p[..., None] * sources).sum(0).to(current.dtype)


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

    def __init__(self, cfg: ModelConfig, index: int, dense_attention: bool = False, routed_experts: bool = True):
        super().__init__()
        self.index, self.kind = index, cfg.layer_types[index]
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = (
            KDAttention(cfg)
            if self.kind == "kda"
            else LatentAttention(cfg, indexed=self.kind == "dsa", dense=dense_attention)
        )
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.block_size = cfg.attn_res_block_size
        if self.block_size is not None:
            self.attn_res = ResidualMix(cfg.hidden_size, cfg.rms_norm_eps)
            self.ffn_res = ResidualMix(cfg.hidden_size, cfg.rms_norm_eps)
        self.is_moe = cfg.is_moe_layer(index)
        if self.is_moe:
            self.moe = MoE(cfg, routed_experts)
        else:
            self.mlp = GatedMLP(cfg.hidden_size, cfg.dense_intermediate_size, cfg.activation)

    def attention_block(self, r: ResidualStream, segments: list[Segment]) -> None:
        if self.block_size is None:
            r.current = r.current + self.attn(self.attn_norm(r.current), segments, self.index)
            return
        h = self.attn_res(r.blocks, r.current)  # mixed before this layer banks anything
        out = self.attn(self.attn_norm(h), segments, self.index)
        if self.index % self.block_size == 0:  # a block starts: bank the stream, restart it
            r.blocks.append(r.current)
            r.current = out
        else:
            r.current = r.current + out

    def ffn_input(self, r: ResidualStream) -> torch.Tensor:
        """The MLP's / MoE's normed input [N, H]."""
        return self.ffn_norm(self.ffn_res(r.blocks, r.current) if self.block_size is not None else r.current)

    def dense_block(self, r: ResidualStream) -> None:
        r.current = r.current + self.mlp(self.ffn_input(r))

    def route(self, r: ResidualStream):
        """→ (the routed experts' input [N, W], topk_ids, topk_weights, shared_out [N, H])."""
        return self.moe.route(self.ffn_input(r))

    def add_moe(self, r: ResidualStream, shared: torch.Tensor, routed: torch.Tensor) -> None:
        """Add the MoE's output: shared_out [N, H] and the routed sum fp32 [N, W] (canonical order)."""
        r.current = r.current + self.moe.output(shared, routed).to(r.current.dtype)

    def forward(self, r: ResidualStream, segments: list[Segment]) -> None:
        self.attention_block(r, segments)
        if not self.is_moe:
            self.dense_block(r)
            return
        z, ids, weights, shared = self.route(r)
        self.add_moe(r, shared, routed_sum(self.moe.cfg, self.moe.experts(z, ids), ids, weights, r.current.dtype))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, dense_attention: bool = False, routed_experts: bool = True):
        """`routed_experts=False` builds no routed-expert buffers (what an attention worker holds)."""
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
    def forward(self, tokens: torch.Tensor, segments: list[Segment]) -> torch.Tensor:
        """tokens [N] (the new tokens of every segment, concatenated) → logits [N, V]; advances the caches."""
        r = ResidualStream(self.embed(tokens))
        for layer in self.layers:
            layer(r, segments)
        for seg in segments:
            seg.cache.length += seg.length
        return self.logits(self.output(r))

    @torch.no_grad()
    def step(self, token_ids: list[int], cache: SequenceCache) -> torch.Tensor:
        """One sequence: feed `token_ids` after what `cache` has seen → logits [len, V]."""
        tokens = torch.tensor(token_ids, dtype=torch.int64, device=self.embed.weight.device)
        return self.forward(tokens, [Segment(0, len(token_ids), cache)])


# ----------------------------------------------------------------------------------------------- init
# Tensors the published models keep in fp32 (routing logits and bias, KDA decay parameters, the indexer's head
# weights): a bf16 copy would change which expert wins a near-tie. Everything else is stored in bf16.
FP32_PARAMETERS = ("moe.router.weight", "moe.router_bias", "attn.A_log", "attn.dt_bias", "attn.index_w.weight")


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
    for layer in model.layers:
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
