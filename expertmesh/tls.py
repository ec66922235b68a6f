"""TLS / mutual TLS for gRPC (router ↔ workers, public endpoints), certificates from PEM files (a mounted
Kubernetes Secret is files too). A directory layout is also understood, the one `expertmesh up --tls-dir` uses:
ca.crt, server.crt, server.key, client.crt, client.key."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc


def _read(path: str | None, what: str) -> bytes | None:
    if path is None:
        return None
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{what}: {path} is not a readable file")
    return p.read_bytes()


@dataclass(frozen=True)
class ServerTLS:
    cert: str
    key: str
    client_ca: str | None = None      # set → clients must present a certificate signed by it (mTLS)

    def credentials(self) -> grpc.ServerCredentials:
        pair = (_read(self.key, "--tls-key"), _read(self.cert, "--tls-cert"))
        ca = _read(self.client_ca, "--tls-client-ca")
        return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=ca is not None)


@dataclass(frozen=True)
class ClientTLS:
    ca: str                           # verifies the server
    cert: str | None = None           # our certificate, for mTLS
    key: str | None = None
    server_name: str | None = None    # expected name in the server certificate, when it is not the host

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=_read(self.ca, "--worker-tls-ca"),
                                            private_key=_read(self.key, "--worker-tls-key"),
                                            certificate_chain=_read(self.cert, "--worker-tls-cert"))

    def options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


def server_tls_from_dir(d: str | Path, mutual: bool = True) -> ServerTLS:
    d = Path(d)
    return ServerTLS(str(d / "server.crt"), str(d / "server.key"), str(d / "ca.crt") if mutual else None)


def client_tls_from_dir(d: str | Path) -> ClientTLS:
    d = Path(d)
    return ClientTLS(str(d / "ca.crt"), str(d / "client.crt"), str(d / "client.key"))
