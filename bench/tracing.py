"""Tracing overhead: decode tokens/s of the in-process engine with tracing off, on with per-layer spans on
every step, and at the default setting (per-layer spans on one step in 16), each mode in its own process
(a process has one tracer provider), spans exported to a sink that drops them (what is measured is the cost
of making and ending spans, not of the network).

    python bench/tracing.py [--quick] [--out bench/results/tracing.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

MODES = {
    "off": {},
    "default (layers 1/16)": {"EXPERTMESH_TRACE_LAYER_EVERY": "16"},
    "every step": {"EXPERTMESH_TRACE_LAYER_EVERY": "1"},
}


def child(ckpt: str, mode: str, requests: int, tokens: int) -> None:
    import time

    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    from expertmesh.entry.local import build_local_engine
    from expertmesh.runtime import telemetry
    from expertmesh.wire.sampling_params import SamplingParams

    class Sink(SpanExporter):
        def export(self, spans):
            return SpanExportResult.SUCCESS

    if mode != "off":
        telemetry._extra_processors.append(BatchSpanProcessor(Sink()))
        telemetry.setup_tracing("expertmesh-router", force=True)
    eng = build_local_engine(ckpt, attention_workers=1, expert_workers=2)
    tracer = telemetry.tracer()

    def batch():
        reqs = []
        for i in range(requests):
            if mode == "off":
                reqs.append(eng.submit([1 + i, 2, 3, 4], SamplingParams(max_tokens=tokens)))
            else:
                with tracer.start_as_current_span("chat bench"):
                    reqs.append(eng.submit([1 + i, 2, 3, 4], SamplingParams(max_tokens=tokens)))
        for r in reqs:
            r.wait(300)

    batch()  # warm-up
    best = 0.0
    for _ in range(3):
        t0 = time.perf_counter()
        batch()
        best = max(best, requests * tokens / (time.perf_counter() - t0))
    eng.close()
    print(json.dumps({"mode": mode, "tok_s": best}))


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default="bench/results/tracing.json")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--child", nargs=4, metavar=("CKPT", "MODE", "REQUESTS", "TOKENS"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args.child[0], args.child[1], int(args.child[2]), int(args.child[3]))
        return 0
    from expertmesh.checkpoint.loader import create_checkpoint
    from expertmesh.model.config import preset

    ckpt = str(create_checkpoint(preset("tiny"), Path(tempfile.mkdtemp()) / "tiny", seed=0))
    requests, tokens = (4, 16) if args.quick else (8, 48)
    best: dict[str, float] = {}
    for _ in range(args.rounds):  # modes interleaved, best of the rounds: the machine is shared and noisy
        for mode, env in MODES.items():
            out = subprocess.run(
                [sys.executable, __file__, "--child", ckpt, mode, str(requests), str(tokens)],
                env={**os.environ, **env},
                capture_output=True,
                text=True,
                check=True,
            )
            tok_s = json.loads(out.stdout.strip().splitlines()[-1])["tok_s"]
            best[mode] = max(best.get(mode, 0.0), tok_s)
    rows = [{"mode": mode, "tok_s": best[mode]} for mode in MODES]
    base = rows[0]["tok_s"]
    print(f"{'tracing':24} {'tok/s':>8} {'overhead':>9}")
    for r in rows:
        r["overhead"] = 1 - r["tok_s"] / base
        print(f"{r['mode']:24} {r['tok_s']:>8.1f} {100 * r['overhead']:>8.1f}%")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
