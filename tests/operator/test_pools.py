"""Prefill and decode pools (#36): their children, KV sizes, autoscalers, reachability and what the CLIs accept."""

from __future__ import annotations

import argparse
import json

import pytest
from support.tiny_deployment import by_kind_and_name, reachable, tiny

from expertmesh.operator.children import absent_children, build_children
from expertmesh.operator.naming import WORKER_PORT
from expertmesh.operator.spec import parse_spec
from expertmesh.operator.worker_tls import worker_tls_hosts


def _opts(args: list[str], start: int) -> dict:
    return dict(zip(args[start::2], args[start + 1 :: 2]))


def test_no_prefill_pool_renders_the_colocated_children(tiny_plan):
    """prefillWorkers.replicas 0 (the default) and no autoscale: one mixed pool, exactly the children without the
    field — no prefill object, no --pool, no --prefill, no autoscaler — and the prefill objects are what a spec
    without the pool deletes (absent_children)."""
    spec, cfg, plan = tiny_plan
    explicit = parse_spec(tiny(prefillWorkers={"replicas": 0, "gpusPerPod": 2, "minPromptTokens": 64}))
    children = build_children("kimi", "serving", spec, cfg, plan)
    assert build_children("kimi", "serving", explicit, cfg, plan) == children
    assert "prefill" not in json.dumps(children).replace(
        '"prefill-decode"', ""
    ) and "HorizontalPodAutoscaler" not in json.dumps(children)
    att = by_kind_and_name(children)[("StatefulSet", "kimi-attention")]["spec"]["template"]["spec"]["containers"][0]
    assert "--pool" not in att["args"] and att["name"] == "attention"
    router = by_kind_and_name(children)[("Deployment", "kimi-router")]["spec"]["template"]["spec"]["containers"][0][
        "args"
    ]
    assert "--prefill" not in router and "--prefill-min-tokens" not in router
    assert set(absent_children("kimi", spec)) == {
        ("apps/v1", "StatefulSet", "kimi-prefill"),
        ("v1", "Service", "kimi-prefill"),
        ("networking.k8s.io/v1", "NetworkPolicy", "kimi-prefill-worker-ingress"),
        ("autoscaling/v2", "HorizontalPodAutoscaler", "kimi-prefill"),
        ("autoscaling/v2", "HorizontalPodAutoscaler", "kimi-attention"),
    }


def test_prefill_pool_renders_its_statefulset_service_args_and_the_router_list(tiny_plan):
    """replicas >= 1: a prefill StatefulSet + headless Service of its own (component prefill-worker), its pods the
    attention worker with --pool prefill and the attention pods' TLS, probes, env and volumes; the attention workers
    become --pool decode; the router gets --prefill with the prefill pods' stable DNS names (and
    --prefill-min-tokens); spec.kv's tiers go to the prefill pool only."""
    _, cfg, plan = tiny_plan
    spec = parse_spec(
        tiny(
            prefillWorkers={
                "replicas": 3,
                "gpusPerPod": 0,
                "minPromptTokens": 96,
                "resources": {"requests": {"cpu": "2", "memory": "8Gi"}},
            },
            kv={"hostGiB": 4, "disk": {"sizeGiB": 10}},
            telemetry={"otlpEndpoint": "http://otel:4317"},
        )
    )
    children = build_children("kimi", "serving", spec, cfg, plan)
    assert [(c["kind"], c["metadata"]["name"]) for c in children] == [
        ("ConfigMap", "kimi-plan"),
        ("Service", "kimi-attention"),
        ("Service", "kimi-prefill"),
        ("Service", "kimi-expert"),
        ("StatefulSet", "kimi-attention"),
        ("StatefulSet", "kimi-prefill"),
        ("StatefulSet", "kimi-expert"),
        ("PodDisruptionBudget", "kimi-expert"),
        ("Deployment", "kimi-router"),
        ("Service", "kimi-router"),
        ("NetworkPolicy", "kimi-attention-worker-ingress"),
        ("NetworkPolicy", "kimi-prefill-worker-ingress"),
        ("NetworkPolicy", "kimi-expert-worker-ingress"),
    ]
    by = by_kind_and_name(children)
    svc = by[("Service", "kimi-prefill")]["spec"]
    assert svc["clusterIP"] == "None" and svc["selector"]["app.kubernetes.io/component"] == "prefill-worker"
    pre, dec = by[("StatefulSet", "kimi-prefill")]["spec"], by[("StatefulSet", "kimi-attention")]["spec"]
    assert (pre["serviceName"], pre["replicas"], dec["replicas"]) == ("kimi-prefill", 3, 1)
    assert pre["selector"]["matchLabels"] == svc["selector"]
    assert pre["template"]["metadata"]["labels"]["app.kubernetes.io/component"] == "prefill-worker"
    pc, dc = pre["template"]["spec"]["containers"][0], dec["template"]["spec"]["containers"][0]
    assert pc["args"][:3] == dc["args"][:3] == ["worker", "--role", "attention"]
    po, do = _opts(pc["args"], 3), _opts(dc["args"], 3)
    assert (po["--pool"], do["--pool"]) == ("prefill", "decode")
    seq = -(-cfg.max_context // spec.kv.block_size)
    assert (int(po["--kv-blocks"]), int(do["--kv-blocks"])) == (2 * seq, seq)
    # the tiers (and the host tier's memory) are the prefill pool's; the decode pool keeps no prefixes
    assert (po["--kv-host-gib"], po["--kv-disk-gib"]) == ("4", "10") and "--kv-host-gib" not in do
    assert pc["resources"] == {"requests": {"cpu": "2", "memory": f"{(8 + 4) * 1024}Mi"}}
    assert "kv-disk" in {v["name"] for v in pre["template"]["spec"]["volumes"]}
    assert "kv-disk" not in {v["name"] for v in dec["template"]["spec"]["volumes"]}
    # the same pod shape as the attention workers': TLS flags, probes, mounts, env (its own service name)
    tls = [a for a in pc["args"] if "tls" in a]
    assert tls and tls == [a for a in dc["args"] if "tls" in a]
    assert all(pc[k] == dc[k] for k in ("startupProbe", "readinessProbe", "livenessProbe", "ports"))
    assert {m["mountPath"] for m in pc["volumeMounts"]} >= {m["mountPath"] for m in dc["volumeMounts"]}
    env = {e["name"]: e.get("value") for e in pc["env"]}
    assert env["OTEL_SERVICE_NAME"] == "expertmesh-prefill"
    router = by[("Deployment", "kimi-router")]["spec"]["template"]["spec"]["containers"][0]["args"]
    ro = _opts(router, 1)
    assert ro["--prefill"].split(",") == [f"kimi-prefill-{i}.kimi-prefill.serving.svc:50061" for i in range(3)]
    assert ro["--attention"] == "kimi-attention-0.kimi-attention.serving.svc:50061"  # the decode pool
    assert ro["--prefill-min-tokens"] == "96"
    assert absent_children("kimi", spec) == [
        ("autoscaling/v2", "HorizontalPodAutoscaler", "kimi-attention"),
        ("autoscaling/v2", "HorizontalPodAutoscaler", "kimi-prefill"),
    ]
    # what the router dials in the prefill pool is covered by the worker certificate
    assert "*.kimi-prefill.serving.svc" in worker_tls_hosts("kimi", "serving")
    kv = pytest.importorskip("kubernetes_validate")
    for child in children:
        kv.validate(child, "1.30", strict=True)


@pytest.mark.parametrize("max_context, block_size", [(4096, 16), (1000, 7), (1, 1024), (131072, 64)])
def test_pool_kv_sizes_each_pool_for_its_role(max_context, block_size):
    """mixed: one sequence at full context + the tiers; prefill: two (the prompt being prefilled and the one
    waiting to be handed off) + the tiers; decode: one, no tiers."""
    from expertmesh.operator.pools import DECODE, MIXED, PREFILL, PoolKV, pool_kv

    disk = parse_spec(tiny(kv={"disk": {"sizeGiB": 5}})).kv.disk
    pages = len(range(0, max_context, block_size))  # pages of block_size tokens covering max_context
    assert pool_kv(MIXED, max_context=max_context, block_size=block_size, host_gib=3, disk=disk) == PoolKV(
        pages, 3, disk
    )
    got = pool_kv(PREFILL, max_context=max_context, block_size=block_size, host_gib=3, disk=disk)
    assert (got.blocks, got.host_gib, got.disk) == (2 * pages, 3, disk)
    got = pool_kv(DECODE, max_context=max_context, block_size=block_size, host_gib=3, disk=disk)
    assert (got.blocks, got.host_gib, got.disk) == (pages, 0.0, None)
    assert got.blocks * block_size >= max_context > (got.blocks - 1) * block_size
    with pytest.raises(ValueError, match="role"):
        pool_kv("both", max_context=max_context, block_size=block_size)
    with pytest.raises(ValueError, match="block_size"):
        pool_kv(MIXED, max_context=max_context, block_size=0)


def test_spec_pool_kv_uses_the_specs_context_or_the_models(tiny_plan):
    from expertmesh.operator.pools import DECODE, PREFILL, spec_pool_kv

    _, cfg, _ = tiny_plan
    spec = parse_spec(tiny(kv={"maxContext": 1000, "blockSize": 32, "hostGiB": 2}))
    assert spec_pool_kv(spec, cfg, PREFILL).blocks == 2 * 32 and spec_pool_kv(spec, cfg, PREFILL).host_gib == 2
    assert spec_pool_kv(parse_spec(tiny()), cfg, DECODE).blocks == cfg.max_context // 16


@pytest.mark.parametrize(
    "metric, target, kind, quantity",
    [
        ("prefill_tokens_waiting", 4096, "AverageValue", "4096"),
        ("requests_waiting", 2.5, "AverageValue", "2500m"),
        ("kv_utilization", 0.8, "Value", "800m"),
    ],
)
def test_autoscaled_pools_get_an_hpa_on_the_routers_pool_metric(tiny_plan, metric, target, kind, quantity):
    """One autoscaling/v2 HPA per autoscaled pool, on its StatefulSet, minReplicas..maxReplicas, one External metric:
    the router's expertmesh_pool_<metric> of that pool (label pool) and deployment, at the spec's target."""
    _, cfg, plan = tiny_plan
    auto = {"minReplicas": 2, "maxReplicas": 5, "metric": metric, "target": target}
    spec = parse_spec(
        tiny(
            prefillWorkers={"gpusPerPod": 0, "autoscale": auto},
            attentionWorkers={"autoscale": {**auto, "minReplicas": 1}},
        )
    )
    children = build_children("kimi", "serving", spec, cfg, plan)
    by = by_kind_and_name(children)
    for sts, pool, low in (("kimi-prefill", "prefill", 2), ("kimi-attention", "decode", 1)):
        hpa = by[("HorizontalPodAutoscaler", sts)]
        assert hpa["apiVersion"] == "autoscaling/v2"
        assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": sts}
        assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (low, 5)
        (m,) = hpa["spec"]["metrics"]
        assert m["type"] == "External"
        assert m["external"]["metric"] == {
            "name": f"expertmesh_pool_{metric}",
            "selector": {"matchLabels": {"pool": pool, "app_kubernetes_io_instance": "kimi"}},
        }
        assert m["external"]["target"] == {
            "type": kind,
            ("averageValue" if kind == "AverageValue" else "value"): quantity,
        }
        assert by[("StatefulSet", sts)]["spec"]["replicas"] == low  # before the StatefulSet exists: minReplicas
    # the HPA follows its StatefulSet in apply order
    names = [(c["kind"], c["metadata"]["name"]) for c in children]
    assert names.index(("HorizontalPodAutoscaler", "kimi-prefill")) > names.index(("StatefulSet", "kimi-prefill"))
    assert absent_children("kimi", spec) == []
    kv = pytest.importorskip("kubernetes_validate")
    for child in children:
        kv.validate(child, "1.30", strict=True)


def test_an_autoscaled_pools_replicas_are_kept_and_the_router_follows_them(tiny_plan):
    """The StatefulSet's replicas now (the HPA's) are kept, within [minReplicas, maxReplicas]; the router lists that
    many pods; a pool that is not autoscaled has the spec's replicas whatever is observed."""
    from expertmesh.operator.pools import pool_replicas

    _, cfg, plan = tiny_plan
    spec = parse_spec(
        tiny(
            prefillWorkers={"autoscale": {"minReplicas": 2, "maxReplicas": 6, "target": 10}},
            attentionWorkers={"replicas": 2},
        )
    )
    for seen, want in ((4, 4), (1, 2), (9, 6)):
        by = by_kind_and_name(
            build_children("kimi", "serving", spec, cfg, plan, {"prefill-worker": seen, "attention-worker": 7})
        )
        assert by[("StatefulSet", "kimi-prefill")]["spec"]["replicas"] == want
        assert by[("StatefulSet", "kimi-attention")]["spec"]["replicas"] == 2  # not autoscaled: the spec's
        ro = _opts(by[("Deployment", "kimi-router")]["spec"]["template"]["spec"]["containers"][0]["args"], 1)
        assert len(ro["--prefill"].split(",")) == want and len(ro["--attention"].split(",")) == 2
    auto = spec.prefill_workers.autoscale
    assert [pool_replicas(3, auto, n) for n in (None, 0, 2, 5, 6, 100)] == [2, 2, 2, 5, 6, 6]
    assert pool_replicas(3, None, 100) == 3


@pytest.mark.parametrize("transport", ["grpc", "collective"])
def test_prefill_pods_reach_the_decode_and_expert_workers(tiny_plan, transport):
    """With a prefill pool: the router reaches it on the gRPC port; it reaches the expert workers as the attention
    workers do (gRPC port; any port with the collective transport, both ways) and the decode workers' gRPC port
    (the hand-off; with the collective transport any port, both ways: its pairs, and the decode pods serve their
    rendezvous store); nobody else reaches it."""
    _, cfg, plan = tiny_plan
    spec = parse_spec(tiny(transport=transport, prefillWorkers={"replicas": 1}))
    children = build_children("kimi", "serving", spec, cfg, plan)
    allowed = reachable(children, "kimi-")
    grpc = (WORKER_PORT,)
    want = {("kimi-router", w, grpc) for w in ("kimi-attention", "kimi-prefill", "kimi-expert")}
    if transport == "grpc":
        want |= {
            ("kimi-attention", "kimi-expert", grpc),
            ("kimi-prefill", "kimi-expert", grpc),
            ("kimi-prefill", "kimi-attention", grpc),
        }
    else:
        want |= {
            (a, b, None)
            for x, y in (
                ("kimi-attention", "kimi-expert"),
                ("kimi-prefill", "kimi-expert"),
                ("kimi-prefill", "kimi-attention"),
            )
            for a, b in ((x, y), (y, x))
        }
    assert allowed == want
    envs = {
        c["metadata"]["name"]: {e["name"] for e in c["spec"]["template"]["spec"]["containers"][0]["env"]}
        for c in children
        if c["kind"] == "StatefulSet"
    }
    stores = {n for n, env in envs.items() if "EXPERTMESH_COLLECTIVE_PORT" in env}
    assert stores == (set() if transport == "grpc" else {"kimi-attention", "kimi-expert"})  # not the prefill pool


def test_the_pools_args_parse_with_the_real_router_and_worker_clis(tiny_plan):
    """What the operator renders is what the router and the worker accept (their own parsers; nothing is started):
    --prefill / --prefill-min-tokens, --pool and each pool's KV flags."""
    from expertmesh.router.server import add_arguments as router_arguments
    from expertmesh.worker.cli import build_parser  # the worker's parser (imports torch)

    _, cfg, plan = tiny_plan
    spec = parse_spec(tiny(prefillWorkers={"replicas": 2, "minPromptTokens": 64}, kv={"hostGiB": 1}))
    by = by_kind_and_name(build_children("kimi", "serving", spec, cfg, plan))
    p = argparse.ArgumentParser()
    router_arguments(p)
    r = p.parse_args(by[("Deployment", "kimi-router")]["spec"]["template"]["spec"]["containers"][0]["args"][1:])
    assert r.prefill.split(",") == [f"kimi-prefill-{i}.kimi-prefill.serving.svc:50061" for i in range(2)]
    assert r.prefill_min_tokens == 64 and r.attention == "kimi-attention-0.kimi-attention.serving.svc:50061"
    seq = -(-cfg.max_context // spec.kv.block_size)
    for sts, pool, blocks, host in (("kimi-prefill", "prefill", 2 * seq, 1.0), ("kimi-attention", "decode", seq, 0.0)):
        w = build_parser().parse_args(by[("StatefulSet", sts)]["spec"]["template"]["spec"]["containers"][0]["args"][1:])
        assert (w.role, w.pool, w.kv_blocks, w.kv_host_gib) == ("attention", pool, blocks, host)
