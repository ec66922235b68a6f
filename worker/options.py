"""`WorkerOptions`: everything a worker process is started with, parsed once (worker/cli.py) or given by a test or
an embedder (`serve(role, checkpoint, port, **fields)`), then read by the assembly (worker/server.py) — no option
is handed down by hand from function to function."""

from __future__ import annotations

from dataclasses import dataclass, field

ROLES = ("attention", "expert", "both")


@dataclass(frozen=True)
class WorkerOptions:
    role: str  # attention | expert | both
    host: str = "127.0.0.1"
    port: int = 0  # 0: any free port
    name: str | None = None  # default: <role>-0
    device: str | None = None  # cuda | cpu | meta (None: cuda when torch sees one, else cpu)
    dtype: object = None  # torch dtype or its name (None: bfloat16 on cuda / meta, float32 on cpu)
    max_workers: int = 16  # gRPC handler threads
    tls: object = None  # runtime.tls.ServerTLS: serve TLS (mutual with a client CA)
    health_port: int | None = None  # also serve grpc.health.v1 alone, plaintext, here
    collective_port: int | None = None  # also serve the collective transport, its rendezvous store here
    collective_backend: str = "auto"  # worker/collective.backend_for
    decode_threads: int | None = None  # torch threads for decode-sized overlapping work (worker/threads.py)
    # expert role
    assignment: list[tuple[int, int]] | None = None  # the (layer, expert) pairs held; None: all of them
    gpu_of: dict[tuple[int, int], int] | None = None  # the plan's GPU of each pair held
    # attention role
    kv_blocks: int | None = 512  # KV pool blocks (None: sized by gpu_memory_utilization)
    block_size: int = 16  # tokens per KV block
    gpu_memory_utilization: float | None = None  # size the KV pool to this fraction of the device
    device_memory_bytes: int | None = None  # the device's memory for it (default: the CUDA device's)
    lease_seconds: float = 30.0  # close the sequences of a router silent this long (0: never)
    kv_host_bytes: int = 0  # host-memory tier for demoted prefixes (0: none)
    kv_disk_dir: str | None = None  # local-disk tier's directory
    kv_disk_bytes: int = 0  # local-disk tier's bound
    kv_disk_key: bytes | None = field(default=None, repr=False)  # its files' MAC secret (None: random per process)
    pool: str = "mixed"  # prefill | decode | mixed: the label Info and /metrics carry
    speculative_method: str | None = None  # mtp | ngram (worker/speculation.py; None: off)
    speculative_tokens: int = 0  # drafts per decode step (0: off)
    expert_tls: object = None  # runtime.tls.ClientTLS for the calls to expert workers and hand-offs

    def __post_init__(self):
        if self.role not in ROLES:
            raise ValueError(f"role: expected one of {list(ROLES)}, found {self.role!r}")

    @property
    def kv_tiers(self) -> dict:
        """The lower KV tiers' bounds, as AttentionWorker takes them."""
        return {
            "kv_host_bytes": self.kv_host_bytes,
            "kv_disk_dir": self.kv_disk_dir,
            "kv_disk_bytes": self.kv_disk_bytes,
            "kv_disk_key": self.kv_disk_key,
        }
