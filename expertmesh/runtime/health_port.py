"""A plaintext gRPC server exposing only grpc.health.v1, beside a worker's or router's real port: Kubernetes `grpc:`
probes cannot present a client certificate, so under mutual TLS they need a port of their own (`--health-port`)."""

from __future__ import annotations

from concurrent import futures

import grpc
from grpc_health.v1 import health_pb2_grpc


def serve_health_only(health_servicer, host: str, port: int) -> tuple[grpc.Server, int]:
    """Serve `health_servicer` (shared with the real server, so the probe sees what the real port reports) alone,
    plaintext, on host:port (0: any free port). Nothing else is reachable on it. Returns (server, bound port)."""
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="grpc-health"),
        options=[("grpc.so_reuseport", 0)],
        maximum_concurrent_rpcs=32,
    )
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    try:
        bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError as e:
        raise OSError(f"--health-port {host}:{port}: cannot listen ({e})") from None
    if bound == 0:
        raise OSError(f"--health-port {host}:{port}: cannot listen (address in use?)")
    server.start()
    return server, bound
