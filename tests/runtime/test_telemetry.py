"""Traces and metrics of the router over in-process workers (tests/entry/test_up.py checks the cross-process tree)."""

import re

import httpx
import openai
import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from expertmesh.entry.cluster import free_port
from expertmesh.entry.local import build_local_engine
from expertmesh.model.config import preset
from expertmesh.router.http import build_app, serve_http
from expertmesh.runtime import telemetry

EXPORTER = InMemorySpanExporter()


@pytest.fixture(scope="module")
def server(tiny_checkpoint, monkeypatch_module):
    monkeypatch_module.setenv("EXPERTMESH_TRACE_LAYER_EVERY", "1")
    telemetry._extra_processors.append(SimpleSpanProcessor(EXPORTER))
    telemetry.setup_tracing("expertmesh-router", {"expertmesh.role": "router"}, force=True)
    ck = tiny_checkpoint
    engine = build_local_engine(ck, attention_workers=1, expert_workers=2, prefill_chunk=16)
    port = free_port()
    srv, thread = serve_http(build_app(engine), "127.0.0.1", port)
    yield f"http://127.0.0.1:{port}", engine
    srv.should_exit = True
    thread.join(timeout=10)
    engine.close()


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def test_one_request_one_trace_with_the_expected_tree(server):
    EXPORTER.clear()
    client = openai.OpenAI(base_url=server[0] + "/v1", api_key="x", max_retries=0)
    r = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "trace me " * 3}],
        max_tokens=6,
        temperature=0,
        reasoning_effort="low",
    )
    spans = EXPORTER.get_finished_spans()
    roots = [s for s in spans if s.parent is None]
    assert len(roots) == 1
    root = roots[0]
    assert root.name == "chat tiny" and len({s.context.trace_id for s in spans}) == 1
    a = root.attributes
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.request.model"] == "tiny"
    assert a["gen_ai.request.max_tokens"] == 6 and a["expertmesh.chat.thinking.tier"] == "low"
    assert a["gen_ai.usage.input_tokens"] == r.usage.prompt_tokens
    assert a["gen_ai.usage.output_tokens"] == r.usage.completion_tokens
    assert a["gen_ai.usage.reasoning_tokens"] == r.usage.completion_tokens_details.reasoning_tokens
    by_id = {s.context.span_id: s for s in spans}
    children = [s for s in spans if s.parent is not None and s.parent.span_id == root.context.span_id]
    names = [s.name for s in children]
    assert names.count("queue") == 1
    prefill = [s for s in children if s.name == "prefill_chunk"]
    decode = [s for s in children if s.name == "decode_step"]
    assert len(prefill) == -(-r.usage.prompt_tokens // 16) and len(decode) == r.usage.completion_tokens - 1
    steps = [s for s in spans if s.name == "step"]
    assert steps and {by_id[s.parent.span_id].name for s in steps} <= {"prefill_chunk", "decode_step"}
    calls = [s for s in spans if s.name == "attention.run_step"]
    assert calls and all(by_id[s.parent.span_id].name == "step" for s in calls)
    # the attention worker's expert exchange, one span per MoE layer, inside its step call
    exchange = [s for s in spans if s.name == "expert_exchange"]
    assert {s.attributes["expertmesh.layer"] for s in exchange} == set(preset("tiny").moe_layers)
    assert all(by_id[s.parent.span_id].name == "attention.run_step" for s in exchange)


def test_a_prefill_to_decode_hand_off_is_traced_under_its_request(server):
    """router/engine.py: `kv.handoff` under the request's root, the prefill worker's `kv.send` inside it (bytes,
    tokens), then the decode worker's steps."""
    from expertmesh.wire.sampling_params import SamplingParams

    split = build_local_engine(server[1].attention[0]._client.ckpt, prefill_chunk=16, prefill_workers=1)
    try:
        EXPORTER.clear()
        with telemetry.tracer().start_as_current_span("request") as root:
            out = split.generate([(7 * j + 3) % 256 for j in range(40)], SamplingParams(max_tokens=3))
        assert len(out.output) == 3
    finally:
        split.close()
    spans = EXPORTER.get_finished_spans()
    (routed,) = [s for s in spans if s.name == "kv.handoff"]
    (sent,) = [s for s in spans if s.name == "kv.send"]
    assert routed.parent.span_id == root.get_span_context().span_id
    assert sent.parent.span_id == routed.context.span_id
    assert routed.attributes["expertmesh.handoff.from"] == "prefill-0"
    assert routed.attributes["expertmesh.handoff.to"] == "attention-0"
    assert sent.attributes["expertmesh.kv.tokens"] == 40
    assert routed.attributes["expertmesh.kv.bytes"] == sent.attributes["expertmesh.kv.bytes"] > 0


def _metric(text: str, name: str, labels: str = "") -> float:
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} ([0-9.e+-]+)$", text, re.M)
    assert m, f"{name}{labels} not in /metrics"
    return float(m.group(1))


def test_metrics_agree_with_usage(server):
    before = httpx.get(server[0] + "/metrics").text
    client = openai.OpenAI(base_url=server[0] + "/v1", api_key="x", max_retries=0)
    usages = [
        client.completions.create(model="tiny", prompt=f"count {i} " * 4, max_tokens=5, temperature=0).usage
        for i in range(3)
    ]
    text = httpx.get(server[0] + "/metrics").text
    gen = _metric(text, "expertmesh_generation_tokens_total") - _metric(before, "expertmesh_generation_tokens_total")
    prompt = _metric(text, "expertmesh_prompt_tokens_total") - _metric(before, "expertmesh_prompt_tokens_total")
    assert gen == sum(u.completion_tokens for u in usages)
    assert prompt == sum(u.prompt_tokens for u in usages)
    assert _metric(text, "expertmesh_time_to_first_token_seconds_count") >= 3
    assert _metric(text, "expertmesh_requests_running") == 0
    assert _metric(text, "expertmesh_kv_blocks", '{state="used",worker="attention-0"}') >= 0
    routed = sum(float(v) for v in re.findall(r"^expertmesh_expert_tokens_total\{[^}]*\} ([0-9.e+]+)$", text, re.M))
    engine = server[1]
    assert routed == sum(sum(c) for c in engine.load_stats().values()) > 0
    assert _metric(text, "expertmesh_expert_load_imbalance_max") >= 1.0
    assert 'expertmesh_worker_call_duration_seconds_count{method="run_step",worker="attention-0"}' in text
    assert _metric(text, "expertmesh_expert_exchange_bytes_total") > 0


def test_a_restore_from_a_lower_kv_tier_is_a_span(server):
    """worker/attention.py copies a prefix back from host / disk inside a `kv.restore` span: tier, bytes, tokens."""
    from expertmesh.wire.sampling_params import SamplingParams

    engine = server[1]
    engine.generate([(5 * j + 1) % 256 for j in range(40)], SamplingParams(max_tokens=2))
    w = engine.attention[0]._client
    key = max(w.prefixes, key=lambda k: w.prefixes[k].length)
    length = w.prefixes[key].length
    w.tiers.host_bytes = 2**26  # this deployment has no host tier: one for the test
    try:
        assert w.demote_prefix(key)[1] == [] and w.tiers.tier_of(key) == "host"
        EXPORTER.clear()
        assert (
            w.open_sequence("traced", SamplingParams(max_tokens=1), reserve_tokens=length + 1, prefix_key=key) == length
        )
        w.close_sequence("traced")
    finally:
        w.tiers.host_bytes = 0
    (span,) = [s for s in EXPORTER.get_finished_spans() if s.name == "kv.restore"]
    a = span.attributes
    assert a["expertmesh.kv.tier"] == "host" and a["expertmesh.kv.tokens"] == length and a["expertmesh.kv.bytes"] > 0
