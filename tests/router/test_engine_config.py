"""The engine's construction: an EngineConfig built once (from keyword arguments, or parsed from the router's flags as
the operator renders them), a constructor that does no I/O, and `Engine.start()` that waits for the workers."""

import argparse
import socket
import threading
import time

import pytest

from expertmesh.entry.cluster import make_placement
from expertmesh.model.config import preset
from expertmesh.router.engine import Engine, EngineClosed
from expertmesh.router.engine_config import EngineConfig, step_deadline
from expertmesh.router.server import add_arguments, build_remote_engine
from expertmesh.wire.sampling_params import SamplingParams


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Spy:
    """A worker client that records every call and answers none."""

    def __init__(self, calls: list):
        self.calls = calls

    def __getattr__(self, method: str):
        def call(*args, **kwargs):
            self.calls.append(method)
            raise ConnectionError(f"{method}: unreachable")

        return call


@pytest.fixture(scope="module")
def tiny():
    cfg = preset("tiny")
    return cfg, make_placement(cfg, 1)


def test_the_constructor_contacts_no_worker_and_starts_no_thread(tiny):
    cfg, placement = tiny
    calls: list[str] = []
    threads = set(threading.enumerate())
    engine = Engine(cfg, [Spy(calls)], [Spy(calls)], placement, EngineConfig(startup_timeout=0.6), prefill=[Spy(calls)])
    assert calls == [] and set(threading.enumerate()) == threads and not engine.started
    assert engine.kv.workers == [] and engine.attention_down == set()
    assert b"expertmesh_requests_waiting 0.0" in engine.metrics.render() and calls == []  # /metrics asks no worker
    with pytest.raises(EngineClosed, match="not started"):
        engine.submit([1, 2, 3], SamplingParams(max_tokens=1))
    start = time.monotonic()
    with pytest.raises(ConnectionError):
        engine.start()  # waits for the first attention worker, up to startup_timeout
    assert time.monotonic() - start >= 0.6 and calls and set(calls) == {"info"}
    assert not engine.started
    engine.close()


def test_a_remote_engine_over_unreachable_workers_is_built_at_once_and_start_fails(tiny):
    cfg, placement = tiny
    address = f"127.0.0.1:{closed_port()}"
    start = time.monotonic()
    # built without waiting out startup_timeout (half of it is the bound: a full run on a busy machine took 0.73 s
    # to build, over the 0.5 s this once allowed against a 1 s timeout)
    engine = build_remote_engine(cfg, [address], [address], placement, EngineConfig(startup_timeout=3.0), timeout=0.5)
    assert time.monotonic() - start < 1.5 and not engine.started
    start = time.monotonic()
    with pytest.raises(ConnectionError):
        engine.start()
    assert time.monotonic() - start >= 3.0
    engine.close()


def router_flags(*flags: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(flags)


def test_the_config_is_parsed_from_the_flags_the_operator_renders():
    from expertmesh.operator.pod_commands import router_args
    from expertmesh.operator.spec import parse_spec

    spec = parse_spec(
        {
            "model": {"preset": "tiny", "checkpoint": {"pvc": {"claimName": "weights", "path": "/ckpt/tiny"}}},
            "transport": "collective",
            "attentionWorkers": {"gpusPerPod": 0},
            "prefillWorkers": {"replicas": 1, "gpusPerPod": 0, "minPromptTokens": 64},
            "expertWorkers": {"replicas": 2, "gpusPerPod": 0, "reserveGiB": 0, "gpuMemoryGiB": 1},
        }
    )
    args = router_args("kimi", "ns", spec)
    assert args[0] == "router"
    config = EngineConfig.from_args(router_flags(*args[1:]))
    assert config.transport == "collective" and config.prefill_min_tokens == 64
    assert config.call_timeout == step_deadline(30.0, 2)  # the router's --call-timeout over its 2 expert workers
    assert config == EngineConfig.from_args(router_flags(*args[1:]))  # a value: equal flags, equal configs


def test_flags_become_the_config_and_bad_ones_are_named():
    base = ("--checkpoint", "-", "--plan", "-", "--attention", "a:1", "--experts", "e:1,e:2,e:3")
    config = EngineConfig.from_args(
        router_flags(
            *base,
            "--prefill-chunk",
            "32",
            "--prefill-tokens",
            "96",
            "--max-queue-wait",
            "7",
            "--kv-growth",
            "64",
            "--image-fetch-allow",
            "Example.org, b:8",
            "--prefix-index-refresh-s",
            "0",
        ),
        prefix_salt=b"salt",
    )
    assert (config.prefill_chunk, config.prefill_tokens, config.max_queue_wait, config.kv_growth) == (32, 96, 7, 64)
    assert config.image_limits.fetch_allow == ("example.org", "b:8") and config.prefix_index_refresh == 0
    assert config.prefix_salt == b"salt" and config.call_timeout == 30.0 * 4
    with pytest.raises(ValueError, match="--prefill-tokens 40 is not a multiple of --prefill-chunk 16"):
        EngineConfig.from_args(router_flags(*base, "--prefill-chunk", "16", "--prefill-tokens", "40"))
    with pytest.raises(ValueError, match="transport"):
        EngineConfig(transport="carrier-pigeon")
    with pytest.raises(ValueError, match="prefix_salt: empty"):
        EngineConfig(prefix_salt=b"")
    with pytest.raises(AttributeError):
        config.kv_growth = 1  # frozen: built once


def test_the_scheduling_limits_follow_the_config():
    limits = EngineConfig(prefill_chunk=16, prefill_tokens=0, max_running=8, kv_growth=0).limits(
        max_context=512, snapshot_within_step=True
    )
    assert (limits.prefill_tokens, limits.max_batch_tokens, limits.kv_growth) == (16, 256, 1)
    big = EngineConfig(prefill_chunk=64, prefill_tokens=1024, max_running=64).limits(
        max_context=512, snapshot_within_step=False
    )
    assert big.max_batch_tokens == 1024 + 64 and big.max_context == 512
