"""One chat request across a 1×2 multi-process deployment yields one trace whose spans, exported over OTLP/HTTP
by every process to a receiver started here on loopback, form the expected tree across processes."""

import gzip
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import openai
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

from expertmesh.entry.cluster import LocalCluster, free_port

pytestmark = pytest.mark.slow


class Receiver:
    """A minimal OTLP/HTTP trace receiver: decodes ExportTraceServiceRequest bodies into plain span dicts."""

    def __init__(self):
        self.spans: list[dict] = []
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                req = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
                for rs in req.resource_spans:
                    res = {a.key: a.value.string_value for a in rs.resource.attributes}
                    for ss in rs.scope_spans:
                        for s in ss.spans:
                            attrs = {a.key: (a.value.string_value or a.value.int_value) for a in s.attributes}
                            with outer.lock:
                                outer.spans.append(
                                    {
                                        "name": s.name,
                                        "trace": s.trace_id.hex(),
                                        "id": s.span_id.hex(),
                                        "parent": s.parent_span_id.hex(),
                                        "service": res["service.name"],
                                        "attrs": attrs,
                                        "resource": res,
                                    }
                                )
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.end_headers()
                self.wfile.write(trace_service_pb2.ExportTraceServiceResponse().SerializeToString())

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def test_one_trace_across_router_and_workers(tmp_path, monkeypatch, tiny_checkpoint_dir):
    receiver = Receiver()
    for k, v in {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{receiver.port}",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_BSP_SCHEDULE_DELAY": "100",
        "EXPERTMESH_TRACE_LAYER_EVERY": "1",
    }.items():
        monkeypatch.setenv(k, v)  # `up` passes the OTEL_* environment to every process it starts
    ck = tiny_checkpoint_dir
    with LocalCluster(ck, attention_workers=1, expert_workers=2, http_port=free_port(), grpc_port=free_port()) as c:
        client = openai.OpenAI(base_url=c.http_url + "/v1", api_key="x", max_retries=0)
        r = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "trace across"}],
            max_tokens=4,
            temperature=0,
            reasoning_effort="low",
        )
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            with receiver.lock:
                roots = [s for s in receiver.spans if s["name"] == "chat tiny"]
                workers = {
                    s["resource"].get("expertmesh.worker")
                    for s in receiver.spans
                    if s["service"] == "expertmesh-worker"
                }
            if roots and len(workers) == 3:
                break
            time.sleep(0.2)
    receiver.server.shutdown()
    spans = receiver.spans
    (root,) = [s for s in spans if s["name"] == "chat tiny"]
    trace = [s for s in spans if s["trace"] == root["trace"]]
    by_id = {s["id"]: s for s in trace}
    assert root["service"] == "expertmesh-router" and root["parent"] == ""
    assert root["attrs"]["gen_ai.operation.name"] == "chat" and root["attrs"]["gen_ai.request.model"] == "tiny"
    assert root["attrs"]["gen_ai.usage.output_tokens"] == r.usage.completion_tokens
    assert root["attrs"]["gen_ai.usage.input_tokens"] == r.usage.prompt_tokens
    # every span of the trace hangs off the root through its parents
    for s in trace:
        seen, cur = 0, s
        while cur["parent"]:
            cur = by_id[cur["parent"]]
            seen += 1
            assert seen < 20
        assert cur is root
    server_spans = [s for s in trace if s["service"] == "expertmesh-worker"]
    assert {s["resource"]["expertmesh.worker"] for s in server_spans} == {"attention-0", "expert-0", "expert-1"}
    assert {s["resource"]["expertmesh.role"] for s in server_spans} == {"attention", "expert"}
    for s in server_spans:
        parent = by_id[s["parent"]]
        if s["name"] == "worker.RunStep":  # attention worker's step ← router client span ← the step span
            assert parent["service"] == "expertmesh-router" and parent["name"] == "attention.run_step"
            assert by_id[parent["parent"]]["name"] == "step"
        elif s["name"] == "expert_exchange":  # one per MoE layer, inside the attention worker's step
            assert parent["name"] == "worker.RunStep" and s["resource"]["expertmesh.worker"] == "attention-0"
        else:  # expert call ← the attention worker's exchange of that layer
            assert s["name"] == "worker.RunExperts" and s["resource"]["expertmesh.role"] == "expert"
            assert parent["name"] == "expert_exchange" and parent["resource"]["expertmesh.worker"] == "attention-0"
            assert by_id[parent["parent"]]["name"] == "worker.RunStep"
    names = {s["name"] for s in trace}
    assert {
        "queue",
        "prefill_chunk",
        "decode_step",
        "step",
        "attention.run_step",
        "worker.RunStep",
        "expert_exchange",
        "worker.RunExperts",
    } <= names
