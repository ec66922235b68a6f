"""The expert role: holds the (layer, expert) shards its placement assigns and runs them for a batch.

One call per layer per scheduler step carries every (token, expert) pair routed to this worker: the
tokens' hidden states once each, and for each token the slots (top-k ranks) it wants computed here.
"""
from __future__ import annotations

import os
import threading
import time
from collections import defaultdict

import torch

from expertmesh.checkpoint import Checkpoint


class ExpertRequestError(ValueError):
    """Bad request (→ INVALID_ARGUMENT), naming the field."""


class UnknownExpert(KeyError):
    """(layer, expert) not held here (→ NOT_FOUND)."""

    def __str__(self) -> str:
        return str(self.args[0])


class ExpertWorker:
    def __init__(self, checkpoint: Checkpoint | str, assignment: list[tuple[int, int]], name: str = "expert-0"):
        """`assignment`: the (layer, expert) pairs this worker holds (from the placement plan)."""
        self.ckpt = checkpoint if isinstance(checkpoint, Checkpoint) else Checkpoint(checkpoint)
        self.cfg = self.ckpt.cfg
        self.name = name
        by_layer: dict[int, list[int]] = defaultdict(list)
        for layer, expert in assignment:
            by_layer[int(layer)].append(int(expert))
        self.experts = {layer: self.ckpt.load_experts(layer, sorted(set(ids))) for layer, ids in by_layer.items()}
        self.assignment = sorted((l, e) for l, ids in by_layer.items() for e in set(ids))
        self.lock = threading.Lock()
        self.calls = 0
        self.tokens_computed = 0
        # fault injection for tests (a slow worker): every run() sleeps this long first
        self.fault_delay_s = float(os.environ.get("EXPERTMESH_FAULT_DELAY_S", "0") or 0)

    def holds(self, layer: int, expert: int) -> bool:
        mod = self.experts.get(layer)
        return mod is not None and bool(mod.global_to_local[expert] >= 0)

    @torch.no_grad()
    def run(self, layer: int, hidden: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        """hidden [n, H]; expert_ids [n, K] global ids, −1 for slots computed elsewhere
        → outputs [P, H] for the P slots ≥ 0, in row-major (token, slot) order."""
        if self.fault_delay_s:
            time.sleep(self.fault_delay_s)
        h = self.cfg.hidden_size
        if hidden.dim() != 2 or hidden.shape[1] != h:
            raise ExpertRequestError(f"hidden: expected shape [n, {h}], found {list(hidden.shape)}")
        if expert_ids.dim() != 2 or expert_ids.shape[0] != hidden.shape[0]:
            raise ExpertRequestError(f"expert_ids: expected shape [{hidden.shape[0]}, K], found {list(expert_ids.shape)}")
        mod = self.experts.get(layer)
        if mod is None:
            raise UnknownExpert(f"layer {layer}: {self.name} holds no experts of this layer")
        valid = expert_ids >= 0
        ids = expert_ids.clamp(min=0)
        if bool((ids >= self.cfg.moe.n_routed_experts).any()):
            bad = int(ids.max())
            raise ExpertRequestError(f"expert_ids: {bad} outside [0, {self.cfg.moe.n_routed_experts})")
        local = torch.where(valid, mod.global_to_local[ids], torch.full_like(ids, -1))
        missing = valid & (local < 0)
        if bool(missing.any()):
            e = int(expert_ids[missing][0])
            raise UnknownExpert(f"expert ({layer}, {e}) is not held by {self.name}")
        with self.lock:
            self.calls += 1
            self.tokens_computed += int(valid.sum())
            out = mod(hidden.float(), torch.where(valid, expert_ids, torch.full_like(expert_ids, -1)))  # [n, K, H]
        return out[valid]
