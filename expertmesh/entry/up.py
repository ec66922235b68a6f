"""`expertmesh up`: the whole system on this machine — N attention workers, M expert workers and the router
as separate processes on loopback (expertmesh/entry/cluster.py's `LocalCluster`), from up's own options and the
router options given after `--`. The same system in one process is `expertmesh.entry.local.build_local_engine`.

Each child prints `READY ...` once serving; `up` waits for all of them, prints where the router listens and
serves until Ctrl-C / SIGTERM (restarting a process that exits: `supervise`), then stops the router first (no new
requests), then the workers.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from expertmesh.checkpoint.embedded import default_checkpoint_dir
from expertmesh.entry.cluster import LocalCluster, default_expert_workers, supervise
from expertmesh.entry.kv_store_service import KV_STORES
from expertmesh.router.server import DEFAULT_PREFILL_CHUNK, DEFAULT_PREFILL_TOKENS
from expertmesh.router.server import add_arguments as router_arguments
from expertmesh.runtime.argtypes import check_kv_tiers, nonnegative_int, positive_int
from expertmesh.runtime.shutdown import stop_on_signals
from expertmesh.runtime.tls import ephemeral_pki

# router options `up` sets itself (addresses, plan, TLS, the deployment's shape): not for `up -- ...`
UP_OWNED_ROUTER_OPTIONS = (
    "--checkpoint",
    "--plan",
    "--attention",
    "--prefill",
    "--experts",
    "--host",
    "--http-port",
    "--grpc-port",
    "--epp-port",
    "--prefill-chunk",
    "--prefill-tokens",
    "--transport",
    "--speculative-method",
    "--speculative-tokens",
    "--worker-tls-ca",
    "--worker-tls-cert",
    "--worker-tls-key",
    "--worker-tls-server-name",
    "--tls-cert",
    "--tls-key",
    "--tls-client-ca",
    "--kv-store",
)


def router_options(options: list[str]) -> list[str]:
    """The router options given after `up ... --`, checked by the router's own parser before anything starts:
    an unknown option or a bad value exits with the router's error naming it, as does one `up` sets itself."""
    options = options[1:] if options[:1] == ["--"] else list(options)
    parser = argparse.ArgumentParser(prog="expertmesh up -- (router options)")
    router_arguments(parser)
    for option in options:
        if option.split("=", 1)[0] in UP_OWNED_ROUTER_OPTIONS:
            parser.error(f"{option.split('=', 1)[0]} is set by `expertmesh up` itself (use up's own options)")
    parser.parse_args(["--checkpoint", "-", "--plan", "-", "--attention", "-", "--experts", "-", *options])
    return options


def router_engine_config(args, options: list[str]):
    """The EngineConfig the router process will parse from the command line `up` gives it (its own options, the
    router options after `--`), built here before anything starts: a combination the engine refuses (e.g.
    --prefill-tokens not a multiple of --prefill-chunk, an unreadable --prefix-salt-file) fails `up` at once."""
    from expertmesh.router.engine_config import EngineConfig  # numpy: not for every `expertmesh` command
    from expertmesh.router.server import read_prefix_salt

    parser = argparse.ArgumentParser(prog="expertmesh up")
    router_arguments(parser)
    experts = ",".join(f"expert-{i}" for i in range(args.expert_workers))  # their addresses: not known yet
    own = ["--prefill-chunk", str(args.prefill_chunk), "--prefill-tokens", str(args.prefill_tokens)]
    own += ["--transport", args.transport, "--experts", experts]
    own += ["--kv-store", args.kv_store] if args.kv_store else []
    if args.speculative_tokens:
        if args.speculative_method is None:
            raise ValueError(f"--speculative-tokens {args.speculative_tokens}: needs --speculative-method mtp|ngram")
        own += ["--speculative-tokens", str(args.speculative_tokens), "--speculative-method", args.speculative_method]
    parsed = parser.parse_args(["--checkpoint", "-", "--plan", "-", "--attention", "-", *own, *options])
    return EngineConfig.from_args(parsed, prefix_salt=read_prefix_salt(parsed.prefix_salt_file))


def run_up(args) -> int:
    passed_to_router = router_options(args.router_options)
    if args.epp_port:
        passed_to_router = [*passed_to_router, "--epp-port", str(args.epp_port)]
    if args.expert_workers is None:
        args.expert_workers = default_expert_workers(replicas=args.expert_replicas)
    try:
        check_kv_tiers(args.kv_host_gib, args.kv_disk_dir, args.kv_disk_gib)
        if args.kv_store_gib <= 0:
            raise ValueError(f"--kv-store-gib {args.kv_store_gib}: expected > 0")
        engine = router_engine_config(args, passed_to_router)
    except ValueError as e:
        print(f"expertmesh up: error: {e}", file=sys.stderr)
        return 2
    if args.checkpoint is None:
        args.checkpoint = str(default_checkpoint_dir(args.preset))
    checkpoint = args.checkpoint
    worker_tls = None
    if args.tls_dir is None and not args.insecure_workers:
        # workers answer only callers holding this run's client key (mutual TLS), never any local process
        worker_tls = ephemeral_pki(Path(tempfile.mkdtemp(prefix="expertmesh-pki-")), (args.host, "localhost"))
    cluster = LocalCluster(
        checkpoint,
        attention_workers=args.attention_workers,
        expert_workers=args.expert_workers,
        redundant_experts=args.redundant_experts,
        expert_replicas=args.expert_replicas,
        http_port=args.http_port,
        grpc_port=args.grpc_port,
        host=args.host,
        threads=args.threads,
        prefill_chunk=engine.prefill_chunk,  # rendered back into the router's flags
        prefill_tokens=engine.prefill_tokens,
        echo=args.verbose,
        tls_dir=args.tls_dir,
        device=args.device,
        dtype=args.dtype,
        worker_tls_dir=worker_tls,
        transport=engine.transport,
        router_args=passed_to_router,
        kv_blocks=args.kv_blocks,
        kv_host_gib=args.kv_host_gib,
        kv_disk_dir=args.kv_disk_dir,
        kv_disk_gib=args.kv_disk_gib,
        prefill_workers=args.prefill_workers,
        speculative_method=args.speculative_method,
        speculative_tokens=args.speculative_tokens,
        kv_store=args.kv_store,
        kv_store_gib=args.kv_store_gib,
    )
    stop = stop_on_signals()
    pools = (
        f"{args.prefill_workers} prefill + {args.attention_workers} decode"
        if args.prefill_workers
        else str(args.attention_workers)
    )
    print(f"starting {pools} attention + {args.expert_workers} expert workers from {checkpoint} ...", flush=True)
    cluster.start()
    print(
        f"expertmesh up: HTTP {cluster.http_url}  (OpenAI-compatible: {cluster.http_url}/v1)\n"
        f"               gRPC {args.host}:{args.grpc_port}\n"
        + (f"               endpoint picker (Envoy ext_proc) {args.host}:{args.epp_port}\n" if args.epp_port else "")
        + f"               plan {cluster.plan_path}\n"
        f"Ctrl-C to stop.",
        flush=True,
    )
    try:
        rc = supervise(cluster, stop)
    finally:
        cluster.stop()
    if rc:
        return rc
    print("expertmesh up: stopped", flush=True)
    return 0


def _device(value: str) -> str:
    # torch (is CUDA visible?) only when --device is given: the CLI builds up's parser for the router's command too
    from expertmesh.model.memory import DeviceError, check_device

    try:
        kind = check_device(value)
    except DeviceError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if kind == "meta":
        raise argparse.ArgumentTypeError("--device meta: only for `expertmesh worker --dry-run`")
    return kind


def add_arguments(p) -> None:
    p.add_argument(
        "--checkpoint", help="checkpoint directory (default: the embedded k3-tiny model shipped in models/k3-tiny)"
    )
    p.add_argument(
        "--preset", default=None, help="serve this preset's synthetic checkpoint (created on first run) instead"
    )
    p.add_argument("--attention-workers", type=positive_int, default=1)
    p.add_argument(
        "--prefill-workers",
        type=nonnegative_int,
        default=0,
        help="a prefill pool of this many attention workers: they run the prompts and hand each sequence "
        "(KV + recurrent state) to one of the --attention-workers, which then form the decode pool "
        "(0: one colocated pool). Router options for it: `-- --prefill-min-tokens N`",
    )
    p.add_argument(
        "--speculative-method",
        choices=("mtp", "ngram"),
        default=None,
        help="speculative decoding's drafter on the attention workers: mtp (the checkpoint's MTP layer; refused "
        "when it has none) or ngram (prompt lookup); with --speculative-tokens",
    )
    p.add_argument(
        "--speculative-tokens",
        type=nonnegative_int,
        default=0,
        metavar="K",
        help="drafts per decode step (up to K + 1 tokens a step per sequence), given to the router and every "
        "attention worker (0: off)",
    )
    p.add_argument(
        "--expert-workers",
        type=positive_int,
        default=None,
        help="default: one per two cores this process may run on, at least 1 and at least "
        "--expert-replicas (default_expert_workers)",
    )
    p.add_argument(
        "--redundant-experts", type=nonnegative_int, default=0, help="extra replicas of hot experts per layer"
    )
    p.add_argument(
        "--expert-replicas",
        type=positive_int,
        default=1,
        help="every expert on at least this many expert workers (2: losing one fails no request)",
    )
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=50051)
    p.add_argument(
        "--epp-port",
        type=nonnegative_int,
        default=0,
        metavar="PORT",
        help="the router also serves the Gateway API Inference Extension's Endpoint Picker (Envoy ext_proc) on this "
        "port (0: off)",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        help="torch threads per process (default: the attention workers share this machine's cores, "
        "and so do the expert workers — they compute in turn; the router 1)",
    )
    p.add_argument(
        "--prefill-chunk",
        type=positive_int,
        default=DEFAULT_PREFILL_CHUNK,
        help=f"the prefix cache's granularity: prompt chunks end at its multiples (default "
        f"{DEFAULT_PREFILL_CHUNK}; a multiple of --block-size)",
    )
    p.add_argument(
        "--prefill-tokens",
        type=positive_int,
        default=DEFAULT_PREFILL_TOKENS,
        help=f"prompt tokens a sequence may prefill in one step, a multiple of --prefill-chunk (default "
        f"{DEFAULT_PREFILL_TOKENS})",
    )
    p.add_argument(
        "--kv-blocks",
        type=positive_int,
        default=512,
        help="each attention worker's device KV pool, in blocks of 16 tokens (default 512)",
    )
    p.add_argument(
        "--kv-host-gib",
        type=float,
        default=0.0,
        metavar="GIB",
        help="each attention worker's host-memory tier for prefixes demoted off the device (0: none)",
    )
    p.add_argument(
        "--kv-disk-dir",
        default=None,
        metavar="DIR",
        help="local-disk tier below the host tier: each attention worker keeps its files in DIR/<its name> "
        "(reused by a later run of the same model)",
    )
    p.add_argument(
        "--kv-disk-gib", type=float, default=0.0, metavar="GIB", help="each attention worker's bound in --kv-disk-dir"
    )
    p.add_argument(
        "--kv-store",
        choices=KV_STORES,
        default=None,
        help="a cluster KV tier below host and disk that every attention worker shares: mooncake — Mooncake's "
        "master and store process run as supervised children, demoted prefixes are put there and any attention "
        "worker restores them (needs the mooncake-transfer-engine-non-cuda wheel and libibverbs1)",
    )
    p.add_argument(
        "--kv-store-gib", type=float, default=1.0, metavar="GIB", help="the cluster KV store's memory (--kv-store)"
    )
    p.add_argument("--verbose", action="store_true", help="echo every process's output")
    p.add_argument(
        "--device",
        type=_device,
        default=None,
        help="workers' device: cuda|cpu (default: cuda when torch sees one, else cpu)",
    )
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default=None,
        help="workers' dtype (default: bfloat16 on cuda, float32 on cpu)",
    )
    p.add_argument(
        "--transport",
        choices=("grpc", "collective"),
        default="collective",
        help="per-layer expert exchange: collective (default: point-to-point pairs, a TCP connection per "
        "pair on cpu, NCCL on cuda; gRPC stays for control, health and fallback; on loopback here, "
        "not encrypted) or grpc (every call over the workers' mutual-TLS gRPC)",
    )
    p.add_argument(
        "--insecure-workers",
        action="store_true",
        help="workers accept plain gRPC from any local process (default: mutual TLS with certificates "
        "generated for this run)",
    )
    p.add_argument(
        "--tls-dir",
        help="mutual TLS between router and workers, HTTPS/TLS on the router: a folder "
        "with ca.crt, server.crt, server.key, client.crt, client.key",
    )
    p.add_argument(
        "router_options",
        nargs=argparse.REMAINDER,
        metavar="-- ROUTER_OPTION",
        help="options after `--` go to the router (`expertmesh router --help`), e.g. "
        "`-- --max-context 4096 --image-fetch-allow example.org --thinking-budgets 64,256,1024`",
    )
