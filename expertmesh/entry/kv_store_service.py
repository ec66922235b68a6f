"""The cluster KV store's processes for `expertmesh up --kv-store mooncake` and the tests: Mooncake's master
(`mooncake_master`, with its HTTP metadata server) and the store process that holds the objects' memory
(`mooncake_client` with a global segment), both from the `mooncake-transfer-engine-non-cuda` wheel, on loopback.

The attention workers are the store's clients and contribute no memory (worker/kv_store.py): the store process
holds it, so a worker that dies loses nothing it put. The master keeps only metadata and no snapshot: restarted,
it starts empty — the workers reconnect by themselves and fall back to their local tiers meanwhile."""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

KV_STORES = ("mooncake",)


def mooncake_binary(name: str) -> str:
    """The path of a binary the Mooncake wheel ships (mooncake_master, mooncake_client); RuntimeError naming
    --kv-store when the wheel is not installed."""
    try:
        import mooncake
    except ImportError as e:
        raise RuntimeError(
            f"--kv-store mooncake: the Mooncake wheel is not installed (pip install "
            f"'mooncake-transfer-engine-non-cuda'; it needs Debian's libibverbs1): {e}"
        ) from None
    path = Path(mooncake.__file__).parent / name
    if not path.exists():
        found = shutil.which(name)
        if found is None:
            raise RuntimeError(f"--kv-store mooncake: {name} is not in the Mooncake wheel ({path})")
        return found
    return str(path)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listening(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex((host if host != "0.0.0.0" else "127.0.0.1", port)) == 0


class KVStoreService:
    """mooncake_master + the store process on loopback. `store_bytes`: the store's memory (its global segment);
    `log_dir`: where their output goes (None: discarded); ports: free ones unless given."""

    def __init__(
        self,
        store_bytes: int = 256 << 20,
        log_dir: str | Path | None = None,
        host: str = "127.0.0.1",
        ports: tuple[int, int, int, int] | None = None,
    ):
        self.host, self.store_bytes = host, store_bytes
        self.rpc_port, self.metadata_port, self.metrics_port, self.store_port = ports or tuple(
            _free_port() for _ in range(4)
        )
        self.log_dir = Path(log_dir) if log_dir is not None else None
        self.master: subprocess.Popen | None = None
        self.store: subprocess.Popen | None = None

    @property
    def master_address(self) -> str:
        return f"{self.host}:{self.rpc_port}"

    @property
    def metadata_url(self) -> str:
        return f"http://{self.host}:{self.metadata_port}/metadata"

    def master_command(self) -> list[str]:
        return [
            mooncake_binary("mooncake_master"),
            f"--rpc_port={self.rpc_port}",
            f"--rpc_address={self.host}",
            "--enable_http_metadata_server=true",
            f"--http_metadata_server_host={self.host}",
            f"--http_metadata_server_port={self.metadata_port}",
            f"--metrics_port={self.metrics_port}",
            "--default_kv_lease_ttl=100",  # ms: a got object can be removed (refused ones) or evicted soon after
        ]

    def store_command(self) -> list[str]:
        return [
            mooncake_binary("mooncake_client"),
            f"--global_segment_size={self.store_bytes}",
            f"--master_server_address={self.master_address}",
            f"--metadata_server={self.metadata_url}",
            f"--host={self.host}",
            f"--port={self.store_port}",
            "--protocol=tcp",
        ]

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        out = open(self.log_dir / f"{name}.log", "ab") if self.log_dir is not None else subprocess.DEVNULL
        try:
            return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ))
        finally:
            if out is not subprocess.DEVNULL:
                out.close()

    def start_master(self, timeout: float = 30.0) -> None:
        self.master = self._spawn("mooncake-master", self.master_command())
        self._wait(self.master, (self.rpc_port, self.metadata_port), "mooncake_master", timeout)

    def start(self, timeout: float = 30.0) -> KVStoreService:
        """Start the master, then the store process; RuntimeError when either exits or does not listen."""
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
        self.start_master(timeout)
        self.store = self._spawn("mooncake-store", self.store_command())
        self._wait(self.store, (self.store_port,), "the store process (mooncake_client)", timeout)
        return self

    def _wait(self, proc: subprocess.Popen, ports: tuple[int, ...], what: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not all(_listening(p, self.host) for p in ports):  # on a pod: its IP, which the master binds
            if proc.poll() is not None:
                raise RuntimeError(f"--kv-store mooncake: {what} exited with code {proc.returncode}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"--kv-store mooncake: {what} did not listen within {timeout:g} s")
            time.sleep(0.1)

    def kill_master(self) -> None:
        """SIGKILL the master (a fault): the store process and the workers lose it until `start_master`."""
        if self.master is not None:
            self.master.kill()
            self.master.wait()

    def stop(self) -> None:
        for proc in (self.store, self.master):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()

    def __enter__(self) -> KVStoreService:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _die_with_parent() -> None:
    """In the binary's process before exec: SIGKILL it when this wrapper dies (a SIGKILLed wrapper — a fault test,
    `up` killed — leaves no master serving behind the launcher's back)."""
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def main(argv: list[str] | None = None) -> int:
    """`python -m expertmesh.entry.kv_store_service master|store --ports R,M,X,S [--store-bytes N]`: one of the
    store's processes as a child of `expertmesh up` (expertmesh/entry/cluster.py): started, READY printed once it
    listens, stopped with SIGTERM, gone with its parent — so `up` supervises and restarts it like the workers."""
    from expertmesh.runtime.shutdown import die_with_parent

    die_with_parent()
    p = argparse.ArgumentParser(prog="expertmesh kv-store")
    p.add_argument("role", choices=("master", "store"))
    p.add_argument("--ports", required=True, help="rpc,metadata,metrics,store ports")
    p.add_argument("--store-bytes", type=int, default=256 << 20)
    p.add_argument("--host", default="127.0.0.1")
    args = p.parse_args(argv)
    ports = tuple(int(x) for x in args.ports.split(","))
    service = KVStoreService(args.store_bytes, host=args.host, ports=ports)  # type: ignore[arg-type]
    argv_ = service.master_command() if args.role == "master" else service.store_command()
    proc = subprocess.Popen(argv_, stdout=sys.stdout, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
    signal.signal(signal.SIGTERM, lambda *_: proc.terminate())
    try:
        listen = (service.rpc_port, service.metadata_port) if args.role == "master" else (service.store_port,)
        service._wait(proc, listen, argv_[0], 60.0)
    except RuntimeError as e:
        print(f"expertmesh kv-store: error: {e}", file=sys.stderr, flush=True)
        proc.kill()
        return 2
    print(f"READY kv-store-{args.role} {args.host}:{listen[0]}", flush=True)
    return proc.wait()


if __name__ == "__main__":
    sys.exit(main())
