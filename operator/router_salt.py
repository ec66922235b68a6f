"""The router replicas' shared prefix-key salt: the deployment's `N-router-salt` Secret and the router's flag.

With `spec.router.replicas` > 1 every router pod mounts the Secret at naming.ROUTER_SALT_DIR and runs with
`--prefix-salt-file`: the replicas salt their prefix keys alike, so each hits the prefixes the others saved on the
attention workers (docs/data-plane.md, "KV tiers"). The handler creates the Secret once, with random bytes, and
never rebuilds it: a new salt would orphan every cached prefix and split running replicas. One router keeps its
own random salt (no Secret, no flag).
"""

from __future__ import annotations

import base64

from expertmesh.operator.naming import COMPONENT_ROUTER, ROUTER_SALT_DIR, object_meta, router_salt_secret_name
from expertmesh.operator.spec import MoEDeploymentSpec

SALT_KEY = "salt"
SALT_BYTES = 32


def shares_salt(spec: MoEDeploymentSpec) -> bool:
    """Whether the router replicas need the shared salt (more than one of them)."""
    return spec.router.replicas > 1


def router_salt_secret(name: str, namespace: str, spec: MoEDeploymentSpec, salt: bytes) -> dict:
    """The Secret holding `salt` (os.urandom(SALT_BYTES) when the handler makes it)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": object_meta(router_salt_secret_name(name), namespace, COMPONENT_ROUTER, spec, instance=name),
        "data": {SALT_KEY: base64.b64encode(salt).decode()},
    }


def router_salt_volume(name: str, spec: MoEDeploymentSpec) -> tuple[list[dict], list[dict], list[str]]:
    """(volumes, volume mounts, router flags) for the shared salt; all empty with one router replica."""
    if not shares_salt(spec):
        return [], [], []
    return (
        [{"name": "router-salt", "secret": {"secretName": router_salt_secret_name(name), "defaultMode": 0o400}}],
        [{"name": "router-salt", "mountPath": ROUTER_SALT_DIR, "readOnly": True}],
        ["--prefix-salt-file", f"{ROUTER_SALT_DIR}/{SALT_KEY}"],
    )
