"""End-to-end serving benchmark: decode tokens/s and time to first token at several concurrencies,
in-process engine vs the multi-process deployment (gRPC on loopback), and the bytes sent per token per layer
against the minimum (hidden × top-k × dtype size, both ways), measured from the serialized router↔worker messages (all
calls, attention and expert, counted by the router's gRPC clients).

    python bench/e2e.py [--quick] [--presets tiny,small] [--out bench/results/e2e.json]
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from expertmesh.checkpoint import Checkpoint, create_checkpoint
from expertmesh.config import preset
from expertmesh.model import SamplingParams


def _prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(length)] for _ in range(n)]


def _run(submit, concurrency: int, prompt_len: int, max_tokens: int) -> dict:
    """`submit(prompt, params)` returns a started request with .stream(); measure TTFT and decode rate."""
    prompts = _prompts(concurrency, prompt_len, seed=concurrency)
    ttft, decode_rates, tokens = [], [], 0
    t0 = time.perf_counter()

    def one(p):
        start = time.perf_counter()
        first = None
        n = 0
        for _ in submit(p, SamplingParams(max_tokens=max_tokens)):
            n += 1
            if first is None:
                first = time.perf_counter()
        end = time.perf_counter()
        return first - start, (n - 1) / (end - first) if n > 1 and end > first else 0.0, n

    with ThreadPoolExecutor(concurrency) as pool:
        for a, b, n in pool.map(one, prompts):
            ttft.append(a)
            decode_rates.append(b)
            tokens += n
    wall = time.perf_counter() - t0
    return {"ttft_p50_ms": 1000 * statistics.median(ttft), "per_seq_tok_s": statistics.mean(decode_rates),
            "total_tok_s": tokens / wall, "tokens": tokens}


def bench_inprocess(ckpt, concurrencies, prompt_len, max_tokens):
    from expertmesh.router.local import build_local_engine
    eng = build_local_engine(ckpt, attention_workers=1, expert_workers=2, max_running=64, max_waiting=256)
    try:
        _run(lambda p, s: eng.submit(p, s).stream(120), 1, prompt_len, 4)  # warm-up
        return {c: _run(lambda p, s: eng.submit(p, s).stream(120), c, prompt_len, max_tokens) for c in concurrencies}
    finally:
        eng.close()


def bench_multiprocess(ckpt_dir, concurrencies, prompt_len, max_tokens):
    import re
    import httpx
    cfg = Checkpoint(ckpt_dir).cfg
    from expertmesh.up import LocalCluster, free_port
    cluster = LocalCluster(ckpt_dir, attention_workers=1, expert_workers=2, http_port=free_port(),
                           grpc_port=free_port())
    cluster.start()
    client = httpx.Client(base_url=cluster.http_url, timeout=300)

    def submit(prompt, params):
        body = {"model": Checkpoint(ckpt_dir).cfg.name, "prompt": prompt, "max_tokens": params.max_tokens,
                "temperature": 0, "stream": True}
        with client.stream("POST", "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    yield 1

    def wire_and_tokens():
        text = client.get("/metrics").text
        wire = sum(float(m) for m in re.findall(r'^expertmesh_worker_message_bytes_total\{[^}]*\} (\S+)$', text, re.M))
        toks = sum(float(m) for m in re.findall(r'^expertmesh_(?:prompt|generation)_tokens_total (\S+)$', text, re.M))
        return wire, toks

    try:
        list(submit([1, 2, 3], SamplingParams(max_tokens=2)))
        out = {}
        for c in concurrencies:
            w0, t0 = wire_and_tokens()
            out[c] = _run(submit, c, prompt_len, max_tokens)
            w1, t1 = wire_and_tokens()
            out[c]["wire_bytes_per_token_layer"] = (w1 - w0) / max(1.0, t1 - t0) / cfg.n_moe_layers
        return out
    finally:
        client.close()
        cluster.stop()


def wire_minimum(cfg) -> int:
    """The least a token must move per MoE layer: its hidden state to each of its top-k experts and their
    outputs back (fp32 on the wire)."""
    return 2 * cfg.hidden_size * cfg.moe.top_k * 4


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--presets", default="tiny,small")
    p.add_argument("--out", default="bench/results/e2e.json")
    args = p.parse_args(argv)
    concurrencies = [1, 4] if args.quick else [1, 4, 16, 32]
    rows, tmp = [], Path(tempfile.mkdtemp(prefix="bench-e2e-"))
    for name in args.presets.split(","):
        cfg = preset(name)
        d = create_checkpoint(cfg, tmp / name, seed=0)
        ckpt = Checkpoint(d)
        max_tokens = 8 if args.quick else 32
        inproc = bench_inprocess(ckpt, concurrencies, 16, max_tokens)
        multi = bench_multiprocess(str(d), concurrencies, 16, max_tokens)
        minimum = wire_minimum(cfg)
        for c in concurrencies:
            a, b = inproc[c], multi[c]
            wb = {"bytes_per_token_layer": b["wire_bytes_per_token_layer"], "minimum": minimum,
                  "ratio": b["wire_bytes_per_token_layer"] / minimum}
            rows.append({"preset": name, "concurrency": c, "inproc_tok_s": a["total_tok_s"],
                         "multi_tok_s": b["total_tok_s"], "ratio_multi_over_inproc": b["total_tok_s"] / a["total_tok_s"],
                         "inproc_ttft_ms": a["ttft_p50_ms"], "multi_ttft_ms": b["ttft_p50_ms"],
                         "inproc_per_seq_tok_s": a["per_seq_tok_s"], "multi_per_seq_tok_s": b["per_seq_tok_s"],
                         **{f"wire_{k}": v for k, v in wb.items()}})
    hdr = f"{'preset':6} {'conc':>4} {'inproc tok/s':>12} {'multi tok/s':>11} {'ratio':>6} {'TTFT in ms':>10} {'TTFT mp ms':>10} {'wire B/tok/layer':>16} {'min':>6} {'x':>5}"
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        print(f"{r['preset']:6} {r['concurrency']:>4} {r['inproc_tok_s']:>12.1f} {r['multi_tok_s']:>11.1f} "
              f"{r['ratio_multi_over_inproc']:>6.2f} {r['inproc_ttft_ms']:>10.1f} {r['multi_ttft_ms']:>10.1f} "
              f"{r['wire_bytes_per_token_layer']:>16.0f} {r['wire_minimum']:>6} {r['wire_ratio']:>5.2f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
