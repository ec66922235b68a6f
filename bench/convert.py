"""`expertmesh checkpoint convert` throughput on a synthetic `small`-sized DeepSeek-V3.2-layout directory.

Writes a Hugging Face directory (model_type deepseek_v32, the `small` preset's widths: hidden 1024, 8 layers,
32 experts of width 512 per MoE layer) with seeded random bf16 weights under the published names and per-expert
`gate_proj/up_proj/down_proj`, converts it to MXFP4 experts, and reports GB/s of source tensor bytes read, with
the converting process's peak resident memory growth (all of it, and the anonymous part: mapped source pages are
page cache the kernel can drop). The converted directory is loaded afterwards and a few
logits compared with the source's (they must agree: the experts are the same values quantized once).

    python bench/convert.py [--quick] [--out bench/results/convert.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import resource
import tempfile
import threading
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from expertmesh.checkpoint.convert import convert_checkpoint
from expertmesh.checkpoint.hf_config import config_from_hf
from expertmesh.checkpoint.hf_layout import tensor_names
from expertmesh.checkpoint.loader import Checkpoint
from expertmesh.model.config import preset
from expertmesh.model.transformer import module_shapes


def small_deepseek_config(n_layers: int) -> dict:
    s = preset("small")
    return {
        "model_type": "deepseek_v32",
        "vocab_size": s.vocab_size,
        "hidden_size": s.hidden_size,
        "intermediate_size": s.dense_intermediate_size,
        "moe_intermediate_size": s.moe.expert_intermediate_size,
        "num_hidden_layers": n_layers,
        "num_attention_heads": s.mla.n_heads,
        "num_key_value_heads": s.mla.n_heads,
        "n_routed_experts": s.moe.n_routed_experts,
        "num_experts_per_tok": s.moe.top_k,
        "n_group": s.moe.n_group,
        "topk_group": s.moe.topk_group,
        "n_shared_experts": s.moe.n_shared_experts,
        "routed_scaling_factor": s.moe.routed_scaling_factor,
        "q_lora_rank": s.mla.q_lora_rank,
        "kv_lora_rank": s.mla.kv_lora_rank,
        "qk_nope_head_dim": s.mla.qk_nope_head_dim,
        "qk_rope_head_dim": s.mla.qk_rope_head_dim,
        "v_head_dim": s.mla.v_head_dim,
        "index_topk": s.indexer.index_topk,
        "index_head_dim": s.indexer.head_dim,
        "index_n_heads": s.indexer.n_heads,
        "first_k_dense_replace": s.first_k_dense,
        "max_position_embeddings": s.max_context,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e4},
    }


def write_synthetic(path: Path, raw: dict) -> int:
    """Random bf16 weights (fp32 for the routing tensors) under the published names, one shard per layer."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(raw))
    cfg = config_from_hf(raw, set(), name=path.name)
    shapes = module_shapes(cfg)
    gen = torch.Generator().manual_seed(0)
    shards: dict[str, dict[str, torch.Tensor]] = {}
    for ours, names in tensor_names(cfg).items():
        layer = ours.split(".")[1] if ours.startswith("layers.") else "embed"
        dtype = torch.float32 if ours.endswith(("router.weight", "router_bias", "index_w.weight")) else torch.bfloat16
        shards.setdefault(layer, {})[names[0]] = (torch.randn(shapes[ours], generator=gen) * 0.02).to(dtype)
    h, i = cfg.hidden_size, cfg.moe.expert_intermediate_size
    for layer in cfg.moe_layers:
        for e in range(cfg.moe.n_routed_experts):
            for proj, shape in (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i))):
                name = f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight"
                shards[str(layer)][name] = (torch.randn(shape, generator=gen) * 0.02).bfloat16()
    total = 0
    for key, tensors in shards.items():
        save_file(tensors, str(path / f"model-{key}.safetensors"))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    return total


def rss_anon_kib() -> int:
    """Resident anonymous memory (excludes the memory-mapped source pages, which the kernel can drop)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1])
    return 0


class PeakSampler(threading.Thread):
    def __init__(self):
        super().__init__(daemon=True)
        self.peak, self.stop = rss_anon_kib(), threading.Event()

    def run(self):
        while not self.stop.wait(0.01):
            self.peak = max(self.peak, rss_anon_kib())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="3 layers instead of 8")
    ap.add_argument("--out", default="bench/results/convert.json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = Path(tmp) / "src", Path(tmp) / "dst"
        # written by a child process, so this process's peak RSS afterwards is the converter's alone
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            src_bytes = pool.apply(write_synthetic, (src, small_deepseek_config(3 if args.quick else 8)))
        rss0, anon0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, rss_anon_kib()
        sampler = PeakSampler()
        sampler.start()
        t0 = time.perf_counter()
        report = convert_checkpoint(src, dst)
        wall = time.perf_counter() - t0
        sampler.stop.set()
        sampler.join()
        rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        a, b = Checkpoint(src).load_model(), Checkpoint(dst).load_model()
        prompt = list(range(3, 40))
        same = torch.equal(a.step(prompt, a.new_cache()), b.step(prompt, b.new_cache()))
    row = {
        "source_gb": src_bytes / 1e9,
        "read_gb": report.bytes_read / 1e9,
        "written_gb": report.bytes_written / 1e9,
        "seconds": wall,
        "gb_per_s": report.bytes_read / 1e9 / wall,
        "shards": report.shards,
        "peak_rss_growth_mib": (rss1 - rss0) / 1024,
        "peak_anon_growth_mib": (sampler.peak - anon0) / 1024,
        "logits_equal_after_convert": same,
    }
    print(
        f"{'source GB':>9}  {'read GB':>8}  {'written GB':>10}  {'seconds':>7}  {'GB/s':>6}  {'RSS +MiB':>8}  "
        f"{'anon +MiB':>9}  same"
    )
    print(
        f"{row['source_gb']:9.3f}  {row['read_gb']:8.3f}  {row['written_gb']:10.3f}  {row['seconds']:7.2f}  "
        f"{row['gb_per_s']:6.3f}  {row['peak_rss_growth_mib']:8.1f}  {row['peak_anon_growth_mib']:9.1f}  {same}"
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(row, indent=1) + "\n")


if __name__ == "__main__":
    main()
