"""Devices, dtypes and the one source of truth for a worker's resident memory.

Devices (`--device cuda|cpu|meta`, default cuda when torch sees one, else cpu) and the dtype that follows them:
  - cuda: bf16 weights and activations, bf16 KV pool; what the published models keep in fp32 stays fp32
    (`model.FP32_PARAMETERS`: routing weights and bias, KDA A_log / dt_bias, the indexer's head weights; fp32
    inputs to those projections), and norms' statistics, softmax, routing scores, KDA state and the MoE
    accumulation run in fp32 inside the modules and kernels;
  - cpu: fp32 everywhere, the reference dtype of the determinism, batch-invariance and oracle tests
    (`--dtype bfloat16` runs the GPU dtype on a CPU, for tests);
  - meta: the worker built exactly as on a GPU (bf16) with no memory behind its tensors, for `--dry-run`.

Process model: one worker process per expert pod, one device rank per GPU of the plan inside it. The plan places
shards per (pod, GPU); the worker puts GPU g's shards on `cuda:g` and, for each MoE call, launches every device's
grouped MXFP4 GEMM before it gathers any result, so the G devices compute at once. Why one process per pod and not
one per GPU: the router addresses expert workers by StatefulSet ordinal (one gRPC endpoint per pod, replicas on
distinct pods); a token whose experts sit on several GPUs of a pod costs one call and one copy of its hidden state
per pod instead of one per GPU; per-GPU processes would need (pod, GPU) endpoints in the router and the plan's
replica table (a later change). Attention workers hold one device each (one attention pod per GPU).

Resident memory: the functions below compute what a worker holds from the config and its assignment; the meta
dry run builds the worker and measures its tensors, the tests check the two agree byte for byte, and the planner
(`expertmesh plan`, the operator) uses the same functions: `expert_slot_bytes` per shard,
`expert_workspace_bytes` against the per-GPU reserve.
  weights_bytes    persistent tensors: parameters, packed MXFP4 blocks + E8M0 scales
  kv_bytes         the paged latent KV pool (MLA/DSA layers; DSA layers also their indexer keys)
  workspace_bytes  index tables and an upper bound on the activations of one call of up to `step_tokens`
                   tokens (expert calls are cut into pieces of that size), plus on CPU the bounded dequantize
                   cache of the grouped path and one expert's transient fp32 weights (the Triton path decodes
                   MXFP4 inside the GEMM: no dequantized matrix on GPUs)
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch

from expertmesh.checkpoint.loader import expected_tensors, is_routed_expert
from expertmesh.kernels.moe import dequant_cache
from expertmesh.model.config import ModelConfig
from expertmesh.model.transformer import FP32_PARAMETERS

DEVICES = ("cuda", "cpu", "meta")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# tokens per call the workspace is sized for: the router's default prompt tokens per step (--prefill-tokens); expert
# calls are cut into pieces of at most this many tokens
STEP_TOKENS = 1024
GIB = 2**30


class DeviceError(ValueError):
    """A bad --device / --dtype (the message names the flag)."""


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def check_device(device: str | None, flag: str = "--device") -> str:
    """The device kind to use ('cuda', 'cpu' or 'meta'); None → the default. Refuses unknown values and cuda
    without a CUDA device, naming the flag."""
    if device is None:
        return default_device()
    kind = str(device).strip().lower()
    if kind not in DEVICES:
        raise DeviceError(f"{flag}: expected one of {', '.join(DEVICES)}, found {device!r}")
    if kind == "cuda" and not torch.cuda.is_available():
        raise DeviceError(f"{flag} cuda: no CUDA device is visible to torch (torch.cuda.is_available() is False)")
    return kind


def compute_dtype(device: str, dtype: str | torch.dtype | None = None, flag: str = "--dtype") -> torch.dtype:
    """The weights' and activations' dtype: `dtype` when given, else bf16 on cuda / meta and fp32 on cpu."""
    if dtype is None:
        return torch.float32 if device == "cpu" else torch.bfloat16
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise DeviceError(f"{flag}: expected one of {', '.join(DTYPES)}, found {dtype}")
        return dtype
    if dtype not in DTYPES:
        raise DeviceError(f"{flag}: expected one of {', '.join(DTYPES)}, found {dtype!r}")
    return DTYPES[dtype]


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def device_label(kind: str, index: int = 0) -> str:
    """How a device is reported: 'cpu', or 'cuda:i' (also for meta: the dry run stands for the GPU run)."""
    return "cpu" if kind == "cpu" else f"cuda:{index}"


def torch_device(kind: str, index: int = 0) -> torch.device:
    return (
        torch.device("cpu")
        if kind == "cpu"
        else torch.device("meta")
        if kind == "meta"
        else torch.device("cuda", index)
    )


# ----------------------------------------------------------------------------------------------- weights
def expert_slot_bytes(cfg: ModelConfig) -> int:
    """Bytes one routed expert occupies on a device: MXFP4 blocks + E8M0 scales (4.25 bits/weight)."""
    return cfg.expert_bytes_mxfp4


def dense_weight_bytes(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """Everything but the routed experts in `dtype`, the FP32_PARAMETERS in fp32 (a tied head counted once)."""
    total = 0
    for name, spec in expected_tensors(cfg).items():
        if is_routed_expert(name):
            continue
        n = 1
        for s in spec.shape:
            n *= s
        total += n * (4 if name.endswith(FP32_PARAMETERS) else dtype_bytes(dtype))
    return total


def kv_block_bytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
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
    dequantize cache's bound and one expert's fp32 weights (a miss not kept by the cache)."""
    h, i, k, e = cfg.expert_hidden_size, cfg.moe.expert_intermediate_size, cfg.moe.top_k, cfg.moe.n_routed_experts
    n_layers = cfg.n_moe_layers if layers is None else layers
    tables = 8 * (n_layers * e + shards)  # global_to_local [E] + expert_ids per layer
    t = step_tokens
    acts = 4 * t * h + 4 * t * k * h * 2 + 4 * t * k * i
    dequant = 0
    if device == "cpu":
        if dequant_cache_bytes is None:
            dequant_cache_bytes = dequant_cache().max_bytes
        dequant = dequant_cache_bytes + 4 * 3 * h * i
    return tables + acts + dequant


def attention_workspace_bytes(cfg: ModelConfig, dtype: torch.dtype, *, step_tokens: int = STEP_TOKENS) -> int:
    """An attention worker's workspace for a step of `step_tokens` tokens: the routing tables of its (empty)
    expert modules, fp32 logits [T, V], eight activation buffers of the widest projection [T, W] in fp32, and
    the indexer's fp32 scores of those queries over the whole context [T, max_context] (kernels reduce the heads
    tile by tile)."""
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
    dtype: torch.dtype | None = None,
    kv_blocks: int,
    block_size: int,
    step_tokens: int = STEP_TOKENS,
) -> WorkerMemory:
    """What an attention worker holds on its one device."""
    dtype = compute_dtype(device, dtype)
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
    dtype: torch.dtype,
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
) -> WorkerMemory:
    """What an expert worker holds: per GPU index of the plan, its shards packed in MXFP4 and the workspace. On
    cpu every GPU's shards share the one device."""
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
            workspace=expert_workspace_bytes(cfg, device, layers=layers, shards=len(pairs), step_tokens=step_tokens),
        )
    return mem


def plan_expert_memory(cfg: ModelConfig, plan, ordinal: int, *, device: str = "cuda") -> WorkerMemory:
    """`expert_memory` of expert worker `ordinal` of a PlacementPlan."""
    return expert_memory(cfg, {g.gpu: list(g.shards) for g in plan.workers[ordinal].gpus}, device=device)


def module_memory(mem: WorkerMemory, label: str, module: torch.nn.Module) -> None:
    """Add a built module's tensors to `mem` under device `label`: its state-dict tensors (parameters, persistent
    buffers) as weights, non-persistent buffers (index tables) as workspace. Works on meta tensors."""
    seen: set[int] = set()
    persistent = {id(t) for t in module.state_dict(keep_vars=True).values()}
    weights = workspace = 0
    for t in list(module.parameters()) + list(module.buffers()):
        if id(t) in seen:
            continue
        seen.add(id(t))
        n = t.numel() * t.element_size()
        if id(t) in persistent:
            weights += n
        else:
            workspace += n
    mem.add(label, weights=weights, workspace=workspace)
