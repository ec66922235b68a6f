"""`expertmesh up --epp-port N`: the router process serves the Endpoint Picker beside its HTTP and gRPC APIs. A real
ext_proc client (Envoy's part) asks it where a chat request goes; the answer names the router's own HTTP address
(one replica, no --epp-replicas); the request then sent there is answered — the whole path a gateway takes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from expertmesh.entry.cluster import free_port
from expertmesh.protos import ext_proc_pb2 as pb
from expertmesh.protos import ext_proc_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow  # a whole `up` (router + workers as processes): ~20 s
DEST = "x-gateway-destination-endpoint"


def start_up(ckpt_dir, http_port: int, grpc_port: int, epp_port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "expertmesh.entry.cli", "up", "--checkpoint", str(ckpt_dir)]
    cmd += ["--expert-workers", "1", "--transport", "grpc", "--insecure-workers", "--threads", "1"]
    cmd += ["--http-port", str(http_port), "--grpc-port", str(grpc_port), "--epp-port", str(epp_port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline, seen = time.monotonic() + 90, []
    for line in proc.stdout:
        seen.append(line)
        if "endpoint picker (Envoy ext_proc)" in line:
            return proc
        if time.monotonic() > deadline:
            break
    os.killpg(proc.pid, signal.SIGKILL)
    raise AssertionError("expertmesh up did not announce the endpoint picker:\n" + "".join(seen[-30:]))


def test_up_serves_the_endpoint_picker(tiny_checkpoint_dir):
    http_port, grpc_port, epp_port = free_port(), free_port(), free_port()
    proc = start_up(tiny_checkpoint_dir, http_port, grpc_port, epp_port)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{epp_port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            for name in ("liveness", "readiness"):
                assert health.Check(health_pb2.HealthCheckRequest(service=name), timeout=10).status == 1, name
            body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
            hmap = pb.HeaderMap(headers=[pb.HeaderValue(key=":path", raw_value=b"/v1/chat/completions")])
            requests = [
                pb.ProcessingRequest(
                    request_headers=pb.HttpHeaders(headers=hmap),
                    protocol_config=pb.ProtocolConfiguration(request_body_mode=pb.ProcessingMode.FULL_DUPLEX_STREAMED),
                ),
                pb.ProcessingRequest(request_body=pb.HttpBody(body=json.dumps(body).encode(), end_of_stream=True)),
            ]
            answers = list(pb_grpc.ExternalProcessorStub(channel).Process(iter(requests), timeout=20))
        (option,) = answers[0].request_headers.response.header_mutation.set_headers
        assert option.header.key == DEST
        endpoint = option.header.raw_value.decode()
        assert endpoint == f"127.0.0.1:{http_port}"
        assert answers[1].request_body.response.body_mutation.streamed_response.body == json.dumps(body).encode()
        r = httpx.post(f"http://{endpoint}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["role"] == "assistant"
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
