"""`expertmesh up --transport collective`: the per-layer expert exchange over point-to-point pairs (TCP on CPU),
real processes on loopback. Token-exact against the in-process reference model, as over gRPC (tests/entry/test_up.py),
and real faults on an expert rank (SIGKILL, SIGSTOP) with two replicas of every expert: same tokens, no hang,
the pair re-formed once the worker is back."""

import signal
import time

import httpx
import pytest
from support.expert_calls import SUBSET, expert_call, same
from support.router_client import PROMPTS, run_with_fault, stream

from expertmesh.chat.tokenizer import ByteTokenizer
from expertmesh.checkpoint.loader import Checkpoint
from expertmesh.entry.cluster import LocalCluster, free_port
from expertmesh.model.transformer import generate
from expertmesh.wire.clients import RemoteExpert
from expertmesh.wire.sampling_params import SamplingParams

pytestmark = pytest.mark.slow
EOS = ByteTokenizer().eos_id
MAX_TOKENS = 40  # test_faults' streams


@pytest.fixture(scope="module")
def ckpt_dir(tiny_checkpoint_dir):
    return tiny_checkpoint_dir  # the session's shared tiny checkpoint (tests/conftest.py)


@pytest.mark.parametrize("backend", ["tcp", "gloo"])
def test_a_pair_gives_the_grpc_bits_and_errors_in_process(ckpt_dir, backend):
    """One expert server with a collective port and its two clients in this process: over the pair (either CPU
    backend), RunExperts gives exactly gRPC's bytes on fresh random calls (fp32 and bf16), errors keep their type
    and the pair; an expert worker without --collective-port keeps being called over gRPC."""
    import torch

    from expertmesh.kernels.moe.combine import present_groups
    from expertmesh.wire.worker_api import ExpertRequestError, UnknownExpert
    from expertmesh.worker.collective import CollectiveExpert
    from expertmesh.worker.server import serve, shutdown

    cfg = Checkpoint(ckpt_dir).cfg
    groups = cfg.moe.combine_groups
    server = serve(
        "expert", ckpt_dir, 0, assignment=SUBSET, name="shard", collective_port=0, collective_backend=backend
    )
    plain = serve("expert", ckpt_dir, 0, assignment=SUBSET, name="plain")
    grpc_only = RemoteExpert(f"127.0.0.1:{server.port}", timeout=5)
    pair = CollectiveExpert(RemoteExpert(f"127.0.0.1:{server.port}", timeout=5))
    fallback = CollectiveExpert(RemoteExpert(f"127.0.0.1:{plain.port}", timeout=5))
    try:
        import subprocess

        listening = subprocess.run(
            ["ss", "-tlnH", f"sport = :{server.collective.port}"], capture_output=True, text=True
        ).stdout.split()
        assert f"127.0.0.1:{server.collective.port}" in listening  # the store: on --host only, as gRPC
        assert wait_until(lambda: pair.formed, 20) and pair.backend == backend
        for seed, (dtype, out_dtype) in enumerate(
            [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)]
        ):
            hidden, ids, w = expert_call(cfg, 9 + seed, 3, seed, held=[e for l, e in SUBSET if l == 1])
            hidden = hidden.to(dtype)
            rows = int(present_groups(ids, cfg.moe.n_routed_experts // groups, groups).sum())
            want = grpc_only.run(1, hidden, ids, w, out_dtype)
            same(pair.run(1, hidden, ids, w, out_dtype, rows=rows), want)
            same(fallback.run(1, hidden, ids, w, out_dtype, rows=rows), want)
        assert pair.collective_calls == 3 and pair.grpc_calls == 0 and not fallback.formed
        assert fallback.grpc_calls == 3
        # split calls (the exchange's): sent now, received later on the caller's thread; a second call posted
        # before the first answer was read receives that answer first, so both keep theirs
        calls = [expert_call(cfg, 5 + i, 3, 10 + i, held=[e for l, e in SUBSET if l == 1]) for i in range(2)]
        wants = [grpc_only.run(1, h, i, w, torch.float32) for h, i, w in calls]
        posted = [pair.post(1, h, i, w, torch.float32, rows=want.shape[0]) for (h, i, w), want in zip(calls, wants)]
        for p, want in zip(reversed(posted), reversed(wants)):
            same(p.result(), want)
        same(posted[0].result(), wants[0])  # read once, kept
        assert fallback.post(1, *calls[0], torch.float32, rows=wants[0].shape[0]) is None  # no pair: use run
        assert pair.collective_calls == 5
        with pytest.raises(UnknownExpert, match="expert \\(1, 7\\) is not held by shard"):
            pair.run(1, hidden[:1], torch.tensor([[7]]), w[:1, :1], rows=1)
        with pytest.raises(ExpertRequestError, match="expert_ids"):
            pair.run(1, hidden[:1], torch.tensor([[99]]), w[:1, :1], rows=1)
        assert pair.formed and server.collective.calls == 7  # errors answered on the pair, which stays
    finally:
        for c in (pair, fallback, grpc_only):
            c.close()
        shutdown(server, 1.0)
        shutdown(plain, 1.0)


def test_a_socket_pair_checks_its_key_and_notices_a_closed_peer():
    """SocketPair (the tcp backend): the connecting rank's key is checked by the listening rank before anything is
    served (a connection without it is refused), tensors of any dtype arrive byte for byte in posting order, a
    closed peer ends a receive with an error instead of a hang, and an unknown backend is refused by name."""
    import datetime
    import socket
    import threading

    import torch
    import torch.distributed as dist

    from expertmesh.worker.collective import SocketPair, backend_for, new_group

    store = client = dist.HashStore()  # both ranks in this process: an in-memory store (get waits, set wakes)
    store.set_timeout(datetime.timedelta(seconds=10))
    ranks = {}

    def rank1(group_id):
        try:
            ranks[group_id] = new_group("tcp", store, group_id, 1, "127.0.0.1", 5)
        except Exception as e:
            ranks[group_id] = e

    # an intruder that learned the address (not the key) is refused
    t = threading.Thread(target=rank1, args=("g1",))
    t.start()
    prefixed = dist.PrefixStore("expertmesh/g1/", client)
    host, port = prefixed.get("address").decode().rsplit(":", 1)
    prefixed.set("secret", b"0" * 32)
    with socket.create_connection((host, int(port))) as intruder:
        intruder.sendall(b"1" * 32)
        t.join(10)
    assert isinstance(ranks["g1"], ConnectionError)
    # the real pair
    t = threading.Thread(target=rank1, args=("g2",))
    t.start()
    a = new_group("tcp", client, "g2", 0, "127.0.0.1", 5)
    t.join(10)
    b = ranks["g2"]
    assert isinstance(a, SocketPair) and isinstance(b, SocketPair)
    gen = torch.Generator().manual_seed(3)
    sent = [
        torch.randn(5, 7, generator=gen).bfloat16(),
        torch.randint(-9, 9, (3, 4), generator=gen),
        torch.randn(2, generator=gen),
    ]
    got = [torch.empty_like(x) for x in sent]
    posted = [a.send([x], 1, 0) for x in sent]
    receiving = threading.Thread(target=lambda: [b.recv([x], 0, 0).wait(datetime.timedelta(seconds=5)) for x in got])
    receiving.start()
    for w in posted:
        w.wait(datetime.timedelta(seconds=5))
    receiving.join(10)
    assert all(torch.equal(x, y) for x, y in zip(sent, got))
    # several tensors in one send (a call's header and inputs): one larger than the (shrunk) send buffer (sendmsg
    # sends part of it and the rest follows), an empty one in between; read back one by one
    together = [
        torch.arange(8),
        torch.randn(1024, 1024, generator=gen).bfloat16(),
        torch.empty(0),
        torch.randint(0, 255, (17,), dtype=torch.uint8, generator=gen),
    ]
    got = [torch.empty_like(x) for x in together]
    a.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    receiving = threading.Thread(target=lambda: [b.recv([x], 0, 0).wait(datetime.timedelta(seconds=5)) for x in got])
    receiving.start()
    a.send_all(together, 5.0)
    receiving.join(10)
    assert all(torch.equal(x, y) for x, y in zip(together, got))
    a.abort()
    with pytest.raises((ConnectionError, OSError)):
        b.recv([torch.empty(4)], 0, 0).wait(datetime.timedelta(seconds=5))
    b.abort()
    with pytest.raises(ValueError, match="collective backend"):
        backend_for("cpu", "mpi")
    assert backend_for("cpu") == "tcp" and backend_for("cuda") == "nccl"


@pytest.fixture(scope="module")
def reference(ckpt_dir):
    model = Checkpoint(ckpt_dir).load_model()
    params = SamplingParams(max_tokens=MAX_TOKENS, stop_token_ids=(EOS,))
    return [generate(model, p, params, prefill_chunk=16).tokens for p in PROMPTS]


@pytest.fixture(scope="module")
def cluster(ckpt_dir, tmp_path_factory):
    """As `expertmesh up --transport collective` runs it (mutual TLS between the processes: pairs are opened over
    it): 2 attention workers, 3 expert workers, every expert on 2 of them; a 2 s deadline on every expert call (the
    collective waits too), so a hung rank is noticed quickly."""
    from expertmesh.runtime.tls import ClientTLS, ephemeral_pki

    pki = ephemeral_pki(tmp_path_factory.mktemp("pki"))
    c = LocalCluster(
        ckpt_dir,
        attention_workers=2,
        expert_workers=3,
        expert_replicas=2,
        http_port=free_port(),
        grpc_port=free_port(),
        transport="collective",
        router_args=["--call-timeout", "2"],
        worker_tls_dir=pki,
    )
    c.grpc_address = f"127.0.0.1:{c.grpc_port}"
    c.client_tls = ClientTLS(str(pki / "ca.crt"), str(pki / "client.crt"), str(pki / "client.key"))
    with c:
        yield c


def counts(cluster) -> dict[str, dict]:
    out = {}
    for w in cluster.workers:
        if w.name.startswith("expert-") and w.proc.poll() is None:
            with RemoteExpert(w.address, timeout=5, tls=cluster.client_tls) as client:
                out[w.name] = client.transport_counts()
    return out


def wait_until(predicate, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return False


def healthy(cluster) -> bool:
    return httpx.get(cluster.http_url + "/health").json()["expert_workers_down"] == []


def all_pairs(cluster) -> bool:
    """Every expert worker serves a pair to each of the 2 attention workers."""
    return all(c["collective_pairs"] == 2 for c in counts(cluster).values())


def test_tokens_equal_the_reference_over_collective_pairs(cluster, reference):
    assert wait_until(lambda: all_pairs(cluster))
    before = counts(cluster)
    out = run_with_fault(cluster.grpc_address, lambda: None)
    assert [e for _, e in out] == [None] * len(PROMPTS)
    assert [t for t, _ in out] == reference
    after = counts(cluster)
    # the layers' tensors went over the pairs, not over gRPC
    assert sum(after[w]["collective_calls"] - before[w]["collective_calls"] for w in after) > 50
    assert sum(after[w]["grpc_calls"] - before[w]["grpc_calls"] for w in after) == 0


@pytest.mark.parametrize("fault", ["SIGSTOP", "SIGKILL"])
def test_a_lost_expert_rank_fails_over_with_the_same_tokens_and_the_pair_comes_back(cluster, reference, fault):
    """Mid-generation an expert rank is hung (SIGSTOP: sockets open, nothing answers) or killed: the collective
    wait times out (or breaks), the layer's lost groups are redone over gRPC on the replicas, nothing hangs and
    the tokens are the reference's. Once the worker answers again its pairs are formed again."""
    assert wait_until(lambda: all_pairs(cluster) and healthy(cluster))
    victim = cluster.child("expert-1")
    t0 = time.monotonic()
    out = run_with_fault(cluster.grpc_address, lambda: victim.proc.send_signal(getattr(signal, fault)))
    try:
        elapsed = time.monotonic() - t0
        assert [e for _, e in out] == [None] * len(PROMPTS)
        assert [t for t, _ in out] == reference
        assert elapsed < 40  # deadlines fired; no step waited on the lost rank
        assert httpx.get(cluster.http_url + "/health").json()["expert_workers_down"] == [1]
    finally:
        if fault == "SIGSTOP":
            victim.proc.send_signal(signal.SIGCONT)
        else:
            cluster.restart("expert-1")
    assert wait_until(lambda: healthy(cluster) and all_pairs(cluster))  # taken back: pairs re-formed
    before = counts(cluster)["expert-1"]["collective_calls"]
    tokens, err = stream(cluster.grpc_address, PROMPTS[0])
    assert err is None and tokens == reference[0]
    assert counts(cluster)["expert-1"]["collective_calls"] > before  # the returned rank serves over its pair


def test_every_process_exits_cleanly_on_sigterm_after_the_faults(cluster):
    """Pairs that were hung, broken and re-formed never hold a process: SIGTERM ends each within the grace
    period with status 0 (LocalCluster.stop SIGKILLs a process still there after 10 s: status −9)."""
    cluster.stop()
    assert {c.name: c.proc.returncode for c in cluster.children} == {c.name: 0 for c in cluster.children}
