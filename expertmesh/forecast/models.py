"""The models a forecast knows by name, and any config.json: ModelConfigs, never tensors.

`full-2.8t` is the brief's K3 + DSA preset; `kimi-k3` is the same model with its 24 full-attention layers plain
gated MLA, as Kimi K3 ships; `deepseek-v3` and `kimi-k2` are their published Hugging Face config.json values
(deepseek-ai/DeepSeek-V3 and moonshotai/Kimi-K2-Instruct), mapped as DeepSeek-V3.2's layout with every layer full
MLA (no indexer): the forecast needs shapes, not the loader's tensor names. A path names a config.json (or a
checkpoint directory holding one): this project's format or a published relative's.
"""

from __future__ import annotations

import json
from pathlib import Path

from expertmesh.checkpoint.hf_config import MODEL_TYPES, config_from_hf
from expertmesh.model.config import ModelConfig, load_config, preset

# deepseek-ai/DeepSeek-V3 config.json (the fields the arithmetic reads; R1 has the same shapes)
DEEPSEEK_V3 = {
    "model_type": "deepseek_v3",
    "vocab_size": 129280,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_nextn_predict_layers": 1,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "n_shared_experts": 1,
    "n_routed_experts": 256,
    "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "qk_nope_head_dim": 128,
    "topk_method": "noaux_tc",
    "n_group": 8,
    "topk_group": 4,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "norm_topk_prob": True,
    "scoring_func": "sigmoid",
    "max_position_embeddings": 163840,
    "rope_theta": 10000,
    "hidden_act": "silu",
}
# moonshotai/Kimi-K2-Instruct config.json: DeepSeek-V3's layout with 64 heads, 384 experts ungrouped, one dense layer
KIMI_K2 = {
    **DEEPSEEK_V3,
    "model_type": "kimi_k2",
    "vocab_size": 163840,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "n_routed_experts": 384,
    "routed_scaling_factor": 2.827,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "num_nextn_predict_layers": 0,
    "max_position_embeddings": 131072,
    "rope_theta": 50000.0,
}
PUBLISHED = {"deepseek-v3": DEEPSEEK_V3, "kimi-k2": KIMI_K2}
MODEL_NAMES = ("full-2.8t", "kimi-k3", *PUBLISHED)


def from_hf(raw: dict, name: str) -> ModelConfig:
    """A published config.json → ModelConfig; DeepSeek-V3-layout families (deepseek_v3, kimi_k2) as DeepSeek-V3.2's
    with every layer full MLA (their attention without the indexer)."""
    model_type = raw.get("model_type")
    if model_type in ("deepseek_v3", "kimi_k2"):
        # the indexer fields are placeholders: no layer is DSA
        mla_only = {"index_head_dim": 128, "index_n_heads": 64, **raw, "model_type": "deepseek_v32"}
        mapped = config_from_hf(mla_only, set(), name)
        return mapped.model_copy(update={"layer_types": ("mla",) * mapped.n_layers})
    return config_from_hf(raw, set(), name)


def kimi_k3() -> ModelConfig:
    """Kimi K3 as published: the full-2.8t preset with plain gated MLA in place of DSA."""
    cfg = preset("full-2.8t")
    types = tuple("mla" if t == "dsa" else t for t in cfg.layer_types)
    return cfg.model_copy(update={"name": "kimi-k3", "layer_types": types})


def resolve_model(name: str) -> ModelConfig:
    """A model by name (MODEL_NAMES) or a config.json path; anything else is refused naming --model."""
    if name == "full-2.8t":
        return preset(name)
    if name == "kimi-k3":
        return kimi_k3()
    if name in PUBLISHED:
        return from_hf(PUBLISHED[name], name)
    path = Path(name)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"--model {name!r}: expected one of {', '.join(MODEL_NAMES)} or a config.json path")
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"--model {name}: cannot read it ({e})") from None
    if isinstance(raw, dict) and raw.get("model_type") in (*MODEL_TYPES, "deepseek_v3", "kimi_k2"):
        try:
            return from_hf(raw, path.parent.name or "model")
        except ValueError as e:
            raise ValueError(f"--model {name}: {e}") from None
    try:
        return load_config(path)
    except ValueError as e:
        raise ValueError(f"--model {name}: {e}") from None
