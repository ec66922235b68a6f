"""KDA in chunked form (prefill), in PyTorch: intra-chunk work as batched matmuls plus one triangular
solve, and a loop over chunks only to pass the state along.

The maths (per head, one chunk of C steps, S0 the state entering the chunk). With G_r the inclusive
cumulative sum of g inside the chunk and Gam_r = exp(G_r), substitute S_r = diag(Gam_r) St_r; the
recurrence becomes an ungated delta rule in St, so (the WY / UT-transform form of Gated DeltaNet and
Kimi Linear) the pseudo-values u_i that S absorbs satisfy

    (I + A) u = diag(beta) (V - (K * Gam) S0),   A[r, i] = beta_r sum_c k_rc k_ic exp(G_rc - G_ic), i < r
    u = U0 - W S0,   U0 = (I + A)^-1 diag(beta) V,   W = (I + A)^-1 diag(beta) (K * Gam)
    o_r = scale (q_r * Gam_r)^T S0 + sum_{i <= r} P[r, i] u_i,   P[r, i] = scale sum_c q_rc k_ic exp(G_rc - G_ic)
        = Ointra + Qeff S0,   Ointra = P U0,   Qeff = scale (Q * Gam) - P W
    S_next = diag(exp(G_C)) S0 + (K * exp(G_C - G))^T u

Every exponent above is a difference G_later - G_earlier <= 0 (g <= 0), so nothing overflows: we never
form exp(-G) on its own. Only U0, W, Qeff, Ointra, K*exp(G_C - G) and exp(G_C) cross into the
chunk loop; they are computed vectorised over (sequence, chunk, head), in groups of chunks whose
size only bounds the temporaries. A sequence's last chunk is zero-padded (k = v = 0, beta = 0, g = 0),
which leaves its state exactly unchanged.

Per-channel decay means A and P are not a matmul: each (r, i) pair has its own decay vector, a
[C, C, K] tensor if formed directly. We use the sub-chunk trick instead (`_decayed_grams`): split
the chunk into sub-chunks of 16; a block of rows in sub-chunk a against columns in an earlier
sub-chunk b factors exactly through the reference point G_ref = G at the first row of a,
exp(G_r - G_i) = exp(G_r - G_ref) * exp(G_ref - G_i), both factors <= 1, so those blocks are
matmuls. Only the C/16 diagonal 16x16 blocks need the exact [16, 16, K] form. That cuts the
temporary from C*C*K to C*(16 + C/16)*K per chunk (8x at C=64) and turns most of the work into GEMMs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from expertmesh.kernels.kda.naive import KDAInputs, check_kda_inputs

SUB_CHUNK = 16


@dataclass
class BlockLayout:
    """Where each sequence's tokens sit in a padded [num_blocks, C] layout.

    Sequence n owns blocks block_start[n] .. block_start[n+1]-1, in order. `gather` [num_blocks, C] holds
    the flat token row ([B*T] axis) for each slot, or `pad` (= B*T, a zero row appended by the caller)
    past the sequence's end. `slot` [B*T] is the inverse: the flat slot (block * C + offset) of each token.
    """

    C: int
    blocks_per_seq: list[int]
    block_start: list[int]
    gather: torch.Tensor
    slot: torch.Tensor
    pad: int

    @property
    def num_blocks(self) -> int:
        return self.block_start[-1]


def block_layout(info: KDAInputs, C: int, device: torch.device, blocks_per_seq: list[int] | None = None) -> BlockLayout:
    """Cut every sequence into blocks of C tokens (default ceil(len / C) blocks each); padded slots
    point at the zero row. Vectorised index arithmetic, no loop over tokens."""
    lengths = torch.tensor(info.lengths, dtype=torch.int64)
    starts = torch.tensor(info.starts, dtype=torch.int64)
    if blocks_per_seq is None:
        blocks_per_seq = [-(-n // C) for n in info.lengths]
    nb = torch.tensor(blocks_per_seq, dtype=torch.int64)
    block_start = torch.zeros(info.N + 1, dtype=torch.int64)
    block_start[1:] = nb.cumsum(0)
    seq_of_block = torch.repeat_interleave(torch.arange(info.N), nb)  # [NB]
    j = torch.arange(int(block_start[-1])) - block_start[seq_of_block]  # block index in its sequence
    t = j[:, None] * C + torch.arange(C)  # [NB, C] offset in sequence
    pad = info.B * info.T
    gather = torch.where(t < lengths[seq_of_block, None], starts[seq_of_block, None] + t, pad)
    seq_of_token = torch.repeat_interleave(torch.arange(info.N), lengths)  # [B*T]
    t_tok = torch.arange(pad) - starts[seq_of_token]
    slot = (block_start[seq_of_token] + t_tok // C) * C + t_tok % C
    return BlockLayout(
        C=C,
        blocks_per_seq=list(blocks_per_seq),
        block_start=block_start.tolist(),
        gather=gather.to(device),
        slot=slot.to(device),
        pad=pad,
    )


def to_blocks(x: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
    """[B, T, H, D] or [B, T, H] -> fp32 [NB, H, C, D] or [NB, H, C], zero in padded slots."""
    flat = x.reshape(layout.pad, *x.shape[2:]).float()
    flat = torch.cat([flat, flat.new_zeros(1, *flat.shape[1:])])
    blocks = flat[layout.gather]  # [NB, C, H, (D)]
    return blocks.transpose(1, 2).contiguous()


def _decayed_grams(q: torch.Tensor, k: torch.Tensor, G: torch.Tensor, sub: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(Mqk, Mkk) with M_xk[..., r, i] = sum_c x[r, c] k[i, c] exp(G[r, c] - G[i, c]) for i <= r, 0 above.

    q, k, G: [..., C, K], G non-increasing along C. Sub-chunk trick (module docstring); both Gram
    matrices share the decay tensors, so q and k rows go through each contraction together.
    """
    *lead, C, K = k.shape
    n = C // sub
    Gs = G.reshape(*lead, n, sub, K)
    qk = torch.stack([q, k], -2).reshape(*lead, n, sub, 2, K)  # rows of both Grams
    # Diagonal sub-blocks, exact: D[..., a, r, i, c] = k[i, c] exp(G[r, c] - G[i, c]), masked to i <= r
    # (-inf before exp, so no positive exponent is ever evaluated); in place to keep memory passes few.
    causal = torch.ones(sub, sub, dtype=torch.bool, device=k.device).tril()
    D = Gs.unsqueeze(-2) - Gs.unsqueeze(-3)  # [..., n, s(r), s(i), K]
    D.masked_fill_(~causal[:, :, None], float("-inf")).exp_().mul_(k.reshape(*lead, n, 1, sub, K))
    # sum_c D[a, r, i, c] x[a, r, c] for x in (q, k): a matmul with batch (a, r), [s(i), K] @ [K, 2].
    diag = (D @ qk.transpose(-1, -2)).transpose(-1, -2)  # [..., n, s(r), 2, s(i)]
    # Off-diagonal blocks (rows in sub-chunk a, columns in earlier sub-chunks), factored through
    # G_ref = G at the first row of a: exp(G_r - G_ref) * exp(G_ref - G_i), both factors <= 1.
    ref = Gs[..., :1, :].contiguous()  # [..., n, 1, K]
    xr = (qk * (Gs - ref).exp_().unsqueeze(-2)).reshape(*lead, n, 2 * sub, K)
    before = torch.arange(C, device=k.device)[None, :] < (torch.arange(n, device=k.device) * sub)[:, None]
    kr = ref - G.unsqueeze(-3)  # [..., n, C, K]
    kr.masked_fill_(~before[:, :, None], float("-inf")).exp_().mul_(k.unsqueeze(-3))
    off = (xr @ kr.transpose(-1, -2)).reshape(*lead, n, sub, 2, n, sub)  # rows (a, r, q|k), cols (b, i)
    eye = torch.eye(n, device=k.device, dtype=k.dtype)
    M = (off + diag.unsqueeze(-2) * eye[:, None, None, :, None]).reshape(*lead, C, 2, C)
    return M[..., :, 0, :], M[..., :, 1, :]


@dataclass
class ChunkPrep:
    """Per-(block, head) tensors that the chunk loop needs (fp32). Shapes: [NB, H, C, *] / decay [NB, H, K, 1]."""

    layout: BlockLayout
    W: torch.Tensor  # [NB, H, C, K]
    U0: torch.Tensor  # [NB, H, C, V]
    Qeff: torch.Tensor  # [NB, H, C, K]
    Ointra: torch.Tensor  # [NB, H, C, V]
    Kd: torch.Tensor  # [NB, H, C, K]  k * exp(G_C - G)
    decay: torch.Tensor  # [NB, H, K, 1]  exp(G_C)


# Upper bound (fp32 elements) on the sub-chunk temporaries of one group of blocks in `prepare_chunks`:
# keeps memory O(1) in T. On CPU it also stays below glibc's mmap threshold, so buffers are recycled
# instead of page-faulted in afresh (measured: that costs more than the arithmetic); on a GPU, larger
# groups mean fewer kernel launches.
TEMP_ELEMENTS = {"cpu": 1 << 22, "cuda": 1 << 27}


def prepare_chunks(q, k, v, g, beta, info: KDAInputs, chunk_size: int, grams=None) -> ChunkPrep:
    """Everything that does not depend on the incoming state, for every (sequence, chunk, head).

    Vectorised over blocks and heads; blocks go through in groups sized by TEMP_ELEMENTS so that the
    [.., C/16, 16, 16, K] sub-chunk temporaries stay bounded however long the prompt. `grams` replaces
    `_decayed_grams` (same signature; the Triton path passes its kernel).
    """
    grams = grams or _decayed_grams
    C, H, K, V = chunk_size, info.H, info.K, info.V
    layout = block_layout(info, C, q.device)
    qb, kb, vb, gb = (to_blocks(t, layout) for t in (q, k, v, g))  # [NB, H, C, *]
    bb = to_blocks(beta, layout)[..., None]  # [NB, H, C, 1]
    sub = SUB_CHUNK if C % SUB_CHUNK == 0 else C  # else: the plain [C, C, K] form
    NB = layout.num_blocks
    prep = ChunkPrep(
        layout=layout,
        W=qb.new_empty(NB, H, C, K),
        U0=qb.new_empty(NB, H, C, V),
        Qeff=qb.new_empty(NB, H, C, K),
        Ointra=qb.new_empty(NB, H, C, V),
        Kd=qb.new_empty(NB, H, C, K),
        decay=qb.new_empty(NB, H, K, 1),
    )
    eye = torch.eye(C, device=q.device)
    budget = TEMP_ELEMENTS.get(q.device.type, TEMP_ELEMENTS["cpu"])
    step = max(1, budget // (H * C * max(sub, C // sub) * K))
    for b0 in range(0, NB, step):
        sl = slice(b0, b0 + step)
        qg, kg, vg, bg = qb[sl], kb[sl], vb[sl], bb[sl]
        G = gb[sl].cumsum(-2)  # in-chunk cumulative log decay
        Mqk, Mkk = grams(qg, kg, G, sub)
        A = (bg * Mkk).tril_(-1)
        gam = G.exp()
        WU = torch.linalg.solve_triangular(
            A + eye, torch.cat([bg * kg * gam, bg * vg], -1), upper=False, unitriangular=True
        )
        W, U0 = WU.split([K, V], -1)
        P = Mqk.mul_(info.scale)
        prep.W[sl] = W
        prep.U0[sl] = U0
        torch.sub(info.scale * qg * gam, P @ W, out=prep.Qeff[sl])
        torch.matmul(P, U0, out=prep.Ointra[sl])
        GC = G[..., -1:, :]  # [g, H, 1, K]
        torch.mul(kg, (GC - G).exp_(), out=prep.Kd[sl])
        prep.decay[sl] = GC.exp().transpose(-1, -2)
    return prep


def state_passing_torch(prep: ChunkPrep, S: torch.Tensor, o_blocks: torch.Tensor) -> torch.Tensor:
    """Walk the chunks in order, all sequences side by side. S: fp32 [N, H, K, V] (updated in place and
    returned); o_blocks: fp32 [NB, H, C, V], every block written exactly once."""
    lay = prep.layout
    nb = lay.blocks_per_seq
    for j in range(max(nb, default=0)):
        seqs = [n for n, c in enumerate(nb) if c > j]
        idx = torch.tensor([lay.block_start[n] + j for n in seqs], device=S.device)
        sidx = torch.tensor(seqs, device=S.device)
        Sa = S.index_select(0, sidx)  # [n, H, K, V]
        u = prep.U0.index_select(0, idx) - prep.W.index_select(0, idx) @ Sa  # [n, H, C, V]
        o_blocks[idx] = prep.Ointra.index_select(0, idx) + prep.Qeff.index_select(0, idx) @ Sa
        Sa = prep.decay.index_select(0, idx) * Sa + prep.Kd.index_select(0, idx).transpose(-1, -2) @ u
        S.index_copy_(0, sidx, Sa)
    return S


def from_blocks(o_blocks: torch.Tensor, layout: BlockLayout, info: KDAInputs, dtype: torch.dtype) -> torch.Tensor:
    """fp32 [NB, H, C, V] -> [B, T, H, V] in dtype (a gather: padded slots are never read)."""
    flat = o_blocks.transpose(1, 2).reshape(-1, info.H, info.V)  # [NB*C, H, V]
    return flat[layout.slot].reshape(info.B, info.T, info.H, info.V).to(dtype)


def check_chunk_size(chunk_size: int) -> None:
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(f"chunk_size: expected a positive int, found {chunk_size!r}")


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """KDA over whole sequences in chunked form (prefill), PyTorch; same results as
    `kda_recurrent_reference` up to fp32 rounding.

    q, k, g: [B, T, H, K]; v: [B, T, H, V]; beta: [B, T, H]; g <= 0 (log decay per key channel).
    cu_seqlens: int32/int64 [N+1] packs N sequences along T (then B must be 1); states never cross
    sequences. initial_state: [N, H, K, V] (N = B without cu_seqlens), None = zeros. Any T works (the
    last chunk of each sequence is zero-padded, which leaves the state unchanged). Returns o
    [B, T, H, V] in v's dtype and the fp32 final state [N, H, K, V] (None unless output_final_state).
    Temporaries are O(T * H * K * (16 + C/16)) fp32.
    """
    info = check_kda_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens)
    check_chunk_size(chunk_size)
    prep = prepare_chunks(q, k, v, g, beta, info, chunk_size)
    S = (
        torch.zeros(info.N, info.H, info.K, info.V, device=q.device)
        if initial_state is None
        else initial_state.float().clone()
    )
    o_blocks = torch.empty(prep.layout.num_blocks, info.H, chunk_size, info.V, device=q.device)
    S = state_passing_torch(prep, S, o_blocks)
    return from_blocks(o_blocks, prep.layout, info, v.dtype), (S if output_final_state else None)
