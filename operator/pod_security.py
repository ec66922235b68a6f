"""Pods that cannot reach the node: the restricted Pod Security Standard on every pod the operator renders, and the
node directories (hostPath volumes) a spec may name — only under the allow-list the cluster admin gives the operator
(`--allowed-host-paths`, the chart's `operator.allowedHostPaths`). Pure.

Every pod runs as the image's non-root user (the Dockerfile's `USER 10001:10001`) with the runtime's default seccomp
profile; every container without privilege escalation, with every capability dropped and a read-only root file
system — what the processes write goes to volumes: an emptyDir at /tmp (HOME in the image: Python's, Triton's and
torch's caches), the checkpoint cache and the KV disk tier. GPUs come through the device plugin's resources
(`nvidia.com/gpu`), never through privileges.
"""

from __future__ import annotations

import posixpath
from pathlib import PurePosixPath

from expertmesh.operator.spec import MoEDeploymentSpec

IMAGE_USER = 10001  # the Dockerfile's USER (uid and gid): numeric, so the kubelet can verify runAsNonRoot
TMP_VOLUME = "tmp"
TMP_MOUNT = "/tmp"
TMP_SIZE = "4Gi"  # torch's and Triton's compile caches land here; past it the pod is evicted, not the node filled

# what the chart's operator.allowedHostPaths defaults to: the node directory spec.model.checkpoint.cache.hostPath
# defaults to (spec_model.CheckpointCache)
DEFAULT_CACHE_HOST_PATH = "/var/cache/expertmesh"
DEFAULT_ALLOWED_HOST_PATHS = (DEFAULT_CACHE_HOST_PATH,)


def pod_security_context() -> dict:
    """The pod-level half of the restricted profile. fsGroup makes the volumes the processes write (PVCs, emptyDirs)
    and the Secrets they read (mode 0400 → 0440, group IMAGE_USER) theirs; OnRootMismatch skips the recursive
    ownership walk of a volume already owned (a checkpoint PVC holds thousands of files)."""
    return {
        "runAsNonRoot": True,
        "runAsUser": IMAGE_USER,
        "runAsGroup": IMAGE_USER,
        "fsGroup": IMAGE_USER,
        "fsGroupChangePolicy": "OnRootMismatch",
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def container_security_context() -> dict:
    """The container-level half: every container of every pod (init containers too)."""
    return {
        "allowPrivilegeEscalation": False,
        "privileged": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
    }


def tmp_volume() -> tuple[dict, dict]:
    """(volume, mount) of the writable /tmp every container gets under its read-only root file system."""
    return (
        {"name": TMP_VOLUME, "emptyDir": {"sizeLimit": TMP_SIZE}},
        {"name": TMP_VOLUME, "mountPath": TMP_MOUNT},
    )


# ------------------------------------------------------------------------------------------------ host paths
def normalised(path: str) -> str | None:
    """`path` as the node would resolve it lexically (no symlinks: the operator cannot see the node), or None when
    it is not absolute or a `..` would climb above the root."""
    if not path.startswith("/") or "\x00" in path:
        return None
    parts: list[str] = []
    for part in path.split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            if not parts:
                return None
            parts.pop()
            continue
        parts.append(part)
    return "/" + "/".join(parts)


def parse_allowed_host_paths(text: str) -> tuple[str, ...]:
    """The operator's `--allowed-host-paths` (comma-separated absolute paths; empty: none allowed), each normalised.
    Raises ValueError naming the entry that is not an absolute path."""
    out = []
    for entry in (e.strip() for e in text.split(",")):
        if not entry:
            continue
        norm = normalised(entry)
        if norm is None:
            raise ValueError(f"--allowed-host-paths: {entry!r} is not an absolute path (no '..' above the root)")
        out.append(norm)
    return tuple(dict.fromkeys(out))


def host_path_allowed(path: str, allowed: tuple[str, ...]) -> bool:
    """Whether `path`, normalised, is one of `allowed` or below one — compared by whole components, so
    /var/cache/expertmesh allows /var/cache/expertmesh/models but not /var/cache/expertmesh-evil."""
    norm = normalised(path)
    if norm is None:
        return False
    parts = PurePosixPath(norm).parts
    for root in allowed:
        root_parts = PurePosixPath(posixpath.normpath(root)).parts
        if parts[: len(root_parts)] == root_parts:
            return True
    return False


def host_paths(spec: MoEDeploymentSpec) -> list[tuple[str, str]]:
    """(field, path) of every node directory the spec would mount: the checkpoint cache (a fetched checkpoint without
    a cache PVC) and the KV disk tier's hostPath."""
    out = []
    ck = spec.model.checkpoint
    if ck.fetched and ck.cache.claim_name is None:
        out.append(("spec.model.checkpoint.cache.hostPath", ck.cache.host_path))
    if spec.kv.disk is not None and spec.kv.disk.host_path is not None:
        out.append(("spec.kv.disk.hostPath", spec.kv.disk.host_path))
    return out


def host_path_error(spec: MoEDeploymentSpec, allowed: tuple[str, ...]) -> str | None:
    """What is wrong with the spec's node directories under the admin's allow-list (None: nothing), naming the
    field, the path and what is allowed."""
    for field, path in host_paths(spec):
        if not host_path_allowed(path, allowed):
            where = ", ".join(allowed) if allowed else "none: the operator was started with an empty allow-list"
            return (
                f"{field}={path[:200]!r}: not under a node directory the cluster admin allows for hostPath "
                f"volumes (the operator's --allowed-host-paths, the chart's operator.allowedHostPaths: {where}); "
                f"use one of them or a PersistentVolumeClaim"
            )
    return None
