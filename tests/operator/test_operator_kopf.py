"""The operator running for real (Kopf's reactor, watches, handlers) against kmock's in-memory Kubernetes API
(the wiring: tests/support/kopf_cluster.py)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import socket
import threading
import urllib.request

import kmock
import kopf
import numpy as np
import pytest
from support.kopf_cluster import (
    KIND,
    MOE,
    NS,
    TINY_EXPERTS,
    Cluster,
    Emulator,
    emulator,
    eventually,
    no_load,
    operator,
    operator_process,
    plain,
    pod_uids,
    ready_deployment,
    run_operator,
    tiny_spec,
)

from expertmesh.model.config import preset
from expertmesh.operator.handlers import Deps, _api, _read_load
from expertmesh.operator.kube import Kube, KubeError
from expertmesh.operator.naming import (
    PLAN_HASH_ANNOTATION,
    attention_name,
    expert_name,
    router_name,
)
from expertmesh.operator.placement_policy import changed_ordinals, parse_load
from expertmesh.placement.planner import imbalance, moved_shards, zipf_loads

pytestmark = [
    pytest.mark.asyncio,
    pytest.mark.timeout(60),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]  # kmock's importlib.resources use


# ------------------------------------------------------------------------------------------------ tests
async def test_create_applies_children_and_reports_status():
    async with operator() as c:
        await c.create_moe("kimi", tiny_spec(experts=2, slots_per_pod=30, redundant=4))
        await eventually(lambda: c.status("kimi").get("phase") == "Deploying", what="Deploying")
        st = c.status("kimi")
        plan = c.plan("kimi")
        moe = c.moe("kimi")
        uid = moe["metadata"]["uid"]
        assert st["observedGeneration"] == 1
        assert st["placement"]["planHash"] == plan.plan_hash()
        assert st["placement"]["logicalExperts"] == TINY_EXPERTS
        assert st["placement"]["physicalExperts"] == TINY_EXPERTS + 4 * 3 == plan.figures.physical_experts
        assert st["endpoints"] == {"http": f"kimi-router.{NS}.svc:8000", "grpc": f"kimi-router.{NS}.svc:50051"}
        placement = c.condition("kimi", "PlacementReady")
        assert placement["status"] == "True" and placement["reason"] == "Planned"
        assert c.condition("kimi", "WorkersReady")["status"] == "False"
        # every child exists, is owned by the resource (garbage collection) and carries the plan where it matters
        children = {
            ("v1/configmaps", "kimi-plan"),
            ("v1/services", "kimi-attention"),
            ("v1/services", "kimi-expert"),
            ("v1/services", "kimi-router"),
            ("apps/v1/statefulsets", "kimi-attention"),
            ("apps/v1/statefulsets", "kimi-expert"),
            ("apps/v1/deployments", "kimi-router"),
            ("policy/v1/poddisruptionbudgets", "kimi-expert"),
            ("v1/secrets", "kimi-worker-tls"),
        }
        for res, name in children:
            obj = c.get(res, name)
            assert obj is not None, (res, name)
            refs = obj["metadata"]["ownerReferences"]
            assert [(r["kind"], r["name"], r["uid"], r["controller"]) for r in refs] == [(KIND, "kimi", uid, True)]
        sts = c.get("apps/v1/statefulsets", "kimi-expert")
        assert sts["spec"]["replicas"] == 2
        assert PLAN_HASH_ANNOTATION not in sts["spec"]["template"]["metadata"]["annotations"]  # the ConfigMap has it
        assert c.get("v1/configmaps", "kimi-plan")["metadata"]["annotations"][PLAN_HASH_ANNOTATION] == plan.plan_hash()
        router = c.get("apps/v1/deployments", "kimi-router")["spec"]["template"]["spec"]["containers"][0]
        experts_arg = router["args"][router["args"].index("--experts") + 1]
        assert experts_arg == f"kimi-expert-0.kimi-expert.{NS}.svc:50061,kimi-expert-1.kimi-expert.{NS}.svc:50061"

        await c.start_pods("kimi")
        await eventually(lambda: c.status("kimi").get("phase") == "Ready", what="Ready")
        st = c.status("kimi")
        assert (st["readyWorkers"], st["desiredWorkers"]) == (3, 3)
        assert st["expertWorkers"]["ready"] == 2 and st["router"] == {"ready": 1, "desired": 1}
        assert {x["type"]: x["status"] for x in st["conditions"]} == {
            "PlacementReady": "True",
            "WorkersReady": "True",
            "RouterReady": "True",
            "Degraded": "False",
        }


async def test_router_replicas_get_one_prefix_salt_secret_kept_across_reconciles():
    """One router: no salt Secret (its own random salt). Two: the operator creates N-router-salt (32 random bytes,
    owned by the resource) and the router pods read it through --prefix-salt-file; a later reconcile keeps it."""
    async with operator() as c:
        await c.create_moe("kimi", tiny_spec())
        await eventually(lambda: c.status("kimi").get("phase") == "Deploying", what="Deploying")
        assert c.get("v1/secrets", "kimi-router-salt") is None
        await c.patch_moe("kimi", {"spec": {"router": {"replicas": 2}}})
        await eventually(lambda: c.status("kimi").get("observedGeneration") == 2, what="generation 2 handled")
        secret = c.get("v1/secrets", "kimi-router-salt")  # made before the router pods that mount it
        assert len(base64.b64decode(secret["data"]["salt"])) == 32
        assert [r["name"] for r in secret["metadata"]["ownerReferences"]] == ["kimi"]
        router = c.get("apps/v1/deployments", "kimi-router")["spec"]["template"]["spec"]["containers"][0]
        assert "--prefix-salt-file" in router["args"]
        await c.patch_moe("kimi", {"spec": {"router": {"replicas": 3}}})
        await eventually(lambda: c.status("kimi").get("observedGeneration") == 3, what="generation 3 handled")
        assert c.get("apps/v1/deployments", "kimi-router")["spec"]["replicas"] == 3
        assert c.get("v1/secrets", "kimi-router-salt")["data"] == secret["data"]


async def test_update_replicas_replans_with_new_hash_and_delete_finalizes():
    async with operator() as c:
        st = await ready_deployment(c, "kimi", tiny_spec(experts=2, slots_per_pod=30))
        old = c.plan("kimi")
        old_expert = c.get("apps/v1/statefulsets", "kimi-expert")["spec"]["template"]
        old_tls = c.get("v1/secrets", "kimi-worker-tls")["data"]
        assert {"ca.crt", "server.crt", "server.key", "client.crt", "client.key"} == set(old_tls)
        lt_placement = c.condition("kimi", "PlacementReady")["lastTransitionTime"]
        await c.patch_moe("kimi", {"spec": {"expertWorkers": {"replicas": 3}}})
        await eventually(lambda: c.status("kimi").get("observedGeneration") == 2, what="generation 2 handled")
        new = c.plan("kimi")
        st = c.status("kimi")
        assert st["placement"]["planHash"] == new.plan_hash() != old.plan_hash()
        assert new.cluster.pods == 3 and st["phase"] == "Deploying"
        # the minimal-movement plan would leave the new pod empty (imbalance 1.5 > 1.1): a balanced plan is taken
        assert len(new.experts_of(2)) >= 15 and new.figures.imbalance < 1.2  # 16 experts / 3 pods: 1.125
        assert st["placement"]["movedShards"] == moved_shards(old, new) > 0
        sts = c.get("apps/v1/statefulsets", "kimi-expert")
        assert sts["spec"]["replicas"] == 3
        # the pod templates do not change with the plan: no rollout (running pods adopt it live)
        assert sts["spec"]["template"] == old_expert  # (the router's changes: it is given the third pod's address)
        # the certificates are issued once: a re-plan keeps them (new ones would split the pods' trust)
        assert c.get("v1/secrets", "kimi-worker-tls")["data"] == old_tls
        assert "pendingRestarts" not in st["placement"]
        assert c.condition("kimi", "PlacementReady")["lastTransitionTime"] == lt_placement  # stayed True
        await c.start_pods("kimi")  # the rollout: pods come back on the new plan
        await eventually(lambda: c.status("kimi").get("phase") == "Ready", what="Ready on the new plan")
        assert c.status("kimi")["readyWorkers"] == 4

        await c.delete_moe("kimi")  # Kopf's finalizer is released and the object goes
        await eventually(lambda: c.moe("kimi") is None, what="deleted")


async def test_transient_api_error_is_retried_with_backoff():
    async with operator() as c:
        c.emu.failures[("PATCH", f"/apis/apps/v1/namespaces/{NS}/statefulsets/kimi-expert")] = 1
        await c.create_moe("kimi", tiny_spec())
        await eventually(lambda: c.status("kimi").get("phase") == "Deploying", what="Deploying after a retry")
        assert c.emu.failures[("PATCH", f"/apis/apps/v1/namespaces/{NS}/statefulsets/kimi-expert")] == 0
        assert c.get("apps/v1/statefulsets", "kimi-expert")["spec"]["replicas"] == 2
        applies = [w for w in c.emu.writes if w[1] == f"/apis/apps/v1/namespaces/{NS}/statefulsets/kimi-expert"]
        assert len(applies) == 2  # apply → 503 (TemporaryError); after the backoff: apply → 404 → create


async def test_kube_errors_map_to_kopf_errors():
    async def fail(status):
        raise KubeError(status, "boom")

    for status in (None, 409, 429, 500, 503):
        with pytest.raises(kopf.TemporaryError) as e:
            await _api(fail(status), retry=3)
        assert e.value.delay == 8.0
    with pytest.raises(KubeError):  # a refusal is not retried blindly
        await _api(fail(422))


async def test_invalid_spec_fails_with_message_without_retry_storm():
    async with operator() as c:
        bad = tiny_spec()
        bad["expertWorkers"]["reserveGiB"] = 1.0  # more than the whole device
        await c.create_moe("bad", bad)
        await eventually(lambda: c.status("bad").get("phase") == "Failed", what="Failed")
        cond = c.condition("bad", "PlacementReady")
        assert cond["status"] == "False" and cond["reason"] == "InvalidSpec"
        assert "expertWorkers.reserveGiB" in cond["message"] and "gpuMemoryGiB" in cond["message"]
        writes = len([w for w in c.emu.writes if "/bad" in w[1]])
        await asyncio.sleep(1.5)  # a retrying handler would patch again within this
        assert len([w for w in c.emu.writes if "/bad" in w[1]]) == writes
        assert c.get("apps/v1/statefulsets", "bad-expert") is None

        small = tiny_spec(experts=1, slots_per_pod=40)  # 48 experts do not fit 1 pod of 40 slots
        await c.create_moe("small", small)
        await eventually(lambda: c.status("small").get("phase") == "Failed", what="Failed (too small)")
        cond = c.condition("small", "PlacementReady")
        assert cond["reason"] == "ClusterTooSmall" and "GiB missing" in cond["message"]
        assert "2 pods of this shape would fit" in cond["message"]

        # fixing the spec gets it out of Failed
        await c.patch_moe("small", {"spec": {"expertWorkers": {"replicas": 2}}})
        await eventually(lambda: c.status("small").get("phase") == "Deploying", what="Deploying after the fix")
        assert c.condition("small", "PlacementReady")["status"] == "True"


async def test_lost_pod_with_replicas_is_degraded_then_recovers():
    async with operator() as c:
        # 2 pods, 16 redundant slots per layer: every expert has a replica on each pod
        await ready_deployment(c, "kimi", tiny_spec(experts=2, slots_per_pod=48, redundant=16))
        plan = c.plan("kimi")
        assert all(len(plan.replicas(layer, e)) == 2 for layer, e in plan.experts_of(0))
        await c.delete_pod("kimi-expert-1")
        await eventually(lambda: c.status("kimi").get("phase") == "Degraded", what="Degraded")
        cond = c.condition("kimi", "Degraded")
        assert cond["status"] == "True" and cond["reason"] == "ReplicasServing"
        assert c.plan("kimi").plan_hash() == plan.plan_hash()  # nothing moved
        assert c.status("kimi")["expertWorkers"]["ready"] == 1
        # NotReady (not deleted) counts as lost too; back Ready → Ready
        await c.set_ready("kimi-expert-0", False)
        await c.put_pod("kimi-expert-1", c.get("apps/v1/statefulsets", "kimi-expert")["spec"]["template"])
        await eventually(
            lambda: (
                c.status("kimi")["expertWorkers"]["ready"] == 1 and c.condition("kimi", "Degraded")["status"] == "True"
            ),
            what="still degraded",
        )
        await c.set_ready("kimi-expert-0", True)
        await eventually(lambda: c.status("kimi").get("phase") == "Ready", what="Ready again")


async def test_lost_pod_without_replicas_replans_onto_survivors():
    async with operator() as c:
        # 16 experts each, room for 24; a lost pod gets 1 s to come back before its experts are re-planned
        await ready_deployment(c, "kimi", tiny_spec(experts=3, slots_per_pod=24, grace=1))
        old = c.plan("kimi")
        await c.delete_pod("kimi-expert-1")
        await eventually(
            lambda: c.condition("kimi", "Degraded").get("reason") == "ExpertsUnavailable", what="ExpertsUnavailable"
        )
        assert "unless they come back" in c.condition("kimi", "Degraded")["message"]
        assert c.plan("kimi").plan_hash() == old.plan_hash() and c.status("kimi")["lostSince"][0]["ordinal"] == 1
        # the grace period runs out: the timer re-assesses and re-plans
        await eventually(lambda: c.status("kimi")["placement"]["planHash"] != old.plan_hash(), what="re-plan")
        new = c.plan("kimi")
        st = c.status("kimi")
        assert st["placement"]["planHash"] == new.plan_hash() and st["placement"]["lostWorkers"] == [1]
        assert new.experts_of(1) == []
        assert set(new.experts_of(0)) >= set(old.experts_of(0)) and set(new.experts_of(2)) >= set(old.experts_of(2))
        assert st["placement"]["movedShards"] == len(old.experts_of(1))  # only the lost pod's experts move
        assert c.condition("kimi", "Degraded")["reason"] == "ReplannedOntoSurvivors"
        # Deploying as the re-plan writes it; the next assessment may already find every pod the new plan needs live
        # (the survivors, still on the old plan) and say Degraded, routing around the lost worker
        assert st["phase"] in ("Deploying", "Degraded"), st["phase"]
        assert (
            PLAN_HASH_ANNOTATION
            not in c.get("apps/v1/statefulsets", "kimi-expert")["spec"]["template"]["metadata"]["annotations"]
        )
        # the survivors roll onto the new plan, the lost pod comes back: it rejoins and all is Ready again
        await c.start_pods("kimi")
        await eventually(lambda: c.status("kimi")["placement"]["lostWorkers"] == [], what="rejoined")
        await c.start_pods("kimi")
        await eventually(lambda: c.status("kimi").get("phase") == "Ready", what="Ready")
        assert c.plan("kimi").experts_of(1) != []


async def test_lost_pod_without_memory_to_replan_is_degraded_with_reason():
    async with operator() as c:
        await ready_deployment(c, "kimi", tiny_spec(experts=2, slots_per_pod=30))  # one pod cannot hold 48
        old = c.plan("kimi")
        await c.delete_pod("kimi-expert-0")
        await eventually(
            lambda: c.condition("kimi", "Degraded").get("reason") == "InsufficientMemory", what="InsufficientMemory"
        )
        assert c.status("kimi")["phase"] == "Degraded"
        assert "GiB missing" in c.condition("kimi", "Degraded")["message"]
        assert c.plan("kimi").plan_hash() == old.plan_hash()


async def test_timer_rebalances_on_observed_imbalance():
    cfg = preset("tiny")
    skew = zipf_loads(cfg, s=1.5, seed=3) * 1000
    calls = []

    async def fetch(url, timeout):
        calls.append((url, timeout))
        return {
            "model": "tiny",
            "moe_layers": cfg.moe_layers,
            "tokens": {str(layer): skew[i].round().tolist() for i, layer in enumerate(cfg.moe_layers)},
        }

    async with operator(fetch_load=fetch, tick=0.2) as c:
        await ready_deployment(c, "kimi", tiny_spec(experts=2, slots_per_pod=40, redundant=8, interval=1))
        old = c.plan("kimi")
        await eventually(lambda: c.plan("kimi").plan_hash() != old.plan_hash(), timeout=15, what="rebalance")
        assert calls[0] == (f"http://kimi-router.{NS}.svc:8000/v1/load", 2.0)
        new = c.plan("kimi")
        st = await eventually(lambda: c.status("kimi") if c.status("kimi").get("lastRebalanceTime") else None)
        assert st["placement"]["planHash"] == new.plan_hash()
        assert st["placement"]["observedImbalance"] > 1.1
        loads = parse_load(await fetch("", 0), cfg)
        assert imbalance(new, loads).mean < imbalance(old, loads).mean
        assert c.condition("kimi", "PlacementReady")["reason"] == "Rebalanced"
        assert np.isclose(st["placement"]["observedImbalance"], imbalance(old, loads).mean, atol=1e-4)
        # the observed load is kept in the cluster (owned by the resource): a restarted operator or a new leader
        # re-plans around a lost pod with it
        kept = c.get("v1/configmaps", "kimi-load")
        assert kept["metadata"]["ownerReferences"][0]["name"] == "kimi"
        assert np.array_equal(await _read_load(c.deps, NS, "kimi", cfg), loads)


async def test_a_restarted_operator_keeps_the_rebalance_time_and_the_observed_load():
    """What the operator knows between load reads lives in the cluster, not in its memory: after a restart (a
    fresh process: empty Deps) the last rebalance time in the status still holds the interval — no early read of
    the router's load — and the load kept in `<name>-load` is what it re-plans with."""
    cfg = preset("tiny")
    skew = zipf_loads(cfg, s=1.5, seed=3) * 1000
    calls = []

    async def fetch(url, timeout):
        calls.append(url)
        return {
            "model": "tiny",
            "moe_layers": cfg.moe_layers,
            "tokens": {str(layer): skew[i].round().tolist() for i, layer in enumerate(cfg.moe_layers)},
        }

    async with emulator() as emu:
        url = str(emu.url).rstrip("/")
        first = Deps(kube=Kube.for_url(url), fetch_load=fetch, load_timeout=2.0)
        async with run_operator(emu, first):
            c = Cluster(emu, first)
            await ready_deployment(c, "kimi", tiny_spec(experts=2, slots_per_pod=40, redundant=8, interval=60))
            await eventually(lambda: c.status("kimi").get("lastRebalanceTime"), what="a load read")
            await eventually(lambda: c.get("v1/configmaps", "kimi-load"), what="the load kept")
        read, rebalanced = len(calls), c.status("kimi")["lastRebalanceTime"]
        assert read == 1 and first.loads
        second = Deps(kube=Kube.for_url(url), fetch_load=fetch, load_timeout=2.0)  # a new process: nothing known
        async with run_operator(emu, second):
            c = Cluster(emu, second)
            await asyncio.sleep(1.5)  # several timer ticks (0.2 s) of a Ready resource
            assert len(calls) == read and c.status("kimi")["lastRebalanceTime"] == rebalanced
            assert second.loads == {}
            kept = await _read_load(second, NS, "kimi", cfg)
            assert np.array_equal(kept, first.loads[(NS, "kimi")])


async def test_cli_entrypoint_connects_via_kubeconfig_and_serves_liveness(tmp_path):
    """`expertmesh operator` as a process: kubeconfig login, liveness endpoint, SIGTERM. (Cluster-wide: in
    namespace-scoped mode Kopf lists /api/v1/namespaces, a path kmock 0.8 cannot parse.)"""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    async with Emulator() as emu, kmock.Server(emu):
        emu.resources.load_bundled()
        emu.resources[MOE] = kmock.ResourceInfo(
            kind=KIND, namespaced=True, verbs={"get", "list", "watch", "patch"}, subresources={"status", "scale"}
        )
        async with operator_process(emu, tmp_path, "--liveness", f"http://127.0.0.1:{port}/healthz"):
            c = Cluster(emu, None)
            await c.create_moe("kimi", tiny_spec())
            await eventually(lambda: c.status("kimi").get("phase") == "Deploying", timeout=30, what="Deploying")
            assert c.get("apps/v1/statefulsets", "kimi-expert") is not None

            def live():
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as r:
                    return r.status == 200

            assert await asyncio.to_thread(live)
            auth = {r.headers.get("Authorization") for r in emu if r.headers.get("Authorization")}
            assert auth == {"Bearer t0ken"}  # Kopf and the operator's own calls both use the kubeconfig's user


@contextlib.asynccontextmanager
async def controllers(c: Cluster, name: str, hold: set):
    """The StatefulSet / Deployment controllers and kubelets, crudely: a missing pod (other than those named in
    `hold`) is recreated, Ready, from its workload's current template."""

    async def loop():
        while True:
            for sts in (attention_name(name), expert_name(name)):
                obj = c.get("apps/v1/statefulsets", sts)
                for i in range(obj["spec"]["replicas"]):
                    if f"{sts}-{i}" not in hold and c.get("v1/pods", f"{sts}-{i}") is None:
                        await c.put_pod(f"{sts}-{i}", obj["spec"]["template"])
            dep = c.get("apps/v1/deployments", router_name(name))
            pod = f"{router_name(name)}-5d8f9-0"
            if c.get("v1/pods", pod) is None:
                await c.put_pod(pod, dep["spec"]["template"])
            await asyncio.sleep(0.05)

    task = asyncio.create_task(loop())
    try:
        yield
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_new_plans_are_published_without_touching_pod_templates():
    """redundantExperts changed, then an expert pod lost: each publishes a new plan in the ConfigMap while every
    pod template stays byte-identical and no pod is restarted (the router and the expert workers adopt the
    plan live: tests/worker/test_live_replan.py, tests/operator/test_operator_e2e.py)."""

    def templates():
        return json.dumps(
            [
                c.get(r, n)["spec"]["template"]
                for r, n in (
                    ("apps/v1/statefulsets", "kimi-expert"),
                    ("apps/v1/statefulsets", "kimi-attention"),
                    ("apps/v1/deployments", "kimi-router"),
                )
            ],
            sort_keys=True,
        )

    async with operator() as c:
        await ready_deployment(c, "kimi", tiny_spec(experts=4, slots_per_pod=18, grace=0))
        hold: set = set()
        async with controllers(c, "kimi", hold):
            before, uids, old = templates(), pod_uids(c), c.plan("kimi")
            await c.patch_moe("kimi", {"spec": {"expertWorkers": {"redundantExperts": 1}}})
            await eventually(lambda: c.status("kimi")["placement"]["planHash"] != old.plan_hash(), what="new plan")
            new = c.plan("kimi")
            assert new.figures.physical_experts == TINY_EXPERTS + 1 * 3
            assert templates() == before
            changed = changed_ordinals(old, new)
            assert changed and set(changed) < {0, 1, 2, 3}  # minimal movement: not every pod gains a replica
            assert c.status("kimi")["placement"]["movedShards"] == 3
            await eventually(lambda: c.status("kimi").get("phase") == "Ready", what="Ready")
            assert pod_uids(c) == uids  # nothing restarted

            # an expert pod is lost for good: its experts are re-planned onto the survivors, templates unchanged
            old, uids = c.plan("kimi"), pod_uids(c)
            hold.add("kimi-expert-1")
            await c.delete_pod("kimi-expert-1")
            await eventually(lambda: c.status("kimi")["placement"]["planHash"] != old.plan_hash(), what="re-plan")
            assert templates() == before and c.plan("kimi").experts_of(1) == []
            await eventually(
                lambda: (
                    c.status("kimi").get("phase") == "Degraded"
                    and c.condition("kimi", "Degraded")["reason"] == "ReplannedOntoSurvivors"
                ),
                what="re-planned",
            )
            assert {p: u for p, u in pod_uids(c).items()} == {p: u for p, u in uids.items() if p != "kimi-expert-1"}
            # it comes back: re-planned onto every pod, still without touching a template
            hold.clear()
            await eventually(
                lambda: c.status("kimi").get("phase") == "Ready" and c.plan("kimi").experts_of(1) != [],
                timeout=15,
                what="rejoined and Ready",
            )
            assert templates() == before


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(level=logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


class CountingKube(Kube):
    """The operator's API edge, counting the children it applies (tells which replica did the work)."""

    applies = 0

    async def apply(self, obj: dict) -> dict:
        self.applies += 1
        return await super().apply(obj)


async def test_two_replicas_elect_one_leader_and_the_standby_takes_over():
    """Two operators with `--peering`: the higher priority leads (reconciles), the other stands by (paused, no
    writes); when the leader stops, the standby resumes and handles the next change.

    The leader starts first and the standby joins once the leader's entry is in the peering: Kopf starts every
    peered operator paused, so the standby then never resumes while the leader lives. (A standby started first
    resumes alone and pauses again when the leader comes; under the suite's load that pause was sometimes reached
    without Kopf's "Pausing" log line, which the test used to wait for.)"""
    async with emulator() as emu:
        url = str(emu.url).rstrip("/")
        c = Cluster(emu, None)
        await c._ok(
            emu.post(
                "/apis/kopf.dev/v1/clusterkopfpeerings",
                json={"apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering", "metadata": {"name": "expertmesh"}},
            )
        )

        def peers() -> dict:
            for (res, _ns, name), obj in list(emu.objects.items()):
                if (
                    res == kmock.resource("kopf.dev/v1/clusterkopfpeerings")
                    and name == "expertmesh"
                    and not obj.deleted
                ):
                    return plain(obj.raw).get("status") or {}
            return {}

        kubes = [CountingKube.for_url(url), CountingKube.for_url(url)]
        kopf_logs, peering_log = _Records(), logging.getLogger("kopf._core.engines.peering")
        level = peering_log.level
        peering_log.setLevel(logging.INFO)  # Kopf says it pauses and resumes at INFO
        peering_log.addHandler(kopf_logs)

        def resumed(thread: threading.Thread) -> bool:
            return any(
                r.thread == thread.ident and r.getMessage().startswith("Resuming operations")
                for r in list(kopf_logs.records)
            )

        deps = [Deps(kube=k, fetch_load=no_load, load_timeout=2.0) for k in kubes]
        try:
            # short lifetimes: keep-alives every second, so a peer's entry missed by a watch that started late
            # (the suite's load) is seen on the next one
            async with contextlib.AsyncExitStack() as standby_lifetime:  # the standby outlives the leader
                async with run_operator(
                    emu, deps[1], peering_name="expertmesh", priority=20, peering_lifetime=6
                ) as leader:
                    await eventually(lambda: resumed(leader), what="the leader, alone, resumed")
                    await eventually(
                        lambda: [p["priority"] for p in peers().values()] == [20], what="the leader's entry"
                    )
                    standby = await standby_lifetime.enter_async_context(
                        run_operator(emu, deps[0], peering_name="expertmesh", priority=10, peering_lifetime=6)
                    )
                    await eventually(lambda: len(peers()) == 2, what="both replicas in the peering")
                    assert sorted(p["priority"] for p in peers().values()) == [10, 20]
                    await c.create_moe("kimi", tiny_spec())
                    await eventually(lambda: c.status("kimi").get("phase") == "Deploying", what="reconciled")
                    await asyncio.sleep(1.0)
                    assert kubes[1].applies > 0 and kubes[0].applies == 0  # only the leader worked
                    assert not resumed(standby)  # the standby stayed paused
                # the leader is gone (its peering entry removed on exit): the standby resumes and takes the next change
                await eventually(
                    lambda: [p["priority"] for p in peers().values()] == [10], what="the leader's entry removed"
                )
                await eventually(lambda: resumed(standby), timeout=15, what="the standby resumed")
                await c.patch_moe("kimi", {"spec": {"expertWorkers": {"replicas": 3}}})
                await eventually(
                    lambda: c.status("kimi").get("observedGeneration") == 2, timeout=15, what="the standby reconciled"
                )
                assert kubes[0].applies > 0 and standby.is_alive()
        finally:
            peering_log.removeHandler(kopf_logs)
            peering_log.setLevel(level)


# ------------------------------------------------------------------------------------------------ pools (#36)
def _pool_addresses(statefulset: str, n: int) -> str:
    return ",".join(f"{statefulset}-{i}.{statefulset}.{NS}.svc:50061" for i in range(n))


async def test_a_prefill_pool_gets_its_statefulset_the_routers_list_and_status():
    """prefillWorkers.replicas 1: both StatefulSets (the attention workers --pool decode, the prefill workers --pool
    prefill), the router's --prefill list, status for both pools; back to 0: the prefill objects are deleted, the
    router colocated again and status.prefillWorkers gone."""
    async with operator() as c:
        spec = tiny_spec()
        spec["prefillWorkers"] = {"replicas": 1, "gpusPerPod": 0}
        await c.create_moe("kimi", spec)
        await eventually(lambda: c.status("kimi").get("phase") == "Deploying", what="Deploying")
        pre, dec = c.get("apps/v1/statefulsets", "kimi-prefill"), c.get("apps/v1/statefulsets", "kimi-attention")
        uid = c.moe("kimi")["metadata"]["uid"]
        for obj in (
            pre,
            c.get("v1/services", "kimi-prefill"),
            c.get("networking.k8s.io/v1/networkpolicies", "kimi-prefill-worker-ingress"),
        ):
            assert [r["uid"] for r in obj["metadata"]["ownerReferences"]] == [uid]
        pre_args, dec_args = (s["spec"]["template"]["spec"]["containers"][0]["args"] for s in (pre, dec))
        assert (
            pre_args[pre_args.index("--pool") + 1] == "prefill" and dec_args[dec_args.index("--pool") + 1] == "decode"
        )
        assert pre["spec"]["replicas"] == 1
        assert c.router_arg("kimi", "--prefill") == _pool_addresses("kimi-prefill", 1)
        assert c.router_arg("kimi", "--attention") == _pool_addresses("kimi-attention", 1)
        await c.start_pods("kimi")
        await eventually(lambda: c.status("kimi").get("phase") == "Ready", what="Ready")
        st = c.status("kimi")
        assert st["prefillWorkers"] == {"ready": 1, "desired": 1} and st["attentionWorkers"] == {
            "ready": 1,
            "desired": 1,
        }
        assert (st["readyWorkers"], st["desiredWorkers"]) == (4, 4)
        assert "1/1 prefill workers ready" in c.condition("kimi", "WorkersReady")["message"]

        await c.patch_moe("kimi", {"spec": {"prefillWorkers": {"replicas": 0}}})
        await eventually(lambda: c.status("kimi").get("observedGeneration") == 2, what="generation 2 handled")
        await eventually(lambda: c.get("apps/v1/statefulsets", "kimi-prefill") is None, what="prefill deleted")
        assert c.get("v1/services", "kimi-prefill") is None
        assert c.get("networking.k8s.io/v1/networkpolicies", "kimi-prefill-worker-ingress") is None
        assert c.router_arg("kimi", "--prefill") is None
        args = c.get("apps/v1/statefulsets", "kimi-attention")["spec"]["template"]["spec"]["containers"][0]["args"]
        assert "--pool" not in args
        assert c.status("kimi").get("prefillWorkers") is None


async def test_an_autoscaled_pool_keeps_the_hpas_replicas_and_the_router_follows():
    """prefillWorkers.autoscale: an HPA on the prefill StatefulSet, which starts at minReplicas; the HPA's resize
    (here played by the test) is kept — not reset by the operator, not by a later reconcile — and re-renders the
    router's --prefill list; autoscale removed: the HPA is deleted and the spec's replicas apply again."""
    async with operator() as c:
        spec = tiny_spec()
        spec["prefillWorkers"] = {
            "gpusPerPod": 0,
            "autoscale": {"minReplicas": 1, "maxReplicas": 4, "metric": "prefill_tokens_waiting", "target": 2048},
        }
        await ready_deployment(c, "kimi", spec)
        hpa = c.get("autoscaling/v2/horizontalpodautoscalers", "kimi-prefill")
        assert hpa["spec"]["scaleTargetRef"]["name"] == "kimi-prefill" and hpa["spec"]["maxReplicas"] == 4
        assert hpa["spec"]["metrics"][0]["external"]["metric"]["name"] == "expertmesh_pool_prefill_tokens_waiting"
        assert c.get("apps/v1/statefulsets", "kimi-prefill")["spec"]["replicas"] == 1
        assert c.get("autoscaling/v2/horizontalpodautoscalers", "kimi-attention") is None  # not autoscaled
        router_template = c.get("apps/v1/deployments", "kimi-router")["spec"]["template"]

        await asyncio.sleep(1.0)  # the pods' events handled: what follows the resize is its StatefulSet's event
        await c.scale("kimi-prefill", 3)  # the HPA scales the pool up
        await eventually(
            lambda: c.router_arg("kimi", "--prefill") == _pool_addresses("kimi-prefill", 3),
            what="the router lists 3 prefill workers",
        )
        assert c.get("apps/v1/statefulsets", "kimi-prefill")["spec"]["replicas"] == 3
        assert c.get("apps/v1/deployments", "kimi-router")["spec"]["template"] != router_template  # it rolls
        await eventually(
            lambda: c.status("kimi").get("prefillWorkers") == {"ready": 1, "desired": 3},
            what="status: 1/3 prefill workers",
        )
        assert c.status("kimi")["phase"] == "Deploying"
        await c.start_pods("kimi")
        await eventually(lambda: c.status("kimi").get("phase") == "Ready", what="Ready at 3 prefill workers")
        assert c.status("kimi")["prefillWorkers"] == {"ready": 3, "desired": 3}

        await c.patch_moe("kimi", {"spec": {"router": {"replicas": 2}}})  # an unrelated change: a reconcile
        await eventually(lambda: c.status("kimi").get("observedGeneration") == 2, what="generation 2 handled")
        assert c.get("apps/v1/statefulsets", "kimi-prefill")["spec"]["replicas"] == 3  # kept, not reset
        assert c.router_arg("kimi", "--prefill") == _pool_addresses("kimi-prefill", 3)

        await c.scale("kimi-prefill", 2)  # and down
        await eventually(
            lambda: c.router_arg("kimi", "--prefill") == _pool_addresses("kimi-prefill", 2),
            what="the router lists 2 prefill workers",
        )

        await c.patch_moe("kimi", {"spec": {"prefillWorkers": {"autoscale": None, "replicas": 1}}})
        await eventually(
            lambda: c.get("autoscaling/v2/horizontalpodautoscalers", "kimi-prefill") is None, what="the HPA deleted"
        )
        assert c.get("apps/v1/statefulsets", "kimi-prefill")["spec"]["replicas"] == 1
        assert c.router_arg("kimi", "--prefill") == _pool_addresses("kimi-prefill", 1)


async def test_bad_autoscale_fields_fail_naming_them():
    async with operator() as c:
        bad = tiny_spec()
        bad["prefillWorkers"] = {"autoscale": {"minReplicas": 3, "maxReplicas": 2, "target": 10}}
        await c.create_moe("bad", bad)
        await eventually(lambda: c.status("bad").get("phase") == "Failed", what="Failed")
        cond = c.condition("bad", "PlacementReady")
        assert cond["reason"] == "InvalidSpec" and "spec.prefillWorkers.autoscale.maxReplicas" in cond["message"]
        assert c.get("apps/v1/statefulsets", "bad-prefill") is None
        await c.patch_moe("bad", {"spec": {"prefillWorkers": {"autoscale": {"maxReplicas": 4}}}})
        await eventually(lambda: c.status("bad").get("phase") == "Deploying", what="Deploying after the fix")
        assert c.get("autoscaling/v2/horizontalpodautoscalers", "bad-prefill")["spec"]["minReplicas"] == 3
        assert c.get("apps/v1/statefulsets", "bad-prefill")["spec"]["replicas"] == 3
