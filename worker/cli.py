"""`expertmesh worker`'s command line: the flags, parsed and checked once into a `WorkerOptions` (worker/options.py),
then the worker process — serve until SIGTERM / SIGINT, or `--dry-run`'s one JSON line. Shutdown: health goes
NOT_SERVING, new calls are refused, in-flight ones get `--grace` seconds; the process ends `--grace` + 5 s after the
signal whatever is still running (expertmesh/runtime/shutdown.py).
"""

import argparse
import logging
import os
import sys
from pathlib import Path

from expertmesh.checkpoint.loader import Checkpoint
from expertmesh.model import memory
from expertmesh.model.config import ModelConfig, preset
from expertmesh.placement.plan import PlacementPlan
from expertmesh.runtime import telemetry
from expertmesh.runtime.argtypes import check_kv_tiers, positive_int
from expertmesh.runtime.shutdown import exit_after, stop_on_signals
from expertmesh.runtime.tls import ClientTLS, ServerTLS
from expertmesh.worker.attention import POOLS
from expertmesh.worker.collective import (
    BACKENDS,
)
from expertmesh.worker.kv_store import attach_cluster_store
from expertmesh.worker.kv_tiers import secure_folder
from expertmesh.worker.metrics import serve_metrics
from expertmesh.worker.options import ROLES, WorkerOptions
from expertmesh.worker.server import build_workers, dry_run, shutdown, start

log = logging.getLogger("expertmesh.worker")


MIN_DISK_KEY_BYTES, MAX_DISK_KEY_BYTES = 16, 4096  # --kv-disk-key-file: a secret, not a guessable word
SHUTDOWN_SLACK_S = 5.0  # after the grace: closing the health port, the pairs, the exit handlers


def parse_experts(spec: str) -> list[tuple[int, int]]:
    """ "L:E,L:E,..." (E may be a range A-B, inclusive) → [(layer, expert), ...]."""
    out = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        layer, sep, experts = item.partition(":")
        try:
            if not sep:
                raise ValueError
            lo, _, hi = experts.partition("-")
            lo_i, hi_i = int(lo), int(hi or lo)
            layer_i = int(layer)
            if layer_i < 0 or lo_i < 0 or hi_i < lo_i:
                raise ValueError
        except ValueError:
            raise ValueError(f"--experts: expected LAYER:EXPERT or LAYER:FIRST-LAST items, found {item!r}") from None
        out += [(layer_i, e) for e in range(lo_i, hi_i + 1)]
    if not out:
        raise ValueError(f"--experts: no LAYER:EXPERT item in {spec!r}")
    return out


def plan_assignment(path: str, ordinal: int, gpu_of: dict | None = None) -> list[tuple[int, int]]:
    """The (layer, expert) pairs of expert worker `ordinal` of the plan at `path`; fills `gpu_of` (when given)
    with each pair's GPU index in the plan."""
    plan = PlacementPlan.from_json(Path(path).read_text())
    pairs = [(int(l), int(e)) for l, e in plan.experts_of(ordinal)]
    if gpu_of is not None:
        gpu_of.update({(int(l), int(e)): g.gpu for g in plan.workers[ordinal].gpus for l, e in g.shards})
    if not pairs:  # a spare replica slot (e.g. scaled up before the plan): serve, holding nothing yet
        log.warning("--ordinal %d: the plan %s assigns no experts to this worker", ordinal, path)
    return pairs


def kv_tier_options(args) -> dict:
    """--kv-host-gib / --kv-disk-dir / --kv-disk-gib / --kv-disk-key-file → AttentionWorker's tier arguments
    (ValueError naming the flag: argtypes.check_kv_tiers, an unsafe tier folder — kv_tiers.secure_folder, made
    private here before anything else creates it —, a bad key file, or tiers on a worker without the attention
    role)."""
    if (args.kv_host_gib or args.kv_disk_gib) and args.role == "expert":
        raise ValueError("--kv-host-gib/--kv-disk-gib: only for --role attention or both")
    if args.kv_disk_key_file is not None and args.kv_disk_dir is None:
        raise ValueError("--kv-disk-key-file: only with --kv-disk-dir")
    if args.kv_disk_dir is not None and args.kv_disk_gib > 0:
        secure_folder(args.kv_disk_dir)
    check_kv_tiers(args.kv_host_gib, args.kv_disk_dir, args.kv_disk_gib)
    return {
        "kv_host_bytes": int(args.kv_host_gib * 2**30),
        "kv_disk_dir": args.kv_disk_dir,
        "kv_disk_bytes": int(args.kv_disk_gib * 2**30),
        "kv_disk_key": read_disk_key(args.kv_disk_key_file),
    }


def kv_store_options(args) -> dict:
    """--kv-store-* → attach_cluster_store's arguments (ValueError naming the flag)."""
    if args.role == "expert":
        raise ValueError("--kv-store-master: only for --role attention or both")
    host, sep, port = args.kv_store_master.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"--kv-store-master {args.kv_store_master!r}: expected HOST:PORT")
    if args.kv_store_key_file is None:
        raise ValueError("--kv-store-master: needs --kv-store-key-file (the deployment's store secret)")
    if args.kv_store_gib <= 0:
        raise ValueError(f"--kv-store-gib {args.kv_store_gib}: expected > 0")
    secret = read_disk_key(args.kv_store_key_file, flag="--kv-store-key-file")
    return {
        "master": args.kv_store_master,
        "metadata": args.kv_store_metadata or f"http://{host}:8080/metadata",
        "deployment": args.kv_store_deployment,
        "secret": secret,
        "capacity_bytes": int(args.kv_store_gib * 2**30),
    }


def read_disk_key(path: str | None, flag: str = "--kv-disk-key-file") -> bytes | None:
    """The bytes of --kv-disk-key-file (None without one: a random key per process, so files an earlier process
    wrote are refused). ValueError naming the flag when the file cannot be read or holds too few bytes."""
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            key = f.read(MAX_DISK_KEY_BYTES + 1)
    except OSError as e:
        raise ValueError(f"{flag} {path}: cannot read it ({e.strerror or e})") from None
    if not MIN_DISK_KEY_BYTES <= len(key) <= MAX_DISK_KEY_BYTES:
        raise ValueError(
            f"{flag} {path}: expected at least {MIN_DISK_KEY_BYTES} secret bytes (at most "
            f"{MAX_DISK_KEY_BYTES}), found {len(key)}"
        )
    return key


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="expertmesh worker", description="an attention / expert worker (gRPC)")
    p.add_argument("--role", choices=ROLES, required=True)
    p.add_argument("--checkpoint", help="checkpoint directory (required, except --dry-run with --preset)")
    p.add_argument("--preset", help="model preset, for --device meta --dry-run without a checkpoint")
    p.add_argument(
        "--device",
        default=None,
        help="cuda|cpu|meta (default: cuda when torch sees one, else cpu). cuda: bf16, expert pod's "
        "GPU g of the plan on cuda:g; cpu: the fp32 reference; meta: built as on a GPU, no memory "
        "(with --dry-run)",
    )
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default=None,
        help="weights and activations (default: bfloat16 on cuda/meta, float32 on cpu)",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        metavar="F",
        help="attention role: size the KV pool to fill this fraction of the device after weights and "
        "workspace (overrides --kv-blocks)",
    )
    p.add_argument(
        "--device-memory-gib",
        type=float,
        default=None,
        metavar="GIB",
        help="the device's memory for --gpu-memory-utilization (default: the CUDA device's; needed on meta)",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="with --device meta: build the worker, print one JSON line of resident bytes, exit",
    )
    p.add_argument(
        "--port", type=int, default=None, help="port to listen on (0: any free port; required unless --dry-run)"
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 / [::] in a pod)")
    p.add_argument("--experts", help="the (layer, expert) pairs held: L:E,L:E,... (E may be FIRST-LAST)")
    p.add_argument("--plan", help="placement plan JSON; this worker holds experts_of(--ordinal)")
    p.add_argument("--ordinal", type=int, help="this expert worker's ordinal in --plan")
    p.add_argument("--kv-blocks", type=int, default=512, help="KV blocks of the attention role")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument(
        "--kv-host-gib",
        type=float,
        default=0.0,
        metavar="GIB",
        help="attention role: host-memory tier for prefixes demoted off the device pool, at most this "
        "many GiB (pinned on cuda; 0: none — a demoted prefix is dropped)",
    )
    p.add_argument(
        "--kv-disk-dir",
        default=None,
        metavar="DIR",
        help="attention role: local-disk tier below the host tier, one authenticated file per prefix "
        "(reused after a restart when the files match this model and layout and --kv-disk-key-file); "
        "a folder of this user's that no one else may write (created 0700 when missing)",
    )
    p.add_argument(
        "--kv-disk-gib",
        type=float,
        default=0.0,
        metavar="GIB",
        help="attention role: at most this many GiB in --kv-disk-dir (needed with --kv-disk-dir)",
    )
    p.add_argument(
        "--kv-disk-key-file",
        default=None,
        metavar="PATH",
        help="attention role: a file of secret bytes (≥ 16) the disk tier's files are authenticated with "
        "(HMAC-SHA256), held by the deployment, not the folder; without it a random key per process — files "
        "an earlier process wrote are refused (cache lost, never wrong tokens)",
    )
    p.add_argument(
        "--kv-store-master",
        default=None,
        metavar="HOST:PORT",
        help="attention role: the cluster KV tier below disk — Mooncake's store, whose master listens here "
        "(worker/kv_store.py): demoted prefixes are put there too and any attention worker of the deployment "
        "restores them; needs --kv-store-key-file",
    )
    p.add_argument(
        "--kv-store-metadata",
        default=None,
        metavar="URL",
        help="the Mooncake metadata server (default: http://<the master's host>:8080/metadata, the master's own)",
    )
    p.add_argument(
        "--kv-store-key-file",
        default=None,
        metavar="PATH",
        help="a file of secret bytes (≥ 16) shared by the deployment's attention workers: store objects are "
        "authenticated with it (HMAC-SHA256); one that fails is refused, counted, never served",
    )
    p.add_argument(
        "--kv-store-gib",
        type=float,
        default=1.0,
        metavar="GIB",
        help="at most this many GiB of this worker's puts held in the store (its oldest removed first)",
    )
    p.add_argument(
        "--kv-store-deployment",
        default="expertmesh",
        metavar="NAME",
        help="the deployment's name, hashed into every store key: deployments sharing a store never meet",
    )
    p.add_argument(
        "--pool",
        choices=POOLS,
        default="mixed",
        help="attention role: the pool this worker serves in — prefill (runs prompts, hands each sequence "
        "to a decode worker), decode, or mixed (both: one pool); the router decides what runs where, "
        "this labels Info and /metrics",
    )
    p.add_argument(
        "--speculative-method",
        choices=("mtp", "ngram"),
        default=None,
        help="attention role: speculative decoding's drafter — mtp (the checkpoint's MTP layer, loaded here; a "
        "checkpoint without one is refused) or ngram (prompt lookup, no weights); with --speculative-tokens",
    )
    p.add_argument(
        "--speculative-tokens",
        type=int,
        default=0,
        metavar="K",
        help="attention role: drafts per decode step, verified with the newest token in one step (0: off); the "
        "router must be started with the same K",
    )
    p.add_argument("--name", help="worker name (default: <role>-<ordinal>, or <role>-0)")
    p.add_argument("--threads", type=int, default=16, help="gRPC handler threads")
    p.add_argument(
        "--decode-threads",
        type=positive_int,
        default=None,
        metavar="N",
        help="torch threads for decode-sized work (at most 16 token rows) that overlaps the other role's: "
        "an expert worker's calls, an attention worker's shared experts. For workers sharing cores "
        "(expertmesh up sets it there); default: all ($EXPERTMESH_TORCH_THREADS)",
    )
    p.add_argument(
        "--grace",
        type=float,
        default=10.0,
        help=f"seconds in-flight calls get on shutdown; the process ends {SHUTDOWN_SLACK_S:g} s after "
        "that, done or not",
    )
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics on this port")
    p.add_argument(
        "--health-port",
        type=int,
        default=None,
        help="also serve grpc.health.v1 alone, plaintext, on this port (Kubernetes probes under mTLS)",
    )
    p.add_argument("--tls-cert", help="serve TLS with this certificate (PEM)")
    p.add_argument("--tls-key", help="private key of --tls-cert (PEM)")
    p.add_argument("--tls-client-ca", help="require client certificates signed by this CA (mutual TLS)")
    p.add_argument(
        "--collective-port",
        type=int,
        default=int(os.environ["EXPERTMESH_COLLECTIVE_PORT"]) if os.environ.get("EXPERTMESH_COLLECTIVE_PORT") else None,
        help="also serve the collective transport (point-to-point pairs: TCP on cpu, NCCL on cuda) — the "
        "expert exchange's calls (expert role) and hand-offs sent to this worker (attention role) — its "
        "rendezvous store on this port (default: $EXPERTMESH_COLLECTIVE_PORT; none: gRPC only)",
    )
    p.add_argument(
        "--collective-backend",
        choices=BACKENDS,
        default="auto",
        help="the collective pairs' backend: tcp (one TCP connection per pair), gloo (torch.distributed), "
        "nccl (torch.distributed on GPUs); auto: nccl on cuda, tcp on cpu",
    )
    p.add_argument(
        "--lease-seconds",
        type=float,
        default=30.0,
        help="attention role: close the sequences of a router silent this long (it heartbeats every second); 0 = never",
    )
    p.add_argument("--expert-tls-ca", help="attention role: call expert workers over TLS, verifying them with this CA")
    p.add_argument("--expert-tls-cert", help="client certificate for mutual TLS with the expert workers")
    p.add_argument("--expert-tls-key", help="private key of --expert-tls-cert")
    p.add_argument("--expert-tls-server-name", help="name expected in the expert workers' certificates")
    return p


def parse_options(args) -> tuple[object, WorkerOptions]:
    """Parsed flags → (the model source: a checkpoint directory, or --preset's ModelConfig for a meta dry run; the
    WorkerOptions). ValueError / OSError name the flag."""
    device = memory.check_device(args.device)
    memory.compute_dtype(device, args.dtype)
    if args.dry_run and device != "meta":
        raise ValueError(f"--dry-run: needs --device meta (found --device {device})")
    if device == "meta" and not args.dry_run:
        raise ValueError("--device meta: only with --dry-run (a meta worker holds no weights to serve)")
    if args.checkpoint is None:
        if not (args.dry_run and args.preset):
            raise ValueError("--checkpoint: required (or --preset with --device meta --dry-run)")
        source = preset(args.preset)
    elif args.preset:
        raise ValueError("--preset: only without --checkpoint (the checkpoint has its config)")
    else:
        source = args.checkpoint
    if args.port is None and not args.dry_run:
        raise ValueError("--port: required")
    if args.gpu_memory_utilization is not None and not 0 < args.gpu_memory_utilization <= 1:
        raise ValueError(
            f"--gpu-memory-utilization: expected a fraction in (0, 1], found {args.gpu_memory_utilization}"
        )
    assignment, gpu_of = None, {}
    if args.experts and args.plan:
        raise ValueError("--experts and --plan: give one of them, not both")
    if args.plan:
        if args.ordinal is None:
            raise ValueError("--ordinal: required with --plan")
        assignment = plan_assignment(args.plan, args.ordinal, gpu_of)
    elif args.experts:
        assignment = parse_experts(args.experts)
    elif args.role == "expert":
        raise ValueError("--experts or --plan/--ordinal: required for --role expert")
    tls = None
    if args.tls_cert or args.tls_key:
        if not (args.tls_cert and args.tls_key):
            raise ValueError("--tls-cert and --tls-key: give both")
        tls = ServerTLS(args.tls_cert, args.tls_key, args.tls_client_ca)
    elif args.tls_client_ca:
        raise ValueError("--tls-client-ca: needs --tls-cert and --tls-key")
    expert_tls = None
    if args.expert_tls_ca:
        expert_tls = ClientTLS(
            args.expert_tls_ca, args.expert_tls_cert, args.expert_tls_key, args.expert_tls_server_name
        )
    elif args.expert_tls_cert or args.expert_tls_key:
        raise ValueError("--expert-tls-cert/--expert-tls-key: need --expert-tls-ca")
    if args.kv_blocks <= 0 or args.block_size <= 0:
        raise ValueError(f"--kv-blocks {args.kv_blocks} / --block-size {args.block_size}: expected positive")
    kv_tiers = kv_tier_options(args)
    if args.kv_store_master is not None:
        kv_store_options(args)  # checked before anything starts
    if args.speculative_tokens < 0:
        raise ValueError(f"--speculative-tokens {args.speculative_tokens}: expected an integer >= 0")
    if args.speculative_tokens and args.speculative_method is None:
        raise ValueError(f"--speculative-tokens {args.speculative_tokens}: needs --speculative-method mtp|ngram")
    if args.speculative_tokens and args.role == "expert":
        raise ValueError("--speculative-tokens: only for --role attention or both (attention workers draft)")
    if args.pool != "mixed" and args.role == "expert":
        raise ValueError(f"--pool {args.pool}: only for --role attention or both (expert workers serve every pool)")
    name = args.name
    if name is None and args.role != "both" and args.ordinal is not None:
        name = f"{args.role}-{args.ordinal}"
    return source, WorkerOptions(
        role=args.role,
        host=args.host,
        port=args.port if args.port is not None else 0,
        name=name,
        device=device,
        dtype=args.dtype,
        max_workers=args.threads,
        tls=tls,
        health_port=args.health_port,
        collective_port=args.collective_port,
        collective_backend=args.collective_backend,
        decode_threads=args.decode_threads,
        assignment=assignment,
        gpu_of=gpu_of or None,
        kv_blocks=None if args.gpu_memory_utilization is not None else args.kv_blocks,
        block_size=args.block_size,
        gpu_memory_utilization=args.gpu_memory_utilization,
        device_memory_bytes=None if args.device_memory_gib is None else int(args.device_memory_gib * 2**30),
        lease_seconds=args.lease_seconds,
        pool=args.pool,
        speculative_method=args.speculative_method if args.speculative_tokens else None,
        speculative_tokens=args.speculative_tokens,
        expert_tls=expert_tls,
        **kv_tiers,
    )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if os.environ.get("EXPERTMESH_TORCH_THREADS"):
        import torch

        torch.set_num_threads(int(os.environ["EXPERTMESH_TORCH_THREADS"]))
    try:
        source, options = parse_options(args)
    except (ValueError, OSError) as e:
        parser.error(str(e))
    if args.dry_run:
        try:
            source = source if isinstance(source, ModelConfig) else Checkpoint(source).cfg
            attention, expert = build_workers(source, options)
        except ValueError as e:
            print(f"expertmesh worker: error: {e}", file=sys.stderr)
            return 2
        print(dry_run(attention, expert, options), flush=True)
        return 0

    stop = stop_on_signals()
    try:
        server = start(source, options)
    except (OSError, ValueError) as e:  # port taken, bad checkpoint, experts it lacks: one clear line
        print(f"expertmesh worker: error: {e}", file=sys.stderr)
        return 2
    name = options.name
    telemetry.setup_tracing(
        "expertmesh-worker", {"expertmesh.role": args.role, "expertmesh.worker": name, "expertmesh.shard": args.ordinal}
    )
    if args.metrics_port is not None:
        serve_metrics(server, args.host, args.metrics_port)
    if args.kv_store_master is not None and server.attention is not None:
        store = kv_store_options(args)
        attach_cluster_store(
            server.attention, local_hostname=args.host if args.host != "0.0.0.0" else "127.0.0.1", **store
        )
    print(f"READY {args.role} {args.host}:{server.port}", flush=True)
    while not stop.wait(0.5):
        pass
    log.info("shutting down: NOT_SERVING, finishing in-flight calls (grace %.1fs)", args.grace)
    exit_after(args.grace + SHUTDOWN_SLACK_S, f"expertmesh worker {name or args.role}")
    shutdown(server, args.grace)
    log.info("stopped")
    exchange = getattr(server.attention, "exchange", None)
    if server.collective is not None or any(hasattr(c, "run_grpc") for c in getattr(exchange, "clients", ())):
        # torch.distributed pairs may hold threads in C++ waits (a hung peer): run the exit handlers (telemetry
        # flush), then leave without joining those threads
        import atexit

        atexit._run_exitfuncs()
        logging.shutdown()
        sys.stdout.flush()
        os._exit(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
