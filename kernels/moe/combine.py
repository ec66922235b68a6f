"""The canonical grouped MoE combine: the same bits whichever worker computed which expert.

A token's routed sum is defined in two levels over the model's combine groups (group g = experts [g·S, (g+1)·S),
S = moe.combine_group_size, by default the routing group size E / n_group — routing is group-limited, so a token
touches few of them; a group-aware plan keeps each on one expert pod):

  P_g   = fold over the token's slots in group g, in ascending expert id:  acc = acc + y_k · w_k   (fp32, from 0)
  sum   = fold over the groups present, ascending:                       acc = acc + round(P_g)  (fp32, from 0)

where round() is a cast to the activation dtype and back (identity in fp32; in bf16 it is what a pre-reduced
row costs on the wire). Every step is one rounded fp32 multiply or add, so the result depends only on the
token's own (expert, weight, output) triples — not on the batch, the placement, the replica that ran an expert,
or whether P_g was reduced on an expert worker (`group_partials`) or assembled from per-slot rows on the
attention worker (`fold_fragments`). The reference model runs `grouped_combine`, which is these two functions.
"""

from __future__ import annotations

import numpy as np
import torch

from expertmesh.kernels.moe import cpu_kernel


def sort_slots(topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, K] ids (distinct per row; −1 = absent) and weights → both with each row in ascending id order."""
    order = topk_ids.argsort(dim=1, stable=True)
    return topk_ids.gather(1, order), topk_weights.gather(1, order)


def present_groups(ids: torch.Tensor, group_size: int, n_groups: int) -> torch.Tensor:
    """ids [T, K] (−1 = absent) → bool [T, G]: the groups each row has a slot in."""
    present = torch.zeros(ids.shape[0], n_groups, dtype=torch.bool, device=ids.device)
    valid = ids >= 0
    rows = torch.arange(ids.shape[0], device=ids.device)[:, None].expand_as(ids)
    present[rows[valid], ids[valid] // group_size] = True
    return present


def group_partials(
    outputs: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, group_size: int, n_groups: int
) -> torch.Tensor:
    """outputs [T, K, H] unweighted expert outputs, ids [T, K] in ascending order per row (−1 = absent, its output
    ignored), weights [T, K] → fp32 [R, H]: one P_g per (row, group present), rows in row-major (row, group) order
    (`present_groups(ids).nonzero()`). On CPU the C++ loop (kernels/moe/cpu_kernel.py) where it is built: the same
    operations, so the same bits as `group_partials_torch`."""
    if outputs.device.type == "cpu" and cpu_kernel.available():
        return cpu_kernel.group_partials(outputs, ids, weights, group_size)
    return group_partials_torch(outputs, ids, weights, group_size, n_groups)


def group_partials_torch(
    outputs: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, group_size: int, n_groups: int
) -> torch.Tensor:
    """`group_partials` in tensor ops: the definition."""
    T, K, H = outputs.shape
    present = present_groups(ids, group_size, n_groups)  # [T, G]
    index = torch.cumsum(present.flatten(), 0).view(T, n_groups) - 1  # (row, group) → output row
    acc = torch.zeros(int(present.sum()), H, dtype=torch.float32, device=outputs.device)
    w = weights.float()
    for k in range(K):  # ascending id within each row, so within each (row, group)
        valid = ids[:, k] >= 0
        if not bool(valid.any()):
            continue
        rows = valid.nonzero().squeeze(1)
        dst = index[rows, ids[rows, k] // group_size]  # distinct: one slot per row
        acc[dst] = acc[dst] + outputs[rows, k].float() * w[rows, k, None]
    return acc


def fold_groups(partials: torch.Tensor, present: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """partials fp32 [T, G, H] (P_g; anything where absent), present bool [T, G] → fp32 [T, H]: the groups
    present, ascending, each rounded through `dtype`."""
    tokens, groups = present.nonzero(as_tuple=True)
    return fold_rows(tokens, groups, partials[tokens, groups], partials.shape[0], dtype)


def fold_rows(tokens, groups, rows: torch.Tensor, n_tokens: int, dtype: torch.dtype) -> torch.Tensor:
    """`fold_groups` from the present P_g alone: rows [R, H] (fp32 or `dtype`) of the distinct (token, group) pairs
    tokens [R], groups [R] (numpy or torch integers) → fp32 [n_tokens, H]: per token, +0 then + round(P_g) for its
    groups ascending. On CPU the C++ loop (kernels/moe/cpu_kernel.py) where it is built, bf16 or fp32 rounding: the
    same adds, so the same bits as `fold_rows_torch`."""
    if (
        rows.device.type == "cpu"
        and rows.shape[0]
        and dtype in (torch.float32, torch.bfloat16)
        and cpu_kernel.available()
    ):

        def as_tensor(a):
            return a.cpu() if isinstance(a, torch.Tensor) else torch.from_numpy(np.asarray(a))

        return cpu_kernel.fold_rows(as_tensor(tokens), as_tensor(groups), rows, n_tokens, dtype)
    return fold_rows_torch(tokens, groups, rows, n_tokens, dtype)


def fold_rows_torch(tokens, groups, rows: torch.Tensor, n_tokens: int, dtype: torch.dtype) -> torch.Tensor:
    """`fold_rows` in tensor ops: a group's rows go in with one index_add_ (a token at most once per group: each of
    its rows is one rounded fp32 add), the groups ascending: the same steps as the fold. The grouping runs in
    numpy: a decode step has a handful of rows per layer, where torch's per-op cost would be most of the time."""
    acc = torch.zeros(n_tokens, rows.shape[-1], dtype=torch.float32, device=rows.device)
    if rows.shape[0] == 0:
        return acc
    tokens = tokens.cpu().numpy() if isinstance(tokens, torch.Tensor) else np.asarray(tokens)
    groups = groups.cpu().numpy() if isinstance(groups, torch.Tensor) else np.asarray(groups)
    rounded = rows.float() if dtype == torch.float32 else rows.to(dtype).float()
    order = np.argsort(groups, kind="stable")
    cuts = np.flatnonzero(np.diff(groups[order])) + 1
    for seg in np.split(order, cuts):
        if len(seg) == 1:
            acc[int(tokens[seg[0]])] += rounded[int(seg[0])]
        else:
            acc.index_add_(0, torch.from_numpy(tokens[seg]).to(rows.device), rounded[torch.from_numpy(seg)])
    return acc


def grouped_combine(
    outputs: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    n_experts: int,
    n_groups: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The single-process definition: outputs [T, K, H] of experts topk_ids [T, K] (distinct per row, any order;
    of `n_experts` in `n_groups` groups) with gate weights [T, K] → the routed sum fp32 [T, H]."""
    T, K, H = outputs.shape
    group_size = n_experts // n_groups
    order = topk_ids.argsort(dim=1, stable=True)
    ids, w = topk_ids.gather(1, order), topk_weights.gather(1, order)
    y = outputs.gather(1, order[..., None].expand(T, K, H))
    present = present_groups(ids, group_size, n_groups)
    partials = torch.zeros(T, n_groups, H, dtype=torch.float32, device=outputs.device)
    partials[present] = group_partials(y, ids, w, group_size, n_groups)
    return fold_groups(partials, present, dtype)
