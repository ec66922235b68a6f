"""KDA kernels on CPU: chunked prefill vs the step-by-step reference, recurrent decode vs the reference, and the
C++ prefill (`recurrent_steps_`, token by token: what the model runs on CPU) vs the chunked form it replaced.

Shapes follow the `small` preset's KDA layers (H=8 heads, K=V=128). Each row times the fast path and
the reference side by side in one run (interleaved, median of repeats) and checks they agree; the C++ prefill's
row has the chunked form in the `ref` column and its error against the reference recurrence.

    python bench/kernels_kda.py [--quick] [--out bench/results/kernels_kda.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from expertmesh.kernels.backend import use_backend
from expertmesh.kernels.kda import chunk_kda, fused_recurrent_kda, kda_recurrent_reference
from expertmesh.kernels.kda import cpu_kernel as kda_cpu

H, K, V = 8, 128, 128


def _inputs(B: int, T: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen)
    g = F.logsigmoid(2 * torch.randn(B, T, H, K, generator=gen) + 2)
    beta = torch.sigmoid(torch.randn(B, T, H, generator=gen))
    h0 = torch.randn(B, H, K, V, generator=gen) * 0.1
    return q, k, v, g, beta, h0


def _time_pair(fast, ref, repeats: int) -> tuple[float, float]:
    fast(), ref()  # warm-up
    tf, tr = [], []
    for _ in range(repeats):  # interleaved: same machine load for both
        t0 = time.perf_counter()
        fast()
        tf.append(time.perf_counter() - t0)  # noqa: E702
        t0 = time.perf_counter()
        ref()
        tr.append(time.perf_counter() - t0)  # noqa: E702
    return statistics.median(tf), statistics.median(tr)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def _row(op: str, B: int, T: int, fast_s: float, ref_s: float, rel_err: float, tokens: int) -> dict:
    return dict(
        op=op,
        B=B,
        T=T,
        H=H,
        K=K,
        V=V,
        fast_ms=fast_s * 1e3,
        ref_ms=ref_s * 1e3,
        speedup=ref_s / fast_s,
        tokens_per_s=tokens / fast_s,
        rel_err=rel_err,
    )


def run(quick: bool) -> list[dict]:
    rows: list[dict] = []
    repeats = 2 if quick else 3
    with use_backend("torch"):
        for T in [256] if quick else [2048]:
            q, k, v, g, beta, h0 = _inputs(1, T)
            fast = lambda: chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)  # noqa: E731
            ref = lambda: kda_recurrent_reference(q, k, v, g, beta, initial_state=h0, output_final_state=True)  # noqa: E731
            tf, tr = _time_pair(fast, ref, repeats)
            rows.append(_row("chunk_kda (prefill)", 1, T, tf, tr, _rel(fast()[0], ref()[0]), T))
            if kda_cpu.available():
                steps = lambda: kda_cpu.recurrent_steps_(q[0], k[0], v[0], g[0], beta[0], h0[0].clone())  # noqa: E731
                tf, tc = _time_pair(steps, fast, repeats)
                rows.append(_row("recurrent_steps_ vs chunk", 1, T, tf, tc, _rel(steps()[None], ref()[0]), T))
        for B in [1, 8] if quick else [1, 4, 8, 16, 32]:
            q, k, v, g, beta, h0 = _inputs(B, 1, seed=B)
            fast = lambda: fused_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)  # noqa: E731
            ref = lambda: kda_recurrent_reference(q, k, v, g, beta, initial_state=h0, output_final_state=True)  # noqa: E731
            tf, tr = _time_pair(fast, ref, repeats * 5)
            rows.append(_row("fused_recurrent_kda (decode)", B, 1, tf, tr, _rel(fast()[0], ref()[0]), B))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, fewer repeats (smoke run)")
    parser.add_argument("--out", default="bench/results/kernels_kda.json")
    args = parser.parse_args()
    rows = run(args.quick)
    print(f"KDA kernels, CPU, torch {torch.__version__}, {torch.get_num_threads()} threads, H={H} K={K} V={V}")
    print(f"{'op':30} {'B':>3} {'T':>5} {'fast ms':>9} {'ref ms':>9} {'speedup':>8} {'tok/s':>9} {'rel err':>8}")
    for r in rows:
        print(
            f"{r['op']:30} {r['B']:>3} {r['T']:>5} {r['fast_ms']:>9.2f} {r['ref_ms']:>9.2f} {r['speedup']:>7.1f}x "
            f"{r['tokens_per_s']:>9.0f} {r['rel_err']:>8.1e}"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = dict(torch=torch.__version__, threads=torch.get_num_threads(), cpus=os.cpu_count(), quick=args.quick)
    out.write_text(json.dumps(dict(meta=meta, rows=rows), indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
