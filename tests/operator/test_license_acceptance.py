"""Licences accepted before weights move: the decision as a pure function (operator/model_license.py), and the
operator (Kopf for real against kmock) fetching and deploying nothing for a deployment whose weights' licence is not
accepted — its status says which licence — until the spec accepts it."""

from __future__ import annotations

import asyncio

import pytest
from support.kopf_cluster import NS, eventually, operator, tiny_spec
from support.tiny_deployment import tiny

from expertmesh.operator.model_license import license_verdict, published_license
from expertmesh.operator.spec import SpecError, parse_spec

KIMI = "hf://moonshotai/Kimi-K3@main"


def _model(checkpoint: dict, license: dict | None = None):
    model = {"preset": "tiny", "checkpoint": checkpoint}
    if license is not None:
        model["license"] = license
    return parse_spec(tiny(model=model)).model


def test_known_published_sources_declare_their_licence():
    assert published_license(KIMI) == "modified-mit"
    assert published_license("hf://MoonshotAI/kimi-k2-instruct") == "modified-mit"  # Hub ids: any case
    for other in ("hf://org/tiny@v1", "https://models.example/kimi", "s3://b/moonshotai/Kimi-K3", "/opt/ck", None):
        assert published_license(other) is None


@pytest.mark.parametrize(
    "checkpoint, license, verdict",
    [
        ({"uri": "hf://org/tiny"}, None, None),  # no licence known or declared: nothing to accept
        ({"pvc": {"claimName": "w"}}, None, None),
        ({"uri": KIMI}, None, (False, "LicenseNotAccepted", "'modified-mit'")),
        ({"uri": KIMI}, {"name": "modified-mit"}, (False, "LicenseNotAccepted", "'modified-mit'")),
        ({"uri": KIMI}, {"name": "modified-mit", "accepted": False}, (False, "LicenseNotAccepted", "modified-mit")),
        ({"uri": KIMI}, {"name": "Modified-MIT", "accepted": True}, (True, "LicenseAccepted", "'Modified-MIT'")),
        ({"uri": KIMI}, {"name": "apache-2.0", "accepted": True}, (False, "LicenseMismatch", "'modified-mit'")),
        # a licence the spec declares binds whatever the source
        ({"pvc": {"claimName": "w"}}, {"name": "llama3"}, (False, "LicenseNotAccepted", "'llama3'")),
        ({"uri": "https://x/ck"}, {"name": "llama3", "accepted": True}, (True, "LicenseAccepted", "'llama3'")),
    ],
)
def test_the_decision(checkpoint, license, verdict):
    got = license_verdict(_model(checkpoint, license))
    if verdict is None:
        assert got is None
        return
    accepted, reason, named = verdict
    assert (got.accepted, got.reason) == (accepted, reason)
    assert named in got.message
    if not accepted:
        assert got.message.startswith("spec.model.license")


def test_the_licence_field_is_checked():
    with pytest.raises(SpecError, match=r"spec\.model\.license\.name: Field required"):
        parse_spec(tiny(model={"preset": "tiny", "checkpoint": {"uri": KIMI}, "license": {"accepted": True}}))
    with pytest.raises(SpecError, match=r"spec\.model\.license\.name: '--x' must be a licence name"):
        parse_spec(tiny(model={"preset": "tiny", "checkpoint": {"uri": KIMI}, "license": {"name": "--x"}}))
    with pytest.raises(SpecError, match=r"spec\.model\.license\.acceptd"):
        parse_spec(tiny(model={"preset": "tiny", "checkpoint": {"uri": KIMI}, "license": {"name": "a", "acceptd": 1}}))


# ------------------------------------------------------------------------------------------------ Kopf, for real
@pytest.mark.asyncio
@pytest.mark.timeout(60)
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
async def test_a_deployment_without_licence_acceptance_fetches_nothing_and_says_why():
    spec = {**tiny_spec(), "model": {"preset": "tiny", "checkpoint": {"uri": KIMI}}}
    async with operator() as c:
        await c.create_moe("kimi", spec)
        await eventually(lambda: c.status("kimi").get("phase") == "Failed", what="refused")
        cond = c.condition("kimi", "LicenseAccepted")
        assert (cond["status"], cond["reason"]) == ("False", "LicenseNotAccepted")
        assert "hf://moonshotai/Kimi-K3@main" in cond["message"] and "'modified-mit'" in cond["message"]
        assert "{name: modified-mit, accepted: true}" in cond["message"]
        assert c.condition("kimi", "PlacementReady")["reason"] == "LicenseNotAccepted"
        # nothing was created: no fetch init container, no pod template, no Secret, no plan
        await asyncio.sleep(1.0)  # a retrying handler would write within this
        written = {
            path for _, path in c.emu.writes if not any(x in path for x in ("/moedeployments", "/events", "kopf"))
        }
        assert written == set(), written
        assert c.get("apps/v1/statefulsets", "kimi-attention") is None

        # declaring the licence without accepting it is not enough
        await c.patch_moe("kimi", {"spec": {"model": {"license": {"name": "modified-mit"}}}})
        await eventually(lambda: c.status("kimi").get("observedGeneration") == 2, what="generation 2 handled")
        assert c.condition("kimi", "LicenseAccepted")["status"] == "False"
        assert c.get("apps/v1/statefulsets", "kimi-attention") is None

        # accepted: the operator deploys, the pods fetch the weights, the condition records the acceptance
        await c.patch_moe("kimi", {"spec": {"model": {"license": {"name": "modified-mit", "accepted": True}}}})
        await eventually(
            lambda: c.status("kimi").get("phase") == "Deploying", what="Deploying once accepted", timeout=30
        )
        cond = c.condition("kimi", "LicenseAccepted")
        assert (cond["status"], cond["reason"]) == ("True", "LicenseAccepted") and cond["observedGeneration"] == 3
        pod = c.get("apps/v1/statefulsets", "kimi-attention")["spec"]["template"]["spec"]
        assert [x["name"] for x in pod["initContainers"]] == ["fetch"]
        assert KIMI in pod["initContainers"][0]["args"]
        assert c.get("apps/v1/deployments", "kimi-router")["metadata"]["namespace"] == NS
