"""`expertmesh plan --slo` (operator/forecast.py over expertmesh/forecast/): a layout for full-2.8t on H200 and B300
nodes, written as a MoEDeployment the operator's spec accepts; the SLO's refusals; planning stays torch-free."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from expertmesh.entry.cli import main
from expertmesh.operator.forecast import parse_slo
from expertmesh.operator.spec import parse_spec

EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples"


@pytest.mark.parametrize("gpu", ["h200", "b300"])
def test_plan_slo_proposes_a_layout_and_writes_a_deployment(tmp_path, capsys, gpu):
    out = tmp_path / f"{gpu}.yaml"
    assert main(["plan", "--slo", "ttft=5,tpot=50", "--gpu", gpu, "--write-deployment", str(out)]) == 0
    text = capsys.readouterr().out
    assert "full-2.8t on" in text and "tpotMilliseconds" in text
    manifest = yaml.safe_load(out.read_text())
    assert manifest["kind"] == "MoEDeployment" and "expertmesh.dev/forecast" in manifest["metadata"]["annotations"]
    spec = parse_spec(manifest["spec"])
    assert spec.expert_workers.replicas >= 1 and spec.attention_workers.replicas >= 1


def test_an_slo_nothing_meets_is_refused_naming_the_flag(capsys):
    assert main(["plan", "--slo", "ttft=0.001,tpot=0.1", "--gpu", "h200"]) == 2
    assert "--slo" in capsys.readouterr().err


@pytest.mark.parametrize("text", ["ttft=2", "tpot=50", "ttft=x,tpot=50", "ttft=-1,tpot=50", "latency=3"])
def test_bad_slo_text_is_refused(text):
    with pytest.raises(ValueError, match="--slo"):
        parse_slo(text)


def test_plan_without_pods_or_slo_names_the_flag(capsys):
    assert main(["plan"]) == 2
    assert "--expert-pods" in capsys.readouterr().err


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_the_examples_are_accepted_and_annotated(path):
    manifest = yaml.safe_load(path.read_text())
    parse_spec(manifest["spec"])
    assert "expertmesh.dev/forecast" in manifest["metadata"]["annotations"]


def test_the_forecast_imports_without_torch():
    code = "import sys, expertmesh.operator.forecast, expertmesh.forecast.validation; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, env={"PYTHONSAFEPATH": "1"})
