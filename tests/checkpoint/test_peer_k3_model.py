"""bench/peer.py --model k3's model and llama.cpp command lines (bench/_peer_k3_model.py, bench/_peer_llamacpp.py),
at a tiny shape: the word vocabulary is a BPE llama.cpp's converter can derive merges from and every word streams
as itself; the K3 directory the builder writes loads in expertmesh and greedy decoding yields only word tokens
(never EOS, so every request runs to max_tokens); the converter's and the server's command lines. Nothing here
builds llama.cpp."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from expertmesh.chat.tiktoken_tokenizer import TikTokenTokenizer
from expertmesh.checkpoint.loader import Checkpoint
from expertmesh.model.transformer import generate
from expertmesh.wire.sampling_params import SamplingParams

REPO = Path(__file__).resolve().parents[2]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench{name}", REPO / "bench" / f"{name}.py")
    mod = sys.modules[f"bench{name}"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


k3_model = _load("_peer_k3_model")
llamacpp = _load("_peer_llamacpp")

TINY = dict(
    k3_model.K3,
    vocab_size=512,
    hidden_size=64,
    num_hidden_layers=4,
    full_attn_layers=[2, 4],
    num_heads=4,
    kda_head_dim=16,
    intermediate_size=96,
    moe_intermediate_size=32,
    routed_expert_hidden_size=32,
    num_experts=8,
    num_experts_per_token=2,
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    max_position_embeddings=4096,
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("peer-k3")
    return out, k3_model.write_model(out, TINY, seed=0)


def test_every_word_is_one_bpe_token_of_two_lower_ranked_parts():
    import tiktoken

    ranks = k3_model.word_ranks(3000)
    assert len(ranks) == 3000 and sorted(ranks.values()) == list(range(3000))
    enc = tiktoken.Encoding(name="peer_k3", pat_str=r"\s?\S+", mergeable_ranks=ranks, special_tokens={})
    for token, rank in ranks.items():
        if len(token) > 1:
            # llama.cpp's converter derives the merges by running BPE below each token's rank: two parts each time
            assert enc.encode(token.decode()) == [rank]
            head, tail = token[:-1], token[-1:]
            assert ranks[head] < rank and ranks[tail] < rank, token


def test_the_k3_directory_loads_and_greedy_decoding_yields_only_words(tiny):
    out, facts = tiny
    first, end = facts["word_ids"]
    tok = TikTokenTokenizer(out)
    assert tok.vocab_size == TINY["vocab_size"]
    assert end - first == TINY["vocab_size"] - 64 - 257
    assert [tok.decode([i]) for i in (first, first + 1, end - 1)] == [" w0", " w1", f" w{end - 1 - first}"]
    eos = set(tok.eos_ids)
    assert eos and not eos & set(range(first, end))

    model = Checkpoint(out).load_model()
    assert model.cfg.model_type == "kimi_k3"
    assert model.cfg.layer_types == ("kda", "mla", "kda", "mla")
    assert model.cfg.moe.latent_size == TINY["routed_expert_hidden_size"]
    generator = torch.Generator().manual_seed(1)
    for n in (5, 20):
        prompt = torch.randint(first, end, (n,), generator=generator).tolist()
        got = generate(model, prompt, SamplingParams(max_tokens=12), prefill_chunk=16).tokens
        assert len(got) == 12 and all(first <= t < end for t in got), got  # no EOS, no special, no bare byte
        decoder = tok.stream_decoder()
        assert all(decoder.feed(t).startswith(" w") for t in got)  # each token streams as its own word


def test_the_routed_experts_are_stored_as_compressed_tensors_mxfp4(tiny):
    import json

    out, facts = tiny
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["format"] == "mxfp4-pack-quantized"
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    packed = [n for n in index if n.endswith("experts.0.w1.weight_packed")]
    assert len(packed) == 3  # the three MoE layers (layer 0 is dense)
    assert not any(n.endswith("experts.0.w1.weight") for n in index)


def test_converter_and_server_command_lines(tmp_path):
    cmd = llamacpp.convert_command(tmp_path / "llama", tmp_path / "src", tmp_path / "m.gguf", "bfloat16")
    assert cmd[0] == "_convert" and cmd[-2:] == ["--outtype", "bf16"]
    assert llamacpp.convert_command(tmp_path, tmp_path, tmp_path / "m.gguf", "float32")[-1] == "f32"
    with pytest.raises(ValueError, match="dtype: expected one of bfloat16, float32, found 'float16'"):
        llamacpp.convert_command(tmp_path, tmp_path, tmp_path / "m.gguf", "float16")

    ctx = llamacpp.slot_context(1000, 64)
    assert ctx % 256 == 0 and ctx >= 1000 + 64
    cmd = llamacpp.server_command(Path("/x/llama-server"), Path("/m.gguf"), 8123, 8, ctx)
    args = dict(zip(cmd[1::2], cmd[2::2]))
    assert args["-t"] == args["-tb"] == "2" and args["-np"] == "8" and args["-c"] == str(8 * ctx)
    assert args["--port"] == "8123" and args["--alias"] == "peer" and args["-m"] == "/m.gguf"
