"""The attention workers' disk tier as the operator renders it: a private folder inside the volume, and the files'
key from the deployment's salt Secret (operator/router_salt.py), which the operator creates once a disk tier is
configured, even with one router."""

from __future__ import annotations

import base64
import json

import pytest
from support.kopf_cluster import eventually, operator, tiny_spec
from support.tiny_deployment import tiny

from expertmesh.operator.children import build_children
from expertmesh.operator.router_salt import shares_salt
from expertmesh.operator.spec import parse_spec

KEY_DIR = "/etc/expertmesh-kv-disk-key"


def _opts(args: list[str]) -> dict:
    return dict(zip(args[3::2], args[4::2]))


def _pods(spec, cfg, plan) -> dict:
    return {
        c["metadata"]["name"]: c["spec"]["template"]["spec"]
        for c in build_children("kimi", "serving", spec, cfg, plan)
        if c["kind"] in ("StatefulSet", "Deployment")
    }


@pytest.mark.parametrize("disk", [{"sizeGiB": 10}, {"sizeGiB": 10, "pvc": {}}, {"sizeGiB": 10, "hostPath": "/x"}])
def test_an_attention_pod_with_a_disk_tier_mounts_the_salt_secret_as_its_disk_key(tiny_plan, disk):
    """spec.kv.disk: the attention worker runs with --kv-disk-dir a folder inside its volume (the worker makes it
    private: the volume's root is not) and --kv-disk-key-file the salt Secret's file, mounted read-only, 0400; one
    router still gets no salt flag; the expert and router pods mount no key."""
    _, cfg, plan = tiny_plan
    spec = parse_spec(tiny(kv={"disk": disk}))
    assert shares_salt(spec) and spec.router.replicas == 1
    pods = _pods(spec, cfg, plan)
    att = pods["kimi-attention"]
    opt = _opts(att["containers"][0]["args"])
    assert opt["--kv-disk-dir"] == "/var/cache/expertmesh-kv/tier" and opt["--kv-disk-gib"] == "10"
    assert opt["--kv-disk-key-file"] == f"{KEY_DIR}/salt"
    vols = {v["name"]: v for v in att["volumes"]}
    mounts = {m["name"]: m for m in att["containers"][0]["volumeMounts"]}
    assert vols["kv-disk-key"]["secret"] == {"secretName": "kimi-router-salt", "defaultMode": 0o400}
    assert mounts["kv-disk-key"] == {"name": "kv-disk-key", "mountPath": KEY_DIR, "readOnly": True}
    assert mounts["kv-disk"]["mountPath"] == "/var/cache/expertmesh-kv"
    assert "--prefix-salt-file" not in pods["kimi-router"]["containers"][0]["args"]
    for name in ("kimi-router", "kimi-expert"):
        assert "kv-disk-key" not in json.dumps(pods[name])


def test_no_disk_tier_no_key_and_a_decode_pool_gets_none(tiny_plan):
    """Without spec.kv.disk: no key flag or mount (and no Secret with one router). With a prefill pool the tiers
    are the prefill pool's: the decode pool's pods mount no key."""
    _, cfg, plan = tiny_plan
    plain = parse_spec(tiny())
    assert not shares_salt(plain)
    att = _pods(plain, cfg, plan)["kimi-attention"]
    assert "--kv-disk-key-file" not in att["containers"][0]["args"] and "kv-disk-key" not in json.dumps(att)
    split = parse_spec(tiny(prefillWorkers={"replicas": 1, "gpusPerPod": 0}, kv={"disk": {"sizeGiB": 10}}))
    pods = _pods(split, cfg, plan)
    assert "--kv-disk-key-file" in pods["kimi-prefill"]["containers"][0]["args"]
    assert "kv-disk-key" not in json.dumps(pods["kimi-attention"])


@pytest.mark.asyncio
@pytest.mark.timeout(60)
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
async def test_the_operator_creates_the_salt_secret_for_a_disk_tier_with_one_router():
    """One router and spec.kv.disk: the operator creates N-router-salt (32 random bytes, owned by the resource)
    before the attention pods that read it, and keeps it across reconciles."""
    async with operator() as c:
        await c.create_moe("kimi", {**tiny_spec(), "kv": {"disk": {"sizeGiB": 1}}})
        await eventually(lambda: c.get("apps/v1/statefulsets", "kimi-attention") is not None, 30, "attention pods")
        secret = c.get("v1/secrets", "kimi-router-salt")  # made before the attention pods that mount it
        assert secret is not None and len(base64.b64decode(secret["data"]["salt"])) == 32
        assert [r["name"] for r in secret["metadata"]["ownerReferences"]] == ["kimi"]
        att = c.get("apps/v1/statefulsets", "kimi-attention")["spec"]["template"]["spec"]["containers"][0]
        assert "--kv-disk-key-file" in att["args"]
        await c.patch_moe("kimi", {"spec": {"kv": {"disk": {"sizeGiB": 2}}}})
        await eventually(lambda: c.status("kimi").get("observedGeneration") == 2, 30, "generation 2 handled")
        assert c.get("v1/secrets", "kimi-router-salt")["data"] == secret["data"]
