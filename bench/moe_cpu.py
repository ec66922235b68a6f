"""The fused CPU MoE kernel on bf16 activations, per path, side by side: the vector paths' order (avx512bf16:
MXFP4 decoded in registers into VDPBF16PS) against the tile unit's (amx: weights decoded to bf16 A tiles, 16
activation rows per B tile; experts with at most 8 rows emulate its order on the vector units).

The shape is one expert worker's share of the peer benchmark's model (bench/peer.py: 64 experts top-4, H 1024,
I 512, two expert workers): 32 experts, ids on half of a token's 4 slots, T tokens per call (1 and 8: decode;
256 and 1024: prefill steps). Each call decodes every expert it touches, so `MB/s` is the MXFP4 bytes of the
touched experts per second and `GFLOP/s` counts 2 · 3 · H · I per (token, slot). Those calls reuse one layer's
weights, warm in cache; a second table decodes as a worker does, cold: one worker's experts of 7 layers (64 each,
all 4 slots, ~360 MB), the layers in turn and fresh experts at random on every call, 1 and 2 tokens. Median ms over interleaved
repeats (both paths in each round); `x` = avx512bf16 ms / amx ms (> 1: amx faster). Skipped paths (no AMX-BF16 /
no AVX512-BF16 here) are left out with a message.

    python bench/moe_cpu.py [--quick] [--out bench/results/moe_cpu.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the benchmarks' own helpers (PYTHONSAFEPATH omits it)
from _report import write_json  # noqa: E402

from expertmesh.kernels.moe import MXFP4Experts, cpu_kernel  # noqa: E402

E, TOP_K, H, I = 32, 4, 1024, 512


def _ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer token counts and repeats (smoke run)")
    parser.add_argument("--out", default="bench/results/moe_cpu.json")
    args = parser.parse_args()
    if cpu_kernel.load() is None:
        raise SystemExit(f"the fused CPU kernel is not built here: {cpu_kernel.build_error}")
    paths = []
    for path, runs in (("avx512bf16", cpu_kernel.best_isa() == "avx512bf16"), ("amx", cpu_kernel.amx_runs())):
        if runs:
            paths.append(path)
        else:
            print(f"{path}: not on this CPU, left out")
    gen = torch.Generator().manual_seed(0)
    w = MXFP4Experts.quantize(
        torch.randn(E, 2 * I, H, generator=gen) * H**-0.5, torch.randn(E, H, I, generator=gen) * I**-0.5
    )
    expert_bytes = sum(t[0].numel() for t in w)
    tokens = (1, 8, 256) if args.quick else (1, 8, 16, 64, 256, 1024)
    repeats, rounds = (3, 1) if args.quick else (10, 3)
    rows = []
    for T in tokens:
        x = torch.randn(T, H, generator=gen).bfloat16()
        ids = torch.randint(0, 2 * E, (T, TOP_K), generator=gen)
        ids[ids >= E] = -1  # the other worker's half of the slots
        touched = int(ids[ids >= 0].unique().numel())
        times = {p: [] for p in paths}
        for _ in range(rounds):
            for p in paths:
                times[p].append(_ms(lambda: cpu_kernel.moe_expert_outputs(x, ids, w, isa=p), repeats))
        slots = int((ids >= 0).sum())
        for p in paths:
            ms = statistics.median(times[p])
            rows.append(
                {
                    "tokens": T,
                    "experts": touched,
                    "isa": p,
                    "ms": ms,
                    "MB_s": touched * expert_bytes / ms / 1e3,
                    "GFLOP_s": 6 * H * I * slots / ms / 1e6,
                }
            )
    print(f"CPU MoE kernel, bf16 activations, {E} experts H {H} I {I}, {torch.get_num_threads()} threads")
    print(f"{'tokens':>6} {'experts':>7} {'isa':>10} {'ms':>8} {'MB/s':>8} {'GFLOP/s':>8} {'x':>6}")
    by = {(r["tokens"], r["isa"]): r for r in rows}
    for r in rows:
        other = by.get((r["tokens"], "avx512bf16"))
        speedup = other["ms"] / r["ms"] if other and r["isa"] == "amx" else None
        r["x_vs_avx512bf16"] = speedup
        print(
            f"{r['tokens']:>6} {r['experts']:>7} {r['isa']:>10} {r['ms']:>8.3f} {r['MB_s']:>8.0f} "
            f"{r['GFLOP_s']:>8.1f} {'' if speedup is None else f'{speedup:.2f}':>6}"
        )
    cold = _cold_decode(paths, gen, calls=70 if args.quick else 420)
    write_json(args.out, args, rows=rows, cold=cold)


def _cold_decode(paths: list[str], gen: torch.Generator, calls: int, layers: int = 7, experts: int = 64) -> list:
    """Median / p90 ms per call of decode-sized calls on weights out of cache (see the module's docstring)."""
    weights = [
        MXFP4Experts.quantize(
            torch.randn(experts, 2 * I, H, generator=gen) * H**-0.5, torch.randn(experts, H, I, generator=gen) * I**-0.5
        )
        for _ in range(layers)
    ]
    rows = []
    print(f"cold decode: {layers} layers x {experts} experts in turn, {TOP_K} fresh experts a token, {calls} calls")
    print(f"{'tokens':>6} {'isa':>10} {'p50 ms':>8} {'p90 ms':>8}")
    for T in (1, 2):
        x = torch.randn(T, H, generator=gen).bfloat16()
        times = {p: [] for p in paths}
        for i in range(calls):
            for p in paths:  # each path its own experts: none left warm by the other
                ids = torch.stack([torch.randperm(experts, generator=gen)[:TOP_K] for _ in range(T)])
                t0 = time.perf_counter()
                cpu_kernel.moe_expert_outputs(x, ids, weights[i % layers], isa=p)
                times[p].append(1e3 * (time.perf_counter() - t0))
        for p in paths:
            v = sorted(times[p])
            rows.append({"tokens": T, "isa": p, "p50_ms": statistics.median(v), "p90_ms": v[9 * len(v) // 10]})
            print(f"{T:>6} {p:>10} {rows[-1]['p50_ms']:>8.3f} {rows[-1]['p90_ms']:>8.3f}")
    return rows


if __name__ == "__main__":
    main()
