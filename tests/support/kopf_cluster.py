"""The operator running for real (Kopf's reactor, watches, handlers) against kmock's in-memory Kubernetes API.

Wiring:
  - `Emulator` = `kmock.KubernetesEmulator` + the API-server behaviour Kopf relies on (uid, resourceVersion,
    generation, 422 on a failed JSON-patch test, watches that start after the listed resourceVersion);
    bundled builtin resources + our CRD's resource entry; served over HTTP by `kmock.Server`;
  - the operator = `kopf.operator(registry=build_registry(login=<ConnectionInfo to the emulator>),
    memo=kopf.Memo(deps=Deps(kube=Kube.for_url(url), fetch_load=<stub>)), standalone=True, clusterwide=True)`
    in its own thread and event loop (`run_operator`, `operator`), or `expertmesh operator` as a process
    (`operator_process`);
  - `Cluster`: the test plays the cluster's controllers: it creates the pods the StatefulSets/Deployment would
    create (labels and plan-hash annotation from their templates) and marks them Ready / deletes them.
Only the router's HTTP load endpoint is stubbed (`fetch_load`).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import itertools
import json
import os
import signal
import sys
import threading
import uuid

import kmock
import kopf
import yaml
from kmock._internal import enums

from expertmesh.operator.handlers import Deps, build_registry
from expertmesh.operator.kube import Kube
from expertmesh.operator.naming import (
    attention_name,
    expert_name,
    plan_configmap_name,
    prefill_name,
    router_name,
)
from expertmesh.operator.spec import API_VERSION, GROUP, KIND, PLURAL, VERSION
from expertmesh.operator.status import condition as condition_of
from expertmesh.placement.plan import PlacementPlan

NS = "serving"
MOE = f"{GROUP}/{VERSION}/{PLURAL}"
TINY_EXPERT_BYTES = 3264  # one tiny expert in MXFP4
TINY_EXPERTS = 48  # 3 MoE layers x 16 experts
GIB = 2**30


class Emulator(kmock.KubernetesEmulator):
    """kmock's emulator plus what a real API server does that Kopf relies on: uid / creationTimestamp /
    resourceVersion / generation in metadata, 422 when a JSON-patch `test` fails, list resourceVersions, and
    watches that start after the listed resourceVersion (no stale replays). Records every write."""

    def __attrs_post_init__(self):
        super().__attrs_post_init__()
        self._rv = itertools.count(1)
        self.last_rv = 0
        self.writes: list[tuple[str, str]] = []
        self.failures: dict[tuple[str, str], int] = {}  # (METHOD, path prefix) → how many calls to fail with 503

    def _next_rv(self) -> str:
        self.last_rv = next(self._rv)
        return str(self.last_rv)

    async def _handle(self, request):
        if request.resource is not None and request.action in (
            enums.action.CREATE,
            enums.action.UPDATE,
            enums.action.DELETE,
        ):
            self.writes.append((str(request.method), request.url.path))
            for (method, prefix), n in list(self.failures.items()):
                if n > 0 and request.method.value == method and request.url.path.startswith(prefix):
                    self.failures[(method, prefix)] = n - 1
                    raise kmock.KubernetesError(status=503, reason="ServiceUnavailable", message="etcd is sad")
        if request.resource is not None and request.action == enums.action.CREATE and isinstance(request.data, dict):
            meta = request.data.setdefault("metadata", {})
            meta.setdefault("uid", str(uuid.uuid4()))
            meta.setdefault("creationTimestamp", datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))
            meta.setdefault("generation", 1)
            if request.namespace:
                meta.setdefault("namespace", request.namespace)
            meta["resourceVersion"] = self._next_rv()
        elif request.resource is not None and request.action == enums.action.UPDATE:
            key = (request.resource, request.namespace, request.name)
            obj = self.objects[key] if key in self.objects else None
            if obj is not None and not obj.deleted:
                meta = obj.get("metadata", {})
                gen = meta.get("generation") or 1
                if isinstance(request.data, list):  # JSON patch
                    for op in request.data:
                        if (
                            op.get("op") == "test"
                            and op.get("path") == "/metadata/resourceVersion"
                            and op.get("value") != meta.get("resourceVersion")
                        ):
                            raise kmock.KubernetesError(
                                status=422, reason="Invalid", message="the object has been modified"
                            )
                    touches_spec = request.subresource is None and any(
                        op.get("path", "").startswith("/spec") for op in request.data
                    )
                    request.data.append({"op": "add", "path": "/metadata/resourceVersion", "value": self._next_rv()})
                    if touches_spec:
                        request.data.append({"op": "add", "path": "/metadata/generation", "value": gen + 1})
                elif isinstance(request.data, dict):  # merge patch / apply
                    patch_meta = dict(request.data.get("metadata") or {})
                    patch_meta["resourceVersion"] = self._next_rv()
                    if (
                        request.subresource is None
                        and "spec" in request.data
                        and request.data["spec"] != plain(obj.get("spec", {}))
                    ):
                        patch_meta["generation"] = gen + 1
                    request.data["metadata"] = patch_meta
        return await super()._handle(request)

    async def _serve_list(self, request):
        result = await super()._serve_list(request)
        result["metadata"]["resourceVersion"] = str(self.last_rv)
        return result

    async def _serve_watch(self, request):
        since = request.params.get("resourceVersion", "")
        async for event in super()._serve_watch(request):
            if since.isdigit() and isinstance(event, dict):
                rv = str(event.get("object", {}).get("metadata", {}).get("resourceVersion", ""))
                if rv.isdigit() and int(rv) <= int(since):
                    continue
            yield event


def plain(x):
    return json.loads(json.dumps(x, default=dict))


class Cluster:
    """The emulator seen from a test: create/patch/delete objects, read them back, play the controllers."""

    def __init__(self, emu: Emulator, deps: Deps):
        self.emu, self.deps = emu, deps

    def get(self, resource: str, name: str):
        key = (kmock.resource(resource), NS, name)
        if key not in self.emu.objects or self.emu.objects[key].deleted:
            return None
        return plain(self.emu.objects[key].raw)

    def moe(self, name: str):
        return self.get(MOE, name)

    def status(self, name: str) -> dict:
        return (self.moe(name) or {}).get("status") or {}

    def condition(self, name: str, type_: str) -> dict:
        return condition_of(self.status(name), type_) or {}

    def plan(self, name: str) -> PlacementPlan:
        return PlacementPlan.from_json(self.get("v1/configmaps", plan_configmap_name(name))["data"]["plan.json"])

    async def _ok(self, resp):
        async with resp as r:
            assert r.status < 300, await r.text()
            return await r.json()

    async def create_moe(self, name: str, spec: dict):
        body = {"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": name, "namespace": NS}, "spec": spec}
        return await self._ok(self.emu.post(f"/apis/{GROUP}/{VERSION}/namespaces/{NS}/{PLURAL}", json=body))

    async def patch_moe(self, name: str, patch: dict):
        return await self._ok(
            self.emu.patch(
                f"/apis/{GROUP}/{VERSION}/namespaces/{NS}/{PLURAL}/{name}",
                json=patch,
                headers={"Content-Type": "application/merge-patch+json"},
            )
        )

    async def delete_moe(self, name: str):
        return await self._ok(self.emu.delete(f"/apis/{GROUP}/{VERSION}/namespaces/{NS}/{PLURAL}/{name}"))

    async def put_pod(self, name: str, template: dict, ready: bool = True):
        meta = template["metadata"]
        body = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name,
                "namespace": NS,
                "labels": dict(meta["labels"]),
                "annotations": dict(meta.get("annotations", {})),
            },
            "spec": template["spec"],
            "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": str(ready)}]},
        }
        if self.get("v1/pods", name) is not None:
            await self.delete_pod(name)
        return await self._ok(self.emu.post(f"/api/v1/namespaces/{NS}/pods", json=body))

    async def set_ready(self, pod: str, ready: bool):
        return await self._ok(
            self.emu.patch(
                f"/api/v1/namespaces/{NS}/pods/{pod}/status",
                json={"status": {"conditions": [{"type": "Ready", "status": str(ready)}]}},
                headers={"Content-Type": "application/merge-patch+json"},
            )
        )

    async def scale(self, statefulset: str, replicas: int):
        """What a HorizontalPodAutoscaler does: set a StatefulSet's replicas."""
        return await self._ok(
            self.emu.patch(
                f"/apis/apps/v1/namespaces/{NS}/statefulsets/{statefulset}",
                json={"spec": {"replicas": replicas}},
                headers={"Content-Type": "application/merge-patch+json"},
            )
        )

    def router_arg(self, name: str, flag: str):
        args = self.get("apps/v1/deployments", router_name(name))["spec"]["template"]["spec"]["containers"][0]["args"]
        return args[args.index(flag) + 1] if flag in args else None

    async def delete_pod(self, pod: str):
        return await self._ok(self.emu.delete(f"/api/v1/namespaces/{NS}/pods/{pod}"))

    async def start_pods(self, name: str):
        """What the StatefulSet / Deployment controllers and kubelets would do: every pod, Ready."""
        for sts in (attention_name(name), prefill_name(name), expert_name(name)):
            obj = self.get("apps/v1/statefulsets", sts)
            if obj is None:  # no prefill pool
                continue
            for i in range(obj["spec"]["replicas"]):
                await self.put_pod(f"{sts}-{i}", obj["spec"]["template"])
        dep = self.get("apps/v1/deployments", router_name(name))
        for i in range(dep["spec"]["replicas"]):
            await self.put_pod(f"{router_name(name)}-5d8f9-{i}", dep["spec"]["template"])


async def eventually(check, timeout: float = 10.0, what: str = ""):
    """Poll `check()` until it returns a truthy value; fail with the last value otherwise."""
    deadline = asyncio.get_running_loop().time() + timeout
    last = None
    while True:
        try:
            last = check()
            if last:
                return last
        except (KeyError, TypeError, IndexError) as e:
            last = e
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what or check}: last {last!r}")
        await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def emulator():
    """The emulator, served over HTTP, with the builtin resources, our CRD's and Kopf's peering resource."""
    async with Emulator() as emu, kmock.Server(emu):
        emu.resources.load_bundled()
        emu.resources[MOE] = kmock.ResourceInfo(
            kind=KIND,
            singular="moedeployment",
            namespaced=True,
            shortnames={"moe"},
            verbs={"get", "list", "watch", "create", "patch", "delete"},
            subresources={"status", "scale"},
        )
        emu.resources["kopf.dev/v1/clusterkopfpeerings"] = kmock.ResourceInfo(
            kind="ClusterKopfPeering",
            singular="clusterkopfpeering",
            namespaced=False,
            verbs={"get", "list", "watch", "create", "patch"},
        )
        yield emu


@contextlib.asynccontextmanager
async def run_operator(emu, deps: Deps, tick: float = 0.2, **kw):
    """One operator (Kopf, for real) against `emu` until the context exits. `kw`: kopf.operator's peering
    arguments (default standalone)."""
    url = str(emu.url).rstrip("/")
    registry = build_registry(
        rebalance_tick=tick,
        login=lambda **_: kopf.ConnectionInfo(server=url, insecure=True),
        peering_lifetime=kw.pop("peering_lifetime", None),
    )

    @kopf.on.startup(id="fast_exit", registry=registry)
    def _fast_exit(settings: kopf.OperatorSettings, **_):  # idle per-object workers exit quickly on stop
        settings.queueing.idle_timeout = 0.5
        settings.queueing.exit_timeout = 0.5

    # Kopf in its own thread and event loop: on stop it waits for every task its loop started, and the
    # emulator's connection tasks live in the test's loop
    stop, ready = threading.Event(), threading.Event()
    kw = kw or {"standalone": True}
    thread = threading.Thread(
        name="kopf",
        daemon=True,
        target=lambda: asyncio.run(
            kopf.operator(
                registry=registry, memo=kopf.Memo(deps=deps), clusterwide=True, stop_flag=stop, ready_flag=ready, **kw
            )
        ),
    )
    thread.start()
    try:
        assert await asyncio.to_thread(ready.wait, 10), "the operator did not start"
        yield thread
    finally:
        stop.set()
        await asyncio.to_thread(thread.join, 15)
        assert not thread.is_alive(), "the operator did not stop"


async def no_load(url, timeout):
    raise ConnectionError("no router in this test")


@contextlib.asynccontextmanager
async def operator(fetch_load=None, tick: float = 0.2, read_log=None):
    async with emulator() as emu:
        url = str(emu.url).rstrip("/")
        deps = Deps(kube=Kube.for_url(url), fetch_load=fetch_load or no_load, load_timeout=2.0, read_log=read_log)
        async with run_operator(emu, deps, tick):
            yield Cluster(emu, deps)


def tiny_spec(
    experts: int = 2, slots_per_pod: int = 48, redundant: int = 0, interval: int = 300, grace: int = 0
) -> dict:
    """tiny on CPU pods, each holding `slots_per_pod` experts (memory given in GiB, as a user would)."""
    return {
        "model": {"preset": "tiny", "checkpoint": {"pvc": {"claimName": "weights", "path": "/tiny"}}},
        "router": {"replicas": 1},
        "attentionWorkers": {"replicas": 1, "gpusPerPod": 0},
        "expertWorkers": {
            "replicas": experts,
            "gpusPerPod": 0,
            "reserveGiB": 0,
            "gpuMemoryGiB": (slots_per_pod * TINY_EXPERT_BYTES + 100) / GIB,
            "redundantExperts": redundant,
        },
        "placement": {"rebalanceIntervalSeconds": interval, "imbalanceThreshold": 1.1, "replanGraceSeconds": grace},
    }


async def ready_deployment(c: Cluster, name: str, spec: dict) -> dict:
    await c.create_moe(name, spec)
    await eventually(lambda: c.status(name).get("phase") == "Deploying", what="phase Deploying")
    await c.start_pods(name)
    await eventually(lambda: c.status(name).get("phase") == "Ready", what="phase Ready")
    return c.status(name)


@contextlib.asynccontextmanager
async def operator_process(emu, tmp_path, *args: str):
    """`expertmesh operator` as its own process, logged in through a kubeconfig naming `emu`; SIGTERM on exit,
    which it must answer by exiting 0."""
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "emu",
                "clusters": [{"name": "emu", "cluster": {"server": str(emu.url).rstrip("/")}}],
                "users": [{"name": "u", "user": {"token": "t0ken"}}],
                "contexts": [{"name": "emu", "context": {"cluster": "emu", "user": "u"}}],
            }
        )
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(KUBECONFIG=str(kubeconfig), KUBERNETES_SERVICE_HOST="")
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "expertmesh.operator.main",
        *args,
        env=env,
        cwd=str(tmp_path),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    try:
        yield proc
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
        out, _ = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 0, out.decode()[-3000:]


def pod_uids(c: Cluster) -> dict[str, str]:
    """Every live pod's uid by name: a pod restarted gets a new one."""
    return {
        k[2]: plain(v.raw)["metadata"]["uid"]
        for k, v in list(c.emu.objects.items())
        if k[0] == kmock.resource("v1/pods") and k[1] == NS and not v.deleted
    }
