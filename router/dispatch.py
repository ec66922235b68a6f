"""The expert dispatcher: one batched call per expert worker per MoE layer per step.

For each (token, top-k slot) the dispatcher picks a replica of the chosen expert among the live workers that
hold it (least outstanding (token, expert) pairs in this call first, lowest ordinal on ties), sends every
worker its tokens concurrently, and scatters the outputs back into [N, K, H]. The combine with the gate
weights happens in exactly one place (model.combine_moe's order) whatever worker computed each slot.
"""
from __future__ import annotations

import logging
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

import numpy as np
import torch


log = logging.getLogger("expertmesh.router")


class ExpertClient(Protocol):
    name: str

    def run(self, layer: int, hidden: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor: ...


class ExpertsUnavailable(RuntimeError):
    """Some chosen expert has no live replica (→ UNAVAILABLE / HTTP 503, naming the experts)."""


class Placement(Protocol):
    def replicas(self, layer: int, expert: int) -> list[int]: ...


class Dispatcher:
    def __init__(self, workers: list[ExpertClient], placement: Placement, n_experts: int, moe_layers: list[int],
                 pool: ThreadPoolExecutor | None = None):
        self.workers = workers
        self.placement = placement
        self.down: set[int] = set()
        self.moe_layers = moe_layers
        self.n_experts = n_experts
        self.pool = pool or ThreadPoolExecutor(max_workers=max(4, len(workers)), thread_name_prefix="dispatch")
        # replica table: layer → [E] list of worker ordinals, precomputed once per plan
        self._replicas = {l: [list(placement.replicas(l, e)) for e in range(n_experts)] for l in moe_layers}
        self.lock = threading.Lock()
        self.load = {l: np.zeros(n_experts, dtype=np.int64) for l in moe_layers}  # tokens per (layer, expert)
        self.calls = Counter()  # worker ordinal → calls
        self.last_error: dict[int, str] = {}

    def mark_down(self, worker: int) -> None:
        if worker not in self.down:
            log.warning("expert worker %d marked down", worker)
        self.down.add(worker)

    def mark_up(self, worker: int) -> None:
        self.down.discard(worker)

    def assign(self, layer: int, topk_ids: torch.Tensor, exclude: set[int] | frozenset = frozenset()
               ) -> tuple[np.ndarray, dict[int, set[int]]]:
        """[N, K] expert ids → ([N, K] worker ordinals, −1 where no live replica; {row: missing experts})."""
        ids = topk_ids.cpu().numpy()
        owner = np.empty_like(ids)
        outstanding: Counter = Counter()
        missing: dict[int, set[int]] = {}
        replicas = self._replicas[layer]
        down = self.down | set(exclude)
        for t in range(ids.shape[0]):
            for k in range(ids.shape[1]):
                live = [w for w in replicas[ids[t, k]] if w not in down]
                if not live:
                    missing.setdefault(t, set()).add(int(ids[t, k]))
                    owner[t, k] = -1
                    continue
                w = min(live, key=lambda w: (outstanding[w], w))
                outstanding[w] += 1
                owner[t, k] = w
        return owner, missing

    def run(self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor, *, retries: int = 2
            ) -> tuple[torch.Tensor, dict[int, str]]:
        """hidden [N, H], topk_ids [N, K] → (routed outputs [N, K, H] fp32, {row: why it failed}).

        A worker that fails (unreachable, deadline) is marked down and its slots go to other replicas in the
        same step — each (token, expert) output is batch-invariant, so the result is the same bits. Rows whose
        expert has no live replica are returned as failed (their outputs stay 0); the other rows are unaffected."""
        n, k = topk_ids.shape
        out = torch.zeros(n, k, hidden.shape[1], dtype=torch.float32)
        todo = torch.ones(n, k, dtype=torch.bool)         # slots still to compute
        failed: dict[int, str] = {}
        for attempt in range(retries + 1):
            owner, missing = self.assign(layer, topk_ids)
            for row, experts in missing.items():
                failed.setdefault(row, f"experts without a live replica in layer {layer}: {sorted(experts)}")
            owner = np.where(todo.numpy(), owner, -1)
            jobs = []
            for w in sorted(set(owner.ravel().tolist()) - {-1}):
                mask = torch.from_numpy(owner == w)                     # [N, K]
                rows = mask.any(dim=1).nonzero().squeeze(1)
                ids_w = torch.where(mask[rows], topk_ids[rows], torch.full_like(topk_ids[rows], -1))
                jobs.append((w, rows, mask, self.pool.submit(self.workers[w].run, layer, hidden[rows], ids_w)))
            lost = False
            for w, rows, mask, fut in jobs:
                try:
                    result = fut.result()
                except ConnectionError as e:       # unreachable / deadline: fail over to replicas
                    self.mark_down(w)
                    self.last_error[w] = str(e)
                    lost = True
                    continue
                self.calls[w] += 1
                block = out[rows]
                block[mask[rows]] = result.float()
                out[rows] = block
                todo &= ~mask
            if not lost:
                break
        for row in todo.any(dim=1).nonzero().squeeze(1).tolist():
            if row not in failed:
                failed[row] = f"expert workers failed for layer {layer}: " + "; ".join(
                    self.last_error.get(w, "") for w in sorted(self.down))
        with self.lock:
            np.add.at(self.load[layer], topk_ids.cpu().numpy().ravel(), 1)
        return out, failed

    def load_stats(self) -> dict[int, list[int]]:
        with self.lock:
            return {l: v.tolist() for l, v in self.load.items()}
