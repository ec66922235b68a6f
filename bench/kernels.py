"""All CPU kernel benchmarks in one run: grouped MXFP4 MoE GEMM, KDA chunked/recurrent, DSA decode curves, and the
fused CPU MXFP4 kernel against the box's copy bandwidth (`mxfp4cpu`, defined here).
Each other section is its own script (bench/kernels_{moe,kda,dsa}.py, which also run alone); this one runs them in
sequence, prints every table and writes one JSON file.

    python bench/kernels.py [--quick] [--only moe,kda,dsa,mxfp4cpu] [--out bench/results/kernels.json]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
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


def run_mxfp4cpu(quick: bool) -> list[dict]:
    """Decode shapes, weights not cache-resident (each timed pass cycles through >= 64 experts' MXFP4 bytes):
    GB/s of MXFP4 bytes (blocks + scales) read per second by the fused kernel, next to the box's copy rate (a
    same-sized preallocated tensor copy, measured in the same run; counted as bytes copied, i.e. read once and
    written once) and the PyTorch path it replaces (torch_ms: dequantise + GEMV; the grouped path with its
    dequantised-weight cache off)."""
    import torch

    from expertmesh.kernels.moe import (
        cpu_kernel,
        moe_expert_outputs_cpu,
        moe_expert_outputs_grouped,
        set_dequant_cache_bytes,
    )
    from expertmesh.kernels.mxfp4 import dequantize_mxfp4

    if cpu_kernel.load() is None:
        print(f"mxfp4cpu: the fused CPU kernel is not built here ({cpu_kernel.build_error}); section skipped")
        return []
    gen = torch.Generator().manual_seed(0)
    repeats = 3 if quick else 5
    rows = []

    def rand_mxfp4(*shape):   # random codes, scales near 2^0 (the decode cost does not depend on the values)
        blocks = torch.randint(0, 256, (*shape[:-1], shape[-1] // 2), dtype=torch.uint8, generator=gen)
        scales = torch.randint(118, 127, (*shape[:-1], shape[-1] // 32), dtype=torch.uint8, generator=gen)
        return blocks, scales

    def copy_gbps(nbytes: int) -> float:
        src = torch.ones(nbytes, dtype=torch.uint8)
        dst = torch.empty_like(src)
        dst.copy_(src)
        return nbytes / _median_s(lambda: dst.copy_(src), repeats) / 1e9

    threads = torch.get_num_threads()
    # 1) one full-2.8t expert projection: W [2304, 7168] (rows x hidden) x one token, cycling through 64 experts
    n_exp, N, K = 64, 2304, 7168
    b, sc = rand_mxfp4(n_exp, N, K)
    x = torch.randn(1, K, generator=gen)
    per = b[0].numel() + sc[0].numel()
    for nt in sorted({1, threads}):
        torch.set_num_threads(nt)
        copy = copy_gbps(n_exp * per)
        cycle = lambda: [cpu_kernel.mxfp4_linear(x, b[e], sc[e]) for e in range(n_exp)]   # noqa: E731
        cycle()
        t = _median_s(cycle, repeats) / n_exp
        rows.append({"shape": f"full-2.8t proj {N}x{K} T=1", "threads": nt, "isa": cpu_kernel.best_isa(),
                     "ms": 1e3 * t, "ours_GB_s": per / t / 1e9, "copy_GB_s": copy,
                     "ours/copy": per / t / 1e9 / copy, "torch_ms": None})
    torch.set_num_threads(threads)
    # torch path for reference: dequantise + GEMV (few experts: it is slow), one thread count
    t_torch = _median_s(lambda: [torch.nn.functional.linear(x, dequantize_mxfp4(b[e], sc[e], torch.float32))
                                 for e in range(4)], 1) / 4
    rows[-1]["torch_ms"] = 1e3 * t_torch
    del b, sc
    # 2) the small preset's MoE layer at one token: 32 experts top-4, H 1024, I 512; 8 layers' worth of experts
    #    (256 experts, ~215 MB) so each call's 4 experts are cold
    n_layers, E, H, I, Kt = 8, 32, 1024, 512, 4
    layers = [(*rand_mxfp4(E, 2 * I, H), *rand_mxfp4(E, H, I)) for _ in range(n_layers)]
    per_expert = sum(t[0].numel() for t in layers[0])             # one expert's blocks + scales bytes
    calls = [(torch.randn(1, H, generator=gen), torch.randperm(E, generator=gen)[:Kt].reshape(1, Kt))
             for _ in range(n_layers)]
    for nt in sorted({1, threads}):
        torch.set_num_threads(nt)
        copy = copy_gbps(n_layers * E * per_expert)
        cycle = lambda: [moe_expert_outputs_cpu(xi, ids, *w) for (xi, ids), w in zip(calls, layers)]  # noqa: E731
        cycle()
        t = _median_s(cycle, repeats) / n_layers
        rows.append({"shape": f"small MoE layer E{E} top{Kt} {H}x{I} T=1", "threads": nt,
                     "isa": cpu_kernel.best_isa(), "ms": 1e3 * t, "ours_GB_s": Kt * per_expert / t / 1e9,
                     "copy_GB_s": copy, "ours/copy": Kt * per_expert / t / 1e9 / copy, "torch_ms": None})
    torch.set_num_threads(threads)
    set_dequant_cache_bytes(0)      # the PyTorch path without its dequantised-weight cache (cold weights)
    try:
        t_torch = _median_s(lambda: [moe_expert_outputs_grouped(xi, ids, *w)
                                     for (xi, ids), w in zip(calls, layers)], 1) / n_layers
    finally:
        set_dequant_cache_bytes(256 * 2**20)
    rows[-1]["torch_ms"] = 1e3 * t_torch
    return rows


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_kernels_{name}", HERE / f"kernels_{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _print_rows(title: str, rows: list[dict]) -> None:
    print(f"\n== {title} ==")
    if not rows:
        return
    keys = list(rows[0])
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
    args = p.parse_args(argv)
    results = {}
    for name in [s for s in args.only.split(",") if s]:
        if name not in SECTIONS:
            p.error(f"--only: {name!r} is not one of {', '.join(SECTIONS)}")
        rows = run_mxfp4cpu(args.quick) if name == "mxfp4cpu" else _load(name).run(args.quick)
        results[name] = rows
        _print_rows(f"kernels: {name}", rows)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1, default=str))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
