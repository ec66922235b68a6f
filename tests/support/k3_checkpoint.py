"""A tiny random-weight Kimi K3 checkpoint, written by the tests from K3's published layout — not by expertmesh.

Hugging Face directory as `moonshotai/Kimi-K3` lays it out: a `KimiK3ForConditionalGeneration` wrapper config
(`model_type: kimi_k3`, the text model's fields in `text_config`, a `vision_config`), every text tensor under
`language_model.`, safetensors shards + index, and the tokenizer files. By default it carries no vision tensors (a
text-only checkpoint); `vision=True` adds a tiny MoonViT3d tower + patchmergerv2 projector at the checkpoint's root
under the published names (`vision_tower.patch_embed.*`, `vision_tower.encoder.blocks.N.{norm0, wqkv, wo, norm1,
mlp.fc0, mlp.fc1}`, `vision_tower.encoder.final_layernorm`, `mm_projector.{proj.0, proj.2, post_norm}`, as vLLM's
and SGLang's K3 loaders read them) with a `vision_config` at that width, and `media_placeholder_token_id` names
`<|media_pad|>` (as the published config's 163605 does). Tensor names, shapes
and config keys follow llama.cpp's `conversion/kimi_k3.py` and vLLM's `vllm/models/kimi_k3/`.

Routed experts come in two variants of ONE model:
- `bf16`: `…block_sparse_moe.experts.{e}.w{1,2,3}.weight` in bf16;
- `mxfp4`: compressed-tensors `mxfp4-pack-quantized`: `weight_packed` uint8 [out, in/2] (element 2j in the low
  nibble of byte j, 2j+1 in the high one; each nibble an OCP E2M1 code) and `weight_scale` uint8 [out, in/32]
  (E8M0: 2^(s − 127) per 32 consecutive inputs), with the `quantization_config` block.
Every expert weight is an E2M1 value times its block's scale, and each block holds a ±4 or ±6 (so the OCP
"floor" scale rule, e = floor(log2 max|x|) − 2, finds the same scale) and no −0: the bf16 variant quantized at
load gives the mxfp4 variant's bytes bit for bit.

Every tensor is drawn from its own generator, seeded by (seed, tensor name): adding MTP layers or indexer
tensors leaves every other tensor as it was, and the same files come out on any machine (torch's CPU generator).

`tests/data/k3/oracle.json` holds what llama.cpp computes from these checkpoints (scripts/k3_oracle.py writes it
by running this file); changing anything that alters the weights or the config means rerunning that script.

    python tests/support/k3_checkpoint.py OUT_DIR [--experts bf16|mxfp4] [--seed 0] [--mtp] [--with-indexer]
                                                  [--vision]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import zlib
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

PREFIX = "language_model."
VARIANTS = ("bf16", "mxfp4")

# The tiny shape. llama.cpp's kimi-k3 needs num_attention_heads == num_key_value_heads == the KDA head count;
# expertmesh's MXFP4 needs the expert widths (routed_expert_hidden_size, moe_intermediate_size) to be multiples
# of 32.
HIDDEN = 64
HEADS = 4  # MLA heads = KDA heads = num_key_value_heads
KDA_HEAD_DIM = 16  # KDA d = HEADS · KDA_HEAD_DIM = 64
CONV_KERNEL = 4
DENSE_INTERMEDIATE = 96
MOE_INTERMEDIATE = 32  # per routed expert; the shared MLP is N_SHARED times as wide
LATENT = 32  # routed_expert_hidden_size (< HIDDEN: the latent MoE)
N_EXPERTS, TOP_K, N_SHARED = 8, 2, 2
Q_LORA, KV_LORA, QK_NOPE, QK_ROPE, V_HEAD = 32, 32, 16, 8, 16
N_LAYERS = 6
FULL_ATTN_LAYERS = [2, 6]  # 1-based, as K3's linear_attn_config has them: layers 1 and 5 are MLA
ATTN_RES_BLOCK = 2  # 6 layers → 3 banked blocks
FIRST_K_DENSE = 1
INDEXER = {"index_topk": 8, "index_head_dim": 16, "index_n_heads": 16}
# the tiny vision tower (vision=True): K3's published vision_config keys, every variant at K3's value; a 6×6
# position grid, so every image's grid is resampled (bilinear)
VISION = {
    "_attn_implementation": "flash_attention_2",
    "activation_func": "gelu_pytorch_tanh",
    "attn_bias": False,
    "init_pos_emb_height": 6,
    "init_pos_emb_time": 4,
    "init_pos_emb_width": 6,
    "linear_bias": False,
    "merge_kernel_size": [2, 2],
    "merge_type": "sd2_tpool",
    "mlp_type": "mlp2",
    "mm_hidden_size": 32,
    "mm_projector_type": "patchmergerv2",
    "model_type": "kimi_k3_vision",
    "norm_type": "rmsnorm",
    "patch_embed_proj_bias": False,
    "patch_size": 14,
    "pos_emb_interpolation_mode": "bilinear",
    "pos_emb_type": "divided_fixed",
    "projector_hidden_act": "gelu",
    "projector_ln_eps": 1e-5,
    "qkv_hidden_size": 48,
    "text_hidden_size": HIDDEN,
    "vt_hidden_size": 32,
    "vt_intermediate_size": 64,
    "vt_num_attention_heads": 2,
    "vt_num_hidden_layers": 2,
}

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

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
    # everything but the routed experts stays bf16
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


# ----------------------------------------------------------------------------------------------- tokenizer
def _tokenizer(out: Path) -> dict:
    """The tiny K3 tokenizer of tests/support/k3_fixtures.py (tiktoken.model + tokenizer_config.json with K3's special
    tokens); → {"vocab_size": BPE ranks + reserved ids, "special": {content: id}}."""
    try:
        from support import k3_fixtures
    except ImportError:  # run as a script: tests/ is not on sys.path
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from support import k3_fixtures
    special = k3_fixtures.write_k3_tokenizer(out, config=False)
    n_base = sum(1 for line in (out / "tiktoken.model").read_text().splitlines() if line.strip())
    return {"vocab_size": n_base + k3_fixtures.N_RESERVED, "special": special}


# ----------------------------------------------------------------------------------------------- config
def text_config(
    vocab_size: int, special: dict[str, int], *, experts: str = "bf16", mtp: bool = False, with_indexer: bool = False
) -> dict:
    """K3's `text_config` (KimiLinearConfig keys) for the tiny model. Every key llama.cpp's converter reads with
    `[...]` is present (transformers does not know kimi_k3, so nobody fills in defaults)."""
    kda = [i + 1 for i in range(N_LAYERS) if i + 1 not in FULL_ATTN_LAYERS]
    cfg = {
        "architectures": ["KimiLinearForCausalLM"],
        "model_type": "kimi_linear",
        "vocab_size": vocab_size,
        "hidden_size": HIDDEN,
        "intermediate_size": DENSE_INTERMEDIATE,
        "num_hidden_layers": N_LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": HEADS,
        "hidden_act": "situ",
        "activation_situ_beta": 4.0,
        "activation_situ_linear_beta": 25.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "bos_token_id": special["[BOS]"],
        "eos_token_id": special["<|end_of_msg|>"],
        "pad_token_id": special["[PAD]"],
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        # latent MoE, sigmoid routing with the noaux_tc correction bias
        "num_experts": N_EXPERTS,
        "num_experts_per_token": TOP_K,
        "num_shared_experts": N_SHARED,
        "moe_intermediate_size": MOE_INTERMEDIATE,
        "routed_expert_hidden_size": LATENT,
        "latent_moe_use_norm": True,
        "moe_renormalize": True,
        "moe_router_activation_func": "sigmoid",
        "routed_scaling_factor": 2.5,
        "first_k_dense_replace": FIRST_K_DENSE,
        "moe_layer_freq": 1,
        "use_grouped_topk": True,
        "num_expert_group": 1,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        # NoPE MLA with q-LoRA and the sigmoid output gate
        "q_lora_rank": Q_LORA,
        "kv_lora_rank": KV_LORA,
        "qk_nope_head_dim": QK_NOPE,
        "qk_rope_head_dim": QK_ROPE,
        "v_head_dim": V_HEAD,
        "mla_use_nope": True,
        "mla_use_output_gate": True,
        "attn_res_block_size": ATTN_RES_BLOCK,
        "linear_attn_config": {
            "kda_layers": kda,
            "full_attn_layers": list(FULL_ATTN_LAYERS),
            "num_heads": HEADS,
            "head_dim": KDA_HEAD_DIM,
            "short_conv_kernel_size": CONV_KERNEL,
            "gate_lower_bound": -5.0,
            "use_full_rank_gate": True,
        },
        "num_nextn_predict_layers": 1 if mtp else 0,
    }
    if with_indexer:
        cfg |= INDEXER
    if experts == "mxfp4":
        cfg["quantization_config"] = QUANTIZATION_CONFIG
    return cfg


def wrapper_config(text: dict, special: dict[str, int], *, vision: bool = False) -> dict:
    cfg = {
        "architectures": ["KimiK3ForConditionalGeneration"],
        "model_type": "kimi_k3",
        "text_config": text,
        "vision_config": {
            "model_type": "kimi_k3_vision",
            "patch_size": 14,
            "vt_hidden_size": 1024,
            "vt_num_hidden_layers": 27,
            "vt_num_attention_heads": 12,
            "merge_kernel_size": [2, 2],
            "mm_projector_type": "patchmergerv2",
        },
        "media_placeholder_token_id": special["<|kimi_image_placeholder|>"],
        "image_placeholder": "<|kimi_image_placeholder|>",
        "pad_token_id": special["[PAD]"],
        "ignore_index": -100,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    if vision:
        cfg["vision_config"] = dict(VISION)
        cfg["media_placeholder_token_id"] = special["<|media_pad|>"]
    if "quantization_config" in text:
        cfg["quantization_config"] = text["quantization_config"]  # where vLLM's KimiK3Config puts it too
    return cfg


# ----------------------------------------------------------------------------------------------- weights
class _Weights:
    """Draws each tensor from a generator seeded by (seed, name)."""

    def __init__(self, seed: int):
        self.seed = seed

    def gen(self, name: str) -> torch.Generator:
        return torch.Generator().manual_seed((self.seed << 32) + zlib.crc32(name.encode()))

    def normal(self, name: str, *shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen(name)) * std

    def linear(self, name: str, out: int, inp: int, gain: float = 1.0) -> torch.Tensor:
        return self.normal(name, out, inp, std=gain / math.sqrt(inp)).bfloat16()

    def norm(self, name: str, n: int) -> torch.Tensor:
        return (1.0 + 0.1 * torch.randn(n, generator=self.gen(name))).bfloat16()


def mxfp4_codes(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w fp32 [out, in] → (codes uint8 [out, in], exponents int [out, in/32]) with w ≈ E2M1[code] · 2^exp:
    exp = floor(log2(block max |w|)) − 2, codes the nearest E2M1 value (saturating at 6), never −0."""
    out, inp = w.shape
    blk = w.reshape(out, inp // 32, 32)
    _, p = torch.frexp(blk.abs().amax(-1))  # amax = m · 2^p, m in [0.5, 1)
    exp = p - 1 - 2
    x = blk / torch.exp2(exp.double()).float()[..., None]
    grid = torch.tensor(E2M1)
    mag = (x.abs()[..., None] - grid).abs().argmin(-1)  # nearest magnitude (|x| < 8: max is 6)
    code = torch.where((x < 0) & (mag > 0), mag | 8, mag).to(torch.uint8)
    return code.reshape(out, inp), exp


def mxfp4_value(code: torch.Tensor, exp: torch.Tensor) -> torch.Tensor:
    """The exact fp32 values of E2M1 codes [out, in] under per-32 exponents [out, in/32]."""
    lut = torch.tensor(E2M1 + tuple(-v for v in E2M1))
    scale = torch.exp2(exp.double()).float().repeat_interleave(32, 1)
    return lut[code.long()] * scale


def expert_tensors(name: str, w: torch.Tensor, experts: str) -> dict[str, torch.Tensor]:
    """One routed-expert weight (random fp32) as the variant stores it, values on the MXFP4 grid either way."""
    code, exp = mxfp4_codes(w)
    top = (code & 7).reshape(code.shape[0], -1, 32).amax(-1)
    assert bool((top >= 6).all()), name  # a ±4 or ±6 in every block: the scale is the canonical one
    if experts == "bf16":
        v = mxfp4_value(code, exp)
        b = v.bfloat16()
        assert torch.equal(b.float(), v), name  # exact in bf16
        return {name + ".weight": b}
    packed = (code[:, 0::2] | (code[:, 1::2] << 4)).to(torch.uint8)
    return {name + ".weight_packed": packed.contiguous(), name + ".weight_scale": (exp + 127).to(torch.uint8)}


def model_tensors(text: dict, *, experts: str, seed: int) -> dict[str, torch.Tensor]:
    """Every text tensor (names with the `language_model.` prefix) of the tiny K3 described by `text`."""
    R = _Weights(seed)
    V, H = text["vocab_size"], HIDDEN
    d = HEADS * KDA_HEAD_DIM
    T: dict[str, torch.Tensor] = {}

    def put(name: str, make):
        T[PREFIX + name] = make(PREFIX + name)

    put("model.embed_tokens.weight", lambda n: R.normal(n, V, H, std=1.0).bfloat16())
    put("model.norm.weight", lambda n: R.norm(n, H))
    put("lm_head.weight", lambda n: R.linear(n, V, H, gain=2.0))
    put("model.output_attn_res_norm.weight", lambda n: R.norm(n, H))
    put("model.output_attn_res_proj.weight", lambda n: R.normal(n, 1, H, std=0.3).bfloat16())

    def layer(i: int, *, mla: bool, dense: bool, attn_res: bool):
        L = f"model.layers.{i}."
        put(L + "input_layernorm.weight", lambda n: R.norm(n, H))
        put(L + "post_attention_layernorm.weight", lambda n: R.norm(n, H))
        if attn_res:
            for part in ("self_attention_res", "mlp_res"):
                put(L + f"{part}_norm.weight", lambda n: R.norm(n, H))
                put(L + f"{part}_proj.weight", lambda n: R.normal(n, 1, H, std=0.3).bfloat16())
        A = L + "self_attn."
        if not mla:  # KDA
            for p in "qkv":
                put(A + f"{p}_proj.weight", lambda n: R.linear(n, d, H))
                put(A + f"{p}_conv1d.weight", lambda n: R.normal(n, d, 1, CONV_KERNEL, std=0.5).bfloat16())
            put(A + "f_a_proj.weight", lambda n: R.linear(n, KDA_HEAD_DIM, H))
            put(A + "f_b_proj.weight", lambda n: R.linear(n, d, KDA_HEAD_DIM))
            put(A + "b_proj.weight", lambda n: R.linear(n, HEADS, H))
            put(A + "A_log", lambda n: torch.log(torch.empty(HEADS).uniform_(1, 16, generator=R.gen(n))).float())
            put(A + "dt_bias", lambda n: R.normal(n, d, std=0.5).float())
            put(A + "g_proj.weight", lambda n: R.linear(n, d, H))
            put(A + "o_norm.weight", lambda n: R.norm(n, KDA_HEAD_DIM))
            put(A + "o_proj.weight", lambda n: R.linear(n, H, d))
        else:  # NoPE MLA, q-LoRA, output gate
            put(A + "q_a_proj.weight", lambda n: R.linear(n, Q_LORA, H))
            put(A + "q_a_layernorm.weight", lambda n: R.norm(n, Q_LORA))
            put(A + "q_b_proj.weight", lambda n: R.linear(n, HEADS * (QK_NOPE + QK_ROPE), Q_LORA, gain=2.0))
            put(A + "kv_a_proj_with_mqa.weight", lambda n: R.linear(n, KV_LORA + QK_ROPE, H, gain=2.0))
            put(A + "kv_a_layernorm.weight", lambda n: R.norm(n, KV_LORA))
            put(A + "kv_b_proj.weight", lambda n: R.linear(n, HEADS * (QK_NOPE + V_HEAD), KV_LORA))
            put(A + "g_proj.weight", lambda n: R.linear(n, HEADS * V_HEAD, H))
            put(A + "o_proj.weight", lambda n: R.linear(n, H, HEADS * V_HEAD))
            if "index_topk" in text:  # DeepSeek-V3.2's lightning indexer (deepseek_v32 names)
                nh, hd = text["index_n_heads"], text["index_head_dim"]
                put(A + "indexer.wq_b.weight", lambda n: R.linear(n, nh * hd, Q_LORA, gain=2.0))
                put(A + "indexer.wk.weight", lambda n: R.linear(n, hd, H, gain=2.0))
                put(A + "indexer.k_norm.weight", lambda n: R.norm(n, hd))
                put(A + "indexer.k_norm.bias", lambda n: R.normal(n, hd, std=0.1).bfloat16())
                put(A + "indexer.weights_proj.weight", lambda n: R.linear(n, nh, H))
        if dense:
            put(L + "mlp.gate_proj.weight", lambda n: R.linear(n, DENSE_INTERMEDIATE, H, gain=2.0))
            put(L + "mlp.up_proj.weight", lambda n: R.linear(n, DENSE_INTERMEDIATE, H, gain=2.0))
            put(L + "mlp.down_proj.weight", lambda n: R.linear(n, H, DENSE_INTERMEDIATE))
            return
        M = L + "block_sparse_moe."
        put(M + "gate.weight", lambda n: R.linear(n, N_EXPERTS, H, gain=2.0))
        put(M + "gate.e_score_correction_bias", lambda n: R.normal(n, N_EXPERTS, std=0.1).float())
        put(M + "routed_expert_down_proj.weight", lambda n: R.linear(n, LATENT, H))
        put(M + "routed_expert_norm.weight", lambda n: R.norm(n, LATENT))
        put(M + "routed_expert_up_proj.weight", lambda n: R.linear(n, H, LATENT))
        for p in ("gate_proj", "up_proj"):
            put(M + f"shared_experts.{p}.weight", lambda n: R.linear(n, MOE_INTERMEDIATE * N_SHARED, H, gain=2.0))
        put(M + "shared_experts.down_proj.weight", lambda n: R.linear(n, H, MOE_INTERMEDIATE * N_SHARED))
        for e in range(N_EXPERTS):
            for wn, (o, inp, gain) in (
                ("w1", (MOE_INTERMEDIATE, LATENT, 2.0)),
                ("w3", (MOE_INTERMEDIATE, LATENT, 2.0)),
                ("w2", (LATENT, MOE_INTERMEDIATE, 1.0)),
            ):
                name = PREFIX + M + f"experts.{e}.{wn}"
                w = R.normal(name, o, inp, std=gain / math.sqrt(inp))
                T.update(expert_tensors(name, w, experts))

    full = {i - 1 for i in text["linear_attn_config"]["full_attn_layers"]}
    n_layers = text["num_hidden_layers"]
    for i in range(n_layers):
        layer(i, mla=i in full, dense=i < text["first_k_dense_replace"], attn_res=True)
    for j in range(text.get("num_nextn_predict_layers", 0)):
        # an MTP layer (vLLM's KimiK3MTP): a full-attention MoE block without attention residuals, plus its
        # input projections and head
        i = n_layers + j
        layer(i, mla=True, dense=False, attn_res=False)
        L = f"model.layers.{i}."
        put(L + "enorm.weight", lambda n: R.norm(n, H))
        put(L + "hnorm.weight", lambda n: R.norm(n, H))
        put(L + "eh_proj.weight", lambda n: R.linear(n, H, 2 * H))
        put(L + "shared_head.norm.weight", lambda n: R.norm(n, H))
        put(L + "shared_head.head.weight", lambda n: R.linear(n, V, H, gain=2.0))
    return T


def vision_tensors(seed: int) -> dict[str, torch.Tensor]:
    """The tiny tower and projector of VISION under their published names (bf16, each from its own generator)."""
    R = _Weights(seed)
    v = VISION
    d, q, i, p = v["vt_hidden_size"], v["qkv_hidden_size"], v["vt_intermediate_size"], v["patch_size"]
    merged = d * v["merge_kernel_size"][0] * v["merge_kernel_size"][1]
    T: dict[str, torch.Tensor] = {}

    def put(name: str, make):
        T[name] = make(name)

    put(
        "vision_tower.patch_embed.proj.weight",
        lambda n: R.normal(n, d, 3, p, p, std=1 / math.sqrt(3 * p * p)).bfloat16(),
    )
    put(
        "vision_tower.patch_embed.pos_emb.weight",
        lambda n: R.normal(n, v["init_pos_emb_height"], v["init_pos_emb_width"], d, std=0.5).bfloat16(),
    )
    for b in range(v["vt_num_hidden_layers"]):
        B = f"vision_tower.encoder.blocks.{b}."
        put(B + "norm0.weight", lambda n: R.norm(n, d))
        put(B + "norm1.weight", lambda n: R.norm(n, d))
        put(B + "wqkv.weight", lambda n: R.linear(n, 3 * q, d, gain=2.0))
        put(B + "wo.weight", lambda n: R.linear(n, d, q))
        put(B + "mlp.fc0.weight", lambda n: R.linear(n, i, d, gain=2.0))
        put(B + "mlp.fc1.weight", lambda n: R.linear(n, d, i))
    put("vision_tower.encoder.final_layernorm.weight", lambda n: R.norm(n, d))
    put("mm_projector.proj.0.weight", lambda n: R.linear(n, merged, merged, gain=2.0))
    put("mm_projector.proj.2.weight", lambda n: R.linear(n, v["text_hidden_size"], merged))
    put("mm_projector.post_norm.weight", lambda n: R.norm(n, v["text_hidden_size"]))
    return T


# ----------------------------------------------------------------------------------------------- writing
def write_k3_checkpoint(
    out: str | Path,
    *,
    experts: str = "bf16",
    seed: int = 0,
    mtp: bool = False,
    with_indexer: bool = False,
    vision: bool = False,
) -> Path:
    """Write the tiny K3 checkpoint into `out` (created; existing files of the same names overwritten)."""
    if experts not in VARIANTS:
        raise ValueError(f"experts: expected one of {VARIANTS}, found {experts!r}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer(out)
    text = text_config(tok["vocab_size"], tok["special"], experts=experts, mtp=mtp, with_indexer=with_indexer)
    config = wrapper_config(text, tok["special"], vision=vision)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": text["bos_token_id"], "eos_token_id": text["eos_token_id"], "do_sample": False})
        + "\n"
    )
    T = model_tensors(text, experts=experts, seed=seed)
    if vision:
        T |= vision_tensors(seed)
    names = sorted(T)  # two shards + index, like the published checkpoint
    shards = {
        "model-00001-of-00002.safetensors": names[: len(names) // 2],
        "model-00002-of-00002.safetensors": names[len(names) // 2 :],
    }
    weight_map = {}
    for fname, part in shards.items():
        save_file({n: T[n].contiguous() for n in part}, str(out / fname), metadata={"format": "pt"})
        weight_map |= {n: fname for n in part}
    total = sum(t.numel() * t.element_size() for t in T.values())
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1) + "\n"
    )
    return out


def tensor_digest(path: str | Path) -> str:
    """sha256 over every tensor of a safetensors directory (sorted names, dtype, shape, bytes): what the weights
    are, whatever the shard layout or header order."""
    path = Path(path)
    h = hashlib.sha256()
    tensors = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():
                tensors[name] = f
    for name in sorted(tensors):
        with safe_open(str(tensors[name]), framework="pt") as sf:
            t = sf.get_tensor(name).contiguous()
        h.update(f"{name}|{t.dtype}|{list(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--experts", choices=VARIANTS, default="bf16")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mtp", action="store_true", help="add one MTP layer (num_nextn_predict_layers = 1)")
    ap.add_argument("--with-indexer", action="store_true", help="DSA indexer on the full-attention layers")
    ap.add_argument("--vision", action="store_true", help="a tiny vision tower and projector")
    a = ap.parse_args(argv)
    out = write_k3_checkpoint(
        a.out, experts=a.experts, seed=a.seed, mtp=a.mtp, with_indexer=a.with_indexer, vision=a.vision
    )
    print(json.dumps({"path": str(out), "tensor_digest": tensor_digest(out)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
