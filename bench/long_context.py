"""Decode cost against context length through the engine: DSA's flat-cost property, measured.

For each context length a request with a random prompt of that length runs through the in-process engine
(attention worker + expert worker, the serving code path: paged KV, paged sparse decode); after its prefill,
the time between consecutive generated tokens is the decode cost at that context. A decode step reads the
indexer keys of the whole context (a small dot product per position) and attends to at most `index_topk`
latents; KDA layers carry a constant-size state. So the cost should barely grow with the context, while a
dense-attention decode (or copying the cache every step) grows linearly.

    python bench/long_context.py [--quick] [--json bench/results/long_context.json]

--quick: the `small` preset, contexts 2K → 32K (its maximum), 8 decode tokens each; otherwise 2K, 4K, 8K,
16K, 32K with 24 decode tokens. Prints a table and writes {"contexts": [...], "decode_ms": [...], ...}.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

from expertmesh.checkpoint.loader import Checkpoint, create_checkpoint
from expertmesh.entry.local import build_local_engine
from expertmesh.model.config import preset
from expertmesh.wire.sampling_params import SamplingParams

PREFILL_CHUNK = 1024  # long prompts prefill in large chunks (the bench measures decode, not prefill)
BLOCK_SIZE = 64


def decode_ms(engine, context: int, new_tokens: int, seed: int) -> tuple[float, float]:
    """(median ms between generated tokens, prefill seconds) for one request whose prompt has `context` tokens."""
    rng = random.Random(seed)
    prompt = [rng.randrange(256) for _ in range(context)]
    t0 = time.perf_counter()
    stamps = []
    for _ in engine.submit(prompt, SamplingParams(max_tokens=new_tokens)).stream(timeout=3600):
        stamps.append(time.perf_counter())
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return 1e3 * statistics.median(gaps), stamps[0] - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2K, 8K, 32K with 8 decode tokens each")
    ap.add_argument("--json", default="bench/results/long_context.json", help="where to write the results")
    args = ap.parse_args()
    cfg = preset("small")
    top = cfg.max_context
    contexts = [2048, 8192, top] if args.quick else [2048, 4096, 8192, 16384, top]
    new_tokens = 8 if args.quick else 24
    contexts = [min(c, top - new_tokens) for c in contexts]
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Checkpoint(create_checkpoint(cfg, Path(tmp) / "small", seed=0))
        blocks = -(-top // BLOCK_SIZE) + 4
        engine = build_local_engine(
            ckpt, kv_blocks=blocks, block_size=BLOCK_SIZE, prefill_chunk=PREFILL_CHUNK, max_batch_tokens=PREFILL_CHUNK
        )
        try:
            decode_ms(engine, 256, 4, seed=99)  # warm-up (allocator, kernels' first calls)
            rows = [(c, *decode_ms(engine, c, new_tokens, seed=c)) for c in contexts]
        finally:
            engine.close()
    print(f"{'context':>8}  {'decode ms/token':>15}  {'vs first':>8}  {'prefill s':>9}")
    for c, ms, prefill in rows:
        print(f"{c:8d}  {ms:15.1f}  {ms / rows[0][1]:8.2f}  {prefill:9.1f}")
    result = {
        "preset": cfg.name,
        "contexts": [r[0] for r in rows],
        "decode_ms": [r[1] for r in rows],
        "prefill_s": [r[2] for r in rows],
        "decode_tokens": new_tokens,
        "index_topk": cfg.indexer.index_topk,
        "last_over_first": rows[-1][1] / rows[0][1],
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
