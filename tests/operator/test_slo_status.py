"""spec.slo (#55): a MoEDeployment states TTFT / TPOT on a GPU type; the operator writes the forecast of its layout
to status.predicted, says in condition SLOAttainable whether it meets the SLO (naming the bound when not), and
derives an autoscaled pool's HPA target from the forecast when the spec gives none. Bad SLO fields are refused
naming the field — by the spec parser and, for real, by Kopf against kmock."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from support.kopf_cluster import eventually, operator, tiny_spec
from support.tiny_deployment import tiny

from expertmesh.operator.forecast import predicted_status, spec_layout
from expertmesh.operator.spec import SpecError, parse_spec, resolve_model

SLO = {"ttftSeconds": 2, "tpotMilliseconds": 50, "gpu": "h100", "inputTokens": 512, "outputTokens": 64}


def test_the_forecast_of_a_specs_layout_and_its_condition():
    spec = parse_spec(tiny(slo=SLO, attentionWorkers={"replicas": 2, "gpusPerPod": 0}))
    assert spec_layout(spec).gpus == 2 and spec_layout(spec).dp_attention
    predicted, (status, reason, message) = predicted_status(spec, resolve_model(spec))
    assert (status, reason) == ("True", "ForecastMeetsSLO") and predicted["meetsSlo"]
    assert predicted["gpu"] == "h100" and predicted["sequences"] >= 1 and predicted["decodeTokensPerSecond"] > 0
    assert predicted["tpotMilliseconds"] <= 50 and set(predicted["bound"]) == {"prefill", "decode"}

    tight = parse_spec(tiny(slo={**SLO, "tpotMilliseconds": 0.001}))
    predicted, (status, reason, message) = predicted_status(tight, resolve_model(tight))
    assert (status, reason) == ("False", "ForecastMissesSLO") and not predicted["meetsSlo"]
    assert "spec.slo.tpotMilliseconds" in message and f"decode bound by {predicted['bound']['decode']}" in message


@pytest.mark.parametrize(
    ("slo", "field"),
    [
        ({**SLO, "gpu": "v100"}, "spec.slo.gpu"),
        ({**SLO, "tpotMilliseconds": 0}, "spec.slo.tpotMilliseconds"),
        ({k: v for k, v in SLO.items() if k != "ttftSeconds"}, "spec.slo.ttftSeconds"),
        ({**SLO, "inputTokens": "many"}, "spec.slo.inputTokens"),
        ({**SLO, "weights": "fp6"}, "spec.slo.weights"),
        ({**SLO, "latency": 3}, "spec.slo.latency"),
    ],
)
def test_bad_slo_fields_are_refused_naming_them(slo, field):
    with pytest.raises(SpecError, match=field.replace(".", r"\.")):
        parse_spec(tiny(slo=slo))


def test_autoscale_targets_come_from_the_forecast_unless_given():
    auto = {"replicas": 1, "gpusPerPod": 0, "autoscale": {"minReplicas": 1, "maxReplicas": 4, "metric": "X"}}
    for metric in ("requests_waiting", "prefill_tokens_waiting", "kv_utilization"):
        auto["autoscale"]["metric"] = metric
        target = parse_spec(tiny(slo=SLO, attentionWorkers=auto)).attention_workers.autoscale.target
        assert target is not None and target > 0 and (metric != "kv_utilization" or target <= 1)
    given = {**auto, "autoscale": {**auto["autoscale"], "target": 7}}
    given["autoscale"]["metric"] = "requests_waiting"
    assert parse_spec(tiny(slo=SLO, attentionWorkers=given)).attention_workers.autoscale.target == 7
    with pytest.raises(SpecError, match=r"spec\.attentionWorkers\.autoscale\.target: required without spec\.slo"):
        parse_spec(tiny(attentionWorkers=auto))


# ------------------------------------------------------------------------------------------------ Kopf, for real
@pytest.mark.asyncio
@pytest.mark.timeout(60)
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
async def test_the_operator_writes_the_forecast_and_warns_when_the_slo_cannot_be_met():
    spec = {**tiny_spec(), "slo": SLO}
    async with operator() as c:
        await c.create_moe("fast", spec)
        await eventually(lambda: c.status("fast").get("predicted") is not None, what="status.predicted")
        predicted = c.status("fast")["predicted"]
        assert predicted["gpu"] == "h100" and predicted["meetsSlo"] and predicted["decodeTokensPerSecond"] > 0
        assert c.condition("fast", "SLOAttainable")["status"] == "True"

        # an SLO no layout of this size meets: the deployment still deploys, the condition says why
        await c.patch_moe("fast", {"spec": {"slo": {"tpotMilliseconds": 0.001}}})
        await eventually(lambda: c.condition("fast", "SLOAttainable")["status"] == "False", what="SLO missed")
        cond = c.condition("fast", "SLOAttainable")
        assert cond["reason"] == "ForecastMissesSLO" and "decode bound by" in cond["message"]
        assert cond["observedGeneration"] == 2 and c.status("fast")["predicted"]["meetsSlo"] is False
        assert c.status("fast")["phase"] != "Failed"

        # without an SLO: neither
        await c.patch_moe("fast", {"spec": {"slo": None}})
        await eventually(lambda: c.status("fast").get("predicted") is None, what="status.predicted dropped")
        assert c.condition("fast", "SLOAttainable") == {}

        # a bad SLO field: refused (permanently) naming it
        await c.create_moe("slow", {**tiny_spec(), "slo": {**SLO, "gpu": "v100"}})
        await eventually(lambda: c.status("slow").get("phase") == "Failed", what="refused")
        assert "spec.slo.gpu" in c.condition("slow", "PlacementReady")["message"]


EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "docs" / "examples").glob("*.yaml"))


@pytest.mark.asyncio
@pytest.mark.timeout(120)
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
async def test_the_examples_are_deployed_by_the_operator_with_their_forecast():
    """docs/examples (Kimi K3 and K3+DSA on H200 and B300): each accepted by Kopf against kmock — planned and
    deploying, weights fetched by an init container, the SLO met by the forecast its annotation records."""
    assert {p.stem for p in EXAMPLES} >= {"kimi-k3-h200", "kimi-k3-b300", "k3-dsa-h200", "k3-dsa-b300"}
    manifests = [yaml.safe_load(p.read_text()) for p in EXAMPLES]
    async with operator() as c:
        for m in manifests:
            await c.create_moe(m["metadata"]["name"], m["spec"])
        for m in manifests:
            name = m["metadata"]["name"]
            await eventually(
                lambda n=name: c.status(n).get("phase") == "Deploying", what=f"{name} Deploying", timeout=60
            )
            annotated = json.loads(m["metadata"]["annotations"]["expertmesh.dev/forecast"])
            predicted = c.status(name)["predicted"]
            assert c.condition(name, "SLOAttainable")["status"] == "True" and predicted["meetsSlo"]
            assert predicted["tpotMilliseconds"] == annotated["tpotMilliseconds"]
            pod = c.get("apps/v1/statefulsets", f"{name}-attention")["spec"]["template"]["spec"]
            assert [x["name"] for x in pod["initContainers"]] == ["fetch"]
            hpa = c.get("autoscaling/v2/horizontalpodautoscalers", f"{name}-attention")
            value = hpa["spec"]["metrics"][0]["external"]["target"]["value"]  # a quantity: "516m"
            assert 0 < (float(value[:-1]) / 1000 if value.endswith("m") else float(value)) <= 1
