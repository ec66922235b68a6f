"""An in-process deployment: the router's engine over attention and expert workers as objects, called directly
(the reference transport). Same Engine, same worker classes as the multi-process deployment, no gRPC in between:
the distributed system must give exactly its greedy tokens."""

from __future__ import annotations

from expertmesh.checkpoint.loader import Checkpoint
from expertmesh.entry.cluster import make_placement
from expertmesh.router.engine import Engine
from expertmesh.router.engine_config import EngineConfig
from expertmesh.worker.attention import AttentionWorker
from expertmesh.worker.expert import ExpertWorker
from expertmesh.worker.kv_store import attach_cluster_store


def build_local_engine(
    checkpoint: str | Checkpoint,
    *,
    attention_workers: int = 1,
    expert_workers: int = 1,
    redundant_experts: int = 0,
    kv_blocks: int = 512,
    block_size: int = 16,
    placement=None,
    lease_seconds: float = 30.0,
    serving_cfg=None,
    dtype=None,
    kv_tiers: dict | None = None,
    prefill_workers: int = 0,
    config: EngineConfig | None = None,
    drafter=None,
    kv_store: dict | None = None,
    **engine_kw,
) -> Engine:
    """`serving_cfg`: the checkpoint's config with a deployment's serving limits (router.server.serving_config:
    --max-context) for the engine; the workers keep the checkpoint's. `dtype`: the attention
    workers' compute dtype (default: the device's, memory.compute_dtype), as `expertmesh up --dtype`. `kv_tiers`:
    every attention worker's lower KV tiers (AttentionWorker's kv_host_bytes, kv_disk_dir, kv_disk_bytes).
    `prefill_workers`: a prefill pool of that many attention workers beside the `attention_workers` of the decode
    pool (router/disagg.py; 0: one colocated pool). `config`: the engine's settings, or `engine_kw` its fields
    (EngineConfig(**engine_kw)); its speculative_method / speculative_tokens go to the attention workers too.
    `drafter`: a test hook — called with each attention worker's Speculation to replace its drafter's proposals.
    `kv_store`: the cluster KV tier every attention worker gets (worker/kv_store.attach_cluster_store's keyword
    arguments: master, metadata, deployment, secret, capacity_bytes); the engine is told (EngineConfig.kv_store).
    Returns the engine started."""
    if config is not None and engine_kw:
        raise TypeError(f"build_local_engine: config= or EngineConfig fields, not both ({', '.join(engine_kw)})")
    config = config or EngineConfig(**({"kv_store": True} if kv_store else {}) | engine_kw)
    ckpt = checkpoint if isinstance(checkpoint, Checkpoint) else Checkpoint(checkpoint)
    cfg = ckpt.cfg
    mtp = config.speculative_method == "mtp" and config.speculative_tokens > 0  # the MTP layer's experts placed too
    placement = placement or make_placement(cfg, expert_workers, redundant_experts, mtp=mtp)

    def attention(name: str, pool: str) -> AttentionWorker:
        return AttentionWorker(
            ckpt,
            kv_blocks=kv_blocks,
            block_size=block_size,
            name=name,
            lease_seconds=lease_seconds,
            dtype=dtype,
            pool=pool,
            speculative_method=config.speculative_method or None,
            speculative_tokens=config.speculative_tokens,
            **(kv_tiers or {}),
        )

    decode = [attention(f"attention-{i}", "decode" if prefill_workers else "mixed") for i in range(attention_workers)]
    prefill = [attention(f"prefill-{i}", "prefill") for i in range(prefill_workers)]
    if drafter is not None:
        for worker in decode + prefill:
            drafter(worker.spec)
    for worker in decode + prefill if kv_store else ():
        attach_cluster_store(worker, **kv_store)
    experts = [ExpertWorker(ckpt, placement.experts_of(i), name=f"expert-{i}") for i in range(expert_workers)]
    return Engine(serving_cfg or cfg, decode, experts, placement, config, prefill=prefill or None).start()
