"""A worker's resident memory from the config and its assignment: torch-free byte arithmetic.

The one source of truth for what a worker holds: the meta dry run (`expertmesh worker --device meta --dry-run`)
builds the worker and measures its tensors, the tests check the two agree byte for byte, and the planner
(`expertmesh plan`, the operator) uses the same functions: `expert_slot_bytes` per shard, `expert_workspace_bytes`
against the per-GPU reserve. No torch here, so the operator and the planner size a deployment without loading it;
the device side (devices, torch dtypes, measuring built modules) is expertmesh/model/memory.py.
  weights_bytes    persistent tensors: parameters, packed MXFP4 blocks + E8M0 scales
  kv_bytes         the paged latent KV pool (MLA/DSA layers; DSA layers also their indexer keys)
  workspace_bytes  index tables and an upper bound on the activations of one call of up to `step_tokens`
                   tokens (expert calls are cut into pieces of that size), plus on CPU the bounded dequantize
                   cache of the grouped path and one expert's transient fp32 weights (the Triton path decodes
                   MXFP4 inside the GEMM: no dequantized matrix on GPUs)

Dtypes are given as a name ('bfloat16', 'float32'), a byte width, or any dtype object with `itemsize` (a
torch.dtype or numpy dtype passes as it is).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from expertmesh.model.config import ModelConfig

# tokens per call the workspace is sized for: the router's default prompt tokens per step (--prefill-tokens); expert
# calls are cut into pieces of at most this many tokens
STEP_TOKENS = 1024
GIB = 2**30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


class DeviceError(ValueError):
    """A bad --device / --dtype / device-memory flag (the message names the flag)."""


def default_dtype(device: str) -> str:
    """The weights' and activations' dtype a device computes in unless told: fp32 on cpu, bf16 on cuda / meta."""
    return "float32" if device == "cpu" else "bfloat16"


def dtype_bytes(dtype) -> int:
    """Bytes per element of `dtype`: a name in DTYPE_BYTES, a byte width, or an object with `itemsize`."""
    if isinstance(dtype, str):
        try:
            return DTYPE_BYTES[dtype]
        except KeyError:
            raise DeviceError(f"--dtype: expected one of {', '.join(DTYPE_BYTES)}, found {dtype!r}") from None
    if isinstance(dtype, int) and not isinstance(dtype, bool):
        return dtype
    return int(dtype.itemsize)


def device_label(kind: str, index: int = 0) -> str:
    """How a device is reported: 'cpu', or 'cuda:i' (also for meta: the dry run stands for the GPU run)."""
    return "cpu" if kind == "cpu" else f"cuda:{index}"


# ----------------------------------------------------------------------------------------------- weights
def expert_slot_bytes(cfg: ModelConfig) -> int:
    """Bytes one routed expert occupies on a device: MXFP4 blocks + E8M0 scales (4.25 bits/weight)."""
    return cfg.expert_bytes_mxfp4


def dense_weight_bytes(cfg: ModelConfig, dtype) -> int:
    """Everything but the routed experts in `dtype`, the FP32_PARAMETERS in fp32 (a tied head counted once)."""
    dense = cfg.total_params - cfg.routed_expert_params
    return (dense - cfg.fp32_params) * dtype_bytes(dtype) + 4 * cfg.fp32_params


def kv_block_bytes(cfg: ModelConfig, block_size: int, dtype) -> int:
    """One KV block (`block_size` tokens) over every latent-KV layer, as worker/kv.BlockPool allocates it."""
    return block_size * cfg.kv_bytes_per_token_all_layers(dtype_bytes(dtype))


# ----------------------------------------------------------------------------------------------- workspace
def expert_workspace_bytes(
    cfg: ModelConfig,
    device: str,
    *,
    layers: int | None = None,
    shards: int = 0,
    step_tokens: int = STEP_TOKENS,
    dequant_cache_bytes: int | None = None,
) -> int:
    """One expert device's workspace: the routing tables of the `layers` MoE layers it holds experts of (None:
    all) for its `shards` experts, and one call of `step_tokens` tokens: hidden rows (fp32), the [T, K, H] slot
    outputs (fp32 accumulation and the result), the [T·K, I] gated-MLP intermediate (fp32); on cpu also the
    dequantize cache's bound (`dequant_cache_bytes`, required there: the process's own, memory.dequant_cache_bytes)
    and one expert's fp32 weights (a miss not kept by the cache)."""
    h, i, k, e = cfg.expert_hidden_size, cfg.moe.expert_intermediate_size, cfg.moe.top_k, cfg.moe.n_routed_experts
    n_layers = cfg.n_moe_layers if layers is None else layers
    tables = 8 * (n_layers * e + shards)  # global_to_local [E] + expert_ids per layer
    t = step_tokens
    acts = 4 * t * h + 4 * t * k * h * 2 + 4 * t * k * i
    dequant = 0
    if device == "cpu":
        if dequant_cache_bytes is None:
            raise ValueError("expert_workspace_bytes on cpu: pass dequant_cache_bytes (the dequantize cache's bound)")
        dequant = dequant_cache_bytes + 4 * 3 * h * i
    return tables + acts + dequant


def attention_workspace_bytes(cfg: ModelConfig, dtype=None, *, step_tokens: int = STEP_TOKENS) -> int:
    """An attention worker's workspace for a step of `step_tokens` tokens: the routing tables of its (empty)
    expert modules, fp32 logits [T, V], eight activation buffers of the widest projection [T, W] in fp32, and
    the indexer's fp32 scores of those queries over the whole context [T, max_context] (kernels reduce the heads
    tile by tile). All fp32: `dtype` does not change it."""
    m, a = cfg.mla, cfg.kda
    widths = [
        cfg.hidden_size,
        cfg.dense_intermediate_size,
        cfg.moe.n_shared_experts * cfg.moe.expert_intermediate_size,
        3 * a.n_heads * a.head_dim,
        m.n_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim),
        m.n_heads * (m.kv_lora_rank + m.qk_rope_head_dim),
    ]
    t = step_tokens
    tables = 8 * cfg.n_moe_layers * cfg.moe.n_routed_experts
    return tables + 4 * t * cfg.vocab_size + 8 * 4 * t * max(widths) + 4 * t * cfg.max_context


# ----------------------------------------------------------------------------------------------- workers
@dataclass
class WorkerMemory:
    """Resident bytes of one worker process; `devices`: label → resident bytes on that device."""

    weights_bytes: int = 0
    kv_bytes: int = 0
    workspace_bytes: int = 0
    devices: dict[str, int] = field(default_factory=dict)

    def add(self, device: str, weights: int = 0, kv: int = 0, workspace: int = 0) -> None:
        self.weights_bytes += weights
        self.kv_bytes += kv
        self.workspace_bytes += workspace
        self.devices[device] = self.devices.get(device, 0) + weights + kv + workspace

    def to_json(self, **extra) -> str:
        return json.dumps(
            {
                "weights_bytes": self.weights_bytes,
                "kv_bytes": self.kv_bytes,
                "workspace_bytes": self.workspace_bytes,
                "devices": self.devices,
                **extra,
            }
        )


def attention_memory(
    cfg: ModelConfig,
    *,
    device: str = "cuda",
    dtype=None,
    kv_blocks: int,
    block_size: int,
    step_tokens: int = STEP_TOKENS,
) -> WorkerMemory:
    """What an attention worker holds on its one device (`dtype` None: the device's default)."""
    dtype = default_dtype(device) if dtype is None else dtype
    mem = WorkerMemory()
    mem.add(
        device_label(device),
        weights=dense_weight_bytes(cfg, dtype),
        kv=kv_blocks * kv_block_bytes(cfg, block_size, dtype),
        workspace=attention_workspace_bytes(cfg, dtype, step_tokens=step_tokens),
    )
    return mem


def kv_blocks_for_memory(
    cfg: ModelConfig,
    *,
    device_bytes: int,
    utilization: float,
    dtype,
    block_size: int,
    step_tokens: int = STEP_TOKENS,
    flag: str = "--gpu-memory-utilization",
) -> int:
    """KV blocks that fit in `utilization` of a device of `device_bytes` after the attention worker's weights
    and workspace."""
    if not 0 < utilization <= 1:
        raise DeviceError(f"{flag}: expected a fraction in (0, 1], found {utilization}")
    used = dense_weight_bytes(cfg, dtype) + attention_workspace_bytes(cfg, dtype, step_tokens=step_tokens)
    left = int(utilization * device_bytes) - used
    blocks = left // kv_block_bytes(cfg, block_size, dtype)
    if blocks <= 0:
        raise DeviceError(
            f"{flag} {utilization}: {utilization} x {device_bytes / GIB:.1f} GiB leaves no room for "
            f"KV after {used / GIB:.2f} GiB of weights and workspace"
        )
    return int(blocks)


def expert_memory(
    cfg: ModelConfig,
    shards_by_gpu: dict[int, list[tuple[int, int]]],
    *,
    device: str = "cuda",
    step_tokens: int = STEP_TOKENS,
    dequant_cache_bytes: int | None = None,
) -> WorkerMemory:
    """What an expert worker holds: per GPU index of the plan, its shards packed in MXFP4 and the workspace. On
    cpu every GPU's shards share the one device (and `dequant_cache_bytes` is required, see
    expert_workspace_bytes)."""
    mem = WorkerMemory()
    if device == "cpu":
        pairs = [p for ps in shards_by_gpu.values() for p in ps]
        shards_by_gpu = {0: pairs} if pairs else {}
    for g, pairs in sorted(shards_by_gpu.items()):
        if not pairs:
            continue
        layers = len({layer for layer, _ in pairs})
        mem.add(
            device_label(device, g),
            weights=len(pairs) * expert_slot_bytes(cfg),
            workspace=expert_workspace_bytes(
                cfg,
                device,
                layers=layers,
                shards=len(pairs),
                step_tokens=step_tokens,
                dequant_cache_bytes=dequant_cache_bytes,
            ),
        )
    return mem


def plan_expert_memory(
    cfg: ModelConfig, plan, ordinal: int, *, device: str = "cuda", dequant_cache_bytes: int | None = None
) -> WorkerMemory:
    """`expert_memory` of expert worker `ordinal` of a PlacementPlan."""
    return expert_memory(
        cfg,
        {g.gpu: list(g.shards) for g in plan.workers[ordinal].gpus},
        device=device,
        dequant_cache_bytes=dequant_cache_bytes,
    )
