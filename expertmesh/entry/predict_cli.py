"""`expertmesh predict`: how fast a deployment will be, before renting it (expertmesh/forecast/).

    expertmesh predict --model NAME|CONFIG --gpu TYPE --gpus N [--tp N] [--ep N] [--dp-attention]
        [--prefill-gpus N --decode-gpus N] --input-len N --output-len N [--concurrency N | --batch-per-gpu N]
        [--weights bf16|fp8|int4|mxfp4|nvfp4] [--attention-dtype bf16|fp8] [--cache-hit F]
        [--accepted-tokens F] [--expert-imbalance F] [--phase prefill|decode|both] [--json]

A table for people, `--json` for machines (the prediction with the inputs it assumed echoed). Bad input exits 2
naming the flag.
"""

from __future__ import annotations

import argparse
import json
import sys

from expertmesh.forecast.gpus import GPU_NAMES
from expertmesh.forecast.models import MODEL_NAMES
from expertmesh.forecast.predict import ATTENTION_DTYPES, WEIGHT_DTYPES, Layout, Workload, predict
from expertmesh.forecast.terms import EP_IMBALANCE
from expertmesh.runtime.argtypes import positive_int


def _fraction(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, found {text!r}") from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help=f"{', '.join(MODEL_NAMES)} or a config.json path")
    p.add_argument("--gpu", required=True, help=f"GPU type: {', '.join(GPU_NAMES)}")
    p.add_argument("--gpus", type=positive_int, required=True, metavar="N", help="GPUs in the deployment")
    p.add_argument("--tp", type=positive_int, default=1, metavar="N", help="tensor parallelism (default 1)")
    p.add_argument(
        "--ep", type=positive_int, metavar="N", help="expert parallelism (default: each pool's GPUs, wide EP)"
    )
    p.add_argument("--dp-attention", action="store_true", help="one attention instance per GPU (DP attention)")
    p.add_argument("--prefill-gpus", type=positive_int, metavar="N", help="GPUs of a separate prefill pool")
    p.add_argument("--decode-gpus", type=positive_int, metavar="N", help="GPUs of a separate decode pool")
    p.add_argument("--input-len", type=positive_int, required=True, metavar="N", help="prompt tokens")
    p.add_argument("--output-len", type=positive_int, required=True, metavar="N", help="output tokens")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=_fraction, metavar="N", help="sequences decoding at once, all GPUs")
    load.add_argument("--batch-per-gpu", type=_fraction, metavar="N", help="sequences per decode GPU")
    p.add_argument(
        "--weights",
        default="bf16",
        help=f"routed experts' dtype: {'|'.join(WEIGHT_DTYPES)} (default "
        "bf16; fp8 also quantises the other linear layers)",
    )
    p.add_argument("--attention-dtype", default="bf16", help=f"KV cache and attention: {'|'.join(ATTENTION_DTYPES)}")
    p.add_argument("--cache-hit", type=_fraction, default=0.0, metavar="F", help="prompt share found cached")
    p.add_argument(
        "--accepted-tokens",
        type=_fraction,
        default=1.0,
        metavar="F",
        help="tokens per decode step per sequence with speculation (default 1)",
    )
    p.add_argument(
        "--expert-imbalance",
        type=_fraction,
        default=EP_IMBALANCE,
        metavar="F",
        help=f"busiest EP rank's expert load over the mean (default {EP_IMBALANCE:.2f}, LMSYS's measured EPLB; "
        "1 for routing simulated balanced)",
    )
    p.add_argument("--phase", choices=("prefill", "decode", "both"), default="both", help="what to report")
    p.add_argument("--json", action="store_true", help="print JSON")


def run(args) -> int:
    try:
        p = predict(
            args.model,
            args.gpu,
            Layout(args.gpus, args.tp, args.ep, args.dp_attention, args.prefill_gpus, args.decode_gpus),
            Workload(
                args.input_len,
                args.output_len,
                args.concurrency,
                args.batch_per_gpu,
                args.cache_hit,
                args.accepted_tokens,
                expert_imbalance=args.expert_imbalance,
            ),
            weights=args.weights,
            attention=args.attention_dtype,
        )
    except ValueError as e:
        print(f"expertmesh predict: {e}", file=sys.stderr)
        return 2
    out = p.to_dict()
    if args.phase != "both":
        drop = "decode" if args.phase == "prefill" else "prefill"
        out = {
            k: v
            for k, v in out.items()
            if not k.startswith(drop) and k != ("tpot_ms" if drop == "decode" else "ttft_s")
        }
        out["bound"] = {args.phase: p.bound[args.phase]}
        out["step_seconds"] = {args.phase: p.step_seconds[args.phase]}
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    rows = [("model / GPU", f"{p.model} on {p.assumed['gpus']} x {p.gpu}")]
    if args.phase in ("prefill", "both"):
        rows += [
            ("prefill tok/s per GPU", f"{p.prefill_tokens_per_s_per_gpu:,.0f}"),
            ("prefill tok/s per node", f"{p.prefill_tokens_per_s_per_node:,.0f}"),
            ("TTFT", f"{p.ttft_s:,.3f} s"),
            ("prefill bound by", p.bound["prefill"]),
        ]
    if args.phase in ("decode", "both"):
        rows += [
            ("decode tok/s per GPU", f"{p.decode_tokens_per_s_per_gpu:,.0f}"),
            ("decode tok/s per node", f"{p.decode_tokens_per_s_per_node:,.0f}"),
            ("TPOT", f"{p.tpot_ms:,.2f} ms"),
            ("decode bound by", p.bound["decode"]),
            ("KV capacity", f"{p.kv_capacity_sequences:,} sequences"),
        ]
    rows += [(f"assumed {k}", str(v)) for k, v in p.assumed.items()]
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"{k:<{width}}  {v}" for k, v in rows))
    return 0
