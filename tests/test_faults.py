"""Fault tests on loopback with real processes: workers SIGKILLed mid-generation, slow workers, router loss.
Each scenario is bounded in time; greedy tokens are compared with an undisturbed run."""
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import pytest

from expertmesh.checkpoint import create_checkpoint
from expertmesh.config import preset
from expertmesh.protos import router_pb2, router_pb2_grpc, sampling_pb2
from expertmesh.tokenizer import ByteTokenizer
from expertmesh.up import LocalCluster, free_port

pytestmark = pytest.mark.slow
EOS = ByteTokenizer().eos_id
PROMPTS = [[(7 * i + j) % 256 for j in range(5 + 3 * i)] for i in range(4)]
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    return create_checkpoint(preset("tiny"), tmp_path_factory.mktemp("faults") / "tiny", seed=0)


def stream(address: str, prompt: list[int], first: threading.Event | None = None, timeout: float = 60):
    """Greedy generation over gRPC; sets `first` once a few tokens arrived. Returns (tokens, error)."""
    tokens = []
    try:
        with grpc.insecure_channel(address) as ch:
            stub = router_pb2_grpc.RouterStub(ch)
            req = router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=prompt),
                                             params=sampling_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0,
                                                                                stop_token_ids=[EOS]))
            for ev in stub.Generate(req, timeout=timeout):
                if ev.HasField("token"):
                    tokens.append(ev.token.token_id)
                    if first is not None and len(tokens) >= 3:
                        first.set()
        return tokens, None
    except grpc.RpcError as e:
        return tokens, e


def run_with_fault(address: str, fault) -> list:
    started = [threading.Event() for _ in PROMPTS]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        futs = [pool.submit(stream, address, p, ev) for p, ev in zip(PROMPTS, started)]
        assert all(ev.wait(60) for ev in started)
        fault()
        return [f.result(timeout=120) for f in futs]


def reference_tokens(ckpt_dir, prompt: list[int]) -> list[int]:
    """The single-process reference model's greedy tokens (what every layout must produce)."""
    from expertmesh.checkpoint import Checkpoint
    from expertmesh.model import SamplingParams, generate
    model = Checkpoint(ckpt_dir).load_model()
    return generate(model, prompt, SamplingParams(max_tokens=MAX_TOKENS, stop_token_ids=(EOS,)),
                    prefill_chunk=16).tokens


def cluster(ckpt_dir, **kw):
    grpc_port = free_port()
    c = LocalCluster(ckpt_dir, http_port=free_port(), grpc_port=grpc_port,
                     router_args=["--call-timeout", "2"], **kw)
    c.grpc_address = f"127.0.0.1:{grpc_port}"
    return c


def test_expert_worker_killed_with_replicas_loses_nothing(ckpt_dir):
    # 16 redundant slots per layer: every expert has a replica on another worker
    with cluster(ckpt_dir, attention_workers=1, expert_workers=3, redundant_experts=16) as c:
        undisturbed = [stream(c.grpc_address, p)[0] for p in PROMPTS]
        results = run_with_fault(c.grpc_address, lambda: c.kill("expert-1"))
        assert [e for _, e in results] == [None] * len(PROMPTS)
        assert [t for t, _ in results] == undisturbed
        assert httpx.get(c.http_url + "/health").json()["expert_workers_down"] == [1]
        c.restart("expert-1")
        deadline = time.monotonic() + 20
        while httpx.get(c.http_url + "/health").json()["expert_workers_down"] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert httpx.get(c.http_url + "/health").json()["status"] == "ok"   # taken back once healthy
        assert stream(c.grpc_address, PROMPTS[0])[0] == undisturbed[0]


def test_expert_worker_killed_without_replicas_fails_clearly_then_recovers(ckpt_dir):
    with cluster(ckpt_dir, attention_workers=1, expert_workers=2) as c:
        undisturbed = stream(c.grpc_address, PROMPTS[1])[0]
        t0 = time.monotonic()
        results = run_with_fault(c.grpc_address, lambda: c.kill("expert-0"))
        assert time.monotonic() - t0 < 30
        errors = [e for _, e in results]
        assert all(e is not None and e.code() == grpc.StatusCode.UNAVAILABLE for e in errors)
        assert all("experts without a live replica" in e.details() for e in errors)
        r = httpx.post(c.http_url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 4})
        assert r.status_code == 503 and "experts without a live replica" in r.json()["error"]["message"]
        # what clients are told names the experts, never a worker's address
        assert not any("127.0.0.1" in e.details() for e in errors) and "127.0.0.1" not in r.text
        c.restart("expert-0")
        deadline = time.monotonic() + 20
        while httpx.get(c.http_url + "/health").json()["status"] != "ok" and time.monotonic() < deadline:
            time.sleep(0.2)
        assert stream(c.grpc_address, PROMPTS[1]) == (undisturbed, None)      # service resumes


@pytest.mark.parametrize("fault", ["SIGKILL", "SIGSTOP"])
def test_attention_worker_lost_streams_continue_identically(ckpt_dir, fault):
    """Killed, or hung (SIGSTOP: connections stay open, nothing answers): with the default 30 s call deadline
    (a step may take 90 s) the router notices the hang through the worker's health check within seconds."""
    import signal
    c = LocalCluster(ckpt_dir, http_port=free_port(), grpc_port=free_port(), attention_workers=2, expert_workers=2)
    c.grpc_address = f"127.0.0.1:{c.grpc_port}"
    with c:
        undisturbed = [stream(c.grpc_address, p)[0] for p in PROMPTS]
        victim = c.child("attention-0").proc
        t0 = time.monotonic()
        results = run_with_fault(c.grpc_address, lambda: victim.send_signal(getattr(signal, fault)))
        try:
            assert time.monotonic() - t0 < 45
            assert [e for _, e in results] == [None] * len(PROMPTS)
            assert [t for t, _ in results] == undisturbed
            assert httpx.get(c.http_url + "/health").json()["attention_workers_down"] == [0]
        finally:
            victim.send_signal(signal.SIGCONT)


def test_slow_expert_worker_fails_over_to_its_replica(ckpt_dir):
    slow = {"expert-2": {"EXPERTMESH_FAULT_DELAY_S": "5"}}    # every RunExperts call sleeps past the deadline
    with cluster(ckpt_dir, attention_workers=1, expert_workers=3, redundant_experts=16, worker_env=slow) as c:
        t0 = time.monotonic()
        tokens, err = stream(c.grpc_address, PROMPTS[0], timeout=60)
        assert time.monotonic() - t0 < 45                     # deadlines fired, nobody waited forever
        assert err is None and tokens == reference_tokens(ckpt_dir, PROMPTS[0])   # replicas: the same tokens


def test_router_restart_ends_requests_clearly_and_a_second_router_serves(ckpt_dir):
    with cluster(ckpt_dir, attention_workers=1, expert_workers=2) as c:
        expected = stream(c.grpc_address, PROMPTS[2])[0]
        second_http, second_grpc = free_port(), free_port()
        args = list(c.router.args)
        args[args.index("--http-port") + 1] = str(second_http)
        args[args.index("--grpc-port") + 1] = str(second_grpc)
        second = c._spawn("router-2", args)
        c._wait_ready([second], 60)
        results = run_with_fault(c.grpc_address, lambda: c.kill("router"))
        assert all(e is not None and e.code() == grpc.StatusCode.UNAVAILABLE for _, e in results)
        assert stream(f"127.0.0.1:{second_grpc}", PROMPTS[2]) == (expected, None)   # workers kept running
        assert all(w.proc.poll() is None for w in c.workers if w.name != "router-2")
