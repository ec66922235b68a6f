"""Row-invariant bf16 projections on CPU: the current padded path vs the row-invariant C++ kernel, side by side.

  current  kernels.batch_invariant.linear_padded: rows padded to 16, oneDNN's prepacked weight
           (`mkldnn::_linear_pointwise`); bmm_padded: 16-row tiles through ATen's bf16 bmm
  kernel   kernels.linear.cpu_kernel (isa auto: AMX-BF16 tiles where the CPU has them, else fixed-order VDPBF16PS,
           else the same steps on fp32 FMAs with AVX-512 or AVX2; EXPERTMESH_CPU_LINEAR_ISA picks one; weight
           prepacked once for linear, read in place for bmm)

Shapes (K → N) are the peer benchmark model's bf16 projections (hidden 1024), rows M = 1, 4, 16, 64, 256, 1024;
bmm: MLA's absorbed per-head projections, x [16, M, 128] @ [16, 128, 512] and [16, M, 512] @ [16, 512, 128],
x a token-major strided view as the model passes it, M = 1, 16, 256. Median (or min) ms of interleaved repeats; GB/s =
weight bytes read once / time; GFLOP/s = 2·M·N·K / time (`--stat min`: best of the repeats instead of the median,
for a shared machine); `diff` = max |kernel − current| in bf16 ulps of the
output's magnitude (both round an fp32 sum once, in different orders).

    python bench/linear_cpu.py [--quick] [--stat median|min] [--out bench/results/linear_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from expertmesh.kernels import batch_invariant as bi
from expertmesh.kernels.linear import cpu_kernel

LINEAR_SHAPES = [
    (1024, 512),
    (512, 3072),
    (1024, 576),
    (512, 4096),
    (2048, 1024),
    (1024, 2816),
    (2816, 1024),
    (1024, 32000),
]  # (K, N)
BMM_SHAPES = [(16, 128, 512), (16, 512, 128)]  # (B, K, N)


STAT = {"median": statistics.median, "min": min}


def _time_pair(fns: dict, budget_s: float, stat: str, min_reps: int = 3, max_reps: int = 200) -> dict[str, float]:
    for fn in fns.values():  # warm-up (and first-use packing)
        fn()
    t0 = time.perf_counter()
    for fn in fns.values():
        fn()
    per = max(time.perf_counter() - t0, 1e-6)
    reps = int(min(max_reps, max(min_reps, budget_s / per)))
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(reps):  # interleaved: same machine load for both
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    return {k: STAT[stat](v) for k, v in times.items()}


def _ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a − b| over the bf16 ulp at max |b| (2^-7 of its power of two)."""
    ref = b.float().abs().max().item()
    if ref == 0:
        return 0.0
    ulp = 2.0 ** (torch.tensor(ref).log2().floor().item() - 7)
    return (a.float() - b.float()).abs().max().item() / ulp


def run(quick: bool, stat: str = "median") -> tuple[list[dict], list[dict]]:
    gen = torch.Generator().manual_seed(0)
    Ms = [1, 16, 256] if quick else [1, 4, 16, 64, 256, 1024]
    budget = 0.15 if quick else 0.4
    lin_rows = []
    for K, N in LINEAR_SHAPES:
        w = torch.nn.Parameter((torch.randn(N, K, generator=gen) * K**-0.5).bfloat16(), requires_grad=False)
        onednn = torch.ops.mkldnn._reorder_linear_weight(w.detach(), bi.ROW_TILE)
        packed = cpu_kernel.pack_weight(w)
        for M in Ms:
            x = torch.randn(M, K, generator=gen).bfloat16()
            fns = {
                "current": lambda: bi.linear_padded(x, w, None, onednn),
                "kernel": lambda: cpu_kernel.linear(x, packed, N, K),
            }
            t = _time_pair(fns, budget, stat)
            wbytes, flop = N * K * 2, 2 * M * N * K
            lin_rows.append(
                dict(
                    K=K,
                    N=N,
                    M=M,
                    current_ms=t["current"] * 1e3,
                    kernel_ms=t["kernel"] * 1e3,
                    current_gbs=wbytes / t["current"] / 1e9,
                    kernel_gbs=wbytes / t["kernel"] / 1e9,
                    current_gflops=flop / t["current"] / 1e9,
                    kernel_gflops=flop / t["kernel"] / 1e9,
                    speedup=t["current"] / t["kernel"],
                    diff_ulps=_ulps(fns["kernel"](), fns["current"]()),
                )
            )
    bmm_rows = []
    for B, K, N in BMM_SHAPES:
        w = (torch.randn(B, K, N, generator=gen) * K**-0.5).bfloat16()
        for M in [1, 16, 256]:
            x = torch.randn(M, B, K, generator=gen).bfloat16().transpose(0, 1)  # token-major, as the model
            fns = {"current": lambda: bi.bmm_padded(x, w), "kernel": lambda: cpu_kernel.bmm(x, w)}
            t = _time_pair(fns, budget, stat)
            wbytes, flop = B * N * K * 2, 2 * B * M * N * K
            bmm_rows.append(
                dict(
                    B=B,
                    K=K,
                    N=N,
                    M=M,
                    current_ms=t["current"] * 1e3,
                    kernel_ms=t["kernel"] * 1e3,
                    current_gbs=wbytes / t["current"] / 1e9,
                    kernel_gbs=wbytes / t["kernel"] / 1e9,
                    current_gflops=flop / t["current"] / 1e9,
                    kernel_gflops=flop / t["kernel"] / 1e9,
                    speedup=t["current"] / t["kernel"],
                    diff_ulps=_ulps(fns["kernel"](), fns["current"]()),
                )
            )
    return lin_rows, bmm_rows


def _print(title: str, rows: list[dict], shape: str) -> None:
    print(title)
    print(
        f"{shape:>16} {'M':>5} {'cur ms':>9} {'ker ms':>9} {'cur GB/s':>9} {'ker GB/s':>9} "
        f"{'cur GF/s':>9} {'ker GF/s':>9} {'speedup':>8} {'diff':>5}"
    )
    for r in rows:
        name = f"{r['K']}->{r['N']}" if "B" not in r else f"{r['B']}x{r['K']}->{r['N']}"
        print(
            f"{name:>16} {r['M']:>5} {r['current_ms']:>9.3f} {r['kernel_ms']:>9.3f} {r['current_gbs']:>9.1f} "
            f"{r['kernel_gbs']:>9.1f} {r['current_gflops']:>9.1f} {r['kernel_gflops']:>9.1f} "
            f"{r['speedup']:>7.2f}x {r['diff_ulps']:>5.1f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer row counts, shorter timing (smoke run)")
    parser.add_argument(
        "--stat",
        choices=list(STAT),
        default="median",
        help="per-shape time: median of the repeats, or min (best of n: robust on a shared machine)",
    )
    parser.add_argument("--out", default="bench/results/linear_cpu.json")
    args = parser.parse_args()
    if not cpu_kernel.available():
        raise SystemExit(
            f"the row-invariant kernel is not available here (enabled={cpu_kernel.enabled()}, "
            f"build error: {cpu_kernel.EXTENSION.build_error})"
        )
    lin, bmm = run(args.quick, args.stat)
    head = f"CPU, torch {torch.__version__}, {torch.get_num_threads()} threads, bf16, isa {cpu_kernel.default_isa()}, {args.stat} ms"
    _print(f"linear y[M,N] = x[M,K] @ w[N,K]^T — {head}", lin, "K->N")
    print()
    _print("bmm y[B,M,N] = x[B,M,K] @ w[B,K,N] (x strided, token-major)", bmm, "BxK->N")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = dict(
        torch=torch.__version__,
        threads=torch.get_num_threads(),
        cpus=os.cpu_count(),
        quick=args.quick,
        isa=cpu_kernel.default_isa(),
        stat=args.stat,
    )
    out.write_text(json.dumps(dict(meta=meta, linear=lin, bmm=bmm), indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
