"""Kimi K3's vision tower (MoonViT3d) and projector, under the published tensor names (VisionConfig layout `kimi_k3`).

The same tower family as Kimi K2.5's (expertmesh/model/vision.py), as vLLM's `kimi_k25_vit` builds it for both
models, with every variant K3's `vision_config` names honoured:

    vision_tower.patch_embed.proj                 Conv2d(3, D, 14, stride 14), bias when patch_embed_proj_bias
    vision_tower.patch_embed.pos_emb.weight       [Hp, Wp, D] learned grid, resampled (pos_emb_interpolation_mode,
                                                  align_corners=False) to the image's patch grid unless it is that
                                                  grid already; "divided_fixed": frame t of a clip adds a fixed
                                                  sinusoid [sin(t·ω) | cos(t·ω)], ω_j = 10000^(-j/(D/2)) — none for
                                                  an image (one frame)
    vision_tower.encoder.blocks.N.{norm0, wqkv, wo, norm1, mlp.fc0, mlp.fc1}
                                                  pre-norm layers (norm_type: LayerNorm eps 1e-5, or RMSNorm with
                                                  eps = bf16's epsilon 2^-7 — what `nn.RMSNorm(dim)` uses on the
                                                  published bf16 weights as vLLM serves them, kept in any dtype);
                                                  wqkv [3·Q, D] (Q = qkv_hidden_size, q k v each head-major), wo
                                                  [D, Q]; bidirectional attention within the image, scale
                                                  (Q/heads)^-0.5; 2-D RoPE on q and k as complex pairs: pair 2k of
                                                  a head turns by column·f_k, pair 2k+1 by row·f_k,
                                                  f_k = θ^(-4k/head_dim); mlp2: fc1(act(fc0(x)))
    vision_tower.encoder.final_layernorm          the same norm type
    mm_projector.{linear_1, linear_2, post_norm}  patchmergerv2: each 2×2 block of patches (concatenated, raster
                                                  order) → Linear, GELU, Linear (no biases) → RMSNorm(eps
                                                  projector_ln_eps) over the LM width; the checkpoint stores
                                                  linear_1 / linear_2 as `proj.0` / `proj.2` (vLLM renames them the
                                                  same way, hf_layout.py here)
    mm_projector.{pre_norm, linear_1, linear_2}   patchmerger: LayerNorm per patch, then Linear, GELU, Linear with
                                                  biases (kimi_k25's projector)

Pixels are K3's processor's: uint8 RGB scaled to [0, 1], then (x − 0.5) / 0.5 per channel. Plain PyTorch in the
parameters' dtype; RoPE and softmax in fp32. Every image is encoded on its own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from expertmesh.model.config import VisionConfig

PIXEL_MEAN, PIXEL_STD = 0.5, 0.5  # kimi_k25's and K3's image processors: IMAGENET_STANDARD_MEAN / _STD
RMS_NORM_EPS = torch.finfo(torch.bfloat16).eps  # 2^-7: nn.RMSNorm(dim)'s eps on the published bf16 weights
LAYER_NORM_EPS = 1e-5
TIME_THETA = 10_000.0


def _norm(v: VisionConfig, width: int) -> nn.Module:
    if v.norm_type == "layernorm":
        return nn.LayerNorm(width, eps=LAYER_NORM_EPS)
    return nn.RMSNorm(width, eps=RMS_NORM_EPS)


def _act(name: str):
    return lambda x: F.gelu(x, approximate="tanh" if name == "gelu_pytorch_tanh" else "none")


def time_embedding(dim: int, frames: int) -> torch.Tensor:
    """The fixed per-frame sinusoid of divided_fixed position embeddings: [frames, dim] as [sin | cos]."""
    omega = 1.0 / TIME_THETA ** (torch.arange(dim // 2, dtype=torch.float64) / (dim / 2.0))
    angles = torch.arange(frames, dtype=torch.float64)[:, None] * omega
    return torch.cat([angles.sin(), angles.cos()], dim=1).float()


class DividedPositionEmbedding(nn.Module):
    """divided_fixed: a learned [Hp, Wp, D] grid resampled per image, plus a fixed sinusoid per frame."""

    def __init__(self, v: VisionConfig):
        super().__init__()
        self.cfg = v
        self.weight = nn.Parameter(torch.zeros(v.pos_emb_height, v.pos_emb_width, v.hidden_size))

    def forward(self, grid_h: int, grid_w: int, frames: int = 1) -> torch.Tensor:
        """[frames · grid_h · grid_w, D] (fp32) in frame-major raster order."""
        if frames > self.cfg.pos_emb_time:
            raise ValueError(f"frames: {frames} exceeds the tower's pos_emb_time={self.cfg.pos_emb_time}")
        table = self.weight.float()
        if tuple(table.shape[:2]) != (grid_h, grid_w):
            table = F.interpolate(
                table.permute(2, 0, 1)[None],
                size=(grid_h, grid_w),
                mode=self.cfg.pos_emb_interpolation_mode,
                align_corners=False,
            )[0].permute(1, 2, 0)
        grid = table.reshape(grid_h * grid_w, -1)
        if frames == 1:
            return grid
        time = time_embedding(grid.shape[-1], frames).to(grid.device)
        return (grid[None] + time[:, None]).reshape(frames * grid_h * grid_w, -1)


class PatchEmbed(nn.Module):
    def __init__(self, v: VisionConfig):
        super().__init__()
        p = v.patch_size
        self.proj = nn.Conv2d(3, v.hidden_size, kernel_size=p, stride=p, bias=v.patch_embed_proj_bias)
        self.pos_emb = DividedPositionEmbedding(v)


def embed_patches(patch_embed: nn.Module, pixels: torch.Tensor, p: int) -> tuple[torch.Tensor, int, int]:
    """uint8 pixels [H, W, 3] → (patch embeddings plus their position embeddings [h · w, D] in raster order, h, w):
    normalised as the image processors do, cut into p×p patches, through `patch_embed.proj` (the conv) and
    `patch_embed.pos_emb(h, w)`. Both towers' first step (vision.py's K2.5 one too)."""
    h, w = pixels.shape[0] // p, pixels.shape[1] // p
    weight = patch_embed.proj.weight
    x = (pixels.to(weight.device, torch.float32) / 255.0 - PIXEL_MEAN) / PIXEL_STD
    patches = x.permute(2, 0, 1).reshape(3, h, p, w, p).permute(1, 3, 0, 2, 4).reshape(h * w, 3, p, p)
    x = patch_embed.proj(patches.to(weight.dtype)).view(h * w, -1)
    return x + patch_embed.pos_emb(h, w).to(x.dtype), h, w


def rope_angles(grid_h: int, grid_w: int, head_dim: int, theta: float, device=None) -> torch.Tensor:
    """[grid_h · grid_w, head_dim / 2] fp32 angles of the complex pairs: (column·f_k, row·f_k) per frequency k."""
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 4, device=device)[: head_dim // 4].float() / head_dim)
    rows, cols = torch.meshgrid(
        torch.arange(grid_h, device=device, dtype=torch.float32),
        torch.arange(grid_w, device=device, dtype=torch.float32),
        indexing="ij",
    )
    angles = torch.stack([torch.outer(cols.flatten(), freqs), torch.outer(rows.flatten(), freqs)], dim=-1)
    return angles.flatten(1)


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, hd] turned pair by pair (dims 2j, 2j+1) by angle j; cos / sin [N, hd/2]; fp32 inside."""
    xf = x.float().unflatten(-1, (-1, 2))
    a, b = xf[..., 0], xf[..., 1]
    c, s = cos[:, None], sin[:, None]
    return torch.stack([a * c - b * s, a * s + b * c], dim=-1).flatten(-2).to(x.dtype)


class MLP2(nn.Module):
    def __init__(self, v: VisionConfig):
        super().__init__()
        self.fc0 = nn.Linear(v.hidden_size, v.intermediate_size, bias=v.linear_bias)
        self.fc1 = nn.Linear(v.intermediate_size, v.hidden_size, bias=v.linear_bias)
        self.act = _act(v.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc1(self.act(self.fc0(x)))


class EncoderBlock(nn.Module):
    def __init__(self, v: VisionConfig):
        super().__init__()
        q = v.qkv_width
        self.n_heads, self.head_dim = v.num_attention_heads, q // v.num_attention_heads
        self.norm0, self.norm1 = _norm(v, v.hidden_size), _norm(v, v.hidden_size)
        self.wqkv = nn.Linear(v.hidden_size, 3 * q, bias=v.attn_bias)
        self.wo = nn.Linear(q, v.hidden_size, bias=v.attn_bias)
        self.mlp = MLP2(v)

    def attention(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.wqkv(x).view(n, 3, self.n_heads, self.head_dim).unbind(1)
        q, k = rotate_pairs(q, cos, sin), rotate_pairs(k, cos, sin)
        scores = torch.einsum("qhd,khd->hqk", q, k).float() * self.head_dim**-0.5
        probs = torch.softmax(scores, dim=-1).to(v.dtype)
        return self.wo(torch.einsum("hqk,khd->qhd", probs, v).reshape(n, -1))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.norm0(x), cos, sin)
        return x + self.mlp(self.norm1(x))


class Encoder(nn.Module):
    def __init__(self, v: VisionConfig):
        super().__init__()
        self.blocks = nn.ModuleList(EncoderBlock(v) for _ in range(v.num_hidden_layers))
        self.final_layernorm = _norm(v, v.hidden_size)


class K3VisionTower(nn.Module):
    def __init__(self, v: VisionConfig):
        super().__init__()
        self.cfg = v
        self.patch_embed = PatchEmbed(v)
        self.encoder = Encoder(v)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """uint8 [H, W, 3] → merged patch states [H/28 · W/28, 4, D] (each 2×2 block's patches in raster order)."""
        v = self.cfg
        p, (kh, kw) = v.patch_size, v.merge_kernel_size
        x, h, w = embed_patches(self.patch_embed, pixels, p)
        angles = rope_angles(h, w, v.qkv_width // v.num_attention_heads, v.rope_theta, device=x.device)
        cos, sin = angles.cos(), angles.sin()
        for block in self.encoder.blocks:
            x = block(x, cos, sin)
        x = self.encoder.final_layernorm(x)
        blocks = x.view(h // kh, kh, w // kw, kw, -1).permute(0, 2, 1, 3, 4)
        return blocks.reshape((h // kh) * (w // kw), kh * kw, -1)


class K3Projector(nn.Module):
    def __init__(self, v: VisionConfig, lm_hidden: int):
        super().__init__()
        self.v2 = v.projector_type == "patchmergerv2"
        merged = v.hidden_size * v.merge_kernel_size[0] * v.merge_kernel_size[1]
        if self.v2:
            self.post_norm = nn.RMSNorm(lm_hidden, eps=v.projection_layer_norm_eps)
        else:
            self.pre_norm = nn.LayerNorm(v.hidden_size, eps=v.projection_layer_norm_eps)
        self.linear_1 = nn.Linear(merged, merged, bias=not self.v2)
        self.linear_2 = nn.Linear(merged, lm_hidden, bias=not self.v2)
        self.act = _act(v.projector_hidden_act)

    def forward(self, merged: torch.Tensor) -> torch.Tensor:
        """[T, k, D] → [T, lm_hidden]."""
        x = merged if self.v2 else self.pre_norm(merged)
        x = self.linear_2(self.act(self.linear_1(x.reshape(merged.shape[0], -1))))
        return self.post_norm(x) if self.v2 else x
