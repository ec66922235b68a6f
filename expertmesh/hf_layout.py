"""Hugging Face checkpoints of the published relatives, loaded as they are.

A directory with `config.json` of model_type `kimi_linear` (Kimi Linear: KDA + NoPE MLA layers) or `deepseek_v32`
(DeepSeek-V3.2: MLA + lightning indexer on every layer), plus the hybrid this project serves — a Kimi Linear
config whose full-attention layers carry DSA indexer fields (`index_topk`, `index_head_dim`, `index_n_heads`) —
and `*.safetensors` shards under the published tensor names. Two tables per model_type say everything that
differs: CONFIG_FIELDS (config.json keys → ModelConfig, with the aliases each family's configs use) and
TENSOR_NAMES (our module names → the published names, first candidate present wins).

Routed experts come in any of: per-expert `experts.E.{w1,w3,w2}` / `experts.E.{gate,up,down}_proj` (bf16, fp32 or
DeepSeek FP8), fused `experts.gate_up_proj` [E, 2I, H] + `experts.down_proj` [E, H, I] (gate rows first), or MXFP4
`experts.gate_up_proj_blocks/_scales` + `down_proj_blocks/_scales` (gpt-oss naming; blocks [.., K/2] or
[.., K/32, 16]). Float experts are quantized to MXFP4 as they are read (or once, by `expertmesh checkpoint
convert`). DeepSeek FP8 weights (`F8_E4M3` + `weight_scale_inv`, 128×128 blocks) are dequantized on read.
Everything else keeps the dtype it was stored in. Tensors of layers past num_hidden_layers (DeepSeek's
multi-token-prediction layer) are not part of the served model and are skipped; any other unknown tensor is
refused by name.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from expertmesh.config import (
    MXFP4_BLOCK, IndexerConfig, KDAConfig, MLAConfig, ModelConfig, MoEConfig, RopeConfig, ThinkingBudgets,
    YarnConfig,
)

MODEL_TYPES = ("kimi_linear", "deepseek_v32")
_FLOAT_DTYPES = {"F32", "BF16", "F16"}
_FP8 = "F8_E4M3"
DEFAULT_THINKING = ThinkingBudgets(low=1024, high=8192, max=32768)


class HFCheckpointError(ValueError):
    """A Hugging Face directory that is not a loadable relative: names the file, the tensor or field, and what
    was expected."""


# ----------------------------------------------------------------------------------------------- config
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
        raise HFCheckpointError(f"config.json: mlp_layer_types={types}: only leading dense layers followed by MoE "
                                f"layers are supported")
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
    return RopeConfig(theta=theta, yarn=YarnConfig(
        factor=factor, original_max_position_embeddings=orig, beta_fast=params.get("beta_fast") or 32,
        beta_slow=params.get("beta_slow") or 1, mscale=params.get("mscale") or 0.0,
        mscale_all_dim=params.get("mscale_all_dim") or 0.0, attention_factor=params.get("attention_factor"),
        truncate=params.get("truncate", True)))


def _check_supported(raw: dict) -> None:
    for key, ok in (("hidden_act", ("silu",)), ("scoring_func", ("sigmoid",)),
                    ("moe_router_activation_func", ("sigmoid",)), ("topk_method", ("noaux_tc",)),
                    ("attention_bias", (False,)), ("mlp_bias", (False,))):
        if key in raw and raw[key] not in ok:
            raise HFCheckpointError(f"config.json: {key}={raw[key]!r} is not supported (expected "
                                    f"{' or '.join(map(repr, ok))})")
    heads, kv_heads = raw.get("num_attention_heads"), raw.get("num_key_value_heads")
    if kv_heads not in (None, heads):
        raise HFCheckpointError(f"config.json: num_key_value_heads={kv_heads} must equal num_attention_heads="
                                f"{heads} (MLA shares one latent across heads)")
    quant = raw.get("quantization_config")
    if quant and quant.get("quant_method") not in ("fp8", "mxfp4"):
        raise HFCheckpointError(f"config.json: quantization_config.quant_method={quant.get('quant_method')!r}: "
                                f"expected fp8 or mxfp4")


def config_from_hf(raw: dict, tensor_names: set[str], name: str) -> ModelConfig:
    """config.json of a published relative (+ the tensor names present, for optional biases) → ModelConfig."""
    model_type = raw.get("model_type")
    if model_type not in MODEL_TYPES:
        raise HFCheckpointError(f"config.json: model_type {model_type!r}: expected one of {', '.join(MODEL_TYPES)}")
    _check_supported(raw)
    n_layers = int(_get(raw, "num_hidden_layers"))
    hidden = int(_get(raw, "hidden_size"))
    indexed = model_type == "deepseek_v32" or "index_topk" in raw
    rope = _rope(raw)
    if model_type == "kimi_linear":
        lin = raw.get("linear_attn_config") or {}
        kda_heads = int(lin.get("num_heads", _get(raw, "linear_num_heads", default=32)))
        kda_dim = int(lin.get("head_dim", _get(raw, "linear_head_dim", default=128)))
        kernel = int(lin.get("short_conv_kernel_size", _get(raw, "linear_conv_kernel_dim", default=4)))
        types = raw.get("layer_types")
        if types is None and "full_attn_layers" in lin:
            full = {i - 1 for i in lin["full_attn_layers"]}            # 1-indexed in the published config
            types = ["full_attention" if i in full else "linear_attention" for i in range(n_layers)]
        if types is None:
            types = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(n_layers)]
        global_type = "dsa" if indexed else "mla"
        layer_types = tuple(global_type if t == "full_attention" else "kda" for t in types)
        dense = _dense_prefix(raw, n_layers, default=1)
        # Kimi Linear's MLA is NoPE; the hybrid's DSA layers follow DeepSeek-V3.2 when the config gives RoPE
        mla_rope = "interleaved" if indexed else "none"
        n_experts = int(_get(raw, "num_experts", "n_routed_experts", "num_local_experts"))
        top_k = int(_get(raw, "num_experts_per_token", "num_experts_per_tok"))
        n_group = int(_get(raw, "num_expert_group", "n_group", default=1))
        renorm = bool(_get(raw, "moe_renormalize", "norm_topk_prob", default=True))
        n_shared = int(_get(raw, "num_shared_experts", "n_shared_experts", default=1))
        max_context = int(_get(raw, "model_max_length", "max_position_embeddings", default=1 << 20))
        kda = KDAConfig(n_heads=kda_heads, head_dim=kda_dim, conv_kernel_size=kernel, gate_low_rank=kda_dim,
                        conv_bias=any(n.endswith("q_conv1d.bias") for n in tensor_names),
                        output_gate_bias=any(n.endswith("g_b_proj.bias") for n in tensor_names))
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
        kda = KDAConfig(n_heads=1, head_dim=MXFP4_BLOCK, gate_low_rank=1)   # unused: no KDA layers
    heads = int(_get(raw, "num_attention_heads"))
    cfg = ModelConfig(
        name=name, model_type=model_type, vocab_size=int(_get(raw, "vocab_size")), hidden_size=hidden,
        layer_types=layer_types, first_k_dense=dense, dense_intermediate_size=int(_get(raw, "intermediate_size")),
        moe=MoEConfig(n_routed_experts=n_experts, n_shared_experts=n_shared, top_k=top_k,
                      expert_intermediate_size=int(_get(raw, "moe_intermediate_size")), n_group=n_group,
                      topk_group=int(_get(raw, "topk_group", default=1)),
                      routed_scaling_factor=float(_get(raw, "routed_scaling_factor", default=1.0)),
                      norm_topk_prob=renorm),
        mla=MLAConfig(n_heads=heads, q_lora_rank=raw.get("q_lora_rank"), kv_lora_rank=int(_get(raw, "kv_lora_rank")),
                      qk_nope_head_dim=int(_get(raw, "qk_nope_head_dim")),
                      qk_rope_head_dim=int(_get(raw, "qk_rope_head_dim")), v_head_dim=int(_get(raw, "v_head_dim")),
                      rope=mla_rope if rope is not None else "none"),
        indexer=IndexerConfig(n_heads=int(_get(raw, "index_n_heads", default=1)),
                              head_dim=int(_get(raw, "index_head_dim", default=MXFP4_BLOCK)),
                              index_topk=int(_get(raw, "index_topk", default=2048)), rope=rope is not None),
        kda=kda, rope=rope or RopeConfig(), thinking=DEFAULT_THINKING, max_context=max_context,
        rms_norm_eps=float(_get(raw, "rms_norm_eps", default=1e-6)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
    )
    return cfg


def moe_prefix(cfg: ModelConfig, tensor_names: set[str]) -> str:
    """The module the FFN tensors live under: DeepSeek `mlp`; Kimi Linear `block_sparse_moe` (also its dense
    layers, as transformers writes them) or `mlp`."""
    if cfg.model_type == "kimi_linear" and any(".block_sparse_moe." in n for n in tensor_names):
        return "block_sparse_moe"
    return "mlp"


# ----------------------------------------------------------------------------------------------- tensor names
def _attention_names(kind: str) -> dict[str, tuple[str, ...]]:
    """Our attention module's tensor suffix → published suffixes under `model.layers.L.self_attn.`."""
    if kind == "kda":
        names = {f"{p}_proj.weight": (f"{p}_proj.weight",) for p in "qkv"}
        names |= {f"{p}_conv.weight": (f"{p}_conv1d.weight",) for p in "qkv"}
        names |= {f"{p}_conv.bias": (f"{p}_conv1d.bias",) for p in "qkv"}
        names |= {"f_a.weight": ("f_a_proj.weight",), "f_b.weight": ("f_b_proj.weight",),
                  "g_a.weight": ("g_a_proj.weight",), "g_b.weight": ("g_b_proj.weight",),
                  "g_b.bias": ("g_b_proj.bias",), "b_proj.weight": ("b_proj.weight",), "A_log": ("A_log",),
                  "dt_bias": ("dt_bias",), "o_norm.weight": ("o_norm.weight",), "o_proj.weight": ("o_proj.weight",)}
        return names
    return {"q_proj.weight": ("q_proj.weight",), "q_a.weight": ("q_a_proj.weight",),
            "q_a_norm.weight": ("q_a_layernorm.weight",), "q_b.weight": ("q_b_proj.weight",),
            "kv_a.weight": ("kv_a_proj_with_mqa.weight",), "kv_a_norm.weight": ("kv_a_layernorm.weight",),
            "kv_b.weight": ("kv_b_proj.weight",), "o_proj.weight": ("o_proj.weight",),
            "index_q.weight": ("indexer.wq_b.weight",), "index_k.weight": ("indexer.wk.weight",),
            "index_k_norm.weight": ("indexer.k_norm.weight",), "index_k_norm.bias": ("indexer.k_norm.bias",),
            "index_w.weight": ("indexer.weights_proj.weight",)}


def tensor_names(cfg: ModelConfig, prefix: str = "mlp") -> dict[str, tuple[str, ...]]:
    """Every non-expert module tensor of `cfg` → the published names it may be stored under (`prefix`: the FFN
    module name, see moe_prefix)."""
    from expertmesh.checkpoint import module_shapes
    ffn = {"moe.router.weight": ("gate.weight",), "moe.router_bias": ("gate.e_score_correction_bias",),
           **{f"moe.shared.{p}.weight": (f"shared_experts.{p}_proj.weight",) for p in ("gate", "up", "down")},
           **{f"mlp.{p}.weight": (f"{p}_proj.weight",) for p in ("gate", "up", "down")}}
    out = {}
    for name in module_shapes(cfg):
        if ".moe.experts." in name:
            continue
        if not name.startswith("layers."):
            out[name] = {"embed.weight": ("model.embed_tokens.weight",), "norm.weight": ("model.norm.weight",),
                         "lm_head.weight": ("lm_head.weight",)}[name]
            continue
        _, layer, rest = name.split(".", 2)
        base = f"model.layers.{layer}."
        if rest in ("attn_norm.weight", "ffn_norm.weight"):
            out[name] = (base + ("input_layernorm.weight" if rest.startswith("attn") else
                                 "post_attention_layernorm.weight"),)
        elif rest.startswith("attn."):
            suffixes = _attention_names(cfg.layer_types[int(layer)])[rest[len("attn."):]]
            out[name] = tuple(base + "self_attn." + s for s in suffixes)
        else:
            prefixes = (prefix, "mlp") if prefix != "mlp" else ("mlp",)
            out[name] = tuple(base + f"{p}.{s}" for p in prefixes for s in ffn[rest])
    return out


_EXPERT_FORMS = {
    # name of the form → (gate, up, down) published suffixes under `<moe prefix>.experts.`, {e} = expert id
    "w123": ("{e}.w1.weight", "{e}.w3.weight", "{e}.w2.weight"),
    "proj": ("{e}.gate_proj.weight", "{e}.up_proj.weight", "{e}.down_proj.weight"),
}


@dataclass(frozen=True)
class ExpertLayout:
    """How one MoE layer's routed experts are stored."""
    form: str                  # "w123" | "proj" (per expert) | "fused" | "mxfp4"
    base: str                  # "model.layers.L.<prefix>.experts."


# ----------------------------------------------------------------------------------------------- reading
class SafetensorsDir:
    """The tensors of a directory of safetensors shards: name → file (from the index, else every shard's
    header), dtype and shape from the headers; reads lazily (memory-mapped), slices without loading the rest."""

    def __init__(self, path: Path):
        from expertmesh.checkpoint import INDEX_FILE, _read_header
        self.path = path
        index = path / INDEX_FILE
        files = sorted(path.glob("*.safetensors"))
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise HFCheckpointError(f"{index}: not a valid index ({e!r})") from None
            files = sorted({path / f for f in weight_map.values()})
        if not files:
            raise HFCheckpointError(f"{path}: no *.safetensors files")
        self.file_of: dict[str, Path] = {}
        self.header: dict[str, tuple[str, list[int]]] = {}
        for f in files:
            if not f.exists():
                raise HFCheckpointError(f"{f}: missing (named by {INDEX_FILE})")
            for name, info in _read_header(f).items():
                self.file_of[name] = f
                self.header[name] = info
        self.files = files

    def __contains__(self, name: str) -> bool:
        return name in self.header

    def read(self, name: str, index=None) -> torch.Tensor:
        with safe_open(str(self.file_of[name]), framework="pt") as f:
            return f.get_tensor(name) if index is None else f.get_slice(name)[index]


def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """DeepSeek's block-scaled FP8: w[i, j] = fp8[i, j] · scale_inv[i // bo, j // bi] (fp32)."""
    bo, bi = block
    out, inp = weight.shape
    scale = scale_inv.float().repeat_interleave(bo, 0)[:out].repeat_interleave(bi, 1)[:, :inp]
    return weight.float() * scale


class HFLayout:
    """A validated Hugging Face directory: config mapped, every tensor the model needs found with the shape it
    needs, the expert layout of each MoE layer known. Reads return our module names and layouts."""

    def __init__(self, path: Path, raw: dict):
        self.path = path
        self.files = SafetensorsDir(path)
        self.cfg = config_from_hf(raw, set(self.files.header), name=path.name)
        quant = raw.get("quantization_config") or {}
        self.fp8_block = tuple(quant.get("weight_block_size") or (128, 128))
        self.prefix = moe_prefix(self.cfg, set(self.files.header))
        self.names: dict[str, str] = {}          # our module name → the published name found
        from expertmesh.checkpoint import module_shapes
        shapes = module_shapes(self.cfg)
        used: set[str] = set()
        for ours, candidates in tensor_names(self.cfg, self.prefix).items():
            found = next((c for c in candidates if c in self.files), None)
            if found is None:
                raise HFCheckpointError(f"{path}: tensor {candidates[0]!r} missing (a {self.cfg.model_type} model "
                                        f"with this config.json needs it for {ours})")
            self._check(found, shapes[ours])
            self.names[ours] = found
            used |= {found, found + "_scale_inv"}
        self.experts: dict[int, ExpertLayout] = {}
        for layer in self.cfg.moe_layers:
            layout, names = self._expert_layout(layer)
            self.experts[layer] = layout
            used |= names
        self._refuse_unknown(used)

    # ---------------------------------------------------------------- validation
    def _check(self, name: str, shape: tuple[int, ...]) -> None:
        dtype, found = self.files.header[name]
        where = self.files.file_of[name]
        if dtype not in _FLOAT_DTYPES | {_FP8}:
            raise HFCheckpointError(f"{where}: tensor {name!r} has dtype {dtype}, expected F32, BF16, F16 or F8_E4M3")
        if dtype == _FP8 and name + "_scale_inv" not in self.files:
            raise HFCheckpointError(f"{where}: tensor {name!r} is F8_E4M3 but {name + '_scale_inv'!r} is missing")
        if math.prod(found) != math.prod(shape) or (len(found) == len(shape) and tuple(found) != shape):
            raise HFCheckpointError(f"{where}: tensor {name!r} has shape {list(found)}, expected {list(shape)}")

    def _expert_layout(self, layer: int) -> tuple[ExpertLayout, set[str]]:
        cfg = self.cfg
        e, h, i = cfg.moe.n_routed_experts, cfg.hidden_size, cfg.moe.expert_intermediate_size
        base = f"model.layers.{layer}.{self.prefix}.experts."
        if base + "gate_up_proj_blocks" in self.files:
            names = {base + f"{p}_{k}" for p in ("gate_up_proj", "down_proj") for k in ("blocks", "scales")}
            for p, rows, k in (("gate_up_proj", 2 * i, h), ("down_proj", h, i)):
                self._check_any(base + f"{p}_blocks", [(e, rows, k // 2), (e, rows, k // 32, 16)], ("U8",))
                self._check_any(base + f"{p}_scales", [(e, rows, k // 32)], ("U8",))
            return ExpertLayout("mxfp4", base), names
        if base + "gate_up_proj" in self.files:
            self._check(base + "gate_up_proj", (e, 2 * i, h))
            self._check(base + "down_proj", (e, h, i))
            return ExpertLayout("fused", base), {base + "gate_up_proj", base + "down_proj"}
        for form, suffixes in _EXPERT_FORMS.items():
            if base + suffixes[0].format(e=0) not in self.files:
                continue
            names = set()
            for x in range(e):
                for suffix, shape in zip(suffixes, ((i, h), (i, h), (h, i))):
                    name = base + suffix.format(e=x)
                    if name not in self.files:
                        raise HFCheckpointError(f"{self.path}: tensor {name!r} missing (expert {x} of layer {layer})")
                    self._check(name, shape)
                    names |= {name, name + "_scale_inv"}
            return ExpertLayout(form, base), names
        raise HFCheckpointError(f"{self.path}: no routed experts found for layer {layer} (looked for "
                                f"{base}0.w1.weight, {base}0.gate_proj.weight, {base}gate_up_proj, "
                                f"{base}gate_up_proj_blocks)")

    def _check_any(self, name: str, shapes: list[tuple[int, ...]], dtypes: tuple[str, ...]) -> None:
        if name not in self.files:
            raise HFCheckpointError(f"{self.path}: tensor {name!r} missing")
        dtype, found = self.files.header[name]
        where = self.files.file_of[name]
        if dtype not in dtypes:
            raise HFCheckpointError(f"{where}: tensor {name!r} has dtype {dtype}, expected {' or '.join(dtypes)}")
        if tuple(found) not in shapes:
            raise HFCheckpointError(f"{where}: tensor {name!r} has shape {list(found)}, expected "
                                    f"{' or '.join(str(list(s)) for s in shapes)}")

    def _refuse_unknown(self, used: set[str]) -> None:
        n_layers = self.cfg.n_layers
        for name in sorted(self.files.header):
            if name in used:
                continue
            m = re.match(r"model\.layers\.(\d+)\.", name)
            if m and int(m.group(1)) >= n_layers:
                continue                       # multi-token-prediction layers: not part of the served model
            if name.endswith("rotary_emb.inv_freq"):
                continue
            raise HFCheckpointError(f"{self.files.file_of[name]}: unexpected tensor {name!r} (not part of a "
                                    f"{self.cfg.model_type} model with this config.json)")

    # ---------------------------------------------------------------- reading
    def _read_float(self, name: str, index=None) -> torch.Tensor:
        t = self.files.read(name, index)
        if self.files.header[name][0] == _FP8:
            scale = self.files.read(name + "_scale_inv")
            full = self.files.read(name) if index is not None else t
            t = dequantize_fp8(full, scale, self.fp8_block)
        return t

    def dense(self, ours: str, shape: tuple[int, ...]) -> torch.Tensor:
        """Our module tensor `ours` in its stored dtype (FP8 dequantized to fp32), reshaped to our layout."""
        return self._read_float(self.names[ours]).reshape(shape)

    def expert_weights(self, layer: int, expert_ids: list[int]) -> dict[str, torch.Tensor]:
        """The MXFP4 buffers of `expert_ids` of `layer` (gate_up/down blocks + scales), quantizing float experts
        one expert at a time (memory: one expert's float weights at once)."""
        from expertmesh.kernels.mxfp4 import quantize_mxfp4
        lay = self.experts[layer]
        h, i = self.cfg.hidden_size, self.cfg.moe.expert_intermediate_size
        if lay.form == "mxfp4":
            out = {}
            for ours, p in (("gate_up", "gate_up_proj"), ("down", "down_proj")):
                blocks = torch.stack([self.files.read(lay.base + f"{p}_blocks", x) for x in expert_ids]) \
                    if expert_ids else torch.empty(0, dtype=torch.uint8)
                scales = torch.stack([self.files.read(lay.base + f"{p}_scales", x) for x in expert_ids]) \
                    if expert_ids else torch.empty(0, dtype=torch.uint8)
                k = h if ours == "gate_up" else i
                rows = 2 * i if ours == "gate_up" else h
                out[f"{ours}_blocks"] = blocks.reshape(len(expert_ids), rows, k // 2)
                out[f"{ours}_scales"] = scales.reshape(len(expert_ids), rows, k // 32)
            return out
        shapes = {"gate_up": (2 * i, h), "down": (h, i)}
        parts: dict[str, list[torch.Tensor]] = {f"{k}_{kind}": [] for k in shapes for kind in ("blocks", "scales")}
        for x in expert_ids:
            if lay.form == "fused":
                gate_up = self._read_float(lay.base + "gate_up_proj", x)
                down = self._read_float(lay.base + "down_proj", x)
            else:
                g, u, d = (lay.base + s.format(e=x) for s in _EXPERT_FORMS[lay.form])
                gate_up = torch.cat([self._read_float(g), self._read_float(u)])
                down = self._read_float(d)
            for key, w in (("gate_up", gate_up), ("down", down)):
                blocks, scales = quantize_mxfp4(w.float())          # one expert's float weights at a time
                parts[f"{key}_blocks"].append(blocks)
                parts[f"{key}_scales"].append(scales)
        out = {}
        for key, packed in parts.items():
            rows, k = shapes[key.rsplit("_", 1)[0]]
            width = k // 2 if key.endswith("blocks") else k // MXFP4_BLOCK
            out[key] = torch.stack(packed) if packed else torch.empty(0, rows, width, dtype=torch.uint8)
        return out
