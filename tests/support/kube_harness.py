"""A node for kmock's Kubernetes emulator: the workload controllers and a kubelet that run pods as local processes.

`LocalNode` plays, for the objects in one namespace of the emulator (`support.kopf_cluster.Emulator`):
  - the StatefulSet controller: pods `<sts>-<i>` for i < replicas from the pod template (labels, annotations,
    owner reference, hostname/subdomain); a missing pod is recreated under the same name; RollingUpdate: once
    every pod is Ready, the highest-ordinal pod of an older template is deleted (and so recreated), one at a time;
    ordinals >= replicas are deleted;
  - the Deployment controller: pods `<deploy>-<template hash>-<suffix>`; new-template pods are created up to
    `replicas` (surge) and the old-template pods deleted once that many new ones are Ready;
  - the kubelet of node `LocalNode.NODE` (every pod the controllers create is bound to it): it starts each pod's
    single container as a process — command + args with Kubernetes' `$(VAR)` expansion over the container env
    (fieldRefs metadata.name / metadata.namespace / status.podIP), HOSTNAME = the pod's hostname, volumes mapped to
    host directories (a ConfigMap or Secret volume materialised from its data at start, a PVC volume from
    `volumes[claimName]`), the image's `expertmesh` entry point = this checkout's `python -m expertmesh.entry.cli`, a
    `/bin/sh -c` script run by the real /bin/sh; init containers run first, one after the other, each to
    completion (a failed one is restarted with the back-off; the pod is Pending with `initContainerStatuses`
    meanwhile; a hostPath volume is a directory of the node, shared by its pods; a ConfigMap volume follows its
    ConfigMap while the container runs, each changed key replaced atomically). Networking is loopback: `0.0.0.0` → `127.0.0.1`; the value of
    every `--*port` flag naming a declared containerPort → a loopback port of its own, reserved per (pod name,
    port) so a StatefulSet pod keeps its address across recreation (stable network identity); cluster DNS names
    in arguments (`<pod>.<svc>.<ns>.svc:<port>`, `<svc>.<ns>.svc:<port>`) → 127.0.0.1:<that pod's port>.
    The pod is Running once started and Ready (conditions + containerStatuses) once the process prints its
    `READY ...` line. A pod that disappears (deleted) has its process SIGKILLed — a pod loss, not a graceful
    termination. A process that exits on its own is marked not Ready and restarted with a (short) back-off, as
    restartPolicy Always does (CrashLoopBackOff, compressed to `backoff`).
`stop()` SIGTERMs every process (router pods first, so no request finds its workers gone), SIGKILLs what is left
after `grace`, and `orphans()` lists every process group that still has a live member.

Everything runs as a task in the event loop that serves the emulator; its reads come from the emulator's memory,
its writes go through the emulator's HTTP API (as a real controller's and kubelet's would).
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import datetime
import json
import os
import re
import secrets
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import kmock

from expertmesh.entry.cluster import free_port
from expertmesh.operator.naming import COMPONENT_ROUTER, LABEL_COMPONENT, TEMPLATE_HASH_ANNOTATION
from expertmesh.runtime.tls import client_tls_from_dir

_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
_DNS_ADDRESS = re.compile(r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?\.)+svc(\.cluster\.local)?:\d+$")


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' `$(VAR)` expansion of command/args/env values: known variables are replaced, `$$` is a
    literal `$`, unknown references stay as written."""

    def sub(mt: re.Match) -> str:
        if mt.group(0) == "$$":
            return "$"
        return env.get(mt.group(1), mt.group(0))

    return _VAR.sub(sub, text)


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _plain(x):
    return json.loads(json.dumps(x, default=dict))


@dataclass
class Process:
    """One run of a pod's container."""

    pod: str
    uid: str
    component: str
    argv: list[str]
    popen: subprocess.Popen
    restarts: int = 0
    lines: list[str] = field(default_factory=list)
    address: str = ""  # from the `READY <role> host:port` line
    marked_ready: bool = False  # the pod's Ready condition has been set for this run
    exit_reported: bool = False  # the pod has been marked not Ready after this run exited
    restart_at: float = 0.0  # monotonic time of the next start after an exit (back-off)
    killed: bool = False  # SIGKILLed because its pod went away
    container: str = ""  # the container's name
    init: bool = False  # an init container (run to completion before the next one)
    last_failure: str = ""  # the previous run's termination message, when it failed
    inits_done: tuple = ()  # names of the init containers that completed before this one
    configmaps: tuple = ()  # (ConfigMap name, host directory) of its ConfigMap volumes

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    def tail(self, n: int = 30) -> str:
        return "\n".join(self.lines[-n:])


class LocalNode:
    NODE = "local-node"

    def __init__(
        self,
        emu,
        namespace: str,
        run_dir: Path,
        volumes: dict[str, Path] | None = None,
        *,
        tick: float = 0.1,
        backoff: tuple[float, ...] = (0.5, 1.0, 2.0, 4.0),
        env: dict[str, str] | None = None,
        echo: bool = False,
    ):
        self.emu, self.ns = emu, namespace
        self.run_dir = Path(run_dir)
        self.volumes = {k: Path(v) for k, v in (volumes or {}).items()}  # PVC claimName → host directory
        self.tick, self.backoff = tick, backoff
        self.extra_env = dict(env or {})
        self.echo = echo
        self.ports: dict[tuple[str, int], int] = {}  # (pod name, container port) → loopback port
        self.running: dict[str, Process] = {}  # pod name → its current process
        self.history: list[Process] = []  # every process ever started, in order
        self.stage: dict[str, int] = {}  # pod uid → index of its running container (inits first)
        self.errors: list[str] = []  # unexpected failures of the loop (a test asserts none)
        self._task: asyncio.Task | None = None
        self._stopping = False

    # ------------------------------------------------------------------ lifecycle
    async def __aenter__(self) -> LocalNode:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._task = asyncio.create_task(self._loop(), name="local-node")
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    async def _loop(self) -> None:
        while not self._stopping:
            try:
                await self._controllers()
                await self._kubelet()
                self._sync_configmaps()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # keep the node running; the test sees what went wrong
                if len(self.errors) < 50:
                    self.errors.append(f"{type(e).__name__}: {e}")
            await asyncio.sleep(self.tick)

    async def stop(self, grace: float = 15.0) -> list[Process]:
        """Stop reconciling, then SIGTERM the router processes, then the workers; SIGKILL after `grace`.
        Returns every process ever started."""
        self._stopping = True
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        routers = [p for p in self.running.values() if p.component == COMPONENT_ROUTER]
        others = [p for p in self.running.values() if p.component != COMPONENT_ROUTER]
        for wave in (routers, others):
            for p in wave:
                if p.alive:
                    p.popen.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + grace
            for p in wave:
                try:
                    await asyncio.to_thread(p.popen.wait, max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    p.popen.kill()
                    await asyncio.to_thread(p.popen.wait)
        return list(self.history)

    def kill_all(self) -> None:
        """Last resort (a failing test): SIGKILL every process group still alive."""
        for p in self.history:
            try:
                os.killpg(p.popen.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            if p.popen.poll() is None:
                p.popen.wait()

    def orphans(self) -> list[str]:
        """Processes (by pod and pid) whose process group still has a live member."""
        out = []
        for p in self.history:
            try:
                os.killpg(p.popen.pid, 0)
                out.append(f"{p.pod} pid {p.popen.pid}")
            except ProcessLookupError:
                pass
        return out

    # ------------------------------------------------------------------ reading the emulator
    def _objects(self, resource: str) -> list[dict]:
        res = kmock.resource(resource)
        return [
            _plain(obj.raw)
            for (r, ns, _), obj in list(self.emu.objects.items())
            if r == res and ns == self.ns and not obj.deleted
        ]

    def _get(self, resource: str, name: str) -> dict | None:
        key = (kmock.resource(resource), self.ns, name)
        if key not in self.emu.objects or self.emu.objects[key].deleted:
            return None
        return _plain(self.emu.objects[key].raw)

    def pods(self) -> dict[str, dict]:
        return {p["metadata"]["name"]: p for p in self._objects("v1/pods")}

    @staticmethod
    def _ready(pod: dict) -> bool:
        return any(
            c.get("type") == "Ready" and c.get("status") == "True"
            for c in (pod.get("status") or {}).get("conditions") or []
        )

    @staticmethod
    def _template_hash(obj: dict) -> str | None:
        return ((obj.get("metadata") or {}).get("annotations") or {}).get(TEMPLATE_HASH_ANNOTATION)

    # ------------------------------------------------------------------ writing through the API
    async def _request(
        self, method: str, path: str, body=None, ok_missing: bool = False, content_type: str = "application/json"
    ):
        call = getattr(self.emu, method)
        kw = {} if body is None else {"json": body, "headers": {"Content-Type": content_type}}
        async with call(path, **kw) as r:
            if r.status == 404 and ok_missing:  # raced with a deletion: the next tick sees the new state
                return None
            if r.status >= 300:
                raise RuntimeError(f"{method.upper()} {path}: {r.status} {await r.text()}")
            return await r.json()

    def _pods_path(self, name: str = "") -> str:
        return f"/api/v1/namespaces/{self.ns}/pods" + (f"/{name}" if name else "")

    async def _create_pod(
        self, name: str, owner: dict, template: dict, hostname: str | None = None, subdomain: str | None = None
    ) -> None:
        meta = template.get("metadata") or {}
        spec = dict(template["spec"], nodeName=self.NODE)
        if hostname:
            spec.update(hostname=hostname, subdomain=subdomain)
        body = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name,
                "namespace": self.ns,
                "labels": dict(meta.get("labels") or {}),
                "annotations": dict(meta.get("annotations") or {}),
                "ownerReferences": [
                    {
                        "apiVersion": owner["apiVersion"],
                        "kind": owner["kind"],
                        "name": owner["metadata"]["name"],
                        "uid": owner["metadata"].get("uid", ""),
                        "controller": True,
                    }
                ],
            },
            "spec": spec,
            "status": {"phase": "Pending"},
        }
        await self._request("post", self._pods_path(), body)

    async def delete_pod(self, name: str) -> None:
        await self._request("delete", self._pods_path(name), ok_missing=True)

    async def _patch_pod_status(self, name: str, status: dict) -> None:
        await self._request(
            "patch",
            self._pods_path(name) + "/status",
            {"status": status},
            ok_missing=True,
            content_type="application/merge-patch+json",
        )

    # ------------------------------------------------------------------ controllers
    async def _controllers(self) -> None:
        pods = self.pods()
        for sts in self._objects("apps/v1/statefulsets"):
            await self._statefulset(sts, pods)
        for dep in self._objects("apps/v1/deployments"):
            await self._deployment(dep, pods)

    @staticmethod
    def _selected(pods: dict[str, dict], selector: dict) -> list[dict]:
        want = (selector or {}).get("matchLabels") or {}
        return [
            p for p in pods.values() if all((p["metadata"].get("labels") or {}).get(k) == v for k, v in want.items())
        ]

    async def _statefulset(self, sts: dict, pods: dict[str, dict]) -> None:
        name, spec = sts["metadata"]["name"], sts["spec"]
        replicas, template = spec.get("replicas", 1), spec["template"]
        current = self._template_hash(template)
        mine = {
            p["metadata"]["name"]: p
            for p in self._selected(pods, spec["selector"])
            if p["metadata"]["name"].startswith(f"{name}-")
        }
        for i in range(replicas):
            if f"{name}-{i}" not in mine:
                await self._create_pod(
                    f"{name}-{i}", sts, template, hostname=f"{name}-{i}", subdomain=spec.get("serviceName")
                )
        for pod_name in mine:
            tail = pod_name.rsplit("-", 1)[-1]
            if tail.isdigit() and int(tail) >= replicas:
                await self.delete_pod(pod_name)  # scaled down
        ordered = [mine.get(f"{name}-{i}") for i in range(replicas)]
        if all(p is not None and self._ready(p) for p in ordered):  # rolling update: one pod at a time
            outdated = [p for p in ordered if self._template_hash(p) != current]
            if outdated:
                await self.delete_pod(outdated[-1]["metadata"]["name"])

    async def _deployment(self, dep: dict, pods: dict[str, dict]) -> None:
        name, spec = dep["metadata"]["name"], dep["spec"]
        replicas, template = spec.get("replicas", 1), spec["template"]
        current = self._template_hash(template) or "0"
        mine = self._selected(pods, spec["selector"])
        new = [p for p in mine if self._template_hash(p) == current]
        old = [p for p in mine if self._template_hash(p) != current]
        for _ in range(replicas - len(new)):
            await self._create_pod(f"{name}-{current[:10]}-{secrets.token_hex(3)[:5]}", dep, template)
        for p in sorted(new, key=lambda p: p["metadata"]["name"])[replicas:]:
            await self.delete_pod(p["metadata"]["name"])  # scaled down
        if sum(self._ready(p) for p in new) >= replicas:
            for p in old:
                await self.delete_pod(p["metadata"]["name"])

    # ------------------------------------------------------------------ kubelet
    async def _kubelet(self) -> None:
        pods = {n: p for n, p in self.pods().items() if (p.get("spec") or {}).get("nodeName") == self.NODE}
        for name, proc in list(self.running.items()):  # pods gone: their processes die with them
            pod = pods.get(name)
            if pod is None or pod["metadata"].get("uid") != proc.uid:
                if proc.alive:
                    proc.killed = True
                    proc.popen.kill()
                    await asyncio.to_thread(proc.popen.wait)
                del self.running[name]
        now = time.monotonic()
        for name, pod in pods.items():
            proc = self.running.get(name)
            if proc is None:
                started = self._start(pod)
                if started is not None:
                    await self._patch_pod_status(name, self._status(started, ready=False))
            elif not proc.alive and proc.init and proc.popen.returncode == 0:  # on to the next container
                if not proc.exit_reported:
                    proc.exit_reported = True
                    self.stage[proc.uid] = self.stage.get(proc.uid, 0) + 1
                started = self._start(pod)
                if started is not None:
                    await self._patch_pod_status(name, self._status(started, ready=False))
            elif not proc.alive:
                if not proc.exit_reported:
                    proc.exit_reported = True
                    proc.restart_at = now + self.backoff[min(proc.restarts, len(self.backoff) - 1)]
                    await self._patch_pod_status(name, self._status(proc, ready=False))
                elif now >= proc.restart_at:
                    failure = proc.tail(5)[-1000:] if proc.popen.returncode else ""
                    started = self._start(pod, restarts=proc.restarts + 1, last_failure=failure)
                    if started is not None:
                        await self._patch_pod_status(name, self._status(started, ready=False))
            elif proc.address and not proc.marked_ready:
                proc.marked_ready = True
                await self._patch_pod_status(name, self._status(proc, ready=True))

    def _status(self, proc: Process, ready: bool) -> dict:
        """The pod status a kubelet reports for this run: Running (Ready or not), or the container's exit; while
        an init container runs, Pending with its state (the termination message of a failed run: its last log
        lines, as terminationMessagePolicy FallbackToLogsOnError)."""
        flag = "True" if ready else "False"
        rc = proc.popen.poll()
        if rc is None:
            state = {"running": {"startedAt": _now()}}
        else:
            state = {
                "terminated": {
                    "exitCode": rc if rc >= 0 else 128 - rc,
                    "reason": "Error" if rc else "Completed",
                    "message": proc.tail(5)[-1000:],
                }
            }
        this = {
            "name": proc.container or proc.component,
            "ready": ready,
            "started": rc is None,
            "restartCount": proc.restarts,
            "state": state,
            "image": "local",
            "containerID": f"local://{proc.popen.pid}",
        }
        if proc.last_failure:
            this["lastState"] = {"terminated": {"exitCode": 1, "reason": "Error", "message": proc.last_failure}}
        done = [
            {
                "name": n,
                "ready": True,
                "restartCount": 0,
                "image": "local",
                "state": {"terminated": {"exitCode": 0, "reason": "Completed"}},
            }
            for n in proc.inits_done
        ]
        out = {
            "phase": "Pending" if proc.init else "Running",
            "podIP": "127.0.0.1",
            "hostIP": "127.0.0.1",
            "conditions": [
                {"type": "PodScheduled", "status": "True"},
                {"type": "Initialized", "status": "False" if proc.init else "True"},
                {"type": "ContainersReady", "status": flag},
                {"type": "Ready", "status": flag},
            ],
        }
        if proc.init:
            out["initContainerStatuses"] = done + [this]
        else:
            out["containerStatuses"] = [this]
            if done:
                out["initContainerStatuses"] = done
        return out

    # ------------------------------------------------------------------ starting a container
    def port(self, pod: str, port: int) -> int:
        """The loopback port standing for `port` of pod `pod` (reserved on first use, kept for the pod name)."""
        key = (pod, int(port))
        if key not in self.ports:
            taken = set(self.ports.values())
            p = free_port()
            while p in taken:
                p = free_port()
            self.ports[key] = p
        return self.ports[key]

    def resolve(self, address: str) -> str:
        """A cluster DNS address → its loopback address: `<pod>.<svc>.<ns>.svc:<port>` → that pod's port;
        `<svc>.<ns>.svc:<port>` → the Service's targetPort on its first Ready pod (a ConnectionError if none)."""
        host, port = address.rsplit(":", 1)
        parts = host.removesuffix(".cluster.local").removesuffix(".svc").split(".")
        if len(parts) == 3:
            return f"127.0.0.1:{self.port(parts[0], int(port))}"
        if len(parts) != 2:
            raise ValueError(f"address {address!r}: expected <pod>.<svc>.<ns>.svc:<port> or <svc>.<ns>.svc:<port>")
        svc = self._get("v1/services", parts[0])
        if svc is None:
            raise ConnectionError(f"{address}: no Service {parts[0]}")
        target = next(
            (p.get("targetPort", p["port"]) for p in svc["spec"].get("ports", []) if p["port"] == int(port)), None
        )
        if target is None:
            raise ConnectionError(f"{address}: Service {parts[0]} has no port {port}")
        selected = self._selected(self.pods(), {"matchLabels": svc["spec"].get("selector") or {}})
        ready = sorted(p["metadata"]["name"] for p in selected if self._ready(p))
        if not ready:
            raise ConnectionError(f"{address}: Service {parts[0]} has no ready endpoints")
        return f"127.0.0.1:{self.port(ready[0], int(target))}"

    def resolve_url(self, url: str) -> str:
        """`http://<svc>.<ns>.svc:<port>/path` → the same URL on loopback (see `resolve`)."""
        u = urlsplit(url)
        return urlunsplit(u._replace(netloc=self.resolve(u.netloc)))

    def _mounts(self, pod: dict, container: dict, pod_dir: Path) -> dict[str, Path] | None:
        """mountPath → host directory; ConfigMap volumes are written out now. None: a volume is not available
        yet (the pod waits, as in ContainerCreating)."""
        volumes = {v["name"]: v for v in pod["spec"].get("volumes") or []}
        out = {}
        for mnt in container.get("volumeMounts") or []:
            vol = volumes[mnt["name"]]
            if "configMap" in vol:
                cm = self._get("v1/configmaps", vol["configMap"]["name"])
                if cm is None:
                    return None
                d = pod_dir / "volumes" / mnt["name"]
                d.mkdir(parents=True, exist_ok=True)
                self._write_configmap(cm, d)
                self._cm_dirs.append((vol["configMap"]["name"], d))
                out[mnt["mountPath"]] = d
            elif "secret" in vol:
                d = self.secret_dir(
                    vol["secret"]["secretName"],
                    pod_dir / "volumes" / mnt["name"],
                    vol["secret"].get("defaultMode", 0o644),
                )
                if d is None:
                    return None
                out[mnt["mountPath"]] = d
            elif "hostPath" in vol:  # a directory of this node, shared by its pods
                d = self.run_dir / "hostpath" / vol["hostPath"]["path"].strip("/")
                d.mkdir(parents=True, exist_ok=True)
                out[mnt["mountPath"]] = d
            elif "persistentVolumeClaim" in vol:
                claim = vol["persistentVolumeClaim"]["claimName"]
                if claim not in self.volumes:
                    return None
                out[mnt["mountPath"]] = self.volumes[claim]
            else:
                raise ValueError(f"pod {pod['metadata']['name']}: volume {mnt['name']} of an unsupported kind")
        return out

    def secret_dir(self, name: str, d: Path, mode: int = 0o600) -> Path | None:
        """A Secret's data keys decoded into files of `d` (as a Secret volume shows them); None: no such Secret."""
        secret = self._get("v1/secrets", name)
        if secret is None:
            return None
        d.mkdir(parents=True, exist_ok=True)
        for key, b64 in (secret.get("data") or {}).items():
            (d / key).write_bytes(base64.b64decode(b64))
            (d / key).chmod(mode)
        return d

    def tls_client(self, client, address: str, secret: str, **kwargs):
        """`client(loopback address, tls=…)` for a cluster DNS `address`, holding the client certificate of the
        Secret `secret` (ca.crt, client.crt, client.key) and verifying the DNS name, as a pod dialling it would."""
        d = self.secret_dir(secret, self.run_dir / "client-tls" / secret)
        if d is None:
            raise LookupError(f"no Secret {secret!r} in namespace {self.ns}")
        tls = dataclasses.replace(client_tls_from_dir(d), server_name=address.rsplit(":", 1)[0])
        return client(self.resolve(address), tls=tls, **kwargs)

    @staticmethod
    def _write_configmap(cm: dict, d: Path) -> bool:
        """Write a ConfigMap's keys into `d`, each replaced atomically (as the kubelet swaps its symlink), only
        the keys whose text changed; True when something changed."""
        changed = False
        for key, text in (cm.get("data") or {}).items():
            f = d / key
            if not f.exists() or f.read_text() != text:
                tmp = d / f".{key}.tmp"
                tmp.write_text(text)
                os.replace(tmp, f)
                changed = True
        return changed

    def _sync_configmaps(self) -> None:
        """The kubelet's periodic sync: a running container's ConfigMap volumes follow their ConfigMap's data
        (a process that re-reads a mounted file sees the new content)."""
        for proc in list(self.running.values()):
            if proc.alive:
                for name, d in proc.configmaps:
                    cm = self._get("v1/configmaps", name)
                    if cm is not None:
                        self._write_configmap(cm, d)

    def _env(self, pod: dict, container: dict) -> dict[str, str]:
        meta = pod["metadata"]
        fields = {
            "metadata.name": meta["name"],
            "metadata.namespace": self.ns,
            "status.podIP": "127.0.0.1",
            "spec.nodeName": self.NODE,
        }
        env: dict[str, str] = {}
        for e in container.get("env") or []:
            if "value" in e:
                env[e["name"]] = expand(e["value"], env)
            elif "fieldRef" in (e.get("valueFrom") or {}):
                env[e["name"]] = fields[e["valueFrom"]["fieldRef"]["fieldPath"]]
            # secretKeyRef / configMapKeyRef: none in these tests
        return env

    def _rewrite(self, tokens: list[str], pod: dict, container: dict, mounts: dict[str, Path]) -> list[str]:
        pod_name = pod["metadata"]["name"]
        ports = {int(p["containerPort"]) for p in container.get("ports") or []}
        out: list[str] = []
        dns_names: list[str] = []
        for i, tok in enumerate(tokens):
            prev = tokens[i - 1] if i else ""
            if i == 0 and tok == "expertmesh":  # the image's entry point: this checkout's CLI
                out += [sys.executable, "-m", "expertmesh.entry.cli"]
                continue
            for mount, host in mounts.items():
                if tok == mount or tok.startswith(mount.rstrip("/") + "/"):
                    tok = str(host) + tok[len(mount.rstrip("/")) :]
                    break
            if tok == "0.0.0.0":
                tok = "127.0.0.1"
            elif prev.startswith("--") and prev.endswith("port") and tok.isdigit() and int(tok) in ports:
                tok = str(self.port(pod_name, int(tok)))
            elif tok and all(_DNS_ADDRESS.match(a) for a in tok.split(",")):
                dns_names += [a.rsplit(":", 1)[0] for a in tok.split(",")]
                tok = ",".join(self.resolve(a) for a in tok.split(","))
            out.append(tok)
        # DNS is emulated by rewriting names to loopback addresses, so a TLS client is told a name it would have
        # dialled and verified: the first it was given, else (the addresses it dials come from the router) its own
        # pod's name — every worker certificate of a deployment carries the names of all its worker pods
        own = (
            [f"{pod['spec']['hostname']}.{pod['spec']['subdomain']}.{self.ns}.svc"]
            if pod["spec"].get("hostname") and pod["spec"].get("subdomain")
            else []
        )
        for flag in ("--worker-tls", "--expert-tls"):
            if f"{flag}-ca" in out and f"{flag}-server-name" not in out and (dns_names or own):
                out += [f"{flag}-server-name", (dns_names or own)[0]]
        return out

    def _argv(self, pod: dict, container: dict, env: dict[str, str], mounts: dict[str, Path]) -> list[str]:
        name = pod["metadata"]["name"]
        argv = [expand(x, env) for x in (container.get("command") or []) + (container.get("args") or [])]
        if len(argv) == 3 and argv[0] in ("/bin/sh", "sh") and argv[1] == "-c":
            # a shell script: rewrite its words, re-quote them (words with a $ stay expandable), run it in sh
            words = shlex.split(argv[2])
            lead = ["exec"] if words[:1] == ["exec"] else []
            words = self._rewrite(words[len(lead) :], pod, container, mounts)
            for w in words:
                if "$" in w and any(ch in w for ch in '"\\`'):
                    raise ValueError(f"pod {name}: cannot re-quote shell word {w!r}")
            script = " ".join(lead + [f'"{w}"' if "$" in w else shlex.quote(w) for w in words])
            return ["/bin/sh", "-c", script]
        return self._rewrite(argv, pod, container, mounts)

    def _start(self, pod: dict, restarts: int = 0, last_failure: str = "") -> Process | None:
        meta, spec = pod["metadata"], pod["spec"]
        name, uid = meta["name"], meta.get("uid", "")
        inits = spec.get("initContainers") or []
        stage = self.stage.get(uid, 0)
        (main,) = spec["containers"]  # one container per pod in these workloads (after its init containers)
        container = inits[stage] if stage < len(inits) else main
        pod_dir = self.run_dir / f"{name}-{uid[:8]}"
        pod_dir.mkdir(parents=True, exist_ok=True)
        self._cm_dirs: list[tuple[str, Path]] = []
        mounts = self._mounts(pod, container, pod_dir)
        if mounts is None:
            return None
        env = self._env(pod, container)
        argv = self._argv(pod, container, env, mounts)
        full_env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        full_env.update(
            {
                "HOSTNAME": spec.get("hostname") or name,
                "PYTHONUNBUFFERED": "1",
                "OMP_NUM_THREADS": "1",
                "MKL_NUM_THREADS": "1",
                "EXPERTMESH_TORCH_THREADS": "1",
                **env,
                **self.extra_env,
            }
        )
        popen = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=full_env,
            cwd=str(pod_dir),
            start_new_session=True,
        )
        component = (meta.get("labels") or {}).get(LABEL_COMPONENT, container["name"])
        proc = Process(
            pod=name,
            uid=uid,
            component=component,
            argv=argv,
            popen=popen,
            restarts=restarts,
            container=container["name"],
            init=stage < len(inits),
            last_failure=last_failure,
            inits_done=tuple(c["name"] for c in inits[:stage]),
            configmaps=tuple(self._cm_dirs),
        )
        log = open(pod_dir / f"run-{container['name']}-{restarts}.log", "w")
        threading.Thread(target=self._pump, args=(proc, log), daemon=True, name=f"log-{name}").start()
        self.running[name] = proc
        self.history.append(proc)
        return proc

    def _pump(self, proc: Process, log) -> None:
        with log:
            for line in proc.popen.stdout:
                line = line.rstrip("\n")
                proc.lines.append(line)
                log.write(line + "\n")
                log.flush()
                if line.startswith("READY "):
                    proc.address = line.split()[-1]
                if self.echo:
                    print(f"[{proc.pod}#{proc.restarts}] {line}", file=sys.stderr)

    # ------------------------------------------------------------------ for tests
    def process(self, pod: str) -> Process | None:
        return self.running.get(pod)

    async def read_log(self, namespace: str, pod: str, container: str) -> str:
        """The log of a pod's container (its latest run), as the API's pods/log gives it."""
        runs = [p for p in self.history if p.pod == pod and p.container == container]
        if namespace != self.ns or not runs:
            raise LookupError(f"no log of container {container} in pod {pod}")
        return "\n".join(runs[-1].lines[-20:])

    def logs(self, n: int = 15) -> str:
        """The last lines of every process, for a failure message."""
        return "\n".join(f"--- {p.pod} (run {p.restarts}, rc {p.popen.poll()})\n{p.tail(n)}" for p in self.history)
