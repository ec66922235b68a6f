"""The random-weight models bench/peer.py serves with both expertmesh and vLLM: built once with transformers into a
cache, as Hugging Face directories both systems read.

`dsv32` — DeepSeek-V3.2's shape scaled to a CPU: hidden 1024, 8 layers (the first dense, width 2816), MLA with 16
heads (q LoRA 512, KV LoRA 512, nope/rope/v head dims 128/64/128), 64 routed experts top-4 of width 512 in 8 groups
(top-4 groups), one shared expert, routed scaling 2.5, the lightning indexer with 16 heads × 128 on every layer,
vocabulary 32,000, plain RoPE (θ 10,000), 40,960 positions (a 32K prompt and its new tokens: bench/peer.py --long):
854.9M parameters, stored bf16 (1.7 GB). `index_topk` is 4,096 — in the default scenarios every context is shorter,
so DSA selects every past token and the model computes exactly what dense MLA computes. That is what lets vLLM's CPU
build serve the same weights as `deepseek_v3`: its DeepSeek-V3.2 path needs the sparse-MLA / indexer kernels of the
GPU builds, while the V3 path runs dense MLA (the CPU_MLA / AMX_MLA backends); vLLM's DeepSeek loader drops the
indexer tensors of layers built without an indexer. Past 4,096 tokens (the 8K / 32K prompts) the two differ by
design: expertmesh attends to the 4,096 tokens the indexer picks, vLLM to all of them.

Two directories (hard links where the filesystem allows, copies otherwise):
  <cache>/models/dsv32/expertmesh/  config.json model_type deepseek_v32 (as `save_pretrained` wrote it); the
                                    routed experts packed in MXFP4 (write_mxfp4_experts: gpt-oss's layout, as a
                                    published MXFP4 checkpoint ships them; the same bytes expertmesh's loader
                                    would quantize the bf16 experts to on every start), the rest in
                                    model-dense.safetensors;
  <cache>/models/dsv32/vllm/        model.safetensors as built (bf16 experts), the config relabelled: model_type
                                    deepseek_v3, DeepseekV3ForCausalLM, the indexer fields and the v3.2-only
                                    `layer_types` / `mlp_layer_types` dropped, DeepSeek-V3's routing fields added
                                    (topk_method noaux_tc, scoring_func sigmoid)

Weights: transformers' own initialisation from a fixed seed, then
  * every routed-expert weight rounded onto the MXFP4 grid (expertmesh quantizes bf16 experts to MXFP4 at load;
    on the grid that is exact, so both systems compute with the same expert values);
  * the LM-head rows of the special tokens (BOS, EOS, UNK) zeroed: their logit is exactly 0 while the largest of
    32,000 random logits is positive, so greedy decoding never ends early and every request yields exactly
    max_tokens tokens on both systems (the benchmark checks the usage counts).

Tokenizer (tokenizer.json + tokenizer_config.json, read by transformers' AutoTokenizer in vLLM and by expertmesh's
CheckpointTokenizer): a word-level vocabulary — id 0 `<｜begin▁of▁sentence｜>`, 1 `<｜end▁of▁sentence｜>` (DeepSeek's
names), 2 `<unk>`, then `w3` … `w31999` — with whitespace splitting. Prompts are sent as token ids, so the tokenizer
only detokenizes the output: every id decodes to its own ASCII word, so each generated token streams as one
non-empty chunk on both systems (a byte-level BPE on random weights emits partial UTF-8 that servers hold back,
which would blur inter-token latency).

The build writes into a sibling `.partial` directory and renames it in, so an interrupted build leaves nothing
half-written; a directory whose `peer-model.json` records a different spec is rebuilt.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

BOS, EOS, UNK = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<unk>"
SPEC_VERSION = 1  # bump when the build below changes what it writes

DSV32 = dict(
    vocab_size=32000,
    hidden_size=1024,
    intermediate_size=2816,
    moe_intermediate_size=512,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=16,
    q_lora_rank=512,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    n_routed_experts=64,
    num_experts_per_tok=4,
    n_shared_experts=1,
    n_group=8,
    topk_group=4,
    first_k_dense_replace=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    index_topk=4096,
    index_head_dim=128,
    index_n_heads=16,
    max_position_embeddings=40960,  # a 32K prompt + new tokens (--long); RoPE is position-free in the weights
    bos_token_id=0,
    eos_token_id=1,
    tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)
V32_ONLY_FIELDS = (
    "index_topk",
    "index_head_dim",
    "index_n_heads",
    "index_topk_freq",
    "index_topk_pattern",
    "layer_types",
    "mlp_layer_types",
)
MODELS = {"dsv32": DSV32}


def write_tokenizer(directory: Path, vocab_size: int, max_length: int) -> None:
    """tokenizer.json (word level, whitespace split) + tokenizer_config.json naming the special tokens."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    vocab = {BOS: 0, EOS: 1, UNK: 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in (BOS, EOS, UNK)])
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": BOS,
                "eos_token": EOS,
                "unk_token": UNK,
                "add_bos_token": False,
                "add_eos_token": False,
                "model_max_length": max_length,
                "clean_up_tokenization_spaces": False,
            },
            indent=1,
        )
    )


def vllm_config(raw: dict) -> dict:
    """The deepseek_v32 config relabelled deepseek_v3 for vLLM, with the routing fields DeepSeek-V3's published
    config.json carries and vLLM reads (transformers' config classes leave them out: without `topk_method` vLLM
    builds no correction bias and refuses the tensor; without `scoring_func` it would route with softmax where
    DeepSeek-V3 / V3.2 (and expertmesh) use sigmoid)."""
    v3 = {k: v for k, v in raw.items() if k not in V32_ONLY_FIELDS}
    v3.update(
        model_type="deepseek_v3",
        architectures=["DeepseekV3ForCausalLM"],
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        moe_layer_freq=1,
    )
    return v3


def write_vllm_config(em: Path, vd: Path) -> None:
    """(Re)write vd/config.json from em/config.json when it differs (cheap: the weights are not touched)."""
    want = json.dumps(vllm_config(json.loads((em / "config.json").read_text())), indent=2)
    target = vd / "config.json"
    if not target.exists() or target.read_text() != want:
        target.write_text(want)


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _spec(name: str, seed: int) -> dict:
    return {"model": name, "seed": seed, "version": SPEC_VERSION, "config": MODELS[name]}


def model_dirs(cache: Path, name: str = "dsv32", seed: int = 0, log=print) -> tuple[Path, Path, dict]:
    """(expertmesh directory, vLLM directory, facts) of model `name`, building them on first use (~1-3 min on
    2 cores, ~5 GB of memory at the peak, 3.4 GB of disk with copies, 1.7 GB with hard links)."""
    if name not in MODELS:
        raise ValueError(f"--model: expected one of {', '.join(MODELS)}, found {name!r}")
    root = cache / "models" / name
    spec = _spec(name, seed)
    record = root / "peer-model.json"
    if record.exists() and json.loads(record.read_text()).get("spec") == spec:
        facts = json.loads(record.read_text())
        write_vllm_config(root / "expertmesh", root / "vllm")
        facts["expertmesh_experts"] = write_mxfp4_experts(root / "expertmesh", log)
        return root / "expertmesh", root / "vllm", facts
    partial = root.with_name(name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    t0 = time.perf_counter()
    log(f"building the {name} model into {root} (once)")
    facts = _build(name, seed, partial)
    facts["build_s"] = time.perf_counter() - t0
    facts["spec"] = spec
    (partial / "peer-model.json").write_text(json.dumps(facts, indent=1))
    shutil.rmtree(root, ignore_errors=True)
    partial.rename(root)
    log(f"built {name} ({facts['parameters'] / 1e6:.1f}M parameters) in {facts['build_s']:.0f} s")
    facts["expertmesh_experts"] = write_mxfp4_experts(root / "expertmesh", log)
    return root / "expertmesh", root / "vllm", facts


def write_mxfp4_experts(em: Path, log=print) -> dict:
    """Give expertmesh's directory its routed experts packed in MXFP4, as a published MXFP4 checkpoint ships them
    (gpt-oss's layout, which expertmesh's loader reads as stored: `experts.gate_up_proj_blocks` [E, 2I, H/2] and
    `_scales` [E, 2I, H/32] uint8, `down_proj_*` likewise): model-dense.safetensors (every other tensor, bf16),
    model-experts-mxfp4.safetensors and an index naming the two. The bytes are quantize_mxfp4 of the stored bf16
    experts — what expertmesh's loader computes from them otherwise (gate rows, then up rows), on every start: ~45 s
    of one core, past `up`'s 120 s readiness limit on a loaded 2-core machine. Once; → what was written."""
    marker = em / "peer-mxfp4.json"
    if marker.exists():
        return json.loads(marker.read_text())
    import re

    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    from expertmesh.kernels.mxfp4 import quantize_mxfp4

    t0 = time.perf_counter()
    log(f"packing the routed experts of {em} in MXFP4 (once)")
    source = em / "model.safetensors"
    dense, experts, pattern = {}, {}, re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(\w+)_proj\.weight")
    by_layer: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    with safe_open(str(source), framework="pt") as f:
        for name in f.keys():
            m = pattern.fullmatch(name)
            if m:
                by_layer.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = f.get_tensor(name)
            else:
                dense[name] = f.get_tensor(name)
    for base, per_expert in by_layer.items():
        ids = sorted(per_expert)
        for ours, rows in (("gate_up", lambda w: torch.cat([w["gate"], w["up"]])), ("down", lambda w: w["down"])):
            packed = [quantize_mxfp4(rows(per_expert[e]).float()) for e in ids]
            experts[f"{base}.{ours}_proj_blocks"] = torch.stack([b for b, _ in packed]).contiguous()
            experts[f"{base}.{ours}_proj_scales"] = torch.stack([sc for _, sc in packed]).contiguous()
    files = {"model-dense.safetensors": dense, "model-experts-mxfp4.safetensors": experts}
    for fname, tensors in files.items():
        save_file(tensors, str(em / (fname + ".partial")), metadata={"format": "pt"})
    for fname in files:
        (em / (fname + ".partial")).rename(em / fname)
    index = {"metadata": {}, "weight_map": {n: fname for fname, ts in files.items() for n in ts}}
    (em / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    source.unlink()  # a hard link of vllm/model.safetensors (that copy stays): expertmesh reads the index's files
    facts = {
        "form": "mxfp4 (gpt-oss layout), packed at build",
        "layers": len(by_layer),
        "bytes": sum((em / f).stat().st_size for f in files),
        "pack_s": time.perf_counter() - t0,
    }
    marker.write_text(json.dumps(facts, indent=1))
    log(f"packed {len(by_layer)} layers of experts in MXFP4 in {facts['pack_s']:.0f} s")
    return facts


def _build(name: str, seed: int, out: Path) -> dict:
    import torch
    from transformers import DeepseekV32Config, DeepseekV32ForCausalLM

    from expertmesh.kernels.mxfp4 import dequantize_mxfp4, quantize_mxfp4

    shape = MODELS[name]
    cfg = DeepseekV32Config(**shape)
    torch.manual_seed(seed)
    model = DeepseekV32ForCausalLM(cfg).eval()
    specials = [0, 1, 2]
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if ".experts." in pname:
                # quantize per expert matrix: one [rows, cols] at a time keeps the peak small
                flat = p.view(-1, p.shape[-1]) if p.dim() > 2 else p
                for i in range(0, flat.shape[0], 4096):
                    rows = flat[i : i + 4096]
                    rows.copy_(dequantize_mxfp4(*quantize_mxfp4(rows.float()), dtype=torch.float32))
        model.lm_head.weight[specials] = 0
    model = model.to(torch.bfloat16)
    n_params = sum(p.numel() for p in model.parameters())
    em = out / "expertmesh"
    em.mkdir(parents=True)
    model.save_pretrained(em)
    del model
    write_tokenizer(em, shape["vocab_size"], shape["max_position_embeddings"])
    # the vLLM directory: same files, config relabelled deepseek_v3
    vd = out / "vllm"
    vd.mkdir()
    for f in em.iterdir():
        if f.name != "config.json":
            _link_or_copy(f, vd / f.name)
    raw = json.loads((em / "config.json").read_text())
    write_vllm_config(em, vd)
    return {
        "parameters": n_params,
        "model_type_expertmesh": raw["model_type"],
        "model_type_vllm": "deepseek_v3",
        "index_topk": raw.get("index_topk"),
        "max_position_embeddings": raw["max_position_embeddings"],
        "dtype_stored": "bfloat16",
        "bytes": sum(f.stat().st_size for f in em.glob("*.safetensors")),
    }
