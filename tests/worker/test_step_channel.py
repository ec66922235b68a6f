"""The router's step channel (expertmesh/wire/step_channel.py, worker/step_channel.py) against a real worker on
loopback: an engine over the channel gives the tokens (and log-probs) an engine over gRPC gives, batched; the
router's traceparent arrives as the worker span's parent; errors keep their types; a step past its deadline drops
the channel and raises WorkerUnavailable (what a failed gRPC RunStep raises); a channel that cannot form leaves the
steps on gRPC, counted on /metrics."""

from __future__ import annotations

import time

import numpy as np
import pytest

from expertmesh.model.transformer import generate
from expertmesh.placement.planner import ClusterShape, plan_placement
from expertmesh.placement.replica_table import ReplicaTable
from expertmesh.router.engine_config import EngineConfig, step_deadline
from expertmesh.router.server import build_remote_engine
from expertmesh.wire.clients import RemoteAttention, RemoteExpert
from expertmesh.wire.sampling_params import SamplingParams
from expertmesh.wire.step_channel import StepChannelAttention
from expertmesh.wire.worker_api import NotFound, StepSegment, WorkerUnavailable
from expertmesh.worker.server import serve, shutdown

CHUNK, MAX_TOKENS = 16, 12


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    return tiny_checkpoint  # the session's shared tiny checkpoint (tests/conftest.py)


@pytest.fixture(scope="module")
def worker(ckpt):
    """One worker process-local server holding the attention worker and every expert."""
    s = serve("both", ckpt, 0, kv_blocks=256, block_size=16, name="w")
    s.address = f"127.0.0.1:{s.port}"
    yield s
    shutdown(s, 1.0)


def engine_over(ckpt, worker, step_transport: str):
    cfg = ckpt.cfg
    shape = ClusterShape(
        pods=1, gpus_per_pod=1, gpu_memory_bytes=cfg.n_logical_experts * cfg.expert_bytes_mxfp4, reserve_bytes=0
    )
    config = EngineConfig(prefill_chunk=CHUNK, call_timeout=step_deadline(30.0, 1), step_transport=step_transport)
    return build_remote_engine(
        cfg, [worker.address], [worker.address], plan_placement(cfg, shape), config, timeout=30.0
    ).start()


def channel_of(engine):
    return engine.attention[0]._client  # the engine's InstrumentedClient around the worker's client


def wait_formed(client, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while client.transport != "tcp" and time.monotonic() < deadline:
        client.form()
        time.sleep(0.05)
    assert client.transport == "tcp", "the step channel did not form"


PROMPTS = [[(7 * i + j) % 200 + 1 for j in range(5 + 9 * i)] for i in range(4)]  # 5..32 tokens: chunks and not
REQUESTS = [SamplingParams(max_tokens=MAX_TOKENS)] * 3 + [
    SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, top_p=0.9, seed=5, logprobs=2)
]


def run_batch(engine) -> list[tuple[list[int], list]]:
    reqs = [engine.submit(p, params) for p, params in zip(PROMPTS, REQUESTS)]  # at once: one batch
    done = [r.wait(120) for r in reqs]
    return [(r.output, [(lp.token, round(lp.logprob, 6)) for lp in r.logprobs]) for r in done]


def test_steps_over_the_channel_give_the_grpc_tokens(ckpt, worker):
    model = ckpt.load_model()
    reference = [
        generate(model, p, SamplingParams(max_tokens=MAX_TOKENS), prefill_chunk=CHUNK).tokens for p in PROMPTS[:3]
    ]
    results = {}
    for transport in ("grpc", "tcp"):
        engine = engine_over(ckpt, worker, transport)
        try:
            if transport == "tcp":
                wait_formed(channel_of(engine))
            results[transport] = run_batch(engine)
            client = channel_of(engine)
        finally:
            engine.close()
    assert [out for out, _ in results["tcp"][:3]] == reference  # greedy: the model's own tokens
    assert results["tcp"] == results["grpc"]  # and the seeded one, its log-probs included
    assert isinstance(client, StepChannelAttention) and client.steps["tcp"] >= MAX_TOKENS
    assert client.steps["grpc"] == 0 and client.fallbacks == 0
    metrics = engine.metrics.render().decode()
    assert f'expertmesh_step_transport{{transport="tcp",worker="{client.name}"}} 1.0' in metrics
    assert f'expertmesh_step_transport_steps_total{{transport="tcp",worker="{client.name}"}}' in metrics
    client.close()


def test_the_routers_traceparent_is_the_worker_spans_parent(ckpt, worker):
    from opentelemetry import trace
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from expertmesh.runtime import telemetry

    exporter = InMemorySpanExporter()
    processor = SimpleSpanProcessor(exporter)
    saved = (telemetry._configured, telemetry._provider)
    telemetry._extra_processors.append(processor)
    try:
        provider = telemetry.setup_tracing("expertmesh-test", force=True)
        if trace.get_tracer_provider() is not provider:  # a provider set earlier in this process stays global
            trace.get_tracer_provider().add_span_processor(processor)
        client = connected_channel(ckpt, worker)
        try:
            client.open_sequence("traced", SamplingParams(max_tokens=4), reserve_tokens=32)
            with telemetry.tracer().start_as_current_span("router.step") as parent:
                done = client.run_step(1, [StepSegment("traced", PROMPTS[1], True)])
            assert set(done.tokens) == {"traced"} and client.steps == {"tcp": 1, "grpc": 0}
            client.close_sequence("traced")
        finally:
            client.close()
    finally:
        telemetry._extra_processors.remove(processor)
        telemetry._configured, telemetry._provider = saved
    steps = [s for s in exporter.get_finished_spans() if s.name == "worker.RunStep"]
    assert len(steps) == 1
    assert steps[0].parent.span_id == parent.get_span_context().span_id and steps[0].parent.is_remote
    assert steps[0].context.trace_id == parent.get_span_context().trace_id


def connected_channel(ckpt, worker, **kw) -> StepChannelAttention:
    """A step channel client of `worker`, its experts connected (all on the worker itself), the channel formed."""
    cfg = ckpt.cfg
    remote = RemoteAttention(worker.address, timeout=10.0, name="w", **kw)
    table = ReplicaTable(
        tuple(cfg.moe_layers), np.zeros((len(cfg.moe_layers), cfg.moe.n_routed_experts, 1), dtype=np.int64)
    )
    remote.connect_experts([RemoteExpert(worker.address, timeout=10.0)], table)
    client = StepChannelAttention(remote)
    wait_formed(client)
    return client


def test_errors_keep_their_types_and_a_late_step_drops_the_channel(ckpt, worker):
    client = connected_channel(ckpt, worker, step_timeout=1.0)
    try:
        with pytest.raises(NotFound, match="never-opened"):  # as over gRPC: NOT_FOUND → NotFound, the channel stays
            client.run_step(1, [StepSegment("never-opened", [1, 2], True)])
        assert client.transport == "tcp"
        slow_step = worker.step_channels.step

        def late(raw, metadata):
            time.sleep(2.0)
            return slow_step(raw, metadata)

        worker.step_channels.step = late
        try:
            client.open_sequence("late", SamplingParams(max_tokens=4), reserve_tokens=32)
            t0 = time.monotonic()
            with pytest.raises(WorkerUnavailable, match="step channel"):
                client.run_step(2, [StepSegment("late", [5, 6, 7], True)])
            assert time.monotonic() - t0 < 1.8  # the step's deadline, not the worker's pace
            assert client.transport == "grpc"  # dropped: the router marks the worker down, as for gRPC
        finally:
            worker.step_channels.step = slow_step
        time.sleep(1.5)  # the late step finishes on the worker
        client.close_sequence("late")
    finally:
        client.close()


def test_a_channel_that_cannot_form_leaves_the_steps_on_grpc(ckpt, worker, monkeypatch):
    def refuse(channel_id, peer_host, timeout):
        raise ValueError("OpenStepChannel: refused by the test")

    monkeypatch.setattr(worker.step_channels, "open", refuse)
    engine = engine_over(ckpt, worker, "tcp")
    try:
        client = channel_of(engine)
        deadline = time.monotonic() + 10
        while client.fallbacks == 0 and time.monotonic() < deadline:
            client.form()
            time.sleep(0.05)
        out = [engine.generate(p, SamplingParams(max_tokens=4)).output for p in PROMPTS[:2]]
    finally:
        engine.close()
    model = ckpt.load_model()
    assert out == [generate(model, p, SamplingParams(max_tokens=4), prefill_chunk=CHUNK).tokens for p in PROMPTS[:2]]
    assert client.fallbacks >= 1 and client.transport == "grpc"
    assert client.steps["tcp"] == 0 and client.steps["grpc"] > 0
    metrics = engine.metrics.render().decode()
    assert f'expertmesh_step_transport{{transport="grpc",worker="{client.name}"}} 1.0' in metrics
    assert f'expertmesh_step_transport_fallbacks_total{{worker="{client.name}"}} {float(client.fallbacks)}' in metrics
    client.close()
