"""`expertmesh router`: the router process — engine over remote workers, HTTP front and gRPC service."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading

from expertmesh.chat.load import load_chat
from expertmesh.chat.thinking import ThinkingBudgets
from expertmesh.checkpoint.config import checkpoint_config
from expertmesh.router.prefix_scope import SCOPES
from expertmesh.router.replica_set import parse_replicas
from expertmesh.router.response_store import ResponseStore, default_replica
from expertmesh.runtime import telemetry
from expertmesh.runtime.argtypes import nonnegative_float, nonnegative_int, positive_float, positive_int
from expertmesh.runtime.shutdown import exit_after, stop_on_signals

log = logging.getLogger("expertmesh.router")

# The prefix cache's granularity (prompt chunks end at its multiples): multi-turn chats find their history cached
# to within 64 tokens. Prompt tokens per prefill step: on CPU a step has a large fixed cost (every weight read once,
# the routed experts decoded once), so a 1,000-token prompt reaches its first token in 1.35-1.50 s in one step of
# 1,024 against 1.42-1.56 s in steps of 512 and 1.77 s in steps of 256 (bench/peer.py's model, bf16, expertmesh up,
# AMX experts; steps of 64 took 5.1 s before them). vLLM batches 2,048 or more prompt tokens a step.
DEFAULT_PREFILL_CHUNK = 64
DEFAULT_PREFILL_TOKENS = 1024


def load_plan(path: str):
    from expertmesh.placement.plan import PlacementPlan  # numpy: not for every `expertmesh` command (see run)

    with open(path) as f:
        return PlacementPlan.from_json(f.read())


def watch_plan(engine, path: str, stop: threading.Event, interval: float = 1.0, drain_delay: float = 0.0) -> None:
    """Follow the plan file (the mounted plan ConfigMap: the kubelet swaps in each plan the operator publishes)
    and re-plan the engine live onto each new one (Engine.replan: warm, switch between steps, drain). The first
    pass re-applies the plan the router started with: expert workers that kept running across a plan change
    while no router was there to move their shards get them now."""
    last, first = None, True
    while first or not stop.wait(interval):
        first = False
        try:
            plan = load_plan(path)
        except (OSError, ValueError) as e:  # mid-swap or unreadable: the current table keeps serving
            log.warning("--plan %s: not re-read (%s)", path, e)
            continue
        if plan.plan_hash() == last:
            continue
        last = plan.plan_hash()
        try:
            engine.replan(plan, drain_delay=drain_delay)
        except Exception:
            log.exception("re-planning onto plan %s failed; the previous table keeps serving", last)


def build_remote_engine(
    cfg,
    attention: list[str],
    experts: list[str],
    plan,
    config=None,
    *,
    timeout: float = 30.0,
    tls=None,
    control_timeout: float | None = None,
    prefill: list[str] | None = None,
):
    """The engine over remote workers, not started (Engine.start waits for them). `config`: its EngineConfig (None:
    the defaults with the step deadline of `timeout`); `timeout`: each expert call's deadline (a step's,
    config.call_timeout, adds one per expert worker: engine_config.step_deadline; a long step's grows with its work,
    up to config.step_timeout_cap: router/work_deadline.py); `control_timeout` (default and
    at most `timeout`): the attention workers' calls outside a step — a hung worker costs one of these, then it is
    down until it answers its health check; `prefill`: the prefill pool's attention workers (router/disagg.py)."""
    from expertmesh.router.engine import Engine  # the engine and the workers' clients: see run
    from expertmesh.router.engine_config import EngineConfig, step_deadline
    from expertmesh.router.step_transport import StepTransportCollector
    from expertmesh.wire.clients import RemoteAttention, RemoteExpert

    config = config or EngineConfig(call_timeout=step_deadline(timeout, len(experts)))
    control = min(control_timeout or timeout, timeout)
    att, pre = (
        [
            RemoteAttention(
                a, timeout=control, tls=tls, step_timeout=config.step_timeout_cap, handoff_timeout=config.call_timeout
            )
            for a in addresses
        ]
        for addresses in (attention, prefill or ())
    )
    if config.step_transport == "tcp":
        from expertmesh.wire.step_channel import StepChannelAttention

        att, pre = [StepChannelAttention(a) for a in att], [StepChannelAttention(a) for a in pre]
    exp = [RemoteExpert(e, timeout=timeout, tls=tls) for e in experts]
    engine = Engine(cfg, att, exp, plan, config, prefill=pre or None)
    engine.metrics.registry.register(StepTransportCollector(att + pre))
    return engine


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--checkpoint",
        required=True,
        help="checkpoint directory (the router reads its config, tokenizer.json and chat template)",
    )
    p.add_argument("--plan", required=True, help="placement plan JSON (followed: a new plan is adopted live)")
    p.add_argument(
        "--plan-poll-seconds",
        type=float,
        default=1.0,
        metavar="SECONDS",
        help="how often to re-read --plan for a new plan (0: read once at start)",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=positive_float,
        default=30.0,
        metavar="SECONDS",
        help="after SIGTERM the router drains, and ends this many seconds later, done or not (default 30: "
        "below the pods' terminationGracePeriodSeconds, 60, so it ends itself before the kubelet "
        "kills it)",
    )
    p.add_argument(
        "--replan-drain-seconds",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="after switching to a new plan, wait this long before expert workers drop the shards it "
        "gave up, so other router replicas following the same plan switch first (default 5)",
    )
    p.add_argument(
        "--attention",
        required=True,
        help="comma-separated host:port of attention workers (with --prefill: the decode pool)",
    )
    p.add_argument(
        "--prefill",
        default="",
        metavar="HOST:PORT,...",
        help="the prefill pool: attention workers that run prompts and hand each sequence to a decode "
        "worker (--attention) once its first token is sampled; none: one colocated pool",
    )
    p.add_argument(
        "--prefill-min-tokens",
        type=nonnegative_int,
        default=0,
        metavar="TOKENS",
        help="prompts shorter than this are prefilled on the decode pool (skipping the hand-off)",
    )
    p.add_argument("--experts", required=True, help="comma-separated host:port of expert workers, by ordinal")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=50051)
    p.add_argument(
        "--health-port",
        type=int,
        default=None,
        help="also serve grpc.health.v1 alone, plaintext, on this port (Kubernetes gRPC probes under TLS)",
    )
    p.add_argument(
        "--prefill-chunk",
        type=positive_int,
        default=DEFAULT_PREFILL_CHUNK,
        help=f"the prefix cache's granularity: prompt chunks end at its multiples (so a cached prefix and "
        f"a fresh run compute the same chunks) and prefixes are saved there (default "
        f"{DEFAULT_PREFILL_CHUNK})",
    )
    p.add_argument(
        "--prefill-tokens",
        type=positive_int,
        default=DEFAULT_PREFILL_TOKENS,
        help=f"prompt chunks end at its multiples (and at the prompt's last multiple of --prefill-chunk): "
        f"the prompt tokens a sequence prefills per step, a multiple of --prefill-chunk (default "
        f"{DEFAULT_PREFILL_TOKENS})",
    )
    p.add_argument(
        "--prefill-work",
        type=nonnegative_int,
        default=None,
        metavar="ROW_TOKENS",
        help="the attention work one prompt chunk may do, in rows x the context they see: deep in a long prompt "
        "a chunk gets fewer rows (a multiple of --prefill-chunk, at least one), so a step's time stays bounded "
        "(default: 2 x --prefill-tokens squared, which leaves a prompt's first two chunks whole; 0: unbounded)",
    )
    p.add_argument(
        "--max-batch-tokens",
        type=positive_int,
        default=None,
        help="tokens per step (default: 256, or --prefill-tokens + 64 if more, so a prompt chunk always "
        "fits beside every decoding sequence; at least --prefill-tokens)",
    )
    p.add_argument("--max-waiting", type=int, default=256)
    from expertmesh.router.prepared_image import ImageLimits  # numpy: not for every `expertmesh` command (see run)

    d = ImageLimits()
    p.add_argument("--max-images-per-request", type=int, default=d.max_images_per_request)
    p.add_argument(
        "--max-image-pixels-per-request",
        type=int,
        default=d.max_pixels_per_request,
        help="encoder pixels (after resizing) over one request's images",
    )
    p.add_argument("--max-image-bytes", type=int, default=d.max_bytes, help="encoded bytes of one image")
    p.add_argument(
        "--max-image-source-pixels",
        type=int,
        default=d.max_source_pixels,
        help="decoded width × height of one image before resizing (larger: refused, never decoded)",
    )
    p.add_argument(
        "--max-image-side",
        type=int,
        default=d.max_side,
        help="decoded width or height of one image (larger: refused, never decoded)",
    )
    p.add_argument(
        "--max-image-aspect",
        type=positive_float,
        default=d.max_aspect,
        help="longer side over shorter side of one image (larger: refused, never decoded)",
    )
    p.add_argument(
        "--image-decoders",
        type=int,
        default=2,
        metavar="N",
        help="processes decoding images (off the event loop), each within --image-decoder-mib",
    )
    p.add_argument(
        "--image-decoder-mib",
        type=int,
        default=768,
        metavar="MIB",
        help="memory one image decoder process may take beyond its start (a decode past it is refused)",
    )
    p.add_argument(
        "--image-fetch-allow",
        default="",
        help="comma-separated hosts (host or host:port) remote image URLs may be fetched from; empty "
        "(default): remote image URLs are refused (SSRF)",
    )
    p.add_argument(
        "--image-fetch-timeout",
        type=positive_float,
        default=d.fetch_timeout,
        help="seconds one remote image fetch may take in all (connecting, headers and the whole body)",
    )
    p.add_argument(
        "--transport",
        choices=("grpc", "collective"),
        default="grpc",
        help="how attention workers exchange each MoE layer with the expert workers: grpc, or collective "
        "(point-to-point pairs, tcp on cpu / nccl on cuda; expert workers need --collective-port; "
        "gRPC stays for health and fallback)",
    )
    p.add_argument(
        "--step-transport",
        choices=("grpc", "tcp"),
        default="grpc",
        help="how the router sends each attention worker its steps: grpc (default) or tcp (RunStep over one plain "
        "TCP connection per worker, formed over gRPC, not encrypted; gRPC while it cannot form)",
    )
    p.add_argument(
        "--handoff-transport",
        choices=("grpc", "collective", "mooncake"),
        default=None,
        help="how a prefill worker hands a sequence to a decode worker: grpc, collective (the --transport pairs) "
        "or mooncake (the decode worker reads the cache with Mooncake's transfer engine, TCP or RDMA; gRPC when "
        "either worker's engine is unavailable) (default: as --transport)",
    )
    p.add_argument(
        "--call-timeout",
        type=float,
        default=30.0,
        help="deadline of each worker call (seconds); a step's deadline adds one per expert worker",
    )
    (
        p.add_argument(
            "--control-timeout",
            type=positive_float,
            default=10.0,
            metavar="SECONDS",
            help="deadline of the calls to an attention worker outside a step (opening, growing and closing "
            "sequences, prefixes, free-block reads, heartbeats; at most --call-timeout): a hung worker "
            "costs one such deadline, then gets no request until it answers its health check again",
        ),
    )
    p.add_argument(
        "--kv-growth",
        type=int,
        default=256,
        metavar="TOKENS",
        help="KV a sequence reserves ahead, at placement and each time it runs out (not prompt + "
        "max_tokens up front); when a worker is full the youngest sequence is preempted and replayed",
    )
    p.add_argument(
        "--speculative-tokens",
        type=int,
        default=0,
        metavar="K",
        help="speculative decoding: a decoding sequence may emit up to K + 1 tokens a step (the attention "
        "workers verify K drafts; KV reserved for them); every attention worker must run with the same K "
        "(checked at start). 0: off",
    )
    p.add_argument(
        "--speculative-method",
        choices=("mtp", "ngram"),
        default=None,
        help="the attention workers' drafter (their --speculative-method), checked at start",
    )
    p.add_argument(
        "--speculative-max-batch",
        type=int,
        default=16,
        metavar="N",
        help="speculation: an attention worker running more than N sequences (decoding or prefilling) drafts and "
        "verifies nothing (large batches are compute-bound; drafts would cost more than they save: bench/spec.py on "
        "the embedded default measured MTP K=3 at 1.3x with 16 streams, 0.98x with 32). Default 16",
    )
    p.add_argument(
        "--max-queue-wait",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="a request that gets no KV room within this long is refused (429, retry later)",
    )
    p.add_argument(
        "--client-request-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="an HTTP request (line, headers, body) must arrive within this many seconds, else 408",
    )
    p.add_argument(
        "--client-write-timeout",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="disconnect an HTTP client (cancel a gRPC stream) that stops reading its response for this "
        "long (its request is cancelled)",
    )
    p.add_argument(
        "--grpc-threads",
        type=int,
        default=64,
        metavar="N",
        help="gRPC calls served at once (one thread each); more are refused (RESOURCE_EXHAUSTED)",
    )
    p.add_argument(
        "--grpc-streams-per-connection",
        type=int,
        default=16,
        metavar="N",
        help="gRPC calls at once on one connection (HTTP/2 max concurrent streams; the client queues more)",
    )
    p.add_argument(
        "--grpc-calls-per-client",
        type=int,
        default=None,
        metavar="N",
        help="gRPC calls at once from one client address (default: half of --grpc-threads; more: RESOURCE_EXHAUSTED)",
    )
    p.add_argument(
        "--max-context",
        type=int,
        default=None,
        metavar="TOKENS",
        help="serve at most this many tokens per sequence (prompt + output); default and ceiling: the "
        "checkpoint's max_context",
    )
    p.add_argument(
        "--thinking-budgets",
        default=None,
        metavar="LOW,HIGH,MAX",
        help="reasoning-token limits of the thinking tiers low, high and max (default: the model "
        "preset's, expertmesh/chat/thinking.py); the router forces the end of thinking at the limit",
    )
    p.add_argument(
        "--stored-responses",
        type=int,
        default=1024,
        metavar="N",
        help="Responses API: keep at most N stored responses (least recently used out first)",
    )
    p.add_argument(
        "--stored-responses-mib",
        type=int,
        default=256,
        metavar="MIB",
        help="Responses API: at most this much memory for stored responses",
    )
    p.add_argument(
        "--stored-responses-ttl",
        type=float,
        default=3600.0,
        metavar="SECONDS",
        help="Responses API: a stored response is forgotten after this long",
    )
    p.add_argument(
        "--replica",
        default=None,
        help="this router's name in response ids (default: $EXPERTMESH_REPLICA, else the hostname)",
    )
    p.add_argument(
        "--no-reasoning-memory",
        action="store_true",
        help="do not give chat histories that drop the reasoning of answers generated here their reasoning back",
    )
    p.add_argument(
        "--api-key-file",
        default=None,
        help="require an API key of this file: one key a line, each its own tenant of the prefix cache "
        "(--prefix-cache-scope) (default: $EXPERTMESH_API_KEY if set, one key); keys are never taken from the "
        "command line, where `ps` would show them",
    )
    p.add_argument(
        "--prefix-salt-file",
        default=None,
        metavar="PATH",
        help="salt prefix keys with this file's bytes, the secret shared by the router replicas of a "
        "deployment: with the same salt every replica computes the same keys and hits the prefixes "
        "the others saved on the workers (default: a random salt of this router instance)",
    )
    p.add_argument(
        "--prefix-index-refresh-s",
        type=nonnegative_float,
        default=5.0,
        metavar="SECONDS",
        help="how often to read every attention worker's cached prefixes into this router's index (what "
        "other replicas saved or dropped there); 0: only when a worker is taken back (default 5)",
    )
    p.add_argument(
        "--kv-store",
        choices=("mooncake",),
        default=None,
        help="the attention workers share this cluster KV store (their --kv-store-master) and write every prefix "
        "they save through to it: the index counts a saved prefix as in the store at once, so a turn after its "
        "worker died restores it on another worker (default: none)",
    )
    p.add_argument(
        "--prefix-cache-scope",
        choices=SCOPES,
        default="key",
        help="whom cached prompt prefixes are shared with: key — each API key only its own (cached_tokens and "
        "latency never tell one key what another sent; with no API key configured everyone is one tenant), "
        "shared — every key (default key; a request's cache_salt / prompt_cache_key scope it further either way)",
    )
    p.add_argument(
        "--epp-port",
        type=nonnegative_int,
        default=0,
        metavar="PORT",
        help="also serve the Gateway API Inference Extension's Endpoint Picker (Envoy ext_proc, gRPC, plaintext) on "
        "this port: the gateway asks it which router replica serves each request (0: off; 9002 by convention)",
    )
    p.add_argument(
        "--epp-replicas",
        default="",
        metavar="HOST:PORT,...",
        help="the endpoint picker's router replicas (their HTTP addresses; a name that resolves to several "
        "addresses, a headless Service's, stands for all of them); default: this router alone, and the "
        "endpoints in the gateway's subset hint",
    )
    p.add_argument("--worker-tls-ca", help="connect to workers over TLS, verifying them with this CA (PEM)")
    p.add_argument("--worker-tls-cert", help="client certificate for mutual TLS with the workers")
    p.add_argument("--worker-tls-key", help="private key of --worker-tls-cert")
    p.add_argument("--worker-tls-server-name", help="name expected in the workers' certificates")
    p.add_argument("--tls-cert", help="serve HTTP (HTTPS) and gRPC over TLS with this certificate")
    p.add_argument("--tls-key", help="private key of --tls-cert")
    p.add_argument("--tls-client-ca", help="require client certificates on the public endpoints (mutual TLS)")


def serving_config(cfg, *, max_context: int | None = None):
    """`cfg` with the deployment's serving limit `--max-context` in place of the checkpoint's. Raises ValueError
    naming the flag when the value is beyond the model."""
    update: dict = {}
    if max_context is not None:
        if not 0 < max_context <= cfg.max_context:
            raise ValueError(f"--max-context={max_context}: must be in 1..{cfg.max_context} (the model's max_context)")
        update["max_context"] = max_context
    return cfg.model_copy(update=update) if update else cfg


def thinking_budgets(text: str | None) -> ThinkingBudgets | None:
    """`--thinking-budgets LOW,HIGH,MAX` (None: the model preset's defaults); ValueError naming the flag."""
    try:
        return ThinkingBudgets.parse(text) if text is not None else None
    except ValueError as e:
        raise ValueError(f"--thinking-budgets={text!r}: {e}") from None


def read_prefix_salt(path: str | None) -> bytes | None:
    """The bytes of --prefix-salt-file (None without one: a random salt per instance). ValueError naming the flag
    when the file is missing, unreadable or empty — replicas that silently fell back to random salts would never
    see each other's prefixes."""
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            salt = f.read()
    except OSError as e:
        raise ValueError(f"--prefix-salt-file {path}: cannot read it ({e.strerror or e})") from None
    if not salt:
        raise ValueError(f"--prefix-salt-file {path}: the file is empty; expected the router replicas' shared secret")
    return salt


def read_api_keys(path: str) -> tuple[str, ...]:
    """The keys of --api-key-file, one a line (blank lines skipped). ValueError naming the flag when the file is
    missing, unreadable or holds no key — a router that silently served without keys would serve everyone."""
    try:
        with open(path) as f:
            keys = tuple(dict.fromkeys(line.strip() for line in f if line.strip()))
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--api-key-file {path}: cannot read it ({getattr(e, 'strerror', None) or e})") from None
    if not keys:
        raise ValueError(f"--api-key-file {path}: the file holds no key")
    return keys


def run(args) -> int:
    # Imported here, not at the top: every `expertmesh` command builds this module's parser (entry/cli.py, entry/up.py), and
    # the engine, the HTTP app and the gRPC service (FastAPI, uvicorn, grpc, numpy, Pillow) load only for a router.
    from expertmesh.router.engine_config import EngineConfig
    from expertmesh.router.grpc_service import serve_router_grpc
    from expertmesh.router.http import build_app, serve_http
    from expertmesh.runtime.tls import ClientTLS, ServerTLS

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    telemetry.setup_tracing("expertmesh-router", {"expertmesh.role": "router"})
    try:
        engine_config = EngineConfig.from_args(args, prefix_salt=read_prefix_salt(args.prefix_salt_file))
    except ValueError as e:
        print(f"expertmesh router: {e}", file=sys.stderr)
        return 2
    try:
        ckpt_cfg = serving_config(checkpoint_config(args.checkpoint), max_context=args.max_context)
        budgets = thinking_budgets(args.thinking_budgets)
        api_key = (
            read_api_keys(args.api_key_file) if args.api_key_file else os.environ.get("EXPERTMESH_API_KEY") or None
        )
    except ValueError as e:
        print(f"expertmesh router: {e}", file=sys.stderr)
        return 2
    try:
        epp_seeds = parse_replicas(args.epp_replicas)
    except ValueError as e:
        print(f"expertmesh router: {e}", file=sys.stderr)
        return 2
    chat = load_chat(args.checkpoint, model_vocab_size=ckpt_cfg.vocab_size)
    plan = load_plan(args.plan)
    worker_tls = (
        ClientTLS(args.worker_tls_ca, args.worker_tls_cert, args.worker_tls_key, args.worker_tls_server_name)
        if args.worker_tls_ca
        else None
    )
    public_tls = ServerTLS(args.tls_cert, args.tls_key, args.tls_client_ca) if args.tls_cert else None
    engine = build_remote_engine(
        ckpt_cfg,
        [a for a in args.attention.split(",") if a],
        [e for e in args.experts.split(",") if e],
        plan,
        engine_config,
        timeout=args.call_timeout,
        prefill=[a for a in args.prefill.split(",") if a],
        control_timeout=args.control_timeout,
        tls=worker_tls,
    ).start()
    try:
        store = ResponseStore(
            max_responses=args.stored_responses,
            max_bytes=args.stored_responses_mib * 2**20,
            ttl=args.stored_responses_ttl,
            replica=args.replica or default_replica(),
        )
    except ValueError as e:
        print(f"expertmesh router: --replica: {e}", file=sys.stderr)
        return 2
    decoder = None
    if ckpt_cfg.vision is not None:
        from expertmesh.router.image_decode import ImageDecoder

        decoder = ImageDecoder(max(1, args.image_decoders), memory_bytes=args.image_decoder_mib * 2**20)
        decoder.warm()
    app = build_app(
        engine,
        api_key=api_key,
        chat=chat,
        response_store=store,
        reasoning_memory=not args.no_reasoning_memory,
        image_decoder=decoder,
        thinking_budgets=budgets,
    )
    http_server, http_thread = serve_http(
        app,
        args.host,
        args.http_port,
        tls=public_tls,
        request_timeout=args.client_request_timeout,
        write_timeout=args.client_write_timeout,
    )
    grpc_server = serve_router_grpc(
        engine,
        args.host,
        args.grpc_port,
        api_key=api_key,
        tls=public_tls,
        chat=chat,
        health_port=args.health_port,
        max_workers=args.grpc_threads,
        max_streams_per_connection=args.grpc_streams_per_connection,
        max_calls_per_client=args.grpc_calls_per_client,
        write_timeout=args.client_write_timeout,
        thinking_budgets=budgets,
    )
    epp_server = None
    if args.epp_port:
        from expertmesh.router.endpoint_picker import serve_endpoint_picker
        from expertmesh.router.replica_set import ReplicaSet, own_address, split_host_port

        seeds = epp_seeds or [split_host_port(own_address(args.host, args.http_port))]
        epp_server = serve_endpoint_picker(ReplicaSet(seeds, tls=public_tls is not None), args.host, args.epp_port)
        log.info(
            "endpoint picker (ext_proc) on %s:%d over %d replica address(es)", args.host, epp_server.port, len(seeds)
        )
    stop = stop_on_signals()
    if args.plan_poll_seconds > 0:
        threading.Thread(
            target=watch_plan,
            args=(engine, args.plan, stop, args.plan_poll_seconds, args.replan_drain_seconds),
            name="plan-watch",
            daemon=True,
        ).start()
    print(f"READY router {args.host}:{args.http_port}", flush=True)
    stop.wait()
    log.info("shutting down: no new requests, finishing in-flight ones")
    exit_after(args.shutdown_timeout, "expertmesh router")
    if epp_server is not None:
        epp_server.stop(grace=2)
        epp_server.replicas.close()
    if grpc_server is not None:
        grpc_server.stop(grace=5)
        if grpc_server.health_server is not None:
            grpc_server.health_server.stop(0)
    http_server.should_exit = True
    http_thread.join(timeout=10)
    engine.close()
    if decoder is not None:
        decoder.close(wait=True)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="expertmesh router")
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
