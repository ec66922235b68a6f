"""Which expert workers hold each routed expert: the table the router pushes to the attention workers (from the
placement plan, at start and at each live re-plan) and their expert exchange dispatches by."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ReplicaTable:
    """Which expert workers hold each (MoE layer, expert): `table` int64 [L, E, R] worker ordinals per MoE layer
    position (the order of `moe_layers`), −1 padding."""

    moe_layers: tuple[int, ...]
    table: np.ndarray

    @classmethod
    def from_placement(cls, placement, moe_layers, n_experts: int) -> ReplicaTable:
        rows = [[sorted(placement.replicas(l, e)) for e in range(n_experts)] for l in moe_layers]
        width = max(1, max(len(r) for layer in rows for r in layer))
        table = np.full((len(rows), n_experts, width), -1, dtype=np.int64)
        for i, layer in enumerate(rows):
            for e, r in enumerate(layer):
                table[i, e, : len(r)] = r
        return cls(tuple(int(l) for l in moe_layers), table)

    def holds(self, layer: int, n_workers: int) -> np.ndarray:
        """bool [W, E]: worker w holds expert e of `layer`."""
        t = self.table[self.moe_layers.index(layer)]  # [E, R]
        out = np.zeros((n_workers, t.shape[0]), dtype=bool)
        e, r = np.nonzero(t >= 0)
        out[t[e, r], e] = True
        return out
