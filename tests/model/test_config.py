import pytest
from pydantic import ValidationError

from expertmesh.chat.thinking import default_budgets
from expertmesh.model.config import ModelConfig, preset
from expertmesh.model.presets import interleaved_layer_types


def test_full_preset_reproduces_published_totals():
    cfg = preset("full-2.8t")
    assert cfg.n_layers == 93 and cfg.n_kda_layers == 69 and cfg.n_dsa_layers == 24
    # Kimi K3's published shape: 896 routed experts top-16 on a 3,584 latent, 2 shared, hidden 7168, SiTU,
    # attention residuals, KDA 96 heads x 128 with a full-rank output gate and gate lower bound -5
    assert (
        cfg.model_type,
        cfg.hidden_size,
        cfg.moe.n_routed_experts,
        cfg.moe.top_k,
        cfg.moe.n_shared_experts,
        cfg.moe.latent_size,
        cfg.moe.n_group,
    ) == ("kimi_k3", 7168, 896, 16, 2, 3584, 1)
    assert (cfg.activation.kind, cfg.activation.beta, cfg.activation.linear_beta) == ("situ", 4.0, 25.0)
    assert cfg.attn_res_block_size and (cfg.kda.n_heads, cfg.kda.head_dim) == (96, 128)
    assert cfg.kda.output_gate == "full_rank" and cfg.kda.gate_lower_bound == -5.0
    assert cfg.mla.rope == "none" and cfg.mla.gated_output and cfg.mla.kv_lora_rank == 512
    assert abs(cfg.total_params / 2.8e12 - 1) < 0.02
    assert abs(cfg.active_params / 104e9 - 1) < 0.02
    assert cfg.indexer.index_topk == 2048
    assert cfg.max_context == 1_048_576
    # ~1.5 TB of weights once the experts are MXFP4 (docs/architecture.md)
    assert 1.3e12 < cfg.checkpoint_bytes < 1.7e12


def test_expert_bytes_are_4_25_bits_per_weight():
    for name in ("tiny", "small", "full-2.8t"):
        cfg = preset(name)
        assert cfg.expert_bytes_mxfp4 * 8 / cfg.expert_params == pytest.approx(4.25)


def test_param_count_matches_the_built_model():
    import torch

    from expertmesh.model.transformer import Transformer

    cfg = preset("tiny")
    with torch.device("meta"):
        model = Transformer(cfg)
    n_float = sum(p.numel() for p in model.parameters())
    n_expert_weights = sum(
        2 * layer.moe.experts.gate_up_blocks.numel() + 2 * layer.moe.experts.down_blocks.numel()
        for layer in model.layers
        if layer.is_moe
    )
    assert n_float + n_expert_weights == cfg.total_params


def test_kv_and_state_arithmetic():
    cfg = preset("full-2.8t")
    assert cfg.kv_bytes_per_token("kda") == 0
    assert cfg.kv_bytes_per_token("dsa") == 2 * (512 + 64 + 128)
    assert cfg.kv_bytes_per_token_all_layers() == 24 * cfg.kv_bytes_per_token("dsa")
    per_layer_state = 96 * 128 * 128 * 4 + 2 * 3 * 96 * 128 * 3
    assert cfg.recurrent_state_bytes_per_sequence == 69 * per_layer_state


def test_interleaved_pattern():
    types = interleaved_layer_types(93, 24)
    assert types.count("dsa") == 24 and types[-1] == "dsa"
    assert interleaved_layer_types(8, 2) == ("kda", "kda", "kda", "dsa", "kda", "kda", "kda", "dsa")


def test_tiny_exercises_every_mechanism():
    cfg = preset("tiny")
    assert {"kda", "dsa"} <= set(cfg.layer_types)
    assert cfg.moe.n_routed_experts >= 16 and cfg.moe.n_shared_experts >= 1
    assert cfg.indexer.index_topk <= 16
    budgets = default_budgets(cfg.name)  # serving policy, beside the presets: tiers of a few dozen tokens
    assert budgets.low < budgets.high < budgets.max <= 64


def _tiny_dict(**changes):
    d = preset("tiny").model_dump()
    for path, value in changes.items():
        node = d
        keys = path.split("__")
        for k in keys[:-1]:
            node = node[k]
        node[keys[-1]] = value
    return d


@pytest.mark.parametrize(
    "changes, needle",
    [
        ({"moe__top_k": 17}, "moe.top_k=17 exceeds moe.n_routed_experts=16"),
        ({"hidden_size": 65}, "hidden_size=65 must be a multiple of the MXFP4 block size 32"),
        ({"layer_types": ["kda", "mamba"]}, "layer_types"),
        ({"moe__n_group": 3}, "not divisible by moe.n_group=3"),
        ({"moe__topk_group": 5}, "moe.topk_group=5 exceeds moe.n_group=4"),
        ({"moe__top_k": 9}, "exceeds the 8 experts reachable"),
        ({"moe__expert_intermediate_size": 40}, "moe.expert_intermediate_size=40"),
        ({"first_k_dense": 9}, "first_k_dense=9 exceeds the 4 layers"),
        ({"mla__qk_rope_head_dim": 7}, "mla.qk_rope_head_dim=7 must be even"),
        ({"vocab_size": 0}, "vocab_size"),
        ({"surprise": 1}, "surprise"),
    ],
)
def test_invalid_configs_name_the_field(changes, needle):
    with pytest.raises(ValidationError) as err:
        ModelConfig.model_validate(_tiny_dict(**changes))
    assert needle in str(err.value)


def test_unknown_preset():
    with pytest.raises(ValueError, match="unknown preset 'huge'"):
        preset("huge")


def test_config_json_round_trip(tmp_path):
    from expertmesh.model.config import load_config

    cfg = preset("small")
    (tmp_path / "config.json").write_text(cfg.model_dump_json())
    assert load_config(tmp_path / "config.json") == cfg
