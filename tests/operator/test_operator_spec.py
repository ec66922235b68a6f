"""MoEDeployment spec (pydantic), the generated CRD, the pure child manifests and the pure status logic."""

from __future__ import annotations

import argparse
import base64
import datetime as dt
import json
import shlex
import subprocess
import sys

import numpy as np
import pytest
import yaml
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID
from support.relatives import DEEPSEEK_V32

from expertmesh.model.config import preset
from expertmesh.operator import crd, rbac
from expertmesh.operator.children import (
    absent_children,
    build_children,
    revision,
    template_hashes,
)
from expertmesh.operator.kube import resource
from expertmesh.operator.main import add_arguments, operator_kwargs
from expertmesh.operator.naming import (
    COLLECTIVE_PORT,
    COMPONENT_EXPERT,
    COMPONENT_ROUTER,
    LABEL_COMPONENT,
    LABEL_INSTANCE,
    PLAN_HASH_ANNOTATION,
    WORKER_PORT,
    checkpoint_path,
    worker_addresses,
)
from expertmesh.operator.placement_policy import changed_ordinals, parse_load, plan_for, rebalance, replan_around
from expertmesh.operator.pod_commands import router_serving_args
from expertmesh.operator.pod_parts import fetch_container, pod_spec, pod_volumes
from expertmesh.operator.pods import PodInfo, assess, pod_info
from expertmesh.operator.router_salt import router_salt_secret
from expertmesh.operator.spec import GIB, SpecError, parse_spec, resolve_model
from expertmesh.operator.status import (
    condition,
    decide,
    placement_status,
    seconds_since,
    set_condition,
    weights_condition,
    with_weights,
)
from expertmesh.operator.worker_tls import worker_tls_hosts, worker_tls_secret
from expertmesh.placement.plan import PlacementPlan
from expertmesh.placement.planner import PlanError, imbalance, moved_shards, zipf_loads
from expertmesh.runtime.tls import pki_pems

TINY_EXPERT_BYTES = 3264


def tiny(**over) -> dict:
    spec = {
        "model": {"preset": "tiny", "checkpoint": {"pvc": {"claimName": "weights", "path": "/ckpt/tiny"}}},
        "attentionWorkers": {"gpusPerPod": 0},
        "expertWorkers": {
            "replicas": 2,
            "gpusPerPod": 0,
            "reserveGiB": 0,
            "gpuMemoryGiB": (30 * TINY_EXPERT_BYTES + 10) / GIB,
        },
    }
    for k, v in over.items():
        spec[k] = {**spec.get(k, {}), **v} if isinstance(v, dict) else v
    return spec


@pytest.fixture(scope="module")
def tiny_plan():
    spec = parse_spec(tiny())
    cfg = resolve_model(spec)
    return spec, cfg, plan_for(spec, cfg)


# ------------------------------------------------------------------------------------------------ spec
def test_spec_defaults_fill_everything_but_the_model():
    s = parse_spec({"model": {"preset": "full-2.8t", "checkpoint": {"uri": "hf://org/full@v1"}}})
    assert (s.router.replicas, s.router.http_port, s.router.grpc_port) == (1, 8000, 50051)
    assert (s.expert_workers.replicas, s.expert_workers.gpus_per_pod, s.expert_workers.redundant_experts) == (2, 1, 0)
    assert s.placement.strategy == "eplb" and s.placement.imbalance_threshold == 1.25
    assert s.kv.block_size == 16 and s.kv.max_context is None and s.thinking is None
    assert s.telemetry.protocol == "grpc" and s.image.pull_policy == "IfNotPresent"
    assert s.model.checkpoint.format == "expertmesh-mxfp4"
    y = s.to_yaml_dict()  # camelCase out, as in YAML
    assert y["expertWorkers"]["gpuMemoryGiB"] == 80.0 and "gpu_memory_gib" not in y["expertWorkers"]
    assert parse_spec(y) == s  # round-trips


@pytest.mark.parametrize(
    "patch, field, words",
    [
        ({"expertWorkers": {"replicas": 0}}, "spec.expertWorkers.replicas", "greater than or equal to 1"),
        ({"expertWorkers": {"reserveGiB": 1.0}}, "spec.expertWorkers", "reserveGiB=1.0 must be below"),
        ({"router": {"httpPort": 70000}}, "spec.router.httpPort", "less than or equal to 65535"),
        ({"router": {"httpPort": 9000, "grpcPort": 9000}}, "spec.router", "must differ"),
        (
            {"model": {"preset": "huge", "checkpoint": {"uri": "/x"}}},
            "spec.model.preset",
            "'tiny', 'small' or 'full-2.8t'",
        ),
        ({"model": {"checkpoint": {"uri": "/x"}}}, "spec.model", "exactly one of model.preset and model.config"),
        ({"model": {"preset": "tiny", "checkpoint": {}}}, "spec.model.checkpoint", "exactly one of"),
        ({"thinking": {"low": 9, "high": 5, "max": 20}}, "spec.thinking", "low <= high <= max"),
        (
            {"model": {"preset": "tiny", "checkpoint": {"uri": "ftp://b/x"}}},
            "spec.model.checkpoint",
            "supported sources are http://, https://, hf://",
        ),
        (
            {"model": {"preset": "tiny", "checkpoint": {"uri": "hf://model"}}},
            "spec.model.checkpoint",
            "expected hf://ORG/NAME[@REVISION]",
        ),
        ({"telemetry": {"protocol": "udp"}}, "spec.telemetry.protocol", "'grpc' or 'http/protobuf'"),
        ({"expertWorker": {}}, "spec.expertWorker", "Extra inputs are not permitted"),
    ],
)
def test_spec_errors_name_the_field(patch, field, words):
    spec = tiny()
    for k, v in patch.items():
        spec[k] = v if k == "model" else {**spec.get(k, {}), **v}
    with pytest.raises(SpecError) as e:
        parse_spec(spec)
    assert f"{field}" in str(e.value) and words in str(e.value), str(e.value)


def test_resolve_model_inline_config_and_overrides():
    cfg = preset("tiny").model_dump(mode="json")
    s = parse_spec(
        {**tiny(), "model": {"config": cfg, "checkpoint": {"uri": "/w"}}, "thinking": {"low": 2, "high": 3, "max": 4}}
    )
    r = resolve_model(s)
    assert r.name == "tiny" and s.thinking.low == 2  # serving policy: rendered as --thinking-budgets
    bad = dict(cfg, hidden_size=65)
    with pytest.raises(SpecError, match=r"spec\.model\.config.*hidden_size=65"):
        resolve_model(parse_spec({**tiny(), "model": {"config": bad, "checkpoint": {"uri": "/w"}}}))
    with pytest.raises(SpecError, match=r"spec\.kv\.maxContext=9999 exceeds the model's max_context=4096"):
        resolve_model(parse_spec(tiny(kv={"maxContext": 9999})))


def test_resolve_model_hugging_face_config():
    """A published relative's config.json inline: mapped by hf_layout, its errors named under spec.model.config."""
    raw = DEEPSEEK_V32
    r = resolve_model(parse_spec({**tiny(), "model": {"config": raw, "checkpoint": {"uri": "/w"}}}))
    assert r.model_type == "deepseek_v32" and r.layer_types == ("dsa",) * 3 and r.first_k_dense == 1
    with pytest.raises(SpecError, match=r"spec\.model\.config: hidden_act='gelu' is not supported"):
        resolve_model(
            parse_spec({**tiny(), "model": {"config": {**raw, "hidden_act": "gelu"}, "checkpoint": {"uri": "/w"}}})
        )


# ------------------------------------------------------------------------------------------------ CRD
def test_committed_crd_is_up_to_date():
    committed = crd.DEFAULT_PATH.read_text()
    assert committed == crd.render(), (
        "stale CRD: regenerate with `python -m expertmesh.operator.crd --out "
        "charts/expertmesh/crds/moedeployments.expertmesh.dev.yaml`"
    )
    r = subprocess.run([sys.executable, "-m", "expertmesh.operator.crd", "--check"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_crd_check_fails_when_stale(tmp_path):
    stale = tmp_path / "crd.yaml"
    stale.write_text(crd.render().replace("imbalanceThreshold", "imbalanceThreshhold"))
    assert crd.main(["--check", "--out", str(stale)]) == 1
    assert crd.main(["--out", str(stale)]) == 0 and crd.main(["--check", "--out", str(stale)]) == 0


def test_crd_is_structural_with_defaults_columns_and_subresources():
    doc = yaml.safe_load(crd.DEFAULT_PATH.read_text())
    assert doc["metadata"]["name"] == "moedeployments.expertmesh.dev"
    names = doc["spec"]["names"]
    assert (names["kind"], names["plural"], names["shortNames"]) == ("MoEDeployment", "moedeployments", ["moe"])
    v = doc["spec"]["versions"][0]
    assert v["name"] == "v1alpha1" and v["served"] and v["storage"]
    schema = v["schema"]["openAPIV3Schema"]
    assert crd.check_structural(schema) == []
    text = yaml.safe_dump(schema)
    assert "$ref" not in text and "anyOf" not in text and "definitions" not in text
    spec = schema["properties"]["spec"]
    ew = spec["properties"]["expertWorkers"]
    assert ew["default"] == {} and ew["properties"]["replicas"] == {
        "type": "integer",
        "description": "expert worker pods (StatefulSet ordinals 0..replicas-1)",
        "default": 2,
        "minimum": 1,
        "maximum": 512,
    }
    assert ew["properties"]["gpuMemoryGiB"]["minimum"] == 0 and ew["properties"]["gpuMemoryGiB"]["exclusiveMinimum"]
    assert spec["properties"]["model"]["properties"]["config"]["x-kubernetes-preserve-unknown-fields"] is True
    limits = spec["properties"]["router"]["properties"]["resources"]["properties"]["limits"]
    assert (
        limits["additionalProperties"]["x-kubernetes-int-or-string"] is True
        and "type" not in limits["additionalProperties"]
    )
    assert limits["additionalProperties"]["maximum"] and limits["additionalProperties"]["pattern"]
    assert spec["properties"]["model"]["properties"]["preset"]["enum"] == ["tiny", "small", "full-2.8t"]
    assert spec["required"] == ["model"]
    # preserve-unknown only where free-form data is expected
    preserved = [p for p, node in _walk(schema) if node.get("x-kubernetes-preserve-unknown-fields")]
    assert preserved == [".spec.model.config"]
    assert v["subresources"]["scale"]["specReplicasPath"] == ".spec.expertWorkers.replicas"
    assert v["subresources"]["scale"]["statusReplicasPath"] == ".status.expertWorkers.ready"
    assert "status" in v["subresources"]
    cols = {c["name"]: c["jsonPath"] for c in v["additionalPrinterColumns"]}
    assert cols == {
        "Phase": ".status.phase",
        "Ready": ".status.readyWorkers",
        "Desired": ".status.desiredWorkers",
        "Experts": ".status.placement.physicalExperts",
        "Imbalance": ".status.placement.imbalance",
        "Age": ".metadata.creationTimestamp",
    }
    status = schema["properties"]["status"]["properties"]
    assert status["conditions"]["items"]["properties"]["status"]["enum"] == ["True", "False", "Unknown"]
    assert status["phase"]["enum"] == ["Pending", "Planning", "Deploying", "Ready", "Degraded", "Failed"]


def _walk(node, path=""):
    yield path, node
    for k, sub in node.get("properties", {}).items():
        yield from _walk(sub, f"{path}.{k}")
    if isinstance(node.get("items"), dict):
        yield from _walk(node["items"], f"{path}[]")


def test_structural_checker_catches_violations():
    bad = {
        "type": "object",
        "properties": {
            "a": {"anyOf": [{"type": "string"}, {"type": "integer"}]},
            "b": {"$ref": "#/x"},
            "c": {"properties": {}},
        },
    }
    problems = crd.check_structural(bad)
    assert any(".a: has anyOf" in p for p in problems) and any(".b: has $ref" in p for p in problems)
    assert any(".c: has no type" in p for p in problems)


def test_crd_and_children_validate_against_kubernetes_schemas(tiny_plan):
    kv = pytest.importorskip("kubernetes_validate")
    spec, cfg, plan = tiny_plan
    full = parse_spec(
        tiny(
            telemetry={"otlpEndpoint": "http://otel:4317"},
            router={
                "apiKeySecretRef": {"name": "keys", "key": "api"},
                "replicas": 2,
                "resources": {"limits": {"cpu": "2", "memory": "4Gi"}},
            },
            scheduling={
                "nodeSelector": {"pool": "gpu"},
                "topologySpreadKey": "kubernetes.io/hostname",
                "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            },
            expertWorkers={"gpusPerPod": 8},
            kv={"hostGiB": 8, "disk": {"sizeGiB": 10, "pvc": {}}},
        )
    )
    kv.validate(crd.build_crd(), "1.30", strict=True)
    for child in build_children("kimi", "serving", full, cfg, plan):
        kv.validate(child, "1.30", strict=True)


# ------------------------------------------------------------------------------------------------ children, placement
def test_children_names_labels_and_no_owner_refs(tiny_plan):
    spec, cfg, plan = tiny_plan
    children = build_children("kimi", "serving", spec, cfg, plan)
    assert [(c["kind"], c["metadata"]["name"]) for c in children] == [
        ("ConfigMap", "kimi-plan"),
        ("Service", "kimi-attention"),
        ("Service", "kimi-expert"),
        ("StatefulSet", "kimi-attention"),
        ("StatefulSet", "kimi-expert"),
        ("PodDisruptionBudget", "kimi-expert"),
        ("Deployment", "kimi-router"),
        ("Service", "kimi-router"),
        ("NetworkPolicy", "kimi-attention-worker-ingress"),
        ("NetworkPolicy", "kimi-expert-worker-ingress"),
    ]
    for c in children:
        meta = c["metadata"]
        assert meta["namespace"] == "serving" and "ownerReferences" not in meta  # left to kopf.adopt
        lab = meta["labels"]
        assert lab["app.kubernetes.io/name"] == "expertmesh" and lab["app.kubernetes.io/instance"] == "kimi"
        assert lab["app.kubernetes.io/managed-by"] == "expertmesh-operator"
        assert lab["app.kubernetes.io/part-of"] == "expertmesh" and "app.kubernetes.io/component" in lab
        if c["kind"] in ("StatefulSet", "Deployment"):
            sel = c["spec"]["selector"]["matchLabels"]
            assert sel.items() <= c["spec"]["template"]["metadata"]["labels"].items()
            assert "app.kubernetes.io/version" not in sel  # selectors are immutable: never the version
    cm = children[0]
    assert PlacementPlan.from_json(cm["data"]["plan.json"]) == plan
    assert resolve_model(spec).model_dump_json(indent=1) == cm["data"]["config.json"]
    for svc in children[1:3]:
        assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True


def test_expert_and_router_pods_args_probes_and_env(tiny_plan):
    _, cfg, plan = tiny_plan
    spec = parse_spec(
        tiny(
            telemetry={"otlpEndpoint": "http://otel:4318", "protocol": "http/protobuf"},
            router={"apiKeySecretRef": {"name": "keys", "key": "api"}},
            expertWorkers={"gpusPerPod": 4},
        )
    )
    by = {(c["kind"], c["metadata"]["name"]): c for c in build_children("kimi", "serving", spec, cfg, plan)}
    sts = by[("StatefulSet", "kimi-expert")]
    assert sts["spec"]["serviceName"] == "kimi-expert" and sts["spec"]["replicas"] == 2
    pod = sts["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["command"][:2] == ["/bin/sh", "-c"]
    argv = shlex.split(c["command"][2])
    assert argv[:4] == ["exec", "expertmesh", "worker", "--role"] and argv[4] == "expert"
    opt = dict(zip(argv[5::2], argv[6::2]))
    tls = "/etc/expertmesh-tls"
    assert opt == {
        "--plan": "/etc/expertmesh/plan.json",
        "--checkpoint": "/mnt/checkpoint/ckpt/tiny",
        "--host": "0.0.0.0",
        "--port": "50061",
        "--health-port": "50062",
        "--tls-cert": f"{tls}/server.crt",
        "--tls-key": f"{tls}/server.key",
        "--tls-client-ca": f"{tls}/ca.crt",
        "--ordinal": "${HOSTNAME##*-}",
        "--name": "$HOSTNAME",
    }
    # the kubelet's probes carry no client certificate: they go to the plaintext health-only port
    assert c["readinessProbe"]["grpc"] == {"port": 50062} and c["startupProbe"]["grpc"] == {"port": 50062}
    assert c["livenessProbe"]["grpc"] == {"port": 50062}
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 4
    mounts = {v["mountPath"]: v["name"] for v in c["volumeMounts"]}
    assert mounts == {"/etc/expertmesh": "plan", "/mnt/checkpoint": "checkpoint", tls: "worker-tls"}
    assert {v["name"]: v for v in pod["volumes"]}["worker-tls"]["secret"]["secretName"] == "kimi-worker-tls"
    assert {v["name"]: v for v in pod["volumes"]}["checkpoint"]["persistentVolumeClaim"] == {
        "claimName": "weights",
        "readOnly": True,
    }

    router = by[("Deployment", "kimi-router")]["spec"]["template"]["spec"]["containers"][0]
    args = router["args"]
    opt = dict(zip(args[1::2], args[2::2]))
    assert args[0] == "router" and opt["--plan"] == "/etc/expertmesh/plan.json"
    assert opt["--attention"] == "kimi-attention-0.kimi-attention.serving.svc:50061"
    assert opt["--experts"].split(",") == [f"kimi-expert-{i}.kimi-expert.serving.svc:50061" for i in range(2)]
    assert (opt["--http-port"], opt["--grpc-port"], opt["--host"]) == ("8000", "50051", "0.0.0.0")
    assert (opt["--worker-tls-ca"], opt["--worker-tls-cert"], opt["--worker-tls-key"]) == (
        f"{tls}/ca.crt",
        f"{tls}/client.crt",
        f"{tls}/client.key",
    )
    env = {e["name"]: e for e in router["env"]}
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"]["value"] == "http://otel:4318"
    assert env["OTEL_EXPORTER_OTLP_PROTOCOL"]["value"] == "http/protobuf"
    assert env["EXPERTMESH_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "keys", "key": "api"}
    assert router["readinessProbe"]["httpGet"] == {"path": "/health", "port": 8000}
    svc = by[("Service", "kimi-router")]["spec"]["ports"]
    assert [(p["name"], p["port"]) for p in svc] == [("http", 8000), ("grpc", 50051)]
    pdb = by[("PodDisruptionBudget", "kimi-expert")]["spec"]
    assert pdb["maxUnavailable"] == 1 and pdb["selector"] == sts["spec"]["selector"]
    att = by[("StatefulSet", "kimi-attention")]["spec"]["template"]["spec"]["containers"][0]
    assert att["args"][:3] == ["worker", "--role", "attention"] and "nvidia.com/gpu" not in att["resources"].get(
        "limits", {}
    )
    att_opt = dict(zip(att["args"][3::2], att["args"][4::2]))
    assert att_opt["--kv-blocks"] == str(4096 // 16) and att_opt["--tls-client-ca"] == f"{tls}/ca.crt"
    # attention workers call the expert workers directly: they present the client certificate too
    assert (att_opt["--expert-tls-ca"], att_opt["--expert-tls-cert"], att_opt["--health-port"]) == (
        f"{tls}/ca.crt",
        f"{tls}/client.crt",
        "50062",
    )


def test_worker_tls_secret_certificates_and_opt_out(tiny_plan):
    """The Secret's certificates chain to its CA, name every pod of both headless Services, and carry the usages
    mutual TLS checks; spec.security.workerTLS false removes every TLS flag and mount (a service mesh does it)."""
    spec, cfg, plan = tiny_plan
    hosts = worker_tls_hosts("kimi", "serving")
    secret = worker_tls_secret("kimi", "serving", spec, pki_pems(hosts))
    assert secret["metadata"]["name"] == "kimi-worker-tls" and "ca.key" not in secret["data"]
    pem = {
        k: x509.load_pem_x509_certificate(base64.b64decode(v)) for k, v in secret["data"].items() if k.endswith(".crt")
    }
    for leaf, usage in (
        ("server.crt", ExtendedKeyUsageOID.SERVER_AUTH),
        ("client.crt", ExtendedKeyUsageOID.CLIENT_AUTH),
    ):
        pem[leaf].verify_directly_issued_by(pem["ca.crt"])
        assert list(pem[leaf].extensions.get_extension_for_class(x509.ExtendedKeyUsage).value) == [usage]
    names = pem["server.crt"].extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.DNSName) == [
        "*.kimi-attention.serving.svc",
        "*.kimi-prefill.serving.svc",
        "*.kimi-expert.serving.svc",
    ]
    att, exp = worker_addresses("kimi", "serving", spec)  # what the router dials is covered by a wildcard
    assert all(
        a.split(":")[0].split(".", 1)[1] in {n[2:] for n in names.get_values_for_type(x509.DNSName)} for a in att + exp
    )
    off = parse_spec(tiny(security={"workerTls": False}))
    for c in build_children("kimi", "serving", off, cfg, plan):
        text = json.dumps(c)
        assert "tls" not in text.lower(), c["metadata"]["name"]
    with pytest.raises(SpecError, match="workerTls"):
        parse_spec(tiny(security={"workerTls": "maybe"}))


def test_router_replicas_share_a_prefix_salt_secret_and_one_router_needs_none(tiny_plan):
    """Several router replicas mount the deployment's N-router-salt Secret and run with --prefix-salt-file (the
    same prefix keys on every replica); one router gets neither (its own random salt); no worker pod mounts it."""
    _, cfg, plan = tiny_plan
    for replicas in (1, 3):
        spec = parse_spec(tiny(router={"replicas": replicas}))
        by = {(c["kind"], c["metadata"]["name"]): c for c in build_children("kimi", "serving", spec, cfg, plan)}
        router = by[("Deployment", "kimi-router")]
        assert router["spec"]["replicas"] == replicas
        pod = router["spec"]["template"]["spec"]
        args, vols = pod["containers"][0]["args"], {v["name"]: v for v in pod["volumes"]}
        mounts = {m["name"]: m for m in pod["containers"][0]["volumeMounts"]}
        if replicas == 1:
            assert "--prefix-salt-file" not in args and "router-salt" not in vols and "router-salt" not in mounts
        else:
            assert args[args.index("--prefix-salt-file") + 1] == "/etc/expertmesh-router-salt/salt"
            assert vols["router-salt"]["secret"] == {"secretName": "kimi-router-salt", "defaultMode": 0o400}
            assert mounts["router-salt"] == {
                "name": "router-salt",
                "mountPath": "/etc/expertmesh-router-salt",
                "readOnly": True,
            }
        for sts in ("kimi-attention", "kimi-expert"):
            assert "router-salt" not in json.dumps(by[("StatefulSet", sts)])
    secret = router_salt_secret("kimi", "serving", spec, b"\x00salt\xff")
    assert (secret["kind"], secret["metadata"]["name"], secret["type"]) == ("Secret", "kimi-router-salt", "Opaque")
    assert base64.b64decode(secret["data"]["salt"]) == b"\x00salt\xff"  # the router reads the file's bytes


def test_fetched_checkpoint_init_container_cache_volume_and_weights_condition(tiny_plan):
    _, cfg, plan = tiny_plan
    spec = parse_spec(
        tiny(
            model={
                "preset": "tiny",
                "checkpoint": {"uri": "hf://org/tiny@v1", "tokenSecretRef": {"name": "hf", "key": "token"}},
            }
        )
    )
    path = checkpoint_path(spec)
    assert path.startswith("/var/cache/expertmesh/org-tiny-v1-")
    for c in build_children("kimi", "ns", spec, cfg, plan):
        if c["kind"] not in ("StatefulSet", "Deployment"):
            continue
        pod = c["spec"]["template"]["spec"]
        (init,) = pod["initContainers"]
        assert init["name"] == "fetch" and init["args"] == ["fetch", "hf://org/tiny@v1", "--cache", path]
        assert init["terminationMessagePolicy"] == "FallbackToLogsOnError"
        assert init["env"] == [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}]
        assert {v["name"]: v for v in pod["volumes"]}["checkpoint-cache"]["hostPath"] == {
            "path": "/var/cache/expertmesh",
            "type": "DirectoryOrCreate",
        }
        main = pod["containers"][0]
        assert path in (main.get("args") or []) + [w for x in main.get("command") or [] for w in shlex.split(x)]
    shared = parse_spec(
        tiny(model={"preset": "tiny", "checkpoint": {"uri": "https://x/ck", "cache": {"claimName": "ckpt-cache"}}})
    )
    vols = pod_volumes("kimi", shared)[0]
    assert {v["name"]: v for v in vols}["checkpoint-cache"]["persistentVolumeClaim"] == {"claimName": "ckpt-cache"}
    s3 = parse_spec(
        tiny(
            model={
                "preset": "tiny",
                "checkpoint": {
                    "uri": "s3://models/tiny",
                    "endpoint": "http://minio:9000",
                    "region": "eu-west-3",
                    "credentialsSecret": "s3-keys",
                },
            }
        )
    )
    init = fetch_container(s3, pod_volumes("kimi", s3)[1])
    assert init["envFrom"] == [{"secretRef": {"name": "s3-keys"}}] and init["env"] == [
        {"name": "AWS_ENDPOINT_URL_S3", "value": "http://minio:9000"},
        {"name": "AWS_REGION", "value": "eu-west-3"},
    ]
    with pytest.raises(SpecError, match="endpoint: only for an s3:// uri"):
        parse_spec(tiny(model={"preset": "tiny", "checkpoint": {"uri": "https://x/ck", "endpoint": "http://m"}}))
    baked = parse_spec(tiny(model={"preset": "tiny", "checkpoint": {"uri": "/opt/ck"}}))
    assert checkpoint_path(baked) == "/opt/ck" and "initContainers" not in pod_spec(
        "kimi", COMPONENT_ROUTER, baked, {"name": "router"}
    )

    def pod(name, node, fetch=None, error=""):
        return PodInfo(
            name=name,
            component=COMPONENT_EXPERT,
            ordinal=0,
            ready=False,
            template_hash="t",
            uid=name,
            fetch=fetch,
            fetch_error=error,
            node=node,
        )

    # a node's pods share its cache (one downloads, the others wait): the node's best; the slowest node counts
    pods = [pod("a", "n1", "running"), pod("b", "n1", "running"), pod("c", "n2", "running")]
    assert weights_condition(spec, pods, {"a": 80.0, "b": None, "c": 37.5}) == (
        "False",
        "Downloading",
        "Downloading 37% (3 pods fetching hf://org/tiny@v1)",
    )
    # a node where one pod has finished is complete (the pods still waiting there read its cache): the others count
    later = pods + [pod("e", "n2", "done")]
    assert (
        weights_condition(spec, later, {"a": 80.0, "b": None, "c": 0.0})[2]
        == "Downloading 80% (3 pods fetching hf://org/tiny@v1)"
    )
    bad = pods + [pod("d", "n2", "failed", "FETCH 10.0% …\nFETCH failed: checkpoint file 'x.safetensors': sha256 …")]
    assert weights_condition(spec, bad, {}) == (
        "False",
        "FetchFailed",
        "pod d: checkpoint file 'x.safetensors': sha256 …",
    )
    assert weights_condition(spec, [pod("a", "n1")], {})[:2] == ("True", "Verified")
    assert weights_condition(baked, pods, {}) is None
    st = with_weights({"phase": "Deploying", "message": "rolling"}, {}, spec, pods, {"a": 50, "c": 50}, 1)
    assert st["message"] == "Downloading 50% (3 pods fetching hf://org/tiny@v1)"
    assert condition(st, "WeightsReady")["reason"] == "Downloading"
    # the fetch init container's state from a pod's status (a restart after a failure keeps the failure)
    status = {
        "initContainerStatuses": [
            {
                "name": "fetch",
                "state": {"running": {}},
                "lastState": {"terminated": {"exitCode": 1, "message": "FETCH failed: boom"}},
            }
        ]
    }
    assert (
        pod_info(
            {
                "metadata": {
                    "name": "kimi-expert-0",
                    "labels": {LABEL_COMPONENT: COMPONENT_EXPERT, LABEL_INSTANCE: "kimi"},
                },
                "spec": {"nodeName": "n1"},
                "status": status,
            }
        ).fetch_error
        == "FETCH failed: boom"
    )


def test_plan_is_published_in_the_configmap_and_no_pod_template_changes_with_it(tiny_plan):
    spec, cfg, plan = tiny_plan
    spec_r = parse_spec(tiny(expertWorkers={"redundantExperts": 2}))
    plan_r = plan_for(spec_r, cfg, previous=plan)
    assert plan_r.plan_hash() != plan.plan_hash()

    def parts(s, p):
        ch = {(c["kind"], c["metadata"]["name"]): c for c in build_children("kimi", "ns", s, cfg, p)}
        return (
            ch[("ConfigMap", "kimi-plan")]["metadata"]["annotations"][PLAN_HASH_ANNOTATION],
            ch[("ConfigMap", "kimi-plan")]["data"]["plan.json"],
            [json.dumps(c["spec"]["template"], sort_keys=True) for c in ch.values() if "template" in c.get("spec", {})],
            revision(list(ch.values())),
        )

    a, b = parts(spec, plan), parts(spec_r, plan_r)
    assert (a[0], b[0]) == (plan.plan_hash(), plan_r.plan_hash()) and a[1] != b[1]
    assert a[2] == b[2]  # attention, expert and router pod templates byte-identical: a new plan rolls nothing
    assert a[3] != b[3]  # but it is a new revision (the ConfigMap changed)
    # same spec and previous plan → the same plan kept (an operator restart does not restart pods)
    assert plan_for(spec, cfg, previous=plan) is plan
    bumped = parse_spec(tiny(image={"tag": "0.2.0"}))
    assert parts(bumped, plan)[2] != a[2]  # a spec change does roll the pods


def test_changed_ordinals_are_the_expert_pods_whose_shards_move(tiny_plan):
    spec, cfg, plan = tiny_plan
    spec3 = parse_spec(tiny(expertWorkers={"replicas": 3, "gpuMemoryGiB": 40 * TINY_EXPERT_BYTES / GIB}))
    new = replan_around(spec3, cfg, plan_for(spec3, cfg), [2])  # ordinal 2's experts move to 0 and 1
    old = plan_for(spec3, cfg)
    assert changed_ordinals(old, new) == [0, 1, 2] and new.experts_of(2) == []
    assert changed_ordinals(old, old) == [] and changed_ordinals(None, new) == [0, 1]


def test_spec_overrides_become_router_flags_the_router_enforces(tiny_plan):
    # the router's own parser checks the flags: imported here, so the operator's tests load no serving stack otherwise
    from expertmesh.router.server import add_arguments as router_arguments
    from expertmesh.router.server import serving_config, thinking_budgets

    _, cfg, plan = tiny_plan
    spec = parse_spec(tiny(thinking={"low": 3, "high": 5, "max": 7}, kv={"maxContext": 1024}))
    router = {(c["kind"], c["metadata"]["name"]): c for c in build_children("kimi", "ns", spec, cfg, plan)}[
        ("Deployment", "kimi-router")
    ]["spec"]["template"]["spec"]["containers"][0]
    p = argparse.ArgumentParser()
    router_arguments(p)
    args = p.parse_args(router["args"][1:])
    assert (args.max_context, args.thinking_budgets) == (1024, "3,5,7")
    served = serving_config(cfg, max_context=args.max_context)
    budgets = thinking_budgets(args.thinking_budgets)
    assert served.max_context == 1024 and (budgets.low, budgets.high, budgets.max) == (3, 5, 7)
    assert serving_config(cfg) is cfg and router_serving_args(parse_spec(tiny())) == []
    with pytest.raises(ValueError, match="--max-context"):
        serving_config(cfg, max_context=cfg.max_context + 1)
    for bad, words in (("3,2,7", "low <= high <= max"), ("3,5", "LOW,HIGH,MAX"), ("0,5,7", "positive")):
        with pytest.raises(ValueError, match=f"--thinking-budgets.*{words}"):
            thinking_budgets(bad)


def test_too_small_cluster_raises_plan_error_with_missing_memory():
    spec = parse_spec(tiny(expertWorkers={"replicas": 1}))
    with pytest.raises(PlanError, match=r"GiB missing; 2 pods of this shape would fit the model"):
        plan_for(spec, resolve_model(spec))


# ------------------------------------------------------------------------------------------------ status logic
NOW = "2026-01-01T00:00:00Z"
LATER = "2026-01-01T00:05:00Z"


def test_set_condition_keeps_transition_time_unless_status_flips():
    c = set_condition([], "WorkersReady", "False", "PodsStarting", "0/2", 1, NOW)
    c = set_condition(c, "WorkersReady", "False", "PodsStarting", "1/2", 1, LATER)
    assert c[0]["lastTransitionTime"] == NOW and c[0]["message"] == "1/2"
    c = set_condition(c, "WorkersReady", "True", "AllWorkersReady", "2/2", 2, LATER)
    assert c[0]["lastTransitionTime"] == LATER and c[0]["observedGeneration"] == 2
    c = set_condition(c, "PlacementReady", "True", "Planned", "", 2, LATER)
    assert [x["type"] for x in c] == ["PlacementReady", "WorkersReady"]


def _pods(spec, children, plan, *, experts=None, ready=True, template=None):
    th = template_hashes(children)
    pods = [
        PodInfo("kimi-router-a", "router", None, True, th["router"]),
        PodInfo("kimi-attention-0", "attention-worker", 0, True, th["attention-worker"]),
    ]
    for o in range(plan.cluster.pods) if experts is None else experts:
        pods.append(PodInfo(f"kimi-expert-{o}", "expert-worker", o, ready, template or th["expert-worker"]))
    return pods, th


def test_decide_state_machine(tiny_plan):
    spec, cfg, plan = tiny_plan
    children = build_children("kimi", "ns", spec, cfg, plan)
    st = {"phase": "Deploying", "placement": placement_status(plan)}

    pods, th = _pods(spec, children, plan, experts=[0])  # still starting: not a loss
    d = decide("kimi", spec, plan, st, assess(spec, plan, pods, th), 1, NOW)
    assert d.status["phase"] == "Deploying" and d.replan_excluding is None
    pods, th = _pods(spec, children, plan, template="old")  # all up, but on the old template: rolling
    assert decide("kimi", spec, plan, st, assess(spec, plan, pods, th), 1, NOW).status["phase"] == "Deploying"

    pods, th = _pods(spec, children, plan)
    d = decide("kimi", spec, plan, st, assess(spec, plan, pods, th), 1, NOW)
    assert d.status["phase"] == "Ready" and (d.status["readyWorkers"], d.status["desiredWorkers"]) == (3, 3)
    ready = {**st, **d.status}
    assert d.status["expertWorkers"]["selector"] == (
        "app.kubernetes.io/component=expert-worker,app.kubernetes.io/instance=kimi,app.kubernetes.io/name=expertmesh"
    )

    pods, th = _pods(spec, children, plan, experts=[0])  # after Ready, no replicas: Degraded, then re-plan
    d = decide("kimi", spec, plan, ready, assess(spec, plan, pods, th), 1, LATER)
    deg = condition(d.status, "Degraded")
    assert d.status["phase"] == "Degraded" and deg["reason"] == "ExpertsUnavailable" and d.replan_excluding is None
    assert deg["lastTransitionTime"] == LATER and "expert workers [1] lost; 24 experts" in deg["message"]
    assert "at 2026-01-01T00:07:00Z unless they come back" in deg["message"]  # the 120 s grace period
    assert d.status["lostSince"] == [{"ordinal": 1, "since": LATER}]
    assert condition(d.status, "WorkersReady")["status"] == "False"
    degraded = {**ready, **d.status}
    d = decide("kimi", spec, plan, degraded, assess(spec, plan, pods, th), 1, "2026-01-01T00:06:59Z")
    assert d.replan_excluding is None and d.status["lostSince"] == [{"ordinal": 1, "since": LATER}]
    d = decide("kimi", spec, plan, degraded, assess(spec, plan, pods, th), 1, "2026-01-01T00:07:00Z")
    assert d.replan_excluding == [1] and "re-planning onto the surviving workers" in d.status["message"]

    pods, th = _pods(spec, children, plan, experts=[0, 1])  # attention pod NotReady
    pods = [
        p if p.component != "attention-worker" else PodInfo(p.name, p.component, 0, False, p.template_hash)
        for p in pods
    ]
    d = decide("kimi", spec, plan, ready, assess(spec, plan, pods, th), 1, LATER)
    assert condition(d.status, "Degraded")["reason"] == "AttentionWorkersUnavailable" and d.replan_excluding is None

    failed = {"phase": "Failed"}
    assert decide("kimi", spec, plan, failed, assess(spec, plan, pods, th), 1, NOW).status == {}


def test_replicas_serving_and_replan_around_lost_pod():
    spec = parse_spec(
        tiny(expertWorkers={"replicas": 3, "redundantExperts": 16, "gpuMemoryGiB": (40 * TINY_EXPERT_BYTES) / GIB})
    )
    cfg = resolve_model(spec)
    plan = plan_for(spec, cfg)
    children = build_children("kimi", "ns", spec, cfg, plan)
    pods, th = _pods(spec, children, plan, experts=[0, 2])
    a = assess(spec, plan, pods, th)
    assert a.lost_experts == [1] and a.unserved == []  # every expert has 2 replicas on distinct pods
    d = decide("kimi", spec, plan, {"phase": "Ready"}, a, 1, NOW)
    assert condition(d.status, "Degraded")["reason"] == "ReplicasServing" and d.replan_excluding is None

    new = replan_around(spec, cfg, plan, [1])
    assert new.cluster == plan.cluster and new.experts_of(1) == []
    for layer, e in plan.experts_of(0):
        assert 1 not in new.replicas(layer, e)
    kept = set(plan.experts_of(0)) & set(new.experts_of(0))
    assert len(kept) == len(plan.experts_of(0))  # survivors keep every shard they had
    assert new.figures.moved_shards == moved_shards(plan, new) and any("lost" in n for n in new.notes)
    with pytest.raises(PlanError, match="all 3 expert workers are lost"):
        replan_around(spec, cfg, plan, [0, 1, 2])


def test_parse_load_and_rebalance():
    spec = parse_spec(tiny(expertWorkers={"redundantExperts": 4}, placement={"imbalanceThreshold": 1.1}))
    cfg = resolve_model(spec)
    plan = plan_for(spec, cfg)
    skew = zipf_loads(cfg, s=1.5, seed=1) * 100
    payload = {"moe_layers": cfg.moe_layers, "tokens": {str(l): skew[i].tolist() for i, l in enumerate(cfg.moe_layers)}}
    loads = parse_load(payload, cfg)
    np.testing.assert_allclose(loads, skew)
    with pytest.raises(ValueError, match=r"tokens\[2\] must be 16 finite counts"):
        parse_load({"tokens": {"2": [1, 2]}}, cfg)
    with pytest.raises(ValueError, match="expected an object with 'tokens'"):
        parse_load({"moe_layers": []}, cfg)
    r = rebalance(spec, cfg, plan, loads)
    assert r.plan is not None and r.observed > 1.1 and r.expected < r.observed
    assert r.observed == pytest.approx(imbalance(plan, loads).mean) and r.moved == moved_shards(plan, r.plan)
    uniform = np.ones_like(loads)
    assert rebalance(spec, cfg, plan, uniform).plan is None  # balanced: nothing to do
    assert rebalance(spec, cfg, plan, 0 * loads).plan is None  # no traffic yet


# ------------------------------------------------------------------------------------------------ rbac / cli
def test_rbac_covers_every_kind_the_operator_writes(tiny_plan):
    spec, cfg, plan = tiny_plan
    granted = rbac.as_policy_rules()
    group = {
        "v1": "",
        "apps/v1": "apps",
        "policy/v1": "policy",
        "networking.k8s.io/v1": "networking.k8s.io",
        "autoscaling/v2": "autoscaling",
    }
    pools = parse_spec(tiny(prefillWorkers={"autoscale": {"maxReplicas": 2, "target": 100}}))
    for child in build_children("kimi", "ns", spec, cfg, plan) + build_children("kimi", "ns", pools, cfg, plan):
        for verb in ("get", "create", "patch"):
            plural = resource(child["apiVersion"], child["kind"])._api_info.plural  # as the client addresses it
            assert rbac.allows(granted, group[child["apiVersion"]], plural, verb), child["kind"]
    for verb in ("get", "list", "watch", "patch"):
        assert rbac.allows(granted, "expertmesh.dev", "moedeployments", verb)
    assert rbac.allows(granted, "expertmesh.dev", "moedeployments/status", "patch")
    # pods: watched, never created, patched, updated or deleted (a new plan is adopted live)
    assert rbac.allows(granted, "", "pods", "watch") and rbac.allows(granted, "", "pods/log", "get")
    # children a later spec no longer has are deleted (children.absent_children); the pools' sizes are watched
    for api_version, kind, _ in absent_children("kimi", spec):
        assert rbac.allows(granted, group[api_version], resource(api_version, kind)._api_info.plural, "delete"), kind
    assert rbac.allows(granted, "apps", "statefulsets", "watch") and rbac.allows(
        granted, "apps", "statefulsets", "list"
    )
    assert not any(rbac.allows(granted, "", "pods", v) for v in ("create", "patch", "update", "delete"))
    # secrets: the worker-TLS Secret is read and created once, never patched, listed or watched
    assert rbac.allows(granted, "", "secrets", "get") and rbac.allows(granted, "", "secrets", "create")
    assert not any(rbac.allows(granted, "", "secrets", v) for v in ("list", "watch", "patch", "update"))
    assert rbac.missing(granted) == []
    assert rbac.missing([r for r in granted if r["resources"] != ["pods"]]) == [
        "core/pods:get",
        "core/pods:list",
        "core/pods:watch",
    ]
    assert all("*" not in r["verbs"] and "*" not in r["resources"] for r in granted)


def test_cli_namespace_scoped_or_clusterwide():
    p = argparse.ArgumentParser()
    add_arguments(p)
    kw = operator_kwargs(p.parse_args([]))
    assert kw == {"liveness_endpoint": "http://0.0.0.0:8080/healthz", "clusterwide": True, "standalone": True}
    kw = operator_kwargs(
        p.parse_args(["-n", "serving", "--namespace", "team-*", "--liveness", "none", "--peering", "expertmesh"])
    )
    priority = kw.pop("priority")
    assert kw == {"liveness_endpoint": None, "namespaces": ["serving", "team-*"], "peering_name": "expertmesh"}
    assert 0 < priority < 2**31  # random: two replicas never tie (Kopf would pause both)
    kw = operator_kwargs(p.parse_args(["--peering", "expertmesh", "--priority", "7"]))
    assert (kw["priority"], kw["clusterwide"], "standalone" in kw) == (7, True, False)


def _reachable(children: list[dict], prefix: str) -> set:
    """(source workload, target workload, ports or None for any) that the NetworkPolicies named `prefix`* admit,
    between the workloads of `children`."""
    pods = {
        c["metadata"]["name"]: c["spec"]["template"]["metadata"]["labels"]
        for c in children
        if c["kind"] in ("StatefulSet", "Deployment")
    }
    allowed = set()
    for p in (c for c in children if c["kind"] == "NetworkPolicy" and c["metadata"]["name"].startswith(prefix)):
        assert p["spec"]["policyTypes"] == ["Ingress"]
        sel = p["spec"]["podSelector"]["matchLabels"]
        for target in (n for n, lab in pods.items() if sel.items() <= lab.items()):
            for rule in p["spec"]["ingress"]:
                ports = tuple(sorted(q["port"] for q in rule["ports"])) if "ports" in rule else None
                for source in rule["from"]:
                    src = source["podSelector"]["matchLabels"]
                    allowed |= {(n, target, ports) for n, lab in pods.items() if src.items() <= lab.items()}
    return allowed


@pytest.mark.parametrize("transport", ["grpc", "collective"])
def test_only_the_deployments_own_pods_reach_the_workers(tiny_plan, transport, monkeypatch):
    """Who may open a connection to whom, on which ports (None: any): the router the workers' gRPC port, the
    attention workers the expert workers' gRPC port; with the collective transport attention and expert pods
    each other on any port (gloo / NCCL pair connections), and never a pod of another deployment."""
    _, cfg, plan = tiny_plan
    spec = parse_spec(tiny(transport=transport))
    children = build_children("kimi", "serving", spec, cfg, plan) + build_children(
        "other", "serving", parse_spec(tiny(transport="collective")), cfg, plan
    )
    allowed = _reachable(children, "kimi-")
    grpc = (WORKER_PORT,)
    want = {("kimi-router", "kimi-attention", grpc), ("kimi-router", "kimi-expert", grpc)}
    want |= (
        {("kimi-attention", "kimi-expert", grpc)}
        if transport == "grpc"
        else {("kimi-attention", "kimi-expert", None), ("kimi-expert", "kimi-attention", None)}
    )
    assert allowed == want
    (expert,) = [c for c in children if c["kind"] == "StatefulSet" and c["metadata"]["name"] == "kimi-expert"]
    container = expert["spec"]["template"]["spec"]["containers"][0]
    (router,) = [c for c in children if c["kind"] == "Deployment" and c["metadata"]["name"] == "kimi-router"]
    router_args = router["spec"]["template"]["spec"]["containers"][0]["args"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    if transport == "collective":
        assert env["EXPERTMESH_COLLECTIVE_PORT"] == str(COLLECTIVE_PORT)
        assert {"name": "collective", "containerPort": COLLECTIVE_PORT} in container["ports"]
        assert router_args[router_args.index("--transport") + 1] == "collective"
        # the worker's own parser reads the port from that env (the pod's command does not name it); imported here:
        # the worker loads torch and the model
        from expertmesh.worker.cli import build_parser

        monkeypatch.setenv("EXPERTMESH_COLLECTIVE_PORT", env["EXPERTMESH_COLLECTIVE_PORT"])
        assert build_parser().parse_args(["--role", "expert"]).collective_port == COLLECTIVE_PORT
    else:
        assert "EXPERTMESH_COLLECTIVE_PORT" not in env and "--transport" not in router_args
    with pytest.raises(SpecError, match="spec.transport"):
        parse_spec(tiny(transport="nccl"))


def test_seconds_since_reads_status_times():
    now = dt.datetime(2026, 1, 1, 0, 5, tzinfo=dt.UTC)
    assert seconds_since(NOW, now) == 300.0  # the last load read, kept in status.lastRebalanceTime
    assert seconds_since(None, now) == seconds_since("garbage", now) == float("inf")


def test_an_inline_kimi_k3_config_resolves():
    """A MoEDeployment may name its model by a Hugging Face kimi_k3 wrapper config (text_config inside)."""
    text = {
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "hidden_act": "situ",
        "num_experts": 8,
        "num_experts_per_token": 2,
        "num_shared_experts": 2,
        "moe_intermediate_size": 32,
        "routed_expert_hidden_size": 32,
        "first_k_dense_replace": 1,
        "q_lora_rank": 32,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "attn_res_block_size": 2,
        "linear_attn_config": {
            "full_attn_layers": [2, 4],
            "num_heads": 4,
            "head_dim": 16,
            "gate_lower_bound": -5.0,
            "use_full_rank_gate": True,
        },
    }
    cfg = resolve_model(
        parse_spec(
            {**tiny(), "model": {"config": {"model_type": "kimi_k3", "text_config": text}, "checkpoint": {"uri": "/w"}}}
        )
    )
    assert cfg.model_type == "kimi_k3" and cfg.moe.latent_size == 32 and cfg.activation.kind == "situ"


@pytest.mark.parametrize(
    "disk, volume",
    [
        ({"sizeGiB": 100}, {"emptyDir": {"sizeLimit": "107520Mi"}}),
        (
            {"sizeGiB": 100, "hostPath": "/mnt/nvme/kv"},
            {"hostPath": {"path": "/mnt/nvme/kv", "type": "DirectoryOrCreate"}},
        ),
        ({"sizeGiB": 100, "pvc": {"storageClassName": "local-nvme"}}, None),
    ],
)
def test_kv_tiers_become_attention_worker_flags_memory_and_a_disk_volume(tiny_plan, disk, volume):
    """spec.kv.hostGiB → --kv-host-gib and the memory request / limit grow by it; spec.kv.disk → --kv-disk-dir on
    its own volume (an emptyDir with a sizeLimit, a node folder per pod, or a claim per pod) and --kv-disk-gib."""
    _, cfg, plan = tiny_plan
    spec = parse_spec(
        tiny(
            kv={"hostGiB": 64, "disk": disk},
            attentionWorkers={"resources": {"requests": {"memory": "16Gi"}, "limits": {"memory": "32Gi"}}},
        )
    )
    by = {(c["kind"], c["metadata"]["name"]): c for c in build_children("kimi", "serving", spec, cfg, plan)}
    sts = by[("StatefulSet", "kimi-attention")]["spec"]
    pod, c = sts["template"]["spec"], sts["template"]["spec"]["containers"][0]
    opt = dict(zip(c["args"][3::2], c["args"][4::2]))
    assert (opt["--kv-host-gib"], opt["--kv-disk-dir"], opt["--kv-disk-gib"]) == (
        "64",
        "/var/cache/expertmesh-kv",
        "100",
    )
    assert c["resources"]["requests"]["memory"] == f"{(16 + 64) * 1024}Mi"
    assert c["resources"]["limits"]["memory"] == f"{(32 + 64) * 1024}Mi"
    mount = {m["name"]: m for m in c["volumeMounts"]}["kv-disk"]
    assert mount["mountPath"] == "/var/cache/expertmesh-kv"
    vols = {v["name"]: v for v in pod["volumes"]}
    if volume is None:
        assert "kv-disk" not in vols
        (claim,) = sts["volumeClaimTemplates"]
        assert claim["metadata"]["name"] == "kv-disk" and claim["spec"]["storageClassName"] == "local-nvme"
        assert claim["spec"]["resources"]["requests"]["storage"] == "107520Mi"
    else:
        assert {k: v for k, v in vols["kv-disk"].items() if k != "name"} == volume
        assert "volumeClaimTemplates" not in sts
        assert mount.get("subPathExpr") == ("$(POD_NAME)" if "hostPath" in volume else None)
    # without tiers: no flag, no volume, the spec's resources as they are
    plain = parse_spec(tiny())
    att = {(c["kind"], c["metadata"]["name"]): c for c in build_children("kimi", "serving", plain, cfg, plan)}[
        ("StatefulSet", "kimi-attention")
    ]["spec"]["template"]["spec"]
    assert not any(a.startswith("--kv-host") or a.startswith("--kv-disk") for a in att["containers"][0]["args"])
    assert "kv-disk" not in {v["name"] for v in att["volumes"]}


@pytest.mark.parametrize(
    "kv, words",
    [
        ({"hostGiB": -1}, "hostGiB"),
        ({"disk": {"sizeGiB": 0}}, "sizeGiB"),
        ({"disk": {"sizeGiB": 1, "hostPath": "/x", "pvc": {}}}, "pvc or hostPath"),
        ({"disk": {"sizeGiB": 1, "hostPath": "relative"}}, "hostPath"),
    ],
)
def test_bad_kv_tier_fields_are_refused_naming_them(kv, words):
    with pytest.raises(SpecError, match=words):
        parse_spec(tiny(kv=kv))


# ------------------------------------------------------------------------------------------------ pools (#36)
def _by(children: list[dict]) -> dict:
    return {(c["kind"], c["metadata"]["name"]): c for c in children}


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
    assert "prefill" not in json.dumps(children) and "HorizontalPodAutoscaler" not in json.dumps(children)
    att = _by(children)[("StatefulSet", "kimi-attention")]["spec"]["template"]["spec"]["containers"][0]
    assert "--pool" not in att["args"] and att["name"] == "attention"
    router = _by(children)[("Deployment", "kimi-router")]["spec"]["template"]["spec"]["containers"][0]["args"]
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
    by = _by(children)
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
    by = _by(children)
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
        by = _by(build_children("kimi", "serving", spec, cfg, plan, {"prefill-worker": seen, "attention-worker": 7}))
        assert by[("StatefulSet", "kimi-prefill")]["spec"]["replicas"] == want
        assert by[("StatefulSet", "kimi-attention")]["spec"]["replicas"] == 2  # not autoscaled: the spec's
        ro = _opts(by[("Deployment", "kimi-router")]["spec"]["template"]["spec"]["containers"][0]["args"], 1)
        assert len(ro["--prefill"].split(",")) == want and len(ro["--attention"].split(",")) == 2
    auto = spec.prefill_workers.autoscale
    assert [pool_replicas(3, auto, n) for n in (None, 0, 2, 5, 6, 100)] == [2, 2, 2, 5, 6, 6]
    assert pool_replicas(3, None, 100) == 3


@pytest.mark.parametrize(
    "over, field",
    [
        (
            {"prefillWorkers": {"autoscale": {"minReplicas": 3, "maxReplicas": 2, "target": 1}}},
            "spec.prefillWorkers.autoscale.maxReplicas",
        ),
        (
            {"attentionWorkers": {"autoscale": {"minReplicas": -1, "maxReplicas": 2, "target": 1}}},
            "spec.attentionWorkers.autoscale.minReplicas",
        ),
        (
            {"attentionWorkers": {"autoscale": {"minReplicas": 0, "maxReplicas": 2, "target": 1}}},
            "spec.attentionWorkers.autoscale.minReplicas",
        ),
        (
            {"prefillWorkers": {"autoscale": {"maxReplicas": 2, "target": 1, "metric": "gpu_util"}}},
            "spec.prefillWorkers.autoscale.metric",
        ),
        (
            {"prefillWorkers": {"autoscale": {"maxReplicas": 2, "target": 1.5, "metric": "kv_utilization"}}},
            "spec.prefillWorkers.autoscale.target",
        ),
        ({"prefillWorkers": {"autoscale": {"maxReplicas": 2, "target": -4}}}, "spec.prefillWorkers.autoscale.target"),
        (
            {"prefillWorkers": {"autoscale": {"maxReplicas": 100000, "target": 4}}},
            "spec.prefillWorkers.autoscale.maxReplicas",
        ),
        ({"prefillWorkers": {"autoscale": {"target": 4}}}, "spec.prefillWorkers.autoscale.maxReplicas"),
        ({"prefillWorkers": {"replicas": -1}}, "spec.prefillWorkers.replicas"),
        ({"prefillWorkers": {"minPromptTokens": -1}}, "spec.prefillWorkers.minPromptTokens"),
        ({"prefillWorkers": {"gpusPerPod": 1, "resources": {"limits": {"nvidia.com/gpu": 2}}}}, "spec.prefillWorkers"),
    ],
)
def test_bad_pool_fields_are_refused_naming_them(over, field):
    with pytest.raises(SpecError) as e:
        parse_spec(tiny(**over))
    assert str(e.value).startswith(field + ":") or f"; {field}:" in str(e.value), str(e.value)


@pytest.mark.parametrize("transport", ["grpc", "collective"])
def test_prefill_pods_reach_the_decode_and_expert_workers(tiny_plan, transport):
    """With a prefill pool: the router reaches it on the gRPC port; it reaches the expert workers as the attention
    workers do (gRPC port; any port with the collective transport, both ways) and the decode workers' gRPC port
    (the hand-off; with the collective transport any port, both ways: its pairs, and the decode pods serve their
    rendezvous store); nobody else reaches it."""
    _, cfg, plan = tiny_plan
    spec = parse_spec(tiny(transport=transport, prefillWorkers={"replicas": 1}))
    children = build_children("kimi", "serving", spec, cfg, plan)
    allowed = _reachable(children, "kimi-")
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


def test_status_reports_both_pools(tiny_plan):
    """status.prefillWorkers beside status.attentionWorkers (the decode pool); a prefill pod not ready keeps the
    deployment from Ready (WorkersReady False, naming the prefill pool); without a prefill pool the field is
    removed (null in the merge patch)."""
    _, cfg, plan = tiny_plan
    spec = parse_spec(tiny(prefillWorkers={"replicas": 2}))
    children = build_children("kimi", "ns", spec, cfg, plan)
    pods, th = _pods(spec, children, plan)
    sizes = {"attention-worker": 1, "prefill-worker": 2}
    st = {"phase": "Deploying", "placement": placement_status(plan)}
    one = pods + [PodInfo("kimi-prefill-0", "prefill-worker", 0, True, th["prefill-worker"])]
    d = decide("kimi", spec, plan, st, assess(spec, plan, one, th, sizes), 1, NOW)
    assert d.status["phase"] == "Deploying" and d.status["prefillWorkers"] == {"ready": 1, "desired": 2}
    assert "1/2 prefill workers ready" in condition(d.status, "WorkersReady")["message"]
    both = one + [PodInfo("kimi-prefill-1", "prefill-worker", 1, True, th["prefill-worker"])]
    d = decide("kimi", spec, plan, st, assess(spec, plan, both, th, sizes), 1, NOW)
    assert d.status["phase"] == "Ready" and d.status["prefillWorkers"] == {"ready": 2, "desired": 2}
    assert d.status["attentionWorkers"] == {"ready": 1, "desired": 1}
    assert (d.status["readyWorkers"], d.status["desiredWorkers"]) == (5, 5)
    ready = {**st, **d.status}
    d = decide("kimi", spec, plan, ready, assess(spec, plan, one, th, sizes), 1, LATER)
    assert d.status["phase"] == "Degraded" and condition(d.status, "WorkersReady")["status"] == "False"
    assert "1/2 prefill" in condition(d.status, "Degraded")["message"]
    assert (
        pod_info(
            {
                "metadata": {
                    "name": "kimi-prefill-1",
                    "labels": {"app.kubernetes.io/component": "prefill-worker", "app.kubernetes.io/instance": "kimi"},
                }
            }
        ).ordinal
        == 1
    )
    plain = parse_spec(tiny())
    pods, th = _pods(plain, build_children("kimi", "ns", plain, cfg, plan), plan)
    assert decide("kimi", plain, plan, st, assess(plain, plan, pods, th), 1, NOW).status["prefillWorkers"] is None


def test_the_pools_args_parse_with_the_real_router_and_worker_clis(tiny_plan):
    """What the operator renders is what the router and the worker accept (their own parsers; nothing is started):
    --prefill / --prefill-min-tokens, --pool and each pool's KV flags."""
    from expertmesh.router.server import add_arguments as router_arguments
    from expertmesh.worker.cli import build_parser  # the worker's parser (imports torch)

    _, cfg, plan = tiny_plan
    spec = parse_spec(tiny(prefillWorkers={"replicas": 2, "minPromptTokens": 64}, kv={"hostGiB": 1}))
    by = _by(build_children("kimi", "serving", spec, cfg, plan))
    p = argparse.ArgumentParser()
    router_arguments(p)
    r = p.parse_args(by[("Deployment", "kimi-router")]["spec"]["template"]["spec"]["containers"][0]["args"][1:])
    assert r.prefill.split(",") == [f"kimi-prefill-{i}.kimi-prefill.serving.svc:50061" for i in range(2)]
    assert r.prefill_min_tokens == 64 and r.attention == "kimi-attention-0.kimi-attention.serving.svc:50061"
    seq = -(-cfg.max_context // spec.kv.block_size)
    for sts, pool, blocks, host in (("kimi-prefill", "prefill", 2 * seq, 1.0), ("kimi-attention", "decode", seq, 0.0)):
        w = build_parser().parse_args(by[("StatefulSet", sts)]["spec"]["template"]["spec"]["containers"][0]["args"][1:])
        assert (w.role, w.pool, w.kv_blocks, w.kv_host_gib) == ("attention", pool, blocks, host)
