"""Malformed MoEDeployment specs, table-driven: each is refused with a message naming what is wrong
(the HTTP and gRPC cases: tests/router/test_bad_input.py)."""

import pytest

from expertmesh.operator.spec import GIB, SpecError, parse_spec, resolve_model


# ----------------------------------------------------------------------------------------------- MoEDeployment
def tiny_spec() -> dict:
    return {
        "model": {"preset": "tiny", "checkpoint": {"pvc": {"claimName": "weights", "path": "/ckpt"}}},
        "attentionWorkers": {"gpusPerPod": 0},
        "expertWorkers": {"replicas": 2, "gpusPerPod": 0, "reserveGiB": 0, "gpuMemoryGiB": 2**20 / GIB},
    }


SPEC_CASES = [
    pytest.param(
        {"expertWorkers": {"replicas": -1}},
        ["spec.expertWorkers.replicas", "greater than or equal to 1", "-1"],
        id="negative-expert-replicas",
    ),
    pytest.param({"attentionWorkers": {"replicas": 0}}, ["spec.attentionWorkers.replicas"], id="zero-attention"),
    pytest.param({"router": {"replicas": -2}}, ["spec.router.replicas"], id="negative-router-replicas"),
    pytest.param(
        {"expertWorkers": {"replicas": "two"}}, ["spec.expertWorkers.replicas", "valid integer"], id="replicas-string"
    ),
    pytest.param(
        {"model": {"preset": "huge", "checkpoint": {"uri": "/x"}}}, ["spec.model.preset", "'huge'"], id="unknown-preset"
    ),
    pytest.param(
        {"model": {"preset": "tiny", "config": {}, "checkpoint": {"uri": "/x"}}},
        ["spec.model", "exactly one of model.preset and model.config"],
        id="preset-and-config",
    ),
    pytest.param(
        {"model": {"config": {"hidden_size": -1}, "checkpoint": {"uri": "/x"}}},
        ["spec.model.config.hidden_size", "greater than 0"],
        id="bad-inline-config",
    ),
    pytest.param(
        {"thinking": {"low": 0, "high": 5, "max": 9}},
        ["spec.thinking.low", "greater than 0"],
        id="zero-thinking-budget",
    ),
    pytest.param(
        {"thinking": {"low": 9, "high": 5, "max": 20}},
        ["spec.thinking", "low <= high <= max"],
        id="thinking-out-of-order",
    ),
    pytest.param(
        {"thinking": {"low": 1, "high": 5}}, ["spec.thinking.max", "Field required"], id="thinking-missing-max"
    ),
    pytest.param(
        {"thinking": {"low": "lots", "high": 5, "max": 9}}, ["spec.thinking.low", "'lots'"], id="thinking-not-a-number"
    ),
    pytest.param(
        {"kv": {"maxContext": 10**6}}, ["spec.kv.maxContext=1000000", "max_context=4096"], id="context-beyond-model"
    ),
    pytest.param(
        {"kv": {"maxContext": 10**9}}, ["spec.kv.maxContext", "less than or equal to"], id="context-beyond-the-schema"
    ),
    pytest.param({"kv": {"blockSize": 0}}, ["spec.kv.blockSize"], id="zero-block-size"),
    pytest.param(
        {"expertWorkers": {"reserveGiB": 5.0, "gpuMemoryGiB": 4.0}},
        ["reserveGiB=5.0 must be below"],
        id="reserve-above-memory",
    ),
    pytest.param(
        {"image": {"pullPolicy": "Sometimes"}}, ["spec.image.pullPolicy", "'Sometimes'"], id="bad-pull-policy"
    ),
    pytest.param({"expertWorker": {}}, ["spec.expertWorker", "Extra inputs are not permitted"], id="typo-field"),
]


@pytest.mark.parametrize("patch, needles", SPEC_CASES)
def test_spec_bad_input(patch, needles):
    spec = tiny_spec()
    for k, v in patch.items():
        spec[k] = v if k == "model" else {**spec.get(k, {}), **v}
    with pytest.raises(SpecError) as e:
        resolve_model(parse_spec(spec))
    missing = [n for n in needles if n not in str(e.value)]
    assert not missing, f"{str(e.value)!r} does not name {missing}"
