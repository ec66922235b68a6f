"""The trained model as a Kimi K3 Hugging Face directory, and back.

Written as `moonshotai/Kimi-K3` lays its checkpoint out (what checkpoint/hf_config + hf_layout read for every K3):
a `KimiK3ForConditionalGeneration` wrapper config (`model_type: kimi_k3`, the text model in `text_config`, with the
DSA indexer fields `index_topk`, `index_head_dim`, `index_n_heads` that make it the K3+DSA hybrid), every text tensor
under `language_model.` by its published name, routed experts in compressed-tensors `mxfp4-pack-quantized`
(`weight_packed` + E8M0 `weight_scale` per expert and projection), everything else bf16 (the fp32 parameters of
model/config.FP32_PARAMETERS in fp32), one MTP layer after the main layers (`num_nextn_predict_layers: 1`), the
TikToken tokenizer files beside, safetensors shards of at most `MAX_SHARD_BYTES`.

Beside the checkpoint, `experts-bf16.safetensors` keeps the experts' float masters in bf16 (what the model was
before MXFP4), so bench/quality.py can measure what quantization costs.

Shapes: V vocabulary, H hidden, E routed experts, W the experts' width (latent), I their intermediate size.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from expertmesh.checkpoint.hf_config import config_from_hf
from expertmesh.checkpoint.hf_layout import tensor_names
from expertmesh.kernels.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from expertmesh.model.config import FP32_PARAMETERS, ModelConfig
from expertmesh.train.model import TrainModel

ROOT = "language_model."
MOE = "block_sparse_moe"
MAX_SHARD_BYTES = 4 << 20  # no file over 5 MB in the repository
MASTERS_FILE = "experts-bf16.safetensors"
TOKENIZER_FILES = ("tiktoken.model", "tokenizer_config.json")

# K3's published quantization block: compressed-tensors MXFP4 for the routed experts, the rest left as it is
QUANTIZATION_CONFIG = {
    "quant_method": "compressed-tensors",
    "format": "mxfp4-pack-quantized",
    "quantization_status": "compressed",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "format": "mxfp4-pack-quantized",
            "weights": {
                "num_bits": 4,
                "type": "float",
                "strategy": "group",
                "group_size": 32,
                "symmetric": True,
                "dynamic": False,
                "scale_dtype": "torch.uint8",
                "zp_dtype": None,
                "observer": "minmax",
                "actorder": None,
            },
            "input_activations": None,
            "output_activations": None,
        }
    },
    "ignore": [
        "lm_head",
        "re:.*self_attn.*",
        "re:.*shared_experts.*",
        "re:.*mlp\\..*",
        "re:.*block_sparse_moe\\.gate$",
        "re:.*routed_expert_(down|up)_proj$",
        "re:.*eh_proj$",
        "re:.*shared_head.*",
        "re:vision_tower.*",
        "re:mm_projector.*",
    ],
}


@dataclass(frozen=True)
class Shape:
    """The model's size. K3's architecture at toy scale: every fourth layer gated DSA (the last one), the first
    layer dense, the rest latent MoE with 2 shared experts; widths multiples of 32 where MXFP4 needs them."""

    hidden: int = 192
    layers: int = 4
    dense_intermediate: int = 384
    heads: int = 4  # MLA heads = KDA heads
    kda_head_dim: int = 32
    experts: int = 16
    top_k: int = 4
    shared: int = 2
    expert_intermediate: int = 96
    latent: int = 64
    q_lora: int = 64
    kv_lora: int = 64
    qk_nope: int = 32
    qk_rope: int = 16
    v_head: int = 32
    index_heads: int = 4
    index_head_dim: int = 32
    index_topk: int = 64
    attn_res_block: int = 2
    max_context: int = 4096


def text_config(s: Shape, vocab_size: int, special: dict[str, int]) -> dict:
    """K3's `text_config` (Kimi Linear's keys, K3's additions, DeepSeek-V3.2's indexer fields)."""
    full = [i + 1 for i in range(s.layers) if (i + 1) % 4 == 0]  # 1-based, as K3 writes them
    return {
        "architectures": ["KimiLinearForCausalLM"],
        "model_type": "kimi_linear",
        "vocab_size": vocab_size,
        "hidden_size": s.hidden,
        "intermediate_size": s.dense_intermediate,
        "num_hidden_layers": s.layers,
        "num_attention_heads": s.heads,
        "num_key_value_heads": s.heads,
        "hidden_act": "situ",
        "activation_situ_beta": 4.0,
        "activation_situ_linear_beta": 25.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "bos_token_id": special["[BOS]"],
        "eos_token_id": special["<|end_of_msg|>"],
        "pad_token_id": special["[PAD]"],
        "max_position_embeddings": s.max_context,
        "num_experts": s.experts,
        "num_experts_per_token": s.top_k,
        "num_shared_experts": s.shared,
        "moe_intermediate_size": s.expert_intermediate,
        "routed_expert_hidden_size": s.latent,
        "latent_moe_use_norm": True,
        "moe_renormalize": True,
        "moe_router_activation_func": "sigmoid",
        "routed_scaling_factor": 2.5,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "use_grouped_topk": False,
        "num_expert_group": 1,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "q_lora_rank": s.q_lora,
        "kv_lora_rank": s.kv_lora,
        "qk_nope_head_dim": s.qk_nope,
        "qk_rope_head_dim": s.qk_rope,
        "v_head_dim": s.v_head,
        "mla_use_nope": True,
        "mla_use_output_gate": True,
        "attn_res_block_size": s.attn_res_block,
        "linear_attn_config": {
            "kda_layers": [i + 1 for i in range(s.layers) if i + 1 not in full],
            "full_attn_layers": full,
            "num_heads": s.heads,
            "head_dim": s.kda_head_dim,
            "short_conv_kernel_size": 4,
            "gate_lower_bound": -5.0,
            "use_full_rank_gate": True,
        },
        "index_topk": s.index_topk,
        "index_head_dim": s.index_head_dim,
        "index_n_heads": s.index_heads,
        "num_nextn_predict_layers": 1,
        "quantization_config": QUANTIZATION_CONFIG,
    }


def wrapper_config(text: dict, special: dict[str, int], shape: Shape) -> dict:
    return {
        "architectures": ["KimiK3ForConditionalGeneration"],
        "model_type": "kimi_k3",
        "text_config": text,
        "media_placeholder_token_id": special["<|kimi_image_placeholder|>"],
        "pad_token_id": special["[PAD]"],
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "quantization_config": QUANTIZATION_CONFIG,
        "expertmesh_training_shape": asdict(shape),
    }


def model_config(raw: dict, name: str) -> ModelConfig:
    """The ModelConfig the serving loader derives from this config.json (the one both sides use)."""
    return config_from_hf(raw, set(), name=name)


# ----------------------------------------------------------------------------------------------- names
def published_names(cfg: ModelConfig) -> dict[str, str]:
    """Every non-expert tensor of TrainModel → its published name: the main layers through hf_layout's map (so
    the loader finds exactly what it looks for); the MTP layer as model.layers.<n_layers>.* with its own parts."""
    main = {ours: names[0] for ours, names in tensor_names(cfg, MOE, ROOT).items()}
    extended = cfg.model_copy(update={"layer_types": (*cfg.layer_types, "dsa")})
    n = cfg.n_layers
    layer_n = {
        ours.replace(f"layers.{n}.", "mtp.block.", 1): names[0]
        for ours, names in tensor_names(extended, MOE, ROOT).items()
        if ours.startswith(f"layers.{n}.") and "_res." not in ours
    }
    base = f"{ROOT}model.layers.{n}."
    mtp = {
        "mtp.enorm.weight": base + "enorm.weight",
        "mtp.hnorm.weight": base + "hnorm.weight",
        "mtp.eh_proj.weight": base + "eh_proj.weight",
        "mtp.head_norm.weight": base + "shared_head.norm.weight",
        "mtp.head.weight": base + "shared_head.head.weight",
    }
    return main | layer_n | mtp


def expert_layers(model: TrainModel) -> dict[str, str]:
    """TrainModel's expert modules → the published `…block_sparse_moe.experts.` prefix of their layer."""
    cfg = model.cfg
    out = {f"layers.{i}.moe.experts": f"{ROOT}model.layers.{i}.{MOE}.experts." for i in cfg.moe_layers}
    out["mtp.block.moe.experts"] = f"{ROOT}model.layers.{cfg.n_layers}.{MOE}.experts."
    return out


def stored(name: str, t: torch.Tensor) -> torch.Tensor:
    return t.detach().float() if name.endswith(FP32_PARAMETERS) else t.detach().to(torch.bfloat16)


# ----------------------------------------------------------------------------------------------- writing
def write_checkpoint(model: TrainModel, raw_config: dict, tokenizer_dir: Path, out: Path) -> Path:
    """Write `model` (trained) as a K3 directory into `out` (replaced); the tokenizer files copied from
    `tokenizer_dir`; the experts' bf16 masters beside as MASTERS_FILE."""
    out = Path(out)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    names = published_names(model.cfg)
    state = model.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    for ours, t in state.items():
        if ".experts." in ours:
            continue
        if ours not in names:
            raise KeyError(f"{ours}: no published name (export.published_names)")
        tensors[names[ours]] = stored(ours, t).contiguous()
    masters: dict[str, torch.Tensor] = {}
    i = model.cfg.moe.expert_intermediate_size
    for module, prefix in expert_layers(model).items():
        gate_up, down = state[module + ".gate_up"].float(), state[module + ".down"].float()
        for e in range(gate_up.shape[0]):
            for w, proj in ((gate_up[e, :i], "w1"), (gate_up[e, i:], "w3"), (down[e], "w2")):
                blocks, scales = quantize_mxfp4(w.contiguous())
                tensors[f"{prefix}{e}.{proj}.weight_packed"] = blocks.contiguous()
                tensors[f"{prefix}{e}.{proj}.weight_scale"] = scales.contiguous()
                masters[f"{prefix}{e}.{proj}.weight"] = w.to(torch.bfloat16).contiguous()
    _write_shards(tensors, out)
    save_file(masters, str(out / MASTERS_FILE), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(raw_config, indent=2) + "\n")
    text = raw_config["text_config"]
    gen = {"bos_token_id": text["bos_token_id"], "eos_token_id": text["eos_token_id"], "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen) + "\n")
    for name in TOKENIZER_FILES:
        shutil.copyfile(Path(tokenizer_dir) / name, out / name)
    return out


def _write_shards(tensors: dict[str, torch.Tensor], out: Path) -> None:
    groups: list[list[str]] = [[]]
    size = 0
    for name in sorted(tensors):
        n = tensors[name].numel() * tensors[name].element_size()
        if groups[-1] and size + n > MAX_SHARD_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += n
    weight_map = {}
    for k, group in enumerate(groups, start=1):
        fname = f"model-{k:05d}-of-{len(groups):05d}.safetensors"
        save_file({n: tensors[n] for n in group}, str(out / fname), metadata={"format": "pt"})
        weight_map |= {n: fname for n in group}
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1) + "\n")


# ----------------------------------------------------------------------------------------------- reading
def load_train_model(directory: Path, experts: str = "mxfp4") -> TrainModel:
    """A written directory back as a TrainModel (for measuring it): `experts` "mxfp4" (the checkpoint's packed
    experts, dequantized exactly) or "bf16" (the masters of MASTERS_FILE)."""
    directory = Path(directory)
    raw = json.loads((directory / "config.json").read_text())
    cfg = model_config(raw, directory.name)
    model = TrainModel(cfg, mtp=True)
    index = json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]

    def read(name: str, file: str | None = None) -> torch.Tensor:
        with safe_open(str(directory / (file or index[name])), framework="pt") as f:
            return f.get_tensor(name)

    state = {}
    for ours, name in published_names(cfg).items():
        state[ours] = read(name).float()
    i = cfg.moe.expert_intermediate_size
    for module, prefix in expert_layers(model).items():
        per_expert: dict[str, list[torch.Tensor]] = {"w1": [], "w3": [], "w2": []}
        for e in range(cfg.moe.n_routed_experts):
            for proj in per_expert:
                if experts == "bf16":
                    w = read(f"{prefix}{e}.{proj}.weight", MASTERS_FILE).float()
                else:
                    blocks = read(f"{prefix}{e}.{proj}.weight_packed")
                    w = dequantize_mxfp4(blocks, read(f"{prefix}{e}.{proj}.weight_scale"), torch.float32)
                per_expert[proj].append(w)
        state[module + ".gate_up"] = torch.cat([torch.stack(per_expert["w1"]), torch.stack(per_expert["w3"])], 1)
        state[module + ".down"] = torch.stack(per_expert["w2"])
        assert state[module + ".gate_up"].shape[1] == 2 * i
    model.load_state_dict(state)
    model.set_qat(False)  # the weights are already what they are: MXFP4 values or the bf16 masters
    return model.eval()


def keep_main_model(out: Path, source: Path, n_layers: int) -> None:
    """Rewrite the checkpoint written to `out` with every tensor outside its MTP layers (model.layers.<i>.,
    i >= n_layers) — and those experts' bf16 masters — taken from `source` bit for bit. A run that trained only the
    MTP layer (loop.TrainConfig.init, steps 0) would otherwise re-quantize the main experts from their bf16 masters,
    which moves a few MXFP4 codes: the main model it drafts for must stay the one it was distilled from."""
    out, source = Path(out), Path(source)

    def is_mtp(name: str) -> bool:
        head, _, rest = name.partition(f"{ROOT}model.layers.")
        return not head and bool(rest) and int(rest.split(".", 1)[0]) >= n_layers

    def read_all(directory: Path, files) -> dict[str, torch.Tensor]:
        tensors = {}
        for file in files:
            with safe_open(str(directory / file), framework="pt") as f:
                tensors |= {name: f.get_tensor(name) for name in f.keys()}
        return tensors

    def shard_files(directory: Path) -> list[str]:
        return sorted(set(json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"].values()))

    for files, write in (
        (shard_files(out), lambda tensors: _write_shards(tensors, out)),
        ([MASTERS_FILE], lambda tensors: save_file(tensors, str(out / MASTERS_FILE), metadata={"format": "pt"})),
    ):
        mine, theirs = read_all(out, files), read_all(source, shard_files(source) if files != [MASTERS_FILE] else files)
        if set(mine) != set(theirs):
            raise ValueError(
                f"{source}: its tensors are not this model's ({len(set(mine) ^ set(theirs))} names differ)"
            )
        for file in files:
            (out / file).unlink()
        write({name: (t if is_mtp(name) else theirs[name]) for name, t in mine.items()})
