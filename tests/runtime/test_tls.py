"""Mutual TLS between router and workers, TLS on the public endpoints; a client without a certificate is refused."""

import ssl
import subprocess

import grpc
import httpx
import pytest

from expertmesh.entry.cluster import LocalCluster, free_port
from expertmesh.protos import worker_pb2, worker_pb2_grpc

pytestmark = pytest.mark.slow


def make_certs(d):
    """A CA, a server certificate for 127.0.0.1/localhost and a client certificate, with the openssl CLI."""

    def ssl(*args):
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)

    ssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
        "-days",
        "2",
        "-subj",
        "/CN=expertmesh-test-ca",
    )
    (d / "san.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name, ext in (("server", ["-extfile", "san.cnf"]), ("client", [])):
        ssl(
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            f"{name}.key",
            "-out",
            f"{name}.csr",
            "-subj",
            f"/CN=expertmesh-{name}",
        )
        ssl(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            f"{name}.crt",
            "-days",
            "2",
            *ext,
        )
    return d


def test_mtls_deployment_serves_and_refuses_clients_without_certificates(tmp_path, tiny_checkpoint_dir):
    ck = tiny_checkpoint_dir
    certs = make_certs(tmp_path)
    with LocalCluster(
        ck, attention_workers=1, expert_workers=1, http_port=free_port(), grpc_port=free_port(), tls_dir=certs
    ) as cluster:
        assert cluster.http_url.startswith("https://")
        r = httpx.post(
            cluster.http_url + "/v1/completions",
            verify=ssl.create_default_context(cafile=str(certs / "ca.crt")),
            json={"model": "tiny", "prompt": "secure", "max_tokens": 4, "temperature": 0},
            timeout=60,
        )
        assert r.status_code == 200 and 1 <= r.json()["usage"]["completion_tokens"] <= 4
        with pytest.raises(httpx.HTTPError):  # plain HTTP to the TLS port fails
            httpx.get(cluster.http_url.replace("https", "http") + "/health", timeout=5)
        worker = cluster.child("expert-0").address
        ca = (certs / "ca.crt").read_bytes()
        # verifies the server but presents no client certificate → the handshake is refused
        with grpc.secure_channel(worker, grpc.ssl_channel_credentials(root_certificates=ca)) as ch:
            with pytest.raises(grpc.RpcError) as e:
                worker_pb2_grpc.ExpertWorkerStub(ch).Info(worker_pb2.InfoRequest(), timeout=5)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        with grpc.insecure_channel(worker) as ch:  # no TLS at all → refused too
            with pytest.raises(grpc.RpcError):
                worker_pb2_grpc.ExpertWorkerStub(ch).Info(worker_pb2.InfoRequest(), timeout=5)
        creds = grpc.ssl_channel_credentials(
            root_certificates=ca,
            private_key=(certs / "client.key").read_bytes(),
            certificate_chain=(certs / "client.crt").read_bytes(),
        )
        with grpc.secure_channel(worker, creds) as ch:  # with the client certificate it answers
            info = worker_pb2_grpc.ExpertWorkerStub(ch).Info(worker_pb2.InfoRequest(), timeout=5)
            assert info.name == "expert-0"


def test_health_port_is_plaintext_health_only_while_the_worker_port_requires_mtls(tmp_path, tiny_checkpoint_dir):
    """What a Kubernetes `grpc:` probe does (plaintext, no certificate) reaches Health on --health-port and gets
    SERVING; the same raw client is refused on the worker's real port, and the health port serves nothing else."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from expertmesh.runtime.tls import ephemeral_pki, server_tls_from_dir
    from expertmesh.worker.server import serve, shutdown

    ck = tiny_checkpoint_dir
    server = serve("expert", ck, 0, tls=server_tls_from_dir(ephemeral_pki(tmp_path / "pki")), health_port=0)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.health_port}") as ch:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            with pytest.raises(grpc.RpcError) as e:  # only Health lives on the health port
                worker_pb2_grpc.ExpertWorkerStub(ch).Info(worker_pb2.InfoRequest(), timeout=5)
            assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
            for call in (
                lambda: health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5),
                lambda: worker_pb2_grpc.ExpertWorkerStub(ch).Info(worker_pb2.InfoRequest(), timeout=5),
            ):
                with pytest.raises(grpc.RpcError) as e:
                    call()
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        server.health.enter_graceful_shutdown()  # the probe sees what the real port reports
        with grpc.insecure_channel(f"127.0.0.1:{server.health_port}") as ch:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        shutdown(server, 0)
