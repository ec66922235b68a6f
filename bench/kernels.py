"""All CPU kernel benchmarks in one run: grouped MXFP4 MoE GEMM, KDA chunked/recurrent, DSA decode curves.
Each section is its own script (bench/kernels_{moe,kda,dsa}.py, which also run alone); this one runs them in
sequence, prints every table and writes one JSON file.

    python bench/kernels.py [--quick] [--only moe,kda,dsa] [--out bench/results/kernels.json]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

HERE = Path(__file__).parent
SECTIONS = ("moe", "kda", "dsa")


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
        rows = _load(name).run(args.quick)
        results[name] = rows
        _print_rows(f"kernels: {name}", rows)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1, default=str))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
