"""How `support.kube_harness.LocalNode` turns a pod's container into a local process, and what it runs.

Command + args get Kubernetes' `$(VAR)` expansion over the container env (fieldRefs metadata.name /
metadata.namespace / status.podIP / spec.nodeName); volumes map to host directories (a ConfigMap or Secret volume
materialised from its data, a hostPath volume a directory of the node, a PVC volume from `volumes[claimName]`); the
image's `expertmesh` entry point is this checkout's `python -m expertmesh.entry.cli`; a `/bin/sh -c` script is
rewritten word by word and run by the real /bin/sh. Networking is loopback: `0.0.0.0` → `127.0.0.1`; the value of
every `--*port` flag naming a declared containerPort → a loopback port of its own, reserved per (pod name, port);
cluster DNS names in arguments (`<pod>.<svc>.<ns>.svc:<port>`, `<svc>.<ns>.svc:<port>`) → 127.0.0.1:<that pod's
port>.
"""

from __future__ import annotations

import base64
import dataclasses
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from expertmesh.entry.cluster import free_port
from expertmesh.runtime.tls import client_tls_from_dir
from support.kube_workloads import EmulatorClient

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


class ContainerLaunch(EmulatorClient):
    """A part of `LocalNode`: a container's argv, env and mounts on this machine, and the loopback addresses that
    stand for cluster ones. The node sets these:"""

    run_dir: Path  # the node's working directory (pod directories, hostPath volumes)
    volumes: dict[str, Path]  # PVC claimName → host directory
    ports: dict[tuple[str, int], int]  # (pod name, container port) → loopback port
    _cm_dirs: list[tuple[str, Path]]  # (ConfigMap name, host directory) of the container being started

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
            elif "emptyDir" in vol:  # the pod's own scratch directory (its /tmp under a read-only root)
                d = pod_dir / "volumes" / mnt["name"]
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
