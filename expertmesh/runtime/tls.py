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
    client_ca: str | None = None  # set → clients must present a certificate signed by it (mTLS)

    def credentials(self) -> grpc.ServerCredentials:
        pair = (_read(self.key, "--tls-key"), _read(self.cert, "--tls-cert"))
        ca = _read(self.client_ca, "--tls-client-ca")
        return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=ca is not None)


@dataclass(frozen=True)
class ClientTLS:
    ca: str  # verifies the server
    cert: str | None = None  # our certificate, for mTLS
    key: str | None = None
    server_name: str | None = None  # expected name in the server certificate, when it is not the host

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca, "--worker-tls-ca"),
            private_key=_read(self.key, "--worker-tls-key"),
            certificate_chain=_read(self.cert, "--worker-tls-cert"),
        )

    def options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


def server_tls_from_dir(d: str | Path, mutual: bool = True) -> ServerTLS:
    d = Path(d)
    return ServerTLS(str(d / "server.crt"), str(d / "server.key"), str(d / "ca.crt") if mutual else None)


def client_tls_from_dir(d: str | Path) -> ClientTLS:
    d = Path(d)
    return ClientTLS(str(d / "ca.crt"), str(d / "client.crt"), str(d / "client.key"))


def pki_pems(hosts: tuple[str, ...] = ("127.0.0.1", "localhost"), days: int = 30) -> dict[str, bytes]:
    """A fresh CA and a server + client certificate signed by it, as PEM bytes by file name (the `--tls-dir`
    layout: ca.crt, ca.key, server.crt/key, client.crt/key). `hosts`: the server certificate's names (IP addresses,
    DNS names, `*.` wildcards). Pure apart from randomness: `up` writes it to a directory, the operator into a
    Secret."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)
    out: dict[str, bytes] = {}

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def put(stem: str, key, cert) -> None:
        out[f"{stem}.key"] = key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        out[f"{stem}.crt"] = cert.public_bytes(serialization.Encoding.PEM)

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(name("expertmesh ephemeral CA"))
        .issuer_name(name("expertmesh ephemeral CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    put("ca", ca_key, ca)
    sans = [
        x509.IPAddress(ipaddress.ip_address(h)) if h.replace(".", "").isdigit() or ":" in h else x509.DNSName(h)
        for h in hosts
    ]
    for stem, usage in (("server", ExtendedKeyUsageOID.SERVER_AUTH), ("client", ExtendedKeyUsageOID.CLIENT_AUTH)):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            x509.CertificateBuilder()
            .subject_name(name(f"expertmesh {stem}"))
            .issuer_name(ca.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .sign(ca_key, hashes.SHA256())
        )
        put(stem, key, cert)
    return out


def ephemeral_pki(d: str | Path, hosts: tuple[str, ...] = ("127.0.0.1", "localhost"), days: int = 30) -> Path:
    """Write pki_pems(hosts, days) into `d` (the `--tls-dir` layout), keys readable by the owner only. What
    `expertmesh up` uses by default so that no other local process can call its workers (mutual TLS: a caller
    needs the client key)."""
    import os

    d = Path(d)
    d.mkdir(parents=True, exist_ok=True)
    os.chmod(d, 0o700)
    for file, pem in pki_pems(hosts, days).items():
        (d / file).write_bytes(pem)
        if file.endswith(".key"):
            os.chmod(d / file, 0o600)
    return d
