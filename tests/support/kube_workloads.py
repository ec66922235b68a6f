"""The workload controllers of `support.kube_harness.LocalNode`, and its access to kmock's Kubernetes emulator.

`EmulatorClient` reads the objects of one namespace from the emulator's memory and writes through its HTTP API (as
a real controller or kubelet would). `WorkloadControllers` plays, on it:
  - the StatefulSet controller: pods `<sts>-<i>` for i < replicas from the pod template (labels, annotations,
    owner reference, hostname/subdomain); a missing pod is recreated under the same name; RollingUpdate: once
    every pod is Ready, the highest-ordinal pod of an older template is deleted (and so recreated), one at a time;
    ordinals >= replicas are deleted;
  - the Deployment controller: pods `<deploy>-<template hash>-<suffix>`; new-template pods are created up to
    `replicas` (surge) and the old-template pods deleted once that many new ones are Ready.
Every pod they create is bound to node `EmulatorClient.NODE`.
"""

from __future__ import annotations

import json
import secrets

import kmock

from expertmesh.operator.naming import TEMPLATE_HASH_ANNOTATION


def _plain(x):
    return json.loads(json.dumps(x, default=dict))


class EmulatorClient:
    """The objects of namespace `ns` in the emulator `emu`: read from its memory, written through its API."""

    NODE = "local-node"
    emu: object  # kmock's emulator (support.kopf_cluster.Emulator)
    ns: str

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

    @staticmethod
    def _selected(pods: dict[str, dict], selector: dict) -> list[dict]:
        want = (selector or {}).get("matchLabels") or {}
        return [
            p for p in pods.values() if all((p["metadata"].get("labels") or {}).get(k) == v for k, v in want.items())
        ]


class WorkloadControllers(EmulatorClient):
    """The StatefulSet and Deployment controllers (see the module's docstring), one reconciliation per call."""

    async def _controllers(self) -> None:
        pods = self.pods()
        for sts in self._objects("apps/v1/statefulsets"):
            await self._statefulset(sts, pods)
        for dep in self._objects("apps/v1/deployments"):
            await self._deployment(dep, pods)

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
