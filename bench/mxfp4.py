"""MXFP4 quantise / dequantise throughput on CPU (GB/s of bf16 data in or out), PyTorch path.

Sizes are expert-weight shaped: one `small` expert matrix up to a whole layer's gate_up. Each row checks the
round trip (dequantise(quantise(x)) error) so a fast wrong run would show.

    python bench/mxfp4.py [--quick] [--out bench/results/mxfp4.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from expertmesh.kernels.backend import use_backend
from expertmesh.kernels.mxfp4 import dequantize_mxfp4, quantize_mxfp4


def _median_time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run(quick: bool) -> list[dict]:
    sizes = [(1024, 1024), (4, 1024, 1024)] if quick else [(1024, 1024), (1024, 512), (8, 1024, 1024), (32, 1024, 1024)]
    repeats = 2 if quick else 5
    rows = []
    gen = torch.Generator().manual_seed(0)
    with use_backend("torch"):
        for shape in sizes:
            x = (torch.randn(*shape, generator=gen) * 0.02).bfloat16()
            n = x.numel()
            blocks, scales = quantize_mxfp4(x)
            tq = _median_time(lambda: quantize_mxfp4(x), repeats)
            td = _median_time(lambda: dequantize_mxfp4(blocks, scales, torch.bfloat16), repeats)
            td32 = _median_time(lambda: dequantize_mxfp4(blocks, scales, torch.float32), repeats)
            y = dequantize_mxfp4(blocks, scales, torch.float32)
            rel = ((y - x.float()).norm() / x.float().norm()).item()
            rows.append(
                dict(
                    shape=list(shape),
                    elements=n,
                    quantize_ms=tq * 1e3,
                    quantize_gbps=2 * n / tq / 1e9,
                    dequant_bf16_ms=td * 1e3,
                    dequant_bf16_gbps=2 * n / td / 1e9,
                    dequant_fp32_ms=td32 * 1e3,
                    dequant_fp32_gbps=4 * n / td32 / 1e9,
                    roundtrip_rel_err=rel,
                )
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, fewer repeats (smoke run)")
    parser.add_argument("--out", default="bench/results/mxfp4.json")
    args = parser.parse_args()
    rows = run(args.quick)
    print(
        f"MXFP4, CPU, torch {torch.__version__}, {torch.get_num_threads()} threads (GB/s of bf16 in/out; "
        f"fp32 dequant counts fp32 bytes)"
    )
    print(
        f"{'shape':>16} {'quant ms':>9} {'GB/s':>6} {'deq bf16 ms':>12} {'GB/s':>6} {'deq fp32 ms':>12} {'GB/s':>6} "
        f"{'rt err':>7}"
    )
    for r in rows:
        shape = "x".join(map(str, r["shape"]))
        print(
            f"{shape:>16} {r['quantize_ms']:>9.2f} {r['quantize_gbps']:>6.2f} {r['dequant_bf16_ms']:>12.2f} "
            f"{r['dequant_bf16_gbps']:>6.2f} {r['dequant_fp32_ms']:>12.2f} {r['dequant_fp32_gbps']:>6.2f} "
            f"{r['roundtrip_rel_err']:>7.3f}"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = dict(torch=torch.__version__, threads=torch.get_num_threads(), cpus=os.cpu_count(), quick=args.quick)
    out.write_text(json.dumps(dict(meta=meta, rows=rows), indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
