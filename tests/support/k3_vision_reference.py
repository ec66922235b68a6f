"""A float64 reference of Kimi K3's vision tower + patchmergerv2 projector, written from the published implementation
(vLLM's kimi_k25_vit as K3's vision_config configures it: MoonViT3d, Rope2DPosEmbRepeated, MLP2, tpool_patch_merger,
KimiK25MultiModalProjector) and reading the checkpoint's tensors by their published names — not expertmesh's code."""

import math

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from support.k3_checkpoint import VISION


def reference_features(path, pixels: torch.Tensor) -> torch.Tensor:
    """The published tower + patchmergerv2 projector (vLLM kimi_k25_vit / MoonViT3d, configured as VISION) in
    float64 from the checkpoint's own tensors: complex RoPE pairs, RMSNorm eps = bf16's epsilon, bilinear
    position resampling, 2×2 merge, Linear-GELU-Linear, RMSNorm."""
    W = {}
    for f in path.glob("*.safetensors"):
        W |= {k: t.double() for k, t in load_file(f).items() if k.startswith(("vision_tower", "mm_projector"))}
    v = VISION
    p, d, q, nh = v["patch_size"], v["vt_hidden_size"], v["qkv_hidden_size"], v["vt_num_attention_heads"]
    hd = q // nh
    eps = 2.0**-7

    def rms(x, w, e=eps):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + e) * w

    H, Wd = pixels.shape[0] // p, pixels.shape[1] // p
    x = (pixels.double() / 255 - 0.5) / 0.5
    patches = x.permute(2, 0, 1).reshape(3, H, p, Wd, p).permute(1, 3, 0, 2, 4).reshape(H * Wd, -1)
    x = patches @ W["vision_tower.patch_embed.proj.weight"].reshape(d, -1).T
    grid = W["vision_tower.patch_embed.pos_emb.weight"].permute(2, 0, 1)[None]
    pos = F.interpolate(grid, size=(H, Wd), mode="bilinear")[0].permute(1, 2, 0).reshape(H * Wd, d)
    x = x + pos
    freqs = 1.0 / 10000.0 ** (torch.arange(0, hd, 4)[: hd // 4].double() / hd)
    flat = torch.arange(H * Wd)
    xs, ys = (flat % Wd).double(), (flat // Wd).double()
    cis = torch.stack([torch.polar(torch.ones(H * Wd, hd // 4, dtype=torch.float64), torch.outer(c, freqs))
                       for c in (xs, ys)], dim=-1).reshape(H * Wd, hd // 2)  # fmt: skip
    for b in range(v["vt_num_hidden_layers"]):
        B = f"vision_tower.encoder.blocks.{b}."
        h = rms(x, W[B + "norm0.weight"])
        qq, kk, vv = (h @ W[B + "wqkv.weight"].T).view(-1, 3, nh, hd).unbind(1)
        qq, kk = (torch.view_as_real(torch.view_as_complex(t.reshape(-1, nh, hd // 2, 2).contiguous()) * cis[:, None])
                  .reshape(-1, nh, hd) for t in (qq, kk))  # fmt: skip
        att = torch.softmax(torch.einsum("qhd,khd->hqk", qq, kk) / math.sqrt(hd), -1)
        x = x + torch.einsum("hqk,khd->qhd", att, vv).reshape(-1, q) @ W[B + "wo.weight"].T
        h = rms(x, W[B + "norm1.weight"])
        x = x + F.gelu(h @ W[B + "mlp.fc0.weight"].T, approximate="tanh") @ W[B + "mlp.fc1.weight"].T
    x = rms(x, W["vision_tower.encoder.final_layernorm.weight"])
    merged = x.view(1, H // 2, 2, Wd // 2, 2, d).mean(0).permute(0, 2, 1, 3, 4).reshape(-1, 4 * d)
    y = F.gelu(merged @ W["mm_projector.proj.0.weight"].T) @ W["mm_projector.proj.2.weight"].T
    return rms(y, W["mm_projector.post_norm.weight"], v["projector_ln_eps"])
