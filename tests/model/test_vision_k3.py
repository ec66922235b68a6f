"""Kimi K3's vision tower (#50): its vision_config read or refused by field, its published tensors loaded with
every name and shape checked, its parameter count, and its features against two references nobody here wrote the
maths of — transformers' kimi_k25 tower + projector where K3's settings coincide with K2.5's, and a float64
re-derivation of the published implementation (vLLM's kimi_k25_vit as K3 configures it) for K3's own settings."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from support.k3_checkpoint import VISION, write_k3_checkpoint
from support.k3_vision_reference import reference_features

from expertmesh.checkpoint.config import checkpoint_config
from expertmesh.checkpoint.files import CheckpointError
from expertmesh.checkpoint.hf_config import config_from_hf
from expertmesh.checkpoint.loader import Checkpoint
from expertmesh.model.config import VisionConfig, preset
from expertmesh.model.transformer import Transformer
from expertmesh.model.vision import Projector, VisionTower, encode_image
from expertmesh.model.vision_k3 import time_embedding


@pytest.fixture(scope="module")
def k3_vision_dir(tmp_path_factory):
    return write_k3_checkpoint(tmp_path_factory.mktemp("k3v"), vision=True)


def _raw(path):
    return json.loads((path / "config.json").read_text())


def _names(path):
    return set(json.loads((path / "model.safetensors.index.json").read_text())["weight_map"])


# ----------------------------------------------------------------------------------------------- config
def test_vision_config_read_from_the_published_keys(k3_vision_dir):
    v = checkpoint_config(k3_vision_dir).vision
    assert v.layout == "kimi_k3" and v.norm_type == "rmsnorm" and v.projector_type == "patchmergerv2"
    assert (v.hidden_size, v.qkv_width, v.intermediate_size, v.num_attention_heads) == (32, 48, 64, 2)
    assert (v.attn_bias, v.linear_bias, v.patch_embed_proj_bias) == (False, False, False)
    assert (v.pos_emb_height, v.pos_emb_width, v.pos_emb_time, v.pos_emb_interpolation_mode) == (6, 6, 4, "bilinear")
    # the image run is <|media_content|> <|media_pad|>×n <|media_end|>, ids from the tokenizer the checkpoint ships
    special = {
        t["content"]: int(i)
        for i, t in json.loads((k3_vision_dir / "tokenizer_config.json").read_text())["added_tokens_decoder"].items()
    }
    assert v.image_token_id == special["<|media_pad|>"]
    assert v.image_start_token_id == special["<|media_content|>"]
    assert v.image_end_token_id == special["<|media_end|>"]


@pytest.mark.parametrize(
    "key,value,why",
    [
        ("norm_type", "batchnorm", "vision_config.norm_type='batchnorm'"),
        ("mm_projector_type", "mlp", "vision_config.mm_projector_type='mlp'"),
        ("pos_emb_type", "learnable", "vision_config.pos_emb_type='learnable'"),
        ("pos_emb_interpolation_mode", "nearest", "vision_config.pos_emb_interpolation_mode='nearest'"),
        ("mlp_type", "swiglu", "vision_config.mlp_type='swiglu'"),
        ("merge_type", "sd2", "vision_config.merge_type='sd2'"),
        ("video_attn_type", "spatial", "vision_config.video_attn_type='spatial'"),
        ("text_hidden_size", 7168, "vision_config.text_hidden_size=7168"),
        ("mm_hidden_size", 64, "vision_config.mm_hidden_size=64"),
        ("qkv_hidden_size", 50, "vision_config"),  # 25 per head: not a RoPE head dim
        ("use_cls_token", True, "vision_config.use_cls_token"),
        ("model_type", "kimi_k25_vision", "vision_config.model_type"),
    ],
)
def test_every_vision_field_is_honoured_or_refused_by_name(k3_vision_dir, key, value, why):
    raw = _raw(k3_vision_dir)
    raw["vision_config"][key] = value
    with pytest.raises(CheckpointError, match=why.replace("[", r"\[").replace("(", r"\(")):
        config_from_hf(raw, _names(k3_vision_dir), "k3")


def test_text_only_k3_has_no_vision(tmp_path):
    """The vision_config alone (no vision tensors) leaves the model text only, loaded as before."""
    path = write_k3_checkpoint(tmp_path)
    assert checkpoint_config(path).vision is None
    assert not any(n.startswith(("vision_tower", "mm_projector")) for n, _ in Checkpoint(path).iter_dense_tensors())


def test_loader_checks_every_vision_tensor(tmp_path):
    path = write_k3_checkpoint(tmp_path, vision=True, with_indexer=True)  # the K3+DSA twin carries it too
    ck = Checkpoint(path)
    assert ck.cfg.layer_types.count("dsa") == 2 and ck.cfg.vision is not None
    model = ck.load_model()
    assert model.mm_projector.linear_1.weight.shape == (128, 128)
    shard = next(f for f in sorted(path.glob("*.safetensors")) if "mm_projector.proj.0.weight" in load_file(f))
    tensors = load_file(shard)
    good = dict(tensors)
    tensors["mm_projector.proj.0.weight"] = torch.zeros(128, 64, dtype=torch.bfloat16)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"'mm_projector.proj.0.weight' has shape \[128, 64\], expected"):
        Checkpoint(path)
    tensors = dict(good)
    tensors["mm_projector.proj.0.bias"] = torch.zeros(128, dtype=torch.bfloat16)  # patchmergerv2 has no biases
    save_file(tensors, str(shard), metadata={"format": "pt"})
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"]["mm_projector.proj.0.bias"] = shard.name
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="unexpected tensor 'mm_projector.proj.0.bias'"):
        Checkpoint(path)


# ----------------------------------------------------------------------------------------------- sizes
K3_TINY = dict(
    layout="kimi_k3",
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=64,
    pos_emb_height=6,
    pos_emb_width=6,
    image_token_id=1,
    image_start_token_id=2,
    image_end_token_id=3,
)


@pytest.mark.parametrize(
    "variant",
    [
        dict(norm_type="rmsnorm", attn_bias=False, linear_bias=False, patch_embed_proj_bias=False, qkv_hidden_size=48,
             projector_type="patchmergerv2"),
        dict(norm_type="layernorm", attn_bias=True, linear_bias=False, patch_embed_proj_bias=True, qkv_hidden_size=16,
             projector_type="patchmerger"),
        dict(norm_type="rmsnorm", attn_bias=False, linear_bias=True, patch_embed_proj_bias=False,
             projector_type="patchmerger"),
    ],
)  # fmt: skip
def test_params_count_the_built_tower(variant):
    v = VisionConfig(**K3_TINY, **variant)
    with torch.device("meta"):
        built = sum(p.numel() for m in (VisionTower(v), Projector(v, 40)) for p in m.parameters())
    assert v.params(40) == built


def test_planning_counts_the_k3_tower(k3_vision_dir):
    """The memory arithmetic (sizing: total_params) counts the tower: the vision checkpoint's model is larger by
    exactly its tower, and equals the built model's parameters."""
    cfg = checkpoint_config(k3_vision_dir)
    text_only = cfg.model_copy(update={"vision": None})
    assert cfg.total_params - text_only.total_params == cfg.vision.params(cfg.hidden_size) == 65248
    with torch.device("meta"):
        model = Transformer(cfg)
    tower = sum(p.numel() for n, p in model.named_parameters() if n.startswith(("vision_tower", "mm_projector")))
    assert tower == cfg.vision.params(cfg.hidden_size)


# ----------------------------------------------------------------------------------------------- (a) kimi_k25
def test_k3_tower_matches_transformers_kimi_k25_where_the_settings_coincide():
    """K3's module at K2.5's settings (LayerNorm, biases, q/k/v as wide as the tower, bicubic resampling,
    patchmerger) against transformers' Kimi_K25VisionModel + Kimi_K25MultimodalProjection on the same weights,
    moved into the published layout by transformers' own inverse RoPE permutation (its converter's
    PermuteForRope, inverse=True) and concatenation into wqkv."""
    from transformers.core_model_loading import PermuteForRope
    from transformers.models.kimi_k25.configuration_kimi_k25 import Kimi_K25Config, Kimi_K25VisionConfig
    from transformers.models.kimi_k25.modeling_kimi_k25 import Kimi_K25MultimodalProjection, Kimi_K25VisionModel

    v = VisionConfig(
        **K3_TINY | dict(pos_emb_height=8, pos_emb_width=8),
        norm_type="layernorm",
        attn_bias=True,
        linear_bias=True,
        patch_embed_proj_bias=True,
        pos_emb_interpolation_mode="bicubic",
        projector_type="patchmerger",
    )
    lm_hidden = 48
    vc = Kimi_K25VisionConfig(
        patch_size=14,
        pos_emb_height=8,
        pos_emb_width=8,
        num_attention_heads=2,
        num_hidden_layers=2,
        hidden_size=32,
        intermediate_size=64,
        merge_kernel_size=[2, 2],
        rope_parameters={"rope_type": "axial", "rope_theta": v.rope_theta},
    )
    full = Kimi_K25Config(
        vision_config=vc.to_dict(),
        projection_hidden_size=32,
        text_config={"model_type": "deepseek_v3", "hidden_size": lm_hidden},
    )
    gen = torch.Generator().manual_seed(11)
    tower, proj = Kimi_K25VisionModel(vc).eval(), Kimi_K25MultimodalProjection(full).eval()
    with torch.no_grad():
        for p in list(tower.parameters()) + list(proj.parameters()):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    unpermute = PermuteForRope(inverse=True)._permute_for_rope
    t = tower.state_dict()
    ours = {
        "patch_embed.proj.weight": t["patch_embed.proj.weight"],
        "patch_embed.proj.bias": t["patch_embed.proj.bias"],
        "patch_embed.pos_emb.weight": t["patch_embed.pos_emb.position_embeddings"],
        "encoder.final_layernorm.weight": t["final_layernorm.weight"],
        "encoder.final_layernorm.bias": t["final_layernorm.bias"],
    }
    for i in range(2):
        L, B = f"layers.{i}.", f"encoder.blocks.{i}."
        for kind in ("weight", "bias"):
            q, k, val = (t[f"{L}attn.{p}_proj.{kind}"] for p in "qkv")
            ours[B + f"wqkv.{kind}"] = torch.cat([unpermute(q, vc), unpermute(k, vc), val])
            for theirs, mine in (("norm1", "norm0"), ("norm2", "norm1"), ("attn.proj", "wo")):
                ours[B + f"{mine}.{kind}"] = t[f"{L}{theirs}.{kind}"]
            for theirs, mine in (("fc1", "fc0"), ("fc2", "fc1")):
                ours[B + f"mlp.{mine}.{kind}"] = t[f"{L}mlp.{theirs}.{kind}"]
    p_sd = proj.state_dict()
    mine_proj = {
        f"{m}.{kind}": p_sd[f"{th}.{kind}"]
        for th, m in (("pre_norm", "pre_norm"), ("in_proj", "linear_1"), ("out_proj", "linear_2"))
        for kind in ("weight", "bias")
    }
    our_tower, our_proj = VisionTower(v).eval(), Projector(v, lm_hidden).eval()
    our_tower.load_state_dict(ours, strict=True)
    our_proj.load_state_dict(mine_proj, strict=True)
    model = torch.nn.Module()
    model.vision_tower, model.mm_projector = our_tower, our_proj
    worst = 0.0
    for h, w in ((84, 140), (112, 112), (224, 56)):
        pixels = torch.randint(0, 256, (h, w, 3), dtype=torch.uint8, generator=gen)
        x = (pixels.float() / 255 - 0.5) / 0.5
        pv = x.permute(2, 0, 1).reshape(3, h // 14, 14, w // 14, 14).permute(1, 3, 0, 2, 4).reshape(-1, 3, 14, 14)
        with torch.no_grad():
            ref = proj(tower(pv, grid_thw=torch.tensor([[1, h // 14, w // 14]])).pooler_output).squeeze(1)
        got = encode_image(model, pixels)
        assert got.shape == ref.shape == ((h // 28) * (w // 28), lm_hidden)
        torch.testing.assert_close(got, ref, atol=2e-4, rtol=2e-4)
        worst = max(worst, (got - ref).abs().max().item())
    print(f"kimi_k25 settings: max |ours - transformers| = {worst:.2e}")


# ----------------------------------------------------------------------------------------------- (b) float64
def test_k3_settings_match_a_float64_reference(k3_vision_dir):
    """The loaded tower (fp32) against the float64 reference on non-square, resampled grids: within 1e-4."""
    model = Checkpoint(k3_vision_dir).load_model()
    gen = torch.Generator().manual_seed(5)
    worst = 0.0
    for h, w in ((84, 140), (112, 112), (56, 224)):
        pixels = torch.randint(0, 256, (h, w, 3), dtype=torch.uint8, generator=gen)
        ref = reference_features(k3_vision_dir, pixels)
        got = encode_image(model, pixels).double()
        assert got.shape == ref.shape == ((h // 28) * (w // 28), 64)
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
        worst = max(worst, (got - ref).abs().max().item())
    print(f"K3 settings: max |ours fp32 - float64 reference| = {worst:.2e}")


def test_divided_fixed_time_axis_matches_the_published_sinusoid(k3_vision_dir):
    """Frames of a clip add get_1d_sincos_pos_embed(D, t) (numpy's formula, float64 here) to the resampled grid;
    one frame adds nothing; more than pos_emb_time frames is refused."""
    model = Checkpoint(k3_vision_dir).load_model()
    pos = model.vision_tower.patch_embed.pos_emb
    d = VISION["vt_hidden_size"]
    omega = 1.0 / 10000.0 ** (torch.arange(d // 2, dtype=torch.float64) / (d / 2.0))
    out = torch.outer(torch.arange(3, dtype=torch.float64), omega)
    sincos = torch.cat([out.sin(), out.cos()], 1)
    torch.testing.assert_close(time_embedding(d, 3).double(), sincos, atol=1e-7, rtol=0)
    one = pos(4, 6)
    three = pos(4, 6, frames=3).view(3, 24, d)
    for t in range(3):
        torch.testing.assert_close(three[t].double(), one.double() + sincos[t], atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="pos_emb_time=4"):
        pos(4, 6, frames=5)


def test_k25_layout_unchanged_and_refuses_k3_variants():
    cfg = preset("tiny")
    assert cfg.vision.layout == "kimi_k25"
    with pytest.raises(ValueError, match="vision.norm_type='rmsnorm'"):
        VisionConfig.model_validate(cfg.vision.model_dump() | {"norm_type": "rmsnorm"})
