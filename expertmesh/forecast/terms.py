"""The roofline terms of one step and the efficiencies that turn peak figures into achieved ones.

Each block of a layer (attention projections, the attention kernel, the FFN, the expert all-to-all, the TP
all-reduce) costs max(its bytes / achieved bandwidth, its FLOPs / achieved FLOP/s, its kernels x the per-kernel
floor); the block's time is credited to whichever of those bound it, so a prediction says what bounds each phase.
One set of factors for every model, GPU and workload; where a factor comes from, its comment says.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from expertmesh.forecast.gpus import GPU

# ---------------------------------------------------------------------------------------------- efficiencies
# memory-bound attention: FlashMLA (deepseek-ai/FlashMLA README) reaches 3,000 GB/s of H800 SXM5's 3.35 TB/s
ATTENTION_BANDWIDTH = 3000 / 3350
# compute-bound attention: FlashMLA 580 TFLOP/s of H800's 989 BF16 (its first release; the same README's later
# kernels reach 660)
ATTENTION_COMPUTE = 580 / 989
# weight-streaming GEMMs (decode, small M): DeepGEMM's README tables show its small-M FP8 GEMMs streaming weights at
# roughly 2.6–2.7 TB/s of H800's 3.35 (below FlashMLA's 0.9: scale loads, per-expert tails) — 0.8 taken
WEIGHT_BANDWIDTH = 0.80
# compute-bound GEMMs: DeepGEMM (deepseek-ai/DeepGEMM README) reaches up to 1,550 TFLOP/s FP8 on H800 (1,979 peak)
# at its best shapes; its grouped (MoE) GEMMs on serving shapes about 1,200–1,300 — 0.62 taken for every GEMM
GEMM_COMPUTE = 0.62
# NVLink all-to-all: DeepEP's intranode normal kernels move 153 GB/s (dispatch) / 158 (combine) over H800's
# 200 GB/s one-way NVLink
NVLINK_EFFICIENCY = 155 / 200
# DeepEP low-latency kernels (decode): achieved RDMA GB/s by EP size on H800 with one CX7 400 Gb/s NIC per GPU,
# 128 tokens, hidden 7168, top-8, FP8 dispatch / BF16 combine (DeepEP README); scaled by the NIC's speed
DEEPEP_LL_DISPATCH = {8: 98, 16: 63, 32: 48, 64: 43, 128: 39, 256: 39}
DEEPEP_LL_COMBINE = {8: 127, 16: 80, 32: 57, 64: 49, 128: 42, 256: 43}
# DeepEP normal kernels (prefill), internode RDMA GB/s by EP size (DeepEP README; 4,096 tokens a batch)
DEEPEP_NORMAL_DISPATCH = {16: 43, 32: 58, 64: 51}
DEEPEP_NORMAL_COMBINE = {16: 43, 32: 57, 64: 50}
DEEPEP_NIC_BYTES_PER_S = 50e9  # the CX7 400 Gb/s the tables were measured with
# DeepEP's normal kernels take 24 of H800's 132 SMs (its tests' Buffer.set_num_sms(24)): while a prefill's
# all-to-all overlaps compute, the GEMMs run on the rest
DEEPEP_NORMAL_SM_SHARE = 24 / 132
# two-batch overlap hides only part of the all-to-all: LMSYS measured it raising DeepSeek's prefill throughput by
# 27–35% on 96 H100s ("Deploying DeepSeek with PD Disaggregation and Large-scale Expert Parallelism", 2025-05-05):
# an overlapped layer takes (compute + communication) / 1.31, never less than the longer of the two
TWO_BATCH_OVERLAP_SPEEDUP = 1.31
# the smallest cost of one kernel in a CUDA-graph-replayed step: 3.4 µs a kernel (NVIDIA, "Getting Started with
# CUDA Graphs": a short kernel replayed from a graph, launch and execution together)
KERNEL_FLOOR_S = 3.4e-6
# a TP all-reduce's fixed cost beyond its bytes: one custom one-shot kernel plus an NVLink round trip — assumed two
# kernel floors (no published figure for decode-sized messages was found here)
ALLREDUCE_LATENCY_S = 2 * KERNEL_FLOOR_S
# kernels per block in a fused serving step (counted from the block's operations, SGLang-style fusions: norm with
# residual add, q_a / kv_a as one GEMM, FP8 activation quantisation inside GEMMs)
KERNELS = {
    "mla": 10,  # norm, qkv_a GEMM, q/kv norms, q_b GEMM, absorb bmm, rope + cache write, attention (2), out bmm, o_proj
    "dsa": 14,  # MLA's + indexer q / k GEMMs, k norm + cache write, scores + top-k
    "kda": 10,  # norm, qkv GEMM, short conv, forget gate (2), beta, recurrence, output gate GEMM, gated norm, o_proj
    "dense_ffn": 4,  # norm, gate_up GEMM, activation, down GEMM
    "moe": 10,  # norm, router GEMM, top-k, align / sort, gate_up, activation, down, shared expert (3 fused to 2), sum
    "latent": 3,  # down projection, latent norm, up projection
    "attn_res": 2,  # the attention-residual mixes (attention and MLP inputs)
    "head": 4,  # final norm, LM head GEMM, logits processing, sampling
}


def interpolate(table: dict[int, float], ep: int) -> float:
    """A DeepEP table's GB/s at an EP size, log-linear between measured sizes, clamped at the ends."""
    sizes = sorted(table)
    if ep <= sizes[0]:
        return table[sizes[0]]
    if ep >= sizes[-1]:
        return table[sizes[-1]]
    lo = max(s for s in sizes if s <= ep)
    hi = min(s for s in sizes if s >= ep)
    if lo == hi:
        return table[lo]
    f = (math.log2(ep) - math.log2(lo)) / (math.log2(hi) - math.log2(lo))
    return table[lo] + f * (table[hi] - table[lo])


# ---------------------------------------------------------------------------------------------- cost
TERMS = ("weights read", "KV read", "FLOPs", "attention kernel", "expert all-to-all", "all-reduce", "kernel launches")


@dataclass
class StepCost:
    """Seconds of one step, credited to the term that bound each block."""

    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(TERMS, 0.0))

    @property
    def total(self) -> float:
        return sum(self.seconds.values())

    @property
    def bound(self) -> str:
        return max(self.seconds, key=self.seconds.get)

    def add(self, term: str, seconds: float) -> None:
        self.seconds[term] += seconds

    def scaled(self, factor: float) -> StepCost:
        return StepCost({k: v * factor for k, v in self.seconds.items()})

    def merged(self, other: StepCost) -> StepCost:
        return StepCost({k: self.seconds[k] + other.seconds[k] for k in TERMS})


def block(
    cost: StepCost,
    gpu: GPU,
    *,
    weight_bytes: float = 0.0,
    kv_bytes: float = 0.0,
    flops: float = 0.0,
    dtype: str = "bf16",
    kernels: int = 0,
    attention: bool = False,
    compute_share: float = 1.0,
) -> float:
    """Add one block's roofline time to `cost` (credited to its binding term) and return it. `attention`: the
    attention kernel's efficiencies (FlashMLA) instead of the GEMMs'; `compute_share`: the SMs left to compute."""
    bw = gpu.hbm_bytes_per_s
    candidates = {
        "weights read": weight_bytes / (bw * WEIGHT_BANDWIDTH),
        "KV read": kv_bytes / (bw * ATTENTION_BANDWIDTH),
        ("attention kernel" if attention else "FLOPs"): flops
        / (gpu.peak(dtype) * (ATTENTION_COMPUTE if attention else GEMM_COMPUTE) * compute_share),
        "kernel launches": kernels * KERNEL_FLOOR_S,
    }
    if weight_bytes and kv_bytes:  # one pass streams both
        candidates["weights read"] = candidates["KV read"] = (weight_bytes + kv_bytes) / (bw * WEIGHT_BANDWIDTH)
    term = max(candidates, key=candidates.get)
    seconds = candidates[term]
    cost.add(term, seconds)
    return seconds
