"""Bounds on what a MoEDeployment can make the operator do (issue 33, items 2 and 6): every spec of the probe gets a
status condition naming its field — never a crash loop, a blocked event loop or an invalid child — and the operator
stays small while it refuses them.

  - the schema: every number, string, list and map of the CRD (spec and status) and of the pydantic models is
    bounded; `metadata.name` is bounded (schema + CEL) so that every child name is valid;
  - the operator (Kopf, for real, against kmock's emulator — which enforces no schema, as a cluster whose CRD predates
    the bounds would not) refuses each bad spec with InvalidSpec naming the field;
  - planning: refused before computing past its budget (PlanBudgetExceeded), run in a process under a deadline and a
    memory limit, never on Kopf's loop; a child the API would not take is refused unsent (ObjectTooLarge).
"""

from __future__ import annotations

import asyncio
import copy
import json
import re
import time

import kmock
import pytest
import yaml
from support.kopf_cluster import (
    KIND,
    MOE,
    NS,
    PLURAL,
    Cluster,
    Emulator,
    emulator,
    eventually,
    no_load,
    operator,
    operator_process,
    run_operator,
    tiny_spec,
)
from support.relatives import DEEPSEEK_V32

from expertmesh.operator import crd
from expertmesh.operator.budget import ARG_MAX, check_children, estimate
from expertmesh.operator.children import build_children
from expertmesh.operator.handlers import Deps
from expertmesh.operator.kube import Kube
from expertmesh.operator.naming import LABEL_VERSION, MAX_NAME_LENGTH, STATEFULSET_NAME_MAX, expert_name, name_error
from expertmesh.operator.placement_policy import plan_for
from expertmesh.operator.planning import PlanningFailed, PlanRunner
from expertmesh.operator.spec import (
    MAX_ATTENTION_REPLICAS,
    MAX_EXPERT_REPLICAS,
    MoEDeploymentSpec,
    MoEDeploymentStatus,
    parse_spec,
    resolve_model,
)
from expertmesh.operator.validation import LABEL_VALUE
from expertmesh.placement.planner import PlanError

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]  # kmock's importlib.resources use

MIB = 2**20
OPERATOR_MEMORY_MAX = 256 * MIB
FETCHED = {"uri": "https://weights.example/tiny"}


def _merge(base: dict, patch: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in patch.items():
        out[k] = _merge(out.get(k) or {}, v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _checkpoint(**over) -> dict:
    return {"model": {"preset": "tiny", "checkpoint": over}}


# (id, metadata.name, spec patch over tiny_spec(), what the condition's message must name)
BAD_SPECS = [
    # item 2: one spec value crash-looped the operator (31 s, 1.99 GiB on its event loop), an overflow retried forever
    ("gpus-per-pod-1e6", "gpus", {"expertWorkers": {"gpusPerPod": 1_000_000}}, "spec.expertWorkers.gpusPerPod"),
    ("gpu-memory-1e300", "memory", {"expertWorkers": {"gpuMemoryGiB": 1e300}}, "spec.expertWorkers.gpuMemoryGiB"),
    ("block-size-1e9", "block", {"kv": {"blockSize": 1e9}}, "spec.kv.blockSize"),
    ("attention-40000", "attention", {"attentionWorkers": {"replicas": 40_000}}, "spec.attentionWorkers.replicas"),
    ("experts-20000", "experts", {"expertWorkers": {"replicas": 20_000}}, "spec.expertWorkers.replicas"),
    (
        "redundant-1e9",
        "redundant",
        {"expertWorkers": {"redundantExperts": 10**9}},
        "spec.expertWorkers.redundantExperts",
    ),
    ("thinking-1e12", "thinking", {"thinking": {"low": 1, "high": 2, "max": 10**12}}, "spec.thinking.max"),
    (
        "config-layers-1e7",
        "layers",
        {"model": {"preset": None, "config": {**DEEPSEEK_V32, "num_hidden_layers": 10**7}}},
        "spec.model.config.num_hidden_layers",
    ),
    # item 6: specs that validated but built invalid children
    ("name-50-chars", "k" * 50, {}, "metadata.name"),
    ("name-with-a-dot", "kimi.v2", {}, "metadata.name"),
    ("name-leading-digit", "3kimi", {}, "metadata.name"),
    ("image-tag-with-space", "tag", {"image": {"tag": "v1 beta"}}, "spec.image.tag"),
    ("image-repository-upper", "repo", {"image": {"repository": "Registry/Team/Expertmesh"}}, "spec.image.repository"),
    (
        "toleration-exists-with-value",
        "tol-value",
        {"scheduling": {"tolerations": [{"key": "gpu", "operator": "Exists", "value": "yes"}]}},
        "spec.scheduling.tolerations.0",
    ),
    (
        "toleration-seconds-without-noexecute",
        "tol-seconds",
        {
            "scheduling": {
                "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule", "tolerationSeconds": 30}]
            }
        },
        "spec.scheduling.tolerations.0",
    ),
    (
        "toleration-empty-key-equal",
        "tol-key",
        {"scheduling": {"tolerations": [{"operator": "Equal", "value": "x"}]}},
        "spec.scheduling.tolerations.0",
    ),
    (
        "node-selector-key",
        "selector-key",
        {"scheduling": {"nodeSelector": {"bad key!": "x"}}},
        "spec.scheduling.nodeSelector",
    ),
    (
        "node-selector-value",
        "selector-value",
        {"scheduling": {"nodeSelector": {"pool": "a b"}}},
        "spec.scheduling.nodeSelector.pool",
    ),
    (
        "topology-key",
        "topology",
        {"scheduling": {"topologySpreadKey": "-bad-/key-"}},
        "spec.scheduling.topologySpreadKey",
    ),
    ("cpu-lots", "cpu", {"router": {"resources": {"requests": {"cpu": "lots"}}}}, "spec.router.resources.requests.cpu"),
    (
        "memory-negative",
        "negative",
        {"attentionWorkers": {"resources": {"limits": {"memory": "-1Gi"}}}},
        "spec.attentionWorkers.resources.limits.memory",
    ),
    (
        "resource-unknown",
        "resource",
        {"attentionWorkers": {"resources": {"limits": {"gpus": 1}}}},
        "spec.attentionWorkers.resources.limits.gpus",
    ),
    (
        "requests-over-limits",
        "over",
        {"router": {"resources": {"requests": {"memory": "2Gi"}, "limits": {"memory": "1Gi"}}}},
        "spec.router.resources",
    ),
    (
        "gpu-requests-not-limits",
        "gpu",
        {
            "attentionWorkers": {
                "gpusPerPod": 1,
                "resources": {"requests": {"nvidia.com/gpu": 2}, "limits": {"nvidia.com/gpu": 1}},
            }
        },
        "spec.attentionWorkers",
    ),
    (
        "host-path-relative",
        "host-relative",
        _checkpoint(**FETCHED, cache={"hostPath": "cache/expertmesh"}),
        "spec.model.checkpoint.cache.hostPath",
    ),
    (
        "host-path-dotdot",
        "host-dotdot",
        _checkpoint(**FETCHED, cache={"hostPath": "/var/cache/../../etc"}),
        "spec.model.checkpoint.cache.hostPath",
    ),
    (
        "pvc-path-dotdot",
        "pvc-dotdot",
        _checkpoint(pvc={"claimName": "weights", "path": "../../etc"}),
        "spec.model.checkpoint.pvc.path",
    ),
    ("uri-option", "uri-option", _checkpoint(uri="--help"), "spec.model.checkpoint.uri"),
    ("uri-relative", "uri-relative", _checkpoint(uri="checkpoints/tiny"), "spec.model.checkpoint.uri"),
    (
        "secret-name",
        "secret",
        _checkpoint(**FETCHED, tokenSecretRef={"name": "Bad_Name", "key": "token"}),
        "spec.model.checkpoint.tokenSecretRef.name",
    ),
    (
        "s3-endpoint",
        "endpoint",
        _checkpoint(uri="s3://bucket/tiny", endpoint="minio:9000 --x"),
        "spec.model.checkpoint.endpoint",
    ),
]


def bad_spec(patch: dict) -> dict:
    """tiny_spec() with `patch` merged in; a patched checkpoint or model config replaces the whole one (so that the
    spec is wrong in that one field only)."""
    spec = _merge(tiny_spec(), patch)
    for key in ("checkpoint", "config"):
        if key in patch.get("model", {}):
            spec["model"][key] = copy.deepcopy(patch["model"][key])
    if spec["model"].get("preset") is None:
        spec["model"].pop("preset", None)
    return spec


def _label_value_ok(value: str) -> bool:
    return len(value) <= 63 and re.fullmatch(LABEL_VALUE, value) is not None


# ------------------------------------------------------------------------------------------------ the schema
def _walk(node: dict, path: str = ""):
    yield path, node
    for name, sub in (node.get("properties") or {}).items():
        yield from _walk(sub, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        yield from _walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from _walk(node["additionalProperties"], f"{path}.*")


def _unbounded(schema: dict) -> list[str]:
    """Every number needs a maximum, every free string a maxLength or pattern, every list maxItems, every map
    maxProperties."""
    out = []
    for path, node in _walk(schema):
        t = node.get("type")
        if node.get("x-kubernetes-int-or-string"):
            if not ("maximum" in node and ("maxLength" in node or "pattern" in node)):
                out.append(f"{path}: int-or-string without maximum and maxLength/pattern")
        elif t in ("integer", "number") and "maximum" not in node:
            out.append(f"{path}: {t} without maximum")
        elif t == "string" and not ({"maxLength", "pattern", "enum"} & set(node)):
            out.append(f"{path}: string without maxLength / pattern / enum")
        elif t == "array" and "maxItems" not in node:
            out.append(f"{path}: array without maxItems")
        elif (
            t == "object"
            and ("additionalProperties" in node or node.get("x-kubernetes-preserve-unknown-fields"))
            and "maxProperties" not in node
        ):
            out.append(f"{path}: map without maxProperties")
    return out


def test_every_field_of_the_crd_and_the_models_is_bounded():
    doc = yaml.safe_load(crd.DEFAULT_PATH.read_text())
    root = doc["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    assert _unbounded(root["properties"]["spec"]) == []
    assert _unbounded(root["properties"]["status"]) == []
    # the pydantic models the CRD is generated from (the operator validates with them), before the rewrite
    for model, mode in ((MoEDeploymentSpec, "validation"), (MoEDeploymentStatus, "serialization")):
        raw = model.model_json_schema(by_alias=True, mode=mode)
        assert _unbounded(crd.structural(raw)) == [], model.__name__
    # the probe counted 35 unbounded numeric and string fields; bounded now, and there are more than 35 of them
    bounded = [p for p, n in _walk(root["properties"]["spec"]) if n.get("type") in ("integer", "number", "string")]
    assert len(bounded) > 35


def test_metadata_name_bound_keeps_every_child_name_valid(tmp_path):
    doc = yaml.safe_load(crd.DEFAULT_PATH.read_text())
    root = doc["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    name_schema = root["properties"]["metadata"]["properties"]["name"]
    assert name_schema["maxLength"] == MAX_NAME_LENGTH == STATEFULSET_NAME_MAX - len("-attention") == 42
    (rule,) = root["x-kubernetes-validations"]
    assert rule["rule"] == (
        f"size(self.metadata.name) <= {MAX_NAME_LENGTH} && self.metadata.name.matches('{name_schema['pattern']}')"
    )
    assert "metadata.name" in rule["message"]

    spec = parse_spec(tiny_spec(experts=2))
    cfg = resolve_model(spec)
    plan = plan_for(spec, cfg)
    longest = "k" * MAX_NAME_LENGTH
    assert name_error(longest) is None
    names = {(c["kind"], c["metadata"]["name"]) for c in build_children(longest, NS, spec, cfg, plan)}
    for kind, name in names:
        assert len(name) <= 253 and re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name), (kind, name)
        if kind == "Service":
            assert len(name) <= 63 and name[0].isalpha(), name
        if kind == "StatefulSet":
            assert len(name) <= STATEFULSET_NAME_MAX, name
            top = max(MAX_ATTENTION_REPLICAS, MAX_EXPERT_REPLICAS) - 1
            assert len(f"{name}-{top}") <= 63  # the highest ordinal's pod hostname
    for bad in ("k" * (MAX_NAME_LENGTH + 1), "kimi.v2", "3kimi", "Kimi", "kimi-"):
        assert "metadata.name" in (name_error(bad) or ""), bad
        assert not re.fullmatch(name_schema["pattern"], bad) or len(bad) > name_schema["maxLength"]


def test_cel_rules_evaluate_as_meant():
    """The CRD's CEL rules, evaluated by a CEL implementation (cel-python), where one is installed."""
    celpy = pytest.importorskip("celpy")
    doc = yaml.safe_load(crd.DEFAULT_PATH.read_text())
    root = doc["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    tol = root["properties"]["spec"]["properties"]["scheduling"]["properties"]["tolerations"]["items"]
    env = celpy.Environment()

    def ok(rule: str, obj: dict) -> bool:
        return bool(env.program(env.compile(rule)).evaluate({"self": celpy.json_to_cel(obj)}))

    (name_rule,) = root["x-kubernetes-validations"]
    assert ok(name_rule["rule"], {"metadata": {"name": "k" * MAX_NAME_LENGTH}})
    for bad in ("k" * (MAX_NAME_LENGTH + 1), "kimi.v2", "3kimi"):
        assert not ok(name_rule["rule"], {"metadata": {"name": bad}}), bad
    rules = [r["rule"] for r in tol["x-kubernetes-validations"]]
    good = [
        {"key": "gpu", "operator": "Exists", "effect": "NoSchedule"},
        {"key": "gpu", "operator": "Equal", "value": "a100"},
        {"operator": "Exists"},
        {"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 30},
    ]
    bad = [
        {"key": "gpu", "operator": "Exists", "value": "yes"},
        {"key": "gpu", "operator": "Exists", "effect": "NoSchedule", "tolerationSeconds": 30},
        {"operator": "Equal", "value": "x"},
    ]
    assert all(ok(r, t) for t in good for r in rules)
    assert all(not all(ok(r, t) for r in rules) for t in bad)


def test_children_at_every_bound_are_valid_and_within_the_api_limits():
    """The largest spec the bounds admit (longest name and namespace, most workers, GPUs and scheduling entries)
    builds children the API takes: names, labels, sizes, one container argument within Linux's 128 KiB."""
    kv = pytest.importorskip("kubernetes_validate")
    name, namespace = "k" * MAX_NAME_LENGTH, "n" * 63
    spec = parse_spec(
        _merge(
            tiny_spec(experts=MAX_EXPERT_REPLICAS, slots_per_pod=48),
            {
                "attentionWorkers": {"replicas": MAX_ATTENTION_REPLICAS, "gpusPerPod": 16},
                "image": {"tag": "_" + "v" * 127},
                "scheduling": {
                    "nodeSelector": {f"example.com/key-{i}": "v" * 63 for i in range(32)},
                    "tolerations": [
                        {
                            "key": f"example.com/taint-{i}",
                            "operator": "Exists",
                            "effect": "NoExecute",
                            "tolerationSeconds": 60,
                        }
                        for i in range(32)
                    ],
                    "topologySpreadKey": "topology.kubernetes.io/zone",
                },
            },
        )
    )
    cfg = resolve_model(spec)
    plan = plan_for(spec, cfg)
    children = build_children(name, namespace, spec, cfg, plan)
    check_children(children)
    router = next(c for c in children if c["kind"] == "Deployment")
    args = router["spec"]["template"]["spec"]["containers"][0]["args"]
    assert max(len(a) for a in args) < ARG_MAX
    for child in children:
        kv.validate(child, "1.30", strict=True)
        for labels in (
            child["metadata"].get("labels") or {},
            ((child.get("spec") or {}).get("template") or {}).get("metadata", {}).get("labels") or {},
        ):
            assert all(_label_value_ok(v) for v in labels.values()), labels


# ------------------------------------------------------------------------------------------------ the operator
@pytest.mark.asyncio
async def test_operator_refuses_every_bad_spec_naming_the_field():
    """Items 2 and 6 of the probe, each a MoEDeployment of its own on one operator: every one gets phase Failed and
    an InvalidSpec condition naming its field at once, nothing is built for it, no handler retries, and a good
    deployment beside them is served as usual. (The operator's memory over the same specs: the next test.)"""
    async with operator() as c:
        for _, name, patch, _ in BAD_SPECS:
            await c.create_moe(name, bad_spec(patch))
        await c.create_moe("good", tiny_spec())  # the operator keeps working beside them
        for case, name, _, field in BAD_SPECS:
            await eventually(lambda: c.status(name).get("phase") == "Failed", timeout=20, what=f"{case} Failed")
            cond = c.condition(name, "PlacementReady")
            assert cond["reason"] == "InvalidSpec" and field in cond["message"], (case, cond)
            assert c.status(name)["message"] == cond["message"]
            assert c.get("apps/v1/statefulsets", expert_name(name)) is None, case
            assert c.get("v1/configmaps", f"{name}-plan") is None, case
        await eventually(lambda: c.status("good").get("phase") == "Deploying", timeout=30, what="good Deploying")
        names = {f"/{PLURAL}/{name}" for _, name, _, _ in BAD_SPECS}

        def writes() -> int:
            return len([w for w in c.emu.writes if any(w[1].endswith(n) or f"{n}/" in w[1] for n in names)])

        before = writes()
        await asyncio.sleep(1.5)  # a retrying handler would write again within this
        assert writes() == before


@pytest.mark.asyncio
async def test_operator_process_stays_under_256_mib(tmp_path):
    """`expertmesh operator` as its own process (as in a pod) over the same bad specs and one good one: its peak
    resident memory (VmHWM) stays under 256 MiB — the planning process holds the planner's imports, not the
    operator."""
    async with Emulator() as emu, kmock.Server(emu):
        emu.resources.load_bundled()
        emu.resources[MOE] = kmock.ResourceInfo(
            kind=KIND,
            namespaced=True,
            verbs={"get", "list", "watch", "patch", "create"},
            subresources={"status", "scale"},
        )
        async with operator_process(emu, tmp_path) as proc:
            c = Cluster(emu, None)
            for _, name, patch, _ in BAD_SPECS:
                await c.create_moe(name, bad_spec(patch))
            await c.create_moe("good", tiny_spec())
            for case, name, _, field in BAD_SPECS:
                await eventually(lambda: c.status(name).get("phase") == "Failed", timeout=30, what=f"{case} Failed")
                assert field in c.condition(name, "PlacementReady")["message"], case
            await eventually(lambda: c.status("good").get("phase") == "Deploying", timeout=60, what="good Deploying")
            with open(f"/proc/{proc.pid}/status") as f:
                hwm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    print(
        f"\noperator process: peak resident memory (VmHWM) {hwm / MIB:.1f} MiB over {len(BAD_SPECS)} bad specs "
        f"and one deployment"
    )
    assert hwm < OPERATOR_MEMORY_MAX


@pytest.mark.asyncio
async def test_image_tag_that_is_no_label_value_still_gives_valid_labels():
    """A valid image tag need not be a label value (`_2024.06-rc.` starts with '_' and ends with '.'): the version
    label is the tag trimmed to one, and every child's labels are valid."""
    async with operator() as c:
        await c.create_moe("tagged", _merge(tiny_spec(), {"image": {"tag": "_2024.06-rc."}}))
        await eventually(lambda: c.status("tagged").get("phase") == "Deploying", what="Deploying")
        for res, name in (
            ("apps/v1/statefulsets", "tagged-expert"),
            ("apps/v1/statefulsets", "tagged-attention"),
            ("apps/v1/deployments", "tagged-router"),
            ("v1/configmaps", "tagged-plan"),
            ("v1/services", "tagged-router"),
        ):
            obj = c.get(res, name)
            labels = dict(obj["metadata"]["labels"])
            labels.update(((obj.get("spec") or {}).get("template") or {}).get("metadata", {}).get("labels") or {})
            assert all(_label_value_ok(v) for v in labels.values()), (name, labels)
            assert labels[LABEL_VERSION] == "2024.06-rc"
        container = c.get("apps/v1/deployments", "tagged-router")["spec"]["template"]["spec"]["containers"][0]
        assert container["image"].endswith(":_2024.06-rc.")


FULL = {
    "model": {"preset": "full-2.8t", "checkpoint": {"pvc": {"claimName": "weights"}}},
    "attentionWorkers": {"replicas": 1, "gpusPerPod": 8},
}


@pytest.mark.asyncio
async def test_a_plan_past_the_budget_is_refused_before_planning():
    """full-2.8t on 512 pods x 16 GPUs with 16,384 redundant experts per layer passes every field's bound but would
    take the planner ~1.3 GiB and 1e10 device passes: refused from the estimate, naming the fields; no planning
    process is even started."""
    async with operator() as c:
        spec = _merge(
            FULL,
            {
                "expertWorkers": {
                    "replicas": 512,
                    "gpusPerPod": 16,
                    "gpuMemoryGiB": 141,
                    "reserveGiB": 24,
                    "redundantExperts": 16384,
                }
            },
        )
        started = time.monotonic()
        await c.create_moe("huge", spec)
        await eventually(lambda: c.status("huge").get("phase") == "Failed", what="Failed")
        assert time.monotonic() - started < 10
        cond = c.condition("huge", "PlacementReady")
        assert cond["reason"] == "PlanBudgetExceeded", cond
        for field in ("spec.expertWorkers.replicas=512", "gpusPerPod=16", "redundantExperts=16384"):
            assert field in cond["message"], cond["message"]
        assert c.deps.planning.started == 0
        assert c.get("v1/configmaps", "huge-plan") is None


@pytest.mark.asyncio
async def test_a_plan_configmap_over_the_api_limit_is_refused_unsent():
    """full-2.8t on 16 pods x 8 GPUs with one replica of every expert plans fine, but its plan.json (1.4 MiB) is over
    the API's 1 MiB for a ConfigMap: ObjectTooLarge naming the fields, nothing sent."""
    async with operator() as c:
        spec = _merge(
            FULL,
            {
                "expertWorkers": {
                    "replicas": 16,
                    "gpusPerPod": 8,
                    "gpuMemoryGiB": 141,
                    "reserveGiB": 24,
                    "redundantExperts": 896,
                }
            },
        )
        await c.create_moe("big", spec)
        await eventually(lambda: c.status("big").get("phase") == "Failed", timeout=45, what="Failed")
        cond = c.condition("big", "PlacementReady")
        assert cond["reason"] == "ObjectTooLarge", cond
        assert "spec.expertWorkers" in cond["message"] and "1 MiB" in cond["message"], cond["message"]
        for res, name in (
            ("v1/configmaps", "big-plan"),
            ("apps/v1/statefulsets", "big-expert"),
            ("v1/secrets", "big-worker-tls"),
        ):
            assert c.get(res, name) is None, name


@pytest.mark.asyncio
async def test_planning_keeps_kopf_loop_free_and_past_its_deadline_is_refused():
    """A plan runs in the planning process: while full-2.8t is being planned (seconds), Kopf handles another
    resource at once; a plan past the runner's deadline is stopped and refused with PlanBudgetExceeded."""
    async with operator() as c:
        await c.create_moe(
            "full",
            _merge(
                FULL,
                {
                    "expertWorkers": {
                        "replicas": 16,
                        "gpusPerPod": 8,
                        "gpuMemoryGiB": 141,
                        "reserveGiB": 24,
                        "redundantExperts": 896,
                    }
                },
            ),
        )
        await asyncio.sleep(1.0)  # its reconcile is planning now
        await c.create_moe("quick", bad_spec({"kv": {"blockSize": 10**9}}))
        await eventually(lambda: c.status("quick").get("phase") == "Failed", timeout=30, what="quick Failed")
        assert c.status("full").get("phase") is None  # still planning when the other was handled
        await eventually(lambda: c.status("full").get("phase") == "Failed", timeout=60, what="full Failed")

    async with emulator() as emu:
        url = str(emu.url).rstrip("/")
        deps = Deps(kube=Kube.for_url(url), fetch_load=no_load, load_timeout=2.0, planning=PlanRunner(deadline=0.001))
        async with run_operator(emu, deps):
            c = Cluster(emu, deps)
            await c.create_moe("slow", tiny_spec())
            await eventually(lambda: c.status("slow").get("phase") == "Failed", timeout=30, what="Failed")
            cond = c.condition("slow", "PlacementReady")
            assert cond["reason"] == "PlanBudgetExceeded" and "spec.expertWorkers" in cond["message"]
            assert "did not finish within 0.001 s" in cond["message"]


# ------------------------------------------------------------------------------------------------ the runner
@pytest.mark.asyncio
async def test_plan_runner_deadline_memory_limit_and_errors():
    runner = PlanRunner(deadline=1.0, memory_limit=64 * MIB, idle=0)
    try:
        spec = parse_spec(tiny_spec())
        cfg = resolve_model(spec)
        plan = await runner.run(plan_for, spec, cfg)
        assert plan == plan_for(spec, cfg) and plan.plan_hash() == plan_for(spec, cfg).plan_hash()
        started = time.monotonic()
        with pytest.raises(PlanningFailed, match="did not finish within 1 s"):
            await runner.run(time.sleep, 60)
        assert time.monotonic() - started < 5  # stopped at its deadline: the process was killed
        with pytest.raises(PlanningFailed, match="more than the planning process's 64 MiB"):
            await runner.run(bytearray, 256 * MIB)
        small = parse_spec(tiny_spec(experts=1, slots_per_pod=40))
        with pytest.raises(PlanError, match="cluster too small"):  # the planner's own errors as they are
            await runner.run(plan_for, small, resolve_model(small))
        assert await runner.run(pow, 2, 10) == 1024
        assert runner.started == 2  # one start, one restart after the deadline
    finally:
        runner.close()


def test_estimates_bound_the_planner():
    """The estimate is what the budget judges: it grows with each term the planner's arrays grow with."""
    cfg = resolve_model(parse_spec(FULL | {"expertWorkers": {}}))
    base = estimate(cfg, 16, 8, 32)
    assert base.layers == 92 and base.experts == 896 and base.shards == 92 * (896 + 32)
    assert estimate(cfg, 16, 8, 896).memory > base.memory  # replicas: quotient table, shards
    assert estimate(cfg, 64, 8, 32).memory > base.memory  # pods: pod_has, [L, N] arrays
    assert estimate(cfg, 16, 16, 32).work == 2 * base.work
    assert estimate(cfg, 1, 1, 10**6).redundant == 0  # one pod: no replicas (the planner's cap)
    plan = plan_for(
        parse_spec(
            FULL
            | {
                "expertWorkers": {
                    "replicas": 16,
                    "gpusPerPod": 8,
                    "gpuMemoryGiB": 141,
                    "reserveGiB": 24,
                    "redundantExperts": 32,
                }
            }
        ),
        cfg,
    )
    assert base.plan_json_min <= len(plan.to_json())
    assert json.loads(plan.to_json())["figures"]["physical_experts"] <= base.shards
