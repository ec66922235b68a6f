"""`expertmesh worker`'s assembly: the attention / expert worker objects a `WorkerOptions` asks for, behind gRPC
(`expertmesh.v1`, worker/servicers.py) with the standard grpc.health.v1 health service and server reflection (v1
and v1alpha), the collective transport beside it when asked. The command line is worker/cli.py.

Shutdown (`shutdown`): health goes NOT_SERVING, new calls are refused, in-flight ones get the grace seconds.
"""

import logging
from concurrent import futures

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from expertmesh.checkpoint.loader import Checkpoint
from expertmesh.kernels.dsa import cpu_kernel as dsa_cpu_kernel
from expertmesh.kernels.moe import cpu_kernel
from expertmesh.model import memory
from expertmesh.model.config import ModelConfig
from expertmesh.placement.sizing import WorkerMemory
from expertmesh.runtime.health_port import serve_health_only
from expertmesh.runtime.reflection import enable_reflection
from expertmesh.worker.attention import AttentionWorker
from expertmesh.worker.collective import (
    CollectiveServer,
    backend_for,
)
from expertmesh.worker.expert import ExpertWorker
from expertmesh.worker.options import WorkerOptions
from expertmesh.worker.servicers import (
    ATTENTION_SERVICE,
    EXPERT_SERVICE,
    AttentionServicer,
    ExpertServicer,
    add_servicer,
)

log = logging.getLogger("expertmesh.worker")

MAX_MESSAGE_BYTES = 256 * 1024 * 1024


def all_experts(cfg) -> list[tuple[int, int]]:
    return [(layer, e) for layer in cfg.moe_layers for e in range(cfg.moe.n_routed_experts)]


def build_workers(checkpoint, o: WorkerOptions):
    """The (attention, expert) worker objects of `o.role` (None where the role has none), on `o.device` (see
    expertmesh/model/memory.py: devices, dtypes, the process model). `checkpoint`: a directory, a Checkpoint, or on
    --device meta a ModelConfig (nothing read)."""
    device = memory.check_device(o.device)
    if not isinstance(checkpoint, (Checkpoint, ModelConfig)):
        checkpoint = Checkpoint(checkpoint)
    cfg = checkpoint if isinstance(checkpoint, ModelConfig) else checkpoint.cfg
    attention = expert = None
    if o.role in ("attention", "both"):
        attention = AttentionWorker(
            checkpoint,
            kv_blocks=o.kv_blocks,
            block_size=o.block_size,
            name=o.name or "attention-0",
            device=device,
            dtype=o.dtype,
            gpu_memory_utilization=o.gpu_memory_utilization,
            device_memory_bytes=o.device_memory_bytes,
            lease_seconds=o.lease_seconds,
            pool=o.pool,
            decode_threads=o.decode_threads,
            speculative_method=o.speculative_method,
            speculative_tokens=o.speculative_tokens,
            **o.kv_tiers,
        )
    if o.role in ("expert", "both"):
        pairs = all_experts(cfg) if o.assignment is None else [(int(l), int(e)) for l, e in o.assignment]
        if device == "cuda" and o.gpu_of:
            need, have = max(o.gpu_of.values()) + 1, torch.cuda.device_count()
            if need > have:
                raise ValueError(f"--plan: this worker's experts are placed on {need} GPUs, torch sees {have}")
        expert = ExpertWorker(
            checkpoint,
            pairs,
            name=o.name or "expert-0",
            device=device,
            gpu_of=o.gpu_of,
            decode_threads=o.decode_threads,
        )
    return attention, expert


def dry_run(attention, expert, o: WorkerOptions) -> str:
    """The one JSON line of `--dry-run`: resident bytes of the built worker(s), per device; the lower KV tiers'
    bounds (host memory beside the device's, disk) where `o` gives them."""
    total = WorkerMemory()
    for w in (attention, expert):
        if w is None:
            continue
        m = w.memory()
        for dev, n in m.devices.items():
            total.devices[dev] = total.devices.get(dev, 0) + n
        total.weights_bytes += m.weights_bytes
        total.kv_bytes += m.kv_bytes
        total.workspace_bytes += m.workspace_bytes
    extra = {}
    if attention is not None:
        extra["kv_blocks"] = attention.pool.num_blocks
        for name in ("kv_host_bytes", "kv_disk_bytes"):
            if getattr(o, name):
                extra[name] = getattr(o, name)
    if expert is not None:
        extra["experts"] = len(expert.assignment)
    return total.to_json(**extra)


def serve(role: str, checkpoint, port: int, host: str = "127.0.0.1", **fields) -> grpc.Server:
    """`start(checkpoint, WorkerOptions(role, host, port, **fields))`: the keyword form tests and embedders use."""
    return start(checkpoint, WorkerOptions(role=role, host=host, port=port, **fields))


def start(checkpoint, o: WorkerOptions) -> grpc.Server:
    """Load the worker(s) of `o.role` from `checkpoint` (a directory or a Checkpoint) and serve them on
    o.host:o.port (0 → a free port), with the collective transport when `o.collective_port` is set
    (worker/collective.py: expert calls, hand-offs; 0: any free port) and grpc.health.v1 alone, plaintext, on
    `o.health_port` (what Kubernetes gRPC probes reach when the real port requires mutual TLS).
    Returns the started server, with `.port` (the bound port), `.health`, `.health_server` / `.health_port`,
    `.attention` / `.expert` (the local workers, or None), `.collective` (CollectiveServer or None),
    `.step_channels` (the routers' step channels, worker/step_channel.py; None without an attention worker) and
    `.role`."""
    attention, expert = build_workers(checkpoint, o)
    if expert is not None and expert.device_kind == "cpu":
        # build (or load) the fused CPU MXFP4 kernel before serving: a first build takes ~12 s, which inside the
        # first RunExperts call would overrun the caller's deadline and mark this worker down
        if cpu_kernel.enabled():
            cpu_kernel.load()
    if attention is not None and attention.device_kind == "cpu" and attention.cfg.latent_kv_layers:
        dsa_cpu_kernel.available()  # the paged-attention kernel, likewise built before the first RunStep

    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=o.max_workers, thread_name_prefix=f"grpc-{o.role}"),
        options=[
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.so_reuseport", 0),
        ],  # a taken port must fail, not be shared
        maximum_concurrent_rpcs=16 * o.max_workers,
    )  # the queue of calls waiting for a thread has a bound
    services = []
    attention_servicer = AttentionServicer(attention, o.expert_tls) if attention is not None else None
    collective = None
    if o.collective_port is not None:
        collective = CollectiveServer(
            o.host,
            o.collective_port,
            backend_for((expert or attention).device_kind, o.collective_backend),
            expert=expert,
            attention=attention,
            import_cache=attention_servicer.import_cache if attention_servicer else None,
        )
    if attention_servicer is not None:
        attention_servicer.collective = collective
        add_servicer(server, ATTENTION_SERVICE, attention_servicer)
        services.append(ATTENTION_SERVICE)
    if expert is not None:
        add_servicer(server, EXPERT_SERVICE, ExpertServicer(expert, collective))
        services.append(EXPERT_SERVICE)
    health_servicer = health.HealthServicer(experimental_non_blocking=True)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    enable_reflection(services + [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name], server)

    address = f"{o.host}:{o.port}"
    try:
        bound = (
            server.add_secure_port(address, o.tls.credentials())
            if o.tls is not None
            else server.add_insecure_port(address)
        )
    except RuntimeError as e:
        raise OSError(f"--host/--port {address}: cannot listen ({e})") from None
    if bound == 0:
        raise OSError(f"--host/--port {address}: cannot listen (address in use?)")
    server.start()
    for s in services + [""]:
        health_servicer.set(s, health_pb2.HealthCheckResponse.SERVING)
    server.port, server.role, server.health = bound, o.role, health_servicer
    server.health_server, server.health_port = None, None
    if o.health_port is not None:
        server.health_server, server.health_port = serve_health_only(health_servicer, o.host, o.health_port)
    server.attention, server.expert, server.collective = attention, expert, collective
    server.step_channels = attention_servicer.step_channels if attention_servicer is not None else None
    log.info("%s worker serving %s on %s:%d", o.role, ", ".join(services), o.host, bound)
    return server


def shutdown(server: grpc.Server, grace: float = 10.0) -> None:
    """Health NOT_SERVING first (balancers stop sending), then refuse new calls and let in-flight ones finish."""
    server.health.enter_graceful_shutdown()
    server.stop(grace).wait()
    if getattr(server, "health_server", None) is not None:
        server.health_server.stop(0).wait()
