"""Grouped MXFP4 MoE expert GEMM on CPU: grouped fast path vs the reference, and the MXFP4 cost vs the same
grouped GEMM on pre-dequantised fp32 / bf16 weights.

Sizes are the `small` preset's routed experts (H=1024, I=512, E=32, top-4), random routing, decode
T = 1, 4, 16, 64 and prefill T = 2048. Columns (median ms of interleaved repeats, same run, same load):
  ref        naive reference (per-expert loop, dequantise, gather)
  mxfp4      grouped path, dequant cache OFF: MXFP4 weights decoded on every call (what the bytes cost)
  cached     grouped path, dequant cache warm (decoded experts reused)
  fp32/bf16  the same grouped GEMM on weights dequantised once up front (fp32; bf16 GEMMs)
Ratios: ref/mxfp4 (fast-path speed-up), mxfp4/fp32 and mxfp4/bf16 (MXFP4 overhead); rel err vs the reference.
`--activation situ` runs every column with Kimi K3's SiTU (β = 4, β_lin = 25) in place of SwiGLU.

    python bench/kernels_moe.py [--quick] [--activation swiglu|situ] [--out bench/results/kernels_moe.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from expertmesh.kernels.activation import SWIGLU, GatedActivation
from expertmesh.kernels.backend import use_backend
from expertmesh.kernels.moe import (
    MXFP4Experts,
    moe_expert_outputs_dense,
    moe_expert_outputs_grouped,
    moe_expert_outputs_reference,
    set_dequant_cache_bytes,
)
from expertmesh.kernels.mxfp4 import dequantize_mxfp4, quantize_mxfp4


def _sizes() -> tuple[int, int, int, int, str]:
    try:
        from expertmesh.model.config import preset

        cfg = preset("small")
        return (
            cfg.hidden_size,
            cfg.moe.expert_intermediate_size,
            cfg.moe.n_routed_experts,
            cfg.moe.top_k,
            "expertmesh.model.config small",
        )
    except Exception:  # the preset module may not be importable in every checkout
        return 1024, 512, 32, 4, "built-in small sizes"


def _time_all(fns: dict, repeats: int) -> dict[str, float]:
    for fn in fns.values():  # warm-up
        fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):  # interleaved: same machine load for all
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


ACTIVATIONS = {"swiglu": SWIGLU, "situ": GatedActivation("situ", beta=4.0, linear_beta=25.0)}


def run(quick: bool, activation: str = "swiglu") -> list[dict]:
    act = ACTIVATIONS[activation]
    H, I, E, K, source = _sizes()
    gen = torch.Generator().manual_seed(0)
    w13 = quantize_mxfp4(torch.randn(E, 2 * I, H, generator=gen) * H**-0.5)
    w2 = quantize_mxfp4(torch.randn(E, H, I, generator=gen) * I**-0.5)
    w13_f32, w2_f32 = dequantize_mxfp4(*w13, torch.float32), dequantize_mxfp4(*w2, torch.float32)
    w13_bf16, w2_bf16 = w13_f32.bfloat16(), w2_f32.bfloat16()
    experts = MXFP4Experts(*w13, *w2)
    rows = []
    Ts = [1, 16, 256] if quick else [1, 4, 16, 64, 2048]
    with use_backend("torch"):
        for T in Ts:
            x = torch.randn(T, H, generator=gen)
            ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
            repeats = (3 if quick else 5) if T >= 256 else (5 if quick else 15)

            def mxfp4_nocache():
                set_dequant_cache_bytes(0)
                return moe_expert_outputs_grouped(x, ids, experts, activation=act)

            fns = {
                "ref": lambda: moe_expert_outputs_reference(x, ids, experts, activation=act),
                "mxfp4": mxfp4_nocache,
                "fp32": lambda: moe_expert_outputs_dense(x, ids, w13_f32, w2_f32, activation=act),
                "bf16": lambda: moe_expert_outputs_dense(x, ids, w13_bf16, w2_bf16, activation=act),
            }
            t = _time_all(fns, repeats)
            set_dequant_cache_bytes(1 << 30)  # the warm-up call fills it
            t_cached = _time_all(
                {"cached": lambda: moe_expert_outputs_grouped(x, ids, experts, activation=act)}, repeats
            )["cached"]
            set_dequant_cache_bytes(256 * 2**20)
            ref = moe_expert_outputs_reference(x, ids, experts, activation=act)
            got = moe_expert_outputs_grouped(x, ids, experts, activation=act)
            got_bf16 = moe_expert_outputs_dense(x, ids, w13_bf16, w2_bf16, activation=act)
            rows.append(
                dict(
                    phase="decode" if T <= 64 else "prefill",
                    T=T,
                    H=H,
                    I=I,
                    E=E,
                    K=K,
                    activation=activation,
                    experts_hit=int(torch.unique(ids).numel()),
                    ref_ms=t["ref"] * 1e3,
                    mxfp4_ms=t["mxfp4"] * 1e3,
                    cached_ms=t_cached * 1e3,
                    fp32_ms=t["fp32"] * 1e3,
                    bf16_ms=t["bf16"] * 1e3,
                    speedup_vs_ref=t["ref"] / t["mxfp4"],
                    mxfp4_over_fp32=t["mxfp4"] / t["fp32"],
                    mxfp4_over_bf16=t["mxfp4"] / t["bf16"],
                    tokens_per_s=T / t["mxfp4"],
                    rel_err=_rel(got, ref),
                    bitwise_equal_ref=bool(torch.equal(got, ref)),
                    bf16_rel_err=_rel(got_bf16, ref),
                    sizes_from=source,
                )
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes, fewer repeats (smoke run)")
    parser.add_argument(
        "--activation",
        choices=list(ACTIVATIONS),
        default="swiglu",
        help="the experts' gated activation (situ: Kimi K3's, β = 4, β_lin = 25)",
    )
    parser.add_argument("--out", default="bench/results/kernels_moe.json")
    args = parser.parse_args()
    rows = run(args.quick, args.activation)
    r0 = rows[0]
    print(
        f"MoE grouped MXFP4 GEMM, CPU, torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"H={r0['H']} I={r0['I']} E={r0['E']} top-{r0['K']} ({r0['sizes_from']}), {args.activation}; times in ms"
    )
    print(
        f"{'phase':8} {'T':>5} {'exp':>4} {'ref':>8} {'mxfp4':>8} {'cached':>8} {'fp32':>8} {'bf16':>8} "
        f"{'ref/mx':>7} {'mx/fp32':>8} {'mx/bf16':>8} {'rel err':>8} {'==ref':>6}"
    )
    for r in rows:
        print(
            f"{r['phase']:8} {r['T']:>5} {r['experts_hit']:>4} {r['ref_ms']:>8.2f} {r['mxfp4_ms']:>8.2f} "
            f"{r['cached_ms']:>8.2f} {r['fp32_ms']:>8.2f} {r['bf16_ms']:>8.2f} {r['speedup_vs_ref']:>6.2f}x "
            f"{r['mxfp4_over_fp32']:>7.2f}x {r['mxfp4_over_bf16']:>7.2f}x {r['rel_err']:>8.1e} "
            f"{str(r['bitwise_equal_ref']):>6}"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = dict(
        torch=torch.__version__,
        threads=torch.get_num_threads(),
        cpus=os.cpu_count(),
        quick=args.quick,
        activation=args.activation,
    )
    out.write_text(json.dumps(dict(meta=meta, rows=rows), indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
