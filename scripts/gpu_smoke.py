"""The serving half of scripts/gpu-smoke.sh: `expertmesh up --device cuda` (bf16) against the fp32 CPU reference.

For each preset (tiny, small): a synthetic checkpoint, the reference model on CPU in fp32, and a local deployment
(router + attention worker + expert worker as processes) on the GPU. Prompt log-probs come from /v1/completions
(echo + logprobs, max_tokens 0) and greedy tokens from the router's gRPC Generate.

bf16 tolerance (documented in README): prompt log-probs within 0.15 nats mean and 0.6 max of fp32 — bf16 weights
and activations move near-ties of MoE routing and DSA top-k, so single positions can move more than the average.
Greedy tokens are reported (the position of the first divergence), not required equal: random synthetic models have
near-uniform next-token distributions where bf16 rounding flips the argmax.

NCCL check (`--transport collective` on CUDA, worker/collective.py): tiny served with the per-layer exchange over
torch.distributed NCCL pairs, then over gRPC; the pair must form, carry every expert call (no gRPC fallback) and give
the same greedy tokens. With one GPU both ranks are on it; with two, the expert worker is on the second.

    python scripts/gpu_smoke.py [--presets tiny,small] [--out bench/results/gpu_smoke.json] [--no-nccl]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

import grpc
import httpx
import torch

from expertmesh.checkpoint.loader import Checkpoint, create_checkpoint
from expertmesh.entry.cluster import LocalCluster, free_port
from expertmesh.model.config import preset
from expertmesh.model.transformer import generate
from expertmesh.protos import router_pb2, router_pb2_grpc, sampling_pb2
from expertmesh.wire.sampling_params import SamplingParams

MEAN_TOL, MAX_TOL = 0.15, 0.6
PROMPTS, PROMPT_LEN, NEW_TOKENS = 4, 48, 16


def first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def check(name: str, root: Path) -> dict:
    ckpt = Checkpoint(create_checkpoint(preset(name), root / name, seed=0))
    ref = ckpt.load_model()
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(PROMPT_LEN)] for _ in range(PROMPTS)]
    deltas, divergence = [], []
    http_port, grpc_port = free_port(), free_port()
    with LocalCluster(
        ckpt.path,
        attention_workers=1,
        expert_workers=1,
        http_port=http_port,
        grpc_port=grpc_port,
        device="cuda",
        dtype="bfloat16",
    ):
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            for p in prompts:
                with torch.no_grad():
                    want = torch.log_softmax(ref.step(p, ref.new_cache()).float(), -1)[:-1]
                want = want.gather(1, torch.tensor(p[1:])[:, None])[:, 0]
                r = httpx.post(
                    f"http://127.0.0.1:{http_port}/v1/completions",
                    timeout=300,
                    json={"model": name, "prompt": p, "echo": True, "logprobs": 0, "max_tokens": 0},
                ).json()
                got = torch.tensor(r["choices"][0]["logprobs"]["token_logprobs"][1:])
                deltas.append((got - want).abs())
                req = router_pb2.GenerateRequest(
                    token_ids=router_pb2.TokenIds(ids=p),
                    params=sampling_pb2.SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0),
                )
                served = [ev.token.token_id for ev in stub.Generate(req, timeout=300) if ev.HasField("token")]
                greedy = generate(ref, p, SamplingParams(max_tokens=NEW_TOKENS), prefill_chunk=16).tokens
                divergence.append(first_divergence(served, greedy))
    d = torch.cat(deltas)
    row = {
        "preset": name,
        "logprob_mean_abs_delta": d.mean().item(),
        "logprob_max_abs_delta": d.max().item(),
        "greedy_first_divergence": divergence,
        "ok": d.mean().item() <= MEAN_TOL and d.max().item() <= MAX_TOL,
    }
    return row


def nccl_check(root: Path) -> dict:
    """tiny over NCCL pairs vs over gRPC: pairs formed, every expert call on them, the same greedy tokens."""
    import time

    from expertmesh.wire.clients import RemoteExpert

    ckpt = create_checkpoint(preset("tiny"), root / "nccl-tiny", seed=0)
    prompts = [[(7 * i + j) % 256 for j in range(20 + 5 * i)] for i in range(3)]
    env = {"expert-0": {"CUDA_VISIBLE_DEVICES": "1"}} if torch.cuda.device_count() > 1 else {}
    out = {}
    for transport in ("collective", "grpc"):
        grpc_port = free_port()
        cluster = LocalCluster(
            ckpt,
            attention_workers=1,
            expert_workers=1,
            http_port=free_port(),
            grpc_port=grpc_port,
            device="cuda",
            dtype="bfloat16",
            transport=transport,
            worker_env=env,
        )
        with cluster:
            expert = RemoteExpert(next(c.address for c in cluster.workers if c.name == "expert-0"), timeout=10)
            deadline = time.monotonic() + 60
            while (
                transport == "collective"
                and expert.transport_counts()["collective_pairs"] < 1
                and time.monotonic() < deadline
            ):
                time.sleep(0.2)
            before = expert.transport_counts()
            with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
                stub = router_pb2_grpc.RouterStub(channel)
                out[transport] = [
                    [
                        ev.token.token_id
                        for ev in stub.Generate(
                            router_pb2.GenerateRequest(
                                token_ids=router_pb2.TokenIds(ids=p),
                                params=sampling_pb2.SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0),
                            ),
                            timeout=300,
                        )
                        if ev.HasField("token")
                    ]
                    for p in prompts
                ]
            after = expert.transport_counts()
            expert.close()
            if transport == "collective":
                calls = {k: after[k] - before[k] for k in ("grpc_calls", "collective_calls")}
                calls["pairs_formed"] = before["collective_pairs"]
                why = [line for c in cluster.workers for line in c.lines if "collective pair" in line][-3:]
    ok = calls["collective_calls"] > 0 and calls["grpc_calls"] == 0 and out["collective"] == out["grpc"]
    return {
        "gpus": torch.cuda.device_count(),
        **calls,
        "tokens_equal": out["collective"] == out["grpc"],
        "log": why,
        "ok": ok,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="tiny,small")
    ap.add_argument("--out", default="bench/results/gpu_smoke.json")
    ap.add_argument("--no-nccl", action="store_true", help="skip the NCCL collective-transport check")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_smoke.py: FAILED: no CUDA device", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        rows = [check(name, Path(tmp)) for name in args.presets.split(",")]
        nccl = None if args.no_nccl else nccl_check(Path(tmp))
    print(f"{'preset':>7}  {'mean |Δlogprob|':>15}  {'max |Δlogprob|':>14}  greedy first divergence (None = equal)")
    for r in rows:
        print(
            f"{r['preset']:>7}  {r['logprob_mean_abs_delta']:15.4f}  {r['logprob_max_abs_delta']:14.4f}  "
            f"{r['greedy_first_divergence']}  {'ok' if r['ok'] else 'FAILED'}"
        )
    if nccl is not None:
        print(
            f"NCCL pairs ({nccl['gpus']} GPU(s)): formed {nccl['pairs_formed']}, expert calls over them "
            f"{nccl['collective_calls']}, over gRPC {nccl['grpc_calls']}, tokens equal to gRPC's "
            f"{nccl['tokens_equal']}  {'ok' if nccl['ok'] else 'FAILED'}"
        )
        if not nccl["ok"]:
            print("\n".join(nccl["log"]))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps({"tolerance": {"mean": MEAN_TOL, "max": MAX_TOL}, "rows": rows, "nccl": nccl}, indent=1)
    )
    return 0 if all(r["ok"] for r in rows) and (nccl is None or nccl["ok"]) else 1


if __name__ == "__main__":
    sys.exit(main())
