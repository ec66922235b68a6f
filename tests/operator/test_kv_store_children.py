"""spec.kv.store: mooncake (#53, item 3) as the operator renders it: Mooncake's master and store process as a
Deployment + Service of their own, reached only by this deployment's attention pods (NetworkPolicy); every attention
pod its client (--kv-store-* flags its own parser takes, the salt Secret mounted as the store key), the router told
(--kv-store); without it nothing of the store is rendered and an earlier store's objects are listed for deletion.
The rendered store pod's commands run here for real: the master and the store process come up and take a put."""

from __future__ import annotations

import subprocess
import sys

import pytest
from support.tiny_deployment import by_kind_and_name, tiny

from expertmesh.operator.children import absent_children, build_children
from expertmesh.operator.kv_store import KV_STORE_KEY_DIR, kv_store_name
from expertmesh.operator.naming import attention_name, router_name, selector_labels
from expertmesh.operator.placement_policy import plan_for
from expertmesh.operator.router_salt import shares_salt
from expertmesh.operator.spec import SpecError, parse_spec, resolve_model

STORE = {"kv": {"store": "mooncake", "storeGiB": 0.25}, "prefillWorkers": {"replicas": 1}}


def render(over: dict):
    spec = parse_spec(tiny(**over))
    cfg = resolve_model(spec)
    return spec, by_kind_and_name(build_children("kimi", "serving", spec, cfg, plan_for(spec, cfg)))


def _parser(command: str):
    from expertmesh.entry.cli import build_parser

    top = build_parser()
    sub = next(a for a in top._actions if a.__class__.__name__ == "_SubParsersAction")
    return top, sub.choices[command]


def test_the_store_is_its_own_deployment_and_service_reached_by_the_attention_pods_only():
    spec, children = render(STORE)
    name = kv_store_name("kimi")
    deployment = children[("Deployment", name)]
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"] == {"type": "Recreate"}
    pod = deployment["spec"]["template"]["spec"]
    roles = [c["args"][0] for c in pod["containers"]]
    assert roles == ["master", "store"]
    assert all(c["securityContext"]["allowPrivilegeEscalation"] is False for c in pod["containers"])
    assert pod["automountServiceAccountToken"] is False
    store = pod["containers"][1]
    assert store["args"][store["args"].index("--store-bytes") + 1] == str(2**28)
    assert {p["port"] for p in children[("Service", name)]["spec"]["ports"]} == {50051, 8080}
    policy = children[("NetworkPolicy", name)]["spec"]
    assert policy["podSelector"]["matchLabels"] == selector_labels("kimi", "kv-store")
    admitted = [p["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for p in policy["ingress"][0]["from"]]
    assert sorted(admitted) == ["attention-worker", "prefill-worker"]  # any port: the transfer engine's are ephemeral
    assert shares_salt(spec)  # the Secret the store's objects are authenticated with


def test_every_attention_pod_is_a_client_and_the_router_is_told():
    _, children = render(STORE)
    from expertmesh.worker.cli import build_parser as worker_parser  # the worker parses its own flags

    top, _ = _parser("router")
    for sts in [s for (kind, n), s in children.items() if kind == "StatefulSet" and "expert" not in n]:
        pod = sts["spec"]["template"]["spec"]
        args = pod["containers"][0]["args"]
        at = args.index("--kv-store-master")
        assert args[at + 1] == "kimi-kv-store.serving.svc:50051"
        assert args[args.index("--kv-store-key-file") + 1] == f"{KV_STORE_KEY_DIR}/salt"
        assert args[args.index("--kv-store-deployment") + 1] == "serving/kimi"
        mounts = {m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
        assert KV_STORE_KEY_DIR in mounts
        assert args[0] == "worker"
        parsed = worker_parser().parse_args([a.replace("$(POD_NAME)", "attention-0") for a in args[1:]])
        assert parsed.kv_store_master == "kimi-kv-store.serving.svc:50051"
    router = children[("Deployment", router_name("kimi"))]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert router[router.index("--kv-store") + 1] == "mooncake"
    assert top.parse_args(router).kv_store == "mooncake"


def test_without_the_store_nothing_is_rendered_and_an_earlier_one_is_deleted():
    spec, children = render({})
    assert not [k for k in children if "kv-store" in k[1]]
    args = children[("StatefulSet", attention_name("kimi"))]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--kv-store-master" not in args
    assert ("apps/v1", "Deployment", kv_store_name("kimi")) in absent_children("kimi", spec, other_kinds=True)
    with pytest.raises(SpecError, match="storeGiB|store_gib"):
        parse_spec(tiny(kv={"store": "mooncake", "storeGiB": 0}))
    with pytest.raises(SpecError, match="store"):
        parse_spec(tiny(kv={"store": "redis"}))


def ready(proc) -> bool:
    """The wrapper's READY line, after the binary's own output (the same stream); False at its end."""
    for line in proc.stdout:
        if line.startswith(b"READY"):
            return True
    return False


def test_the_rendered_store_pod_runs(tmp_path):
    pytest.importorskip("mooncake.store", reason="the Mooncake wheel (mooncake-transfer-engine-non-cuda)")
    from expertmesh.entry.cluster import free_port
    from expertmesh.worker.kv_store import connect_mooncake

    _, children = render(STORE)
    pod = children[("Deployment", kv_store_name("kimi"))]["spec"]["template"]["spec"]
    ports = ",".join(str(free_port()) for _ in range(4))  # the pod's own ports may be taken on this machine
    procs = []
    try:
        for c in pod["containers"]:
            args = [a.replace("$(POD_IP)", "127.0.0.1") for a in c["args"]]
            args[args.index("--ports") + 1] = ports
            assert c["command"][:3] == ["python", "-m", "expertmesh.entry.kv_store_service"]
            procs.append(subprocess.Popen([sys.executable, "-m", *c["command"][2:], *args], stdout=subprocess.PIPE))
            assert ready(procs[-1]), f"{c['name']} never printed READY"
        rpc, metadata = ports.split(",")[:2]
        client = connect_mooncake(f"127.0.0.1:{rpc}", f"http://127.0.0.1:{metadata}/metadata", "127.0.0.1")
        assert client.upsert("expertmesh-test/probe", b"x" * 1000) == 0
        assert client.get_size("expertmesh-test/probe") == 1000
        client.close()
    finally:
        for p in procs[::-1]:
            p.terminate()
            p.wait(10)
