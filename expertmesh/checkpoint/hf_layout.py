"""Hugging Face checkpoints of the published relatives, loaded as they are.

A directory with `config.json` of a published relative (checkpoint/hf_config.py maps it to a ModelConfig: model types
`kimi_linear`, `deepseek_v32` and the Kimi Linear + DSA hybrid) and `*.safetensors` shards under the published
tensor names; `tensor_names` maps our module names to the published names (first candidate present wins).

Routed experts come in any of: per-expert `experts.E.{w1,w3,w2}` / `experts.E.{gate,up,down}_proj` (bf16, fp32 or
DeepSeek FP8), fused `experts.gate_up_proj` [E, 2I, H] + `experts.down_proj` [E, H, I] (gate rows first), or MXFP4
`experts.gate_up_proj_blocks/_scales` + `down_proj_blocks/_scales` (gpt-oss naming; blocks [.., K/2] or
[.., K/32, 16]). Float experts are quantized to MXFP4 as they are read (or once, by `expertmesh checkpoint
convert`). DeepSeek FP8 weights (`F8_E4M3` + `weight_scale_inv`, 128×128 blocks) are dequantized on read.
Everything else keeps the dtype it was stored in. Tensors of layers past num_hidden_layers (DeepSeek's
multi-token-prediction layer) are not part of the served model and are skipped (`load_mtp` reads them, names and
shapes checked, for speculative decoding); any other unknown tensor is refused by name.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from expertmesh.checkpoint.files import safetensors_headers
from expertmesh.checkpoint.hf_config import HFCheckpointError, config_from_hf, moe_prefix
from expertmesh.kernels.mxfp4 import quantize_mxfp4
from expertmesh.model.config import MXFP4_BLOCK, ModelConfig
from expertmesh.model.transformer import MTPLayer, Transformer, materialize_, module_shapes

log = logging.getLogger("expertmesh.checkpoint.loader")

_FLOAT_DTYPES = {"F32", "BF16", "F16"}
_FP8 = "F8_E4M3"


# ----------------------------------------------------------------------------------------------- tensor names
def _attention_names(kind: str) -> dict[str, tuple[str, ...]]:
    """Our attention module's tensor suffix → published suffixes under `model.layers.L.self_attn.` (K3 names its
    KDA output gate and its MLA output gate both `g_proj`)."""
    if kind == "kda":
        names = {f"{p}_proj.weight": (f"{p}_proj.weight",) for p in "qkv"}
        names |= {f"{p}_conv.weight": (f"{p}_conv1d.weight",) for p in "qkv"}
        names |= {f"{p}_conv.bias": (f"{p}_conv1d.bias",) for p in "qkv"}
        names |= {
            "f_a.weight": ("f_a_proj.weight",),
            "f_b.weight": ("f_b_proj.weight",),
            "g_a.weight": ("g_a_proj.weight",),
            "g_b.weight": ("g_b_proj.weight",),
            "g_b.bias": ("g_b_proj.bias",),
            "b_proj.weight": ("b_proj.weight",),
            "A_log": ("A_log",),
            "dt_bias": ("dt_bias",),
            "o_norm.weight": ("o_norm.weight",),
            "o_proj.weight": ("o_proj.weight",),
            "g_proj.weight": ("g_proj.weight",),
            "g_proj.bias": ("g_proj.bias",),
        }
        return names
    return {
        "q_proj.weight": ("q_proj.weight",),
        "q_a.weight": ("q_a_proj.weight",),
        "q_a_norm.weight": ("q_a_layernorm.weight",),
        "q_b.weight": ("q_b_proj.weight",),
        "kv_a.weight": ("kv_a_proj_with_mqa.weight",),
        "kv_a_norm.weight": ("kv_a_layernorm.weight",),
        "kv_b.weight": ("kv_b_proj.weight",),
        "o_proj.weight": ("o_proj.weight",),
        "gate.weight": ("g_proj.weight",),
        "index_q.weight": ("indexer.wq_b.weight",),
        "index_k.weight": ("indexer.wk.weight",),
        "index_k_norm.weight": ("indexer.k_norm.weight",),
        "index_k_norm.bias": ("indexer.k_norm.bias",),
        "index_w.weight": ("indexer.weights_proj.weight",),
    }


_RESIDUAL_NAMES = {  # attention residuals (K3): our mix → the published norm / projection names
    "attn_res": "self_attention_res",
    "ffn_res": "mlp_res",
    "out_res": "output_attn_res",
}


def tensor_names(cfg: ModelConfig, prefix: str = "mlp", root: str = "") -> dict[str, tuple[str, ...]]:
    """Every non-expert module tensor of `cfg` → the published names it may be stored under (`prefix`: the FFN
    module name, see moe_prefix; `root`: what every text tensor's name starts with — K3's `language_model.`)."""
    ffn = {
        "moe.router.weight": ("gate.weight",),
        "moe.router_bias": ("gate.e_score_correction_bias",),
        **{f"moe.shared.{p}.weight": (f"shared_experts.{p}_proj.weight",) for p in ("gate", "up", "down")},
        **{f"mlp.{p}.weight": (f"{p}_proj.weight",) for p in ("gate", "up", "down")},
        "moe.latent_down.weight": ("routed_expert_down_proj.weight",),
        "moe.latent_norm.weight": ("routed_expert_norm.weight",),
        "moe.latent_up.weight": ("routed_expert_up_proj.weight",),
    }
    out = {}
    for name in module_shapes(cfg):
        if ".moe.experts." in name:
            continue
        if name.startswith(("vision_tower.", "mm_projector.")):
            out[name] = (_vision_name(name),)
            continue
        if not name.startswith("layers."):
            if name.startswith("out_res."):
                part = name.split(".")[1]  # norm | proj
                out[name] = (f"{root}model.{_RESIDUAL_NAMES['out_res']}_{part}.weight",)
                continue
            out[name] = (
                root
                + {
                    "embed.weight": "model.embed_tokens.weight",
                    "norm.weight": "model.norm.weight",
                    "lm_head.weight": "lm_head.weight",
                }[name],
            )
            continue
        _, layer, rest = name.split(".", 2)
        base = f"{root}model.layers.{layer}."
        mix = rest.split(".")[0]
        if mix in ("attn_res", "ffn_res"):
            out[name] = (f"{base}{_RESIDUAL_NAMES[mix]}_{rest.split('.')[1]}.weight",)
        elif rest in ("attn_norm.weight", "ffn_norm.weight"):
            out[name] = (
                base + ("input_layernorm.weight" if rest.startswith("attn") else "post_attention_layernorm.weight"),
            )
        elif rest.startswith("attn."):
            suffixes = _attention_names(cfg.layer_types[int(layer)])[rest[len("attn.") :]]
            out[name] = tuple(base + "self_attn." + s for s in suffixes)
        else:
            prefixes = (prefix, "mlp") if prefix != "mlp" else ("mlp",)
            out[name] = tuple(base + f"{p}.{s}" for p in prefixes for s in ffn[rest])
    return out


def _vision_name(ours: str) -> str:
    """Kimi K3's tower and projector (expertmesh/model/vision_k3.py) keep the published names at the checkpoint's
    root, except the projector's two linears, stored as `proj.0` / `proj.2` (an nn.Sequential with the GELU at 1;
    vLLM maps them to linear_1 / linear_2 the same way)."""
    for linear, stored in (
        ("mm_projector.linear_1.", "mm_projector.proj.0."),
        ("mm_projector.linear_2.", "mm_projector.proj.2."),
    ):
        if ours.startswith(linear):
            return stored + ours[len(linear) :]
    return ours


_MTP_OWN_NAMES = {  # an MTP layer's own tensors: ours under mtp.<j>. → published under model.layers.<n_layers+j>.
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "eh_proj.weight": "eh_proj.weight",
    "head_norm.weight": "shared_head.norm.weight",
    "head.weight": "shared_head.head.weight",
}
_MTP_SHARED = ("embed_tokens.weight",)  # DeepSeek-V3 repeats the embedding in its MTP layer: the model's own is used


def mtp_tensor_names(cfg: ModelConfig, prefix: str = "mlp", root: str = "") -> dict[str, tuple[str, ...]]:
    """Every non-expert tensor of the MTP layers (`Transformer(cfg, mtp=True).mtp`, names under `mtp.<j>.`) → the
    published names: the block's tensors as a main layer's of index n_layers + j with `cfg.mtp_layer_type`
    attention (no attention residuals), then enorm, hnorm, eh_proj and shared_head."""
    n = cfg.n_layers
    extended = cfg.model_copy(update={"layer_types": (*cfg.layer_types, *[cfg.mtp_layer_type] * cfg.n_mtp_layers)})
    out = {}
    for ours, names in tensor_names(extended, prefix, root).items():
        if not ours.startswith("layers.") or "_res." in ours:
            continue
        _, layer, rest = ours.split(".", 2)
        if int(layer) >= n:
            out[f"mtp.{int(layer) - n}.block.{rest}"] = names
    for j in range(cfg.n_mtp_layers):
        for ours, published in _MTP_OWN_NAMES.items():
            out[f"mtp.{j}.{ours}"] = (f"{root}model.layers.{n + j}.{published}",)
    return out


_EXPERT_FORMS = {
    # name of the form → (gate, up, down) published suffixes under `<moe prefix>.experts.`, {e} = expert id
    "w123": ("{e}.w1.weight", "{e}.w3.weight", "{e}.w2.weight"),
    "proj": ("{e}.gate_proj.weight", "{e}.up_proj.weight", "{e}.down_proj.weight"),
}
# compressed-tensors mxfp4-pack-quantized (Kimi K3): per expert `w{1,3,2}.weight_packed` uint8 [out, in/2] (even
# element in the low nibble) + `weight_scale` E8M0 [out, in/32] — this project's MXFP4 bytes, copied as they are
_CT_MXFP4 = ("{e}.w1.weight", "{e}.w3.weight", "{e}.w2.weight")
_CT_SCALE_DTYPES = ("U8", "F8_E8M0")
_VISION_PREFIXES = ("vision_tower.", "mm_projector.")  # skipped when the config has no vision (text only)


@dataclass(frozen=True)
class ExpertLayout:
    """How one MoE layer's routed experts are stored."""

    form: str  # "w123" | "proj" (per expert) | "fused" | "mxfp4" | "ct_mxfp4"
    base: str  # "model.layers.L.<prefix>.experts."


# ----------------------------------------------------------------------------------------------- reading
class SafetensorsDir:
    """The tensors of a directory of safetensors shards: name → file (from the index, else every shard's
    header), dtype and shape from the headers; reads lazily (memory-mapped), slices without loading the rest."""

    def __init__(self, path: Path):
        self.path = path
        self.files, self.file_of, self.header = safetensors_headers(path)

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
        # K3 keeps its text model under `language_model.` (beside its vision tower)
        self.root = "language_model." if any(n.startswith("language_model.") for n in self.files.header) else ""
        self.names: dict[str, str] = {}  # our module name → the published name found
        shapes = module_shapes(self.cfg)
        used: set[str] = set()
        for ours, candidates in tensor_names(self.cfg, self.prefix, self.root).items():
            found = next((c for c in candidates if c in self.files), None)
            if found is None:
                raise HFCheckpointError(
                    f"{path}: tensor {candidates[0]!r} missing (a {self.cfg.model_type} model "
                    f"with this config.json needs it for {ours})"
                )
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
        e, h, i = cfg.moe.n_routed_experts, cfg.expert_hidden_size, cfg.moe.expert_intermediate_size
        base = f"{self.root}model.layers.{layer}.{self.prefix}.experts."
        if base + _CT_MXFP4[0].format(e=0) + "_packed" in self.files:
            names = set()
            for x in range(e):
                for suffix, (rows, k) in zip(_CT_MXFP4, ((i, h), (i, h), (h, i))):
                    name = base + suffix.format(e=x)
                    self._check_any(name + "_packed", [(rows, k // 2)], ("U8",))
                    self._check_any(name + "_scale", [(rows, k // MXFP4_BLOCK)], _CT_SCALE_DTYPES)
                    names |= {name + "_packed", name + "_scale"}
            return ExpertLayout("ct_mxfp4", base), names
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
        raise HFCheckpointError(
            f"{self.path}: no routed experts found for layer {layer} (looked for "
            f"{base}0.w1.weight, {base}0.gate_proj.weight, {base}gate_up_proj, "
            f"{base}gate_up_proj_blocks)"
        )

    def _check_any(self, name: str, shapes: list[tuple[int, ...]], dtypes: tuple[str, ...]) -> None:
        if name not in self.files:
            raise HFCheckpointError(f"{self.path}: tensor {name!r} missing")
        dtype, found = self.files.header[name]
        where = self.files.file_of[name]
        if dtype not in dtypes:
            raise HFCheckpointError(f"{where}: tensor {name!r} has dtype {dtype}, expected {' or '.join(dtypes)}")
        if tuple(found) not in shapes:
            raise HFCheckpointError(
                f"{where}: tensor {name!r} has shape {list(found)}, expected "
                f"{' or '.join(str(list(s)) for s in shapes)}"
            )

    def _refuse_unknown(self, used: set[str]) -> None:
        n_layers = self.cfg.n_layers
        mtp, vision = set(), 0
        for name in sorted(self.files.header):
            if name in used:
                continue
            m = re.match(r"(?:language_model\.)?model\.layers\.(\d+)\.", name)
            if m and int(m.group(1)) >= n_layers:
                mtp.add(int(m.group(1)))  # multi-token-prediction layers: not part of the served model
                continue
            if name.endswith("rotary_emb.inv_freq"):
                continue
            if name.startswith(_VISION_PREFIXES) and self.cfg.vision is None:
                vision += 1
                continue
            raise HFCheckpointError(
                f"{self.files.file_of[name]}: unexpected tensor {name!r} (not part of a "
                f"{self.cfg.model_type} model with this config.json)"
            )
        if mtp:
            log.info(
                "%s: skipping %d multi-token-prediction layer(s) (%s): not part of the served model",
                self.path,
                len(mtp),
                ", ".join(map(str, sorted(mtp))),
            )
        if vision:
            log.info("%s: skipping the %d vision-tower tensors: this checkpoint is served text only", self.path, vision)

    # ---------------------------------------------------------------- MTP layers
    def load_mtp(self, model: Transformer, experts: bool = True) -> Transformer:
        """Give `model` (this directory's, loaded) its MTP layers as `model.mtp`, on its device in its dtype (the
        fp32 parameters fp32), every tensor of layers n_layers .. n_layers + n_mtp_layers - 1 found with the shape
        it needs and nothing else there; `experts=False`: no routed-expert buffers, as for an attention worker."""
        cfg, n = self.cfg, self.cfg.n_layers
        if not cfg.n_mtp_layers:
            raise HFCheckpointError(f"{self.path}: no MTP layers (config.json num_nextn_predict_layers is 0 or absent)")
        device, dtype = model.embed.weight.device, model.embed.weight.dtype
        with torch.device("meta"):
            model.mtp = torch.nn.ModuleList(MTPLayer(cfg, j, routed_experts=experts) for j in range(cfg.n_mtp_layers))
        materialize_(model.mtp, device, dtype)
        params = dict(model.mtp.named_parameters(prefix="mtp"))
        used: set[str] = set()
        with torch.no_grad():
            for ours, candidates in mtp_tensor_names(cfg, self.prefix, self.root).items():
                found = next((c for c in candidates if c in self.files), None)
                if found is None:
                    raise HFCheckpointError(f"{self.path}: tensor {candidates[0]!r} missing (the MTP layer's {ours})")
                self._check(found, tuple(params[ours].shape))
                params[ours].copy_(self._read_float(found).reshape(params[ours].shape))
                used |= {found, found + "_scale_inv"}
            for j, layer in enumerate(model.mtp):
                self.experts[n + j], names = self._expert_layout(n + j)
                used |= names
                if experts:
                    ids = list(range(cfg.moe.n_routed_experts))
                    for buf, t in self.expert_weights(n + j, ids).items():
                        getattr(layer.block.moe.experts, buf).copy_(t)
        pattern = re.compile(r"(?:language_model\.)?model\.layers\.(\d+)\.(.*)")
        for name in sorted(self.files.header):
            m = pattern.fullmatch(name)
            if m and n <= int(m.group(1)) < n + cfg.n_mtp_layers and name not in used:
                if m.group(2) not in _MTP_SHARED:
                    raise HFCheckpointError(
                        f"{self.files.file_of[name]}: unexpected tensor {name!r} in MTP layer {m.group(1)}"
                    )
        return model

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
        if layer not in self.experts:  # an MTP layer's, read by an expert worker without load_mtp
            self.experts[layer] = self._expert_layout(layer)[0]
        lay = self.experts[layer]
        h, i = self.cfg.expert_hidden_size, self.cfg.moe.expert_intermediate_size
        if lay.form == "ct_mxfp4":  # the packed bytes as stored: no re-quantization

            def packed(kind: str, suffixes: tuple[str, ...], rows: int, width: int) -> torch.Tensor:
                if not expert_ids:
                    return torch.empty(0, rows, width, dtype=torch.uint8)
                return torch.stack(
                    [
                        torch.cat(
                            [self.files.read(lay.base + sfx.format(e=x) + kind).view(torch.uint8) for sfx in suffixes]
                        )
                        for x in expert_ids
                    ]
                )

            return {
                "gate_up_blocks": packed("_packed", _CT_MXFP4[:2], 2 * i, h // 2),
                "gate_up_scales": packed("_scale", _CT_MXFP4[:2], 2 * i, h // MXFP4_BLOCK),
                "down_blocks": packed("_packed", _CT_MXFP4[2:], h, i // 2),
                "down_scales": packed("_scale", _CT_MXFP4[2:], h, i // MXFP4_BLOCK),
            }
        if lay.form == "mxfp4":
            out = {}
            for ours, p in (("gate_up", "gate_up_proj"), ("down", "down_proj")):
                blocks = (
                    torch.stack([self.files.read(lay.base + f"{p}_blocks", x) for x in expert_ids])
                    if expert_ids
                    else torch.empty(0, dtype=torch.uint8)
                )
                scales = (
                    torch.stack([self.files.read(lay.base + f"{p}_scales", x) for x in expert_ids])
                    if expert_ids
                    else torch.empty(0, dtype=torch.uint8)
                )
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
                blocks, scales = quantize_mxfp4(w.float())  # one expert's float weights at a time
                parts[f"{key}_blocks"].append(blocks)
                parts[f"{key}_scales"].append(scales)
        out = {}
        for key, packed in parts.items():
            rows, k = shapes[key.rsplit("_", 1)[0]]
            width = k // 2 if key.endswith("blocks") else k // MXFP4_BLOCK
            out[key] = torch.stack(packed) if packed else torch.empty(0, rows, width, dtype=torch.uint8)
        return out
