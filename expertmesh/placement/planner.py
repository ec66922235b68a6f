"""Expert placement planning: pure functions from (model, cluster shape, loads, previous plan) to a PlacementPlan.

In the style of DeepSeek's EPLB, in two steps, both vectorised over layers:

1. Replication (`replica_counts`): each layer gets `E + r` physical slots. The r redundant ones go, one at a
   time, to the expert with the highest load per replica (`load / replicas`), at most one replica per pod.
   That greedy is the D'Hondt method, so it is done as one sort of the quotients `load[e] / k`.
2. Packing (`plan_placement`): every shard of a layer carries `load / replicas`. The shards of each layer,
   heaviest first, go to the least-loaded GPU (for that layer) that has a free memory slot and whose pod does
   not hold that expert yet (greedy LPT; each GPU's memory holds its shards of ALL layers). Ties go to the GPU
   with the most free slots, then to a per-layer rotated index, so that uniform loads give per-GPU shard counts
   within one of each other. All layers advance in lock-step (the j-th heaviest shard of every layer at once),
   which makes the loop ~E+r numpy steps instead of one Python step per shard.

With a previous plan every still-valid shard stays where it is (its pod and GPU still exist, its expert still
wants that many replicas, its GPU still has room); only the rest is placed, so removing a pod moves only
what that pod held (plus replicas that the new replica counts add). A full rebalance is a plan without
`previous` — the operator can compare `imbalance` of both and the `moved_shards` the fresh one costs.

Everything is deterministic (no randomness; every tie has a fixed rule: equal loads → lower expert first; equal
GPUs → most free slots, then the rotated index; one GPU wanted by several layers in one step → the lower layer
first, the others choose again): the same inputs give a bitwise-equal plan JSON.
"""

from __future__ import annotations

import numpy as np

from expertmesh.model.config import ModelConfig
from expertmesh.placement.plan import ClusterShape, GpuPlacement, PlacementPlan, PlanFigures, WorkerPlacement
from expertmesh.placement.sizing import expert_slot_bytes, expert_workspace_bytes

__all__ = [
    "ClusterShape",
    "PlanError",
    "LayerImbalance",
    "plan_placement",
    "replica_counts",
    "zipf_loads",
    "imbalance",
    "moved_shards",
    "pods_needed",
    "check_loads",
    "placed_layers",
]

GIB = 2**30


class PlanError(ValueError):
    """The cluster cannot hold the model (the message says how much memory is missing and how many pods fit)."""


class LayerImbalance:
    """Per-layer max/mean of per-GPU load (see `PlanFigures` for the definition): `per_layer` [n_moe_layers],
    `mean` (over layers) and `worst` (max over layers)."""

    __slots__ = ("per_layer", "mean", "worst")

    def __init__(self, per_layer: np.ndarray):
        self.per_layer = per_layer
        self.mean = float(per_layer.mean())
        self.worst = float(per_layer.max())

    def __repr__(self) -> str:
        return f"LayerImbalance(mean={self.mean:.4f}, worst={self.worst:.4f})"


# ----------------------------------------------------------------------------------------------- inputs
def placed_layers(cfg: ModelConfig, mtp: bool = False) -> list[int]:
    """The layers whose routed experts a plan places: the MoE layers, and with `mtp` also the MTP layers'
    (n_layers + j, the MTP drafter of `--speculative-method mtp`, whose MoE runs on the expert workers like any
    layer's). A deployment without MTP speculation places exactly the MoE layers."""
    if mtp and not cfg.n_mtp_layers:
        raise ValueError(f"mtp: the model {cfg.name!r} has no MTP layers (n_mtp_layers = 0)")
    return cfg.moe_layers + ([cfg.n_layers + j for j in range(cfg.n_mtp_layers)] if mtp else [])


def check_loads(cfg: ModelConfig, loads, mtp: bool = False) -> np.ndarray:
    """`loads` as float64 [placed layers, E] (finite, ≥ 0; `placed_layers`); None → uniform ones."""
    L, E = len(placed_layers(cfg, mtp)), cfg.moe.n_routed_experts
    if loads is None:
        return np.ones((L, E))
    arr = np.asarray(loads, dtype=np.float64)
    if arr.shape != (L, E):
        raise ValueError(
            f"loads: expected shape [{L}, {E}] (MoE layers, experts of {cfg.name}), found {list(arr.shape)}"
        )
    if not np.isfinite(arr).all() or (arr < 0).any():
        raise ValueError("loads: expected finite values >= 0 (tokens per layer and expert)")
    return arr


def zipf_loads(cfg: ModelConfig, s: float = 1.1, seed: int = 0) -> np.ndarray:
    """Skewed synthetic loads, float64 [n_moe_layers, E]: each layer a random permutation of the Zipf weights
    k^-s (k = 1..E), scaled to mean 1 per expert (the scale of the uniform default)."""
    if not s >= 0:
        raise ValueError(f"s: expected a Zipf exponent >= 0, found {s}")
    E = cfg.moe.n_routed_experts
    w = np.arange(1, E + 1, dtype=np.float64) ** -s
    w *= E / w.sum()
    rng = np.random.default_rng(seed)
    return rng.permuted(np.tile(w, (cfg.n_moe_layers, 1)), axis=1)


def pods_needed(cfg: ModelConfig, shape: ClusterShape, mtp: bool = False) -> int | None:
    """Fewest pods of this shape that hold every expert once (`mtp`: the MTP layers' too); None if one GPU holds
    no expert at all."""
    slots = shape.slots_per_gpu(cfg.expert_bytes_mxfp4) * shape.gpus_per_pod
    n = len(placed_layers(cfg, mtp)) * cfg.moe.n_routed_experts
    return None if slots == 0 else -(-n // slots)


def _check_fits(cfg: ModelConfig, shape: ClusterShape, mtp: bool) -> int:
    """Slots per GPU; PlanError when the cluster cannot hold one copy of every expert."""
    B, n = cfg.expert_bytes_mxfp4, len(placed_layers(cfg, mtp)) * cfg.moe.n_routed_experts
    slots = shape.slots_per_gpu(B)
    if slots * shape.n_gpus >= n:
        return slots
    need, have = n * B, slots * shape.n_gpus * B
    head = (
        f"cluster too small for {cfg.name}: its {n:,} routed experts need {need / GIB:,.1f} GiB, but "
        f"{shape.pods} pods x {shape.gpus_per_pod} GPUs x {shape.gpu_memory_bytes / GIB:g} GiB "
        f"(reserve {shape.reserve_bytes / GIB:g} GiB per GPU) hold {have / GIB:,.1f} GiB of experts: "
        f"{(need - have) / GIB:,.1f} GiB missing"
    )
    pods = pods_needed(cfg, shape, mtp)
    if pods is None:
        raise PlanError(
            f"{head}; one GPU's usable memory ({shape.usable_bytes / GIB:g} GiB) holds no expert "
            f"({B / 2**20:,.1f} MiB), so no number of pods of this shape fits"
        )
    raise PlanError(f"{head}; {pods} pods of this shape would fit the model")


# ----------------------------------------------------------------------------------------------- step 1
def replica_counts(loads: np.ndarray, redundant: int, max_replicas: int) -> np.ndarray:
    """Replicas per (layer, expert), int64 [L, E]: 1 each, plus `redundant` extra per layer given one at a time
    to the expert with the highest `load / replicas` (EPLB's greedy = D'Hondt: the top `redundant` quotients
    load[e]/k, k = 1..max_replicas-1, ties to the lower expert), never above `max_replicas` (the pod count).
    Experts with zero load get no extra replica, so a layer may get fewer than `redundant`."""
    L, E = loads.shape
    counts = np.ones((L, E), dtype=np.int64)
    K = min(max_replicas - 1, redundant)
    if K <= 0:
        return counts
    quotients = (loads[:, :, None] / np.arange(1, K + 1)).reshape(L, E * K)  # index e*K + k-1
    # stable sort of -q: equal quotients keep index order → lower expert first (and for one expert lower k)
    top = np.argsort(-quotients, axis=1, kind="stable")[:, :redundant]
    useful = np.take_along_axis(quotients, top, axis=1) > 0
    layer = np.broadcast_to(np.arange(L)[:, None], top.shape)
    np.add.at(counts, (layer[useful], top[useful] // K), 1)
    return counts


# ----------------------------------------------------------------------------------------------- step 2
def _previous_shards(
    previous: PlacementPlan, cfg: ModelConfig, layers: list[int], shape: ClusterShape, counts: np.ndarray, capacity: int
) -> tuple[np.ndarray, int, int]:
    """The previous plan's shards that stay: rows (gpu id, layer position, expert), how many were dropped
    because their pod or GPU is gone, and how many because their GPU has less room now. Per (layer, expert) at most counts[l, e] stay (lowest worker first); per GPU
    at most `capacity` (lowest (layer, expert) first)."""
    if (previous.model_name, list(previous.moe_layers), previous.n_experts, previous.expert_bytes) != (
        cfg.name,
        layers,
        cfg.moe.n_routed_experts,
        cfg.expert_bytes_mxfp4,
    ):
        raise ValueError(
            f"previous: plan is for model {previous.model_name!r} with {previous.n_experts} experts "
            f"x {len(previous.moe_layers)} MoE layers of {previous.expert_bytes} bytes, not "
            f"{cfg.name!r} ({cfg.moe.n_routed_experts} x {len(layers)}, "
            f"{cfg.expert_bytes_mxfp4} bytes)"
        )
    s = previous.shard_array()
    alive = (s[:, 0] < shape.pods) & (s[:, 1] < shape.gpus_per_pod)
    gone = int((~alive).sum())
    s = s[alive]
    E = cfg.moe.n_routed_experts
    s = s[np.lexsort((s[:, 1], s[:, 0], s[:, 3], s[:, 2]))]
    le = s[:, 2] * E + s[:, 3]
    occurrence = np.arange(len(s)) - np.searchsorted(le, le)
    s = s[occurrence < counts.ravel()[le]]
    gpu = s[:, 0] * shape.gpus_per_pod + s[:, 1]
    rows = np.stack([gpu, s[:, 2], s[:, 3]], axis=1)
    rows = rows[np.lexsort((rows[:, 2], rows[:, 1], rows[:, 0]))]
    occurrence = np.arange(len(rows)) - np.searchsorted(rows[:, 0], rows[:, 0])
    fits = occurrence < capacity
    return rows[fits], gone, int((~fits).sum())


def group_homes(loads: np.ndarray, group_size: int, pods: int, slots_per_pod: int) -> np.ndarray:
    """EPLB's hierarchical first step: a home pod for every combine group of every layer, int64 [L, E / S].

    The first copy of each expert goes to its group's home when the home has room, so a token's slots in one
    group are computed on one pod and come back pre-reduced (one row per (token, group), kernels/moe/combine.py).
    Groups, heaviest first (ties: lower group), go to the pod with the least load in that layer among those with
    room for the whole group; ties to the pod with the most free slots (over all layers: balances memory), then
    an index rotated per layer. All layers in lock-step. A group no pod has room for gets −1 (placed freely)."""
    L, E = loads.shape
    C = E // group_size
    group_load = loads.reshape(L, C, group_size).sum(2)  # [L, C]
    order = np.lexsort((np.tile(np.arange(C), (L, 1)), -group_load), axis=1) if C > 1 else np.zeros((L, 1), int)
    homes = np.full((L, C), -1, dtype=np.int64)
    load = np.zeros((L, pods))
    room = np.full(pods, slots_per_pod, dtype=np.int64)
    rotated = (np.arange(pods)[None, :] - (np.arange(L)[:, None] * pods) // L) % pods
    for j in range(C):  # the j-th heaviest group of every layer, lower layers first
        for l in range(L):
            c = order[l, j]
            ok = room >= group_size
            if not ok.any():
                continue
            lo = np.where(ok, load[l], np.inf)
            best = ok & (lo == lo.min())
            p = int(np.argmin(np.where(best, rotated[l] - room * pods, np.iinfo(np.int64).max)))
            homes[l, c] = p
            load[l, p] += group_load[l, c]
            room[p] -= group_size
    return homes


def _pack(
    loads: np.ndarray,
    counts: np.ndarray,
    shape: ClusterShape,
    capacity: int,
    kept: np.ndarray,
    homes: np.ndarray | None = None,
    group_size: int = 1,
) -> tuple[np.ndarray, int]:
    """Place every replica (greedy LPT per layer, all layers in lock-step). `kept` rows (gpu id, layer, expert)
    are already placed. `homes` [L, E / group_size]: the pod each group's first copies go to when it has a free
    slot (−1 or None: anywhere). Returns all placed rows (gpu id, layer, expert) and how many replicas were dropped (no
    GPU with a free slot on a pod that does not hold that expert yet)."""
    L, E = counts.shape
    N, P, G = shape.n_gpus, shape.pods, shape.gpus_per_pod
    pod_of = np.arange(N) // G
    # items: the replicas of each (l, e), weight load/count, sorted per layer by (weight desc, expert asc)
    flat = counts.ravel()
    item_l = np.repeat(np.repeat(np.arange(L), E), flat)
    item_e = np.repeat(np.tile(np.arange(E), L), flat)
    item_w = loads[item_l, item_e] / counts[item_l, item_e]
    order = np.lexsort((item_e, -item_w, item_l))
    item_l, item_e, item_w = item_l[order], item_e[order], item_w[order]
    sizes = counts.sum(axis=1)
    rank = np.arange(len(item_l)) - np.concatenate([[0], np.cumsum(sizes)[:-1]])[item_l]
    # the replicas of one (l, e) are consecutive: its first n_kept are the kept ones
    n_kept = np.zeros((L, E), dtype=np.int64)
    np.add.at(n_kept, (kept[:, 1], kept[:, 2]), 1)
    le = item_l * E + item_e
    first = np.concatenate([[True], le[1:] != le[:-1]])
    group_start = np.maximum.accumulate(np.where(first, np.arange(len(le)), 0))
    todo = (np.arange(len(le)) - group_start) >= n_kept.ravel()[le]
    first = (np.arange(len(le)) - group_start) == 0  # an expert's first copy (not a replica)
    home = np.full(len(le), -1, dtype=np.int64)
    if homes is not None:
        home = np.where(first, homes[item_l, item_e // group_size], -1)

    S = int(sizes.max())
    e_at = np.zeros((L, S), dtype=np.int64)
    w_at = np.zeros((L, S))
    todo_at = np.zeros((L, S), dtype=bool)
    home_at = np.full((L, S), -1, dtype=np.int64)
    e_at[item_l, rank], w_at[item_l, rank], todo_at[item_l, rank] = item_e, item_w, todo
    home_at[item_l, rank] = home

    load = np.zeros((L, N))
    room = np.full(N, capacity, dtype=np.int64)
    pod_has = np.zeros((L, E, P), dtype=bool)
    np.add.at(load, (kept[:, 1], kept[:, 0]), loads[kept[:, 1], kept[:, 2]] / counts[kept[:, 1], kept[:, 2]])
    np.subtract.at(room, kept[:, 0], 1)
    pod_has[kept[:, 1], kept[:, 2], pod_of[kept[:, 0]]] = True
    # tie-break among equally loaded GPUs: most free slots (balances bytes per GPU), then an index rotated
    # per layer (layer l starts at GPU l·N/L) so that the layers' first picks spread over the GPUs
    rotated = (np.arange(N)[None, :] - (np.arange(L)[:, None] * N) // L) % N
    worst = np.iinfo(np.int64).max

    placed_l, placed_g, placed_e = [kept[:, 1]], [kept[:, 0]], [kept[:, 2]]
    dropped = 0
    for j in range(S):  # the j-th heaviest shard of every layer at once
        ls = np.flatnonzero(todo_at[:, j])
        while len(ls):
            e = e_at[ls, j]
            ok_gpu = (room > 0)[None, :] & ~pod_has[ls, e][:, pod_of]
            h = home_at[ls, j]
            at_home = ok_gpu & (pod_of[None, :] == h[:, None])
            use_home = (h >= 0) & at_home.any(axis=1)
            ok_gpu = np.where(use_home[:, None], at_home, ok_gpu)
            lo = np.where(ok_gpu, load[ls], np.inf)
            best = ok_gpu & (lo == lo.min(axis=1, keepdims=True))
            g = np.argmin(np.where(best, rotated[ls] - room[None, :] * N, worst), axis=1)
            ok = ok_gpu[np.arange(len(ls)), g]
            if not ok.all():
                # only an extra replica can find no GPU: a first copy has no pod conflict, and the free slots
                # number at least the shards still to place
                if not pod_has[ls[~ok], e[~ok]].any(axis=1).all():  # pragma: no cover - a planner bug
                    raise AssertionError("planner: a first copy found no GPU with a free slot")
                dropped += int((~ok).sum())
                ls, e, g = ls[ok], e[ok], g[ok]
            # layers decide together: each GPU takes one of this step's shards per round (the lowest layer);
            # the others choose again with its free slots updated, so ties spread instead of piling up
            by_gpu = np.lexsort((ls, g))
            ls, e, g = ls[by_gpu], e[by_gpu], g[by_gpu]
            take = np.concatenate([[True], g[1:] != g[:-1]]) if len(g) else np.zeros(0, dtype=bool)
            lt, et, gt = ls[take], e[take], g[take]
            load[lt, gt] += w_at[lt, j]
            room[gt] -= 1
            pod_has[lt, et, pod_of[gt]] = True
            placed_l.append(lt), placed_g.append(gt), placed_e.append(et)
            ls = np.sort(ls[~take])
    rows = np.stack([np.concatenate(placed_g), np.concatenate(placed_l), np.concatenate(placed_e)], axis=1)
    return rows, dropped


def _layer_imbalance(rows: np.ndarray, loads: np.ndarray, n_gpus: int) -> np.ndarray:
    """rows (gpu id, layer position, expert) → per-layer max/mean per-GPU load (1.0 for an unloaded layer)."""
    L, E = loads.shape
    counts = np.bincount(rows[:, 1] * E + rows[:, 2], minlength=L * E).reshape(L, E)
    w = loads[rows[:, 1], rows[:, 2]] / counts[rows[:, 1], rows[:, 2]]
    per_gpu = np.bincount(rows[:, 1] * n_gpus + rows[:, 0], weights=w, minlength=L * n_gpus).reshape(L, n_gpus)
    mean = per_gpu.mean(axis=1)
    out = np.ones(L)
    np.divide(per_gpu.max(axis=1), mean, out=out, where=mean > 0)
    return np.maximum(out, 1.0)  # max ≥ mean exactly; guards the last ulp


def imbalance(plan: PlacementPlan, loads) -> LayerImbalance:
    """Expected per-layer imbalance of `plan` under `loads` [n_moe_layers, n_experts] (see `PlanFigures`)."""
    L, E = plan.n_moe_layers, plan.n_experts
    arr = np.asarray(loads, dtype=np.float64)
    if arr.shape != (L, E):
        raise ValueError(f"loads: expected shape [{L}, {E}] (the plan's MoE layers, experts), found {list(arr.shape)}")
    if not np.isfinite(arr).all() or (arr < 0).any():
        raise ValueError("loads: expected finite values >= 0 (tokens per layer and expert)")
    s = plan.shard_array()
    rows = np.stack([s[:, 0] * plan.cluster.gpus_per_pod + s[:, 1], s[:, 2], s[:, 3]], axis=1)
    return LayerImbalance(_layer_imbalance(rows, arr, plan.cluster.n_gpus))


def moved_shards(previous: PlacementPlan, plan: PlacementPlan) -> int:
    """Shards of `plan` that `previous` did not have on the same (worker, gpu): what has to be loaded."""
    s = plan.shard_array()
    G = plan.cluster.gpus_per_pod
    rows = np.stack([s[:, 0] * G + s[:, 1], s[:, 2], s[:, 3]], axis=1)
    return _moved(previous, rows, G, plan.n_moe_layers, plan.n_experts)


def _moved(previous: PlacementPlan, rows: np.ndarray, G: int, L: int, E: int) -> int:
    """rows (gpu id = worker·G + gpu, layer position, expert) not in `previous` on the same (worker, gpu)."""
    a = previous.shard_array()
    Gm = max(G, previous.cluster.gpus_per_pod)
    old = ((a[:, 0] * Gm + a[:, 1]) * L + a[:, 2]) * E + a[:, 3]
    new = (((rows[:, 0] // G) * Gm + rows[:, 0] % G) * L + rows[:, 1]) * E + rows[:, 2]
    return int((~np.isin(new, old)).sum())


# ----------------------------------------------------------------------------------------------- the planner
def plan_placement(
    cfg: ModelConfig,
    shape: ClusterShape,
    redundant_slots: int = 0,
    loads=None,
    previous: PlacementPlan | None = None,
    group_aware: bool = False,
    min_replicas: int = 1,
    mtp: bool = False,
) -> PlacementPlan:
    """Place every routed expert of `cfg` on `shape`'s GPUs.

    cfg: the model (its MoE layers, E experts per layer, MXFP4 bytes per expert).
    shape: expert pods × GPUs per pod, memory per GPU and the per-GPU reserve (not for experts).
    redundant_slots: extra physical slots per layer (all pods together), given to the hottest experts. Reduced,
        with a note in `plan.notes`, to at most E·(pods-1) (one replica per pod) and to what memory holds.
    loads: tokens per (MoE layer position, expert), [placed layers, E]; None = uniform.
    mtp: place the MTP layers' experts too (`placed_layers`: speculative decoding with the MTP drafter).
    previous: the plan in force; its still-valid shards stay put (see the module docstring) and
        `figures.moved_shards` counts the shards placed anywhere new.
    min_replicas: every expert on at least this many pods (fault tolerance: losing a pod fails no request);
        PlanError when there are fewer pods or not the memory for it.
    group_aware: first copies of each combine group (moe.combine_group_size experts) on one pod (`group_homes`),
        so expert workers return one pre-reduced row per (token, group): less combine traffic, but a pod's load
        per layer is then its groups' load — with skewed loads the per-layer imbalance rises (token-bound
        prefill feels it; weight-read-bound decode, which reads every held expert anyway, hardly does).

    Raises PlanError when the cluster cannot hold one copy of every expert; ValueError for bad arguments.
    """
    if not isinstance(shape, ClusterShape):
        raise ValueError(f"shape: expected a ClusterShape, found {type(shape).__name__}")
    if isinstance(redundant_slots, bool) or not isinstance(redundant_slots, (int, np.integer)) or redundant_slots < 0:
        raise ValueError(f"redundant_slots: expected an integer >= 0, found {redundant_slots!r}")
    if previous is not None and not isinstance(previous, PlacementPlan):
        raise ValueError(f"previous: expected a PlacementPlan, found {type(previous).__name__}")
    arr = check_loads(cfg, loads, mtp)
    layers = placed_layers(cfg, mtp)
    L, E, B = len(layers), cfg.moe.n_routed_experts, expert_slot_bytes(cfg)  # what a worker allocates
    P, G, N = shape.pods, shape.gpus_per_pod, shape.n_gpus
    capacity = _check_fits(cfg, shape, mtp)
    notes: list[str] = []

    r = int(redundant_slots)
    if r > E * (P - 1):
        if P == 1:
            notes.append(
                f"redundant_slots reduced from {r} to 0 per layer: with 1 pod, replicas cannot go to distinct pods"
            )
        else:
            notes.append(
                f"redundant_slots reduced from {r} to {E * (P - 1)} per layer: at most one replica of an "
                f"expert per pod ({P} pods x {E} experts)"
            )
        r = E * (P - 1)
    room = capacity * N // L - E  # ≥ 0 since the model fits
    if r > room:
        notes.append(
            f"redundant_slots reduced from {r} to {room} per layer: {N} GPUs x {capacity} slots hold "
            f"{capacity * N} experts, {L} layers x {E} experts leave room for {room} more per layer"
        )
        r = room
    counts = replica_counts(arr, r, P)
    if min_replicas > 1:
        if min_replicas > P:
            raise PlanError(
                f"min_replicas={min_replicas}: every expert on {min_replicas} pods needs at least "
                f"{min_replicas} pods, the cluster has {P}"
            )
        counts = np.maximum(counts, min_replicas)
        if int(counts.sum()) > capacity * N:
            raise PlanError(
                f"min_replicas={min_replicas}: {int(counts.sum()):,} expert copies do not fit "
                f"{N} GPUs x {capacity} slots ({capacity * N:,}); add pods or memory"
            )
    short = r * L - int(counts.sum() - L * E)
    if short:
        notes.append(f"{short} redundant slots left unused: experts with zero load get no replicas")

    kept = np.zeros((0, 3), dtype=np.int64)
    if previous is not None:
        kept, gone, evicted = _previous_shards(previous, cfg, layers, shape, counts, capacity)
        if gone:
            notes.append(f"{gone} shards of the previous plan were on pods or GPUs that no longer exist")
        if evicted:
            notes.append(f"{evicted} shards of the previous plan no longer fit their GPU ({capacity} slots now)")
    S = E // cfg.moe.combine_groups
    homes = group_homes(arr, S, P, capacity * G) if group_aware and previous is None else None
    rows, dropped = _pack(arr, counts, shape, capacity, kept, homes, S)
    if min_replicas > 1 and dropped:
        held = np.bincount(rows[:, 1] * E + rows[:, 2], minlength=L * E)
        if int(held.min()) < min_replicas:
            raise PlanError(
                f"min_replicas={min_replicas}: the GPUs' free slots left some expert on fewer pods; add pods or memory"
            )
    if dropped:
        notes.append(f"{dropped} redundant replicas dropped: no GPU with a free slot on a pod without that expert")

    # ---- the plan: per GPU, shards sorted by (layer, expert)
    rows = rows[np.lexsort((rows[:, 2], rows[:, 1], rows[:, 0]))]
    bounds = np.searchsorted(rows[:, 0], np.arange(N + 1))
    layer_ids = np.asarray(layers, dtype=np.int64)
    pairs = list(zip(layer_ids[rows[:, 1]].tolist(), rows[:, 2].tolist()))
    per_gpu = np.diff(bounds)
    workspace = expert_workspace_bytes(cfg, "cuda", layers=L)  # the same figure the workers' --dry-run reports
    if int(per_gpu.max()) * B + workspace > shape.gpu_memory_bytes:
        notes.append(
            f"the fullest GPU's {int(per_gpu.max())} experts ({int(per_gpu.max()) * B / GIB:.3g} GiB) plus an "
            f"expert worker's per-device workspace ({workspace / GIB:.3g} GiB, "
            f"expertmesh.placement.sizing.expert_workspace_bytes) exceed the GPU's memory: raise the reserve"
        )
    workers = tuple(
        WorkerPlacement(
            ordinal=p,
            gpus=tuple(
                GpuPlacement(
                    gpu=g,
                    shards=tuple(pairs[bounds[p * G + g] : bounds[p * G + g + 1]]),
                    bytes=int(per_gpu[p * G + g]) * B,
                )
                for g in range(G)
            ),
        )
        for p in range(P)
    )
    layer_imb = _layer_imbalance(rows, arr, N)
    figures = PlanFigures(
        logical_experts=L * E,
        physical_experts=len(rows),
        redundant_requested=int(redundant_slots),
        redundant_per_layer=r,
        replicas=len(rows) - L * E,
        shards_per_gpu_min=int(per_gpu.min()),
        shards_per_gpu_mean=float(per_gpu.mean()),
        shards_per_gpu_max=int(per_gpu.max()),
        bytes_per_gpu_min=int(per_gpu.min()) * B,
        bytes_per_gpu_mean=float(per_gpu.mean()) * B,
        bytes_per_gpu_max=int(per_gpu.max()) * B,
        slots_per_gpu=capacity,
        load_source="uniform" if loads is None else "given",
        imbalance=float(layer_imb.mean()),
        imbalance_worst_layer=float(layer_imb.max()),
        moved_shards=None if previous is None else _moved(previous, rows, G, L, E),
        previous_hash=None if previous is None else previous.plan_hash(),
    )
    return PlacementPlan(
        model_name=cfg.name,
        moe_layers=tuple(layers),
        n_experts=E,
        top_k=cfg.moe.top_k,
        expert_bytes=B,
        cluster=shape,
        workers=workers,
        figures=figures,
        notes=tuple(notes),
    )
