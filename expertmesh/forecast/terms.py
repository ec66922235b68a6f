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
# Each figure below was read from the source its comment names (the repositories' README tables at the commits
# given); where no source could be read here the comment says "assumed".
# memory-bound attention: FlashMLA (deepseek-ai/FlashMLA README.md, first release 414a2f3, 2025-02-21) reaches
# 3,000 GB/s of H800 SXM5's 3.35 TB/s
ATTENTION_BANDWIDTH = 3000 / 3350
# compute-bound attention: the same README, 580 TFLOP/s BF16 of H800's 989 (CUDA 12.6; its 2025-04-22 release
# reaches 660, its DSA sparse decoding kernel 410) — the first release's figure, what the Feb–May 2025 runs had
ATTENTION_COMPUTE = 580 / 989
# weight-streaming GEMMs (decode, small M): DeepGEMM's README (deepseek-ai/DeepGEMM 989c9e3, 2025-04-09, H800,
# NVCC 12.8), "Normal GEMMs for dense models", M 64 and 128: 1,509–2,668 GB/s; its best (M 64, N 7168, K 16384:
# 2,668 GB/s) is 0.80 of 3.35 TB/s — taken, as the largest weights (the experts') stream at it
WEIGHT_BANDWIDTH = 0.80
# compute-bound GEMMs: the same README's "Grouped GEMMs for MoE models (contiguous layout)" (prefill): 1,214–1,346
# TFLOP/s FP8 of H800's 1,979 (0.61–0.68); its dense M 4096 rows 775–1,520; "up to 1,550" after 2025-04-18 —
# 0.62 (1,227) taken for every GEMM
GEMM_COMPUTE = 0.62
# NVLink all-to-all: DeepEP's intranode normal kernels move 153 GB/s (dispatch) / 158 (combine) on H800, whose
# NVLink the README puts at "~160 GB/s maximum" (deepseek-ai/DeepEP docs/legacy.md, "Normal kernels with NVLink
# and RDMA forwarding"; README.md until 567632d): 155 of the 200 GB/s one-way nominal
NVLINK_EFFICIENCY = 155 / 200
# DeepEP low-latency kernels (decode): RDMA GB/s by EP size on H800 with one CX7 400 Gb/s NIC (~50 GB/s) per GPU,
# 128 tokens a batch, hidden 7168, top-8, FP8 dispatch / BF16 combine (DeepEP docs/legacy.md, "Low-latency kernels
# with pure RDMA"; the figures since de8cfca, 2025-06-05); scaled by the NIC's speed
DEEPEP_LL_DISPATCH = {8: 98, 16: 63, 32: 48, 64: 43, 128: 39, 256: 39}
DEEPEP_LL_COMBINE = {8: 127, 16: 74, 32: 53, 64: 46, 128: 39, 256: 40}
# DeepEP normal kernels (prefill), internode RDMA GB/s by EP size (the same section as NVLINK_EFFICIENCY; 4,096
# tokens a batch, top-4 groups, top-8 experts)
DEEPEP_NORMAL_DISPATCH = {16: 43, 32: 58, 64: 51}
DEEPEP_NORMAL_COMBINE = {16: 43, 32: 57, 64: 50}
DEEPEP_NIC_BYTES_PER_S = 50e9  # the CX7 400 Gb/s the tables were measured with
# DeepEP's normal kernels take 24 of H800's 132 SMs: DeepSeek's prefill profile (deepseek-ai/profile-data,
# assets/prefill.jpg: "Computation 108 SMs / Communication 24 SMs"); while a prefill's all-to-all overlaps compute,
# the GEMMs run on the rest. Decode's low-latency kernels take none ("Communication 0 SMs", assets/decode.jpg)
DEEPEP_NORMAL_SM_SHARE = 24 / 132
# two-batch overlap hides only part of the all-to-all: LMSYS measured it raising DeepSeek's prefill throughput by
# "27% to 35%" on 96 H100s at the same tokens per device (lm-sys.github.io blog/2025-05-05-large-scale-ep.md,
# "Ablation Study: Two-batch Overlap"): an overlapped layer takes (compute + communication) / 1.31, never less than
# the longer of the two
TWO_BATCH_OVERLAP_SPEEDUP = 1.31
# ... and in decode "25.5% at 256 tokens" a device (the same ablation; "minimal or negative" below 64–128 tokens)
TWO_BATCH_OVERLAP_SPEEDUP_DECODE = 1.255
# expert load imbalance after EPLB: the step waits for its busiest rank. LMSYS measured DeepSeek-V3's prefill on
# 4x8 H100 (EP32, 4,096-token prompts, 16,384 tokens a GPU) at 50,302 tok/s per node with EPLB on the workload's own
# expert distribution and 59,337 with routing simulated perfectly balanced (blog/2025-05-05-large-scale-ep.md,
# "Overall Throughput"): 1.18x. Taken as the busiest rank's routed-expert load (GEMMs and all-to-all) over the mean
# at every EP size > 1 — a lower bound there, since that ratio is over the whole step
EP_IMBALANCE = 59_337 / 50_302
# the smallest cost of one kernel in a CUDA-graph-replayed step: 3.4 µs — NVIDIA's "Getting Started with CUDA
# Graphs" (developer.nvidia.com/blog/cuda-graphs) as recalled (a short kernel replayed from a graph, launch and
# execution together); the page could not be read here, so assumed
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
