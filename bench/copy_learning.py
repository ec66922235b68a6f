"""How fast the embedded default's architecture learns to copy a word from its context, beside a plain transformer.

The embedded default (models/k3-tiny) answers "Tell me about the sea." about some other noun: it never learned to
take up the word it was asked about (bench/quality.py's "names word" is 0.00). This isolates that ability. The task:
`--seq` filler tokens (ids 0..199) with one noun (ids 1000..1999) at a random place, then a marker (id 500); the
target after the marker is the noun. Only its content, not its position, tells which token to copy. Both models
see the same batches (AdamW betas 0.9/0.95, gradient clip 1.0, constant `--lr`):

- `k3+dsa`: expertmesh.train's TrainModel built from the checkpoint's config (KDA, DSA dense, latent MoE, attention
  residuals; no MTP), its LM head tied to the embedding with `--tie`;
- `plain`: a pre-norm transformer of the same width and depth — causal softmax attention without positions (the
  DSA layers' NoPE), a GELU MLP, the LM head tied to the embedding.

    python bench/copy_learning.py [--checkpoint models/k3-tiny] [--steps 300] [--lr 3e-3] [--tie] [--json out.json]

Prints the copy target's loss (uniform over the nouns: ln 1000 = 6.91) and accuracy every `--every` steps.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the benchmarks' own helpers (PYTHONSAFEPATH omits it)
from _report import write_json  # noqa: E402

from expertmesh.train.copy_task import FILLERS, MARKER, NOUNS, copy_batch  # noqa: E402, F401
from expertmesh.train.export import model_config  # noqa: E402
from expertmesh.train.model import TrainModel  # noqa: E402


class PlainBlock(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.attn_norm, self.mlp_norm = nn.RMSNorm(hidden), nn.RMSNorm(hidden)
        self.qkv, self.out = nn.Linear(hidden, 3 * hidden, bias=False), nn.Linear(hidden, hidden, bias=False)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden, bias=False), nn.GELU(), nn.Linear(4 * hidden, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, H]
        B, T, H = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(B, T, 3, self.heads, H // self.heads).permute(2, 0, 3, 1, 4)
        x = x + self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, H))
        return x + self.mlp(self.mlp_norm(x))


class PlainTransformer(nn.Module):
    def __init__(self, vocab: int, hidden: int, layers: int, heads: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        nn.init.normal_(self.embed.weight, std=hidden**-0.5)
        self.blocks = nn.ModuleList(PlainBlock(hidden, heads) for _ in range(layers))
        self.norm = nn.RMSNorm(hidden)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # [B, T] → logits [B, T, V]
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.norm(x) @ self.embed.weight.T


def k3_model(checkpoint: Path, tie: bool, seed: int) -> tuple[nn.Module, dict]:
    cfg = model_config(json.loads((checkpoint / "config.json").read_text()), checkpoint.name)
    model = TrainModel(cfg, mtp=False, seed=seed, tie_embeddings=tie)
    shape = {"vocab": cfg.vocab_size, "hidden": cfg.hidden_size, "layers": cfg.n_layers, "heads": cfg.kda.n_heads}
    return model, shape


def train_rows(model: nn.Module, logits_of, args) -> list[dict]:
    torch.manual_seed(args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95))
    g = torch.Generator().manual_seed(args.seed)  # the same batches for every model
    rows, t0 = [], time.time()
    for step in range(args.steps):
        x = copy_batch(args.batch, args.seq, g)
        logits = logits_of(model, x[:, :-1])[:, -1]  # [B, V] at the marker
        loss = F.cross_entropy(logits, x[:, -1])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % args.every == 0 or step == args.steps - 1:
            accuracy = (logits.argmax(-1) == x[:, -1]).float().mean().item()
            rows.append({"step": step, "loss": loss.item(), "accuracy": accuracy, "seconds": time.time() - t0})
    return rows


def parse_args(argv: list[str] | None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", type=Path, default=Path("models/k3-tiny"), help="whose config.json to build")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--every", type=int, default=50, help="print a row every N steps")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=24, help="filler tokens before the marker")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--tie", action="store_true", help="tie k3+dsa's LM head to its embedding (plain is always tied)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 on a shared 2-core machine)")
    ap.add_argument("--json", default=None, help="where to write every number")
    args = ap.parse_args(argv)
    for name in ("steps", "every", "batch", "threads"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} {getattr(args, name)}: expected >= 1")
    if args.seq < 5:
        ap.error(f"--seq {args.seq}: expected >= 5 (the noun is placed before the last 4 fillers)")
    if not (args.checkpoint / "config.json").is_file():
        ap.error(f"--checkpoint {args.checkpoint}: no config.json")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)  # KDA's in-chunk decays (see expertmesh/train/loop.py)
    k3, shape = k3_model(args.checkpoint, args.tie, args.seed)
    if shape["vocab"] < NOUNS.stop:
        raise SystemExit(f"--checkpoint {args.checkpoint}: vocabulary {shape['vocab']} < {NOUNS.stop} (the nouns' ids)")
    torch.manual_seed(args.seed)
    plain = PlainTransformer(shape["vocab"], shape["hidden"], shape["layers"], shape["heads"])
    results = {
        "k3+dsa" + (" tied" if args.tie else ""): train_rows(k3, lambda m, x: m(x, None).logits, args),
        "plain": train_rows(plain, lambda m, x: m(x), args),
    }
    names = list(results)
    print(f"copy a noun after the marker: {args.seq} fillers, batch {args.batch}, lr {args.lr:g}, {shape}")
    print(f"(uniform over the nouns: loss {math.log(len(NOUNS)):.2f})")
    print("step  " + "  ".join(f"{n + ' loss':>16} {'acc':>5}" for n in names))
    for i, row in enumerate(results[names[0]]):
        cells = "  ".join(f"{results[n][i]['loss']:16.3f} {results[n][i]['accuracy']:5.2f}" for n in names)
        print(f"{row['step']:4d}  {cells}")
    write_json(args.json, args, shape=shape, results=results)
    return {"shape": shape, "results": results}


if __name__ == "__main__":
    main()
