"""The model math against transformers' own implementations of the published relatives (nobody here wrote them).

Tiny random `KimiLinearForCausalLM` (model_type kimi_linear: KDA + NoPE MLA layers) and `DeepseekV32ForCausalLM`
(deepseek_v32: MLA + lightning indexer on every layer, YaRN RoPE) are built on CPU, their routed experts passed
through the MXFP4 rule first (so quantizing them at load is exact), saved with `save_pretrained`, and loaded by
expertmesh as they are. Prompts are longer than `index_topk`, so the sparse selection matters. The hybrid (a Kimi
Linear config whose full-attention layers carry a DSA indexer) has no single oracle: each of its layer types is
checked against its relative's module.
"""

import json
import shutil

import grpc
import pytest
import torch
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")
from transformers import (  # noqa: E402
    DeepseekV32Config,
    DeepseekV32ForCausalLM,
    KimiLinearConfig,
    KimiLinearForCausalLM,
)

from expertmesh.checkpoint.files import CheckpointError  # noqa: E402
from expertmesh.checkpoint.loader import Checkpoint  # noqa: E402
from expertmesh.kernels.mxfp4 import dequantize_mxfp4, quantize_mxfp4  # noqa: E402
from expertmesh.model.cache import Segment  # noqa: E402
from expertmesh.model.transformer import generate  # noqa: E402
from expertmesh.wire.sampling_params import SamplingParams  # noqa: E402

LOGPROB_TOL = 2e-3  # fp32 on CPU (the bar); seen: a few 1e-6
PROMPT_LEN, NEW_TOKENS, INDEX_TOPK = 40, 12, 8
COMMON = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=32,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    n_group=4,
    topk_group=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
    initializer_range=0.1,
)
# 16 indexer heads: with a handful, ReLU zeros make exact score ties, which torch.topk breaks arbitrarily
INDEXER = dict(index_topk=INDEX_TOPK, index_head_dim=16, index_n_heads=16)
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "mscale": 1.0,
    "mscale_all_dim": 0.707,
    "beta_fast": 32,
    "beta_slow": 1,
}


def kimi_config(**kw) -> KimiLinearConfig:
    return KimiLinearConfig(
        **COMMON,
        num_hidden_layers=4,
        num_local_experts=16,
        num_experts_per_tok=4,
        linear_attn_config={
            "head_dim": 32,
            "num_heads": 2,
            "short_conv_kernel_size": 4,
            "full_attn_layers": [2, 4],
            "kda_layers": [1, 3],
        },
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        **kw,
    )


def deepseek_config(**kw) -> DeepseekV32Config:
    return DeepseekV32Config(
        **COMMON,
        **INDEXER,
        num_hidden_layers=3,
        q_lora_rank=32,
        n_routed_experts=16,
        num_experts_per_tok=4,
        rope_parameters=YARN,
        max_position_embeddings=256,
        **kw,
    )


def mxfp4_experts_(model) -> None:
    """Round every routed-expert weight onto the MXFP4 grid, so that quantizing it again at load is exact, and
    give the routing correction bias (zeros at init) values that matter and that bf16 cannot hold."""
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".experts." in name:
                p.copy_(dequantize_mxfp4(*quantize_mxfp4(p.float()), dtype=torch.float32))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=gen) * 0.05)


def build(model_cls, config, path, seed: int):
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    mxfp4_experts_(model)
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def prompt():
    return torch.randint(3, 512, (PROMPT_LEN,), generator=torch.Generator().manual_seed(7)).tolist()


@pytest.fixture(scope="module")
def relatives(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {
        "kimi_linear": (build(KimiLinearForCausalLM, kimi_config(), root / "kimi", 0), root / "kimi"),
        "deepseek_v32": (build(DeepseekV32ForCausalLM, deepseek_config(), root / "dsv32", 1), root / "dsv32"),
    }


def prompt_logprobs(logits: torch.Tensor, prompt: list[int]) -> torch.Tensor:
    """log p(prompt[i] | prompt[:i]) for i >= 1 from logits [T, V]."""
    return logits[:-1].float().log_softmax(-1).gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]


@pytest.mark.parametrize("model_type", ["kimi_linear", "deepseek_v32"])
def test_in_process_matches_transformers(relatives, prompt, model_type):
    hf, path = relatives[model_type]
    ck = Checkpoint(path)
    assert ck.layout == model_type
    ours = ck.load_model()
    with torch.no_grad():
        ref = prompt_logprobs(hf(torch.tensor([prompt])).logits[0], prompt)
    got = prompt_logprobs(ours.step(prompt, ours.new_cache()), prompt)
    delta = (ref - got).abs().max().item()
    print(f"{model_type}: max |Δ prompt logprob| = {delta:.3g}")
    assert delta < LOGPROB_TOL
    want = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)[0, PROMPT_LEN:].tolist()
    assert generate(ours, prompt, SamplingParams(max_tokens=NEW_TOKENS), prefill_chunk=16).tokens == want


def test_sparse_selection_is_exercised(relatives, prompt):
    """The DeepSeek comparison means something only if top-k drops tokens: dense attention must differ."""
    _, path = relatives["deepseek_v32"]
    ck = Checkpoint(path)
    sparse, dense = ck.load_model(), ck.load_model(dense_attention=True)
    a = sparse.step(prompt, sparse.new_cache())
    b = dense.step(prompt, dense.new_cache())
    assert (a[INDEX_TOPK + 2 :] - b[INDEX_TOPK + 2 :]).abs().max() > 1e-3


def test_through_up_matches_transformers(relatives, prompt):
    """`expertmesh up --checkpoint DIR` on a transformers-saved directory (router + attention worker + 2 expert
    workers as processes): greedy tokens over gRPC equal transformers' generate, and the prompt log-probs that
    `/v1/completions` returns (echo + logprobs, max_tokens 0), read with the openai client, equal its logits'."""
    import openai

    from expertmesh.entry.cluster import LocalCluster, free_port
    from expertmesh.protos import router_pb2, router_pb2_grpc, sampling_pb2

    for model_type in ("kimi_linear", "deepseek_v32"):
        hf, path = relatives[model_type]
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)[0, PROMPT_LEN:]
        with torch.no_grad():
            ref = prompt_logprobs(hf(torch.tensor([prompt])).logits[0], prompt)
        grpc_port, http_port = free_port(), free_port()
        with LocalCluster(path, attention_workers=1, expert_workers=2, http_port=http_port, grpc_port=grpc_port):
            with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as ch:
                stub = router_pb2_grpc.RouterStub(ch)
                req = router_pb2.GenerateRequest(
                    token_ids=router_pb2.TokenIds(ids=prompt),
                    params=sampling_pb2.SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0),
                )
                got = [ev.token.token_id for ev in stub.Generate(req, timeout=120) if ev.HasField("token")]
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="none", max_retries=0)
            name = client.models.list().data[0].id
            scored = client.completions.create(model=name, prompt=prompt, echo=True, logprobs=0, max_tokens=0)
        assert got == want.tolist(), model_type
        served = scored.choices[0].logprobs.token_logprobs
        assert served[0] is None and len(served) == PROMPT_LEN
        delta = (torch.tensor(served[1:]) - ref).abs().max().item()
        print(f"{model_type} through up: max |Δ prompt logprob| = {delta:.3g}")
        assert delta < LOGPROB_TOL, model_type


# ----------------------------------------------------------------------------------------------- the hybrid
def test_hybrid_layers_match_their_relatives(tmp_path):
    """A Kimi Linear checkpoint whose full-attention layers carry DeepSeek-V3.2's indexer (and RoPE): its KDA
    layers equal KimiLinearDeltaAttention, its DSA layers equal DeepseekV32Attention with the same weights."""
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import (
        DeepseekV32Attention,
        DeepseekV32RotaryEmbedding,
    )

    kimi = build(KimiLinearForCausalLM, kimi_config(q_lora_rank=32), tmp_path, 2)
    dcfg = deepseek_config()
    dcfg._attn_implementation = "eager"
    torch.manual_seed(3)
    dsa = [DeepseekV32Attention(dcfg, layer_idx=i).eval() for i in (1, 3)]
    # the hybrid directory: Kimi's tensors, its MLA layers' attention replaced by DeepSeek's (with the indexer)
    state = load_file(str(tmp_path / "model.safetensors"))
    state = {k: v for k, v in state.items() if not any(k.startswith(f"model.layers.{i}.self_attn.") for i in (1, 3))}
    for i, mod in zip((1, 3), dsa):
        state |= {f"model.layers.{i}.self_attn.{k}": v.contiguous() for k, v in mod.state_dict().items()}
    save_file(state, str(tmp_path / "model.safetensors"))
    raw = json.loads((tmp_path / "config.json").read_text())
    raw |= {**INDEXER, "rope_parameters": YARN, "max_position_embeddings": 256}
    (tmp_path / "config.json").write_text(json.dumps(raw))

    ours = Checkpoint(tmp_path).load_model()
    assert ours.cfg.layer_types == ("kda", "dsa", "kda", "dsa") and ours.cfg.model_type == "kimi_linear"
    t = PROMPT_LEN
    x = torch.randn(1, t, 64, generator=torch.Generator().manual_seed(5))
    rotary = DeepseekV32RotaryEmbedding(dcfg)
    pos = torch.arange(t)[None]
    causal = torch.full((t, t), float("-inf")).triu(1)[None, None]
    for layer in range(4):
        with torch.no_grad():
            got = ours.layers[layer].attn(x[0], [Segment(0, t, ours.new_cache())], layer)
            if layer % 2 == 0:
                ref = kimi.model.layers[layer].self_attn(x)[0]
            else:
                ref = dsa[layer // 2](x, position_embeddings=rotary(x, pos), attention_mask=causal, position_ids=pos)[
                    0
                ][0]
        rel = ((got - ref).norm() / ref.norm()).item()
        assert rel < 1e-4, (layer, rel)


# ----------------------------------------------------------------------------------------------- deviations
def test_kda_biases_are_honoured(tmp_path):
    """Conv and output-gate biases (present in some KDA checkpoints) load and change the output exactly as
    transformers' module computes them with those biases."""
    torch.manual_seed(4)
    kimi = KimiLinearForCausalLM(kimi_config()).eval()
    mxfp4_experts_(kimi)
    kimi.save_pretrained(tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    for i in (0, 2):  # the KDA layers
        attn = kimi.model.layers[i].self_attn
        attn.conv1d.bias = torch.nn.Parameter(torch.randn(attn.conv1d.out_channels) * 0.5)
        g_b = torch.nn.Linear(attn.g_b_proj.in_features, attn.g_b_proj.out_features, bias=True)
        g_b.weight.data.copy_(attn.g_b_proj.weight.data)
        g_b.bias.data.normal_()
        attn.g_b_proj = g_b
        for p, part in zip("qkv", attn.conv1d.bias.data.chunk(3)):
            state[f"model.layers.{i}.self_attn.{p}_conv1d.bias"] = part.clone()
        state[f"model.layers.{i}.self_attn.g_b_proj.bias"] = g_b.bias.data.clone()
    save_file(state, str(tmp_path / "model.safetensors"))
    ours = Checkpoint(tmp_path).load_model()
    assert ours.cfg.kda.conv_bias and ours.cfg.kda.output_gate_bias
    x = torch.randn(1, 20, 64, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        got = ours.layers[0].attn(x[0], [Segment(0, 20, ours.new_cache())], 0)
        ref = kimi.model.layers[0].self_attn(x)[0]
    assert ((got - ref).norm() / ref.norm()).item() < 1e-4


def test_tied_embeddings_share_one_tensor(tmp_path, prompt):
    hf = build(DeepseekV32ForCausalLM, deepseek_config(tie_word_embeddings=True), tmp_path, 8)
    ours = Checkpoint(tmp_path).load_model()
    assert ours.lm_head.weight is ours.embed.weight
    with torch.no_grad():
        ref = prompt_logprobs(hf(torch.tensor([prompt])).logits[0], prompt)
    assert (ref - prompt_logprobs(ours.step(prompt, ours.new_cache()), prompt)).abs().max() < LOGPROB_TOL


def test_fp32_tensors_keep_their_dtype(relatives, tmp_path):
    """The routing bias, KDA decay and indexer weights stay fp32 (a bf16 copy changes near-tie routing)."""
    from expertmesh.checkpoint.loader import expected_tensors
    from expertmesh.model.config import preset

    specs = expected_tensors(preset("tiny"))
    assert specs["layers.1.moe.router_bias"].dtype == torch.float32
    assert specs["layers.0.attn.A_log"].dtype == torch.float32
    assert specs["layers.1.attn.index_w.weight"].dtype == torch.float32
    _, path = relatives["deepseek_v32"]
    raw = load_file(str(path / "model.safetensors"))["model.layers.1.mlp.gate.e_score_correction_bias"]
    loaded = Checkpoint(path).load_dense_state()["layers.1.moe.router_bias"]
    assert torch.equal(raw, loaded) and not torch.equal(raw, raw.bfloat16().float())


# ----------------------------------------------------------------------------------------------- bad files
def test_bad_checkpoints_name_the_tensor(relatives, tmp_path):
    _, path = relatives["deepseek_v32"]
    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    state = load_file(str(bad / "model.safetensors"))
    name = "model.layers.1.self_attn.indexer.wk.weight"
    save_file({**state, name: torch.zeros(3, 3)}, str(bad / "model.safetensors"))
    with pytest.raises(CheckpointError, match=rf"tensor '{name}' has shape \[3, 3\], expected \[16, 64\]"):
        Checkpoint(bad)
    del state[name]
    save_file(state, str(bad / "model.safetensors"))
    with pytest.raises(CheckpointError, match=rf"tensor '{name}' missing"):
        Checkpoint(bad)
    save_file(
        {**load_file(str(path / "model.safetensors")), "model.layers.0.self_attn.extra.weight": torch.zeros(2)},
        str(bad / "model.safetensors"),
    )
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'model.layers.0.self_attn.extra.weight'"):
        Checkpoint(bad)
    raw = json.loads((path / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**raw, "model_type": "llama"}))
    with pytest.raises(CheckpointError, match=r"model_type 'llama': expected one of kimi_linear, deepseek_v32"):
        Checkpoint(bad)


def test_fp8_block_scaled_weights_dequantize(relatives, tmp_path, prompt):
    """DeepSeek's FP8 layout (F8_E4M3 + weight_scale_inv per 128×128 block): w = fp8 · scale_inv[i//128, j//128]."""
    _, path = relatives["deepseek_v32"]
    fp8 = tmp_path / "fp8"
    shutil.copytree(path, fp8)
    state = load_file(str(fp8 / "model.safetensors"))
    name = "model.layers.1.self_attn.q_b_proj.weight"  # [96, 32]: one block (block 64 below: 2 × 1)
    w = state[name]
    scale = torch.stack([w[:64].abs().max(), w[64:].abs().max()])[:, None] / 448.0  # [2, 1]
    q = (w / scale.repeat_interleave(64, 0)[:96]).to(torch.float8_e4m3fn)
    state[name], state[name + "_scale_inv"] = q, scale.float()
    save_file(state, str(fp8 / "model.safetensors"))
    raw = json.loads((fp8 / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [64, 64]}
    (fp8 / "config.json").write_text(json.dumps(raw))
    got = Checkpoint(fp8).load_dense_state()["layers.1.attn.q_b.weight"]
    expected = q.float() * scale.repeat_interleave(64, 0)[:96]  # independent of the loader's code path
    assert torch.equal(got, expected)
    assert (got - w).abs().max() < 0.1 * w.abs().max()  # and it is the weight, to FP8 precision


# ----------------------------------------------------------------------------------------------- convert
def test_convert_to_mxfp4_is_exact_and_resumable(relatives, tmp_path, prompt):
    """`expertmesh checkpoint convert`: experts become 4.25-bit MXFP4, the model computes bitwise the same
    logits as the float source, and a rerun after an interrupted shard redoes only what is missing."""
    from expertmesh.checkpoint.loader import inspect_checkpoint
    from expertmesh.entry.cli import main

    _, src = relatives["kimi_linear"]
    out = tmp_path / "mx"
    assert main(["checkpoint", "convert", str(src), "--out", str(out)]) == 0
    info = inspect_checkpoint(out)
    assert info["bits_per_expert_weight"] == pytest.approx(4.25) and info["layout"] == "kimi_linear"
    assert inspect_checkpoint(src)["bits_per_expert_weight"] == pytest.approx(32.0)
    a, b = Checkpoint(src).load_model(), Checkpoint(out).load_model()
    assert torch.equal(a.step(prompt, a.new_cache()), b.step(prompt, b.new_cache()))
    shard = out / "model-layer-00002.safetensors"
    shard.rename(shard.with_suffix(".partial"))  # as if killed while writing it
    from expertmesh.checkpoint.convert import convert_checkpoint

    report = convert_checkpoint(src, out)
    assert report.skipped == report.shards - 1 and shard.exists()
    c = Checkpoint(out).load_model()
    assert torch.equal(a.step(prompt, a.new_cache()), c.step(prompt, c.new_cache()))
