"""The random-weight Kimi K3-shaped model `bench/peer.py --model k3` serves with expertmesh and llama.cpp: written
once into the peer cache as a Kimi K3 Hugging Face directory (K3's published layout, as
tests/support/k3_checkpoint.py writes its tiny one), which `expertmesh up --checkpoint` reads as it is and
llama.cpp's own converter turns into a GGUF (bench/_peer_llamacpp.py).

Shape — the dsv32 peer model's scale (hidden 1024, 8 layers, 64 routed experts top-4, vocabulary 32,000) in K3's
structure: Kimi Delta Attention on layers 1-3 and 5-7, NoPE MLA with q-LoRA and the sigmoid output gate on layers
4 and 8 (K3's 3:1), 16 heads for both (llama.cpp's kimi-k3 needs the MLA and KDA head counts equal; KDA head dim
128, short conv 4, full-rank gate), layer 1 a dense SiTU MLP of width 2816, the others K3's latent MoE (routed
experts at hidden 512, width 1024, sigmoid routing with the noaux_tc bias, scaling 2.5, two shared experts),
attention residuals in blocks of 2: 0.91B parameters, 6.3M routed-expert weights active per MoE layer and token
(the dsv32 peer's 4 × 3 × 1024 × 512). Routed experts are stored as K3 ships them: compressed-tensors
`mxfp4-pack-quantized` (E2M1 nibbles + E8M0 scales per 32); everything else bf16.

Tokenizer — K3's TikToken format (`tiktoken.model` + `tokenizer_config.json` with K3's special tokens after the
BPE ranks, 64 reserved ids): the 256 bytes, ` w`, then ` w0` … ` w31678`, each the merge of its prefix one digit
shorter (a valid BPE, which llama.cpp's converter needs to derive the merges). Every word token decodes to its own
ASCII word, so each generated token streams as one non-empty chunk on both servers (text `split()` compares them).

Greedy decoding never ends early: every LM-head row but the word tokens' (bytes, specials, reserved) is zero, so
their logit is exactly 0 while the largest of 31,679 random logits is positive; every request yields exactly
max_tokens tokens on both systems (the benchmark checks the usage counts).

Each tensor comes from its own generator seeded by (seed, name) (tests/support/k3_checkpoint.py's `_Weights`), so
the files are the same on any machine. The build writes into a `.partial` sibling and renames it in; a directory
whose `peer-model.json` records another spec is rebuilt.
"""

from __future__ import annotations

import base64
import importlib.util
import json
import math
import shutil
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SPEC_VERSION = 1  # bump when the build below changes what it writes
PREFIX = "language_model."

K3 = dict(
    vocab_size=32000,
    hidden_size=1024,
    num_hidden_layers=8,
    full_attn_layers=[4, 8],  # 1-based, as K3's linear_attn_config has them
    num_heads=16,  # MLA heads = KDA heads = num_key_value_heads (llama.cpp's kimi-k3)
    kda_head_dim=128,
    conv_kernel=4,
    intermediate_size=2816,  # the dense first layer
    moe_intermediate_size=1024,  # per routed expert; the shared MLP is num_shared_experts times as wide
    routed_expert_hidden_size=512,  # K3's latent MoE: experts run at half the hidden width
    num_experts=64,
    num_experts_per_token=4,
    num_shared_experts=2,
    q_lora_rank=512,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    attn_res_block_size=2,
    first_k_dense_replace=1,
    max_position_embeddings=40960,
)
MODELS = {"k3": K3}


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _k3_support():
    """tests/support/k3_checkpoint.py (K3's layout: quantization_config, wrapper config, MXFP4 codes, seeded
    tensors) and k3_fixtures.py (K3's special tokens), loaded by file: bench/ does not import the tests package."""
    support = ROOT / "tests" / "support"
    return _load("_peer_k3_checkpoint", support / "k3_checkpoint.py"), _load(
        "_peer_k3_fixtures", support / "k3_fixtures.py"
    )


# ----------------------------------------------------------------------------------------------- tokenizer
def word_ranks(n_base: int) -> dict[bytes, int]:
    """The BPE ranks: 256 bytes, b" w", then b" w0", b" w1", ... up to n_base ranks in all. Each word's prefix one
    digit shorter has a lower rank, so every word is the merge of two lower-ranked tokens."""
    ranks = {bytes([b]): b for b in range(256)}
    ranks[b" w"] = 256
    for n in range(n_base - len(ranks)):
        ranks[f" w{n}".encode()] = len(ranks)
    return ranks


def write_tokenizer(out: Path, vocab_size: int, max_length: int) -> dict:
    """tiktoken.model + tokenizer_config.json; → {"n_base", "special": {content: id}, "words": (first, end)}."""
    _, fixtures = _k3_support()
    n_base = vocab_size - fixtures.N_RESERVED
    ranks = word_ranks(n_base)
    lines = [f"{base64.b64encode(t).decode()} {r}" for t, r in ranks.items()]
    (out / "tiktoken.model").write_text("\n".join(lines) + "\n")
    special = fixtures.special_ids(n_base)
    added = {
        str(i): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t, i in sorted(special.items(), key=lambda kv: kv[1])
    }
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "added_tokens_decoder": added,
                "bos_token": "[BOS]",
                "eos_token": "[EOS]",
                "unk_token": "[UNK]",
                "pad_token": "[PAD]",
                "num_reserved_special_tokens": fixtures.N_RESERVED,
                "tokenizer_class": "TikTokenTokenizer",
                "model_max_length": max_length,
            },
            indent=1,
        )
        + "\n"
    )
    return {"n_base": n_base, "special": special, "words": (257, n_base)}


# ----------------------------------------------------------------------------------------------- config
def text_config(shape: dict, special: dict[str, int], quantization: dict) -> dict:
    """K3's `text_config` (KimiLinearConfig keys, every one llama.cpp's converter reads) at `shape`."""
    n = shape["num_hidden_layers"]
    full = list(shape["full_attn_layers"])
    return {
        "architectures": ["KimiLinearForCausalLM"],
        "model_type": "kimi_linear",
        "vocab_size": shape["vocab_size"],
        "hidden_size": shape["hidden_size"],
        "intermediate_size": shape["intermediate_size"],
        "num_hidden_layers": n,
        "num_attention_heads": shape["num_heads"],
        "num_key_value_heads": shape["num_heads"],
        "hidden_act": "situ",
        "activation_situ_beta": 4.0,
        "activation_situ_linear_beta": 25.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "bos_token_id": special["[BOS]"],
        "eos_token_id": special["<|end_of_msg|>"],
        "pad_token_id": special["[PAD]"],
        "max_position_embeddings": shape["max_position_embeddings"],
        "rope_theta": 10000.0,
        "num_experts": shape["num_experts"],
        "num_experts_per_token": shape["num_experts_per_token"],
        "num_shared_experts": shape["num_shared_experts"],
        "moe_intermediate_size": shape["moe_intermediate_size"],
        "routed_expert_hidden_size": shape["routed_expert_hidden_size"],
        "latent_moe_use_norm": True,
        "moe_renormalize": True,
        "moe_router_activation_func": "sigmoid",
        "routed_scaling_factor": 2.5,
        "first_k_dense_replace": shape["first_k_dense_replace"],
        "moe_layer_freq": 1,
        "use_grouped_topk": True,
        "num_expert_group": 1,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "q_lora_rank": shape["q_lora_rank"],
        "kv_lora_rank": shape["kv_lora_rank"],
        "qk_nope_head_dim": shape["qk_nope_head_dim"],
        "qk_rope_head_dim": shape["qk_rope_head_dim"],
        "v_head_dim": shape["v_head_dim"],
        "mla_use_nope": True,
        "mla_use_output_gate": True,
        "attn_res_block_size": shape["attn_res_block_size"],
        "linear_attn_config": {
            "kda_layers": [i for i in range(1, n + 1) if i not in full],
            "full_attn_layers": full,
            "num_heads": shape["num_heads"],
            "head_dim": shape["kda_head_dim"],
            "short_conv_kernel_size": shape["conv_kernel"],
            "gate_lower_bound": -5.0,
            "use_full_rank_gate": True,
        },
        "num_nextn_predict_layers": 0,
        "quantization_config": quantization,
    }


# ----------------------------------------------------------------------------------------------- weights
def layer_tensors(ck, R, shape: dict, i: int, *, mla: bool, dense: bool) -> dict:
    """Layer i's tensors (names with the `language_model.` prefix), K3's names and K3's tiny checkpoint's scales."""
    H, heads = shape["hidden_size"], shape["num_heads"]
    hd = shape["kda_head_dim"]
    d = heads * hd
    T = {}
    L = PREFIX + f"model.layers.{i}."

    def put(name: str, make):
        T[L + name] = make(L + name)

    put("input_layernorm.weight", lambda n: R.norm(n, H))
    put("post_attention_layernorm.weight", lambda n: R.norm(n, H))
    for part in ("self_attention_res", "mlp_res"):
        put(f"{part}_norm.weight", lambda n: R.norm(n, H))
        put(f"{part}_proj.weight", lambda n: R.normal(n, 1, H, std=0.3).bfloat16())
    A = "self_attn."
    if not mla:  # KDA
        import torch

        for p in "qkv":
            put(A + f"{p}_proj.weight", lambda n: R.linear(n, d, H))
            put(A + f"{p}_conv1d.weight", lambda n: R.normal(n, d, 1, shape["conv_kernel"], std=0.5).bfloat16())
        put(A + "f_a_proj.weight", lambda n: R.linear(n, hd, H))
        put(A + "f_b_proj.weight", lambda n: R.linear(n, d, hd))
        put(A + "b_proj.weight", lambda n: R.linear(n, heads, H))
        put(A + "A_log", lambda n: torch.log(torch.empty(heads).uniform_(1, 16, generator=R.gen(n))).float())
        put(A + "dt_bias", lambda n: R.normal(n, d, std=0.5).float())
        put(A + "g_proj.weight", lambda n: R.linear(n, d, H))
        put(A + "o_norm.weight", lambda n: R.norm(n, hd))
        put(A + "o_proj.weight", lambda n: R.linear(n, H, d))
    else:  # NoPE MLA, q-LoRA, output gate
        ql, kvl = shape["q_lora_rank"], shape["kv_lora_rank"]
        nope, rope, v = shape["qk_nope_head_dim"], shape["qk_rope_head_dim"], shape["v_head_dim"]
        put(A + "q_a_proj.weight", lambda n: R.linear(n, ql, H))
        put(A + "q_a_layernorm.weight", lambda n: R.norm(n, ql))
        put(A + "q_b_proj.weight", lambda n: R.linear(n, heads * (nope + rope), ql, gain=2.0))
        put(A + "kv_a_proj_with_mqa.weight", lambda n: R.linear(n, kvl + rope, H, gain=2.0))
        put(A + "kv_a_layernorm.weight", lambda n: R.norm(n, kvl))
        put(A + "kv_b_proj.weight", lambda n: R.linear(n, heads * (nope + v), kvl))
        put(A + "g_proj.weight", lambda n: R.linear(n, heads * v, H))
        put(A + "o_proj.weight", lambda n: R.linear(n, H, heads * v))
    if dense:
        width = shape["intermediate_size"]
        put("mlp.gate_proj.weight", lambda n: R.linear(n, width, H, gain=2.0))
        put("mlp.up_proj.weight", lambda n: R.linear(n, width, H, gain=2.0))
        put("mlp.down_proj.weight", lambda n: R.linear(n, H, width))
        return T
    E, inter, latent = shape["num_experts"], shape["moe_intermediate_size"], shape["routed_expert_hidden_size"]
    shared = inter * shape["num_shared_experts"]
    M = "block_sparse_moe."
    put(M + "gate.weight", lambda n: R.linear(n, E, H, gain=2.0))
    put(M + "gate.e_score_correction_bias", lambda n: R.normal(n, E, std=0.1).float())
    put(M + "routed_expert_down_proj.weight", lambda n: R.linear(n, latent, H))
    put(M + "routed_expert_norm.weight", lambda n: R.norm(n, latent))
    put(M + "routed_expert_up_proj.weight", lambda n: R.linear(n, H, latent))
    for p in ("gate_proj", "up_proj"):
        put(M + f"shared_experts.{p}.weight", lambda n: R.linear(n, shared, H, gain=2.0))
    put(M + "shared_experts.down_proj.weight", lambda n: R.linear(n, H, shared))
    for e in range(E):
        for wn, (o, inp, gain) in (
            ("w1", (inter, latent, 2.0)),
            ("w3", (inter, latent, 2.0)),
            ("w2", (latent, inter, 1.0)),
        ):
            name = L + M + f"experts.{e}.{wn}"
            T.update(ck.expert_tensors(name, R.normal(name, o, inp, std=gain / math.sqrt(inp)), "mxfp4"))
    return T


def write_model(out: Path, shape: dict, seed: int) -> dict:
    """Write the K3 directory of `shape` (K3's keys) into `out` (existing); → facts (parameters, word ids, ...)."""
    import torch
    from safetensors.torch import save_file

    ck, _ = _k3_support()
    tok = write_tokenizer(out, shape["vocab_size"], shape["max_position_embeddings"])
    text = text_config(shape, tok["special"], ck.QUANTIZATION_CONFIG)
    (out / "config.json").write_text(json.dumps(ck.wrapper_config(text, tok["special"]), indent=2) + "\n")
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": text["bos_token_id"], "eos_token_id": text["eos_token_id"], "do_sample": False})
        + "\n"
    )
    R = ck._Weights(seed)
    V, H = shape["vocab_size"], shape["hidden_size"]
    first_word, end_word = tok["words"]
    weight_map, n_params, total = {}, 0, 0

    def shard(fname: str, tensors: dict) -> None:
        nonlocal n_params, total
        save_file({n: t.contiguous() for n, t in tensors.items()}, str(out / fname), metadata={"format": "pt"})
        for n, t in tensors.items():
            weight_map[n] = fname
            total += t.numel() * t.element_size()
            # parameters: an MXFP4 byte holds two weights; scales are not parameters
            n_params += (
                2 * t.numel() if n.endswith(".weight_packed") else 0 if n.endswith(".weight_scale") else t.numel()
            )

    def head(n):
        w = R.linear(n, V, H, gain=2.0)
        keep = torch.zeros(V, dtype=torch.bool)
        keep[first_word:end_word] = True
        w[~keep] = 0  # logit exactly 0 for every non-word id: greedy never picks EOS (see the docstring)
        return w

    n_layers = shape["num_hidden_layers"]
    top = {
        PREFIX + "model.embed_tokens.weight": R.normal(PREFIX + "model.embed_tokens.weight", V, H, std=1.0).bfloat16(),
        PREFIX + "model.norm.weight": R.norm(PREFIX + "model.norm.weight", H),
        PREFIX + "lm_head.weight": head(PREFIX + "lm_head.weight"),
        PREFIX + "model.output_attn_res_norm.weight": R.norm(PREFIX + "model.output_attn_res_norm.weight", H),
        PREFIX + "model.output_attn_res_proj.weight": R.normal(
            PREFIX + "model.output_attn_res_proj.weight", 1, H, std=0.3
        ).bfloat16(),
    }
    names = [f"model-{k:05d}-of-{n_layers + 1:05d}.safetensors" for k in range(1, n_layers + 2)]
    shard(names[0], top)
    full = {i - 1 for i in shape["full_attn_layers"]}
    for i in range(n_layers):  # one shard per layer: the peak memory is one layer's tensors
        tensors = layer_tensors(ck, R, shape, i, mla=i in full, dense=i < shape["first_k_dense_replace"])
        shard(names[i + 1], tensors)
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1) + "\n"
    )
    return {
        "parameters": n_params,
        "model_type": "kimi_k3",
        "routed_experts": "compressed-tensors mxfp4-pack-quantized",
        "dtype_stored": "bfloat16 (routed experts MXFP4)",
        "bytes": total,
        "word_ids": [first_word, end_word],
        "special": tok["special"],
        "eos_token_id": text["eos_token_id"],
    }


def _spec(name: str, seed: int) -> dict:
    return {"model": name, "seed": seed, "version": SPEC_VERSION, "config": MODELS[name]}


def model_dir(cache: Path, name: str = "k3", seed: int = 0, log=print) -> tuple[Path, dict]:
    """(the K3 Hugging Face directory, facts), built on first use under <cache>/models/<name>/hf."""
    if name not in MODELS:
        raise ValueError(f"--model: expected one of {', '.join(MODELS)}, found {name!r}")
    root = cache / "models" / name
    spec = _spec(name, seed)
    record = root / "peer-model.json"
    if record.exists() and json.loads(record.read_text()).get("spec") == spec:
        return root / "hf", json.loads(record.read_text())
    partial = root.with_name(name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    (partial / "hf").mkdir(parents=True)
    t0 = time.perf_counter()
    log(f"building the {name} model into {root} (once)")
    facts = write_model(partial / "hf", MODELS[name], seed)
    facts["build_s"] = time.perf_counter() - t0
    facts["spec"] = spec
    (partial / "peer-model.json").write_text(json.dumps(facts, indent=1))
    shutil.rmtree(root, ignore_errors=True)
    partial.rename(root)
    log(f"built {name} ({facts['parameters'] / 1e6:.1f}M parameters) in {facts['build_s']:.0f} s")
    return root / "hf", facts
