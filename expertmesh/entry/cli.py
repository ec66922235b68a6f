"""The `expertmesh` command line: one entry point, subcommands import what they need lazily."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from expertmesh.runtime.argtypes import nonnegative_int, positive_int


def _table(rows: list[tuple[str, str]], headers: tuple[str, str] = ("figure", "value")) -> str:
    width = max(len(headers[0]), *(len(r[0]) for r in rows))
    lines = [f"{headers[0]:<{width}}  {headers[1]}", f"{'-' * width}  {'-' * max(len(headers[1]), 5)}"]
    lines += [f"{k:<{width}}  {v}" for k, v in rows]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------- model
def cmd_model_describe(args) -> int:
    from expertmesh.model.config import preset

    cfg = preset(args.preset)
    if args.json:
        print(
            json.dumps(
                {
                    "config": cfg.model_dump(),
                    "total_params": cfg.total_params,
                    "active_params": cfg.active_params,
                    "routed_expert_bytes": cfg.routed_expert_bytes,
                    "dense_bytes_bf16": cfg.dense_bytes_bf16,
                    "kv_bytes_per_token": {t: cfg.kv_bytes_per_token(t) for t in ("kda", "dsa")},
                    "recurrent_state_bytes_per_sequence": cfg.recurrent_state_bytes_per_sequence,
                },
                indent=1,
            )
        )
    else:
        print(_table(cfg.describe()))
    return 0


# ----------------------------------------------------------------------------------------------- checkpoints
def cmd_checkpoint_create(args) -> int:
    from expertmesh.checkpoint.loader import create_checkpoint
    from expertmesh.model.config import preset

    cfg = preset(args.preset)
    out = create_checkpoint(cfg, args.out, seed=args.seed, layers_per_shard=args.layers_per_shard, progress=True)
    print(f"wrote {cfg.name} checkpoint (seed {args.seed}) to {out}")
    return 0


def cmd_checkpoint_convert(args) -> int:
    from expertmesh.checkpoint.convert import convert_checkpoint

    r = convert_checkpoint(args.src, args.out, progress=True)
    print(
        f"wrote {r.out}: {r.shards} shards ({r.skipped} already done), read {r.bytes_read / 1e9:.3f} GB, "
        f"wrote {r.bytes_written / 1e9:.3f} GB in {r.seconds:.1f} s ({r.gb_per_s:.3f} GB/s read)"
    )
    return 0


def cmd_checkpoint_inspect(args) -> int:
    from expertmesh.checkpoint.loader import inspect_checkpoint

    info = inspect_checkpoint(args.dir)
    if args.json:
        print(json.dumps(info, indent=1))
        return 0
    mib = 2**20
    print(
        _table(
            [
                ("checkpoint", info["path"]),
                ("model", info["model"]),
                ("layout", info["layout"]),
                ("files", str(info["files"])),
                ("tensors", str(info["tensors"])),
                ("tensor bytes", f"{info['tensor_bytes']:,} ({info['tensor_bytes'] / mib:.2f} MiB)"),
                ("expert weights", f"{info['expert_weights']:,} in {info['expert_bytes']:,} bytes"),
                ("bits per expert weight", f"{info['bits_per_expert_weight']:.4f}"),
                ("other bytes", f"{info['other_bytes']:,}"),
                *(
                    [("MTP layers (not served)", f"{info['mtp_layers']}: {info['mtp_bytes']:,} bytes")]
                    if info["mtp_layers"]
                    else []
                ),
                ("file overhead bytes", f"{info['file_overhead_bytes']:,} (headers, beyond tensor data)"),
            ]
        )
    )
    print()
    print(f"{'layer':>5}  {'type':4}  {'ffn':5}  {'tensors':>7}  {'bytes':>12}  {'expert bytes':>12}  file")
    for row in info["layers"]:
        print(
            f"{row['layer']:>5}  {row['type']:4}  {row['ffn']:5}  {row['tensors']:>7}  {row['bytes']:>12,}  "
            f"{row['expert_bytes']:>12,}  {row['file']}"
        )
    return 0


# ----------------------------------------------------------------------------------------------- generate
def cmd_generate(args) -> int:
    from expertmesh.chat.tokenizer import load_tokenizer
    from expertmesh.checkpoint.embedded import default_checkpoint_dir
    from expertmesh.checkpoint.loader import Checkpoint
    from expertmesh.model.transformer import generate
    from expertmesh.wire.sampling_params import SamplingParams

    path = Path(args.checkpoint) if args.checkpoint else default_checkpoint_dir(args.preset)
    model = Checkpoint(path).load_model(dense_attention=args.dense)
    tok = load_tokenizer(path)
    prompt = tok.encode_prompt(args.prompt)
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop_token_ids=tuple(tok.eos_ids),
    )
    out = generate(model, prompt, params)
    if args.ids:
        print(" ".join(map(str, out.tokens)))
    else:
        print(tok.decode(out.tokens))
    print(f"[{len(out.tokens)} tokens, finish_reason={out.finish_reason}]", file=sys.stderr)
    return 0


# ----------------------------------------------------------------------------------------------- parser
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="expertmesh", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    model = sub.add_parser("model", help="model presets").add_subparsers(dest="model_command", required=True)
    d = model.add_parser("describe", help="print a preset's derived figures")
    d.add_argument("preset", help="tiny, small or full-2.8t")
    d.add_argument("--json", action="store_true")
    d.set_defaults(func=cmd_model_describe)

    ck = sub.add_parser("checkpoint", help="create / inspect checkpoints").add_subparsers(
        dest="checkpoint_command", required=True
    )
    c = ck.add_parser("create", help="write a synthetic (seeded random, MXFP4) checkpoint")
    c.add_argument("--preset", default="tiny")
    c.add_argument("--out", required=True)
    c.add_argument("--seed", type=nonnegative_int, default=0)
    c.add_argument("--layers-per-shard", type=positive_int, default=1)
    c.set_defaults(func=cmd_checkpoint_create)
    i = ck.add_parser("inspect", help="validate a checkpoint and print its figures")
    i.add_argument("dir")
    i.add_argument("--json", action="store_true")
    i.set_defaults(func=cmd_checkpoint_inspect)
    cv = ck.add_parser(
        "convert", help="quantize a Hugging Face directory's routed experts to MXFP4 (streaming, resumable)"
    )
    cv.add_argument("src", help="a kimi_linear / deepseek_v32 directory with bf16 / fp32 / FP8 experts")
    cv.add_argument("--out", required=True, help="output directory (a rerun resumes where it stopped)")
    cv.set_defaults(func=cmd_checkpoint_convert)

    g = sub.add_parser("generate", help="generate with the single-process reference model")
    g.add_argument("prompt")
    g.add_argument(
        "--preset",
        default=None,
        help="a preset's synthetic checkpoint instead of the embedded default (models/k3-tiny)",
    )
    g.add_argument("--checkpoint")
    g.add_argument("--max-tokens", type=positive_int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=nonnegative_int, default=0)
    g.add_argument("--dense", action="store_true", help="turn DSA sparsity off (attend to every past token)")
    g.add_argument("--ids", action="store_true", help="print token ids instead of text")
    g.set_defaults(func=cmd_generate)

    u = sub.add_parser("up", help="run router + workers locally as processes (the embedded default)")
    from expertmesh.entry import up as up_mod

    up_mod.add_arguments(u)
    u.set_defaults(func=up_mod.run_up)

    ch = sub.add_parser("chat", help="chat with a running router (streams; interactive without a prompt)")
    from expertmesh.entry import chat_cli

    chat_cli.add_arguments(ch)
    ch.set_defaults(func=chat_cli.run)

    r = sub.add_parser("router", help="the router process (pod entrypoint)")
    from expertmesh.router import server as router_server

    router_server.add_arguments(r)
    r.set_defaults(func=router_server.run)

    w = sub.add_parser(
        "worker", help="an attention / expert worker process (pod entrypoint); `expertmesh worker --help` for its flags"
    )
    w.set_defaults(func=lambda a: __import__("expertmesh.worker.cli", fromlist=["main"]).main(["--help"]))

    fe = sub.add_parser(
        "fetch",
        help="fetch a checkpoint (http(s)://, hf://) into a cache directory, every file "
        "verified by sha256 (the pods' init container)",
    )
    from expertmesh.checkpoint import fetch as fetch_mod

    fetch_mod.add_arguments(fe)
    fe.set_defaults(func=fetch_mod.run)

    o = sub.add_parser("operator", help="the Kopf operator for MoEDeployment resources")
    from expertmesh.operator import main as operator_main

    operator_main.add_arguments(o)
    o.set_defaults(func=operator_main.run)

    pr = sub.add_parser("predict", help="forecast a deployment's tokens/s, TTFT and TPOT before renting it")
    from expertmesh.entry import predict_cli

    predict_cli.add_arguments(pr)
    pr.set_defaults(func=predict_cli.run)

    try:
        from expertmesh.operator import plan_cli
    except ImportError:
        plan_cli = None
    if plan_cli is not None:
        pl = sub.add_parser("plan", help="offline expert placement for a preset and a cluster shape")
        plan_cli.add_arguments(pl)
        pl.set_defaults(func=plan_cli.run)
    return p


def _set_threads() -> None:
    """$EXPERTMESH_TORCH_THREADS for the commands that compute in this process (generate, checkpoint); the worker
    reads it itself, and the router, operator, chat and fetch never load torch."""
    import os

    n = os.environ.get("EXPERTMESH_TORCH_THREADS")
    if n:
        import torch

        torch.set_num_threads(int(n))


def main(argv: list[str] | None = None) -> int:
    from expertmesh.runtime.shutdown import die_with_parent

    die_with_parent()  # a child of `up`: gone with it
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["fetch"]:  # the pods' init container: no torch, starts in a fraction of a second
        from expertmesh.checkpoint.fetch import main as fetch_main

        return int(fetch_main(argv[1:]) or 0)
    if argv[:1] in (["generate"], ["checkpoint"]):
        _set_threads()
    if argv[:1] == ["worker"]:
        from expertmesh.worker.cli import main as worker_main  # the worker parses its own flags

        return int(worker_main(argv[1:]) or 0)
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, OSError) as e:  # bad input, unreadable / existing files, unreachable servers
        print(f"expertmesh: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:
        import httpx

        if isinstance(e, httpx.HTTPError):
            print(f"expertmesh: error: {e}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
