"""The deployment's prefix-key salt: the `N-router-salt` Secret, the router's flag, and the attention workers' disk
tier key derived from it.

With `spec.router.replicas` > 1 every router pod mounts the Secret at naming.ROUTER_SALT_DIR and runs with
`--prefix-salt-file`: the replicas salt their prefix keys alike, so each hits the prefixes the others saved on the
attention workers (docs/data-plane.md, "KV tiers"). With `spec.kv.disk` every attention pod with a disk tier mounts
the same Secret at KV_DISK_KEY_DIR and runs with `--kv-disk-key-file`: its tier files are authenticated under a key
derived from it (worker/kv_tiers.py), held by the deployment, not by the disk — a restarted worker keeps its files,
and whoever can write the disk cannot forge one. The handler creates the Secret once (either case), with random
bytes, and never rebuilds it: a new salt would orphan every cached prefix and split running replicas. One router
without a disk tier keeps its own random salt (no Secret, no flag).
"""

from __future__ import annotations

import base64

from expertmesh.operator.naming import COMPONENT_ROUTER, ROUTER_SALT_DIR, object_meta, router_salt_secret_name
from expertmesh.operator.spec import MoEDeploymentSpec

SALT_KEY = "salt"
SALT_BYTES = 32


KV_DISK_KEY_DIR = "/etc/expertmesh-kv-disk-key"  # the N-router-salt Secret, in the attention pods with a disk tier
KV_DISK_KEY_VOLUME = "kv-disk-key"


def shares_salt(spec: MoEDeploymentSpec) -> bool:
    """Whether the deployment has the salt Secret: its router replicas share it (more than one of them), or its
    attention workers key their disk tier's files (spec.kv.disk) or the cluster store's objects (spec.kv.store) with
    it."""
    return routers_share_salt(spec) or spec.kv.disk is not None or spec.kv.store is not None


def routers_share_salt(spec: MoEDeploymentSpec) -> bool:
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
    if not routers_share_salt(spec):
        return [], [], []
    return (
        [{"name": "router-salt", "secret": {"secretName": router_salt_secret_name(name), "defaultMode": 0o400}}],
        [{"name": "router-salt", "mountPath": ROUTER_SALT_DIR, "readOnly": True}],
        ["--prefix-salt-file", f"{ROUTER_SALT_DIR}/{SALT_KEY}"],
    )


def kv_disk_key_volume(name: str, disk) -> tuple[list[dict], list[dict]]:
    """(volumes, volume mounts) of an attention pod whose pool has a disk tier (`disk`: pools.PoolKV.disk, None:
    none): the salt Secret, read-only, its file readable by its owner alone."""
    if disk is None:
        return [], []
    return (
        [{"name": KV_DISK_KEY_VOLUME, "secret": {"secretName": router_salt_secret_name(name), "defaultMode": 0o400}}],
        [{"name": KV_DISK_KEY_VOLUME, "mountPath": KV_DISK_KEY_DIR, "readOnly": True}],
    )


def kv_disk_key_args(disk) -> list[str]:
    """The attention worker's `--kv-disk-key-file` when its pool has a disk tier."""
    return [] if disk is None else ["--kv-disk-key-file", f"{KV_DISK_KEY_DIR}/{SALT_KEY}"]
