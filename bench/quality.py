"""What the shipped model's serving choices cost in quality, measured on WordNet text it never trained on.

The embedded default (`models/k3-tiny`, trained by scripts/train_tiny.py) ships its routed experts in MXFP4, reads
its context through DSA's top-k keys, thinks at a chosen effort and carries one MTP layer. Over the held-out
stream (the ~3% of WordNet synsets never trained on, rendered as training renders its text: plain paragraphs and
K3 conversations over the checkpoint's own tokenizer, shuffled as expertmesh/train/loop.prepare_data shuffles
them), at fixed seeded windows of `--context` tokens:

1. experts: perplexity with the bf16 masters (`experts-bf16.safetensors`) and with the shipped MXFP4 experts
   (the training model, `load_train_model`), and through the serving model (`Checkpoint.load_model`, fp32,
   MXFP4 experts as served) as a cross-check of the two code paths;
2. DSA: perplexity at each `--topk` and with dense attention, through the serving model; overall and over the
   last half of each window, where a query has more past keys than the smaller top-ks keep;
3. thinking effort: greedy answers to held-out "Tell me about the <word>." prompts at low / high / max (reasoning
   and answer tokens, how often an answer comes), and the perplexity of the reference answer (the corpus's own
   reasoning and answer at that effort) over the assistant's tokens only;
4. MTP: how often the MTP head's guess for token t+2 equals the main model's greedy t+2 (teacher-forced on t+1),
   its accuracy against the text, and the main model's own next-token accuracy;
5. copying: teacher-forced, after "Tell me about the <word>." and the reasoning's opening "The user asks about
   the", is the model's top token the word's first token? For held-out common nouns, apart for the words the
   tokenizer keeps in one token and those it splits (the recipe's copy task, train/copy_task.py, uses one-token
   words only).

    python bench/quality.py [--checkpoint models/k3-tiny] [--json out.json] [--windows 16] [--prompts 12]
                            [--topk 16,64,256] [--context 512] [--max-tokens 160] [--threads 1]

--seed / --max-synsets pick the synsets as training did (the held-out split itself never depends on them): with
training's values the windows are loop.evaluate's, so section 1's mxfp4 number is the training report's held-out
ppl (up to the bf16 storage of the other weights). Prints one table per section and a summary line; writes every
number with --json.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the benchmarks' own helpers (PYTHONSAFEPATH omits it)
from _report import write_json  # noqa: E402

from expertmesh.chat.format import Message  # noqa: E402
from expertmesh.chat.k3 import K3Chat  # noqa: E402
from expertmesh.chat.tiktoken_tokenizer import TikTokenTokenizer  # noqa: E402
from expertmesh.checkpoint.loader import Checkpoint  # noqa: E402
from expertmesh.model.transformer import Transformer, generate  # noqa: E402
from expertmesh.train import corpus, loop  # noqa: E402
from expertmesh.train.export import load_train_model  # noqa: E402
from expertmesh.train.model import TrainModel  # noqa: E402
from expertmesh.wire.sampling_params import SamplingParams  # noqa: E402

EFFORTS = ("low", "high", "max")
WINDOW_SEED = 1234  # loop.evaluate's window offsets
BATCH = 4  # training-model windows per forward


# ----------------------------------------------------------------------------------------------- held-out text
def load_synsets(seed: int, max_synsets: int | None) -> list[corpus.Synset]:
    """WordNet's synsets, sliced as loop.prepare_data slices them."""
    synsets = corpus.load_wordnet(corpus.wordnet_dir())
    if max_synsets is not None:
        synsets = random.Random(seed).sample(synsets, min(max_synsets, len(synsets)))
    return synsets


def held_out_stream(synsets: list[corpus.Synset], chat: K3Chat, seed: int) -> torch.Tensor:
    """The held-out token stream int64 [M]: loop.prepare_data's held-out part over the checkpoint's tokenizer."""
    held = [s for s in synsets if corpus.held_out(s)]
    docs = corpus.plain_documents(held, include_held_out=True)
    samples = corpus.conversations(held, seed + 1, include_held_out=True)
    tokenizer = chat.tokenizer
    ids = loop.token_stream(tokenizer, chat, docs, samples, tokenizer.special("[EOS]"), random.Random(seed + 1))
    return torch.tensor(ids, dtype=torch.int64)


def fixed_windows(stream: torch.Tensor, context: int, count: int) -> torch.Tensor:
    """`count` windows of context + 1 tokens at seeded offsets (loop.evaluate's) [count, context + 1]."""
    n = stream.numel() - context - 1
    if n < 1:
        raise SystemExit(
            f"--context {context}: the held-out stream has {stream.numel()} tokens, fewer than a window needs "
            "(a shorter --context, or more synsets with --max-synsets)"
        )
    starts = torch.randint(0, n, (count,), generator=torch.Generator().manual_seed(WINDOW_SEED)).tolist()
    return torch.stack([stream[s : s + context + 1] for s in starts])


# ----------------------------------------------------------------------------------------------- scoring
def ppl(nll: torch.Tensor) -> float:
    """Perplexity of per-token NLLs (any shape)."""
    return math.exp(nll.double().mean().item())


def pct(value: float, base: float) -> float:
    return 100.0 * (value / base - 1.0)


@torch.no_grad()
def train_model_scores(model: TrainModel, windows: torch.Tensor, topk: int) -> dict:
    """The training model at DSA `topk` over windows [W, T+1]: per-token NLL [W, T], and the MTP counts."""
    nll, agree, mtp_hits, main_hits = [], 0, 0, 0
    for batch in windows.split(BATCH):
        tokens, targets = batch[:, :-1], batch[:, 1:]  # [B, T]
        out = model(tokens, topk)
        nll.append(F.cross_entropy(out.logits.transpose(1, 2), targets, reduction="none"))
        mtp, _ = model.mtp_logits(tokens, out, topk)  # [B, T-1, V]: position t guesses token t+2
        mtp_guess, main_guess = mtp.argmax(-1), out.logits.argmax(-1)  # [B, T-1], [B, T]
        agree += (mtp_guess == main_guess[:, 1:]).sum().item()
        mtp_hits += (mtp_guess == targets[:, 1:]).sum().item()
        main_hits += (main_guess == targets).sum().item()
    w, t = windows.shape[0], windows.shape[1] - 1
    return {
        "nll": torch.cat(nll),
        "mtp_agreement": agree / (w * (t - 1)),
        "mtp_accuracy": mtp_hits / (w * (t - 1)),
        "main_accuracy": main_hits / (w * t),
        "mtp_positions": w * (t - 1),
    }


@torch.no_grad()
def serving_nll(model: Transformer, windows: torch.Tensor) -> torch.Tensor:
    """The serving model, one fresh sequence per window: per-token NLL [W, T]."""
    rows = []
    for window in windows:
        logits = model.step(window[:-1].tolist(), model.new_cache())  # [T, V]
        rows.append(F.cross_entropy(logits, window[1:], reduction="none"))
    return torch.stack(rows)


def set_index_topk(model: Transformer, k: int) -> None:
    """Every DSA layer of a serving model attends to `k` keys from its next forward on (LatentAttention reads
    `self.ix.index_topk` at each forward)."""
    for layer in model.layers:
        if getattr(layer.attn, "indexed", False):
            layer.attn.ix = layer.attn.ix.model_copy(update={"index_topk": k})


def ppl_row(nll: torch.Tensor) -> dict:
    half = nll.shape[1] // 2
    return {"nll": nll.double().mean().item(), "ppl": ppl(nll), "ppl_last_half": ppl(nll[:, half:])}


# ----------------------------------------------------------------------------------------------- copying
@torch.no_grad()
def copy_rows(model, chat: K3Chat, synsets, seed: int, count: int = 40) -> list[dict]:
    """Per word kind (one token / several): held-out common nouns, and how often the top token after the prompt +
    "The user asks about the" is the word's first token (and its mean probability)."""
    tokenizer = chat.tokenizer
    lead = tokenizer.encode_plain("The user asks about the")
    nouns = [s for s in synsets if corpus.held_out(s) and loop.is_core(s)]
    rows = []
    for kind, several in (("one token", False), ("several tokens", True)):
        pool = [s for s in nouns if (len(tokenizer.encode_plain(" " + s.words[0])) > 1) == several]
        pool = random.Random(seed).sample(pool, min(count, len(pool)))
        top1, prob = 0, 0.0
        for s in pool:
            prompt = chat.render_ids([Message("user", f"Tell me about the {s.words[0]}.")], thinking=True)
            p = torch.softmax(model.step(prompt + lead, model.new_cache())[-1], -1)
            first = tokenizer.encode_plain(" " + s.words[0])[0]
            top1 += int(p.argmax()) == first
            prob += p[first].item()
        n = max(len(pool), 1)
        rows.append({"words": kind, "count": len(pool), "top1_fraction": top1 / n, "mean_probability": prob / n})
    return rows


# ----------------------------------------------------------------------------------------------- thinking
def prompt_synsets(synsets: list[corpus.Synset], count: int, seed: int) -> list[corpus.Synset]:
    """Held-out common nouns in their everyday sense (loop.is_core: the kind training asks "Tell me about the
    <word>." of), a seeded sample."""
    candidates = [s for s in synsets if corpus.held_out(s) and loop.is_core(s) and s.definition]
    return random.Random(seed).sample(candidates, min(count, len(candidates)))


def reference_reply(s: corpus.Synset, effort: str, by_key: dict, seed: int) -> Message:
    """The assistant turn the corpus writes for "Tell me about the <word>." at `effort` (its reasoning and answer,
    corpus.conversations' own helpers with the article "the" that question takes)."""
    rng = random.Random(f"{seed}:{s.key}:{effort}")
    reasoning = corpus.reasoning_text(s, "the", effort, by_key, rng)
    answer = corpus.answer_text(s, "the", corpus.hypernym_of(s, by_key), rng)
    return Message("assistant", answer, reasoning=reasoning)


@torch.no_grad()
def thinking_rows(model, chat: K3Chat, synsets, prompts: list, max_tokens: int, seed: int) -> tuple[list, list]:
    """Per effort: greedy generations parsed into reasoning and answer, and the reference reply's perplexity over
    the tokens after the generation prompt. Returns (rows, samples)."""
    by_key = {s.key: s for s in synsets}
    tokenizer = chat.tokenizer
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, stop_token_ids=tuple(chat.markers.stop))
    rows, samples = [], []
    for effort in EFFORTS:
        reasoning_tokens, answer_tokens, answered, finished, stopped, named, nll = [], [], 0, 0, 0, 0, []
        for s in prompts:
            user = Message("user", f"Tell me about the {s.words[0]}.")
            prompt = chat.render_ids([user], thinking=True, thinking_effort=effort)
            out = generate(model, prompt, params)
            parsed = chat.parse_output(out.tokens, phase="reasoning")
            answer = parsed.content.strip()
            reasoning_tokens.append(parsed.reasoning_tokens)
            answer_tokens.append(len(tokenizer.encode_plain(answer)))
            answered += bool(answer)
            finished += parsed.finished_thinking
            stopped += out.finish_reason == "stop"
            # does it take up the word it was asked about (anywhere in its reasoning or answer)?
            named += bool(re.search(rf"\b{re.escape(s.words[0].lower())}\b", f"{parsed.reasoning} {answer}".lower()))
            samples.append({"word": s.words[0], "effort": effort, "reasoning": parsed.reasoning, "answer": answer})
            full = chat.render_ids(
                [user, reference_reply(s, effort, by_key, seed)],
                thinking=True,
                thinking_effort=effort,
                add_generation_prompt=False,
            )
            if full[: len(prompt)] != prompt:
                raise AssertionError(f"effort {effort}: the rendered conversation does not start with its prompt")
            logits = model.step(full[:-1], model.new_cache())  # [L-1, V]
            targets = torch.tensor(full[1:])
            nll.append(F.cross_entropy(logits, targets, reduction="none")[len(prompt) - 1 :])
        n = len(prompts)
        rows.append(
            {
                "effort": effort,
                "mean_reasoning_tokens": sum(reasoning_tokens) / n,
                "mean_answer_tokens": sum(answer_tokens) / n,
                "answered_fraction": answered / n,
                "finished_thinking_fraction": finished / n,
                "stopped_fraction": stopped / n,
                "named_word_fraction": named / n,
                "reference_ppl": ppl(torch.cat(nll)),
                "reference_tokens": sum(x.numel() for x in nll),
            }
        )
    return rows, samples


# ----------------------------------------------------------------------------------------------- tables
def table(title: str, header: list[str], rows: list[list]) -> None:
    cells = [[c if isinstance(c, str) else f"{c:.4f}" if isinstance(c, float) else str(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(header)]
    print(f"\n{title}")
    print("  ".join(h.rjust(w) if i else h.ljust(w) for i, (h, w) in enumerate(zip(header, widths))))
    for r in cells:
        print("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))))


def signed(x: float) -> str:
    return f"{x:+.2f}%"


# ----------------------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", type=Path, default=Path("models/k3-tiny"), help="a K3 directory from training")
    ap.add_argument("--json", default=None, help="where to write every number")
    ap.add_argument("--windows", type=int, default=16, help="held-out windows")
    ap.add_argument(
        "--context",
        type=int,
        default=None,
        help="window length (default: the trained context, training.json's seq_len beside the checkpoint; else 512)",
    )
    ap.add_argument("--topk", default="16,32,64,128", help="DSA top-k values to compare with dense attention")
    ap.add_argument("--prompts", type=int, default=12, help="held-out prompts per thinking effort")
    ap.add_argument("--max-tokens", type=int, default=160, help="generated tokens per prompt at most")
    ap.add_argument("--seed", type=int, default=0, help="training's seed (which synsets, the held-out shuffle)")
    ap.add_argument("--max-synsets", type=int, default=None, help="training's --max-synsets, when it had one")
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (1: on a shared 2-core machine a second thread waits on the busy core, 10-20x slower)",
    )
    args = ap.parse_args(argv)
    try:
        args.topk_list = sorted({int(k) for k in args.topk.split(",") if k.strip()})
    except ValueError:
        ap.error(f"--topk {args.topk!r}: expected comma-separated integers such as 16,64,256")
    if not args.topk_list or min(args.topk_list) < 1:
        ap.error(f"--topk {args.topk!r}: expected at least one top-k >= 1")
    if not (args.checkpoint / "config.json").is_file():
        ap.error(f"--checkpoint {args.checkpoint}: no config.json (train one with scripts/train_tiny.py)")
    if args.context is None:
        report = args.checkpoint / "training.json"
        args.context = json.loads(report.read_text())["config"]["seq_len"] if report.is_file() else 512
    for name in ("windows", "context", "prompts", "max_tokens"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} {getattr(args, name)}: expected >= 1")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)  # as training evaluates: KDA's tiny decays cost ~100x per op as subnormals
    t0 = time.time()
    directory = args.checkpoint
    chat = K3Chat(TikTokenTokenizer(directory))
    synsets = load_synsets(args.seed, args.max_synsets)
    stream = held_out_stream(synsets, chat, args.seed)
    windows = fixed_windows(stream, args.context, args.windows)
    served = Checkpoint(directory).load_model()
    trained_topk = served.cfg.indexer.index_topk
    print(
        f"{directory}: {args.windows} held-out windows of {args.context} tokens "
        f"(stream {stream.numel()} tokens), trained DSA top-{trained_topk}"
    )

    seconds = {"data": time.time() - t0}
    # 1. experts: bf16 masters vs MXFP4, training model and serving model
    t = time.time()
    bf16 = train_model_scores(load_train_model(directory, "bf16"), windows, trained_topk)
    mxfp4 = train_model_scores(load_train_model(directory, "mxfp4"), windows, trained_topk)
    served_nll = serving_nll(served, windows)
    experts = {
        "bf16": ppl_row(bf16["nll"]),
        "mxfp4": ppl_row(mxfp4["nll"]),
        "serving_mxfp4": ppl_row(served_nll),
    }
    experts["mxfp4_vs_bf16_pct"] = pct(experts["mxfp4"]["ppl"], experts["bf16"]["ppl"])
    experts["serving_vs_train_pct"] = pct(experts["serving_mxfp4"]["ppl"], experts["mxfp4"]["ppl"])
    table(
        f"experts (DSA top-{trained_topk})",
        ["experts", "model", "nll", "ppl", "vs bf16"],
        [
            ["bf16 masters", "train", experts["bf16"]["nll"], experts["bf16"]["ppl"], "-"],
            ["mxfp4", "train", experts["mxfp4"]["nll"], experts["mxfp4"]["ppl"], signed(experts["mxfp4_vs_bf16_pct"])],
            [
                "mxfp4 (served)",
                "serving",
                experts["serving_mxfp4"]["nll"],
                experts["serving_mxfp4"]["ppl"],
                signed(pct(experts["serving_mxfp4"]["ppl"], experts["bf16"]["ppl"])),
            ],
        ],
    )

    seconds["experts"] = time.time() - t
    # 2. DSA top-k vs dense, serving model
    t = time.time()
    dense = ppl_row(serving_nll(Checkpoint(directory).load_model(dense_attention=True), windows))
    topk_rows = []
    for k in args.topk_list:
        if k == trained_topk:
            nll = served_nll
        else:
            set_index_topk(served, k)
            nll = serving_nll(served, windows)
        row = {"k": k, "trained": k == trained_topk, **ppl_row(nll)}
        row["vs_dense_pct"] = pct(row["ppl"], dense["ppl"])
        row["last_half_vs_dense_pct"] = pct(row["ppl_last_half"], dense["ppl_last_half"])
        topk_rows.append(row)
    set_index_topk(served, trained_topk)
    table(
        f"DSA top-k vs dense (serving model, {args.context}-token windows; last half: positions >= {args.context // 2})",
        ["attention", "ppl", "vs dense", "ppl last half", "vs dense "],
        [["dense", dense["ppl"], "-", dense["ppl_last_half"], "-"]]
        + [
            [
                f"top-{r['k']}" + (" (trained)" if r["trained"] else ""),
                r["ppl"],
                signed(r["vs_dense_pct"]),
                r["ppl_last_half"],
                signed(r["last_half_vs_dense_pct"]),
            ]
            for r in topk_rows
        ],
    )

    seconds["dsa"] = time.time() - t
    # 3. thinking effort, serving model at the trained top-k
    t = time.time()
    prompts = prompt_synsets(synsets, args.prompts, args.seed)
    if not prompts:
        raise SystemExit("no held-out common noun to ask about (more synsets with --max-synsets)")
    thinking, samples = thinking_rows(served, chat, synsets, prompts, args.max_tokens, args.seed)
    table(
        f"thinking effort ({len(prompts)} held-out prompts, greedy, at most {args.max_tokens} tokens)",
        ["effort", "reasoning tok", "answer tok", "answered", "thought ended", "stopped", "names word", "ref ppl"],
        [
            [
                r["effort"],
                f"{r['mean_reasoning_tokens']:.1f}",
                f"{r['mean_answer_tokens']:.1f}",
                f"{r['answered_fraction']:.2f}",
                f"{r['finished_thinking_fraction']:.2f}",
                f"{r['stopped_fraction']:.2f}",
                f"{r['named_word_fraction']:.2f}",
                r["reference_ppl"],
            ]
            for r in thinking
        ],
    )

    seconds["thinking"] = time.time() - t
    # 4. MTP, training model with MXFP4 experts (measured in section 1's forward)
    mtp = {k: mxfp4[k] for k in ("mtp_agreement", "mtp_accuracy", "main_accuracy", "mtp_positions")}
    table(
        f"MTP (training model, mxfp4, {mtp['mtp_positions']} positions)",
        ["measure", "value"],
        [
            ["MTP top-1 = main model's greedy t+2", mtp["mtp_agreement"]],
            ["MTP top-1 accuracy (t+2)", mtp["mtp_accuracy"]],
            ["main top-1 accuracy (t+1)", mtp["main_accuracy"]],
        ],
    )

    # 5. copying the asked word, serving model
    copies = copy_rows(served, chat, synsets, args.seed)
    table(
        'copying (held-out common nouns; top token after the prompt + "The user asks about the")',
        ["words", "count", "top-1 = the word", "mean p"],
        [[r["words"], r["count"], f"{r['top1_fraction']:.2f}", f"{r['mean_probability']:.3f}"] for r in copies],
    )

    dsa_pct = pct(experts["serving_mxfp4"]["ppl"], dense["ppl"])  # the served model is at the trained top-k
    summary = (
        f"mxfp4 vs bf16: {signed(experts['mxfp4_vs_bf16_pct'])} ppl; DSA top-{trained_topk} vs dense: "
        f"{signed(dsa_pct)}; MTP agreement: {mtp['mtp_agreement']:.2f}; copies the asked word: "
        + ", ".join(f"{r['top1_fraction']:.2f} ({r['words']})" for r in copies)
    )
    print("\n" + summary)
    result = {
        "checkpoint": str(directory),
        "context": args.context,
        "windows": args.windows,
        "held_out_tokens": stream.numel(),
        "trained_topk": trained_topk,
        "experts": experts,
        "dsa": {"dense": dense, "topk": topk_rows, "trained_vs_dense_pct": dsa_pct},
        "thinking": thinking,
        "thinking_samples": samples,
        "mtp": mtp,
        "copying": copies,
        "summary": summary,
        "seconds": {**{k: round(v, 1) for k, v in seconds.items()}, "total": round(time.time() - t0, 1)},
    }
    write_json(args.json, args, **result)
    return result


if __name__ == "__main__":
    main()
