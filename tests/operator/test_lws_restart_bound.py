"""A bounded restart loop for LeaderWorkerSet groups (issue #56, item 4): the operator counts each group's
recreations (its leader pod back with a new uid on the same template revision), and after
spec.leaderWorkerSet.maxGroupRestarts of them within groupRestartWindowSeconds sets that set's restartPolicy to None
with condition GroupRestartsBounded naming the group, until the spec changes; a quiet window starts a count again.
The accounting as pure functions (operator/lws_restarts.py), then the operator for real (Kopf against kmock with the
LWS CRD installed), the test playing the LWS controller: it deletes and recreates a group's leader pod."""

from __future__ import annotations

import datetime as dt

import pytest
from support.crd_schemas import load_crd, register, schema_errors
from support.kopf_cluster import Cluster, emulator, eventually, no_load, run_operator, tiny_spec
from support.tiny_deployment import by_kind_and_name, tiny

from expertmesh.operator.children import build_children
from expertmesh.operator.crd import build_crd
from expertmesh.operator.handlers import Deps
from expertmesh.operator.kube import Kube
from expertmesh.operator.lws import (
    LWS_API,
    LWS_GROUP_LABEL,
    LWS_KIND,
    LWS_REVISION_LABEL,
    LWS_SET_LABEL,
    LWS_WORKER_LABEL,
    lws_leader,
)
from expertmesh.operator.lws_restarts import CONDITION, account, bounded_sets, lws_groups
from expertmesh.operator.naming import attention_name, expert_name
from expertmesh.operator.placement_policy import plan_for
from expertmesh.operator.pods import PodInfo
from expertmesh.operator.spec import API_VERSION, parse_spec, resolve_model
from expertmesh.operator.status import condition

LWS_CRD = "leaderworkersets.leaderworkerset.x-k8s.io.yaml"
LWS_RESOURCE = f"{LWS_API}/leaderworkersets"
T0 = dt.datetime(2026, 5, 1, 12, 0, tzinfo=dt.UTC)


def _at(seconds: float) -> str:
    return (T0 + dt.timedelta(seconds=seconds)).isoformat().replace("+00:00", "Z")


def _spec(**lws):
    return parse_spec(tiny(workload="leaderworkerset", attentionWorkers={"replicas": 2}, leaderWorkerSet=lws))


def _leader(set_name: str, group: int, uid: str, revision: str = "r1") -> PodInfo:
    return PodInfo(
        name=f"{set_name}-{group}",
        component="attention-worker",
        ordinal=group,
        ready=True,
        template_hash=None,
        uid=uid,
        lws_leader=(set_name, group, revision),
    )


def _status_errors(moe: dict) -> list[str]:
    """Where a MoEDeployment's status breaks the CRD's status schema (what the API server would refuse or prune)."""
    obj = {**moe, "apiVersion": API_VERSION, "kind": "MoEDeployment"}
    return [e for e in schema_errors(obj, build_crd()) if e.startswith("status")]


class Run:
    """The accounting over successive looks, status carried from one to the next as the operator writes it."""

    def __init__(self, spec, generation: int = 1):
        self.spec, self.generation, self.status = spec, generation, {}
        self.groups = lws_groups("kimi", spec)

    def look(self, t: float, *pods: PodInfo):
        acc = account(self.spec, self.status, pods, self.groups, self.generation, _at(t))
        self.status = {**self.status, **acc.status}
        return acc

    def restarts(self, set_name: str, group: int) -> int:
        return next(r["restarts"] for r in self.status["groupRestarts"] if (r["set"], r["group"]) == (set_name, group))


def test_leader_pods_are_read_from_the_lws_controllers_labels():
    labels = {LWS_SET_LABEL: "kimi-expert", LWS_GROUP_LABEL: "0", LWS_WORKER_LABEL: "0", LWS_REVISION_LABEL: "abc"}
    assert lws_leader(labels) == ("kimi-expert", 0, "abc")
    assert lws_leader({**labels, LWS_WORKER_LABEL: "1"}) is None  # a worker of the group
    assert lws_leader({"app": "x"}) is None


def test_a_new_leader_uid_on_the_same_revision_is_a_recreation_and_a_new_revision_is_not():
    run = Run(_spec())
    att = attention_name("kimi")
    first = run.look(0, _leader(att, 0, "u1"), _leader(att, 1, "v1"))
    assert not first.rerender and run.restarts(att, 0) == 0  # first seen: recorded, nothing counted
    assert run.look(1, _leader(att, 0, "u1"), _leader(att, 1, "v1")).status == {}  # nothing changed: nothing written
    run.look(2, _leader(att, 0, "u2"), _leader(att, 1, "v1"))
    assert (run.restarts(att, 0), run.restarts(att, 1)) == (1, 0)
    run.look(3, _leader(att, 0, "u3", revision="r2"), _leader(att, 1, "v1"))  # a rollout
    assert run.restarts(att, 0) == 1
    # a deleting leader is not the group's new one; a group the spec no longer has is dropped
    deleting = PodInfo(**{**_leader(att, 0, "u4", "r2").__dict__, "deleting": True})
    run.look(4, deleting, _leader(att, 7, "x1"))
    assert run.restarts(att, 0) == 1 and {r["group"] for r in run.status["groupRestarts"]} == {0, 1}


def test_at_the_bound_the_set_restarts_pods_alone_and_the_condition_names_the_group():
    spec = _spec(maxGroupRestarts=3, groupRestartWindowSeconds=60)
    run, att = Run(spec), attention_name("kimi")
    for i in range(3):
        acc = run.look(10 * i, _leader(att, 1, f"u{i}"))
        assert not acc.rerender and bounded_sets(run.status, 1) == frozenset()
    acc = run.look(30, _leader(att, 1, "u3"))  # the third recreation
    assert acc.rerender and acc.bounded == {att} == bounded_sets(run.status, 1)
    cond = condition(run.status, CONDITION)
    assert (cond["status"], cond["reason"]) == ("True", "GroupRestartLimit")
    assert f"{att} group 1 (3 recreations)" in cond["message"] and "until the spec changes" in cond["message"]

    cfg = resolve_model(spec)
    children = by_kind_and_name(build_children("kimi", "serving", spec, cfg, plan_for(spec, cfg), None, acc.bounded))
    policy = {n: c["spec"]["leaderWorkerTemplate"]["restartPolicy"] for (k, n), c in children.items() if k == LWS_KIND}
    assert policy == {att: "None", expert_name("kimi"): "RecreateGroupOnPodRestart"}
    assert schema_errors(children[(LWS_KIND, att)], load_crd(LWS_CRD)) == []

    # held while the spec stays: later looks (even quiet ones) keep it, and its status is valid against the CRD
    assert not run.look(30 + 3600, _leader(att, 1, "u3")).rerender and bounded_sets(run.status, 1) == {att}
    assert _status_errors({"metadata": {"name": "kimi"}, "spec": tiny(), "status": run.status}) == []

    # the spec changes (a new generation): lifted — the new spec's children were already rendered without it (the
    # bound holds only at its generation) — the counts start again, the condition turns False
    run.generation = 2
    assert bounded_sets(run.status, 2) == frozenset()
    acc = run.look(4000, _leader(att, 1, "u3"))
    assert not acc.rerender and acc.bounded == frozenset() and run.restarts(att, 1) == 0
    assert condition(run.status, CONDITION)["status"] == "False"


def test_a_quiet_window_starts_the_count_again():
    run, att = Run(_spec(maxGroupRestarts=3, groupRestartWindowSeconds=60)), attention_name("kimi")
    run.look(0, _leader(att, 0, "u0"))
    run.look(10, _leader(att, 0, "u1"))
    run.look(20, _leader(att, 0, "u2"))
    assert run.restarts(att, 0) == 2
    run.look(200, _leader(att, 0, "u3"))  # 180 s after the last: a fresh count, not the third
    assert run.restarts(att, 0) == 1 and bounded_sets(run.status, 1) == frozenset()
    run.look(400, _leader(att, 0, "u3"))  # quiet: the count reads 0 again
    assert run.restarts(att, 0) == 0 and condition(run.status, CONDITION) is None  # never bounded: no condition


@pytest.mark.parametrize("lws", [{"restartPolicy": "None"}, {"maxGroupRestarts": 0}])
def test_no_bound_without_group_recreation_or_with_a_zero_limit(lws):
    run, att = Run(_spec(**lws)), attention_name("kimi")
    for i in range(8):
        assert not run.look(i, _leader(att, 0, f"u{i}")).rerender
    assert bounded_sets(run.status, 1) == frozenset()
    assert run.restarts(att, 0) == (0 if lws.get("restartPolicy") == "None" else 7)


def test_statefulset_mode_drops_the_records():
    run = Run(_spec())
    run.look(0, _leader(attention_name("kimi"), 0, "u0"))
    assert run.status["groupRestarts"]
    acc = account(parse_spec(tiny()), run.status, [], {}, 1, _at(1))
    assert acc.status == {"groupRestarts": []} and not acc.rerender


@pytest.mark.asyncio
@pytest.mark.timeout(90)
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
async def test_the_operator_bounds_a_groups_restart_loop():
    crd = load_crd(LWS_CRD)
    async with emulator() as emu:
        register(emu, crd)  # the CRD installed
        deps = Deps(kube=Kube.for_url(str(emu.url).rstrip("/")), fetch_load=no_load, load_timeout=2.0)
        async with run_operator(emu, deps):
            c = Cluster(emu, deps)
            spec = {**tiny_spec(), "workload": "leaderworkerset", "leaderWorkerSet": {"maxGroupRestarts": 2}}
            await c.create_moe("kimi", spec)
            att, exp = attention_name("kimi"), expert_name("kimi")
            lws = await eventually(lambda: c.get(LWS_RESOURCE, att), what="the attention LWS")
            await eventually(lambda: c.get(LWS_RESOURCE, exp), what="the expert LWS")
            assert lws["spec"]["leaderWorkerTemplate"]["restartPolicy"] == "RecreateGroupOnPodRestart"
            await eventually(lambda: c.status("kimi").get("phase") == "Deploying", what="phase Deploying")

            async def start_leader(set_name: str):  # what the LWS controller does: the group's leader pod
                tmpl = c.get(LWS_RESOURCE, set_name)["spec"]["leaderWorkerTemplate"]["workerTemplate"]
                lws_labels = {LWS_SET_LABEL: set_name, LWS_GROUP_LABEL: "0", LWS_WORKER_LABEL: "0"}
                labels = {**tmpl["metadata"]["labels"], **lws_labels, LWS_REVISION_LABEL: "rev1"}
                await c.put_pod(f"{set_name}-0", {**tmpl, "metadata": {**tmpl["metadata"], "labels": labels}})

            def record():
                rs = [r for r in c.status("kimi").get("groupRestarts") or [] if r["set"] == att]
                return rs[0] if rs else None

            await start_leader(att)
            await start_leader(exp)
            first = await eventually(record, what="the attention group recorded")
            assert first["restarts"] == 0 and first["revision"] == "rev1"
            uid = first["leaderUid"]
            for n in (1, 2):  # the group recreated: its leader deleted, back with a new uid
                await start_leader(att)
                await eventually(lambda n=n: record()["restarts"] == n, what=f"recreation {n} counted")
                assert record()["leaderUid"] != uid
                uid = record()["leaderUid"]
            await eventually(
                lambda: c.get(LWS_RESOURCE, att)["spec"]["leaderWorkerTemplate"]["restartPolicy"] == "None",
                what="the attention set's restartPolicy None",
            )
            assert c.get(LWS_RESOURCE, exp)["spec"]["leaderWorkerTemplate"]["restartPolicy"] != "None"
            cond = await eventually(lambda: c.condition("kimi", CONDITION) or None, what="the condition")
            assert cond["status"] == "True" and f"{att} group 0" in cond["message"]
            assert schema_errors(c.get(LWS_RESOURCE, att), crd) == []
            # the status the operator wrote is valid against the MoEDeployment CRD (its status schema)
            assert _status_errors(c.moe("kimi")) == []

            # the spec changes: the bound is lifted, the set recreates groups again
            await c.patch_moe("kimi", {"spec": {"leaderWorkerSet": {"maxGroupRestarts": 4}}})
            await eventually(
                lambda: (
                    c.get(LWS_RESOURCE, att)["spec"]["leaderWorkerTemplate"]["restartPolicy"]
                    == "RecreateGroupOnPodRestart"
                ),
                what="the bound lifted",
            )
            await start_leader(att)  # a pod event: the records and the condition follow
            await eventually(lambda: c.condition("kimi", CONDITION).get("status") == "False", what="condition False")
