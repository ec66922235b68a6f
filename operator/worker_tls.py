"""Worker mutual TLS: the deployment's `N-worker-tls` Secret and each role's TLS flags (spec.security.workerTLS).

The handler creates the Secret once (a CA, a server certificate for the workers' DNS names, a client certificate)
and never rebuilds it from the spec: new certificates would split running pods into two trust domains. Every pod
mounts it at naming.WORKER_TLS_DIR.
"""

from __future__ import annotations

import base64

from expertmesh.operator.naming import (
    WORKER_TLS_DIR,
    attention_name,
    expert_name,
    object_meta,
    prefill_name,
    worker_tls_secret_name,
)
from expertmesh.operator.spec import MoEDeploymentSpec


def worker_tls_hosts(name: str, namespace: str) -> tuple[str, ...]:
    """The names the workers are reached by (naming.pod_dns): any pod of the attention, prefill (whether or not the
    spec has a prefill pool yet: the Secret is made once) and expert headless Services."""
    return tuple(f"*.{sts}.{namespace}.svc" for sts in (attention_name(name), prefill_name(name), expert_name(name)))


def missing_hosts(secret: dict, hosts: tuple[str, ...]) -> list[str]:
    """The `hosts` the Secret's server certificate does not name (a Secret made before the prefill pool's name was
    in it: delete it and restart the pods to re-issue)."""
    from cryptography import x509  # only when a Secret is checked

    pem = base64.b64decode(((secret or {}).get("data") or {}).get("server.crt", ""))
    try:
        cert = x509.load_pem_x509_certificate(pem)
        names = set(
            cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
        )
    except (ValueError, x509.ExtensionNotFound):
        names = set()
    return [h for h in hosts if h not in names]


def worker_tls_secret(name: str, namespace: str, spec: MoEDeploymentSpec, pems: dict[str, bytes]) -> dict:
    """The Secret holding `pems` (expertmesh.runtime.tls.pki_pems(worker_tls_hosts(...))). Everything but the CA key, which
    only signs and is not needed once the certificates exist."""
    data = {k: base64.b64encode(v).decode() for k, v in sorted(pems.items()) if k != "ca.key"}
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": object_meta(worker_tls_secret_name(name), namespace, "worker-tls", spec, instance=name),
        "data": data,
    }


def worker_tls_args(spec: MoEDeploymentSpec, role: str) -> list[str]:
    """Flags for mutual TLS on every worker RPC: workers serve with the server certificate and require a client
    certificate of the deployment's CA; the router and the attention workers (callers of the expert workers) present
    the client certificate. Empty with spec.security.workerTLS false."""
    if not spec.security.worker_tls:
        return []
    d = WORKER_TLS_DIR
    serve = ["--tls-cert", f"{d}/server.crt", "--tls-key", f"{d}/server.key", "--tls-client-ca", f"{d}/ca.crt"]
    call = {"router": "--worker-tls", "attention": "--expert-tls"}.get(role)
    client = (
        [f"{call}-ca", f"{d}/ca.crt", f"{call}-cert", f"{d}/client.crt", f"{call}-key", f"{d}/client.key"]
        if call
        else []
    )
    return client if role == "router" else serve + client
