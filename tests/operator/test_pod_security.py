"""Pods that cannot reach the node: every pod template the operator renders passes the restricted Pod Security
Standard (support/restricted_pss.py: the Kubernetes documentation's rules) when the spec names no node directory; a
node directory outside the cluster admin's allow-list is refused with a condition naming the field, one under it is
accepted (Kopf for real against kmock)."""

from __future__ import annotations

import pytest
from support.kopf_cluster import Cluster, emulator, eventually, no_load, operator, run_operator, tiny_spec
from support.restricted_pss import pod_templates, violations
from support.tiny_deployment import tiny

from expertmesh.operator.children import build_children
from expertmesh.operator.handlers import Deps
from expertmesh.operator.kube import Kube
from expertmesh.operator.spec import parse_spec

FETCHED = {"uri": "https://models.example/tiny"}
AUTOSCALE = {"maxReplicas": 4, "target": 0.8, "metric": "kv_utilization"}

# Specs without a node directory: every pod of each must be admitted under `enforce: restricted`.
RESTRICTED_SPECS = {
    "pvc": tiny(),
    "image-path-two-routers-telemetry": tiny(
        model={"preset": "tiny", "checkpoint": {"uri": "/opt/expertmesh/checkpoints/tiny"}},
        router={"replicas": 2},
        telemetry={"otlpEndpoint": "http://otel:4317"},
    ),
    "hf-fetch-into-a-cache-pvc": tiny(
        model={
            "preset": "tiny",
            "checkpoint": {
                "uri": "hf://org/tiny@v1",
                "cache": {"claimName": "ckpt-cache"},
                "tokenSecretRef": {"name": "hf", "key": "token"},
            },
        }
    ),
    "s3-fetch-into-a-cache-pvc": tiny(
        model={
            "preset": "tiny",
            "checkpoint": {"uri": "s3://bucket/tiny", "cache": {"claimName": "c"}, "credentialsSecret": "s3"},
        }
    ),
    "prefill-decode-pools-collective-kv-tiers": tiny(
        prefillWorkers={"replicas": 2, "gpusPerPod": 0, "minPromptTokens": 32},
        attentionWorkers={"gpusPerPod": 0, "autoscale": AUTOSCALE},
        kv={"hostGiB": 1, "disk": {"sizeGiB": 2}},
        transport="collective",
    ),
    "autoscaled-prefill-pool-kv-disk-pvcs": tiny(
        prefillWorkers={"gpusPerPod": 0, "autoscale": {**AUTOSCALE, "metric": "prefill_tokens_waiting", "target": 512}},
        kv={"disk": {"sizeGiB": 2, "pvc": {"storageClassName": "local-nvme"}}},
    ),
    "gpus-without-worker-tls": tiny(
        attentionWorkers={"gpusPerPod": 1},
        expertWorkers={"gpusPerPod": 2},
        security={"workerTls": False},
    ),
}


@pytest.mark.parametrize("spec", RESTRICTED_SPECS.values(), ids=RESTRICTED_SPECS.keys())
def test_every_pod_the_operator_renders_passes_the_restricted_standard(spec, tiny_plan):
    _, cfg, plan = tiny_plan
    children = build_children("kimi", "serving", parse_spec(spec), cfg, plan)
    templates = pod_templates(children)
    kinds = {name.split("/")[0] for name, _, _ in templates}
    assert kinds == {"StatefulSet", "Deployment"}  # the router and the worker pools (no Job, no bare Pod)
    for name, pod, notes in templates:
        assert violations(pod, notes) == [], name
        # the image's numeric non-root user (the Dockerfile's USER 10001:10001), GPUs by resources, not privileges
        assert pod["securityContext"]["runAsUser"] == pod["securityContext"]["fsGroup"] == 10001
        for c in pod["containers"] + pod.get("initContainers", []):
            assert c["securityContext"]["readOnlyRootFilesystem"] is True, (name, c["name"])
            # under a read-only root what the processes write goes to volumes: /tmp (HOME) in every container
            assert "/tmp" in {m["mountPath"] for m in c["volumeMounts"]}, (name, c["name"])
        assert {v["name"]: v for v in pod["volumes"]}["tmp"]["emptyDir"]["sizeLimit"]
        assert pod["automountServiceAccountToken"] is False  # no pod of a deployment talks to the API


def test_the_checker_refuses_what_the_restricted_profile_refuses():
    """The checker is not vacuous: a pod as the operator rendered them before (no securityContext) and each single
    departure from the profile are refused."""
    bare = {"containers": [{"name": "c", "image": "x"}], "volumes": [{"name": "v", "emptyDir": {}}]}
    assert {v.split(": ", 1)[1] for v in violations(bare)} >= {
        "allowPrivilegeEscalation is not false",
        "capabilities do not drop ALL",
        "runAsNonRoot is not true (neither the pod's nor every container's)",
        "seccomp profile None (RuntimeDefault or Localhost)",
    }
    good_c = {
        "name": "c",
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
    }
    good = {
        "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [good_c],
    }
    assert violations(good) == []
    with_cap = {
        **good_c,
        "securityContext": {
            **good_c["securityContext"],
            "capabilities": {"drop": ["ALL"], "add": ["NET_BIND_SERVICE"]},
        },
    }
    assert violations({**good, "containers": [with_cap]}) == []
    bad = [
        {**good, "hostNetwork": True},
        {**good, "hostPID": True},
        {**good, "volumes": [{"name": "root", "hostPath": {"path": "/"}}]},
        {**good, "volumes": [{"name": "nfs", "nfs": {"server": "x", "path": "/"}}]},
        {**good, "securityContext": {**good["securityContext"], "runAsUser": 0}},
        {**good, "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "Unconfined"}}},
        {**good, "containers": [{**good_c, "securityContext": {**good_c["securityContext"], "privileged": True}}]},
        {**good, "initContainers": [{"name": "init"}]},
        {
            **good,
            "containers": [
                {
                    **with_cap,
                    "securityContext": {
                        **with_cap["securityContext"],
                        "capabilities": {"drop": ["ALL"], "add": ["SYS_ADMIN"]},
                    },
                }
            ],
        },
        {**good, "containers": [{**good_c, "ports": [{"containerPort": 80, "hostPort": 80}]}]},
    ]
    for pod in bad:
        assert violations(pod), pod


def test_a_node_directory_is_the_one_departure_and_only_where_the_spec_names_it(tiny_plan):
    """With the checkpoint cache on a node directory (the default for a fetched checkpoint) or the KV disk tier on
    one, the hostPath volume is the only rule the pods break: they keep every other part of the profile."""
    _, cfg, plan = tiny_plan
    spec = parse_spec(
        tiny(model={"preset": "tiny", "checkpoint": FETCHED}, kv={"disk": {"sizeGiB": 1, "hostPath": "/mnt/nvme/kv"}})
    )
    for name, pod, notes in pod_templates(build_children("kimi", "serving", spec, cfg, plan)):
        found = violations(pod, notes)
        expected = ["volume checkpoint-cache: hostPath /var/cache/expertmesh"]
        if name == "StatefulSet/kimi-attention":
            expected.append("volume kv-disk: hostPath /mnt/nvme/kv")
        assert found == expected, name


# ------------------------------------------------------------------------------------------------ Kopf, for real
def _refused(c: Cluster, name: str) -> bool:
    return c.status(name).get("phase") == "Failed"


@pytest.mark.asyncio
@pytest.mark.timeout(60)
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize(
    "where, field",
    [
        ({"kv": {"disk": {"sizeGiB": 1, "hostPath": "/etc"}}}, "spec.kv.disk.hostPath"),
        ({"kv": {"disk": {"sizeGiB": 1, "hostPath": "/"}}}, "spec.kv.disk.hostPath"),
        (  # the container runtime's socket directory, as a checkpoint cache
            {"model": {"preset": "tiny", "checkpoint": {**FETCHED, "cache": {"hostPath": "/run/containerd"}}}},
            "spec.model.checkpoint.cache.hostPath",
        ),
        (  # a sibling of the allowed directory whose name merely starts like it
            {"model": {"preset": "tiny", "checkpoint": {**FETCHED, "cache": {"hostPath": "/var/cache/expertmesh-x"}}}},
            "spec.model.checkpoint.cache.hostPath",
        ),
    ],
    ids=["kv-etc", "kv-root", "cache-runtime-socket", "cache-sibling"],
)
async def test_a_node_directory_outside_the_allow_list_is_refused_naming_the_field(where, field):
    spec = {**tiny_spec(), **where}
    async with operator() as c:  # the default allow-list: the checkpoint cache's default directory
        await c.create_moe("kimi", spec)
        await eventually(lambda: _refused(c, "kimi"), what="Failed")
        cond = c.condition("kimi", "PlacementReady")
        assert (cond["status"], cond["reason"]) == ("False", "HostPathNotAllowed")
        assert cond["message"].startswith(f"{field}=") and "/var/cache/expertmesh" in cond["message"]
        assert c.status("kimi")["message"] == cond["message"]
        # nothing that would mount it exists
        for res in ("apps/v1/statefulsets", "apps/v1/deployments"):
            for child in ("kimi-attention", "kimi-expert", "kimi-router"):
                assert c.get(res, child) is None, (res, child)


@pytest.mark.asyncio
@pytest.mark.timeout(60)
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
async def test_a_node_directory_under_the_allow_list_is_accepted():
    """The admin's allow-list (--allowed-host-paths, given to the handlers as Deps.allowed_host_paths): a KV disk
    tier below /mnt/nvme and the default checkpoint cache deploy; /mnt/nvme-other does not."""
    async with emulator() as emu:
        url = str(emu.url).rstrip("/")
        deps = Deps(
            kube=Kube.for_url(url), fetch_load=no_load, allowed_host_paths=("/mnt/nvme", "/var/cache/expertmesh")
        )
        async with run_operator(emu, deps):
            c = Cluster(emu, deps)
            ok = {
                **tiny_spec(),
                "model": {"preset": "tiny", "checkpoint": FETCHED},
                "kv": {"disk": {"sizeGiB": 1, "hostPath": "/mnt/nvme/kv"}},
            }
            await c.create_moe("kimi", ok)
            await eventually(lambda: c.status("kimi").get("phase") == "Deploying", what="Deploying", timeout=30)
            pod = c.get("apps/v1/statefulsets", "kimi-attention")["spec"]["template"]["spec"]
            paths = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
            assert paths == {"checkpoint-cache": "/var/cache/expertmesh", "kv-disk": "/mnt/nvme/kv"}
            await c.create_moe("other", {**ok, "kv": {"disk": {"sizeGiB": 1, "hostPath": "/mnt/nvme-other"}}})
            await eventually(lambda: _refused(c, "other"), what="Failed")
            assert c.condition("other", "PlacementReady")["message"].startswith(
                "spec.kv.disk.hostPath='/mnt/nvme-other'"
            )
