"""An in-process deployment: attention and expert workers as objects, called directly (the reference
transport). Same Engine, same worker classes as the multi-process deployment, no gRPC in between."""
from __future__ import annotations

from expertmesh.checkpoint import Checkpoint
from expertmesh.config import ModelConfig
from expertmesh.router.engine import Engine
from expertmesh.worker.attention import AttentionWorker
from expertmesh.worker.expert import ExpertWorker


def make_placement(cfg: ModelConfig, expert_workers: int, redundant_experts: int = 0, loads=None,
                   group_aware: bool = True, min_replicas: int = 1):
    """A placement plan for `expert_workers` single-GPU workers (the planner; one GPU per local process), by
    default group-aware (each combine group's experts on one worker: one answer row per (token, group))."""
    from expertmesh.planner import ClusterShape, plan_placement
    copies = cfg.n_logical_experts * max(1, min_replicas) + redundant_experts * cfg.n_moe_layers
    per_worker = -(-copies // expert_workers)
    memory = (per_worker + 1) * cfg.expert_bytes_mxfp4
    shape = ClusterShape(pods=expert_workers, gpus_per_pod=1, gpu_memory_bytes=memory, reserve_bytes=0)
    return plan_placement(cfg, shape, redundant_slots=redundant_experts, loads=loads, group_aware=group_aware,
                          min_replicas=min_replicas)


def build_local_engine(checkpoint: str | Checkpoint, *, attention_workers: int = 1, expert_workers: int = 1,
                       redundant_experts: int = 0, kv_blocks: int = 512, block_size: int = 16,
                       placement=None, lease_seconds: float = 30.0, **engine_kw) -> Engine:
    ckpt = checkpoint if isinstance(checkpoint, Checkpoint) else Checkpoint(checkpoint)
    cfg = ckpt.cfg
    placement = placement or make_placement(cfg, expert_workers, redundant_experts)
    attention = [AttentionWorker(ckpt, kv_blocks=kv_blocks, block_size=block_size, name=f"attention-{i}",
                                 lease_seconds=lease_seconds)
                 for i in range(attention_workers)]
    experts = [ExpertWorker(ckpt, placement.experts_of(i), name=f"expert-{i}") for i in range(expert_workers)]
    return Engine(cfg, attention, experts, placement, **engine_kw)
