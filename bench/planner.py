"""Expert placement planner on the full-2.8t preset: 16 pods x 8 GPUs x 141 GiB, uniform vs Zipf(1.1) loads,
0 vs 8/16/32 redundant slots per layer — planning time, expected imbalance, and its ratio to no redundancy
(same loads, same run). Also a re-plan after losing one pod (previous plan given): time, moved shards.

    python bench/planner.py [--quick] [--out bench/results/planner.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from expertmesh.model.config import preset
from expertmesh.placement.planner import ClusterShape, plan_placement, zipf_loads

GIB = 2**30
PODS, GPUS, MEMORY_GIB = 16, 8, 141
REDUNDANT = (0, 8, 16, 32)


def _timed(fn, repeats: int):
    out, times = None, []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return out, statistics.median(times)


def run(quick: bool = False) -> list[dict]:
    cfg = preset("full-2.8t")
    shape = ClusterShape(PODS, GPUS, MEMORY_GIB * GIB, 0)
    repeats = 1 if quick else 5
    loads = {"uniform": None, "zipf-1.1": zipf_loads(cfg, s=1.1, seed=0)}
    rows: list[dict] = []
    plans = {}
    for name, arr in loads.items():
        base = None
        for r in REDUNDANT:
            plan, seconds = _timed(lambda: plan_placement(cfg, shape, r, arr), repeats)
            plans[name, r] = plan
            f = plan.figures
            base = base if base is not None else f.imbalance
            rows.append(
                {
                    "case": "plan",
                    "loads": name,
                    "pods": PODS,
                    "redundant": r,
                    "plan_s": seconds,
                    "physical": f.physical_experts,
                    "shards_gpu_min": f.shards_per_gpu_min,
                    "shards_gpu_max": f.shards_per_gpu_max,
                    "imbalance": f.imbalance,
                    "imbalance_worst": f.imbalance_worst_layer,
                    "imbalance_vs_r0": f.imbalance / base,
                    "moved": None,
                }
            )
    smaller = ClusterShape(PODS - 1, GPUS, MEMORY_GIB * GIB, 0)
    for name, arr in loads.items():
        prev = plans[name, 32]
        plan, seconds = _timed(lambda: plan_placement(cfg, smaller, 32, arr, previous=prev), repeats)
        f = plan.figures
        rows.append(
            {
                "case": "replan -1 pod",
                "loads": name,
                "pods": PODS - 1,
                "redundant": 32,
                "plan_s": seconds,
                "physical": f.physical_experts,
                "shards_gpu_min": f.shards_per_gpu_min,
                "shards_gpu_max": f.shards_per_gpu_max,
                "imbalance": f.imbalance,
                "imbalance_worst": f.imbalance_worst_layer,
                "imbalance_vs_r0": f.imbalance / plans[name, 0].figures.imbalance,
                "moved": f.moved_shards,
                "lost_pod_shards": len(prev.experts_of(PODS - 1)),
            }
        )
    return rows


def _print(rows: list[dict]) -> None:
    head = (
        f"{'case':<14} {'loads':<9} {'pods':>4} {'r':>3} {'plan ms':>8} {'physical':>8} {'shards/GPU':>10} "
        f"{'imbal':>7} {'worst':>7} {'vs r=0':>7} {'moved':>6}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        moved = "-" if r["moved"] is None else f"{r['moved']}"
        print(
            f"{r['case']:<14} {r['loads']:<9} {r['pods']:>4} {r['redundant']:>3} {r['plan_s'] * 1000:>8.0f} "
            f"{r['physical']:>8} {str(r['shards_gpu_min']) + '-' + str(r['shards_gpu_max']):>10} "
            f"{r['imbalance']:>7.3f} {r['imbalance_worst']:>7.3f} {r['imbalance_vs_r0']:>7.3f} {moved:>6}"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="one repeat per case")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "planner.json")
    args = p.parse_args()
    rows = run(args.quick)
    _print(rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "bench": "planner",
                "preset": "full-2.8t",
                "cluster": [PODS, GPUS, MEMORY_GIB],
                "quick": args.quick,
                "rows": rows,
            },
            indent=1,
        )
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
