"""Row norms and rotary embeddings on CPU: the PyTorch forms vs the one-op C++ kernel, side by side.

  naive    kernels.norm.naive (what expertmesh/model/transformer.py ran before: ~12-15 ATen ops per call, the rsqrt through
           kernels.batch_invariant.pointwise)
  kernel   kernels.norm.cpu_kernel (one op: kernels/norm/cpu/norm_rotary.cpp)

Per op (rms_norm, layer_norm, l2_normalize, rotary half / interleaved) at rows 1, 8, 256 and D 512, 1024, 7168,
bf16 and fp32 inputs (rotary: x [rows, D] with fp32 cos / sin [rows, D/2]): microseconds per call, the best of
interleaved repeats (a shared machine: the minimum is the least disturbed), one thread. `diff` = max |kernel −
naive| over max |naive| (rotary: 0, the same bits).

With --model: one decode step of the tiny preset model (a 16-token prompt, then one token) under torch.profiler,
the kernel on vs off: the number of top-level ops of the step (and of the norm / rotary ops among them), and the
step's best-of wall time.

    python bench/norm_cpu.py [--quick] [--model] [--out bench/results/norm_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from expertmesh.kernels.norm import cpu_kernel, naive

ROWS = [1, 8, 256]
WIDTHS = [512, 1024, 7168]
EPS = 1e-6


def _time_pair(fns: dict, budget_s: float, min_reps: int = 5, max_reps: int = 400, inner: int = 1) -> dict:
    for fn in fns.values():
        fn()
    t0 = time.perf_counter()
    for fn in fns.values():
        fn()
    per = max(time.perf_counter() - t0, 1e-7)
    inner = max(1, int(2e-4 / per))  # calls per timing: ≥ ~0.1 ms per sample
    reps = int(min(max_reps, max(min_reps, budget_s / (per * inner))))
    best = {k: float("inf") for k in fns}
    for _ in range(reps):  # interleaved: the same machine load for both
        for name, fn in fns.items():
            t = time.perf_counter()
            for _ in range(inner):
                fn()
            best[name] = min(best[name], (time.perf_counter() - t) / inner)
    return best


def _cases(gen, rows: int, d: int, dtype: torch.dtype):
    x = torch.randn(rows, d, generator=gen).to(dtype)
    w = (torch.randn(d, generator=gen) * 0.1 + 1).to(dtype)
    b = (torch.randn(d, generator=gen) * 0.1).to(dtype)
    cos, sin = torch.randn(rows, d // 2, generator=gen), torch.randn(rows, d // 2, generator=gen)
    return {
        "rms_norm": (lambda: naive.rms_norm(x, w, EPS), lambda: cpu_kernel.rms_norm(x, w, EPS)),
        "layer_norm": (lambda: naive.layer_norm(x, w, b, EPS), lambda: cpu_kernel.layer_norm(x, w, b, EPS)),
        "l2_normalize": (lambda: naive.l2_normalize(x, EPS), lambda: cpu_kernel.l2_normalize(x, EPS)),
        "rotary_half": (lambda: naive.rotary(x, cos, sin, False), lambda: cpu_kernel.rotary(x, cos, sin, False)),
        "rotary_interleaved": (lambda: naive.rotary(x, cos, sin, True), lambda: cpu_kernel.rotary(x, cos, sin, True)),
    }


def run_ops(quick: bool) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    budget = 0.05 if quick else 0.2
    out = []
    for dtype in (torch.bfloat16, torch.float32):
        for d in WIDTHS:
            for rows in ROWS:
                for op, (nv, kn) in _cases(gen, rows, d, dtype).items():
                    ref, got = nv().float(), kn().float()
                    diff = ((got - ref).abs().max() / ref.abs().max()).item()
                    t = _time_pair({"naive": nv, "kernel": kn}, budget)
                    out.append(
                        dict(
                            op=op,
                            dtype=str(dtype).removeprefix("torch."),
                            rows=rows,
                            D=d,
                            naive_us=t["naive"] * 1e6,
                            kernel_us=t["kernel"] * 1e6,
                            speedup=t["naive"] / t["kernel"],
                            diff=diff,
                        )
                    )
    return out


def run_model(quick: bool) -> dict:
    """Top-level op count and wall time of one decode step of the tiny model, kernel on vs off."""
    from expertmesh.model.config import preset
    from expertmesh.model.transformer import Transformer, init_random_

    model = init_random_(Transformer(preset("tiny")), seed=0)
    prompt = list(range(3, 19))
    res = {}
    saved = os.environ.get("EXPERTMESH_CPU_NORM_KERNEL")
    try:
        for label, env in (("naive", "0"), ("kernel", "1")):
            os.environ["EXPERTMESH_CPU_NORM_KERNEL"] = env
            cpu_kernel.refresh()

            def step():
                cache = model.new_cache()
                model.step(prompt, cache)
                return cache

            cache = step()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                model.step([7], cache)
            top = [e for e in prof.events() if e.cpu_parent is None]
            norm_ops = [e for e in top if e.name.startswith("expertmesh_norm_cpu::")]
            best = float("inf")
            for _ in range(5 if quick else 20):
                c = step()
                t = time.perf_counter()
                model.step([7], c)
                best = min(best, time.perf_counter() - t)
            res[label] = dict(top_level_ops=len(top), norm_kernel_ops=len(norm_ops), decode_step_ms=best * 1e3)
    finally:
        if saved is None:
            os.environ.pop("EXPERTMESH_CPU_NORM_KERNEL", None)
        else:
            os.environ["EXPERTMESH_CPU_NORM_KERNEL"] = saved
        cpu_kernel.refresh()
    res["layers"] = len(model.layers)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--model", action="store_true", help="also count the ops of a tiny-model decode step")
    ap.add_argument("--out", default="bench/results/norm_cpu.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if not cpu_kernel.available():
        raise SystemExit(f"the kernel is not available ({cpu_kernel.EXTENSION.build_error})")
    rows = run_ops(args.quick)
    print(f"{'op':<20}{'dtype':<10}{'rows':>6}{'D':>6}{'naive µs':>11}{'kernel µs':>11}{'×':>7}{'diff':>10}")
    for r in rows:
        print(
            f"{r['op']:<20}{r['dtype']:<10}{r['rows']:>6}{r['D']:>6}{r['naive_us']:>11.1f}{r['kernel_us']:>11.1f}"
            f"{r['speedup']:>7.1f}{r['diff']:>10.1e}"
        )
    result = {"threads": 1, "stat": "min of interleaved repeats", "ops": rows}
    if args.model:
        m = run_model(args.quick)
        result["tiny_model_decode_step"] = m
        print(f"\ntiny model ({m['layers']} layers), one decode step after a 16-token prompt:")
        for label in ("naive", "kernel"):
            v = m[label]
            print(
                f"  {label:<7} {v['top_level_ops']:>5} top-level ops ({v['norm_kernel_ops']} norm-kernel ops), "
                f"best {v['decode_step_ms']:.2f} ms"
            )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
