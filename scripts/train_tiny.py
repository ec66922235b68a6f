"""Train the embedded default: a K3+DSA-shaped model (KDA with K3's full-rank gate and lower bound, gated DSA on every
fourth layer with its lightning indexer, latent MoE with SiTU, attention residuals, 2 shared experts, ungrouped top-k,
one MTP layer; experts quantization-aware to MXFP4) on WordNet's English (Debian `wordnet-base`, WordNet 3.0 licence),
written as a Kimi K3 Hugging Face directory the serving loader reads. CPU (--threads, default 2: on a machine
other jobs share, 1 is faster); deterministic for a seed and thread count.

    python scripts/train_tiny.py --out models/k3-tiny --work /tmp/k3-work   # the shipped checkpoint (~38 min, 2 cores)
    python scripts/train_tiny.py --out /tmp/t --steps 8 --max-synsets 2000 --hidden 64   # a smoke run
    # only the last stage (the MTP layer chained and distilled, train/mtp_chain.py) on a trained model, whose other
    # tensors are kept bit for bit:
    python scripts/train_tiny.py --init models/k3-tiny --out /tmp/k3-tiny --steps 0 --work /tmp/k3-work
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from expertmesh.train.export import Shape
from expertmesh.train.loop import TrainConfig, train

# TrainConfig fields that are command-line flags of the same name (--seq-len for seq_len ...)
FLAGS = (
    "seed",
    "steps",
    "batch",
    "seq_len",
    "lr",
    "dense_fraction",
    "mtp_weight",
    "bpe_ranks",
    "eval_every",
    "threads",
    "copy_warmup",
    "copy_batch",
    "copy_mix",
    "mtp_chain_steps",
    "mtp_chain_depth",
    "mtp_chain_lr",
)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="the checkpoint directory to write (replaced)")
    ap.add_argument("--work", type=Path, default=None, help="tokenizer and report (default: <out>/../.train-work)")
    defaults = TrainConfig(out=Path("."))
    for f in FLAGS:
        ap.add_argument("--" + f.replace("_", "-"), type=type(getattr(defaults, f)), default=getattr(defaults, f))
    ap.add_argument("--window-seed", type=int, default=None, help="the training windows' order (default: --seed)")
    ap.add_argument("--init", type=Path, default=None, help="continue from this written checkpoint (same shape)")
    ap.add_argument("--max-synsets", type=int, default=None, help="train on a random slice of WordNet")
    ap.add_argument("--hidden", type=int, default=Shape.hidden, help="hidden size (smoke runs)")
    a = ap.parse_args(argv)
    cfg = TrainConfig(
        out=a.out,
        work=a.work,
        shape=dataclasses.replace(Shape(), hidden=a.hidden),
        max_synsets=a.max_synsets,
        init=a.init,
        window_seed=a.window_seed,
        **{f: getattr(a, f) for f in FLAGS},
    )
    train(cfg, log=lambda line: print(line, flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
