"""DSA (DeepSeek sparse attention) over MLA latent KV: the input contract and the plain PyTorch reference.

Absorbed-MLA / MQA form: every attention head reads the SAME latent entry kv[b, s] (D = kv_lora_rank + rope_dim)
and the values are its first v_dim channels. Per query i (absolute position p_i = Tk - Tq + i: the queries are
the LAST Tq positions of the context):

  1. lightning indexer  I[b,i,s] = sum_h w[b,i,h] * ReLU(index_q[b,i,h] . index_k[b,s])    (fp32)
     with causal=True, positions s > p_i score -inf;
  2. top-k              S_i = the min(topk, Tk) positions of highest I[b,i,:]; ties go to the LOWER position;
                        positions scoring -inf (causally invisible) fill slots only when fewer than topk are
                        visible, and are reported as -1 ("unused slot");
  3. sparse attention   o[b,i,h] = softmax_{s in S_i}(scale * q[b,i,h] . kv[b,s]) @ kv[b, S_i, :v_dim].

Index lists are in a canonical order: used positions ascending, then the -1 slots. With topk >= Tk step 2
selects every visible position, so the result is plain causal attention.

The indexer's arithmetic is defined once, in `indexer_scores`, and every CPU path (this reference, the blocked
prefill, the paged decode) calls it, so they pick bitwise the same top-k. Two things make a score depend on
the call's shape on torch 2.13 CPU, and both are pinned there:
  - MKL sgemm picks its kernel by the row/column count (gemv for 1 row; odd small counts take other kernels),
    which changes the last bits of a dot product. Rows are padded to a multiple of ROW_TILE (16) with at most
    MAX_ROWS per call and columns to at least MIN_COLS; on those shapes each element was checked to be
    independent of M, N and its offset.
  - torch.sum's reduction order depends on the shape; the head sum is instead a fixed pairwise tree of
    elementwise adds (exactly rounded, so independent of vectorisation and threads).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from expertmesh.kernels.batch_invariant import ROW_TILE

MAX_ROWS = 1024  # GEMM rows per call (a multiple of ROW_TILE)
MIN_COLS = 16  # GEMM columns at least (fewer take shape-dependent kernels)
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_INTS = (torch.int32, torch.int64)


# ------------------------------------------------------------------------------------------------ checks
def _shape(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def _check(name: str, t, labels: str, expected: tuple[int | None, ...], dtypes=_FLOATS, device=None) -> None:
    """t must be a tensor of rank len(expected), dims equal to `expected` where not None (labels e.g. "B,Tk,D")."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, found {type(t).__name__}")
    if t.dim() != len(expected) or any(e is not None and s != e for s, e in zip(t.shape, expected)):
        want = ", ".join(lab if e is None else f"{lab}={e}" for lab, e in zip(labels.split(","), expected))
        raise ValueError(f"{name}: expected shape [{want}], found {_shape(t)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise ValueError(f"{name}: expected dtype in {[str(d) for d in dtypes]}, found {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: expected device {device} (as q), found {t.device}")


def _same_dtype(name: str, t: torch.Tensor, other: str, dtype: torch.dtype) -> None:
    if t.dtype != dtype:
        raise ValueError(f"{name}: expected dtype {dtype} (same as {other}), found {t.dtype}")


def _check_scalars(topk, scale, v_dim, D: int) -> tuple[int, float, int]:
    if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
        raise ValueError(f"topk: expected an int >= 1, found {topk!r}")
    v_dim = D if v_dim is None else v_dim
    if isinstance(v_dim, bool) or not isinstance(v_dim, int) or not 1 <= v_dim <= D:
        raise ValueError(f"v_dim: expected an int in [1, D={D}], found {v_dim!r}")
    scale = D**-0.5 if scale is None else scale
    if not isinstance(scale, (int, float)) or isinstance(scale, bool):
        raise ValueError(f"scale: expected a float, found {scale!r}")
    return topk, float(scale), v_dim


def _check_out(out, shape: tuple[int, ...], dtype: torch.dtype, device) -> None:
    if out is None:
        return
    _check("out", out, ",".join("?" * len(shape)), shape, dtypes=(dtype,), device=device)
    if not out.is_contiguous():
        raise ValueError("out: expected a contiguous tensor, found a strided view")


@dataclass(frozen=True)
class DSAShapes:
    B: int
    Tq: int  # queries (the last Tq positions of the context); 1 in decode
    Tk: int  # context length (decode: max_blocks * block_size, the widest context a sequence can have)
    H: int  # attention heads
    D: int  # latent entry width (kv_lora_rank + rope_dim)
    Hi: int  # indexer heads
    Di: int  # indexer head dim
    topk: int
    scale: float
    v_dim: int


def check_indexer_inputs(index_q, index_k, index_weights, causal: bool = True) -> DSAShapes:
    """index_q [B,Tq,Hi,Di], index_k [B,Tk,Di] (same dtype), index_weights [B,Tq,Hi]; floating, one device;
    with causal, Tq <= Tk. Raises ValueError naming the tensor, expected vs found."""
    _check("index_q", index_q, "B,Tq,Hi,Di", (None,) * 4)
    B, Tq, Hi, Di = index_q.shape
    _check("index_k", index_k, "B,Tk,Di", (B, None, Di), device=index_q.device)
    _same_dtype("index_k", index_k, "index_q", index_q.dtype)
    Tk = index_k.shape[1]
    _check("index_weights", index_weights, "B,Tq,Hi", (B, Tq, Hi), device=index_q.device)
    if Tk < 1:
        raise ValueError(f"index_k: expected at least one context position (Tk >= 1), found shape {_shape(index_k)}")
    if causal and Tq > Tk:
        raise ValueError(
            f"index_q: with causal=True the queries are the last Tq of Tk positions, so Tq <= Tk="
            f"{Tk} is expected; found Tq={Tq}"
        )
    return DSAShapes(B, Tq, Tk, 0, 0, Hi, Di, 1, 1.0, 1)


def check_dsa_inputs(
    q, kv, index_q, index_k, index_weights, topk, causal=True, scale=None, v_dim=None, out=None
) -> DSAShapes:
    """The contract of `dsa_attention_reference` / `dsa_prefill`; raise ValueError naming the tensor.

    q [B,Tq,H,D] and kv [B,Tk,D] floating, same dtype; index_q [B,Tq,Hi,Di] and index_k [B,Tk,Di] floating,
    same dtype; index_weights [B,Tq,Hi] floating; one device; causal ⇒ Tq <= Tk; topk int >= 1;
    1 <= v_dim <= D; out (optional) contiguous [B,Tq,H,v_dim] in q's dtype."""
    _check("q", q, "B,Tq,H,D", (None,) * 4)
    B, Tq, H, D = q.shape
    _check("kv", kv, "B,Tk,D", (B, None, D), device=q.device)
    _same_dtype("kv", kv, "q", q.dtype)
    Tk = kv.shape[1]
    _check("index_q", index_q, "B,Tq,Hi,Di", (B, Tq, None, None), device=q.device)
    _check("index_k", index_k, "B,Tk,Di", (B, Tk, index_q.shape[3]), device=q.device)
    ix = check_indexer_inputs(index_q, index_k, index_weights, causal)
    topk, scale, v_dim = _check_scalars(topk, scale, v_dim, D)
    _check_out(out, (B, Tq, H, v_dim), q.dtype, q.device)
    return DSAShapes(B, Tq, Tk, H, D, ix.Hi, ix.Di, topk, scale, v_dim)


@dataclass(frozen=True)
class PagedShapes:
    B: int
    H: int
    D: int
    Hi: int
    Di: int
    num_blocks: int
    block_size: int
    max_blocks: int
    topk: int
    scale: float
    v_dim: int

    @property
    def width(self) -> int:
        """Index slots per sequence: min(topk, widest context a block table can hold)."""
        return min(self.topk, self.max_blocks * self.block_size)


HOST_CHECK_MAX_BLOCKS = 4096  # block tables up to this size have their values checked as host integers


def check_decode_inputs(
    q,
    kv_cache,
    index_k_cache,
    block_table,
    context_lens,
    index_q,
    index_weights,
    topk,
    scale=None,
    v_dim=None,
    out=None,
) -> PagedShapes:
    """The contract of `dsa_decode_paged`; raise ValueError naming the tensor, expected vs found.

    q [B,H,D] and kv_cache [num_blocks, block_size, D] floating, same dtype; index_q [B,Hi,Di] and
    index_k_cache [num_blocks, block_size, Di] floating, same dtype; index_weights [B,Hi]; block_table
    [B, max_blocks] and context_lens [B] int32/int64; one device. On CPU also the values: 1 <= context_lens[b]
    <= max_blocks*block_size, and the block ids a sequence uses lie in [0, num_blocks) (not checked on a GPU,
    where it would cost a host sync per step)."""
    _check("q", q, "B,H,D", (None,) * 3)
    B, H, D = q.shape
    dev = q.device
    _check("kv_cache", kv_cache, "num_blocks,block_size,D", (None, None, D), device=dev)
    _same_dtype("kv_cache", kv_cache, "q", q.dtype)
    nb, bs = kv_cache.shape[:2]
    _check("index_q", index_q, "B,Hi,Di", (B, None, None), device=dev)
    Hi, Di = index_q.shape[1:]
    _check("index_k_cache", index_k_cache, "num_blocks,block_size,Di", (nb, bs, Di), device=dev)
    _same_dtype("index_k_cache", index_k_cache, "index_q", index_q.dtype)
    _check("index_weights", index_weights, "B,Hi", (B, Hi), device=dev)
    _check("block_table", block_table, "B,max_blocks", (B, None), dtypes=_INTS, device=dev)
    _check("context_lens", context_lens, "B", (B,), dtypes=_INTS, device=dev)
    mb = block_table.shape[1]
    if nb < 1 or bs < 1 or mb < 1:
        raise ValueError(
            f"kv_cache/block_table: expected num_blocks, block_size, max_blocks >= 1, found {nb}, {bs}, {mb}"
        )
    topk, scale, v_dim = _check_scalars(topk, scale, v_dim, D)
    _check_out(out, (B, H, v_dim), q.dtype, dev)
    if not q.is_cuda and B > 0 and block_table.numel() <= HOST_CHECK_MAX_BLOCKS:
        # a decode step's small tables: the same checks on host integers (a dozen tensor ops saved per layer)
        lens, table = context_lens.tolist(), block_table.tolist()
        if min(lens) < 1 or max(lens) > mb * bs:
            raise ValueError(
                f"context_lens: expected values in [1, max_blocks*block_size={mb * bs}] (each "
                f"sequence's new entry is already cached), found {lens}"
            )
        used = [b for row, n in zip(table, lens) for b in row[: (n + bs - 1) // bs]]
        if used and (min(used) < 0 or max(used) >= nb):
            raise ValueError(
                f"block_table: expected the blocks each sequence uses to lie in [0, num_blocks={nb}), "
                f"found ids from {min(used)} to {max(used)}"
            )
    elif not q.is_cuda and B > 0:
        lens = context_lens.long()
        if int(lens.min()) < 1 or int(lens.max()) > mb * bs:
            raise ValueError(
                f"context_lens: expected values in [1, max_blocks*block_size={mb * bs}] (each "
                f"sequence's new entry is already cached), found {context_lens.tolist()}"
            )
        used = torch.arange(mb, device=dev)[None, :] < (lens[:, None] + bs - 1) // bs
        ids = block_table.long()[used]
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= nb):
            raise ValueError(
                f"block_table: expected the blocks each sequence uses to lie in [0, num_blocks={nb}), "
                f"found ids from {int(ids.min())} to {int(ids.max())}"
            )
    return PagedShapes(B, H, D, Hi, Di, nb, bs, mb, topk, scale, v_dim)


# ------------------------------------------------------------------------------------ indexer arithmetic
def stable_bmm(a: torch.Tensor, b: torch.Tensor, workspace: torch.Tensor | None = None) -> torch.Tensor:
    """a [B, M, K] @ b[B, N, K]^T → [B, M, N] fp32, each element's bits independent of M, N and its offset
    (rows padded to a multiple of ROW_TILE, at most MAX_ROWS per call; columns padded to MIN_COLS).
    `workspace`, a flat fp32 buffer of at least B * M' * N' elements (padded sizes), receives the product
    instead of a new allocation when the rows fit one call; the result is then a view into it."""
    a, b = a.float(), b.float()
    Bn, M, K = a.shape
    N = b.shape[1]
    if a.is_cuda:  # on a GPU this shape pinning is not the tool (and its results are not compared bitwise)
        return torch.bmm(a, b.transpose(1, 2))
    if N < MIN_COLS:
        b = torch.cat([b, b.new_zeros(Bn, MIN_COLS - N, K)], dim=1)
    Mp = max(ROW_TILE, -(-M // ROW_TILE) * ROW_TILE)
    if Mp != M:
        a = torch.cat([a, a.new_zeros(Bn, Mp - M, K)], dim=1)
    bt = b.transpose(1, 2)
    if Mp > MAX_ROWS:
        out = torch.cat([torch.bmm(a[:, s : s + MAX_ROWS], bt) for s in range(0, Mp, MAX_ROWS)], dim=1)
    elif workspace is not None:
        out = torch.bmm(a, bt, out=workspace[: Bn * Mp * bt.shape[2]].view(Bn, Mp, bt.shape[2]))
    else:
        out = torch.bmm(a, bt)
    return out[:, :M, :N]


def head_sum_(x: torch.Tensor) -> torch.Tensor:
    """x [..., Hi, N] → [..., N] (a view of x, which is overwritten): the sum over heads in a fixed pairwise
    order, by elementwise adds only — x[h] += x[h + half] level by level; an odd head out joins head 0."""
    n = x.shape[-2]
    while n > 1:
        half = n // 2
        x[..., :half, :] += x[..., half : 2 * half, :]
        if n % 2:
            x[..., :1, :] += x[..., 2 * half : n, :]
        n = half
    return x[..., 0, :]


def indexer_scores(
    index_q: torch.Tensor, index_k: torch.Tensor, index_weights: torch.Tensor, workspace: torch.Tensor | None = None
) -> torch.Tensor:
    """Unmasked indexer scores: index_q [B,T,Hi,Di], index_k [B,N,Di], index_weights [B,T,Hi] → [B,T,N] fp32,
    sum_h w[b,t,h] * ReLU(index_q[b,t,h] . index_k[b,n]). The one definition of the indexer's arithmetic; the
    score of (t, n) does not depend on T, N or where the call's rows and columns start. With a `workspace`
    (see stable_bmm) the result is a view into it, valid until the workspace is reused."""
    B, T, Hi, Di = index_q.shape
    N = index_k.shape[1]
    logits = stable_bmm(index_q.reshape(B, T * Hi, Di), index_k, workspace).view(B, T, Hi, N)
    logits.relu_().mul_(index_weights.float()[..., None])
    return head_sum_(logits)


# ------------------------------------------------------------------------------------------- reference
def lightning_indexer_reference(
    index_q: torch.Tensor, index_k: torch.Tensor, index_weights: torch.Tensor, causal: bool = True
) -> torch.Tensor:
    """Indexer scores [B,Tq,Tk] fp32 (module docstring, step 1); with causal, -inf where s > Tk - Tq + i."""
    shp = check_indexer_inputs(index_q, index_k, index_weights, causal)
    scores = indexer_scores(index_q, index_k, index_weights)
    if causal:
        pos = torch.arange(shp.Tk - shp.Tq, shp.Tk, device=scores.device)  # query positions [Tq]
        future = torch.arange(shp.Tk, device=scores.device)[None, :] > pos[:, None]  # [Tq, Tk]
        scores = scores.masked_fill(future, float("-inf"))
    return scores


def topk_indices_reference(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """scores [..., N] (-inf = invisible) → [..., min(topk, N)] int64: the highest-scoring positions, ties to the
    lower position (a stable descending sort), in canonical order: used positions ascending, then -1 slots."""
    k = min(topk, scores.shape[-1])
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]
    unused = scores.gather(-1, order) == float("-inf")
    n = scores.shape[-1]
    order = torch.sort(order.masked_fill(unused, n), dim=-1).values  # -1 slots sort last as n
    return order.masked_fill(order == n, -1)


def dsa_attention_reference(
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
    """DSA attention, the plain way: the full indexer, a stable sort, then dense attention masked to the chosen.

    q [B,Tq,H,D], kv [B,Tk,D], index_q [B,Tq,Hi,Di], index_k [B,Tk,Di], index_weights [B,Tq,Hi] → o
    [B,Tq,H,v_dim] in q.dtype (math in fp32; scale defaults to D**-0.5, v_dim to D), and with return_indices
    also the selection [B,Tq,min(topk,Tk)] int64 (canonical order, -1 = unused). `out` receives o if given.
    """
    shp = check_dsa_inputs(q, kv, index_q, index_k, index_weights, topk, causal, scale, v_dim, out)
    scores = lightning_indexer_reference(index_q, index_k, index_weights, causal)  # [B,Tq,Tk]
    idx = topk_indices_reference(scores, shp.topk)  # [B,Tq,k]
    Tk = scores.shape[-1]
    chosen = torch.zeros(*scores.shape[:-1], Tk + 1, dtype=torch.bool, device=scores.device)
    chosen = chosen.scatter_(-1, idx.masked_fill(idx < 0, Tk), True)[..., :Tk]  # [B,Tq,Tk]; -1 → spare
    kvf = kv.float()
    logits = torch.einsum("bihd,bsd->bihs", q.float(), kvf) * shp.scale  # [B,Tq,H,Tk]
    logits = logits.masked_fill(~chosen[:, :, None, :], float("-inf"))
    o = torch.einsum("bihs,bsv->bihv", torch.softmax(logits, dim=-1), kvf[..., : shp.v_dim]).to(q.dtype)
    if out is not None:
        o = out.copy_(o)
    return (o, idx) if return_indices else o


def gather_pages(cache: torch.Tensor, block_table: torch.Tensor, b: int, length: int) -> torch.Tensor:
    """Sequence b's first `length` cached entries, contiguous: cache [num_blocks, block_size, C] → [length, C]."""
    bs = cache.shape[1]
    pages = block_table[b, : -(-length // bs)].long()
    return cache[pages].reshape(-1, cache.shape[-1])[:length]


def dsa_decode_paged_reference(
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
    """One decode step over a paged cache, by gathering each sequence's pages and calling
    `dsa_attention_reference` with Tq = 1. Contract: `expertmesh.kernels.dsa.sparse.dsa_decode_paged`."""
    shp = check_decode_inputs(
        q, kv_cache, index_k_cache, block_table, context_lens, index_q, index_weights, topk, scale, v_dim, out
    )
    outs, idxs = [], []
    for b in range(shp.B):
        n = int(context_lens[b])
        o, idx = dsa_attention_reference(
            q[b][None, None],
            gather_pages(kv_cache, block_table, b, n)[None],
            index_q[b][None, None],
            gather_pages(index_k_cache, block_table, b, n)[None],
            index_weights[b][None, None],
            topk,
            causal=True,
            scale=shp.scale,
            v_dim=shp.v_dim,
            return_indices=True,
        )
        outs.append(o[0, 0])
        idxs.append(torch.nn.functional.pad(idx[0, 0], (0, shp.width - idx.shape[-1]), value=-1))
    o = torch.stack(outs) if outs else q.new_empty(0, shp.H, shp.v_dim)
    if out is not None:
        o = out.copy_(o)
    if return_indices:
        return o, (torch.stack(idxs) if idxs else torch.empty(0, shp.width, dtype=torch.int64, device=q.device))
    return o
