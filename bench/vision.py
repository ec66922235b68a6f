"""Image tokens and vision-encoder time per 448×448 image on CPU for the presets with an encoder.

    python bench/vision.py [--repeats 20] [--json bench/results/vision.json]

Times `expertmesh.model.vision.encode_image` (tower + projector, fp32) on random pixels, one image at a time (as the
attention worker runs it); prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from expertmesh.model.config import preset
from expertmesh.model.transformer import Transformer, init_random_
from expertmesh.model.vision import encode_image


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--side", type=int, default=448)
    ap.add_argument("--json", default="bench/results/vision.json")
    args = ap.parse_args()
    models, tokens, times = {}, {}, {}
    pixels = torch.randint(
        0, 256, (args.side, args.side, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)
    )
    for name in ("tiny", "small"):
        models[name] = init_random_(Transformer(preset(name)), 0).eval()
        tokens[name] = encode_image(models[name], pixels).shape[0]  # warm-up
        times[name] = []
    # presets interleaved round by round, so a noisy moment on this shared box hits both alike
    for _ in range(args.repeats):
        for name, model in models.items():
            t0 = time.perf_counter()
            encode_image(model, pixels)
            times[name].append((time.perf_counter() - t0) * 1e3)
    rows = [
        {
            "preset": name,
            "side": args.side,
            "image_tokens": tokens[name],
            "encoder_params": model.cfg.vision.params(model.cfg.hidden_size),
            "encoder_ms_median": statistics.median(times[name]),
            "encoder_ms_min": min(times[name]),
            "threads": torch.get_num_threads(),
        }
        for name, model in models.items()
    ]
    print(f"{'preset':8} {'image':>9} {'tokens':>7} {'params':>9} {'median ms':>10} {'min ms':>8}")
    for r in rows:
        print(
            f"{r['preset']:8} {r['side']}x{r['side']:<5} {r['image_tokens']:>7} {r['encoder_params']:>9,} "
            f"{r['encoder_ms_median']:>10.1f} {r['encoder_ms_min']:>8.1f}"
        )
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
