"""The placement-plan schema: which (layer, expert) shards each GPU of each expert worker holds.

Shared by the planner (`expertmesh.placement.planner`, which makes plans), the operator (which stores a plan in
a ConfigMap and puts `plan_hash()` on pods as an annotation), expert workers (`experts_of(ordinal)`: what to
load) and the router (`replicas(layer, expert)`: where to send tokens).

Terms: a *logical* expert is a (layer, expert) pair of the model, `layer` being the model's layer index (one of
`moe_layers`, not a position in that list); a *physical* expert (a *shard*) is one copy of it on one GPU. An
expert worker is a pod, named by its StatefulSet ordinal 0..P-1, with `gpus_per_pod` GPUs indexed 0..G-1.

Invariants (checked on construction and on `from_json`, each error naming the field):
  - every logical expert has ≥ 1 shards, and no two shards of one logical expert share a worker (replicas sit on
    distinct pods, so losing a pod loses at most one copy of anything);
  - workers are listed by ordinal 0..P-1, each with exactly G GPUs listed by index;
  - a GPU's shards are sorted, within range, and fit its usable memory (`gpu_memory_bytes - reserve_bytes`);
    its `bytes` is `len(shards) * expert_bytes`.

JSON is compact (about 9 bytes per shard: the full-2.8t model's 56k shards fit a 1 MiB ConfigMap).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

SCHEMA_VERSION = 1
# the fields that define a placement; `plan_hash` covers these and nothing else (not figures or notes), so that
# re-planning to the same placement keeps the hash and does not restart pods
_HASHED_FIELDS = {
    "schema_version",
    "model_name",
    "moe_layers",
    "n_experts",
    "top_k",
    "expert_bytes",
    "cluster",
    "workers",
}


@dataclass(frozen=True)
class ClusterShape:
    """The expert workers: `pods` pods × `gpus_per_pod` GPUs of `gpu_memory_bytes` each, of which
    `reserve_bytes` per GPU are kept for activations and buffers (not for expert weights)."""

    pods: int
    gpus_per_pod: int
    gpu_memory_bytes: int
    reserve_bytes: int = 0

    def __post_init__(self) -> None:
        for name, low in (("pods", 1), ("gpus_per_pod", 1), ("gpu_memory_bytes", 1), ("reserve_bytes", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
                raise ValueError(f"ClusterShape.{name}: expected an integer >= {low}, found {value!r}")

    @property
    def n_gpus(self) -> int:
        return self.pods * self.gpus_per_pod

    @property
    def usable_bytes(self) -> int:
        """Bytes per GPU available for expert weights."""
        return max(0, self.gpu_memory_bytes - self.reserve_bytes)

    def slots_per_gpu(self, expert_bytes: int) -> int:
        """How many experts of `expert_bytes` one GPU holds."""
        return self.usable_bytes // expert_bytes


class _Derived:
    """Lookups derived from a plan's fields (built once on validation / first use). Compares equal to any other
    `_Derived`, so that plan equality is field equality."""

    __slots__ = ("shards", "table", "hash")

    def __init__(self, shards: np.ndarray):
        self.shards = shards  # [S, 4] int64: worker, gpu, layer position, expert
        self.table = None  # per (layer position, expert): [(worker, gpu), ...]
        self.hash = None

    def __eq__(self, other) -> bool:
        return isinstance(other, _Derived)

    __hash__ = None


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class GpuPlacement(_Frozen):
    gpu: int = Field(ge=0, description="index within its worker")
    shards: tuple[tuple[int, int], ...] = Field(description="(layer, expert) pairs, sorted")
    bytes: int = Field(ge=0, description="len(shards) * expert_bytes")


class WorkerPlacement(_Frozen):
    ordinal: int = Field(ge=0, description="StatefulSet ordinal of the expert pod")
    gpus: tuple[GpuPlacement, ...]

    @property
    def bytes(self) -> int:
        return sum(g.bytes for g in self.gpus)


class PlanFigures(_Frozen):
    """Summary figures of a plan, under the loads it was made with (`load_source`).

    Imbalance: the per-GPU load of a layer is the sum over the GPU's shards of that layer of
    `load[layer, expert] / replicas(layer, expert)` (tokens split evenly across replicas); a layer's imbalance is
    max over GPUs / mean over all P·G GPUs of that load (1.0 = perfect; 1.0 for a layer with no load).
    `imbalance` is the mean of that over MoE layers — every layer sees the same tokens and each is a barrier,
    so it estimates the MoE step time relative to perfect balance; `imbalance_worst_layer` is the max.
    """

    logical_experts: int = Field(ge=0)
    physical_experts: int = Field(ge=0)
    redundant_requested: int = Field(ge=0, description="redundant slots per layer asked for")
    redundant_per_layer: int = Field(ge=0, description="redundant slots per layer after the caps (see notes)")
    replicas: int = Field(ge=0, description="physical - logical: extra copies placed, all layers")
    shards_per_gpu_min: int = Field(ge=0)
    shards_per_gpu_mean: float = Field(ge=0)
    shards_per_gpu_max: int = Field(ge=0)
    bytes_per_gpu_min: int = Field(ge=0)
    bytes_per_gpu_mean: float = Field(ge=0)
    bytes_per_gpu_max: int = Field(ge=0)
    slots_per_gpu: int = Field(ge=0, description="experts one GPU can hold (usable memory / expert_bytes)")
    load_source: Literal["uniform", "given"]
    imbalance: float = Field(ge=1.0, description="mean over layers of max/mean per-GPU load")
    imbalance_worst_layer: float = Field(ge=1.0, description="max over layers of max/mean per-GPU load")
    moved_shards: int | None = Field(
        None, ge=0, description="shards not where the previous plan had them; None without a previous plan"
    )
    previous_hash: str | None = None


class PlacementPlan(_Frozen):
    """A placement of every routed expert of a model on a cluster of expert workers (see the module docstring)."""

    schema_version: Literal[1] = SCHEMA_VERSION
    model_name: str
    moe_layers: tuple[int, ...] = Field(min_length=1)
    n_experts: int = Field(gt=0, description="routed experts per MoE layer")
    top_k: int = Field(gt=0)
    expert_bytes: int = Field(gt=0, description="bytes of one expert's MXFP4 weights")
    cluster: ClusterShape
    workers: tuple[WorkerPlacement, ...]
    figures: PlanFigures
    notes: tuple[str, ...] = ()

    _derived: _Derived = PrivateAttr()

    @model_validator(mode="after")
    def _check(self) -> PlacementPlan:
        layers, E, c = self.moe_layers, self.n_experts, self.cluster
        if any(b <= a for a, b in zip(layers, layers[1:])) or layers[0] < 0:
            raise ValueError(f"moe_layers: expected strictly increasing layer indices >= 0, found {list(layers)}")
        if self.top_k > E:
            raise ValueError(f"top_k: {self.top_k} exceeds n_experts={E}")
        if len(self.workers) != c.pods:
            raise ValueError(f"workers: expected {c.pods} (cluster.pods), found {len(self.workers)}")
        position = {layer: i for i, layer in enumerate(layers)}
        capacity = c.usable_bytes
        rows = []
        for w, worker in enumerate(self.workers):
            if worker.ordinal != w:
                raise ValueError(f"workers[{w}].ordinal: expected {w}, found {worker.ordinal}")
            if len(worker.gpus) != c.gpus_per_pod:
                raise ValueError(
                    f"workers[{w}].gpus: expected {c.gpus_per_pod} (cluster.gpus_per_pod), found {len(worker.gpus)}"
                )
            for g, gpu in enumerate(worker.gpus):
                where = f"workers[{w}].gpus[{g}]"
                if gpu.gpu != g:
                    raise ValueError(f"{where}.gpu: expected {g}, found {gpu.gpu}")
                if gpu.bytes != len(gpu.shards) * self.expert_bytes:
                    raise ValueError(
                        f"{where}.bytes: expected {len(gpu.shards)} shards x {self.expert_bytes} = "
                        f"{len(gpu.shards) * self.expert_bytes}, found {gpu.bytes}"
                    )
                if gpu.bytes > capacity:
                    raise ValueError(
                        f"{where}.bytes: {gpu.bytes} exceed the GPU's usable memory {capacity} "
                        f"(cluster.gpu_memory_bytes - cluster.reserve_bytes)"
                    )
                if list(gpu.shards) != sorted(set(gpu.shards)):
                    raise ValueError(f"{where}.shards: expected sorted, distinct (layer, expert) pairs")
                for layer, expert in gpu.shards:
                    if layer not in position:
                        raise ValueError(f"{where}.shards: layer {layer} is not one of moe_layers")
                    if not 0 <= expert < E:
                        raise ValueError(f"{where}.shards: expert {expert} of layer {layer} is out of range [0, {E})")
                    rows.append((w, g, position[layer], expert))
        shards = np.array(rows, dtype=np.int64).reshape(-1, 4)
        # replicas on distinct workers: no (worker, layer, expert) twice
        key = (shards[:, 0] * len(layers) + shards[:, 2]) * E + shards[:, 3]
        uniq, counts = np.unique(key, return_counts=True)
        if (counts > 1).any():
            k = int(uniq[np.argmax(counts > 1)])
            w, rest = divmod(k, len(layers) * E)
            li, e = divmod(rest, E)
            raise ValueError(
                f"workers[{w}]: (layer {layers[li]}, expert {e}) is on more than one of its GPUs "
                f"(replicas of one expert must be on distinct workers)"
            )
        held = np.zeros(len(layers) * E, dtype=bool)
        held[shards[:, 2] * E + shards[:, 3]] = True
        if not held.all():
            missing = np.flatnonzero(~held)
            first = ", ".join(f"({layers[i // E]}, {i % E})" for i in missing[:5])
            raise ValueError(f"workers: {len(missing)} logical experts have no shard, e.g. (layer, expert) {first}")
        f = self.figures
        if f.logical_experts != len(layers) * E:
            raise ValueError(f"figures.logical_experts: expected {len(layers) * E}, found {f.logical_experts}")
        if f.physical_experts != len(shards):
            raise ValueError(
                f"figures.physical_experts: expected {len(shards)} (shards listed), found {f.physical_experts}"
            )
        self._derived = _Derived(shards)
        return self

    # ------------------------------------------------------------------ lookups
    @property
    def n_moe_layers(self) -> int:
        return len(self.moe_layers)

    def shard_array(self) -> np.ndarray:
        """[S, 4] int64 rows (worker, gpu, layer position in moe_layers, expert), in plan order. Read-only."""
        view = self._derived.shards.view()
        view.flags.writeable = False
        return view

    def _position(self, layer: int, expert: int) -> int:
        try:
            li = self.moe_layers.index(layer)
        except ValueError:
            raise ValueError(
                f"layer {layer} is not an MoE layer of {self.model_name} "
                f"(moe_layers {self.moe_layers[0]}..{self.moe_layers[-1]})"
            ) from None
        if not 0 <= expert < self.n_experts:
            raise ValueError(f"expert {expert} is out of range [0, {self.n_experts})")
        return li

    def placements(self, layer: int, expert: int) -> list[tuple[int, int]]:
        """(worker, gpu) of every shard of (layer, expert), sorted by worker."""
        li = self._position(layer, expert)
        d = self._derived
        if d.table is None:
            s = d.shards
            order = np.lexsort((s[:, 0], s[:, 3], s[:, 2]))
            s = s[order]
            starts = np.searchsorted(
                s[:, 2] * self.n_experts + s[:, 3], np.arange(self.n_moe_layers * self.n_experts + 1)
            )
            pairs = list(zip(s[:, 0].tolist(), s[:, 1].tolist()))
            d.table = [pairs[a:b] for a, b in zip(starts[:-1].tolist(), starts[1:].tolist())]
        return list(d.table[li * self.n_experts + expert])

    def replicas(self, layer: int, expert: int) -> list[int]:
        """Worker ordinals holding (layer, expert), ascending (≥ 1 of them, all distinct)."""
        return [w for w, _ in self.placements(layer, expert)]

    def replica_counts(self) -> np.ndarray:
        """[n_moe_layers, n_experts] int64: shards per logical expert."""
        s = self._derived.shards
        return np.bincount(s[:, 2] * self.n_experts + s[:, 3], minlength=self.n_moe_layers * self.n_experts).reshape(
            self.n_moe_layers, self.n_experts
        )

    def experts_of(self, worker: int) -> list[tuple[int, int]]:
        """(layer, expert) pairs worker `worker` holds, over all its GPUs, sorted."""
        if not 0 <= worker < len(self.workers):
            raise ValueError(f"worker {worker}: expected an ordinal in [0, {len(self.workers)})")
        return sorted(p for gpu in self.workers[worker].gpus for p in gpu.shards)

    def shards_of(self, worker: int, gpu: int) -> list[tuple[int, int]]:
        """(layer, expert) pairs on GPU `gpu` of worker `worker`, sorted."""
        if not 0 <= worker < len(self.workers):
            raise ValueError(f"worker {worker}: expected an ordinal in [0, {len(self.workers)})")
        if not 0 <= gpu < self.cluster.gpus_per_pod:
            raise ValueError(f"gpu {gpu}: expected an index in [0, {self.cluster.gpus_per_pod})")
        return list(self.workers[worker].gpus[gpu].shards)

    def model_copy(self, *, update=None, deep: bool = False) -> PlacementPlan:
        """A copy; with `update`, validated again (pydantic's model_copy would skip the invariant checks)."""
        if not update:
            return super().model_copy(deep=deep)
        data = {name: getattr(self, name) for name in type(self).model_fields}
        return type(self).model_validate({**data, **update})

    # ------------------------------------------------------------------ serialisation
    def to_json(self, indent: int | None = None) -> str:
        return self.model_dump_json(indent=indent)

    @classmethod
    def from_json(cls, text: str | bytes) -> PlacementPlan:
        """Parse and validate; a bad plan raises ValueError (pydantic's ValidationError) naming the field."""
        return cls.model_validate_json(text)

    def plan_hash(self) -> str:
        """First 16 hex digits of the sha256 of the canonical JSON (sorted keys, no spaces) of the placement
        fields — model identity, cluster and workers; not figures or notes."""
        d = self._derived
        if d.hash is None:
            data = self.model_dump(mode="json", include=_HASHED_FIELDS)
            canonical = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
            d.hash = hashlib.sha256(canonical.encode()).hexdigest()[:16]
        return d.hash
