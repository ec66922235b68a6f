"""The router's steps over the step channel (`--step-transport tcp`) with real processes on loopback: an attention
worker SIGKILLed mid-stream is handled as over gRPC — marked down, its sequences replayed on the other worker, every
stream the undisturbed run's tokens — and, restarted, it is taken back with a channel formed again."""

import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from support.router_client import PROMPTS, run_with_fault, stream

from expertmesh.entry.cluster import LocalCluster, free_port

pytestmark = pytest.mark.slow


def step_metrics(c) -> dict[tuple[str, str], float]:
    """(worker, transport) → steps the router sent it over that transport."""
    text = httpx.get(c.http_url + "/metrics").text
    pattern = r'expertmesh_step_transport_steps_total\{transport="(\w+)",worker="([^"]+)"\} ([0-9.e+]+)'
    return {(w, t): float(n) for t, w, n in re.findall(pattern, text)}


def transports(c) -> dict[str, str]:
    text = httpx.get(c.http_url + "/metrics").text
    return {w: t for t, w in re.findall(r'expertmesh_step_transport\{transport="(\w+)",worker="([^"]+)"\} 1\.0', text)}


def wait_for(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.2)


def test_an_attention_worker_killed_mid_stream_over_the_step_channel(tiny_checkpoint_dir):
    grpc_port = free_port()
    with LocalCluster(
        tiny_checkpoint_dir,
        http_port=free_port(),
        grpc_port=grpc_port,
        attention_workers=2,
        expert_workers=2,
        router_args=["--step-transport", "tcp"],
    ) as c:
        address = f"127.0.0.1:{grpc_port}"
        wait_for(lambda: set(transports(c).values()) == {"tcp"} and len(transports(c)) == 2)
        assert sorted(transports(c).values()) == ["tcp", "tcp"], transports(c)
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            undisturbed = list(pool.map(lambda p: stream(address, p), PROMPTS))
        assert all(err is None for _, err in undisturbed)
        before = step_metrics(c)
        assert sorted(before) == sorted((w, t) for w in transports(c) for t in ("tcp", "grpc"))
        assert all((n > 0) == (t == "tcp") for (_, t), n in before.items()), before  # every step went over tcp
        victim = c.child("attention-0").proc
        t0 = time.monotonic()
        results = run_with_fault(address, lambda: victim.send_signal(signal.SIGKILL))
        assert time.monotonic() - t0 < 45
        assert results == undisturbed  # every stream goes on with the same tokens
        health = httpx.get(c.http_url + "/health").json()
        assert (health["status"], health["attention_workers_down"]) == ("degraded", [0])
        c.restart("attention-0")
        wait_for(lambda: httpx.get(c.http_url + "/health").json()["status"] == "ok")
        wait_for(lambda: sorted(transports(c).values()) == ["tcp", "tcp"])
        assert sorted(transports(c).values()) == ["tcp", "tcp"]  # taken back: the channel formed again
        assert stream(address, PROMPTS[0]) == undisturbed[0]
