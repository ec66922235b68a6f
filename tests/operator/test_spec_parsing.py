"""The MoEDeployment spec: its defaults, the errors that name the bad field, and the model it resolves to."""

from __future__ import annotations

import pytest
from support.relatives import DEEPSEEK_V32
from support.tiny_deployment import tiny

from expertmesh.model.config import preset
from expertmesh.operator.spec import SpecError, parse_spec, resolve_model


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
