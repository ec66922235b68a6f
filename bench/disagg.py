"""Prefill/decode disaggregation (issue #36): decode latency under periodic long prompts, colocated vs a prefill pool.

Real processes on loopback (`expertmesh up`'s LocalCluster, the embedded tiny model unless --checkpoint): a
decode-heavy background load — `--decoders` streams, each sending short prompts with long outputs back to back —
and, every `--long-every` seconds, a `--long-tokens`-token prompt (a tool output arriving) with a short answer.
For each deployment, side by side in one run: the decode streams' inter-token latency p50 / p99 (and p99 after
each request's second token, and the first→second token gap, which holds a hand-off), the long prompts'
time to first token p50 / p99, the background tokens/s, and — with a prefill pool — the hand-off bytes and seconds
per 1K prompt tokens (router /metrics) and the prompt tokens each pool computed. Greedy: the long prompts' answers
must be the same in every deployment. Then the full-2.8t arithmetic: KV + KDA state bytes of a 32K-token hand-off
and its time at 400 Gb/s and over NVLink.

    python bench/disagg.py [--deployments colocated,colocated2,disagg] [--seconds 40] [--decoders 4]
                           [--long-tokens 1000] [--long-every 3] [--json bench/results/disagg.json]
"""

from __future__ import annotations

import argparse
import random
import sys
import threading
import time
import urllib.request
from pathlib import Path

import grpc

from expertmesh.checkpoint.loader import default_checkpoint
from expertmesh.entry.cluster import LocalCluster, free_port
from expertmesh.protos import router_pb2, router_pb2_grpc, sampling_pb2

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the benchmarks' own helpers (PYTHONSAFEPATH omits it)
from _report import sequence_cache_bytes, write_json  # noqa: E402

DEPLOYMENTS = {
    "colocated": ("colocated, 1 attention worker", {"attention_workers": 1}),
    "colocated2": ("colocated, 2 attention workers", {"attention_workers": 2}),
    "disagg": ("1 prefill + 1 decode worker", {"attention_workers": 1, "prefill_workers": 1}),
}


def stream(stub, prompt: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy tokens of one request and the monotonic time each arrived."""
    req = router_pb2.GenerateRequest(
        token_ids=router_pb2.TokenIds(ids=prompt),
        params=sampling_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0),
    )  # no stop token: every request runs max_tokens
    tokens, times = [], []
    for ev in stub.Generate(req, timeout=600):
        if ev.HasField("token"):
            tokens.append(ev.token.token_id)
            times.append(time.monotonic())
    return tokens, times


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q / 100 * len(xs)))]


def router_counters(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith(
            (
                "expertmesh_prefill_tokens_total",
                "expertmesh_kv_transfer_bytes_total",
                "expertmesh_kv_handoff_seconds_sum",
                "expertmesh_kv_handoff_seconds_count",
            )
        ):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def run_load(cluster, args, seed: int) -> dict:
    """The workload against one deployment: background decoders + periodic long prompts for `args.seconds`."""
    address = f"127.0.0.1:{cluster.grpc_port}"
    channel = grpc.insecure_channel(address)
    stub = router_pb2_grpc.RouterStub(channel)
    stream(stub, [1, 2, 3], 2)  # warm: kernels loaded, connections up
    before = router_counters(cluster.http_url)
    stop = threading.Event()
    gaps: list[float] = []
    later: list[float] = []  # gaps after a request's second token (a hand-off precedes the second)
    firsts: list[float] = []  # first token → second token
    decoded = [0]
    lock = threading.Lock()

    def decoder(k: int) -> None:
        rng = random.Random(seed + k)
        while not stop.is_set():
            _, times = stream(stub, [rng.randrange(256) for _ in range(args.short_tokens)], args.decode_tokens)
            with lock:
                gaps.extend(b - a for a, b in zip(times, times[1:]))
                later.extend(b - a for a, b in zip(times[1:], times[2:]))
                if len(times) > 1:
                    firsts.append(times[1] - times[0])
                decoded[0] += len(times)

    rng = random.Random(seed)
    longs = [
        [rng.randrange(256) for _ in range(args.long_tokens)] for _ in range(int(args.seconds // args.long_every) + 1)
    ]
    threads = [threading.Thread(target=decoder, args=(k,), daemon=True) for k in range(args.decoders)]
    start = time.monotonic()
    for t in threads:
        t.start()
    ttft, answers = [], []
    for i, prompt in enumerate(longs):
        wake = start + (i + 1) * args.long_every
        if wake > start + args.seconds:
            break
        time.sleep(max(0.0, wake - time.monotonic()))
        sent = time.monotonic()
        tokens, times = stream(stub, prompt, args.long_answer)
        ttft.append(times[0] - sent)
        answers.append(tokens)
    stop.set()
    elapsed = time.monotonic() - start
    for t in threads:
        t.join()
    after = router_counters(cluster.http_url)
    channel.close()
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    prefill_pool = delta.get('expertmesh_prefill_tokens_total{pool="prefill"}', 0.0)
    moved = delta.get("expertmesh_kv_transfer_bytes_total", 0.0)
    handoff_s = delta.get("expertmesh_kv_handoff_seconds_sum", 0.0)
    return {
        "itl_p50_ms": 1e3 * percentile(gaps, 50),
        "itl_p99_ms": 1e3 * percentile(gaps, 99),
        "itl_p99_after_second_ms": 1e3 * percentile(later, 99),
        "first_gap_p50_ms": 1e3 * percentile(firsts, 50),
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "long_prompts": len(ttft),
        "decode_tok_s": decoded[0] / elapsed,
        "prompt_tokens_by_pool": {
            k.split('"')[1]: v for k, v in delta.items() if k.startswith("expertmesh_prefill_tokens_total")
        },
        "handoffs": delta.get("expertmesh_kv_handoff_seconds_count", 0.0),
        "handoff_bytes": moved,
        "handoff_bytes_per_1k_prompt": 1000 * moved / prefill_pool if prefill_pool else None,
        "handoff_s_per_1k_prompt": 1000 * handoff_s / prefill_pool if prefill_pool else None,
        "answers": answers,
    }


def full_scale(tokens: int = 32 * 1024, network_gbit: float = 400.0, nvlink_gbs: float = 450.0) -> dict:
    """The full-2.8t arithmetic for one `tokens`-token hand-off (bf16 latent KV + indexer keys, fp32 KDA state)."""
    kv, state = sequence_cache_bytes(tokens)
    total = kv + state
    return {
        "tokens": tokens,
        "kv_bytes": kv,
        "kda_state_bytes": state,
        "handoff_bytes": total,
        "network_gbit": network_gbit,
        "network_s": total / (network_gbit / 8 * 1e9),
        "nvlink_gbs": nvlink_gbs,
        "nvlink_s": total / (nvlink_gbs * 1e9),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--deployments", default="colocated,colocated2,disagg", help=f"of {', '.join(DEPLOYMENTS)}")
    p.add_argument("--checkpoint", default=None, help="default: the embedded tiny model")
    p.add_argument("--seconds", type=float, default=40.0, help="load duration per deployment")
    p.add_argument("--decoders", type=int, default=4, help="background decode streams")
    p.add_argument("--short-tokens", type=int, default=32, help="prompt tokens of a background request")
    p.add_argument("--decode-tokens", type=int, default=64, help="output tokens of a background request")
    p.add_argument("--long-tokens", type=int, default=1000, help="prompt tokens of a periodic long prompt")
    p.add_argument("--long-answer", type=int, default=4, help="output tokens of a long prompt")
    p.add_argument("--long-every", type=float, default=3.0, help="seconds between long prompts")
    p.add_argument("--prefill-tokens", type=int, default=256, help="prompt tokens a sequence prefills per step")
    p.add_argument("--json", default="bench/results/disagg.json")
    args = p.parse_args(argv)
    checkpoint = args.checkpoint or default_checkpoint("tiny")
    results = {}
    for name in args.deployments.split(","):
        label, shape = DEPLOYMENTS[name]
        with LocalCluster(
            checkpoint,
            expert_workers=2,
            http_port=free_port(),
            grpc_port=free_port(),
            threads=None,
            prefill_chunk=64,
            prefill_tokens=args.prefill_tokens,
            **shape,
        ) as cluster:
            results[label] = run_load(cluster, args, seed=7)
        print(f"{label}: done", flush=True)

    print(
        f"\n{args.decoders} decode streams ({args.short_tokens}-token prompts, {args.decode_tokens} tokens each) + a "
        f"{args.long_tokens}-token prompt every {args.long_every:g} s, {args.seconds:g} s per deployment"
    )
    print(
        f"{'deployment':<32} {'ITL p50 ms':>10} {'ITL p99 ms':>10} {'p99 after 2nd':>13} {'1st gap p50':>11} "
        f"{'TTFT p50 s':>10} {'TTFT p99 s':>10} {'decode tok/s':>12}  prompt tokens by pool; hand-off per 1K "
        f"prompt tokens"
    )
    for label, r in results.items():
        pools = ", ".join(f"{k} {v:,.0f}" for k, v in sorted(r["prompt_tokens_by_pool"].items()))
        moved = (
            ""
            if r["handoff_bytes_per_1k_prompt"] is None
            else (
                f"; {r['handoffs']:.0f} hand-offs, {r['handoff_bytes_per_1k_prompt'] / 2**20:.2f} MiB and "
                f"{1e3 * r['handoff_s_per_1k_prompt']:.1f} ms per 1K prompt tokens"
            )
        )
        print(
            f"{label:<32} {r['itl_p50_ms']:>10.1f} {r['itl_p99_ms']:>10.1f} {r['itl_p99_after_second_ms']:>13.1f} "
            f"{r['first_gap_p50_ms']:>11.1f} {r['ttft_p50_s']:>10.2f} "
            f"{r['ttft_p99_s']:>10.2f} {r['decode_tok_s']:>12.1f}  {pools}{moved}"
        )
    answers = [r["answers"][: min(len(x["answers"]) for x in results.values())] for r in results.values()]
    print(
        f"long prompts' greedy answers identical across deployments: "
        f"{'yes' if all(a == answers[0] for a in answers) else 'NO'} ({len(answers[0])} compared)"
    )
    full = full_scale()
    gib = 2**30
    print(
        f"\nfull-2.8t, one {full['tokens'] // 1024}K-token hand-off: KV {full['kv_bytes'] / gib:.2f} GiB + KDA state "
        f"{full['kda_state_bytes'] / 2**20:.1f} MiB = {full['handoff_bytes'] / gib:.2f} GiB; "
        f"{full['network_s']:.3f} s at {full['network_gbit']:g} Gb/s, {full['nvlink_s']:.4f} s over NVLink "
        f"({full['nvlink_gbs']:g} GB/s per direction)"
    )
    write_json(args.json, args, results=results, full_2_8t=full)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
