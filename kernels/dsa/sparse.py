"""DSA fast paths in PyTorch (CPU, and any device): blocked prefill and paged decode.

Same results as `naive.py` (module docstring there: the math, tie-breaking, index order). Both paths score
with `naive.indexer_scores`, whose per-element bits do not depend on the call's shape, so they select exactly
the reference's top-k; the attention itself may be computed differently (a gather of the chosen entries instead
of a masked dense pass) and agrees to rounding.

- `dsa_prefill`: queries in blocks sized so one block's working set (indexer logits [bq, Hi, n], gathered
  entries [bq, k, D] or masked logits [bq, H, n]) stays under PREFILL_BLOCK_BYTES: memory O(block * Tk), never
  O(Tq * Tk * H). A causal block only scores the positions its last query can see. It gathers its chosen
  entries only when they are under 1/GATHER_BELOW_SHARE of what it sees; else one masked dense pass (GEMMs over
  the shared rows) is cheaper than a gather copy and products per query. When topk covers everything a block
  can see, the indexer is skipped (it would select all visible positions) and attention runs densely over them —
  on CPUs with AMX-BF16, for all such queries at once in the dense-attention kernel (cpu_kernel.dense_attention:
  bf16 products, fp32 logits and softmax; a query's bits do not depend on the other queries of the call).
- `dsa_decode_paged`: one query per sequence over a paged cache. The indexer walks the pages in chunks of
  DECODE_CHUNK_TOKENS (the chunk's keys gathered into a reused buffer, one batched GEMM, ReLU, weighted
  head sum); top-k; then attention over at most topk gathered entries. Cost per token: the indexer pass over
  the context plus attention over <= topk entries, never dense attention over the whole context.
"""

from __future__ import annotations

import torch

from expertmesh.kernels.batch_invariant import ROW_TILE
from expertmesh.kernels.dsa.cpu_kernel import (
    dense_attention as dense_attention_cpu,
)
from expertmesh.kernels.dsa.cpu_kernel import (
    dense_runs_for,
)
from expertmesh.kernels.dsa.cpu_kernel import (
    paged_attention as paged_attention_cpu,
)
from expertmesh.kernels.dsa.cpu_kernel import (
    runs_for as cpu_kernel_runs_for,
)
from expertmesh.kernels.dsa.naive import (
    MIN_COLS,
    DSAShapes,
    PagedShapes,
    check_decode_inputs,
    check_dsa_inputs,
    check_indexer_inputs,
    indexer_scores,
)

PREFILL_BLOCK_BYTES = 64 << 20  # working-set budget of one query block in dsa_prefill
DECODE_CHUNK_TOKENS = 8192  # context positions scored per GEMM in the paged indexer (keys ~4 MiB fp32)
_NEG_INF = float("-inf")
# a prefill block gathers its chosen entries only when top-k is under 1/GATHER_BELOW_SHARE of what it sees; else
# one masked dense pass over the visible rows (GEMMs, no gather) is the cheaper way to the same attention
GATHER_BELOW_SHARE = 4


# ----------------------------------------------------------------------------------------------- top-k
def select_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """scores [..., N] (-inf = invisible), 1 <= k <= N → [..., k] int64: the k highest positions, ties to the
    lower position, used positions ascending then -1 for the -inf ones (exactly `topk_indices_reference`).

    torch.topk gives the k-th largest value t but no tie order. All positions > t are taken, the lowest of
    those == t fill the remaining slots, and a scatter puts the chosen in order (no host sync: the GPU path).
    On CPU, when no tie straddles the cut (the usual case), topk's own picks are just sorted."""
    N = scores.shape[-1]
    vals, picks = scores.topk(k, dim=-1, sorted=False)
    thr = vals.amin(dim=-1, keepdim=True)
    if not scores.is_cuda and bool(((scores >= thr).sum(dim=-1) == k).all()):
        picks = picks.masked_fill(vals == _NEG_INF, N).sort(dim=-1).values
        return picks.masked_fill_(picks == N, -1)
    above = scores > thr
    tied = scores == thr
    need = k - above.sum(dim=-1, keepdim=True)
    take = above | (tied & (tied.cumsum(dim=-1) <= need))  # exactly k per row
    take &= scores != _NEG_INF  # -inf picks: -1 slots
    slot = torch.where(take, take.cumsum(dim=-1) - 1, k)  # slot k: discarded
    pos = torch.arange(N, device=scores.device).expand_as(scores)
    out = torch.full((*scores.shape[:-1], k + 1), -1, dtype=torch.int64, device=scores.device)
    return out.scatter_(-1, slot, pos)[..., :k]


# --------------------------------------------------------------------------------------------- prefill
def _visible_positions(q_pos: torch.Tensor, n: int) -> torch.Tensor:
    """Every position < n for each query, -1 where it is in the query's future: q_pos [Tq] → [Tq, n]."""
    pos = torch.arange(n, device=q_pos.device)
    return torch.where(pos[None, :] <= q_pos[:, None], pos[None, :], -1)


def _attend_gathered(
    q: torch.Tensor, kv_rows: torch.Tensor, Tk: int, idx: torch.Tensor, scale: float, v_dim: int
) -> torch.Tensor:
    """q [B,T,H,D] over kv_rows [B*Tk, D] (kv flattened) at idx [B,T,k] (-1 = unused) → [B,T,H,v_dim] fp32."""
    B, D = q.shape[0], kv_rows.shape[1]
    flat = idx.clamp_min(0) + Tk * torch.arange(B, device=kv_rows.device)[:, None, None]
    sel = kv_rows.index_select(0, flat.reshape(-1)).view(*idx.shape, D).float()  # [B,T,k,D]
    logits = torch.matmul(q.float(), sel.transpose(-1, -2)).mul_(scale)  # [B,T,H,k]
    logits.masked_fill_((idx < 0)[:, :, None, :], _NEG_INF)
    return torch.matmul(torch.softmax(logits, dim=-1), sel[..., :v_dim])


def _attend_selected(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, scale: float, v_dim: int):
    """q [B,T,H,D] over the entries idx [B,T,k] (-1 = unused) of kv [B,n,D] as one masked dense pass (the
    reference's own form) → [B,T,H,v_dim] fp32: two GEMMs over the block's n shared rows instead of a [T, k, D]
    gather copy and per-query products, which at k ~ n cost minutes a step (an 8K prompt with index_topk 4096)."""
    kept = torch.zeros(*idx.shape[:2], kv.shape[1] + 1, dtype=torch.bool, device=idx.device)
    kept = kept.scatter_(-1, torch.where(idx < 0, kv.shape[1], idx), True)[..., :-1]  # [B,T,n]
    kvf = kv.float()
    logits = torch.matmul(q.float(), kvf.transpose(1, 2)[:, None]).mul_(scale)  # [B,T,H,n]
    logits.masked_fill_(~kept[:, :, None, :], _NEG_INF)
    return torch.matmul(torch.softmax(logits, dim=-1), kvf[:, None, :, :v_dim])


def _attend_dense(q: torch.Tensor, kv: torch.Tensor, q_pos: torch.Tensor | None, scale: float, v_dim: int):
    """q [B,T,H,D] over all of kv [B,n,D] (causally masked by q_pos [T] if given) → [B,T,H,v_dim] fp32."""
    kvf = kv.float()
    logits = torch.matmul(q.float(), kvf.transpose(1, 2)[:, None]).mul_(scale)  # [B,T,H,n]
    if q_pos is not None:
        future = torch.arange(kv.shape[1], device=kv.device)[None, :] > q_pos[:, None]  # [T,n]
        logits.masked_fill_(future[None, :, None, :], _NEG_INF)
    return torch.matmul(torch.softmax(logits, dim=-1), kvf[:, None, :, :v_dim])


def _every_visible(q_pos: torch.Tensor | None, n: int, rows: int, device) -> torch.Tensor:
    """The indices of queries that attend to all they see: q_pos [rows] (causal; None: all n visible) → [rows, n],
    -1 in a query's future."""
    return _visible_positions(q_pos, n) if q_pos is not None else torch.arange(n, device=device).expand(rows, n)


def _put_indices(indices: torch.Tensor, i0: int, idx: torch.Tensor) -> None:
    """Rows i0 .. of indices [B, Tq, k] from idx [(B,) rows, w ≤ k], -1 past w."""
    i1, w = i0 + idx.shape[-2], idx.shape[-1]
    indices[:, i0:i1, :w] = idx
    indices[:, i0:i1, w:] = -1


def _dense_attention_prefix(
    q: torch.Tensor, kv: torch.Tensor, causal: bool, topk: int, scale: float, v_dim: int, o: torch.Tensor
) -> int:
    """Where the AMX dense-attention kernel runs (cpu_kernel.dense_runs_for): the leading queries of q [B,Tq,H,D]
    that see at most `topk` positions of kv [B,Tk,D] attend densely in one kernel call, into o; returns how many
    (0 elsewhere: every query goes through the blocks)."""
    if not dense_runs_for(q) or kv.dtype != torch.bfloat16:
        return 0
    Tq, Tk = q.shape[1], kv.shape[1]
    if not causal:
        return Tq if topk >= Tk else 0
    first = max(0, min(Tq, topk - (Tk - Tq)))  # query i sees Tk - Tq + i + 1 positions
    if first:
        n = Tk - Tq + first
        q_pos = torch.arange(Tk - Tq, n, device=q.device)
        o[:, :first] = dense_attention_cpu(q[:, :first], kv[:, :n], q_pos, scale, v_dim)
    return first


def _block_rows(shp: DSAShapes) -> int:
    k = min(shp.topk, shp.Tk)
    gathered = k * (shp.D + shp.H) if k * GATHER_BELOW_SHARE < shp.Tk else shp.H * shp.Tk  # else masked logits
    per_query = 4 * (shp.Hi * shp.Tk + gathered + shp.H * shp.Tk)
    return max(1, min(shp.Tq, PREFILL_BLOCK_BYTES // per_query))


def lightning_indexer(
    index_q: torch.Tensor, index_k: torch.Tensor, index_weights: torch.Tensor, causal: bool = True
) -> torch.Tensor:
    """Indexer scores [B,Tq,Tk] fp32, bitwise equal to `lightning_indexer_reference`, computed in query blocks
    (the [Tq, Hi, Tk] logits never exist at once; with causal, a block skips the positions it cannot see)."""
    shp = check_indexer_inputs(index_q, index_k, index_weights, causal)
    B, Tq, Tk = shp.B, shp.Tq, shp.Tk
    out = torch.full((B, Tq, Tk), _NEG_INF, device=index_q.device)
    bq = max(1, min(Tq, PREFILL_BLOCK_BYTES // (4 * shp.Hi * Tk)))
    for i0 in range(0, Tq, bq):
        i1 = min(Tq, i0 + bq)
        n = Tk - Tq + i1 if causal else Tk
        s = indexer_scores(index_q[:, i0:i1], index_k[:, :n], index_weights[:, i0:i1])
        if causal:
            q_pos = torch.arange(Tk - Tq + i0, Tk - Tq + i1, device=s.device)
            s.masked_fill_(torch.arange(n, device=s.device)[None, :] > q_pos[:, None], _NEG_INF)
        out[:, i0:i1, :n] = s
    return out


def dsa_prefill(
    q: torch.Tensor,
    kv: torch.Tensor,
    index_q: torch.Tensor,
    index_k: torch.Tensor,
    index_weights: torch.Tensor,
    topk: int,
    causal: bool = True,
    scale: float | None = None,
    v_dim: int | None = None,
    return_indices: bool = False,
    out: torch.Tensor | None = None,
):
    """DSA attention for a block of queries (prefill, or prefill continuing a cache when Tq < Tk).

    q [B,Tq,H,D], kv [B,Tk,D], index_q [B,Tq,Hi,Di], index_k [B,Tk,Di], index_weights [B,Tq,Hi] → o
    [B,Tq,H,v_dim] in q.dtype (+ indices [B,Tq,min(topk,Tk)] int64 with return_indices). Contract, tie-breaking
    and index order: `naive.dsa_attention_reference`; this computes the same selection and output."""
    shp = check_dsa_inputs(q, kv, index_q, index_k, index_weights, topk, causal, scale, v_dim, out)
    B, Tq, Tk = shp.B, shp.Tq, shp.Tk
    k_all = min(shp.topk, Tk)
    o = out if out is not None else torch.empty(B, Tq, shp.H, shp.v_dim, dtype=q.dtype, device=q.device)
    indices = torch.empty(B, Tq, k_all, dtype=torch.int64, device=q.device) if return_indices else None
    bq = _block_rows(shp)
    kv_rows = kv.reshape(B * Tk, shp.D)  # once: a copy only if kv is a strided view
    # Queries that see no more than topk positions attend to all of them: on AMX, one call of the dense kernel for
    # all of those (their bits do not depend on which other queries share the call)
    first = _dense_attention_prefix(q, kv, causal, shp.topk, shp.scale, shp.v_dim, o)
    if first and indices is not None:
        q_pos = torch.arange(Tk - Tq, Tk - Tq + first, device=q.device) if causal else None
        _put_indices(indices, 0, _every_visible(q_pos, Tk - Tq + first if causal else Tk, first, q.device))
    for i0 in range(first, Tq, bq):
        i1 = min(Tq, i0 + bq)
        n = Tk - Tq + i1 if causal else Tk  # positions any query of the block can see
        q_pos = torch.arange(Tk - Tq + i0, Tk - Tq + i1, device=q.device) if causal else None
        if shp.topk >= n:  # everything visible is selected
            o[:, i0:i1] = _attend_dense(q[:, i0:i1], kv[:, :n], q_pos, shp.scale, shp.v_dim)
            if indices is None:
                continue
            idx = _every_visible(q_pos, n, i1 - i0, q.device)
        else:
            s = indexer_scores(index_q[:, i0:i1], index_k[:, :n], index_weights[:, i0:i1])  # [B,bq,n]
            if causal:
                s.masked_fill_(torch.arange(n, device=q.device)[None, :] > q_pos[:, None], _NEG_INF)
            idx = select_topk(s, shp.topk)  # [B,bq,topk]
            if shp.topk * GATHER_BELOW_SHARE < n:  # few of the visible positions: gather just those
                o[:, i0:i1] = _attend_gathered(q[:, i0:i1], kv_rows, Tk, idx, shp.scale, shp.v_dim)
            else:
                o[:, i0:i1] = _attend_selected(q[:, i0:i1], kv[:, :n], idx, shp.scale, shp.v_dim)
        if indices is not None:
            _put_indices(indices, i0, idx)
    return (o, indices) if return_indices else o


def mla_prefill(
    q: torch.Tensor, kv: torch.Tensor, scale: float | None = None, v_dim: int | None = None
) -> torch.Tensor:
    """Causal dense attention over the latent (an MLA layer without an indexer), in query blocks.

    q [B,Tq,H,D], kv [B,Tk,D] (the queries are the last Tq positions) → [B,Tq,H,v_dim] in q.dtype; exactly
    `dsa_prefill` with a top-k that covers every visible position."""
    B, Tq, H, D = q.shape
    if kv.dim() != 3 or kv.shape[0] != B or kv.shape[2] != D or kv.shape[1] < Tq:
        raise ValueError(f"kv: expected shape [{B}, Tk >= {Tq}, {D}], found {list(kv.shape)}")
    Tk = kv.shape[1]
    scale = D**-0.5 if scale is None else scale
    v_dim = D if v_dim is None else v_dim
    o = torch.empty(B, Tq, H, v_dim, dtype=q.dtype, device=q.device)
    first = _dense_attention_prefix(q, kv, True, Tk, scale, v_dim, o)  # AMX: every query in one call
    bq = max(1, min(Tq, PREFILL_BLOCK_BYTES // (4 * H * Tk)))
    for i0 in range(first, Tq, bq):
        i1 = min(Tq, i0 + bq)
        n = Tk - Tq + i1
        q_pos = torch.arange(Tk - Tq + i0, Tk - Tq + i1, device=q.device)
        o[:, i0:i1] = _attend_dense(q[:, i0:i1], kv[:, :n], q_pos, scale, v_dim)
    return o


# ---------------------------------------------------------------------------------------------- decode
def paged_indexer_scores(
    index_q: torch.Tensor,
    index_weights: torch.Tensor,
    index_k_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    n_pages: int | None = None,
) -> torch.Tensor:
    """Decode indexer over a paged cache: index_q [B,Hi,Di], index_weights [B,Hi], index_k_cache
    [num_blocks, block_size, Di], block_table [B, max_blocks], context_lens [B] → scores [B, n_pages*block_size]
    fp32, -inf at positions >= context_lens[b] (n_pages defaults to the pages of the longest context).
    Each chunk of pages is gathered into a small buffer and scored with one batched GEMM (naive.indexer_scores)."""
    B = index_q.shape[0]
    nb, bs, Di = index_k_cache.shape
    lens = context_lens.long()
    if n_pages is None:
        n_pages = -(-int(lens.max()) // bs) if B else 0
    W = n_pages * bs
    scores = torch.empty(B, W, device=index_q.device)
    table = block_table[:, :n_pages].long().clamp(0, nb - 1)  # past a sequence's pages: any valid block, masked
    per_chunk = max(1, min(n_pages, DECODE_CHUNK_TOKENS // bs))
    iq, iw = index_q[:, None], index_weights[:, None]  # [B,1,Hi,Di], [B,1,Hi]
    # Buffers reused by every chunk: fresh multi-MiB allocations per chunk cost page faults, not just time.
    keys_buf = index_k_cache.new_empty(B * per_chunk * bs * Di)
    rows = max(ROW_TILE, -(-index_q.shape[1] // ROW_TILE) * ROW_TILE)
    logits_buf = torch.empty(B * rows * max(per_chunk * bs, MIN_COLS), device=index_q.device)
    for p0 in range(0, n_pages, per_chunk):
        pages = table[:, p0 : p0 + per_chunk].reshape(-1)  # [B*p]
        keys = torch.index_select(index_k_cache, 0, pages, out=keys_buf[: pages.numel() * bs * Di].view(-1, bs, Di))
        keys = keys.view(B, -1, Di)  # [B,p*bs,Di]
        scores[:, p0 * bs : p0 * bs + keys.shape[1]] = indexer_scores(iq, keys, iw, logits_buf)[:, 0]
    return scores.masked_fill_(torch.arange(W, device=scores.device)[None, :] >= lens[:, None], _NEG_INF)


def paged_sparse_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, indices: torch.Tensor, scale: float, v_dim: int
) -> torch.Tensor:
    """q [B,H,D] over the entries `indices` [B,k] (logical positions, -1 = unused; at least one used per row)
    of each sequence's pages → [B,H,v_dim] fp32. On CPU (backend auto) the C++ kernel (cpu_kernel.py: no gather
    copy, each sequence's result independent of the batch), else `paged_sparse_attention_torch`."""
    if cpu_kernel_runs_for(q):
        return paged_attention_cpu(q, kv_cache, block_table, indices, scale, v_dim)
    return paged_sparse_attention_torch(q, kv_cache, block_table, indices, scale, v_dim)


def paged_sparse_attention_torch(
    q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, indices: torch.Tensor, scale: float, v_dim: int
) -> torch.Tensor:
    """`paged_sparse_attention` as a gather, two batched GEMMs and a softmax (any device)."""
    bs, D = kv_cache.shape[1:]
    safe = indices.clamp_min(0)
    rows = block_table.long().gather(1, safe // bs) * bs + safe % bs  # physical rows [B,k]
    sel = kv_cache.reshape(-1, D).index_select(0, rows.reshape(-1)).view(*rows.shape, D).float()  # [B,k,D]
    logits = torch.bmm(q.float(), sel.transpose(1, 2)).mul_(scale)  # [B,H,k]
    logits.masked_fill_((indices < 0)[:, None, :], _NEG_INF)
    return torch.bmm(torch.softmax(logits, dim=-1), sel[..., :v_dim])


def visible_positions(context_lens: torch.Tensor, width: int) -> torch.Tensor:
    """[B, width]: 0 .. context_lens[b]-1, then -1."""
    pos = torch.arange(width, device=context_lens.device)[None, :]
    return torch.where(pos < context_lens.long()[:, None], pos, -1)


def decode_indices(shp: PagedShapes, scores_fn, context_lens: torch.Tensor, width: int) -> torch.Tensor:
    """The top-k selection of a decode step over the first `width` positions, [B, min(topk, width)]: every
    visible position when topk covers them (no indexer pass), else select_topk of `scores_fn()[:, :width]`.
    The PyTorch path passes the longest context as the width, so a sequence's result does not depend on the
    page size (paged or one contiguous block: the same bits); the Triton path passes the block table's span
    (no host sync)."""
    if shp.topk >= width:
        return visible_positions(context_lens, width)
    return select_topk(scores_fn()[:, :width], shp.topk)


def pad_indices(idx: torch.Tensor, width: int) -> torch.Tensor:
    return torch.nn.functional.pad(idx, (0, width - idx.shape[-1]), value=-1) if idx.shape[-1] < width else idx


def mla_decode_paged(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float | None = None,
    v_dim: int | None = None,
) -> torch.Tensor:
    """Dense MLA decode over a paged latent cache (MLA layers: every past entry, no indexer): q [B,H,D],
    kv_cache [num_blocks, block_size, D], block_table [B, max_blocks], context_lens [B] → [B,H,v_dim] in
    q.dtype. The pages are read where they are (one gather of the visible entries), never copied whole."""
    if q.dim() != 3 or kv_cache.dim() != 3 or kv_cache.shape[-1] != q.shape[-1]:
        raise ValueError(
            f"q [B,H,D], kv_cache [num_blocks,block_size,D]: found {list(q.shape)}, {list(kv_cache.shape)}"
        )
    D = q.shape[-1]
    scale = D**-0.5 if scale is None else scale
    v_dim = D if v_dim is None else v_dim
    idx = visible_positions(context_lens, int(context_lens.max()))
    return paged_sparse_attention(q, kv_cache, block_table, idx, scale, v_dim).to(q.dtype)


def dsa_decode_paged(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    index_k_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    index_q: torch.Tensor,
    index_weights: torch.Tensor,
    topk: int,
    scale: float | None = None,
    v_dim: int | None = None,
    return_indices: bool = False,
    out: torch.Tensor | None = None,
):
    """One DSA decode step for B sequences over a paged latent cache.

    q [B,H,D]: each sequence's new query, whose own entry is already in the cache at position
    context_lens[b]-1; kv_cache [num_blocks, block_size, D] latent entries; index_k_cache [num_blocks,
    block_size, Di] indexer keys; block_table [B, max_blocks] int32: logical page j of sequence b is physical
    block block_table[b, j]; context_lens [B] int32 (ragged); index_q [B,Hi,Di]; index_weights [B,Hi].
    → o [B,H,v_dim] in q.dtype, and with return_indices the selected logical positions
    [B, min(topk, max_blocks*block_size)] int64 (canonical order, -1 = unused). Equals gathering each
    sequence's pages and calling `dsa_attention_reference` with Tq = 1 (`dsa_decode_paged_reference`)."""
    shp = check_decode_inputs(
        q, kv_cache, index_k_cache, block_table, context_lens, index_q, index_weights, topk, scale, v_dim, out
    )
    o = out if out is not None else torch.empty(shp.B, shp.H, shp.v_dim, dtype=q.dtype, device=q.device)
    n_pages = -(-int(context_lens.max()) // shp.block_size) if shp.B else 0
    if shp.B == 0:
        return (o, torch.empty(0, shp.width, dtype=torch.int64, device=q.device)) if return_indices else o
    idx = decode_indices(
        shp,
        lambda: paged_indexer_scores(index_q, index_weights, index_k_cache, block_table, context_lens, n_pages),
        context_lens,
        int(context_lens.max()),
    )
    o.copy_(paged_sparse_attention(q, kv_cache, block_table, idx, shp.scale, shp.v_dim))
    return (o, pad_indices(idx, shp.width)) if return_indices else o
