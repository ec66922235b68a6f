"""The per-layer expert exchange, and prefill → decode hand-offs, over point-to-point pairs beside gRPC: a plain
TCP connection on CPU (`SocketPair`), torch.distributed with NCCL on CUDA (gloo on CPU on request).

Transport interface: an expert client has `run(layer, hidden, ids, weights, out_dtype)` → partial sums (what
worker/exchange.py calls, one call per expert worker per MoE layer). `RemoteExpert` (router/remote.py) does it over
gRPC; `CollectiveExpert` here does it over a pair and keeps the gRPC client beside it for control, health and
fallback. The deployment picks one (`--transport grpc|collective`); the rows, dtypes and the combine are the
exchange's own either way, so the tokens are bit-identical.

Backends (`backend_for`; the serving worker picks, `--collective-backend`): `tcp` on CPU — one TCP connection per
pair, a call's tensors sent in one sendmsg and received one by one, on the calling thread. A call over gRPC crosses
the channel's and the server's threads: ~0.5 ms a round trip on an idle loopback; decoding on a loaded 2-core
machine, 1.1 ms from the call to the expert handler and 0.65 ms back, per MoE layer. A socket round trip is
~0.03 ms idle. gloo (the earlier CPU backend, still selectable) hands every message to a device thread and back;
`nccl` on CUDA (tensors stay on the GPU).

Groups. One two-rank group per (attention worker, expert worker) pair, never one group over all ranks: a dead or
hung expert rank then breaks only the pairs it is in, and a pair is re-formed without touching the others. The
rendezvous store (a TCPStore) lives on each expert worker, at its own stable address (`--collective-port`, the same
host as its gRPC address): no central store whose loss would stop every pair from re-forming, and an expert worker
that comes back brings its store back with it. Forming a pair goes over gRPC (the control plane): the attention
worker calls `OpenCollective(group_id)` on the expert worker (mutual TLS: the random group id is the pair's
secret key prefix in the store), which starts rank 1 of the group and answers the store port and backend; the
attention worker connects as rank 0. Only then does the pair carry tensors.

One call = header, tensors, answer. The attention worker posts, without waiting in between: header int64[8]
(op, layer, n, K, H, hidden dtype, output dtype, answer rows R), hidden [n, H] in the activation dtype, ids
[n, K] int64, weights [n, K] fp32; then it receives the answer header int64[2] (status, message length) and the
output [R, H] (always sent, zeros on an error) and, on an error, the message bytes. Sizes go first, so the
variable-size exchange needs only point-to-point send/recv, which every backend supports.

Hand-offs (prefill → decode, worker/attention.py's hand_off) take the same road between two attention workers: the
decode worker serves a store (`--collective-port`), the prefill worker forms a pair with it (`OpenCollective` on the
AttentionWorker service) and `CollectiveAttention.import_sequence` sends header int64[8] (OP_IMPORT, the length of
the ImportSequenceRequest header, the cache's length), the header's bytes and the cache's bytes (a kv_snapshot
file, checksummed); the answer is int64[2] (status, message length), int64[1] (the receiver's free blocks) and, on
an error, the message. A pair that fails (or is not formed yet) sends the hand-off over gRPC instead (the
ImportSequence stream): the transport never decides whether a hand-off happens.

Faults. Every wait on the sending side has the call deadline. A failed or timed-out collective call drops the
pair (aborted, never waited on again) and raises WorkerUnavailable: the exchange marks the expert worker down and
redoes the layer's lost groups over gRPC on the replicas (same bits). While a pair is not formed, calls go over
gRPC. The pair is formed again in the background after the expert worker answers its gRPC health check (the
exchange's probe), at most once per `retry_interval`. The expert side waits for the next call without a deadline
(an idle pair is not an error); it learns that a pair is gone when the attention side closes its sockets.
Gloo runs its waits in C++; they all have timeouts here, abandoned groups are only aborted (their threads are
daemons) and the worker process leaves with os._exit after its gRPC shutdown, so a stuck group never holds it.
Security: the pairs' data connections are not encrypted (gloo / NCCL have no authentication either; a `tcp`
pair's first bytes are a random key set in the store by rank 0, which rank 1 checks before serving it); keep
them on a trusted network — the operator's NetworkPolicy admits them only between the deployment's own pods.
"""

from __future__ import annotations

import datetime
import logging
import socket
import threading
import time
import uuid

import torch

from expertmesh.wire.worker_api import (
    ExpertRequestError,
    NotFound,
    OutOfBlocks,
    RemoteError,
    UnknownExpert,
    WorkerError,
    WorkerUnavailable,
)

log = logging.getLogger("expertmesh.worker")

OP_RUN, OP_PING, OP_IMPORT = 1, 2, 3
STATUS_OK, STATUS_INVALID, STATUS_NOT_FOUND, STATUS_ERROR, STATUS_NO_ROOM = 0, 1, 2, 3, 4
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
RENDEZVOUS_TIMEOUT_S = 20.0
IDLE = datetime.timedelta(days=365)  # an expert rank waits this long for the next call (an idle pair is fine)


BACKENDS = ("auto", "tcp", "gloo", "nccl")


def backend_for(device: str, requested: str = "auto") -> str:
    """The pair backend a worker on `device` serves: `requested`, or for "auto" nccl on cuda, tcp elsewhere."""
    if requested not in BACKENDS:
        raise ValueError(f"collective backend: expected one of {', '.join(BACKENDS)}, found {requested!r}")
    if requested != "auto":
        return requested
    return "nccl" if device == "cuda" else "tcp"


def local_address_towards(host: str) -> str:
    """The local IP address this machine uses to reach `host` (what the peer can connect back to)."""
    try:
        infos = socket.getaddrinfo(host, 1, type=socket.SOCK_DGRAM)
    except OSError:
        return socket.gethostbyname(socket.gethostname())
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(addr)  # UDP: nothing is sent, the kernel only picks the route
        return s.getsockname()[0]


def new_group(backend: str, store, group_id: str, rank: int, address: str, timeout: float):
    """One two-rank process group (rank 0: attention worker, rank 1: expert worker) through `store` under the
    prefix `group_id`, its sockets on `address`; every operation defaults to `timeout` seconds."""
    import torch.distributed as dist

    prefixed = dist.PrefixStore(f"expertmesh/{group_id}/", store)
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = datetime.timedelta(seconds=timeout)
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
        return dist.ProcessGroupGloo(prefixed, rank, 2, opts)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = datetime.timedelta(seconds=timeout)
        return dist.ProcessGroupNCCL(prefixed, rank, 2, opts)
    if backend == "tcp":
        return SocketPair.rendezvous(prefixed, rank, address, timeout)
    raise ValueError(f"backend: expected tcp, gloo or nccl, found {backend!r}")


class _Op:
    """One posted send or receive of a SocketPair, carried out by `wait` (posted ops wait in order on both
    sides here, so each runs when its turn comes)."""

    def __init__(self, run):
        self._run = run

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        self._run(None if timeout is None or timeout >= IDLE else timeout.total_seconds())
        return True


class SocketPair:
    """A two-rank pair over one TCP connection, with the part of a torch.distributed process group's interface
    the pairs here use: send / recv of whole CPU tensors to / from the other rank (each a `_Op` whose
    wait(timeout) moves the bytes) and abort. For the exchange's point-to-point calls between two processes it
    is a plain stream: one system call per tensor received and per group of tensors sent, no device thread or
    completion hand-off in between (gloo's), which on a loaded machine cost more than the bytes. Rendezvous
    through the pair's store (its keys under the random group id given over mutual-TLS gRPC): rank 1 listens on
    `address` and publishes host:port, rank 0 sets a random key in the store, connects and sends it first; rank 1
    checks it before it serves the connection."""

    def __init__(self, sock: socket.socket):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock

    @classmethod
    def rendezvous(cls, store, rank: int, address: str, timeout: float) -> SocketPair:
        if rank == 1:
            family = socket.AF_INET6 if ":" in address else socket.AF_INET
            with socket.create_server((address, 0), family=family, backlog=1) as listener:
                listener.settimeout(timeout)
                host, port = listener.getsockname()[:2]
                store.set("address", f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
                secret = store.get("secret")
                conn, _ = listener.accept()
            conn.settimeout(timeout)
            got = _recv_exact(conn, len(secret))
            if got != secret:
                conn.close()
                raise ConnectionError("a connection without the pair's key")
            return cls(conn)
        secret = uuid.uuid4().hex.encode()
        store.set("secret", secret)
        host, port = store.get("address").decode().rsplit(":", 1)
        conn = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout)
        conn.sendall(secret)
        return cls(conn)

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> _Op:
        data = _bytes_of(tensors[0])

        def run(timeout):
            self.sock.settimeout(timeout)
            self.sock.sendall(data)

        return _Op(run)

    def send_all(self, tensors: list[torch.Tensor], timeout: float | None) -> None:
        """Send several tensors back to back in one system call where the socket takes them (sendmsg of their
        buffers, the rest after a partial send; the receiver reads them one by one as usual): a call's header and
        inputs reach the peer together. (Inside `up`'s decode steps the exchange's start, sends included, took
        0.67 ms a layer before and 0.69 after: the cost is the loopback delivery and the peer's wake-up, not the
        number of system calls.)"""
        views = [v for v in (_bytes_of(t) for t in tensors) if len(v)]
        self.sock.settimeout(timeout)
        while views:
            sent = self.sock.sendmsg(views)
            while views and sent >= len(views[0]):
                sent -= len(views[0])
                views.pop(0)
            if views and sent:
                views[0] = views[0][sent:]

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> _Op:
        into = _bytes_of(tensors[0])

        def run(timeout):
            self.sock.settimeout(timeout)
            _recv_into(self.sock, into)

        return _Op(run)

    def abort(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def _bytes_of(t: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's bytes, as a writable view of its storage."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(
            f"a socket pair moves contiguous CPU tensors, found {t.device} "
            f"{'contiguous' if t.is_contiguous() else 'strided'}"
        )
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B") if t.numel() else memoryview(b"")


def _recv_into(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("the other side closed the pair")
        got += n


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    _recv_into(sock, memoryview(buf))
    return bytes(buf)


def _send_all(group, tensors: list[torch.Tensor], dst: int, dev, deadline: datetime.timedelta) -> None:
    """Send `tensors` to rank `dst` in order: one system call on a SocketPair, one send each otherwise."""
    if isinstance(group, SocketPair):
        group.send_all(tensors, deadline.total_seconds())
        return
    for w in [group.send([t.to(dev)], dst, 0) for t in tensors]:
        w.wait(deadline)


def _abandon(group) -> None:
    """Abort a group whose peer failed: no wait on it again; its sockets close, so the peer's waits end."""
    try:
        group.abort()
    except Exception as e:  # already broken: nothing more to release
        log.debug("abort: %s", e)


def _device_of(backend: str) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


# ---------------------------------------------------------------------------------------------- expert side
class CollectiveServer:
    """A worker's side: the rendezvous store on `port` and one serving thread per open pair. `expert` (an
    ExpertWorker) serves the expert exchange's calls, `attention` (an AttentionWorker) hand-offs sent to it;
    `import_cache(header, cache)` → free blocks: how a hand-off's bytes become a sequence (worker/server.py)."""

    def __init__(self, host: str, port: int, backend: str = "gloo", *, expert=None, attention=None, import_cache=None):
        import torch.distributed as dist

        self.expert, self.attention, self.import_cache, self.backend = expert, attention, import_cache, backend
        try:
            # bound here, on --host only (TCPStore alone listens on every interface), and handed to the store
            self.sock = socket.create_server(
                (host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET, backlog=128
            )
            self.store = dist.TCPStore(
                host,
                self.sock.getsockname()[1],
                None,
                True,
                datetime.timedelta(seconds=RENDEZVOUS_TIMEOUT_S),
                wait_for_workers=False,
                master_listen_fd=self.sock.fileno(),
            )
        except Exception as e:  # taken port: one clear line, like the gRPC port
            raise OSError(f"--collective-port {port}: cannot listen ({e})") from None
        self.port = self.store.port
        self.pairs = 0  # pairs being served now
        self.calls = 0  # RunExperts calls received over pairs
        self.imports = 0  # hand-offs received over pairs

    def open(self, group_id: str, peer_host: str, timeout: float) -> None:
        """Start rank 1 of `group_id` (returns at once; the caller joins as rank 0 within `timeout`)."""
        if not group_id or len(group_id) > 64 or not group_id.replace("-", "").isalnum():
            raise ValueError(f"group_id: expected up to 64 letters, digits or '-', found {group_id!r}")
        threading.Thread(
            target=self._serve,
            args=(group_id, local_address_towards(peer_host), timeout),
            name=f"collective-{group_id[:8]}",
            daemon=True,
        ).start()

    def _serve(self, group_id: str, address: str, timeout: float) -> None:
        try:
            group = new_group(self.backend, self.store, group_id, 1, address, timeout)
        except Exception as e:
            log.warning("collective pair %s: rendezvous failed: %s", group_id[:8], e)
            return
        self.pairs += 1
        dev = _device_of(self.backend)
        op_timeout = datetime.timedelta(seconds=timeout)
        try:
            while True:
                head = torch.zeros(8, dtype=torch.int64, device=dev)
                group.recv([head], 0, 0).wait(IDLE)  # the next call, however long that takes
                op = int(head[0])
                if op == OP_PING:
                    group.send([torch.zeros(2, dtype=torch.int64, device=dev)], 0, 0).wait(op_timeout)
                    continue
                serve = {OP_RUN: self._run, OP_IMPORT: self._import}.get(op)
                if serve is None:
                    raise RuntimeError(f"unknown op {op}")
                status, message, out = serve(group, head.tolist(), dev, op_timeout)
                answer = [torch.tensor([status, len(message)], dtype=torch.int64), out.contiguous()]
                if message:
                    answer.append(torch.frombuffer(bytearray(message), dtype=torch.uint8))
                _send_all(group, answer, 0, dev, op_timeout)
        except Exception as e:  # the other side closed the pair (dropped, restarted, shut down)
            log.info("collective pair %s closed: %s", group_id[:8], str(e).splitlines()[0][:200])
        finally:
            self.pairs -= 1
            _abandon(group)

    @staticmethod
    def _failure(e: Exception) -> tuple[int, bytes]:
        status = (
            STATUS_NOT_FOUND
            if isinstance(e, (UnknownExpert, NotFound))
            else STATUS_NO_ROOM
            if isinstance(e, OutOfBlocks)
            else STATUS_INVALID
            if isinstance(e, (ExpertRequestError, WorkerError, ValueError))
            else STATUS_ERROR
        )
        if status == STATUS_ERROR:
            log.exception("collective call failed")
        return status, (str(e) if status != STATUS_ERROR else f"{type(e).__name__}: {e}").encode()[:65536]

    def _run(self, group, head: list[int], dev, op_timeout):
        """OP_RUN: one expert exchange call → (status, message, output [R, H])."""
        _, layer, n, k, h, in_dt, out_dt, rows = head
        hidden = torch.empty(n, h, dtype=DTYPES[in_dt], device=dev)
        ids = torch.empty(n, k, dtype=torch.int64, device=dev)
        weights = torch.empty(n, k, dtype=torch.float32, device=dev)
        for w in [group.recv([t], 0, 0) for t in (hidden, ids, weights)]:
            w.wait(op_timeout)
        self.calls += 1  # before the answer goes: whoever has it sees the call counted
        try:
            if self.expert is None:
                raise ExpertRequestError("this worker holds no experts (an attention worker)")
            out = self.expert.run(layer, hidden.cpu(), ids.cpu(), weights.cpu(), DTYPES[out_dt])
            if out.shape != (rows, h):
                raise RuntimeError(f"{rows} answer rows expected, computed {list(out.shape)}")
            return STATUS_OK, b"", out
        except Exception as e:
            return (*self._failure(e), torch.zeros(rows, h, dtype=DTYPES[out_dt]))

    def _import(self, group, head: list[int], dev, op_timeout):
        """OP_IMPORT: one hand-off → (status, message, the free blocks after as int64 [1])."""
        _, header_len, cache_len = head[:3]
        header = torch.empty(header_len, dtype=torch.uint8, device=dev)
        cache = torch.empty(cache_len, dtype=torch.uint8, device=dev)
        for w in [group.recv([header], 0, 0), group.recv([cache], 0, 0)]:
            w.wait(op_timeout)
        self.imports += 1
        try:
            if self.import_cache is None:
                raise WorkerError("this worker takes no hand-offs (an expert worker)")
            free = self.import_cache(header.cpu().numpy().tobytes(), cache.cpu().numpy().tobytes())
            return STATUS_OK, b"", torch.tensor([free], dtype=torch.int64)
        except Exception as e:
            return (*self._failure(e), torch.zeros(1, dtype=torch.int64))


# ---------------------------------------------------------------------------------------------- attention side
class _PairClient:
    """The calling side of a torch.distributed pair with a worker, beside its gRPC client (`remote`: control,
    health, fallback): formed in the background, dropped on a failure, formed again once the worker answers."""

    def __init__(self, remote, *, retry_interval: float = 1.0):
        self.remote = remote
        self.address, self.timeout, self.name = remote.address, remote.timeout, remote.name
        self.retry_interval = retry_interval
        self.group = None
        self.backend = "gloo"
        self.lock = threading.Lock()  # one call on the pair at a time (the wire is a FIFO)
        self.forming = False
        self.last_attempt = 0.0
        self.closed = False
        self.collective_calls = self.grpc_calls = 0
        self.form()

    # -- control
    def form(self) -> None:
        """Form the pair in the background (no-op while one is formed, being formed, or tried recently)."""
        with self.lock:
            if (
                self.closed
                or self.group is not None
                or self.forming
                or time.monotonic() - self.last_attempt < self.retry_interval
            ):
                return
            self.forming, self.last_attempt = True, time.monotonic()
        threading.Thread(target=self._form, name=f"form-{self.name}", daemon=True).start()

    def _form(self) -> None:
        import torch.distributed as dist

        group = None
        try:
            group_id = uuid.uuid4().hex
            timeout = min(self.timeout, RENDEZVOUS_TIMEOUT_S)
            port, backend = self.remote.open_collective(group_id, timeout)
            host = self.address.rsplit(":", 1)[0].strip("[]")
            store = dist.TCPStore(host, port, None, False, datetime.timedelta(seconds=timeout))
            group = new_group(backend, store, group_id, 0, local_address_towards(host), self.timeout)
            dev = _device_of(backend)
            ping = torch.zeros(8, dtype=torch.int64, device=dev)
            ping[0] = OP_PING
            answer = torch.zeros(2, dtype=torch.int64, device=dev)
            deadline = datetime.timedelta(seconds=self.timeout)
            for w in (group.send([ping], 1, 0), group.recv([answer], 1, 0)):
                w.wait(deadline)
        except Exception as e:
            log.warning("%s: collective pair not formed (gRPC meanwhile): %s", self.name, str(e).splitlines()[0])
            if group is not None:
                _abandon(group)
            with self.lock:
                self.forming = False
            return
        with self.lock:
            self.forming = False
            if self.closed:
                _abandon(group)
                return
            self.group, self.backend = group, backend
        log.info("%s: collective pair formed (%s)", self.name, backend)

    def drop(self, reason, level: int = logging.WARNING) -> None:
        with self.lock:
            group, self.group = self.group, None
        if group is not None:
            log.log(level, "%s: collective pair dropped: %s", self.name, str(reason).splitlines()[0][:300])
            _abandon(group)

    def _drop_locked(self, group, reason) -> None:
        """`drop` from a holder of the lock, if `group` is still the pair."""
        if self.group is group:
            self.group = None
            log.warning("%s: collective pair dropped: %s", self.name, str(reason).splitlines()[0][:300])
            _abandon(group)

    def health(self, service: str = "", timeout: float | None = None) -> str:
        status = self.remote.health(service, timeout)
        if status == "SERVING":
            self.form()  # taken back: the pair is formed again
        return status

    def info(self) -> dict:
        return self.remote.info()

    def close(self) -> None:
        self.closed = True
        self.drop("closed", logging.DEBUG)
        self.remote.close()

    @property
    def formed(self) -> bool:
        return self.group is not None

    def _over_pair(self, group, call):
        """Run `call(group)` → (result, status, message) holding the pair; a broken or timed-out pair (peer dead,
        hung, restarted) is dropped and raises WorkerUnavailable."""
        try:
            with self.lock:
                if self.group is not group:
                    raise RuntimeError("the pair was dropped meanwhile")
                return call(group)
        except Exception as e:  # gloo / NCCL / socket
            self.drop(e)
            raise self._unavailable(e) from None

    def _unavailable(self, e: Exception) -> WorkerUnavailable:
        """What a failed call on the pair raises (the pair is dropped by then)."""
        return WorkerUnavailable(
            f"{self.name} ({self.address}): collective call failed: {str(e).splitlines()[0][:300]}"
        )

    def _answer(self, group, dev, out: torch.Tensor, deadline) -> tuple[int, str]:
        """Receive an answer's status and `out` (filled), and the message on an error."""
        answer = torch.zeros(2, dtype=torch.int64, device=dev)
        for w in (group.recv([answer], 1, 0), group.recv([out], 1, 0)):
            w.wait(deadline)
        status, length = answer.tolist()
        message = ""
        if status != STATUS_OK:
            buf = torch.empty(length, dtype=torch.uint8, device=dev)
            group.recv([buf], 1, 0).wait(deadline)
            message = bytes(buf.cpu().tolist()).decode(errors="replace")
        return status, message


class Posted:
    """A call sent over a pair whose answer is still on the wire: `result()` receives it on the calling thread
    (once; later calls return the same or raise the same), → [R, H] as `CollectiveExpert.run`."""

    def __init__(self, client: CollectiveExpert, group, out: torch.Tensor):
        self.client, self.group, self.out = client, group, out
        self._value = self._error = None
        self.done = False

    def result(self) -> torch.Tensor:
        with self.client.lock:
            if not self.done:
                self._receive()
        if self._error is not None:
            raise self._error
        return self._value

    def _receive(self) -> None:  # under the client's lock
        self.done = True
        if self.client._posted is self:
            self.client._posted = None
        try:
            if self.client.group is not self.group:
                raise RuntimeError("the pair was dropped meanwhile")
            deadline = datetime.timedelta(seconds=self.client.timeout)
            status, message = self.client._answer(self.group, self.out.device, self.out, deadline)
        except Exception as e:  # gloo / NCCL / socket: as _over_pair
            self.client._drop_locked(self.group, e)
            self._error = self.client._unavailable(e)
            return
        self.client.collective_calls += 1
        if status != STATUS_OK:
            self._error = self.client._error_of(status, message)
        else:
            self._value = self.out.cpu()


class CollectiveExpert(_PairClient):
    """An expert worker reached over a pair, with its gRPC client (`remote`, a RemoteExpert) for control, health
    and fallback. Same `run` contract as RemoteExpert; `post` splits a call in two (send now, receive later)."""

    _posted: Posted | None = None  # a call sent whose answer is not received yet (the wire is a FIFO)

    def post(
        self,
        layer: int,
        hidden: torch.Tensor,
        expert_ids: torch.Tensor,
        weights: torch.Tensor,
        out_dtype: torch.dtype,
        rows: int,
    ) -> Posted | None:
        """Send the call of `run` over the pair now, on this thread, and return its `Posted` — whose result() then
        receives the answer, on that caller's thread: no thread in between, and the caller computes meanwhile
        (the exchange's shared experts). None while no pair is formed (call `run`: gRPC). A send that fails drops
        the pair and raises WorkerUnavailable. An earlier call's answer not yet received is received first."""
        group = self.group
        if group is None:
            self.form()
            return None
        dev = _device_of(self.backend)
        with self.lock:
            if self._posted is not None:
                self._posted._receive()
            try:
                if self.group is not group:
                    raise RuntimeError("the pair was dropped meanwhile")
                out = self._send_call(group, dev, layer, hidden, expert_ids, weights, out_dtype, rows)
            except Exception as e:
                self._drop_locked(group, e)
                raise self._unavailable(e) from None
            self._posted = Posted(self, group, out)
            return self._posted

    # -- data
    def run_grpc(self, layer, hidden, expert_ids, weights, out_dtype=torch.float32) -> torch.Tensor:
        self.grpc_calls += 1
        return self.remote.run(layer, hidden, expert_ids, weights, out_dtype)

    def run(
        self,
        layer: int,
        hidden: torch.Tensor,
        expert_ids: torch.Tensor,
        weights: torch.Tensor,
        out_dtype: torch.dtype = torch.float32,
        rows: int | None = None,
    ) -> torch.Tensor:
        """→ [R, H] per-(row, group) partial sums, as RemoteExpert.run. `rows`: R, when the caller knows it (the
        exchange does); without it, or while the pair is not formed, the call goes over gRPC."""
        group = self.group
        if group is None or rows is None:
            self.form()
            return self.run_grpc(layer, hidden, expert_ids, weights, out_dtype)
        out, status, message = self._over_pair(
            group, lambda g: self._exchange(g, layer, hidden, expert_ids, weights, out_dtype, rows)
        )
        self.collective_calls += 1
        if status != STATUS_OK:
            raise self._error_of(status, message)
        return out

    def _error_of(self, status: int, message: str) -> Exception:
        """The exception an error answer stands for (the types gRPC's status codes map to)."""
        cls = {STATUS_INVALID: ExpertRequestError, STATUS_NOT_FOUND: UnknownExpert}.get(status)
        return cls(message) if cls else RemoteError(f"{self.name} ({self.address}): {message}")

    def _exchange(self, group, layer, hidden, ids, weights, out_dtype, rows):
        dev = _device_of(self.backend)
        if self._posted is not None:
            self._posted._receive()
        out = self._send_call(group, dev, layer, hidden, ids, weights, out_dtype, rows)
        status, message = self._answer(group, dev, out, datetime.timedelta(seconds=self.timeout))
        return out.cpu(), status, message

    def _send_call(self, group, dev, layer, hidden, ids, weights, out_dtype, rows) -> torch.Tensor:
        """Send one OP_RUN call → the (empty) tensor its answer goes into."""
        n, h = hidden.shape
        head = torch.tensor(
            [OP_RUN, layer, n, ids.shape[1], h, DTYPES.index(hidden.dtype), DTYPES.index(out_dtype), rows],
            dtype=torch.int64,
        )
        sends = [head, hidden.contiguous(), ids.long().contiguous(), weights.float().contiguous()]
        _send_all(group, sends, 1, dev, datetime.timedelta(seconds=self.timeout))
        return torch.empty(rows, h, dtype=out_dtype, device=dev)


class CollectiveAttention(_PairClient):
    """An attention worker that takes hand-offs, reached over a torch.distributed pair beside its gRPC client
    (`remote`, a RemoteAttention): `import_sequence` as RemoteAttention's, over the pair when it is formed, else —
    or when the pair fails — over gRPC."""

    def import_sequence(
        self,
        seq_id: str,
        params,
        snap,
        sampler_state: bytes,
        observed: list[int],
        *,
        reserve_tokens: int,
        owner: str = "",
        identity: str = "",
    ) -> int:
        group = self.group
        if group is not None:
            from expertmesh.wire.kv_snapshot import encode

            cache = encode(seq_id, identity, snap)
            header = self.remote.import_header(
                seq_id, params, len(cache), sampler_state, observed, reserve_tokens=reserve_tokens, owner=owner
            )
            try:
                free, status, message = self._over_pair(group, lambda g: self._send(g, header, cache))
            except WorkerUnavailable as e:
                log.warning("%s: hand-off over gRPC instead: %s", self.name, e)
            else:
                self.collective_calls += 1
                if status == STATUS_OK:
                    return free
                cls = {STATUS_INVALID: WorkerError, STATUS_NOT_FOUND: NotFound, STATUS_NO_ROOM: OutOfBlocks}.get(status)
                raise cls(message) if cls else RemoteError(f"{self.name} ({self.address}): {message}")
        else:
            self.form()
        self.grpc_calls += 1
        return self.remote.import_sequence(
            seq_id, params, snap, sampler_state, observed, reserve_tokens=reserve_tokens, owner=owner, identity=identity
        )

    def _send(self, group, header, cache: bytes):
        dev = _device_of(self.backend)
        raw = header.SerializeToString()
        head = torch.tensor([OP_IMPORT, len(raw), len(cache), 0, 0, 0, 0, 0], dtype=torch.int64)
        sends = [
            head,
            torch.frombuffer(bytearray(raw), dtype=torch.uint8),
            torch.frombuffer(bytearray(cache), dtype=torch.uint8),
        ]
        free = torch.zeros(1, dtype=torch.int64, device=dev)
        deadline = datetime.timedelta(seconds=self.timeout)
        _send_all(group, sends, 1, dev, deadline)
        status, message = self._answer(group, dev, free, deadline)
        return int(free[0]), status, message
