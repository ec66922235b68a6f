"""A local deployment as processes on loopback (`LocalCluster`): N attention workers, M expert workers and the
router, each a child `expertmesh` process that prints `READY <address>` once serving, with a placement plan
computed for them; started, restarted (fault tests; `supervise`'s backoff) and stopped router first. `expertmesh up`
(expertmesh/entry/up.py) is its command line; tests and benches use it as a context manager.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from expertmesh.checkpoint.config import checkpoint_config
from expertmesh.entry.kv_store_service import KV_STORES, KVStoreService
from expertmesh.model.config import ModelConfig
from expertmesh.placement.planner import ClusterShape, placed_layers, plan_placement
from expertmesh.runtime.shutdown import PARENT_ENV


# ----------------------------------------------------------------------------------------------- placement
def usable_cores() -> int:
    """The cores this process may run on (its affinity mask where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def default_expert_workers(cores: int | None = None, replicas: int = 1) -> int:
    """`up`'s expert workers when not given: one per two cores, at least one and at least `replicas` (the expert
    workers every expert must be on: --expert-replicas). Every expert worker is a process beside the attention
    workers on the same cores, and a decode step waits for the slowest of a layer's calls: on 2 cores, 1 attention
    + 2 expert workers decoded 8 sequences at ITL p50 92.5-102.0 ms and 1 + 1 at 81.7-91.0 ms (one sequence
    48.0-50.9 vs 46.2-48.9 ms), with the same start-up (16.1 vs 15.8 s to healthy)."""
    return max(1, replicas, (usable_cores() if cores is None else cores) // 2)


def make_placement(
    cfg: ModelConfig,
    expert_workers: int,
    redundant_experts: int = 0,
    loads=None,
    group_aware: bool = True,
    min_replicas: int = 1,
    mtp: bool = False,
):
    """A placement plan for `expert_workers` single-GPU workers (the planner; one GPU per local process), by
    default group-aware (each combine group's experts on one worker: one answer row per (token, group)); `mtp`:
    the MTP layers' experts too (speculative decoding with the MTP drafter)."""
    layers = len(placed_layers(cfg, mtp))
    copies = layers * cfg.moe.n_routed_experts * max(1, min_replicas) + redundant_experts * layers
    per_worker = -(-copies // expert_workers)
    memory = (per_worker + 1) * cfg.expert_bytes_mxfp4
    shape = ClusterShape(pods=expert_workers, gpus_per_pod=1, gpu_memory_bytes=memory, reserve_bytes=0)
    return plan_placement(
        cfg,
        shape,
        redundant_slots=redundant_experts,
        loads=loads,
        group_aware=group_aware,
        min_replicas=min_replicas,
        mtp=mtp,
    )


# ----------------------------------------------------------------------------------------------- as processes
def _ephemeral_low() -> int:
    try:
        return int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_HANDED_OUT: dict[int, None] = {}  # the ports free_port returned lately, oldest first
DISK_KEY_NAME = "disk-key"  # in --kv-disk-dir: the secret its attention workers authenticate their tier files with

_HANDED_OUT_LOCK = threading.Lock()
_REMEMBERED = 4096


def free_port(host: str = "127.0.0.1") -> int:
    """A port that is free now, chosen below the kernel's ephemeral range: a port from that range (what binding
    port 0 returns) can be taken by any outgoing connection before the child process binds it. Never one it
    returned among its last 4,096 answers in this process: a port handed to a child that has not bound it yet is
    still free, and a cluster picks a dozen in a row (a make test run failed once when an attention worker could
    not bind the port it was given; 2,000 picks without this check repeated 146 ports)."""
    low = _ephemeral_low()
    with _HANDED_OUT_LOCK:
        for _ in range(200):
            port = random.randrange(max(1024, low - 12000), low)
            if port in _HANDED_OUT:
                continue
            with socket.socket() as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
            break
        else:
            with socket.socket() as s:
                s.bind((host, 0))
                port = s.getsockname()[1]
        _HANDED_OUT[port] = None
        if len(_HANDED_OUT) > _REMEMBERED:
            del _HANDED_OUT[next(iter(_HANDED_OUT))]
        return port


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    args: list[str] = field(default_factory=list)
    address: str = ""
    lines: list[str] = field(default_factory=list)


class LocalCluster:
    """Starts and stops the processes of a local deployment. Usable from tests as a context manager."""

    def __init__(
        self,
        checkpoint: str | Path,
        *,
        attention_workers: int = 1,
        expert_workers: int = 1,
        redundant_experts: int = 0,
        http_port: int = 8000,
        grpc_port: int = 50051,
        expert_replicas: int = 1,
        host: str = "127.0.0.1",
        threads: int | None = 1,
        kv_blocks: int = 512,
        block_size: int = 16,
        prefill_chunk: int = 16,
        prefill_tokens: int | None = None,
        run_dir: str | Path | None = None,
        extra_env: dict | None = None,
        router_args: list[str] | None = None,
        echo: bool = False,
        worker_env: dict | None = None,
        tls_dir: str | Path | None = None,
        device: str | None = None,
        dtype: str | None = None,
        worker_tls_dir: str | Path | None = None,
        transport: str = "grpc",
        kv_host_gib: float = 0.0,
        kv_disk_dir: str | Path | None = None,
        kv_disk_gib: float = 0.0,
        attention_metrics: bool = False,
        prefill_workers: int = 0,
        speculative_method: str | None = None,
        speculative_tokens: int = 0,
        kv_store: str | None = None,
        kv_store_gib: float = 0.25,
    ):
        """`tls_dir`: mutual TLS between router and workers and TLS on the router's public endpoints;
        `worker_tls_dir`: mutual TLS between the processes only (the public endpoints stay plain on loopback);
        `transport`: the per-layer expert exchange, grpc or collective (point-to-point pairs, worker/collective.py:
        each expert worker serves its rendezvous store on a port of its own; the CLI's default). `threads`: torch threads per
        process, or None for each role's share of this machine's cores (`threads_for`). `kv_blocks`: each attention
        worker's device KV pool; `kv_host_gib` / `kv_disk_gib` (in `kv_disk_dir`/attention-<i>): its lower tiers;
        `attention_metrics`: each attention worker serves Prometheus /metrics (`metrics_urls`: the decode pool's,
        then the prefill pool's); `prefill_workers`: a prefill pool of that many attention workers (prefill-<i>,
        `--pool prefill`) beside the `attention_workers` (then `--pool decode`; router/disagg.py);
        `speculative_method` / `speculative_tokens`: speculative decoding, given to the attention workers and the
        router alike (worker/speculation.py; 0 tokens: off). `kv_store` "mooncake": the cluster KV tier — its master
        and store process (`kv_store_gib` of memory) as children `kv-store-master` / `kv-store`
        (entry/kv_store_service.py), every attention worker its client (worker/kv_store.py)."""
        if prefill_workers < 0:
            raise ValueError(f"prefill_workers={prefill_workers}: expected ≥ 0")
        if transport not in ("grpc", "collective"):
            raise ValueError(f"transport: expected grpc or collective, found {transport!r}")
        self.transport = transport
        self.checkpoint = str(checkpoint)
        self.n_attention, self.n_expert, self.n_prefill = attention_workers, expert_workers, prefill_workers
        self.redundant = redundant_experts
        self.expert_replicas = expert_replicas
        self.http_port, self.grpc_port, self.host = http_port, grpc_port, host
        self.threads, self.kv_blocks, self.block_size, self.prefill_chunk = (
            threads,
            kv_blocks,
            block_size,
            prefill_chunk,
        )
        self.prefill_tokens = prefill_tokens or prefill_chunk  # tests: one granule a step, as the in-process engine
        self.run_dir = Path(run_dir or tempfile.mkdtemp(prefix="expertmesh-up-"))
        self.extra_env = extra_env or {}
        self.router_args = router_args or []
        self.speculative = (
            ["--speculative-method", speculative_method, "--speculative-tokens", str(speculative_tokens)]
            if speculative_tokens
            else []
        )
        self.echo = echo
        self.tls_dir = Path(tls_dir) if tls_dir else None
        self.worker_tls_dir = Path(worker_tls_dir) if worker_tls_dir else self.tls_dir
        # passed to every worker (None: the worker's default, cuda when torch sees one, else cpu)
        self.device_args = (["--device", device] if device else []) + (
            ["--dtype", dtype] if dtype else []
        )  # ca.crt, server.crt/key, client.crt/key: mTLS
        self.worker_env = worker_env or {}  # name → extra env for that worker (fault injection in tests)
        self.kv_host_gib, self.kv_disk_gib = kv_host_gib, kv_disk_gib
        self.kv_disk_dir = Path(kv_disk_dir) if kv_disk_dir else None
        self.metrics_urls: list[str] = []
        self.metrics_ports = (
            [free_port(host) for _ in range(attention_workers + prefill_workers)] if attention_metrics else []
        )
        self.children: list[Child] = []
        self.router: Child | None = None
        if kv_store not in (None, *KV_STORES):
            raise ValueError(f"kv_store: expected one of {', '.join(KV_STORES)}, found {kv_store!r}")
        self.kv_store = KVStoreService(int(kv_store_gib * 2**30), host=host) if kv_store else None
        self.plan_path = self.run_dir / "plan.json"

    # ------------------------------------------------------------------ processes
    def threads_for(self, name: str) -> int:
        """Torch threads of the process `name` (attention-i, prefill-i, expert-i, router). With `threads` None, each
        role's share of the cores this process may run on: a step runs the attention workers and the expert workers
        in turn (attention waits while the experts of its layer compute), so the attention workers (of both pools)
        share all the cores and so do the expert workers; the router does no tensor math. (Every expert worker on
        all the cores decoded 8 sequences faster on 2 cores, ITL p50 81-87 vs 88-97 ms, but the expert workers load
        at the same time: healthy after 60.0 s instead of 14.8 s.)"""
        if self.threads is not None:
            return self.threads
        cores = usable_cores()
        role = name.split("-", 1)[0]
        attention = self.n_attention + self.n_prefill  # both pools' workers: attention processes
        share = {"attention": attention, "prefill": attention, "expert": self.n_expert}.get(role)
        return max(1, cores // share) if share else 1

    def decode_threads(self) -> int | None:
        """Every worker's --decode-threads (worker/threads.py), with `threads` None: a decode layer runs each
        attention worker's shared experts and every expert worker's calls at once, and `threads_for` gives each
        role all the cores, so that work gets the cores shared out among all the worker processes instead (on 2
        cores, 1 + 1 workers: ITL p50 of one sequence 39.1-41.3 vs 42.3-43.8 ms with every thread). None (the
        workers' default: all) when `threads` is given."""
        if self.threads is not None:
            return None
        return max(1, usable_cores() // (self.n_attention + self.n_prefill + self.n_expert))

    def _decode_args(self) -> list[str]:
        n = self.decode_threads()
        return [] if n is None else ["--decode-threads", str(n)]

    def _env(self, name: str) -> dict:
        env = dict(os.environ)
        threads = str(self.threads_for(name))
        env.update(
            {
                "OMP_NUM_THREADS": threads,
                "MKL_NUM_THREADS": threads,
                "EXPERTMESH_TORCH_THREADS": threads,
                "PYTHONUNBUFFERED": "1",
                "PYTHONSAFEPATH": "1",
            }
        )  # the repo's operator/ must never shadow the stdlib module
        env.update(self.extra_env)  # OTEL_* and friends pass through from os.environ as well
        return env

    def _spawn(self, name: str, args: list[str], env: dict | None = None) -> Child:
        module = "expertmesh.entry.kv_store_service" if name.startswith("kv-store") else "expertmesh.entry.cli"
        cmd = [sys.executable, "-m", module, *args]
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**self._env(name), **(env or {}), PARENT_ENV: str(os.getpid())},
            start_new_session=True,
        )  # the child dies with us: shutdown.die_with_parent
        child = Child(name, proc, list(args))
        threading.Thread(target=self._pump, args=(child,), daemon=True, name=f"log-{name}").start()
        self.children.append(child)
        return child

    def _collective_args(self) -> list[str]:
        """The rendezvous store port of an expert worker, or of a decode-pool attention worker (the hand-offs sent
        to it), for the collective transport (a port of its own)."""
        return ["--collective-port", str(free_port(self.host))] if self.transport == "collective" else []

    def _tier_args(self, i: int, name: str) -> list[str]:
        """The KV tier flags of attention worker `name`, the i-th (a disk folder of its own under --kv-disk-dir)."""
        args = ["--kv-host-gib", str(self.kv_host_gib)] if self.kv_host_gib else []
        if self.kv_disk_dir is not None:
            args += ["--kv-disk-dir", str(self.kv_disk_dir / name), "--kv-disk-gib", str(self.kv_disk_gib)]
            args += ["--kv-disk-key-file", str(self._disk_key_file())]
        if self.kv_store is not None:
            args += ["--kv-store-master", self.kv_store.master_address]
            args += ["--kv-store-metadata", self.kv_store.metadata_url, "--kv-store-key-file", str(self._store_key())]
        if self.metrics_ports:
            args += ["--metrics-port", str(self.metrics_ports[i])]
            self.metrics_urls.append(f"http://{self.host}:{self.metrics_ports[i]}")
        return args

    def _start_kv_store(self, timeout: float) -> None:
        """The cluster KV tier's master, then its store process, as supervised children."""
        s = self.kv_store
        ports = ",".join(str(p) for p in (s.rpc_port, s.metadata_port, s.metrics_port, s.store_port))
        common = ["--ports", ports, "--store-bytes", str(s.store_bytes), "--host", self.host]
        self._wait_ready([self._spawn("kv-store-master", ["master", *common])], timeout)
        self._wait_ready([self._spawn("kv-store", ["store", *common])], timeout)

    def _store_key(self) -> Path:
        """The attention workers' shared store secret (0600, in the run folder)."""
        path = self.run_dir / "kv-store-key"
        if not path.exists():
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(os.urandom(32))
        return path

    def _disk_key_file(self) -> Path:
        """The secret the attention workers' tier files are authenticated with (worker/kv_tiers.py), kept beside
        their folders (0600, made once): a restarted worker, or a later `up` on the same folder, reads its files
        back; whoever cannot read this folder cannot forge them."""
        path = self.kv_disk_dir / DISK_KEY_NAME
        self.kv_disk_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except FileExistsError:
            return path
        with os.fdopen(fd, "wb") as f:
            f.write(os.urandom(32))
        return path

    def child(self, name: str) -> Child:
        return next(c for c in self.children if c.name == name)

    def kill(self, name: str) -> None:
        """SIGKILL a process (fault tests)."""
        c = self.child(name)
        c.proc.kill()
        c.proc.wait()

    def restart(self, name: str, timeout: float = 120.0, env: dict | None = None) -> Child:
        """Start a stopped process again with the same arguments (same port)."""
        old = self.child(name)
        if old.proc.poll() is None:
            self.kill(name)
        self.children.remove(old)
        new = self._spawn(name, old.args, env)
        if old is self.router:
            self.router = new
        self._wait_ready([new], timeout)
        return new

    def _pump(self, child: Child) -> None:
        for line in child.proc.stdout:
            line = line.rstrip("\n")
            child.lines.append(line)
            if line.startswith("READY "):
                child.address = line.split()[-1]
            if self.echo:
                print(f"[{child.name}] {line}", file=sys.stderr)

    def _wait_ready(self, children: list[Child], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for c in children:
            while not c.address:
                if c.proc.poll() is not None:
                    raise RuntimeError(f"{c.name} exited with {c.proc.returncode}:\n" + "\n".join(c.lines[-30:]))
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{c.name} not ready after {timeout:.0f}s:\n" + "\n".join(c.lines[-30:]))
                time.sleep(0.05)

    def start(self, timeout: float = 120.0) -> LocalCluster:
        cfg = checkpoint_config(self.checkpoint)
        mtp = "mtp" in self.speculative  # its experts on the expert workers
        plan = make_placement(cfg, self.n_expert, self.redundant, min_replicas=self.expert_replicas, mtp=mtp)
        self.plan_path.write_text(plan.to_json())
        common = ["--checkpoint", self.checkpoint, "--host", self.host]
        worker_tls, router_tls, exchange_tls = [], [], []
        if self.worker_tls_dir is not None:
            d = self.worker_tls_dir
            worker_tls = [
                "--tls-cert",
                str(d / "server.crt"),
                "--tls-key",
                str(d / "server.key"),
                "--tls-client-ca",
                str(d / "ca.crt"),
            ]
            # attention workers call the expert workers directly (the expert exchange): as clients, like the router
            exchange_tls = [
                "--expert-tls-ca",
                str(d / "ca.crt"),
                "--expert-tls-cert",
                str(d / "client.crt"),
                "--expert-tls-key",
                str(d / "client.key"),
            ]
            router_tls = [
                "--worker-tls-ca",
                str(d / "ca.crt"),
                "--worker-tls-cert",
                str(d / "client.crt"),
                "--worker-tls-key",
                str(d / "client.key"),
            ]
        if self.tls_dir is not None:
            d = self.tls_dir
            router_tls += ["--tls-cert", str(d / "server.crt"), "--tls-key", str(d / "server.key")]
        common_w = common + worker_tls + self.device_args
        if self.kv_store is not None:
            try:
                self._start_kv_store(timeout)
            except BaseException:
                self.stop()
                raise

        def attention_worker(i: int, name: str, pool: str) -> Child:
            return self._spawn(
                name,
                [
                    "worker",
                    "--role",
                    "attention",
                    *common_w,
                    *exchange_tls,
                    "--port",
                    str(free_port(self.host)),
                    "--name",
                    name,
                    "--pool",
                    pool,
                    "--kv-blocks",
                    str(self.kv_blocks),
                    "--block-size",
                    str(self.block_size),
                    *self._tier_args(i, name),
                    *self._decode_args(),
                    *(self._collective_args() if pool == "decode" else []),
                    *self.speculative,
                ],
            )

        attention = [
            attention_worker(i, f"attention-{i}", "decode" if self.n_prefill else "mixed")
            for i in range(self.n_attention)
        ]
        prefill = [attention_worker(self.n_attention + i, f"prefill-{i}", "prefill") for i in range(self.n_prefill)]
        experts = [
            self._spawn(
                f"expert-{i}",
                [
                    "worker",
                    "--role",
                    "expert",
                    *common_w,
                    "--port",
                    str(free_port(self.host)),
                    "--name",
                    f"expert-{i}",
                    "--plan",
                    str(self.plan_path),
                    "--ordinal",
                    str(i),
                    *self._decode_args(),
                    *self._collective_args(),
                ],
                self.worker_env.get(f"expert-{i}"),
            )
            for i in range(self.n_expert)
        ]
        try:
            self._wait_ready(attention + prefill + experts, timeout)
            self.router = self._spawn(
                "router",
                [
                    "router",
                    *common,
                    "--plan",
                    str(self.plan_path),
                    "--attention",
                    ",".join(c.address for c in attention),
                    *(["--prefill", ",".join(c.address for c in prefill)] if prefill else []),
                    "--experts",
                    ",".join(c.address for c in experts),
                    "--http-port",
                    str(self.http_port),
                    "--grpc-port",
                    str(self.grpc_port),
                    "--prefill-chunk",
                    str(self.prefill_chunk),
                    "--prefill-tokens",
                    str(self.prefill_tokens),
                    "--transport",
                    self.transport,
                    *router_tls,
                    *self.speculative,
                    *(["--kv-store", "mooncake"] if self.kv_store is not None else []),
                    *self.router_args,
                ],
            )
            self._wait_ready([self.router], timeout)
        except BaseException:
            self.stop()
            raise
        return self

    @property
    def workers(self) -> list[Child]:
        return [c for c in self.children if c is not self.router]

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM the router first (it stops taking requests and drains), then every worker at once."""
        waves = [[self.router] if self.router else [], [c for c in self.children if c is not self.router]]
        for wave in waves:
            for c in wave:
                if c.proc.poll() is None:
                    c.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + grace
            for c in wave:
                try:
                    c.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    c.proc.kill()
                    c.proc.wait()

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def http_url(self) -> str:
        scheme = "https" if self.tls_dir is not None else "http"
        return f"{scheme}://{self.host}:{self.http_port}"


def supervise(
    cluster: LocalCluster, stop: threading.Event, *, max_restarts: int = 5, window: float = 300.0, out=sys.stderr
) -> int:
    """Keep the deployment serving: a process that exits is started again on its port (backoff 1, 2, 4, ... s);
    more than `max_restarts` restarts of one process within `window` seconds gives up (returns 1)."""
    restarts: dict[str, list[float]] = {}
    while not stop.wait(0.5):
        for c in [c for c in cluster.children if c.proc.poll() is not None]:
            now = time.monotonic()
            recent = [t for t in restarts.get(c.name, []) if now - t < window]
            if len(recent) >= max_restarts:
                print(
                    f"{c.name} exited {len(recent) + 1} times within {window:g} s; shutting down:\n"
                    + "\n".join(c.lines[-20:]),
                    file=out,
                )
                return 1
            delay = 2.0 ** len(recent) / 2
            print(f"{c.name} exited ({c.proc.returncode}); restarting in {delay:g} s", file=out, flush=True)
            if stop.wait(delay):
                return 0
            try:
                cluster.restart(c.name)
            except Exception as e:  # failed to come up: counted, tried again on the next round
                print(f"{c.name}: restart failed: {e}", file=out, flush=True)
            restarts[c.name] = recent + [now]
    return 0
