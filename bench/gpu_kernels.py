"""GPU kernel benchmark (runs only where CUDA is present): achieved HBM bandwidth and TFLOP/s of each Triton
kernel at `full-2.8t` layer shapes, next to the device's measured copy bandwidth and bf16 matmul rate and
torch's dense bf16 equivalent, after checking each kernel against its PyTorch reference on fresh random inputs.

    python bench/gpu_kernels.py [--quick] [--out bench/results/gpu_kernels.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

REL_TOL = 2e-2  # bf16 kernels vs their references (relative L2 error); more fails the run


def timed(fn, iters: int = 20) -> float:
    """Median seconds per call, CUDA events, after warm-up."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return sorted(times)[len(times) // 2]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30))


def device_roofline() -> dict:
    n = 1 << 28  # 1 GiB of bf16
    src = torch.empty(n, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    t = timed(lambda: dst.copy_(src))
    copy_gbs = 2 * src.numel() * 2 / t / 1e9
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    t = timed(lambda: a @ a, iters=10)
    return {"copy_GBps": copy_gbs, "bf16_matmul_TFLOPs": 2 * 8192**3 / t / 1e12}


def bench_moe(cfg, quick: bool) -> list[dict]:
    from expertmesh.kernels.backend import use_backend
    from expertmesh.kernels.moe import MXFP4Experts, moe_expert_outputs
    from expertmesh.kernels.mxfp4 import dequantize_mxfp4, quantize_mxfp4

    h, i = cfg.hidden_size, cfg.moe.expert_intermediate_size
    e = 16 if quick else 64  # one expert worker GPU's shard of a layer
    g = torch.Generator(device="cuda").manual_seed(0)
    w13b, w13s = quantize_mxfp4(torch.randn(e, 2 * i, h, device="cuda", generator=g) * 0.02)
    w2b, w2s = quantize_mxfp4(torch.randn(e, h, i, device="cuda", generator=g) * 0.02)
    dense13 = dequantize_mxfp4(w13b, w13s, torch.bfloat16)
    dense2 = dequantize_mxfp4(w2b, w2s, torch.bfloat16)
    experts = MXFP4Experts(w13b, w13s, w2b, w2s)
    rows = []
    for t in (1, 16, 64) if quick else (1, 4, 16, 64, 256):
        x = torch.randn(t, h, device="cuda", generator=g, dtype=torch.bfloat16)
        ids = torch.randint(0, e, (t, cfg.moe.top_k), device="cuda", generator=g)
        with use_backend("triton"):
            out = moe_expert_outputs(x, ids, experts)
            sec = timed(lambda: moe_expert_outputs(x, ids, experts))
        with use_backend("torch"):
            ref = moe_expert_outputs(x, ids, experts)
        used = int(ids.unique().numel())
        weight_bytes = used * (w13b[0].numel() + w13s[0].numel() + w2b[0].numel() + w2s[0].numel())
        flops = 2 * t * cfg.moe.top_k * 3 * h * i

        def dense():
            for k in range(cfg.moe.top_k):
                sel = ids[:, k]
                gu = torch.bmm(x[:, None, :], dense13[sel].transpose(1, 2))[:, 0]
                a = torch.nn.functional.silu(gu[:, :i]) * gu[:, i:]
                torch.bmm(a[:, None, :], dense2[sel].transpose(1, 2))

        rows.append(
            {
                "op": "moe_mxfp4",
                "T": t,
                "rel_err": rel_err(out, ref),
                "ms": sec * 1e3,
                "GBps": weight_bytes / sec / 1e9,
                "TFLOPs": flops / sec / 1e12,
                "dense_bf16_ms": timed(dense) * 1e3,
            }
        )
    return rows


def bench_dsa(cfg, quick: bool) -> list[dict]:
    from expertmesh.kernels.backend import use_backend
    from expertmesh.kernels.dsa import dsa_decode_paged

    m, ix = cfg.mla, cfg.indexer
    d, hq, bs = m.kv_lora_rank + m.qk_rope_head_dim, m.n_heads, 64
    g = torch.Generator(device="cuda").manual_seed(1)
    rows = []
    for ctx in (4096, 32768) if quick else (4096, 16384, 65536, 131072):
        nb = ctx // bs
        kv = torch.randn(nb, bs, d, device="cuda", generator=g, dtype=torch.bfloat16)
        ik = torch.randn(nb, bs, ix.head_dim, device="cuda", generator=g, dtype=torch.bfloat16)
        q = torch.randn(1, hq, d, device="cuda", generator=g, dtype=torch.bfloat16)
        iq = torch.randn(1, ix.n_heads, ix.head_dim, device="cuda", generator=g, dtype=torch.bfloat16)
        iw = torch.randn(1, ix.n_heads, device="cuda", generator=g)
        table = torch.randperm(nb, device="cuda", generator=g).int()[None]
        lens = torch.tensor([ctx], device="cuda", dtype=torch.int32)
        args = (q, kv, ik, table, lens, iq, iw, ix.index_topk)
        kw = {"scale": (m.qk_nope_head_dim + m.qk_rope_head_dim) ** -0.5, "v_dim": m.kv_lora_rank}
        with use_backend("triton"):
            out = dsa_decode_paged(*args, **kw)
            sec = timed(lambda: dsa_decode_paged(*args, **kw))
        with use_backend("torch"):
            ref = dsa_decode_paged(*args, **kw)
        read = ctx * ix.head_dim * 2 + min(ctx, ix.index_topk) * d * 2  # index keys + selected entries
        dense_q, dense_kv = q.float(), kv.reshape(-1, d).float()

        def dense():
            p = torch.softmax(dense_q @ dense_kv.T * kw["scale"], dim=-1)
            return p @ dense_kv[:, : m.kv_lora_rank]

        rows.append(
            {
                "op": "dsa_decode",
                "context": ctx,
                "rel_err": rel_err(out, ref),
                "ms": sec * 1e3,
                "GBps": read / sec / 1e9,
                "dense_mla_ms": timed(dense) * 1e3,
            }
        )
    return rows


def bench_kda(cfg, quick: bool) -> list[dict]:
    from expertmesh.kernels.backend import use_backend
    from expertmesh.kernels.kda import chunk_kda, fused_recurrent_kda

    a = cfg.kda
    g = torch.Generator(device="cuda").manual_seed(2)
    rows = []
    for fn, b, t in ((fused_recurrent_kda, 32, 1), (chunk_kda, 1, 1024 if quick else 4096)):
        shape = (b, t, a.n_heads, a.head_dim)
        q = torch.nn.functional.normalize(torch.randn(shape, device="cuda", generator=g), dim=-1)
        k = torch.nn.functional.normalize(torch.randn(shape, device="cuda", generator=g), dim=-1)
        v = torch.randn(shape, device="cuda", generator=g)
        gate = -torch.rand(shape, device="cuda", generator=g) * 0.1
        beta = torch.rand(b, t, a.n_heads, device="cuda", generator=g)
        s0 = torch.randn(b, a.n_heads, a.head_dim, a.head_dim, device="cuda", generator=g) * 0.1
        call = lambda: fn(q, k, v, gate, beta, initial_state=s0, output_final_state=True)  # noqa: E731
        with use_backend("triton"):
            out, _ = call()
            sec = timed(call)
        with use_backend("torch"):
            ref, _ = call()
        state_bytes = 2 * b * a.n_heads * a.head_dim * a.head_dim * 4
        io_bytes = 4 * (q.numel() * 4 + beta.numel())
        rows.append(
            {
                "op": fn.__name__,
                "B": b,
                "T": t,
                "rel_err": rel_err(out, ref),
                "ms": sec * 1e3,
                "GBps": (state_bytes + io_bytes) / sec / 1e9,
            }
        )
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default="bench/results/gpu_kernels.json")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/gpu_kernels.py: no CUDA device here; nothing to measure")
        return 0
    from expertmesh.model.config import preset

    cfg = preset("full-2.8t")
    roof = device_roofline()
    print(
        f"device {torch.cuda.get_device_name()}: copy {roof['copy_GBps']:.0f} GB/s, "
        f"bf16 matmul {roof['bf16_matmul_TFLOPs']:.0f} TFLOP/s"
    )
    rows = bench_moe(cfg, args.quick) + bench_dsa(cfg, args.quick) + bench_kda(cfg, args.quick)
    for r in rows:
        r["pct_of_copy_bw"] = 100 * r["GBps"] / roof["copy_GBps"]
        print("  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"device": roof, "rows": rows}, indent=1))
    print(f"wrote {args.out}")
    bad = [r for r in rows if not r["rel_err"] <= REL_TOL]
    for r in bad:
        print(f"FAILED: {r['op']} differs from its PyTorch reference: rel_err {r['rel_err']:.3g} > {REL_TOL}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
