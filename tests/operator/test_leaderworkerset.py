"""spec.workload: leaderworkerset (issue #56): the workers as LeaderWorkerSet groups — each attention pool's pods as
groups of one, the expert workers as one group — valid against the LWS CRD (tests/data/crds/) with pod templates valid
against Kubernetes' own schema, an explicit restart policy, the router's worker lists naming the pods the LWS
controller makes, the pools' HorizontalPodAutoscalers on the LWS scale subresource, `llm-d.ai/role` on the attention
pods in both workload modes; the operator (Kopf, for real, against kmock with the CRD installed) applies them,
follows an autoscaled LWS's size and deletes its own StatefulSets when the workload kind changes."""

from __future__ import annotations

import re

import pytest
from support.crd_schemas import load_crd, register, schema_errors, upstream_crd
from support.kopf_cluster import Cluster, emulator, eventually, no_load, run_operator, tiny_spec
from support.tiny_deployment import by_kind_and_name, tiny

from expertmesh.operator import rbac
from expertmesh.operator.children import absent_children, build_children
from expertmesh.operator.handlers import Deps
from expertmesh.operator.kube import Kube, resource
from expertmesh.operator.lws import LWS_API, ROLE_LABEL
from expertmesh.operator.naming import WORKER_PORT, attention_name, expert_name, prefill_name, router_name
from expertmesh.operator.placement_policy import plan_for
from expertmesh.operator.spec import SpecError, parse_spec, resolve_model

LWS_CRD = "leaderworkersets.leaderworkerset.x-k8s.io.yaml"
LWS_RESOURCE = f"{LWS_API}/leaderworkersets"
LWS = {"workload": "leaderworkerset"}
POOLS = {"prefillWorkers": {"replicas": 2}, "attentionWorkers": {"replicas": 3}}


def _children(**over) -> dict:
    spec = parse_spec(tiny(**over))
    cfg = resolve_model(spec)
    return by_kind_and_name(build_children("kimi", "serving", spec, cfg, plan_for(spec, cfg)))


def _router_args(children) -> list[str]:
    return children[("Deployment", router_name("kimi"))]["spec"]["template"]["spec"]["containers"][0]["args"]


def test_the_pools_become_leader_worker_sets_valid_against_the_crd():
    kv = pytest.importorskip("kubernetes_validate")
    children = _children(**LWS, **POOLS, leaderWorkerSet={"startupPolicy": "LeaderReady"})
    assert not [k for k in children if k[0] == "StatefulSet"]
    crd, upstream = load_crd(LWS_CRD), upstream_crd("leaderworkerset.x-k8s.io_leaderworkersets.yaml")
    sets = {k[1]: v for k, v in children.items() if k[0] == "LeaderWorkerSet"}
    assert set(sets) == {attention_name("kimi"), prefill_name("kimi"), expert_name("kimi")}
    for lws in sets.values():
        assert schema_errors(lws, crd) == [], lws["metadata"]["name"]
        if upstream is not None:  # the whole upstream CRD (pod templates included), where one is at hand
            assert schema_errors(lws, upstream) == [], lws["metadata"]["name"]
        t = lws["spec"]["leaderWorkerTemplate"]
        assert t["restartPolicy"] == "RecreateGroupOnPodRestart" and lws["spec"]["startupPolicy"] == "LeaderReady"
        tmpl = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "x"}, "template": t["workerTemplate"]}
        kv.validate(tmpl, "1.30", strict=True)
    # attention pools: groups of one pod, as many as the pool has; the experts: one group of all of them
    assert [(sets[n]["spec"]["replicas"], sets[n]["spec"]["leaderWorkerTemplate"]["size"]) for n in sorted(sets)] == [
        (3, 1),  # kimi-attention
        (1, 2),  # kimi-expert
        (2, 1),  # kimi-prefill
    ]
    # the headless Services keep the pods' subdomain; the PDB and NetworkPolicies select the same pods by label
    assert children[("Service", expert_name("kimi"))]["spec"]["clusterIP"] == "None"


def test_the_router_names_the_pods_the_lws_controller_makes():
    args = _router_args(_children(**LWS, expertWorkers={"replicas": 3}))
    experts = args[args.index("--experts") + 1].split(",")
    pods = [a.split(".")[0] for a in experts]
    assert pods == ["kimi-expert-0", "kimi-expert-0-1", "kimi-expert-0-2"]  # leader, then workers 1..size-1
    # each expert pod takes its ordinal from its hostname's last number: the plan's ordinal order
    assert [int(re.sub(r".*-", "", p)) for p in pods] == [0, 1, 2]
    assert all(a == f"{p}.kimi-expert.serving.svc:{WORKER_PORT}" for a, p in zip(experts, pods))
    attention = args[args.index("--attention") + 1].split(",")
    assert [a.split(".")[0] for a in attention] == ["kimi-attention-0"]  # a group of one: the leader's name


def test_the_autoscaler_targets_the_lws_scale_subresource():
    auto = {"attentionWorkers": {"autoscale": {"maxReplicas": 4, "target": 0.8, "metric": "kv_utilization"}}}
    hpa = _children(**LWS, **auto)[("HorizontalPodAutoscaler", attention_name("kimi"))]
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "leaderworkerset.x-k8s.io/v1",
        "kind": "LeaderWorkerSet",
        "name": attention_name("kimi"),
    }
    crd = load_crd(LWS_CRD)
    scale = crd["spec"]["versions"][0]["subresources"]["scale"]
    assert scale["specReplicasPath"] == ".spec.replicas"  # what the HPA sets through the subresource
    hpa = _children(**auto)[("HorizontalPodAutoscaler", attention_name("kimi"))]
    assert hpa["spec"]["scaleTargetRef"]["kind"] == "StatefulSet"


@pytest.mark.parametrize("workload", [{}, LWS], ids=["statefulset", "leaderworkerset"])
def test_role_labels_on_the_attention_pods(workload):
    def roles(children):
        out = {}
        for (kind, n), c in children.items():
            if kind in ("StatefulSet", "LeaderWorkerSet", "Deployment"):
                s = c["spec"]
                tmpl = s["leaderWorkerTemplate"]["workerTemplate"] if kind == "LeaderWorkerSet" else s["template"]
                out[n] = tmpl["metadata"]["labels"].get(ROLE_LABEL)
        return out

    assert roles(_children(**workload)) == {
        attention_name("kimi"): "prefill-decode",
        expert_name("kimi"): None,
        router_name("kimi"): None,
    }
    assert roles(_children(**workload, **POOLS)) == {
        attention_name("kimi"): "decode",
        prefill_name("kimi"): "prefill",
        expert_name("kimi"): None,
        router_name("kimi"): None,
    }


def test_the_other_workload_kind_is_listed_for_deletion():
    lws, sts = parse_spec(tiny(**LWS)), parse_spec(tiny())
    gone_lws = {(k, n) for _, k, n in absent_children("kimi", lws, other_kinds=True)}
    gone_sts = {(k, n) for _, k, n in absent_children("kimi", sts, other_kinds=True)}
    assert {("StatefulSet", attention_name("kimi")), ("StatefulSet", expert_name("kimi"))} <= gone_lws
    assert {("LeaderWorkerSet", attention_name("kimi")), ("LeaderWorkerSet", expert_name("kimi"))} <= gone_sts
    assert ("LeaderWorkerSet", prefill_name("kimi")) in gone_lws  # no prefill pool
    granted = rbac.as_policy_rules()  # the handler may delete each of them
    for spec in (lws, sts):
        for api_version, kind, _ in absent_children("kimi", spec, other_kinds=True):
            group = api_version.rpartition("/")[0]
            assert rbac.allows(granted, group, resource(api_version, kind)._api_info.plural, "delete"), kind
    assert rbac.allows(granted, "leaderworkerset.x-k8s.io", "leaderworkersets", "watch")  # an autoscaled pool's size


@pytest.mark.parametrize(
    "over, named",
    [
        ({"leaderWorkerSet": {}}, "spec.leaderWorkerSet is set but spec.workload is 'statefulset'"),
        ({**LWS, "leaderWorkerSet": {"restartPolicy": "Default"}}, "spec.leaderWorkerSet.restartPolicy"),
        ({**LWS, "leaderWorkerSet": {"startupPolicy": "Eager"}}, "spec.leaderWorkerSet.startupPolicy"),
        ({**LWS, "leaderWorkerSet": {"maxGroupRestarts": -1}}, "spec.leaderWorkerSet.maxGroupRestarts"),
        ({**LWS, "leaderWorkerSet": {"maxGroupRestarts": "5"}}, "spec.leaderWorkerSet.maxGroupRestarts"),
        (
            {**LWS, "leaderWorkerSet": {"groupRestartWindowSeconds": 0}},
            "spec.leaderWorkerSet.groupRestartWindowSeconds",
        ),
        # None never recreates a group: a bound on recreations would be accepted and never apply
        (
            {**LWS, "leaderWorkerSet": {"restartPolicy": "None", "maxGroupRestarts": 3}},
            "spec.leaderWorkerSet.maxGroupRestarts bounds group recreations",
        ),
        ({"workload": "deployment"}, "spec.workload"),
    ],
)
def test_bad_fields_are_refused_naming_them(over, named):
    with pytest.raises(SpecError) as e:
        parse_spec(tiny(**over))
    assert named in str(e.value)


@pytest.mark.asyncio
@pytest.mark.timeout(60)
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
async def test_the_operator_applies_lws_follows_its_size_and_replaces_its_statefulsets():
    crd = load_crd(LWS_CRD)
    auto = {"autoscale": {"minReplicas": 1, "maxReplicas": 4, "target": 0.8, "metric": "kv_utilization"}}
    async with emulator() as emu:
        register(emu, crd)  # the CRD installed
        deps = Deps(kube=Kube.for_url(str(emu.url).rstrip("/")), fetch_load=no_load, load_timeout=2.0)
        async with run_operator(emu, deps):
            c = Cluster(emu, deps)
            spec = tiny_spec()
            await c.create_moe("kimi", spec)
            await eventually(lambda: c.get("apps/v1/statefulsets", attention_name("kimi")), what="StatefulSets")

            # the workload kind changes: LeaderWorkerSets applied, the operator's StatefulSets deleted
            await c.patch_moe("kimi", {"spec": {**LWS, "attentionWorkers": {**spec["attentionWorkers"], **auto}}})
            lws = await eventually(lambda: c.get(LWS_RESOURCE, attention_name("kimi")), what="the attention LWS")
            experts = await eventually(lambda: c.get(LWS_RESOURCE, expert_name("kimi")), what="the expert LWS")
            for obj in (lws, experts):
                assert schema_errors(obj, crd) == []
                assert obj["metadata"]["ownerReferences"][0]["name"] == "kimi"
            await eventually(
                lambda: (
                    c.get("apps/v1/statefulsets", attention_name("kimi")) is None
                    and c.get("apps/v1/statefulsets", expert_name("kimi")) is None
                ),
                what="the operator's StatefulSets deleted",
            )
            assert experts["spec"]["leaderWorkerTemplate"]["size"] == 2

            # an HPA resizes the attention LWS (its scale subresource): kept, and the router's list follows
            await c._ok(
                emu.patch(
                    f"/apis/{LWS_API}/namespaces/serving/leaderworkersets/{attention_name('kimi')}",
                    json={"spec": {"replicas": 3}},
                    headers={"Content-Type": "application/merge-patch+json"},
                )
            )
            await eventually(
                lambda: len(c.router_arg("kimi", "--attention").split(",")) == 3, what="the router's --attention"
            )
            assert c.get(LWS_RESOURCE, attention_name("kimi"))["spec"]["replicas"] == 3
