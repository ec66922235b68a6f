"""The MTP layer trained as the drafter it serves as: chained, and to agree with the model it drafts for.

The main recipe (loop.py) trains the MTP layer as DeepSeek-V3 does: from h_t, the main model's final normed state,
and the embedding of token t+1, predict token t+2 of the corpus. Serving chains it (model/drafters.MTPDrafter, as
vLLM's and SGLang's proposers do): draft i+1 reads the layer's *own* output at draft i in place of h. A layer that
never saw its own outputs drafts poorly past the first token (the shipped model before this stage accepted 0.72,
0.11, 0.02 by draft position), and one trained on the corpus's next-but-one token learns what the corpus says, not
what the target will say — which is all acceptance counts.

So this stage, after the corpus (main model frozen), trains only the MTP layer:
- **chained**, `depth` applications per window: depth 1 reads h_s; depth d > 1 reads depth d-1's output at s-1 (the
  position a chained draft is one step past), with the same token embeddings — position s always predicts token
  s+2, so every depth lines up with the same targets. Depth d's loss is taken on positions s ≥ d-1, where the chain
  is d-1 real drafts deep. (Its attention sees depth-d inputs at the earlier positions, where serving has the target's
  states: a small mismatch the figures below absorb.)
- **self-distilled** (as EAGLE and Medusa-2 train their heads): the target of position s is the frozen main model's
  distribution over token s+2 (its softmax at s+1), cross-entropy against it; greedy acceptance is the argmax
  agreeing, and the sampled acceptance min(1, p/q) grows as q approaches p.
Gradients flow through the chain (depth d's loss trains what depth d-1 hands on). The MTP experts stay
quantization-aware; their router bias keeps balancing as in the main recipe.

Shapes: B windows, T positions, H hidden, V vocabulary.
"""

from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F

from expertmesh.train.model import TrainModel, total


def mtp_outputs(model: TrainModel, emb_next: torch.Tensor, hidden: torch.Tensor, topk, losses) -> torch.Tensor:
    """The MTP layer's output states [B, T, H] (before its head) from embeddings of tokens t+1 and states at t."""
    mtp = model.mtp
    x = mtp.eh_proj(torch.cat([mtp.enorm(emb_next), mtp.hnorm(hidden)], dim=-1))
    return mtp.block([], x, topk, losses)


def chain_losses(
    model: TrainModel, window: torch.Tensor, topk: int | None, depth: int
) -> tuple[list[torch.Tensor], torch.Tensor, list[float]]:
    """window [B, T+1] → (per-depth distillation losses, the MTP indexer loss, per-depth top-1 agreement with the
    main model's argmax)."""
    tokens = window[:, :-1]
    with torch.no_grad():
        out = model(tokens, topk)
        target = torch.softmax(out.logits[:, 1:].float(), dim=-1)  # [B, T-1, V]: token s+2 as the target sees it
        emb = model.embed(tokens[:, 1:])  # [B, T-1, H]
    hidden = out.hidden[:, :-1]
    per_depth, agree, indexer = [], [], []
    for d in range(depth):
        x = mtp_outputs(model, emb, hidden, topk, indexer)
        logits = model.mtp.head(model.mtp.head_norm(x))[:, d:].float()
        per_depth.append(-(target[:, d:] * F.log_softmax(logits, dim=-1)).sum(-1).mean())
        agree.append((logits.argmax(-1) == target[:, d:].argmax(-1)).float().mean().item())
        hidden = torch.cat([hidden[:, :1], x[:, :-1]], dim=1)  # depth d+1 at s reads depth d's output at s-1
    return per_depth, total(indexer, per_depth[0]), agree


@torch.no_grad()
def held_out_agreement(model: TrainModel, stream: torch.Tensor, seq_len: int, topk, depth: int, windows=8) -> list:
    """Top-1 agreement with the main model per chain depth over fixed held-out windows (teacher-forced chain)."""
    g = torch.Generator().manual_seed(4321)
    n = stream.numel() - seq_len - 1
    sums = [0.0] * depth
    for s in torch.randint(0, max(n, 1), (windows,), generator=g).tolist():
        _, _, agree = chain_losses(model, stream[s : s + seq_len + 1][None], topk, depth)
        sums = [a + b for a, b in zip(sums, agree)]
    return [round(x / windows, 4) for x in sums]


def train_mtp_chain(model: TrainModel, windows, held_out: torch.Tensor, cfg, log) -> dict:
    """Train `model.mtp` alone for cfg.mtp_chain_steps on `windows` (an iterator of [B, T+1] token windows; cfg:
    loop.TrainConfig) → the stage's report."""
    steps, depth, topk = cfg.mtp_chain_steps, cfg.mtp_chain_depth, cfg.shape.index_topk
    frozen = {n: p.requires_grad for n, p in model.named_parameters()}
    for name, p in model.named_parameters():
        p.requires_grad = name.startswith("mtp.")
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.mtp_chain_lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    before = held_out_agreement(model, held_out, cfg.seq_len, topk, depth)
    log(f'{{"mtp_chain": "start", "held_out_agreement": {before}}}')
    t0, last = time.time(), []
    for step, window in zip(range(steps), windows):
        for group in opt.param_groups:  # cosine from the peak, no warm-up: the layer starts trained
            group["lr"] = cfg.mtp_chain_lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / max(1, steps))))
        per_depth, indexer, agree = chain_losses(model, window, topk, depth)
        loss = torch.stack(per_depth).sum() + indexer
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        model.mtp.block.moe.balance_(cfg.balance_rate)
        last = agree
        if step % 20 == 0 or step == steps - 1:
            losses = [round(x.item(), 4) for x in per_depth]
            log(
                f'{{"mtp_chain_step": {step}, "losses": {losses}, "agree": {[round(a, 3) for a in agree]}, '
                f'"seconds": {round(time.time() - t0, 1)}}}'
            )
    for name, p in model.named_parameters():
        p.requires_grad = frozen[name]
    after = held_out_agreement(model, held_out, cfg.seq_len, topk, depth)
    log(f'{{"mtp_chain": "done", "held_out_agreement": {after}}}')
    return {
        "steps": steps,
        "depth": depth,
        "seconds": round(time.time() - t0, 1),
        "held_out_agreement_before": before,
        "held_out_agreement_after": after,
        "last_batch_agreement": [round(a, 4) for a in last],
    }
