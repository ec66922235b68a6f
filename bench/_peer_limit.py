"""bench/peer.py's physical limit: the weight bytes one decoded token reads (from a DeepSeek-V3 / V3.2 config.json
and what a system holds each parameter in), this machine's copy bandwidth, and a decode rate as a fraction of
bandwidth ÷ bytes per token.

At one request a decode step reads every active weight once — attention (and DSA's indexer where it runs), the
dense MLPs, the shared experts, the router, the top-k routed experts, the norms, one embedding row and the LM head —
so no system can decode faster than copy bandwidth ÷ those bytes. The KV cache a step reads is left out (small at
short contexts; at 32K tokens dense MLA reads 32K latents a layer, which is DSA's point): the fraction is against
the weights alone.

`python bench/_peer_limit.py [--mib 512] [--repeats 5]` prints the bandwidth as JSON; bench/peer.py runs it so, in
its own process, so that setting torch's thread count here leaves the benchmark's in-process engine alone."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass

MXFP4_BITS = 4.25  # 4-bit E2M1 values + one 8-bit E8M0 scale per 32 (expertmesh/model/config.py MXFP4_BITS_PER_WEIGHT)


@dataclass(frozen=True)
class Holding:
    """Bytes per weight a system holds (and so reads) each class of parameter in."""

    weight_bytes: float  # attention, dense and shared MLPs, norms, embedding row, LM head: the served dtype
    expert_bytes: float  # routed experts
    router_bytes: float  # the gate's weight and correction bias
    indexer: bool  # whether DSA's lightning indexer runs (its weights read every token)
    index_heads_bytes: float  # the indexer's per-head weights (weights_proj)


def expertmesh_holding(dtype: str) -> Holding:
    """`expertmesh up --dtype D`: routed experts packed in MXFP4 on the expert workers (worker/expert.py), the
    router weight and bias and the indexer's head weights in fp32 (model/config.py FP32_PARAMETERS), everything
    else in D; every DSA layer runs its indexer."""
    return Holding(DTYPE_BYTES[dtype], MXFP4_BITS / 8, 4.0, True, 4.0)


def vllm_holding(dtype: str) -> Holding:
    """vLLM's CPU build (0.32.0) serving the same files as deepseek_v3 at --dtype D: every weight in D — its CPU MoE
    prepacks the experts in D (they lie on the MXFP4 grid, which vLLM does not know), the gate is a GateLinear in D
    (its fp32 correction bias counted in D: 2 bytes an expert short in bf16) — and no indexer: its DeepSeek loader
    drops those tensors (dense MLA)."""
    return Holding(DTYPE_BYTES[dtype], DTYPE_BYTES[dtype], DTYPE_BYTES[dtype], False, DTYPE_BYTES[dtype])


DTYPE_BYTES = {"bfloat16": 2.0, "float16": 2.0, "float32": 4.0}


def active_weight_bytes(config: dict, holding: Holding) -> dict[str, float]:
    """Weight bytes one decoded token reads, by part, for a DeepSeek-V3 / V3.2 config.json (`total` is their sum).
    MLA with or without q LoRA; the first `first_k_dense_replace` layers dense, the rest MoE (every layer MoE past
    those: moe_layer_freq 1)."""
    c = config
    h, layers, vocab = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"]
    heads, nope, rope, v = c["num_attention_heads"], c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    q_lora, kv_lora = c.get("q_lora_rank"), c["kv_lora_rank"]
    dense = min(c.get("first_k_dense_replace", 0), layers)
    moe = layers - dense
    experts, top_k, width = c["n_routed_experts"], c["num_experts_per_tok"], c["moe_intermediate_size"]

    q = h * q_lora + q_lora + q_lora * heads * (nope + rope) if q_lora else h * heads * (nope + rope)  # + q_a norm
    kv = h * (kv_lora + rope) + kv_lora + kv_lora * heads * (nope + v)  # kv_a, its norm, kv_b
    attention = layers * (q + kv + heads * v * h)
    indexer = index_heads = 0
    if holding.indexer and c.get("index_n_heads"):
        ih, idim = c["index_n_heads"], c["index_head_dim"]
        q_in = q_lora or h  # the indexer's queries come from the q latent (the hidden state without q LoRA)
        indexer = layers * (q_in * ih * idim + h * idim + 2 * idim)  # wq_b, wk, k_norm (LayerNorm: weight, bias)
        index_heads = layers * h * ih  # weights_proj
    parts = {
        "attention": attention * holding.weight_bytes,
        "indexer": indexer * holding.weight_bytes + index_heads * holding.index_heads_bytes,
        "dense_mlp": dense * 3 * h * c["intermediate_size"] * holding.weight_bytes,
        "shared_experts": moe * c.get("n_shared_experts", 0) * 3 * h * width * holding.weight_bytes,
        "router": moe * (experts * h + experts) * holding.router_bytes,
        "routed_experts": moe * top_k * 3 * h * width * holding.expert_bytes,
        "norms": (2 * layers + 1) * h * holding.weight_bytes,
        "embedding_row": h * holding.weight_bytes,
        "lm_head": vocab * h * holding.weight_bytes,
    }
    parts["total"] = sum(parts.values())
    return parts


def fraction_of_limit(tokens_per_s: float | None, bytes_per_token: float, bandwidth: float | None) -> float | None:
    """A decode rate as a fraction of bandwidth ÷ bytes per token (None where either is unknown)."""
    if not tokens_per_s or not bandwidth:
        return None
    return tokens_per_s * bytes_per_token / bandwidth


# ----------------------------------------------------------------------------------------------- bandwidth
@dataclass
class Bandwidth:
    threads: int
    bytes_per_s: float  # STREAM's copy convention: bytes read + bytes written, over the best repetition
    buffer_bytes: int
    repeats: int


def copy_bandwidth(threads: int, mib: int = 512, repeats: int = 5) -> Bandwidth:
    """Best of `repeats` copies of a `mib`-MiB buffer into another with torch on `threads` threads (sets torch's
    thread count: call it in a process of its own)."""
    import torch

    torch.set_num_threads(threads)
    n = mib * 2**20 // 4
    src, dst = torch.ones(n, dtype=torch.float32), torch.empty(n, dtype=torch.float32)
    dst.copy_(src)  # fault the pages in before timing
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return Bandwidth(threads, 2 * n * 4 / best, n * 4, repeats)


def measure(mib: int = 512, repeats: int = 5, python: str = sys.executable) -> dict:
    """{"1": Bandwidth, "<cpus>": Bandwidth} as dicts, each measured in a child process of `python`."""
    import subprocess

    out = {}
    for threads in sorted({1, os.cpu_count() or 1}):
        r = subprocess.run(
            [python, "-P", __file__, "--threads", str(threads), "--mib", str(mib), "--repeats", str(repeats)],
            capture_output=True,
            text=True,
            timeout=600,
        )
        if r.returncode != 0:
            raise RuntimeError(f"copy bandwidth on {threads} thread(s) failed: {r.stderr.strip()[-500:]}")
        out[str(threads)] = json.loads(r.stdout.strip().splitlines()[-1])
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="copy bandwidth of this machine (JSON)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--mib", type=int, default=512)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    print(json.dumps(asdict(copy_bandwidth(args.threads, args.mib, args.repeats))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
