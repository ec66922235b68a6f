"""All CPU kernel benchmarks in one run: grouped MXFP4 MoE GEMM, KDA chunked/recurrent, DSA decode curves, and the
fused CPU MXFP4 kernel against the box's copy bandwidth and llama.cpp's MXFP4 matmuls at the same shapes
(`mxfp4cpu`, defined here; llama.cpp's test-backend-ops is built on first use by bench/llamacpp.py, minutes, and
skipped with a message where it cannot be built or with --no-llamacpp).
Each other section is its own script (bench/kernels_{moe,kda,dsa}.py, which also run alone); this one runs them in
sequence, prints every table and writes one JSON file.

    python bench/kernels.py [--quick] [--only moe,kda,dsa,mxfp4cpu] [--no-llamacpp] [--out bench/results/kernels.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).parent
SECTIONS = ("moe", "kda", "dsa", "mxfp4cpu")


def _median_s(fn, repeats: int) -> float:
    import time

    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def _llamacpp(enabled: bool):
    """bench/llamacpp.py loaded, with its test-backend-ops built (minutes, once), or None with the reason printed."""
    if not enabled:
        print("mxfp4cpu: llama.cpp side-by-side off (--no-llamacpp / EXPERTMESH_LLAMACPP=0)")
        return None
    spec = importlib.util.spec_from_file_location("bench_llamacpp", HERE / "llamacpp.py")
    llamacpp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(llamacpp)
    try:
        llamacpp.exe = llamacpp.build()
    except llamacpp.Unavailable as exc:
        print(f"mxfp4cpu: llama.cpp's test-backend-ops cannot be built here, its columns stay empty: {exc}")
        return None
    return llamacpp


def run_mxfp4cpu(quick: bool, llamacpp: bool = True) -> list[dict]:
    """Decode shapes (one token), ours vs the box's copy bandwidth vs llama.cpp's MXFP4 MUL_MAT / MUL_MAT_ID
    (bench/llamacpp.py: ggml CPU backend, `test-backend-ops perf`, our shapes patched into its perf list).

    Each shape is timed cold and warm. cold: weights not cache-resident; ours cycles through 64 full-2.8t experts
    (564 MB) or 8 layers' worth of small-preset experts (256 experts, 135 MB); llama.cpp's cold projection is its
    MUL_MAT with 32 different 2304x7168 matrices per op (bs=[32,1], 282 MB), per matrix. warm: the same weights
    again and again, as test-backend-ops perf does (one node repeated in one graph: one 8.8 MB matrix, or the
    4 experts a MUL_MAT_ID call picks, stay in cache); llama.cpp's small MoE layer is its MUL_MAT_ID w13
    (1024x1024) + w2 (1024x512) times, ours is the whole fused layer (w13, SwiGLU, w2) in one call.
    GB/s: MXFP4 bytes (blocks + scales; ggml's block_mxfp4 is the same 17 bytes per 32 weights) per second.
    copy_GB_s: a preallocated tensor copy of the cold set's size, same run, counted as bytes copied.
    The box is shared, so the measurements are interleaved in rounds (ours, copy, llama.cpp per thread count per
    round) and each number is the best round (contention only adds time); medians are in the JSON.
    ours/copy: the goal is >= 0.4 cold. llama/ours = llama.cpp's ms / ours (< 1: ours slower; the goal >= 0.5)."""
    import torch

    from expertmesh.kernels.moe import (
        MXFP4Experts,
        cpu_kernel,
        moe_expert_outputs_cpu,
        moe_expert_outputs_grouped,
        set_dequant_cache_bytes,
    )
    from expertmesh.kernels.mxfp4 import dequantize_mxfp4

    if cpu_kernel.load() is None:
        print(f"mxfp4cpu: the fused CPU kernel is not built here ({cpu_kernel.build_error}); section skipped")
        return []
    lc = _llamacpp(llamacpp and os.environ.get("EXPERTMESH_LLAMACPP", "1") != "0")
    gen = torch.Generator().manual_seed(0)
    repeats = 3 if quick else 5
    rounds = 1 if quick else 3
    threads = torch.get_num_threads()
    thread_counts = sorted({1, threads})

    def rand_mxfp4(*shape):  # random codes, scales near 2^0 (the decode cost does not depend on the values)
        blocks = torch.randint(0, 256, (*shape[:-1], shape[-1] // 2), dtype=torch.uint8, generator=gen)
        scales = torch.randint(118, 127, (*shape[:-1], shape[-1] // 32), dtype=torch.uint8, generator=gen)
        return blocks, scales

    # one full-2.8t expert projection: W [2304, 7168] (rows x hidden) x one token; 64 experts to cycle through
    n_exp, N, K = 64, 2304, 7168
    pb, ps = rand_mxfp4(n_exp, N, K)
    px = torch.randn(1, K, generator=gen)
    p_bytes = pb[0].numel() + ps[0].numel()
    # the small preset's MoE layer at one token: 32 experts top-4, H 1024, I 512; 8 layers' worth of experts
    n_layers, E, H, I, Kt = 8, 32, 1024, 512, 4
    layers = [MXFP4Experts(*rand_mxfp4(E, 2 * I, H), *rand_mxfp4(E, H, I)) for _ in range(n_layers)]
    e_bytes = sum(t[0].numel() for t in layers[0])  # one expert's blocks + scales bytes (w13 + w2)
    calls = [
        (torch.randn(1, H, generator=gen), torch.randperm(E, generator=gen)[:Kt].reshape(1, Kt))
        for _ in range(n_layers)
    ]
    warm_reps = 16

    timings = {
        "proj_cold": lambda: [cpu_kernel.mxfp4_linear(px, pb[e], ps[e]) for e in range(n_exp)],
        "proj_warm": lambda: [cpu_kernel.mxfp4_linear(px, pb[0], ps[0]) for _ in range(warm_reps)],
        "layer_cold": lambda: [moe_expert_outputs_cpu(xi, ids, w) for (xi, ids), w in zip(calls, layers)],
        "layer_warm": lambda: [moe_expert_outputs_cpu(calls[0][0], calls[0][1], layers[0]) for _ in range(warm_reps)],
    }
    per_call = {"proj_cold": n_exp, "proj_warm": warm_reps, "layer_cold": n_layers, "layer_warm": warm_reps}
    copy_bytes = {"proj": n_exp * p_bytes, "layer": n_layers * E * e_bytes}
    src = torch.ones(max(copy_bytes.values()), dtype=torch.uint8)
    dst = torch.empty_like(src)

    ours: dict = {}  # (key, threads) -> [seconds per call, one per round]
    copy: dict = {}  # (proj|layer, threads) -> [GB/s, one per round]
    llama: dict = {}  # threads -> [llamacpp.run() dict, one per round]
    for r in range(rounds):
        for nt in thread_counts:
            torch.set_num_threads(nt)
            for key, fn in timings.items():
                fn()
                ours.setdefault((key, nt), []).append(_median_s(fn, repeats) / per_call[key])
            for what, nbytes in copy_bytes.items():
                s_, d_ = src[:nbytes], dst[:nbytes]
                d_.copy_(s_)
                copy.setdefault((what, nt), []).append(nbytes / _median_s(lambda: d_.copy_(s_), repeats) / 1e9)
            if lc is not None:
                try:
                    llama.setdefault(nt, []).append(lc.run(nt, lc.exe, upstream=(r == 0)))
                except lc.Unavailable as exc:
                    print(f"mxfp4cpu: llama.cpp perf run failed, its columns stay empty: {exc}")
                    lc = None
        torch.set_num_threads(threads)
    del src, dst

    def llama_ms(nt: int, keys: list[str], divide: int = 1) -> tuple[float | None, float | None]:
        """(best, median) over rounds of the sum of these cases' us/run, in ms, / divide."""
        runs = [sum(run[k]["us"] for k in keys) / 1e3 / divide for run in llama.get(nt, [])]
        if not runs:
            return None, None
        return min(runs), sorted(runs)[len(runs) // 2]

    shapes = [
        ("proj_cold", f"full-2.8t proj {N}x{K} T=1", "cold", p_bytes, "proj", (["proj_cold32"], 32)),
        ("proj_warm", f"full-2.8t proj {N}x{K} T=1", "warm", p_bytes, "proj", (["proj_warm"], 1)),
        ("layer_cold", f"small MoE layer E{E} top{Kt} {2 * I}x{H}+{H}x{I} T=1", "cold", Kt * e_bytes, "layer", None),
        (
            "layer_warm",
            f"small MoE layer E{E} top{Kt} {2 * I}x{H}+{H}x{I} T=1",
            "warm",
            Kt * e_bytes,
            "layer",
            (["small_w13", "small_w2"], 1),
        ),
    ]
    rows = []
    for key, shape, cache, nbytes, copy_key, lkeys in shapes:
        for nt in thread_counts:
            t = min(ours[(key, nt)])
            c = max(copy[(copy_key, nt)])
            l_best, l_med = llama_ms(nt, *lkeys) if lkeys else (None, None)
            rows.append(
                {
                    "shape": shape,
                    "cache": cache,
                    "threads": nt,
                    "isa": cpu_kernel.best_isa(),
                    "ms": 1e3 * t,
                    "ours_GB_s": nbytes / t / 1e9,
                    "copy_GB_s": c,
                    "ours/copy": nbytes / t / 1e9 / c,
                    "llama_ms": l_best,
                    "llama_GB_s": nbytes / (l_best / 1e3) / 1e9 if l_best else None,
                    "llama/ours": l_best / (1e3 * t) if l_best else None,
                    "ms_median": 1e3 * sorted(ours[(key, nt)])[len(ours[(key, nt)]) // 2],
                    "llama_ms_median": l_med,
                    "rounds": len(ours[(key, nt)]),
                }
            )
    # llama.cpp's own nearest MXFP4 perf cases (unpatched upstream list), first round only
    for nt in thread_counts:
        first = (llama.get(nt) or [{}])[0]
        for k in ("upstream_mm_4096x14336", "upstream_mmid_2880"):
            if k in first:
                rows.append(
                    {
                        "shape": f"llama.cpp {k}",
                        "cache": "warm",
                        "threads": nt,
                        "isa": None,
                        "ms": None,
                        "llama_ms": first[k]["us"] / 1e3,
                        "llama_params": first[k]["params"],
                    }
                )

    # the PyTorch path this kernel replaces, for reference: dequantise + GEMV; grouped path without its cache
    t_torch = (
        _median_s(
            lambda: [torch.nn.functional.linear(px, dequantize_mxfp4(pb[e], ps[e], torch.float32)) for e in range(4)], 1
        )
        / 4
    )
    set_dequant_cache_bytes(0)
    try:
        t_torch_layer = (
            _median_s(lambda: [moe_expert_outputs_grouped(xi, ids, w) for (xi, ids), w in zip(calls, layers)], 1)
            / n_layers
        )
    finally:
        set_dequant_cache_bytes(256 * 2**20)
    for row in rows:
        if row["cache"] == "cold" and row["threads"] == threads:
            row["torch_ms"] = 1e3 * (t_torch if row["shape"].startswith("full") else t_torch_layer)
    return rows


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_kernels_{name}", HERE / f"kernels_{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_HIDDEN = {"llama_params", "ms_median", "llama_ms_median", "rounds"}  # in the JSON, not the printed table


def _print_rows(title: str, rows: list[dict]) -> None:
    print(f"\n== {title} ==")
    if not rows:
        return
    keys = [k for k in dict.fromkeys(k for r in rows for k in r) if k not in _HIDDEN]  # union, first-seen order
    widths = {k: max(len(k), *(len(_fmt(r.get(k))) for r in rows)) for k in keys}
    print("  ".join(f"{k:>{widths[k]}}" for k in keys))
    for r in rows:
        print("  ".join(f"{_fmt(r.get(k)):>{widths[k]}}" for k in keys))


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--only", default=",".join(SECTIONS))
    p.add_argument("--out", default="bench/results/kernels.json")
    p.add_argument(
        "--no-llamacpp",
        action="store_true",
        help="mxfp4cpu: skip the llama.cpp side-by-side (otherwise built on first use, minutes)",
    )
    args = p.parse_args(argv)
    results = {}
    for name in [s for s in args.only.split(",") if s]:
        if name not in SECTIONS:
            p.error(f"--only: {name!r} is not one of {', '.join(SECTIONS)}")
        rows = run_mxfp4cpu(args.quick, not args.no_llamacpp) if name == "mxfp4cpu" else _load(name).run(args.quick)
        results[name] = rows
        _print_rows(f"kernels: {name}", rows)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1, default=str))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
