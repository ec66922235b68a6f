"""config.json of the published relatives → ModelConfig (no tensors read; no torch): what a Hugging Face
directory's model is, for the router (which needs the config only), the operator and the weight loader
(expertmesh/checkpoint/hf_layout.py) alike.

Model types: `kimi_linear` (Kimi Linear: KDA + NoPE MLA layers), `deepseek_v32` (DeepSeek-V3.2: MLA + lightning
indexer on every layer), `kimi_k3` (Kimi K3: a wrapper whose `text_config` is Kimi Linear's with SiTU, attention
residuals, the latent MoE, a full-rank KDA output gate and gate lower bound, NoPE gated MLA), and the hybrids this
project serves — a Kimi Linear or K3 config whose full-attention layers carry DSA indexer fields (`index_topk`,
`index_head_dim`, `index_n_heads`). Families spell the same field differently; the aliases are listed where each
field is read.

Where K3's two public implementations differ, this follows llama.cpp's kimi-k3 (the oracle its tests compare
with): the KDA q/k L2-norm and the KDA output norm use `rms_norm_eps` (vLLM: a fixed 1e-6 and 1e-5).
"""

from __future__ import annotations

from pydantic import ValidationError

from expertmesh.checkpoint.files import CheckpointError
from expertmesh.model.config import (
    MXFP4_BLOCK,
    ActivationConfig,
    IndexerConfig,
    KDAConfig,
    MLAConfig,
    ModelConfig,
    MoEConfig,
    RopeConfig,
    VisionConfig,
    YarnConfig,
)

MODEL_TYPES = ("kimi_linear", "deepseek_v32", "kimi_k3")
K3_QUANT_FORMAT = "mxfp4-pack-quantized"  # compressed-tensors routed experts: read as they are


class HFCheckpointError(CheckpointError):
    """A Hugging Face directory that is not a loadable relative: names the file, the tensor or field, and what
    was expected."""


def _get(raw: dict, *keys, default=...):
    """The first of `keys` present in config.json (families spell the same field differently)."""
    for key in keys:
        if key in raw and raw[key] is not None:
            return raw[key]
    if default is ...:
        raise HFCheckpointError(f"config.json: field {keys[0]!r} missing")
    return default


def _dense_prefix(raw: dict, n_layers: int, default: int) -> int:
    """Leading dense layers, from `mlp_layer_types` (must be dense…dense sparse…sparse) or first_k_dense_replace."""
    types = raw.get("mlp_layer_types")
    if types is None:
        return int(_get(raw, "first_k_dense_replace", default=default))
    k = 0
    while k < len(types) and types[k] == "dense":
        k += 1
    if list(types) != ["dense"] * k + ["sparse"] * (n_layers - k):
        raise HFCheckpointError(
            f"config.json: mlp_layer_types={types}: only leading dense layers followed by MoE layers are supported"
        )
    return k


def _rope(raw: dict) -> RopeConfig | None:
    """`rope_parameters` (transformers 5) or `rope_theta` + `rope_scaling` (older configs); None: no RoPE."""
    params = dict(raw.get("rope_parameters") or {})
    if raw.get("rope_scaling"):
        params = {**raw["rope_scaling"], **params}
    theta = params.get("rope_theta", raw.get("rope_theta"))
    if theta is None:
        return None
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return RopeConfig(theta=theta)
    if kind != "yarn":
        raise HFCheckpointError(f"config.json: rope type {kind!r}: expected default or yarn")
    orig = params.get("original_max_position_embeddings") or raw.get("max_position_embeddings")
    factor = params.get("factor") or _get(raw, "max_position_embeddings") / orig
    return RopeConfig(
        theta=theta,
        yarn=YarnConfig(
            factor=factor,
            original_max_position_embeddings=orig,
            beta_fast=params.get("beta_fast") or 32,
            beta_slow=params.get("beta_slow") or 1,
            mscale=params.get("mscale") or 0.0,
            mscale_all_dim=params.get("mscale_all_dim") or 0.0,
            attention_factor=params.get("attention_factor"),
            truncate=params.get("truncate", True),
        ),
    )


def text_config(raw: dict) -> dict:
    """A wrapper config (kimi_k3: `text_config` beside `vision_config`) flattened as its text model reads it: the
    text fields over the wrapper's (quantization_config may sit at either level); others unchanged."""
    if raw.get("model_type") != "kimi_k3":
        return raw
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise HFCheckpointError("config.json: model_type 'kimi_k3' needs a text_config object")
    return {**{k: v for k, v in raw.items() if k != "text_config"}, **text, "model_type": "kimi_k3"}


def _check_supported(raw: dict) -> None:
    acts = ("situ",) if raw.get("model_type") == "kimi_k3" else ("silu",)
    for key, ok in (
        ("hidden_act", acts),
        ("scoring_func", ("sigmoid",)),
        ("moe_router_activation_func", ("sigmoid",)),
        ("topk_method", ("noaux_tc",)),
        ("attention_bias", (False,)),
        ("mlp_bias", (False,)),
    ):
        if key in raw and raw[key] not in ok:
            raise HFCheckpointError(
                f"config.json: {key}={raw[key]!r} is not supported (expected {' or '.join(map(repr, ok))})"
            )
    heads, kv_heads = raw.get("num_attention_heads"), raw.get("num_key_value_heads")
    if kv_heads not in (None, heads):
        raise HFCheckpointError(
            f"config.json: num_key_value_heads={kv_heads} must equal num_attention_heads="
            f"{heads} (MLA shares one latent across heads)"
        )
    quant = raw.get("quantization_config")
    if quant and quant.get("quant_method") == "compressed-tensors":
        if quant.get("format") != K3_QUANT_FORMAT:
            raise HFCheckpointError(
                f"config.json: quantization_config.format={quant.get('format')!r}: compressed-"
                f"tensors checkpoints are read in the {K3_QUANT_FORMAT} format only"
            )
    elif quant and quant.get("quant_method") not in ("fp8", "mxfp4"):
        raise HFCheckpointError(
            f"config.json: quantization_config.quant_method={quant.get('quant_method')!r}: "
            f"expected fp8, mxfp4 or compressed-tensors"
        )


def config_from_hf(raw: dict, tensor_names: set[str], name: str) -> ModelConfig:
    """config.json of a published relative (+ the tensor names present, for optional biases) → ModelConfig."""
    model_type = raw.get("model_type")
    if model_type not in MODEL_TYPES:
        raise HFCheckpointError(f"config.json: model_type {model_type!r}: expected one of {', '.join(MODEL_TYPES)}")
    wrapper, raw = raw, text_config(raw)
    _check_supported(raw)
    k3 = model_type == "kimi_k3"
    n_layers = int(_get(raw, "num_hidden_layers"))
    hidden = int(_get(raw, "hidden_size"))
    indexed = model_type == "deepseek_v32" or "index_topk" in raw
    rope = None if k3 else _rope(raw)  # K3 is NoPE throughout (its MLA and the hybrid's indexer alike)
    if model_type in ("kimi_linear", "kimi_k3"):
        lin = raw.get("linear_attn_config") or {}
        kda_heads = int(lin.get("num_heads", _get(raw, "linear_num_heads", default=32)))
        kda_dim = int(lin.get("head_dim", _get(raw, "linear_head_dim", default=128)))
        kernel = int(lin.get("short_conv_kernel_size", _get(raw, "linear_conv_kernel_dim", default=4)))
        types = raw.get("layer_types")
        if types is None and "full_attn_layers" in lin:
            full = {i - 1 for i in lin["full_attn_layers"]}  # 1-indexed in the published config
            types = ["full_attention" if i in full else "linear_attention" for i in range(n_layers)]
        if types is None:
            types = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(n_layers)]
        global_type = "dsa" if indexed else "mla"
        layer_types = tuple(global_type if t == "full_attention" else "kda" for t in types)
        dense = _dense_prefix(raw, n_layers, default=1)
        # Kimi Linear's MLA is NoPE; the hybrid's DSA layers follow DeepSeek-V3.2 when the config gives RoPE
        mla_rope = "interleaved" if indexed and not k3 else "none"
        n_experts = int(_get(raw, "num_experts", "n_routed_experts", "num_local_experts"))
        top_k = int(_get(raw, "num_experts_per_token", "num_experts_per_tok"))
        n_group = int(_get(raw, "num_expert_group", "n_group", default=1))
        renorm = bool(_get(raw, "moe_renormalize", "norm_topk_prob", default=True))
        n_shared = int(_get(raw, "num_shared_experts", "n_shared_experts", default=1))
        max_context = int(_get(raw, "model_max_length", "max_position_embeddings", default=1 << 20))
        full_rank_gate = bool(lin.get("use_full_rank_gate", k3))
        kda = KDAConfig(
            n_heads=kda_heads,
            head_dim=kda_dim,
            conv_kernel_size=kernel,
            gate_low_rank=kda_dim,
            conv_bias=any(n.endswith("q_conv1d.bias") for n in tensor_names),
            output_gate_bias=any(n.endswith(("g_b_proj.bias", "self_attn.g_proj.bias")) for n in tensor_names),
            output_gate="full_rank" if full_rank_gate else "low_rank",
            gate_lower_bound=lin.get("gate_lower_bound") if k3 else None,
            l2_norm_eps=float(_get(raw, "rms_norm_eps", default=1e-6)) if k3 else 1e-6,
        )
    else:
        types = raw.get("layer_types") or ["indexed_attention"] * n_layers
        if set(types) != {"indexed_attention"}:
            raise HFCheckpointError(f"config.json: layer_types={types}: deepseek_v32 layers are all indexed_attention")
        layer_types = ("dsa",) * n_layers
        dense = _dense_prefix(raw, n_layers, default=3)
        mla_rope = "interleaved"
        if rope is None:
            rope = RopeConfig(theta=10_000.0)
        n_experts = int(_get(raw, "n_routed_experts", "num_experts", "num_local_experts"))
        top_k = int(_get(raw, "num_experts_per_tok"))
        n_group = int(_get(raw, "n_group", default=1))
        renorm = bool(_get(raw, "norm_topk_prob", default=True))
        n_shared = int(_get(raw, "n_shared_experts", default=1))
        max_context = int(_get(raw, "max_position_embeddings", default=163_840))
        kda = KDAConfig(n_heads=1, head_dim=MXFP4_BLOCK, gate_low_rank=1)  # unused: no KDA layers
    heads = int(_get(raw, "num_attention_heads"))
    k3_fields = {}
    if k3:
        if not raw.get("mla_use_nope", True):
            raise HFCheckpointError("config.json: mla_use_nope=false: Kimi K3's full-attention layers are NoPE")
        block = raw.get("attn_res_block_size")
        k3_fields = dict(
            activation=ActivationConfig(
                kind="situ",
                beta=float(_get(raw, "activation_situ_beta", default=4.0)),
                linear_beta=float(_get(raw, "activation_situ_linear_beta", default=0.0)),
            ),
            attn_res_block_size=int(block) if block else None,
        )
    latent = raw.get("routed_expert_hidden_size")
    latent_norm = bool(
        raw.get("latent_moe_use_norm", any(n.endswith("routed_expert_norm.weight") for n in tensor_names))
    )
    cfg = ModelConfig(
        name=name,
        model_type=model_type,
        vocab_size=int(_get(raw, "vocab_size")),
        hidden_size=hidden,
        layer_types=layer_types,
        first_k_dense=dense,
        dense_intermediate_size=int(_get(raw, "intermediate_size")),
        moe=MoEConfig(
            n_routed_experts=n_experts,
            n_shared_experts=n_shared,
            top_k=top_k,
            expert_intermediate_size=int(_get(raw, "moe_intermediate_size")),
            n_group=n_group,
            topk_group=int(_get(raw, "topk_group", default=1)),
            routed_scaling_factor=float(_get(raw, "routed_scaling_factor", default=1.0)),
            norm_topk_prob=renorm,
            latent_size=int(latent) if latent else None,
            latent_norm=latent_norm,
        ),
        mla=MLAConfig(
            n_heads=heads,
            q_lora_rank=raw.get("q_lora_rank"),
            kv_lora_rank=int(_get(raw, "kv_lora_rank")),
            qk_nope_head_dim=int(_get(raw, "qk_nope_head_dim")),
            qk_rope_head_dim=int(_get(raw, "qk_rope_head_dim")),
            v_head_dim=int(_get(raw, "v_head_dim")),
            rope=mla_rope if rope is not None else "none",
            gated_output=bool(raw.get("mla_use_output_gate", True)) if k3 else False,
        ),
        indexer=IndexerConfig(
            n_heads=int(_get(raw, "index_n_heads", default=1)),
            head_dim=int(_get(raw, "index_head_dim", default=MXFP4_BLOCK)),
            index_topk=int(_get(raw, "index_topk", default=2048)),
            rope=rope is not None,
        ),
        kda=kda,
        rope=rope or RopeConfig(),
        max_context=max_context,
        rms_norm_eps=float(_get(raw, "rms_norm_eps", default=1e-6)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        n_mtp_layers=int(raw.get("num_nextn_predict_layers") or 0),
        vision=k3_vision(wrapper, hidden, tensor_names) if k3 else None,
        **k3_fields,
    )
    return cfg


def moe_prefix(cfg: ModelConfig, tensor_names: set[str]) -> str:
    """The module the FFN tensors live under: DeepSeek `mlp`; Kimi Linear `block_sparse_moe` (also its dense
    layers, as transformers writes them) or `mlp`."""
    if cfg.model_type in ("kimi_linear", "kimi_k3") and any(".block_sparse_moe." in n for n in tensor_names):
        return "block_sparse_moe"
    return "mlp"


# ----------------------------------------------------------------------------------------------- K3's vision
# K3's `vision_config` (vLLM / SGLang's KimiK3VisionConfig, model_type kimi_k3_vision): published key → our
# VisionConfig field, with the published default
_K3_VISION_FIELDS = {
    "patch_size": ("patch_size", 14),
    "vt_hidden_size": ("hidden_size", 1024),
    "vt_num_hidden_layers": ("num_hidden_layers", 27),
    "vt_num_attention_heads": ("num_attention_heads", 12),
    "vt_intermediate_size": ("intermediate_size", 4096),
    "qkv_hidden_size": ("qkv_hidden_size", 1536),
    "init_pos_emb_height": ("pos_emb_height", 64),
    "init_pos_emb_width": ("pos_emb_width", 64),
    "init_pos_emb_time": ("pos_emb_time", 4),
    "pos_emb_type": ("pos_emb_type", "divided_fixed"),
    "pos_emb_interpolation_mode": ("pos_emb_interpolation_mode", "bilinear"),
    "norm_type": ("norm_type", "rmsnorm"),
    "attn_bias": ("attn_bias", False),
    "linear_bias": ("linear_bias", False),
    "patch_embed_proj_bias": ("patch_embed_proj_bias", False),
    "mlp_type": ("mlp_type", "mlp2"),
    "activation_func": ("hidden_act", "gelu_pytorch_tanh"),
    "merge_kernel_size": ("merge_kernel_size", (2, 2)),
    "mm_projector_type": ("projector_type", "patchmergerv2"),
    "projector_hidden_act": ("projector_hidden_act", "gelu"),
    "projector_ln_eps": ("projection_layer_norm_eps", 1e-5),
}
# keys with the one value served here (temporal pooling and video attention are the identity on one frame)
_K3_VISION_FIXED = {"merge_type": "sd2_tpool", "video_attn_type": "spatial_temporal", "in_channels": 3}
_K3_VISION_CHECKED = {"mm_hidden_size", "text_hidden_size", "model_type"}  # checked against the rest below
_K3_VISION_METADATA = {"_attn_implementation", "torch_dtype", "dtype", "transformers_version"}  # no effect on maths


def k3_vision(raw: dict, text_hidden: int, tensor_names: set[str]) -> VisionConfig | None:
    """Kimi K3's `vision_config` → VisionConfig (layout kimi_k3), every key honoured or refused by name; None when
    there is none, or when the checkpoint's tensors (if known) hold no vision tower: then it is served text only.

    The image tokens are the published tokenizer's: `media_placeholder_token_id` is `<|media_pad|>` (one per image
    token), and K3 numbers `<|media_content|>` and `<|media_end|>` — which open and close the run of pads as
    Kimi-K3.jinja renders an image — two and one below it."""
    vc = raw.get("vision_config")
    if vc is None or (tensor_names and not any(n.startswith("vision_tower.") for n in tensor_names)):
        return None
    if not isinstance(vc, dict):
        raise HFCheckpointError("config.json: vision_config must be an object")
    for key, value in vc.items():
        if key in _K3_VISION_FIXED and value != _K3_VISION_FIXED[key]:
            raise HFCheckpointError(
                f"config.json: vision_config.{key}={value!r} is not supported (expected {_K3_VISION_FIXED[key]!r})"
            )
        if not (
            {key} & (_K3_VISION_FIELDS.keys() | _K3_VISION_FIXED.keys() | _K3_VISION_CHECKED | _K3_VISION_METADATA)
        ):
            raise HFCheckpointError(f"config.json: vision_config.{key} is not a Kimi K3 vision field (kimi_k3_vision)")
    if vc.get("model_type", "kimi_k3_vision") != "kimi_k3_vision":
        raise HFCheckpointError(
            f"config.json: vision_config.model_type={vc['model_type']!r}: expected 'kimi_k3_vision'"
        )
    fields = {ours: vc.get(key, default) for key, (ours, default) in _K3_VISION_FIELDS.items()}
    if not isinstance(fields["merge_kernel_size"], (list, tuple)):
        raise HFCheckpointError(
            f"config.json: vision_config.merge_kernel_size={fields['merge_kernel_size']!r}: expected [height, width]"
        )
    fields["merge_kernel_size"] = tuple(fields["merge_kernel_size"])
    tower = fields["hidden_size"]
    if vc.get("mm_hidden_size") not in (None, tower):
        raise HFCheckpointError(
            f"config.json: vision_config.mm_hidden_size={vc['mm_hidden_size']} must equal vt_hidden_size={tower} "
            f"(the projector merges the tower's own rows)"
        )
    if vc.get("text_hidden_size", 7168) != text_hidden:
        raise HFCheckpointError(
            f"config.json: vision_config.text_hidden_size={vc.get('text_hidden_size', 7168)} must equal the text "
            f"model's hidden_size={text_hidden}"
        )
    pad = int(_get(raw, "media_placeholder_token_id", default=163605))
    try:
        return VisionConfig(
            layout="kimi_k3", **fields, image_token_id=pad, image_start_token_id=pad - 2, image_end_token_id=pad - 1
        )
    except ValidationError as e:
        published = {ours: key for key, (ours, _) in _K3_VISION_FIELDS.items()}
        err = e.errors()[0]
        ours = str(err["loc"][0]) if err["loc"] else ""
        key = published.get(ours)
        name = f"vision_config.{key}={vc.get(key, fields.get(ours))!r}" if key else "vision_config"
        raise HFCheckpointError(f"config.json: {name}: {err['msg']}") from None
