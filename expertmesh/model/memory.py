"""Devices and torch dtypes: the device side of a worker's memory (the arithmetic is placement/sizing.py).

Devices (`--device cuda|cpu|meta`, default cuda when torch sees one, else cpu) and the dtype that follows them:
  - cuda: bf16 weights and activations, bf16 KV pool; what the published models keep in fp32 stays fp32
    (`model.config.FP32_PARAMETERS`: routing weights and bias, KDA A_log / dt_bias, the indexer's head weights; fp32
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

Resident memory is torch-free arithmetic in expertmesh/placement/sizing.py (what the planner and the operator use);
here are the device-side parts: choosing and checking devices and torch dtypes, this process's dequantize-cache
bound (part of a CPU expert worker's workspace), and measuring a built module's tensors (`module_memory`), which the
tests compare with sizing's figures byte for byte.
"""

from __future__ import annotations

import torch

from expertmesh.kernels.moe import dequant_cache
from expertmesh.placement.sizing import DTYPE_BYTES, DeviceError, WorkerMemory, default_dtype

DEVICES = ("cuda", "cpu", "meta")
DTYPES = {name: getattr(torch, name) for name in DTYPE_BYTES}


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
        return DTYPES[default_dtype(device)]
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise DeviceError(f"{flag}: expected one of {', '.join(DTYPES)}, found {dtype}")
        return dtype
    if dtype not in DTYPES:
        raise DeviceError(f"{flag}: expected one of {', '.join(DTYPES)}, found {dtype!r}")
    return DTYPES[dtype]


def torch_device(kind: str, index: int = 0) -> torch.device:
    return (
        torch.device("cpu")
        if kind == "cpu"
        else torch.device("meta")
        if kind == "meta"
        else torch.device("cuda", index)
    )


def dequant_cache_bytes() -> int:
    """This process's bound on the CPU dequantize cache (kernels/moe/grouped.py): part of a CPU expert worker's
    workspace (sizing.expert_workspace_bytes)."""
    return dequant_cache().max_bytes


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
