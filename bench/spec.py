"""Speculative decoding on the shipped model, in one process (expertmesh/model/speculative.py).

On the embedded default (`models/k3-tiny`, its trained MTP layer loaded), greedy, chat questions in K3's template
(the n-gram drafter apart):

1. MTP: K = 0 (plain `generate`) and K = 1, 2, 3 side by side over the same prompts — mean accepted length (tokens
   emitted per target forward), acceptance by draft position, decode tokens/s (prefill timed apart and left out),
   and whether every text equals plain decoding's;
2. n-gram (prompt lookup) on a prompt that repeats code, K = 0 vs K = 3;
3. the serving path (in-process deployment, expertmesh/entry/local.py: the router's engine over an attention and an
   expert worker as objects, the same data path as `expertmesh up` without gRPC): K = 0..4 (`--speculative-tokens`)
   at concurrency 1, 4, 16 — decode tokens/s (from each round's first token to its last) and mean accepted length —
   and the n-gram drafter on an agent-style workload (turns re-emitting code from their context);
4. rollback: what undoing a partially accepted verify of K+1 = 4 rows costs — the per-position states the verify
   keeps (SequenceCache.roll_back: truncate, pick a state) against a snapshot of every KDA state before the verify
   plus a replay of the accepted rows.

    python bench/spec.py [--checkpoint models/k3-tiny] [--max-tokens 48] [--threads 1] [--json out.json]
                         [--serving-only]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import write_json  # noqa: E402

from expertmesh.chat.format import Message  # noqa: E402
from expertmesh.chat.k3 import K3Chat  # noqa: E402
from expertmesh.chat.tokenizer import load_tokenizer  # noqa: E402
from expertmesh.checkpoint.loader import Checkpoint  # noqa: E402
from expertmesh.entry.local import build_local_engine  # noqa: E402
from expertmesh.model.cache import KDACache  # noqa: E402
from expertmesh.model.speculative import forward_rows, generate_speculative  # noqa: E402
from expertmesh.model.transformer import generate  # noqa: E402
from expertmesh.wire.sampling_params import SamplingParams  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
# the MTP workload: chat questions as `expertmesh chat` sends them (K3's template, thinking on) — what the embedded
# default serves; its reasoning and answer are what the drafts have to guess
QUESTIONS = (
    "Tell me about the river.",
    "Tell me about the hammer.",
    "What is a cloud?",
    "Tell me about the king.",
)
CODE = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n"


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def prefill_seconds(model, prompt: list[int]) -> float:
    return timed(lambda: model.step(prompt, model.new_cache()))[1]


def run(model, prompts: list[list[int]], params, method: str | None, k: int) -> dict:
    """Every prompt once (plain `generate` when method is None) → figures summed over the prompts."""
    tokens = decode_s = steps = drafted = accepted = 0
    by_pos_d, by_pos_a = [0] * k, [0] * k
    texts = []
    for prompt in prompts:
        pre = prefill_seconds(model, prompt)
        if method is None:
            gen, s = timed(lambda: generate(model, prompt, params))
            steps += len(gen.tokens) - 1
        else:
            gen, s = timed(lambda: generate_speculative(model, prompt, params, method=method, k=k))
            steps += gen.verify_steps
            drafted, accepted = drafted + gen.drafted, accepted + gen.accepted
            by_pos_d = [a + b for a, b in zip(by_pos_d, gen.drafted_by_position)]
            by_pos_a = [a + b for a, b in zip(by_pos_a, gen.accepted_by_position)]
        tokens += len(gen.tokens) - 1  # the first token comes with the prefill
        decode_s += max(s - pre, 1e-9)
        texts.append(gen.tokens)
    return {
        "method": method or "none",
        "k": k,
        "decode_tokens": tokens,
        "decode_seconds": decode_s,
        "decode_tok_s": tokens / decode_s,
        "target_forwards": steps,
        "mean_accepted_length": tokens / steps if steps else 0.0,
        "drafted": drafted,
        "accepted": accepted,
        "acceptance_by_position": [a / d if d else 0.0 for a, d in zip(by_pos_a, by_pos_d)],
        "texts": texts,
    }


def rollback_cost(model, prompt: list[int], repeats: int) -> dict:
    """Seconds to undo a verify of 4 rows keeping 2 (the newest token and one accepted draft)."""
    per_position, snapshot, replay = [], [], []
    for _ in range(repeats):
        cache = model.new_cache()
        forward_rows(model, prompt, cache, verify=False)
        seen = cache.length
        kda = [e for e in cache.layers if isinstance(e, KDACache)]
        saved, s = timed(lambda: [(e.state.clone(), e.conv.clone()) for e in kda])
        snapshot.append(s)
        rows = [prompt[-1], 11, 12, 13]
        forward_rows(model, rows, cache, verify=True)
        per_position.append(timed(lambda: cache.roll_back(seen + 2))[1])
        # the other design: restore the snapshot, drop the rows, replay the kept ones
        for e, (state, conv) in zip(kda, saved):
            e.state, e.conv = state, conv
        cache.length = seen
        for entry in cache.layers:
            if not isinstance(entry, KDACache):
                entry.truncate(seen)
        replay.append(timed(lambda: forward_rows(model, rows[:2], cache, verify=True))[1])
    med = statistics.median
    return {
        "per_position_rollback_s": med(per_position),
        "snapshot_s": med(snapshot),
        "replay_s": med(replay),
        "snapshot_and_replay_s": med(snapshot) + med(replay),
    }


def serve_round(engine, prompts: list[list[int]], params) -> tuple[list[list[int]], int, float]:
    """All `prompts` submitted at once → (outputs, decode tokens: all but each first, seconds from the round's
    first token to its last)."""
    reqs = [engine.submit(p, params) for p in prompts]
    outs = [r.wait(600).output for r in reqs]
    window = max(r.last_token_at for r in reqs) - min(r.first_token_at for r in reqs)
    return outs, sum(len(o) - 1 for o in outs), window


def serving(checkpoint: str, prompts: list[list[int]], params, method: str, ks, concurrency, rounds: int) -> list:
    """One deployment per K (0: off), all up at once; per concurrency c, `rounds` rounds, each running c requests
    (prompts cycled) on every deployment in turn — interleaved, the order reversed every other round, so a noisy
    machine's slow spells fall on every K alike. Reported: the median over rounds of each K's tok/s and of its
    speedup over K = 0 in the same round."""
    engines = {
        k: build_local_engine(checkpoint, speculative_tokens=k, speculative_method=method if k else "", max_waiting=256)
        for k in ks
    }
    rows = []
    try:
        for engine in engines.values():
            serve_round(engine, prompts[:1], SamplingParams(max_tokens=4, temperature=0.0))  # warm
        for c in concurrency:
            per = {k: {"tok_s": [], "texts": [], "accepted": 0, "steps": 0} for k in ks}
            for r in range(rounds):
                batch = [prompts[(r * c + i) % len(prompts)] for i in range(c)]
                for k in ks if r % 2 == 0 else list(reversed(ks)):
                    engine, acc = engines[k], per[k]
                    before = (engine.stats.accepted, engine.stats.verify_steps)
                    outs, n, dt = serve_round(engine, batch, params)
                    acc["tok_s"].append(n / dt if dt else 0.0)
                    acc["texts"] += outs
                    acc["accepted"] += engine.stats.accepted - before[0]
                    acc["steps"] += engine.stats.verify_steps - before[1]
            for k in ks:
                acc, base = per[k], per[ks[0]]
                ratios = [a / b for a, b in zip(acc["tok_s"], base["tok_s"]) if b]
                rows.append(
                    {
                        "method": method if k else "off",
                        "k": k,
                        "concurrency": c,
                        "decode_tok_s": statistics.median(acc["tok_s"]),
                        "decode_tok_s_rounds": acc["tok_s"],
                        "speedup": statistics.median(ratios) if ratios else 0.0,
                        "mean_accepted_length": 1 + acc["accepted"] / acc["steps"] if acc["steps"] else 1.0,
                        "identical": acc["texts"] == base["texts"],
                    }
                )
    finally:
        for engine in engines.values():
            engine.close()
    return rows


def print_serving(title: str, rows: list) -> None:
    print(f"\n{title}")
    print(f"{'method':>6} {'K':>2} {'conc':>4} {'accepted len':>12} {'tok/s':>8} {'speedup':>8} {'identical':>9}")
    for r in sorted(rows, key=lambda r: (r["concurrency"], r["k"])):
        print(
            f"{r['method']:>6} {r['k']:>2} {r['concurrency']:>4} {r['mean_accepted_length']:>12.2f} "
            f"{r['decode_tok_s']:>8.1f} {r['speedup']:>7.2f}× {str(r['identical']):>9}"
        )


def _load() -> str:
    """The machine's 1-minute load average (a shared machine's noise, printed beside the figures)."""
    return f"{os.getloadavg()[0]:.2f}"


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default=str(REPO / "models" / "k3-tiny"))
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=20, help="rollback measurements (the median is reported)")
    ap.add_argument("--json", default="")
    ap.add_argument("--rounds", type=int, default=3, help="serving: interleaved rounds per (K, concurrency)")
    ap.add_argument("--serving-only", action="store_true", help="only the serving-path tables")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    torch.set_num_threads(args.threads)
    ck = Checkpoint(args.checkpoint)
    model = ck.hf.load_mtp(ck.load_model(dtype=torch.bfloat16))
    tok = load_tokenizer(args.checkpoint)
    chat = K3Chat(tok)
    prompts = [chat.render_ids([Message("user", q)], thinking=True) for q in QUESTIONS]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    generate(model, prompts[0], SamplingParams(max_tokens=2, temperature=0.0))  # warm the kernels once
    load_before = _load()
    served = serving(args.checkpoint, prompts, params, "mtp", (0, 1, 2, 3, 4), (1, 4, 16), args.rounds)
    print_serving(
        f"serving path (in-process deployments: router engine + 1 attention + 1 expert worker each), MTP, greedy, "
        f"{args.max_tokens} tokens a request; median of {args.rounds} interleaved rounds (load average before: "
        f"{load_before}, after: {_load()})",
        served,
    )
    agent = [tok.encode(CODE * 2 + f"def f{i}(a, b):\n") for i in range(4)]
    served_ngram = serving(args.checkpoint, agent, params, "ngram", (0, 3), (1, 4), args.rounds)
    print_serving(
        "serving path, n-gram drafter on an agent-style workload (code re-emitted from context)", served_ngram
    )
    if args.serving_only:
        write_json(args.json, args, serving=served, serving_ngram=served_ngram)
        return {"serving": served, "serving_ngram": served_ngram}

    mtp = [run(model, prompts, params, None if k == 0 else "mtp", k) for k in (0, 1, 2, 3)]
    base = mtp[0]
    print(f"\nMTP speculation, {len(prompts)} prompts × {args.max_tokens} tokens, greedy, concurrency 1")
    print(f"{'K':>2} {'accepted len':>12} {'tok/s':>8} {'speedup':>8} {'identical':>9}  acceptance by position")
    for r in mtp:
        r["identical"] = r["texts"] == base["texts"]
        r["speedup"] = r["decode_tok_s"] / base["decode_tok_s"]
        by_pos = " ".join(f"{a:.2f}" for a in r["acceptance_by_position"])
        print(
            f"{r['k']:>2} {r['mean_accepted_length']:>12.2f} {r['decode_tok_s']:>8.1f} {r['speedup']:>7.2f}× "
            f"{str(r['identical']):>9}  {by_pos}"
        )

    code = [tok.encode(CODE * 3)]
    ngram = [run(model, code, params, None, 0), run(model, code, params, "ngram", 3)]
    print("\nn-gram (prompt lookup) on a prompt repeating code")
    print(f"{'K':>2} {'accepted len':>12} {'tok/s':>8} {'speedup':>8} {'identical':>9}")
    for r in ngram:
        r["identical"] = r["texts"] == ngram[0]["texts"]
        r["speedup"] = r["decode_tok_s"] / ngram[0]["decode_tok_s"]
        print(
            f"{r['k']:>2} {r['mean_accepted_length']:>12.2f} {r['decode_tok_s']:>8.1f} {r['speedup']:>7.2f}× "
            f"{str(r['identical']):>9}"
        )

    rb = rollback_cost(model, prompts[0], args.repeats)
    print("\nrollback of a 4-row verify keeping 2 rows (median seconds)")
    print(f"  per-position states (truncate + pick): {rb['per_position_rollback_s'] * 1e6:9.1f} µs")
    print(
        f"  snapshot before verify + replay:       {rb['snapshot_and_replay_s'] * 1e6:9.1f} µs "
        f"(snapshot {rb['snapshot_s'] * 1e6:.1f} µs, replay {rb['replay_s'] * 1e6:.1f} µs)"
    )
    for r in mtp + ngram:
        del r["texts"]
    result = {"mtp": mtp, "ngram": ngram, "rollback": rb, "serving": served, "serving_ngram": served_ngram}
    write_json(args.json, args, **result)
    return result


if __name__ == "__main__":
    main()
