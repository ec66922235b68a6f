"""The expert role: holds the (layer, expert) shards its placement assigns and runs them for a batch.

One call per MoE layer per step from each attention worker carries every (token, expert) pair it routes here:
the tokens' hidden states once each, their experts here and gate weights. The answer is pre-reduced: one row per
(token, expert group) — the group's weighted partial sum in the canonical order of kernels/moe/combine.py — so
a token costs ≤ topk_group rows on the way back instead of top_k.
"""

from __future__ import annotations

import os
import threading
import time
from collections import defaultdict

import numpy as np
import torch

from expertmesh.checkpoint.loader import Checkpoint
from expertmesh.kernels import cpu_warmup
from expertmesh.kernels.moe.combine import group_partials
from expertmesh.model import memory
from expertmesh.model.config import ModelConfig
from expertmesh.model.moe import RoutedExperts
from expertmesh.placement import sizing
from expertmesh.placement.planner import placed_layers
from expertmesh.wire.worker_api import ExpertRequestError, UnknownExpert
from expertmesh.worker.base import WorkerBase


class ExpertWorker(WorkerBase):
    def __init__(
        self,
        checkpoint: Checkpoint | str | ModelConfig,
        assignment: list[tuple[int, int]],
        name: str = "expert-0",
        *,
        device: str = "cpu",
        gpu_of: dict[tuple[int, int], int] | None = None,
        step_tokens: int | None = None,
        max_call_bytes: int = 256 * 2**20,
        decode_threads: int | None = None,
    ):
        """`assignment`: the (layer, expert) pairs this worker holds (from the placement plan). `gpu_of`: the
        plan's GPU index of each pair (default 0): on cuda GPU g's experts live on cuda:g (one process per pod,
        one device rank per GPU — see expertmesh/model/memory.py), on cpu all on the one device, on meta nowhere
        (`checkpoint` may then be a ModelConfig: nothing is read). Experts stay packed in MXFP4 (uint8 blocks +
        E8M0 scales) and are multiplied from the packed form; calls are cut into pieces of `step_tokens` tokens
        so the workspace stays within sizing.expert_workspace_bytes. `decode_threads`: torch threads for calls of
        decode size, which run while the attention workers compute their shared experts (worker/threads.py: for
        attention workers on the same cores; None: all)."""
        super().__init__(checkpoint, name=name, device=device, decode_threads=decode_threads, error=ExpertRequestError)
        self.step_tokens = step_tokens or sizing.STEP_TOKENS
        self.max_call_bytes = max_call_bytes  # a call's output workspace bound: oversized calls are refused
        # layer → [(device label, RoutedExperts, {global id: local index} on the host)]; replaced as a whole
        # (set_shards), so a call reads one consistent table
        self.experts: dict[int, list] = {}
        self.assignment: list[tuple[int, int]] = []
        self.lock = threading.Lock()
        self._replace_lock = threading.Lock()  # one set_shards at a time
        self.shards_loaded = self.shards_dropped = 0  # by set_shards since start (live re-plans)
        self._place(assignment, gpu_of, keep=False)
        if self.device_kind == "cpu":
            cpu_warmup.load(cpu_warmup.EXPERT)  # before serving: not on the first request
        self.calls = 0
        self.tokens_computed = 0
        # fault injection for tests (a slow worker): every run() sleeps this long first
        self.fault_delay_s = float(os.environ.get("EXPERTMESH_FAULT_DELAY_S", "0") or 0)

    def _load(self, layer: int, gpu: int, ids: list[int]):
        """One (device label, RoutedExperts, local index) entry holding `ids` of `layer` on GPU `gpu`."""
        dev = memory.torch_device(self.device_kind, gpu)
        if self.ckpt is None:
            with torch.device("meta"):
                mod = RoutedExperts(self.cfg, expert_ids=ids)
        else:
            mod = self.ckpt.load_experts(layer, ids).to(dev)
        return sizing.device_label(self.device_kind, gpu), mod, {e: i for i, e in enumerate(ids)}

    def _place(self, assignment, gpu_of, keep: bool) -> tuple[int, int]:
        """Hold `assignment` ((layer, expert) pairs; `gpu_of` the plan's GPU of each): load what is not held;
        `keep` leaves every held shard too, else a held entry with shards outside `assignment` is replaced by one
        without them. The new table is swapped in whole. → (shards loaded, shards dropped)."""
        # the MoE layers, and the MTP layers' where a plan places them (--speculative-method mtp)
        n_experts, layers = self.cfg.moe.n_routed_experts, set(placed_layers(self.cfg, bool(self.cfg.n_mtp_layers)))
        by_shard: dict[tuple[int, int], set[int]] = defaultdict(set)  # (layer, gpu) → experts
        for layer, expert in assignment:
            layer, expert = int(layer), int(expert)
            if layer not in layers or not 0 <= expert < n_experts:
                raise ExpertRequestError(
                    f"experts: ({layer}, {expert}) is not a routed expert of {self.cfg.name} "
                    f"(MoE layers {self.cfg.moe_layers}, experts 0..{n_experts - 1})"
                )
            gpu = 0 if gpu_of is None or self.device_kind == "cpu" else int(gpu_of.get((layer, expert), 0))
            by_shard[(layer, gpu)].add(expert)
        wanted = {(l, e) for (l, _), ids in by_shard.items() for e in ids}
        old = self.experts
        table: dict[int, list] = defaultdict(list)
        dropped = 0
        for layer, entries in old.items():
            for label, mod, local in entries:
                kept = sorted(e for e in local if keep or (layer, e) in wanted)
                dropped += len(local) - len(kept)
                if len(kept) == len(local):
                    table[layer].append((label, mod, local))  # untouched: no reload
                elif kept:
                    gpu = mod.gate_up_blocks.device.index or 0 if self.device_kind == "cuda" else 0
                    table[layer].append(self._load(layer, gpu, kept))
        held = {(l, e) for l, entries in table.items() for _, _, local in entries for e in local}
        loaded = 0
        for (layer, gpu), ids in sorted(by_shard.items()):
            new = sorted(e for e in ids if (layer, e) not in held)
            if new:
                table[layer].append(self._load(layer, gpu, new))
                loaded += len(new)
        self.experts = dict(table)
        self.assignment = sorted(
            {(l, e) for l, entries in self.experts.items() for _, _, local in entries for e in local}
        )
        return loaded, dropped

    def set_shards(self, assignment, gpu_of: dict | None = None, *, drop_others: bool = False) -> dict:
        """A live re-plan, in two calls: first (drop_others False) load the new plan's shards not held yet —
        warmed while the old table still serves — then, once nothing routes to the old ones any more,
        (drop_others True) hold exactly `assignment`. Calls in flight keep the table they started with."""
        with self._replace_lock:
            loaded, dropped = self._place(assignment, gpu_of, keep=not drop_others)
        self.shards_loaded += loaded
        self.shards_dropped += dropped
        return {"loaded": loaded, "dropped": dropped, "experts": list(self.assignment)}

    def holds(self, layer: int, expert: int) -> bool:
        return any(expert in local for _, _, local in self.experts.get(layer, ()))

    def memory(self):
        """Resident bytes (sizing.WorkerMemory) measured from the held tensors, per device; the per-call
        workspace from sizing.expert_workspace_bytes."""
        mem = sizing.WorkerMemory()
        per_device: dict[str, list] = defaultdict(list)
        for _layer, shards in self.experts.items():
            for label, mod, _ in shards:
                per_device[label].append(mod)
        for label, mods in sorted(per_device.items()):
            weights = sum(
                b.numel() * b.element_size()
                for m in mods
                for n, b in m.named_buffers()
                if n.endswith(("_blocks", "_scales"))
            )
            shards = sum(len(m.ids) for m in mods)
            mem.add(
                label,
                weights=weights,
                workspace=sizing.expert_workspace_bytes(
                    self.cfg,
                    self.device_kind,
                    layers=len(mods),
                    shards=shards,
                    step_tokens=self.step_tokens,
                    dequant_cache_bytes=memory.dequant_cache_bytes(),
                ),
            )
        return mem

    @torch.no_grad()
    def run(
        self,
        layer: int,
        hidden: torch.Tensor,
        expert_ids: torch.Tensor,
        weights: torch.Tensor,
        out_dtype: torch.dtype = torch.float32,
    ) -> torch.Tensor:
        """hidden [n, H]; expert_ids [n, K] global ids in ascending order per row, −1 for slots computed elsewhere;
        weights [n, K] the gate weights → [R, H] in `out_dtype`: per row, per expert group it has slots in
        (ascending), the group's partial sum P_g (kernels/moe/combine.py: Σ w·y in ascending expert id, fp32)."""
        if self.fault_delay_s:
            time.sleep(self.fault_delay_s)
        h, n_experts = self.cfg.expert_hidden_size, self.cfg.moe.n_routed_experts
        if hidden.dim() != 2 or hidden.shape[1] != h:
            raise ExpertRequestError(f"hidden: expected shape [n, {h}], found {list(hidden.shape)}")
        if expert_ids.dim() != 2 or expert_ids.shape[0] != hidden.shape[0]:
            raise ExpertRequestError(
                f"expert_ids: expected shape [{hidden.shape[0]}, K], found {list(expert_ids.shape)}"
            )
        if tuple(weights.shape) != tuple(expert_ids.shape) or not weights.is_floating_point():
            raise ExpertRequestError(
                f"weights: expected floating point of shape {list(expert_ids.shape)}, found "
                f"{weights.dtype} {list(weights.shape)}"
            )
        shards = self.experts.get(layer)
        if shards is None:
            raise UnknownExpert(f"layer {layer}: {self.name} holds no experts of this layer")
        expert_ids = expert_ids.long()
        ids = expert_ids.numpy()  # the checks on the host array: a call is a few rows
        valid = ids >= 0
        if ids.size and (ids.max() >= n_experts or ids.min() < -1):
            bad = int(ids.max()) if ids.max() >= n_experts else int(ids.min())
            raise ExpertRequestError(f"expert_ids: {bad} outside [0, {n_experts}) (or −1 for elsewhere)")
        if ids.shape[1] > 1 and bool((valid[:, 1:] & (ids[:, 1:] <= ids[:, :-1])).any()):
            raise ExpertRequestError("expert_ids: expected each row's ids distinct and in ascending order")
        safe_ids = ids.clip(min=0)
        mine_of = [valid & (_host_index(mod)[safe_ids] >= 0) for _, mod, _ in shards]  # per shard [n, K]
        missing = valid & ~np.logical_or.reduce(mine_of)
        if missing.any():
            raise UnknownExpert(f"expert ({layer}, {int(ids[missing][0])}) is not held by {self.name}")
        n, k = ids.shape
        if n * k * h * 4 > self.max_call_bytes:
            raise ExpertRequestError(
                f"hidden: {n} rows x {k} slots need {n * k * h * 4:,} bytes of workspace, over "
                f"this worker's per-call limit of {self.max_call_bytes:,}; split the call"
            )
        with self.lock, self.threads.rows(n):
            self.calls += 1
            self.tokens_computed += int(valid.sum())
            if len(shards) == 1 and n <= self.step_tokens:
                # one shard holds every slot sent: its output is the answer (0 where a slot is −1)
                mod = shards[0][1]
                dev = mod.gate_up_blocks.device
                out = mod.outputs_fp32(hidden.to(dev), expert_ids.to(dev)).cpu()
            else:
                out = self._run_shards(shards, mine_of, hidden, expert_ids, n, k, h)
        groups = self.cfg.moe.combine_groups
        partials = group_partials(out, expert_ids, weights.float(), n_experts // groups, groups)
        return partials.to(out_dtype)

    def _run_shards(self, shards, mine_of, hidden, expert_ids, n: int, k: int, h: int) -> torch.Tensor:
        """[n, K, H] fp32 outputs from several shards (devices) or in pieces of step_tokens rows: every device's
        pieces are launched before any result is read back, so the devices run at once."""
        out = torch.zeros(n, k, h, dtype=torch.float32)
        pending = []
        for (_, mod, _), mine in zip(shards, mine_of):
            dev = mod.gate_up_blocks.device
            if not mine.any():
                continue
            mine = torch.from_numpy(mine)
            ids = torch.where(mine, expert_ids, torch.full_like(expert_ids, -1))
            for s in range(0, n, self.step_tokens):
                rows = slice(s, min(n, s + self.step_tokens))
                res = mod.outputs_fp32(hidden[rows].to(dev), ids[rows].to(dev))  # [t, K, H] fp32
                pending.append((rows, mine[rows], res))
        for rows, mask, res in pending:
            out[rows][mask] = res.cpu()[mask]
        return out


def _host_index(mod: RoutedExperts) -> np.ndarray:
    """A shard's global id → local index table (−1: not held) on the host, kept on the module (a re-plan loads new
    modules, so it never goes stale): which of a call's slots a shard computes, without a per-call set lookup."""
    index = getattr(mod, "_host_global_to_local", None)
    if index is None:
        index = mod._host_global_to_local = mod.global_to_local.cpu().numpy()
    return index
