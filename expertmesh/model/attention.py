"""The two attention kinds: Kimi Delta Attention (linear, a recurrent state per sequence) and multi-head latent
attention (MLA; with the lightning indexer, DSA). Both run per sequence over its own cache, so a sequence's
numbers are the same in any batch.

Shapes: N token rows of a step, H hidden, nH heads, D head dim, Di the indexer's head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from expertmesh.kernels import dsa as dsa_ops
from expertmesh.kernels import kda as kda_ops
from expertmesh.kernels.batch_invariant import bmm, pointwise
from expertmesh.kernels.kda import cpu_kernel as kda_cpu
from expertmesh.model.cache import DSACache, KDACache, Segment
from expertmesh.model.config import ModelConfig
from expertmesh.model.layers import LayerNorm, Linear, RMSNorm, RotaryTable, ShortConv, l2_normalize, project, rotary

# A KDA prefill of at least this many tokens runs the chunked form, shorter ones the recurrent form. The rule
# depends only on the token count, so every deployment makes the same choice — except on CPU with the C++ kernel,
# where every run of tokens takes the recurrence (`recurrent_steps_`: the decode step's bits, 4.2x faster than the
# chunked form at 2,048 tokens on 2 cores, bench/kernels_kda.py).
KDA_CHUNKED_MIN_TOKENS = 2


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
        a, conv_weight, conv_bias = self._per_weights()
        f = self.f_b(f_a).float() + self.dt_bias.float()  # [N, inner]
        if self.gate_lower_bound is None:
            g = -a * pointwise(F.softplus, f)
        else:
            g = self.gate_lower_bound * pointwise(torch.sigmoid, a * f)
        beta = pointwise(torch.sigmoid, b)  # [N, nH]
        out_gate = pointwise(torch.sigmoid, g_in if self.full_rank_gate else self.g_b(g_in))
        o = x.new_empty(n, nh, d)
        for seg in segments:
            rows = slice(seg.start, seg.start + seg.length)
            cache: KDACache = seg.cache.layers[layer]
            conv_window = torch.cat([cache.conv, qkv[rows]]) if seg.verify else None
            q, k, v = self._short_conv(qkv[rows], cache, conv_weight, conv_bias).split(self.inner, dim=-1)
            q = l2_normalize(q.view(-1, nh, d), self.l2_eps)[None]  # [1, T, nH, D]
            k = l2_normalize(k.view(-1, nh, d), self.l2_eps)[None]
            v = v.view(-1, nh, d)[None]
            if seg.verify:
                o[rows], states = self._verify_recurrent(q, k, v, g[rows].view(1, -1, nh, d), beta[rows][None], cache)
                cache.verified_start = seg.cache.length
                cache.verified = [(s, conv_window[j + 1 : j + self.kernel]) for j, s in enumerate(states)]
                continue
            if seg.length == 1 and not cache.verified and kda_cpu.takes(q) and cache.state.is_contiguous():
                # decode on CPU: the state updated in place (a verify's kept states alias it: they take the copy)
                o[rows] = kda_cpu.recurrent_step_(
                    q[0, 0], k[0, 0], v[0, 0], g[rows].view(nh, d), beta[rows][0], cache.state
                )
                continue
            if kda_cpu.takes_prompt(q):  # prefill on CPU: token by token in C++, each the decode step's bits
                # a new state, as the chunked form gives: held states (worker/sequences.py) may alias the old one
                cache.state = cache.state.clone(memory_format=torch.contiguous_format)
                o[rows] = kda_cpu.recurrent_steps_(q[0], k[0], v[0], g[rows].view(-1, nh, d), beta[rows], cache.state)
                continue
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

    def _per_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(a = exp(A_log) per channel [inner], the q/k/v conv weights [3·inner, kernel], their biases or None): what
        every call derives from the parameters alone, kept while those are the same tensors at the same versions
        (a load or an in-place write derives them again); at decode the few ops it takes cost as much as the maths."""
        convs = (self.q_conv, self.k_conv, self.v_conv)
        params = [self.A_log] + [c.weight for c in convs] + [c.bias for c in convs if c.bias is not None]
        key = tuple((p.data_ptr(), p._version, p.dtype) for p in params)
        tracked = torch.is_grad_enabled() and any(p.requires_grad for p in params)  # a graph is never kept
        if tracked or getattr(self, "_per_weights_key", None) != key:
            a = self.A_log.float().exp().repeat_interleave(self.head_dim)
            weight = torch.cat([c.weight[:, 0] for c in convs])
            bias = torch.cat([c.bias for c in convs]) if convs[0].bias is not None else None
            if tracked:
                return a, weight, bias
            self._per_weights_value, self._per_weights_key = (a, weight, bias), key
        return self._per_weights_value

    @staticmethod
    def _verify_recurrent(q, k, v, g, beta, cache: KDACache) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """A verify segment's KDA: every row as the one-token decode call computes it (so the same bits), keeping
        the state after each for a rollback without replay. → (o [T, nH, D], T states)"""
        out, states = kda_ops.verify_recurrent_kda(q, k, v, g, beta, cache.state)
        cache.state = states[-1]
        return out[0], states


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

    def _decode_row(self, pg, row: slice, q_full, index_q, index_w, topk: int, o_lat_all: torch.Tensor) -> None:
        """One decode row over the cache pages `pg`: writes o_lat_all[row] [1, nH, kv_lora]."""
        if self.indexed:  # written in place
            dsa_ops.dsa_decode_paged(
                q_full[row],
                pg.latent,
                pg.index_k,
                pg.block_table,
                pg.context_lens,
                index_q[row],
                index_w[row],
                topk,
                scale=self.scale,
                v_dim=self.m.kv_lora_rank,
                out=o_lat_all[row],
            )
            return
        o_lat_all[row] = dsa_ops.mla_decode_paged(
            q_full[row], pg.latent, pg.block_table, pg.context_lens, scale=self.scale, v_dim=self.m.kv_lora_rank
        )

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
            if seg.length == 1 or seg.verify:
                # decode: read the pages where they are (indexer over the paged keys, top-k, attention over
                # at most index_topk gathered entries): no copy of the whole cache, cost flat in context length.
                # A verify segment: each row as the decode step at its position, over the cache up to that row
                before = seg.cache.length
                for j in range(seg.length):
                    pg = cache.pages(before + j + 1) if seg.verify else cache.pages()
                    row = slice(seg.start + j, seg.start + j + 1)
                    self._decode_row(pg, row, q_full, index_q, index_w, topk, o_lat_all)
                continue
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
