"""The pure child manifests a MoEDeployment renders: names, labels, pods, secrets, the plan's ConfigMap, the
NetworkPolicies and the KV tiers."""

from __future__ import annotations

import argparse
import base64
import json
import shlex

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID
from support.tiny_deployment import reachable, tiny

from expertmesh.operator.children import build_children, revision
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
from expertmesh.operator.placement_policy import plan_for
from expertmesh.operator.pod_commands import router_serving_args
from expertmesh.operator.pod_parts import fetch_container, pod_spec, pod_volumes
from expertmesh.operator.pods import PodInfo, pod_info
from expertmesh.operator.router_salt import router_salt_secret
from expertmesh.operator.spec import SpecError, parse_spec, resolve_model
from expertmesh.operator.status import condition, weights_condition, with_weights
from expertmesh.operator.worker_tls import worker_tls_hosts, worker_tls_secret
from expertmesh.placement.plan import PlacementPlan
from expertmesh.runtime.tls import pki_pems


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
    assert mounts == {"/etc/expertmesh": "plan", "/mnt/checkpoint": "checkpoint", tls: "worker-tls", "/tmp": "tmp"}
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
    allowed = reachable(children, "kimi-")
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
        "/var/cache/expertmesh-kv/tier",
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
