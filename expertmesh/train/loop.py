"""Training the embedded default: corpus → tokenizer → token streams → the K3+DSA TrainModel → a K3 directory.

The schedule, as DeepSeek-V3.2 trained DSA and K3 its experts:
1. dense warm-up (the first `dense_fraction` of the steps): DSA layers attend to every causal key; their indexers
   learn the main attention's distribution (KL, inputs detached);
2. sparse training: each DSA query attends only to the indexer's top `index_topk` keys; the indexer's KL is taken
   over the selected keys;
throughout: routed experts seen through MXFP4 (QAT), the router's correction bias balanced without a loss, the MTP
layer trained on token t+2 with weight `mtp_weight`. AdamW, linear warm-up then cosine decay, gradient clipping.

Deterministic for a seed (the data order, the initial weights, the thread count fixed).
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from expertmesh.chat.k3 import K3Chat
from expertmesh.chat.tiktoken_tokenizer import TikTokenTokenizer
from expertmesh.train import bpe, corpus
from expertmesh.train.copy_task import ChatCopy
from expertmesh.train.export import (
    Shape,
    keep_main_model,
    load_train_model,
    model_config,
    text_config,
    wrapper_config,
    write_checkpoint,
)
from expertmesh.train.model import TrainModel
from expertmesh.train.mtp_chain import train_mtp_chain


@dataclass
class TrainConfig:
    out: Path
    shape: Shape = field(default_factory=Shape)
    seed: int = 0
    steps: int = 3000  # the shipped run: 3,000 × 4 × 256 corpus tokens (+ the copy task), ~50 minutes on 2 cores
    batch: int = 4
    seq_len: int = 256
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup: int = 60
    weight_decay: float = 0.01
    dense_fraction: float = 0.25
    mtp_weight: float = 0.3
    balance_rate: float = 1e-3
    bpe_ranks: int = 2816  # + K3's 256 reserved ids = the vocabulary
    max_synsets: int | None = None  # a slice of WordNet (tests)
    chat_variants: int = 3  # conversations per common noun
    other_synsets: int = 20_000  # the rest of WordNet: a sample
    eval_every: int = 400
    threads: int = 2
    work: Path | None = None  # tokenizer and token streams (default: out's parent / .train-work)
    window_seed: int | None = None  # the order of the training windows (default: seed); a continued run takes a new one
    tie_embeddings: bool = True  # the LM head is the embedding while training (train/model.py: copying learns faster)
    copy_warmup: int = 400  # at most this many copy-task steps before the corpus (train/copy_task.ChatCopy) ...
    copy_target: float = 0.95  # ... stopping once a batch's copies are this right
    copy_batch: int = 64  # conversations of a warm-up step
    copy_mix: int = 8  # copy conversations added to every corpus step, so the ability stays in use
    init: Path | None = None  # continue from a written checkpoint (its bf16 masters and tokenizer) instead of random
    mtp_chain_steps: int = 800  # then the MTP layer alone, chained and distilled from the main model (mtp_chain.py)
    mtp_chain_depth: int = 3  # chain applications trained (the drafts a step serves: --speculative-tokens)
    mtp_chain_lr: float = 1e-3


# ----------------------------------------------------------------------------------------------- data
@dataclass
class Data:
    tokenizer_dir: Path
    special: dict[str, int]
    vocab_size: int
    train: torch.Tensor  # int64 [N] the training stream
    held_out: torch.Tensor  # int64 [M] the held-out stream (synsets never trained on)
    stats: dict


def token_stream(
    tokenizer: TikTokenTokenizer, chat: K3Chat, docs: list[str], samples: list, sep: int, rng
) -> list[int]:
    """Documents and rendered conversations, shuffled, each followed by `sep`, as one token stream."""
    items = [("doc", d) for d in docs] + [("chat", s) for s in samples]
    rng.shuffle(items)
    ids: list[int] = []
    for kind, item in items:
        if kind == "doc":
            ids += tokenizer.encode_plain(item)
        else:
            ids += chat.render_ids(
                item.messages,
                thinking=item.thinking,
                thinking_effort=item.thinking_effort,
                add_generation_prompt=False,
            )
        ids.append(sep)
    return ids


def is_core(s: corpus.Synset) -> bool:
    """A common noun's everyday sense: the first sense of a short single lower-case word."""
    word = s.words[0]
    return s.pos == "n" and s.sense == 1 and word.isalpha() and word.islower() and len(word) <= 9


def prepare_data(cfg: TrainConfig, work: Path) -> Data:
    t0 = time.time()
    synsets = corpus.load_wordnet(corpus.wordnet_dir())
    if cfg.max_synsets is not None:
        synsets = random.Random(cfg.seed).sample(synsets, min(cfg.max_synsets, len(synsets)))
    train_sets = [s for s in synsets if not corpus.held_out(s)]
    held_sets = [s for s in synsets if corpus.held_out(s)]
    # the training mix: every common noun (its first sense, one plain word) asked about in `chat_variants`
    # differently worded conversations, then a sample of the rest of WordNet as conversations and paragraphs
    core = [s for s in train_sets if is_core(s)]
    core_keys = {s.key for s in core}
    rest = [s for s in train_sets if s.key not in core_keys]
    rng = random.Random(cfg.seed)
    others = rng.sample(rest, min(cfg.other_synsets, len(rest)))
    samples = [x for v in range(cfg.chat_variants) for x in corpus.conversations(core, cfg.seed + 100 * v)]
    samples += corpus.conversations(others, cfg.seed)
    docs = corpus.plain_documents(core + others)
    held_docs = corpus.plain_documents(held_sets, include_held_out=True)
    held_samples = corpus.conversations(held_sets, cfg.seed + 1, include_held_out=True)
    texts = [t for s in samples for m in s.messages for t in (m.content, m.reasoning) if t]
    ranks = bpe.train_ranks(docs + texts, cfg.bpe_ranks)
    tok_dir = work / "tokenizer"
    special = bpe.write_tokenizer(tok_dir, ranks)
    tokenizer = TikTokenTokenizer(tok_dir)
    chat = K3Chat(tokenizer)
    sep = special["[EOS]"]
    train = token_stream(tokenizer, chat, docs, samples, sep, random.Random(cfg.seed))
    held = token_stream(tokenizer, chat, held_docs, held_samples, sep, random.Random(cfg.seed + 1))
    stats = {
        "synsets": len(synsets),
        "held_out_synsets": len(held_sets),
        "documents": len(docs),
        "core_synsets": len(core),
        "conversations": len(samples),
        "train_tokens": len(train),
        "held_out_tokens": len(held),
        "characters": sum(map(len, docs))
        + sum(len(m.content) + len(m.reasoning or "") for s in samples for m in s.messages),
        "data_seconds": round(time.time() - t0, 1),
    }
    as_ids = dict(dtype=torch.int64)
    return Data(
        tok_dir, special, tokenizer.vocab_size, torch.tensor(train, **as_ids), torch.tensor(held, **as_ids), stats
    )


def batches(stream: torch.Tensor, batch: int, seq_len: int, seed: int):
    """Endless [batch, seq_len + 1] windows at random offsets of the stream (seeded)."""
    g = torch.Generator().manual_seed(seed)
    n = stream.numel() - seq_len - 1
    while True:
        starts = torch.randint(0, n, (batch,), generator=g)
        yield torch.stack([stream[s : s + seq_len + 1] for s in starts.tolist()])


# ----------------------------------------------------------------------------------------------- losses
@dataclass
class Losses:
    lm: torch.Tensor
    mtp: torch.Tensor
    indexer: torch.Tensor

    def total(self, mtp_weight: float) -> torch.Tensor:
        return self.lm + mtp_weight * self.mtp + self.indexer


def losses(model: TrainModel, window: torch.Tensor, topk: int | None) -> Losses:
    """window [B, T+1]: next-token loss on T positions, the MTP layer's t+2 loss, the indexers' KL."""
    tokens, targets = window[:, :-1], window[:, 1:]
    out = model(tokens, topk)
    v = out.logits.shape[-1]
    lm = F.cross_entropy(out.logits.reshape(-1, v), targets.reshape(-1))
    mtp_logits, mtp_kl = model.mtp_logits(tokens, out, topk)  # position t predicts token t+2 = targets[t+1]
    mtp = F.cross_entropy(mtp_logits.reshape(-1, v), targets[:, 1:].reshape(-1))
    return Losses(lm, mtp, out.indexer_kl + mtp_kl)


@torch.no_grad()
def evaluate(model: TrainModel, stream: torch.Tensor, seq_len: int, topk: int | None, windows: int = 16) -> dict:
    """Held-out next-token and MTP loss over `windows` fixed windows (the same ones every time)."""
    was = model.training
    model.eval()
    g = torch.Generator().manual_seed(1234)
    n = stream.numel() - seq_len - 1
    lm = mtp = 0.0
    for s in torch.randint(0, max(n, 1), (windows,), generator=g).tolist():
        loss = losses(model, stream[s : s + seq_len + 1][None], topk)
        lm, mtp = lm + loss.lm.item(), mtp + loss.mtp.item()
    model.train(was)
    return {"lm_loss": lm / windows, "ppl": math.exp(lm / windows), "mtp_loss": mtp / windows}


# ----------------------------------------------------------------------------------------------- training
def lr_at(cfg: TrainConfig, step: int) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def copy_warmup(model: TrainModel, opt, cfg: TrainConfig, copies: ChatCopy, log) -> list[dict]:
    """Train on the copy task alone (constant `cfg.lr`) until a batch is copied `cfg.copy_target` well or
    `cfg.copy_warmup` steps have run; the history. The corpus's own schedule (its warm-up included) follows."""
    history: list[dict] = []
    t0 = time.time()
    for step in range(cfg.copy_warmup):
        loss, accuracy = copies.loss(lambda x: model(x).logits, *copies.batch(cfg.copy_batch))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        row = {
            "copy_step": step,
            "loss": round(loss.item(), 4),
            "accuracy": accuracy,
            "seconds": round(time.time() - t0, 1),
        }
        history.append(row)
        if step % 10 == 0 or accuracy >= cfg.copy_target:
            log(json.dumps(row))
        if accuracy >= cfg.copy_target:
            break
    return history


def train(cfg: TrainConfig, log=print) -> dict:
    """Run the whole recipe; returns the report (also written as `train-report.json` beside the checkpoint)."""
    torch.set_num_threads(cfg.threads)
    # KDA's decays reach e^-160 inside a chunk: subnormal floats there cost x86 cores ~100x per op (steps took
    # 26 s instead of 2); flushed to zero they change nothing the loss can see
    torch.set_flush_denormal(True)
    torch.manual_seed(cfg.seed)
    work = cfg.work or Path(cfg.out).parent / ".train-work"
    work.mkdir(parents=True, exist_ok=True)
    data = prepare_data(cfg, work)
    log(json.dumps({"data": data.stats}))
    raw = wrapper_config(text_config(cfg.shape, data.vocab_size, data.special), data.special, cfg.shape)
    mcfg = model_config(raw, Path(cfg.out).name)
    model = TrainModel(mcfg, mtp=True, seed=cfg.seed, tie_embeddings=cfg.tie_embeddings)
    init_report = None
    if cfg.init is not None:
        if Path(cfg.init).resolve() == Path(cfg.out).resolve():
            raise ValueError(f"--init {cfg.init}: the same directory as --out (it is read again after training)")
        if (Path(cfg.init) / "training.json").exists():
            init_report = json.loads((Path(cfg.init) / "training.json").read_text())
        start = load_train_model(Path(cfg.init), "bf16")
        if start.cfg != mcfg:
            raise ValueError(f"--init {cfg.init}: its config.json is not this run's model (shape or tokenizer differ)")
        model.load_state_dict(start.state_dict())
        model.set_qat(True)
    model.train()
    decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() >= 2 and "embed" not in n]
    rest = [p for n, p in model.named_parameters() if p.requires_grad and not (p.dim() >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": rest, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=(0.9, 0.95),
    )
    window_seed = cfg.seed if cfg.window_seed is None else cfg.window_seed
    copies = ChatCopy(K3Chat(TikTokenTokenizer(data.tokenizer_dir)), window_seed)
    topk = cfg.shape.index_topk
    dense_steps = int(cfg.steps * cfg.dense_fraction)
    t0 = time.time()
    warmup = copy_warmup(model, opt, cfg, copies, log) if cfg.init is None else []
    history = []
    for step, window in zip(range(cfg.steps), batches(data.train, cfg.batch, cfg.seq_len, window_seed)):
        for group in opt.param_groups:
            group["lr"] = lr_at(cfg, step)
        sparse = step >= dense_steps
        loss = losses(model, window, topk if sparse else None)
        total = loss.total(cfg.mtp_weight)
        if cfg.copy_mix:
            copied, _ = copies.loss(lambda x: model(x).logits, *copies.batch(cfg.copy_mix))
            total = total + copied
        opt.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        for moe in model.moe_layers():
            moe.balance_(cfg.balance_rate)
        row = {
            "step": step,
            "lm": round(loss.lm.item(), 4),
            "mtp": round(loss.mtp.item(), 4),
            "indexer_kl": round(loss.indexer.item(), 4),
            "copy": round(copied.item(), 4) if cfg.copy_mix else None,
            "sparse": sparse,
            "seconds": round(time.time() - t0, 1),
        }
        history.append(row)
        if step % 10 == 0 or step == cfg.steps - 1:
            log(json.dumps(row))
        if cfg.eval_every and (step + 1) % cfg.eval_every == 0:
            log(json.dumps({"step": step, "held_out": evaluate(model, data.held_out, cfg.seq_len, topk)}))
            write_checkpoint(model, raw, data.tokenizer_dir, Path(cfg.out))  # usable if the run stops here
    chain = {}
    if cfg.mtp_chain_steps:
        windows = batches(data.train, cfg.batch, cfg.seq_len, window_seed + 7919)  # apart from the corpus's
        chain = train_mtp_chain(model, windows, data.held_out, cfg, log)
    train_seconds = time.time() - t0
    final = evaluate(model, data.held_out, cfg.seq_len, topk)
    out = write_checkpoint(model, raw, data.tokenizer_dir, Path(cfg.out))
    if cfg.init is not None and cfg.steps == 0:  # only the MTP layer trained: the main model stays the init's bits
        keep_main_model(out, Path(cfg.init), mcfg.n_layers)
    report = {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()},
        "data": data.stats,
        "parameters": sum(p.numel() for p in model.parameters()),
        "train_seconds": round(train_seconds, 1),
        "tokens_seen": cfg.steps * cfg.batch * cfg.seq_len,
        "copy_warmup": {"steps": len(warmup), "last": warmup[-1] if warmup else None},
        "mtp_chain": chain,
        "held_out": final,
        "first_loss": history[0]["lm"] if history else None,
        "last_loss": sum(r["lm"] for r in history[-10:]) / len(history[-10:]) if history else None,
    }
    if init_report is not None:  # how the model it continued was made
        report["init_report"] = init_report
    (out / "training.json").write_text(json.dumps(report, indent=1) + "\n")  # how it was made, beside it
    log(json.dumps({"done": report["held_out"], "seconds": report["train_seconds"], "out": str(out)}))
    return report
