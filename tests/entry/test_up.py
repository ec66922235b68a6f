"""`expertmesh up`-style deployments: router + workers as real processes on loopback, reached over gRPC."""

import random

import grpc
import httpx
import pytest
from support.router_client import EOS, grpc_generate

from expertmesh.chat.thinking import default_budgets
from expertmesh.checkpoint.loader import Checkpoint
from expertmesh.entry.cluster import LocalCluster, free_port
from expertmesh.model.transformer import generate
from expertmesh.protos import router_pb2, router_pb2_grpc, sampling_pb2
from expertmesh.wire.sampling_params import SamplingParams

pytestmark = pytest.mark.slow
N_PROMPTS, N_TOKENS = 16, 32


@pytest.fixture(scope="module")
def ckpt_dir(tiny_checkpoint_dir):
    return tiny_checkpoint_dir  # the session's shared tiny checkpoint (tests/conftest.py)


@pytest.fixture(scope="module")
def reference(ckpt_dir):
    model = Checkpoint(ckpt_dir).load_model()
    rng = random.Random(42)
    prompts = [[rng.randrange(256) for _ in range(rng.randrange(3, 70))] for _ in range(N_PROMPTS)]
    params = SamplingParams(max_tokens=N_TOKENS, stop_token_ids=(EOS,))
    return prompts, [generate(model, p, params, prefill_chunk=16).tokens for p in prompts]


def run_all(address: str, prompts: list[list[int]]) -> list[list[int]]:
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(8) as pool:
        return [t for t, _ in pool.map(lambda p: grpc_generate(address, p, N_TOKENS), prompts)]


@pytest.mark.parametrize(
    "attention, experts, redundant, transport",
    [(1, 1, 0, "grpc"), (1, 2, 0, "grpc"), (2, 3, 2, "grpc"), (1, 2, 0, "collective"), (2, 3, 2, "collective")],
)  # the same layouts over torch.distributed pairs
def test_multiprocess_tokens_equal_reference(ckpt_dir, reference, attention, experts, redundant, transport):
    from expertmesh.wire.clients import RemoteExpert

    prompts, ref = reference
    grpc_port = free_port()
    with LocalCluster(
        ckpt_dir,
        attention_workers=attention,
        expert_workers=experts,
        redundant_experts=redundant,
        http_port=free_port(),
        grpc_port=grpc_port,
        transport=transport,
    ) as cluster:
        out = run_all(f"127.0.0.1:{grpc_port}", prompts)
        health = httpx.get(cluster.http_url + "/health").json()
        calls = {"collective_calls": 0, "grpc_calls": 0}
        for w in cluster.workers:
            if w.name.startswith("expert-"):
                with RemoteExpert(w.address, timeout=5) as client:
                    for k, v in client.transport_counts().items():
                        calls[k] = calls.get(k, 0) + v
    assert out == ref
    assert health["status"] == "ok"
    # the layers' tensors rode the transport asked for (a pair forms shortly after start: the first steps may use gRPC)
    if transport == "collective":
        assert calls["collective_calls"] > calls["grpc_calls"], calls
    else:
        assert calls["collective_calls"] == 0 < calls["grpc_calls"], calls
    # every process stopped cleanly on SIGTERM
    assert [c.proc.returncode for c in cluster.children] == [0] * len(cluster.children)


def test_grpc_errors_and_listing(ckpt_dir):
    grpc_port = free_port()
    with LocalCluster(
        ckpt_dir, attention_workers=1, expert_workers=1, http_port=free_port(), grpc_port=grpc_port
    ) as cluster:
        address = f"127.0.0.1:{grpc_port}"
        with grpc.insecure_channel(address) as ch:
            stub = router_pb2_grpc.RouterStub(ch)
            models = stub.ListModels(router_pb2.ListModelsRequest(), timeout=10).models
            assert [m.id for m in models] == ["tiny"] and models[0].max_context == 4096
            for req, code, needle in [
                (router_pb2.GenerateRequest(), grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
                (
                    router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=[])),
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "prompt: expected at least one token",
                ),
                (
                    router_pb2.GenerateRequest(text="hi", params=sampling_pb2.SamplingParams(max_tokens=0)),
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "max_tokens",
                ),
                (
                    router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=[1] * 5000)),
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "context is 4096",
                ),
                (router_pb2.GenerateRequest(model="other", text="hi"), grpc.StatusCode.NOT_FOUND, "not found"),
            ]:
                with pytest.raises(grpc.RpcError) as e:
                    list(stub.Generate(req, timeout=10))
                assert e.value.code() == code and needle in e.value.details()
        tokens, finish = grpc_generate(address, [1, 2, 3], 4)  # still serving
        assert len(tokens) == finish.usage.completion_tokens <= 4 and finish.usage.prompt_tokens == 3
        r = httpx.post(cluster.http_url + "/v1/completions", json={"model": "tiny", "prompt": "", "max_tokens": 3})
        assert r.status_code == 400 and "prompt" in r.json()["error"]["message"]
        # the router holds no weights and does no tensor math: a serving router process has no torch mapped
        # (a worker of the same deployment does: the check can tell the two apart)
        maps = {c.name: open(f"/proc/{c.proc.pid}/maps").read() for c in cluster.children}
        assert "libtorch" not in maps["router"]
        assert all("libtorch" in m for name, m in maps.items() if name != "router")


def test_grpc_chat_streams_reasoning_content_and_usage(ckpt_dir):
    from expertmesh.protos import chat_pb2

    grpc_port = free_port()
    limit = default_budgets("tiny").low
    with LocalCluster(ckpt_dir, attention_workers=1, expert_workers=2, http_port=free_port(), grpc_port=grpc_port):
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as ch:
            stub = router_pb2_grpc.RouterStub(ch)
            req = chat_pb2.ChatRequest(
                messages=[
                    chat_pb2.ChatMessage(role="system", content="be brief"),
                    chat_pb2.ChatMessage(role="user", content="What is 2+2?"),
                ],
                tools=[chat_pb2.Tool(name="calc", description="calculator", parameters_json='{"type":"object"}')],
                thinking_budget="low",
                params=sampling_pb2.SamplingParams(max_tokens=30, temperature=0),
            )
            events = list(stub.Chat(req, timeout=60))
            finish = events[-1].finish
            assert events[-1].HasField("finish") and finish.thinking_budget == "low"
            reasoning = sum(1 for e in events if e.HasField("reasoning_delta"))
            assert 0 < finish.usage.reasoning_tokens <= limit and reasoning <= finish.usage.reasoning_tokens
            assert finish.usage.completion_tokens <= 30 and finish.finish_reason in ("stop", "length", "tool_calls")
            # the same conversation again: its prompt is served from the prefix cache
            again = list(stub.Chat(req, timeout=60))[-1].finish
            assert again.usage.cached_tokens > 0
            bad = chat_pb2.ChatRequest(messages=[chat_pb2.ChatMessage(role="tool", content="x", tool_call_id="nope")])
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Chat(bad, timeout=10))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "'nope' answers no" in e.value.details()
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Chat(chat_pb2.ChatRequest(messages=req.messages, thinking_budget="huge"), timeout=10))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "thinking_budget" in e.value.details()


def test_up_restarts_a_dead_worker_and_its_workers_die_with_it(ckpt_dir):
    """`expertmesh up` as a real process: its workers refuse callers without this run's client certificate; a
    SIGKILLed expert worker (no replicas) is started again and service resumes; SIGKILL of `up` itself takes its
    workers down (none is left holding a port)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    http, grpc_port = free_port(), free_port()
    up = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "expertmesh.entry.cli",
            "up",
            "--checkpoint",
            str(ckpt_dir),
            "--expert-workers",
            "2",
            "--http-port",
            str(http),
            "--grpc-port",
            str(grpc_port),
            "--",
            "--max-context",
            "384",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONSAFEPATH": "1"},
    )
    try:
        for line in up.stdout:
            if line.startswith("Ctrl-C to stop"):
                break
        else:
            pytest.fail("expertmesh up did not start")
        children = [
            int(p) for p in subprocess.run(["pgrep", "-P", str(up.pid)], capture_output=True, text=True).stdout.split()
        ]
        assert len(children) == 4  # router, 1 attention, 2 expert workers
        cmdlines = {p: open(f"/proc/{p}/cmdline").read().split("\0") for p in children}
        experts = [p for p, cmd in cmdlines.items() if "--role" in cmd and cmd[cmd.index("--role") + 1] == "expert"]
        assert len(experts) == 2
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        for p in experts:  # a local process without the client key: refused
            port = cmdlines[p][cmdlines[p].index("--port") + 1]
            with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
                with pytest.raises(grpc.RpcError) as err:
                    health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=3)
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        # options after `--` reached the router
        assert httpx.get(f"http://127.0.0.1:{http}/v1/models").json()["data"][0]["max_model_len"] == 384
        want = grpc_generate(f"127.0.0.1:{grpc_port}", [5, 6, 7], 6)[0]
        os.kill(experts[0], signal.SIGKILL)
        deadline, got = time.monotonic() + 60, None
        while time.monotonic() < deadline:
            try:
                got = grpc_generate(f"127.0.0.1:{grpc_port}", [5, 6, 7], 6)[0]
                break
            except grpc.RpcError:
                time.sleep(0.5)  # experts without a replica until it is back
        assert got == want
        now = [
            int(p) for p in subprocess.run(["pgrep", "-P", str(up.pid)], capture_output=True, text=True).stdout.split()
        ]
        assert len(now) == 4 and experts[0] not in now
        roles = {p: " ".join(open(f"/proc/{p}/cmdline").read().split("\0")[3:6]) for p in now}  # while they run
        up.kill()
        up.wait()

        def alive() -> dict:
            """pid → role and state of the children still running (zombies wait for init, they hold nothing)."""
            out = {}
            for p in now:
                try:
                    state, wchan = open(f"/proc/{p}/stat").read().split()[2], open(f"/proc/{p}/wchan").read()
                except OSError:
                    continue
                if state != "Z":
                    out[p] = f"{roles[p]} (state {state}, waiting in {wchan or '-'})"
            return out

        # they drain on the SIGTERM their parent's death sends; each ends itself at its shutdown deadline (a worker
        # --grace 10 + 5 s, the router --shutdown-timeout 30 s) whatever is stuck, so allow that and some load
        deadline = time.monotonic() + 45
        while alive() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert alive() == {}
    finally:
        if up.poll() is None:
            up.kill()


def test_router_options_after_the_double_dash_are_checked_before_anything_starts(capsys):
    from expertmesh.entry.up import router_options

    assert router_options(["--", "--max-context", "384", "--image-fetch-allow=example.org"]) == [
        "--max-context",
        "384",
        "--image-fetch-allow=example.org",
    ]
    assert router_options([]) == []
    for bad, named in (
        (["--", "--max-context", "lots"], "--max-context"),
        (["--", "--bogus"], "--bogus"),
        (["--", "--plan=x"], "--plan is set by `expertmesh up`"),
    ):
        with pytest.raises(SystemExit) as e:
            router_options(bad)
        assert e.value.code == 2 and named in capsys.readouterr().err


def test_free_port_never_repeats_a_recent_answer():
    """A cluster takes its ports one after another before any child binds them: free_port must not hand out a
    port twice (2,000 random picks among the 12,000 below the ephemeral range would repeat one almost surely)."""
    ports = [free_port() for _ in range(2000)]
    assert len(set(ports)) == len(ports)


def test_default_expert_workers_one_per_two_cores(monkeypatch):
    """`up` without --expert-workers: one expert worker per two cores of this process's affinity, at least one and
    at least --expert-replicas."""
    import os

    from expertmesh.entry.cluster import default_expert_workers
    from expertmesh.entry.up import add_arguments

    assert [default_expert_workers(c) for c in (1, 2, 3, 4, 16)] == [1, 1, 1, 2, 8]
    assert [default_expert_workers(2, replicas=r) for r in (1, 2, 3)] == [1, 2, 3]  # --expert-replicas R
    assert default_expert_workers(16, replicas=2) == 8
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(6)), raising=False)
    assert default_expert_workers() == 3
    import argparse

    p = argparse.ArgumentParser()
    add_arguments(p)
    assert p.parse_args([]).expert_workers is None and p.parse_args(["--expert-workers", "2"]).expert_workers == 2


def test_default_threads_share_the_cores_among_the_workers_of_a_role(tmp_path, monkeypatch):
    """`up`'s torch threads per process (nothing started): the attention workers of both pools split the cores, so
    do the expert workers, the router has one; `threads` set is one count for all."""
    import os

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    c = LocalCluster(
        tmp_path, attention_workers=1, prefill_workers=1, expert_workers=3, threads=None, run_dir=tmp_path / "run"
    )
    assert [c.threads_for(n) for n in ("attention-0", "prefill-0", "expert-0", "expert-2", "router")] == [4, 4, 2, 2, 1]
    c = LocalCluster(tmp_path, expert_workers=2, threads=3, run_dir=tmp_path / "run")
    assert {c.threads_for(n) for n in ("attention-0", "expert-1", "router")} == {3}


def test_decode_threads_share_the_cores_among_all_the_workers(tmp_path, monkeypatch):
    """With the threads left to `up`, every worker gets --decode-threads: the cores over all the worker processes
    (a decode layer runs the shared experts and every expert call at once); with `threads` given, none."""
    import os

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    c = LocalCluster(
        tmp_path, attention_workers=1, prefill_workers=1, expert_workers=2, threads=None, run_dir=tmp_path / "run"
    )
    assert c.decode_threads() == 2 and c._decode_args() == ["--decode-threads", "2"]
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(2)), raising=False)
    assert LocalCluster(tmp_path, expert_workers=1, threads=None, run_dir=tmp_path / "run").decode_threads() == 1
    assert LocalCluster(tmp_path, expert_workers=3, threads=None, run_dir=tmp_path / "run").decode_threads() == 1
    c = LocalCluster(tmp_path, expert_workers=2, threads=3, run_dir=tmp_path / "run")
    assert c.decode_threads() is None and c._decode_args() == []
