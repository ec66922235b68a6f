"""Image input: a MoonViT-style vision tower and the projector into the language model's embedding space.
`VisionTower` / `Projector` build the modules of the config's layout: kimi_k25's (here) or Kimi K3's published
one (expertmesh/model/vision_k3.py); encoding, checks and splicing below serve both.

Structure and tensor names follow transformers' `kimi_k25` (Kimi K2.5), so its weights load under
`vision_tower.*` / `mm_projector.*` (the `model.` prefix of `Kimi_K25ForConditionalGeneration` dropped):

    vision_tower.patch_embed.proj                 Conv2d(3, D, 14, stride 14): one row per 14×14 patch
    vision_tower.patch_embed.pos_emb.position_embeddings   [Hp, Wp, D] learned grid, bicubically resampled
                                                  (align_corners=False) to each image's patch grid
    vision_tower.layers.N.{norm1, attn.{q,k,v}_proj, attn.proj, norm2, mlp.fc1, mlp.fc2}
                                                  pre-norm ViT layers, bidirectional attention within the image,
                                                  2-D axial RoPE on q and k (rotate-half over the whole head)
    vision_tower.final_layernorm
    mm_projector.{pre_norm, in_proj, out_proj}    LayerNorm per patch, then each 2×2 block of patches
                                                  (concatenated) → Linear, GELU, Linear → one LM embedding row

An image arrives as uint8 RGB pixels [H, W, 3] already resized and padded so H and W are multiples of
14·2 (router/images.py); it becomes (H/28)·(W/28) image tokens. Each image is encoded on its own, so its
embedding rows depend on nothing else in the batch. Plain PyTorch in the parameters' dtype (fp32 on CPU).
"""

from __future__ import annotations

import hashlib
import math
import time

import torch
import torch.nn.functional as F
from torch import nn

from expertmesh.model.config import VisionConfig
from expertmesh.model.vision_k3 import K3Projector, K3VisionTower, embed_patches
from expertmesh.wire.worker_api import ImageEncode, ImageSpan


class PositionEmbedding(nn.Module):
    def __init__(self, v: VisionConfig):
        super().__init__()
        self.position_embeddings = nn.Parameter(torch.zeros(v.pos_emb_height, v.pos_emb_width, v.hidden_size))

    def forward(self, grid_h: int, grid_w: int) -> torch.Tensor:
        """[grid_h · grid_w, D] in raster order: the learned grid resampled to the image's patch grid."""
        table = self.position_embeddings.float().permute(2, 0, 1)[None]  # [1, D, Hp, Wp]
        if tuple(table.shape[-2:]) != (grid_h, grid_w):
            table = F.interpolate(table, size=(grid_h, grid_w), mode="bicubic", align_corners=False)
        return table[0].flatten(1).T


class PatchEmbed(nn.Module):
    def __init__(self, v: VisionConfig):
        super().__init__()
        self.proj = nn.Conv2d(3, v.hidden_size, kernel_size=v.patch_size, stride=v.patch_size)
        self.pos_emb = PositionEmbedding(v)


class Attention(nn.Module):
    def __init__(self, v: VisionConfig):
        super().__init__()
        d = v.hidden_size
        self.n_heads, self.head_dim = v.num_attention_heads, d // v.num_attention_heads
        self.q_proj, self.k_proj, self.v_proj, self.proj = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = (p(x).view(n, self.n_heads, self.head_dim) for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        scores = torch.einsum("qhd,khd->hqk", q, k) * self.head_dim**-0.5
        probs = torch.softmax(scores.float(), dim=-1).to(v.dtype)
        return self.proj(torch.einsum("hqk,khd->qhd", probs, v).reshape(n, -1))


class MLP(nn.Module):
    def __init__(self, v: VisionConfig):
        super().__init__()
        self.fc1, self.fc2 = (
            nn.Linear(v.hidden_size, v.intermediate_size),
            nn.Linear(v.intermediate_size, v.hidden_size),
        )
        self.approximate = "tanh" if v.hidden_act == "gelu_pytorch_tanh" else "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate=self.approximate))


class EncoderLayer(nn.Module):
    def __init__(self, v: VisionConfig):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(v.hidden_size, eps=1e-5), nn.LayerNorm(v.hidden_size, eps=1e-5)
        self.attn, self.mlp = Attention(v), MLP(v)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.mlp(self.norm2(x))


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE in fp32: x [N, heads, hd], cos / sin [N, hd]."""
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos[:, None] + rotated * sin[:, None]).to(x.dtype)


def axial_rope(grid_h: int, grid_w: int, head_dim: int, theta: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [grid_h · grid_w, head_dim] of kimi_k25's 2-D RoPE: the same head_dim/4 frequencies for the
    row and the column, interleaved (column, row) per frequency, the pair repeated for rotate-half."""
    spatial = head_dim // 2
    inv_freq = 1.0 / (theta ** (torch.arange(0, spatial, 2, dtype=torch.float, device=device) / spatial))
    rows, cols = torch.meshgrid(torch.arange(grid_h, device=device), torch.arange(grid_w, device=device), indexing="ij")
    freqs = torch.stack([cols.flatten(), rows.flatten()], dim=-1)[..., None].float() * inv_freq  # [N, 2, hd/4]
    freqs = freqs.transpose(1, 2).flatten(1)  # [N, hd/2]
    freqs = torch.cat([freqs, freqs], dim=-1)
    return freqs.cos(), freqs.sin()


class K25VisionTower(nn.Module):
    def __init__(self, v: VisionConfig):
        super().__init__()
        self.cfg = v
        self.patch_embed = PatchEmbed(v)
        self.layers = nn.ModuleList(EncoderLayer(v) for _ in range(v.num_hidden_layers))
        self.final_layernorm = nn.LayerNorm(v.hidden_size, eps=1e-5)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """uint8 [H, W, 3] → merged patch states [H/28 · W/28, 4, D] (each 2×2 block's patches in raster order)."""
        v = self.cfg
        p, (kh, kw) = v.patch_size, v.merge_kernel_size
        x, h, w = embed_patches(self.patch_embed, pixels, p)
        cos, sin = axial_rope(h, w, v.hidden_size // v.num_attention_heads, v.rope_theta, device=x.device)
        for layer in self.layers:
            x = layer(x, cos, sin)
        x = self.final_layernorm(x)
        blocks = x.view(h // kh, kh, w // kw, kw, -1).permute(0, 2, 1, 3, 4)
        return blocks.reshape((h // kh) * (w // kw), kh * kw, -1)


class K25Projector(nn.Module):
    def __init__(self, v: VisionConfig, lm_hidden: int):
        super().__init__()
        merged = v.hidden_size * v.merge_kernel_size[0] * v.merge_kernel_size[1]
        self.pre_norm = nn.LayerNorm(v.hidden_size, eps=v.projection_layer_norm_eps)
        self.in_proj, self.out_proj = nn.Linear(merged, merged), nn.Linear(merged, lm_hidden)

    def forward(self, merged: torch.Tensor) -> torch.Tensor:
        """[T, k, D] → [T, lm_hidden]."""
        x = self.pre_norm(merged).reshape(merged.shape[0], -1)
        return self.out_proj(F.gelu(self.in_proj(x)))


def VisionTower(v: VisionConfig) -> nn.Module:  # noqa: N802 (builds the module of the config's layout)
    """The tower of `v.layout`: kimi_k25's names (here) or Kimi K3's published ones (vision_k3.py)."""
    return K3VisionTower(v) if v.layout == "kimi_k3" else K25VisionTower(v)


def Projector(v: VisionConfig, lm_hidden: int) -> nn.Module:  # noqa: N802
    """The projector of `v.layout` into an LM of hidden size `lm_hidden`."""
    return K3Projector(v, lm_hidden) if v.layout == "kimi_k3" else K25Projector(v, lm_hidden)


def check_pixels(pixels: torch.Tensor, v: VisionConfig) -> None:
    """An image the encoder can take: uint8 [H, W, 3], sides multiples of the merged patch, within the limits."""
    mh, mw = v.merge_pixels
    if pixels.dtype != torch.uint8 or pixels.dim() != 3 or pixels.shape[2] != 3:
        raise ValueError(f"pixels: expected uint8 [H, W, 3], found {pixels.dtype} {list(pixels.shape)}")
    h, w = pixels.shape[:2]
    if h == 0 or w == 0 or h % mh or w % mw:
        raise ValueError(f"pixels: {h}×{w} is not a positive multiple of {mh}×{mw} (the merged patch)")
    if (h // v.patch_size) * (w // v.patch_size) > v.max_patches or max(h, w) // v.patch_size > v.max_patches_per_side:
        raise ValueError(
            f"pixels: {h}×{w} exceeds the encoder's {v.max_patches} patches ({v.max_patches_per_side} per side)"
        )


@torch.no_grad()
def encode_image(model, pixels: torch.Tensor) -> torch.Tensor:
    """One image's embedding rows [tokens, hidden] through `model.vision_tower` and `model.mm_projector`."""
    check_pixels(pixels, model.vision_tower.cfg)
    return model.mm_projector(model.vision_tower(pixels))


@torch.no_grad()
def init_vision_(model, seed: int) -> None:
    """Seeded random weights for the tower and projector: LayerNorms identity, projections scaled by
    1/sqrt(fan-in) so the image rows come out O(1) like the token embeddings."""
    gen = torch.Generator().manual_seed(seed)
    for prefix in ("vision_tower", "mm_projector"):
        for name, p in getattr(model, prefix).named_parameters():
            if "norm" in name.rsplit(".", 1)[0].rsplit(".", 1)[-1]:
                p.fill_(1.0) if name.endswith("weight") else p.zero_()
            elif p.dim() >= 2 and not name.endswith(("position_embeddings", "pos_emb.weight")):
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p[0].numel()))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)


# ----------------------------------------------------------------------------------------------- per sequence
class SequenceImages:
    """The images of one sequence on the attention worker that owns it. Each distinct image (by pixel digest) is
    encoded once, when the prefill first reaches one of its rows; its rows replace the placeholder embeddings at
    their positions; its embeddings are dropped once the sequence is past every span that uses them."""

    def __init__(self, spans: list[ImageSpan], v: VisionConfig, max_context: int):
        self.spans: list[tuple[int, int, str, torch.Tensor]] = []  # (start, end, digest, pixels)
        end = 0
        for i, s in enumerate(sorted(spans, key=lambda s: s.position)):
            pixels = torch.as_tensor(s.pixels)  # numpy from an in-process router, torch off the wire
            try:
                check_pixels(pixels, v)
            except ValueError as e:
                raise ValueError(f"images[{i}].{e}") from None
            n = v.tokens_for(*pixels.shape[:2])
            if s.position < end or s.position + n > max_context:
                raise ValueError(
                    f"images[{i}].position={s.position}: its {n} tokens overlap another image or "
                    f"pass the context of {max_context}"
                )
            digest = hashlib.sha256(pixels.numpy().tobytes() + bytes(str(tuple(pixels.shape)), "ascii")).hexdigest()
            self.spans.append((s.position, s.position + n, digest, pixels))
            end = s.position + n
        self.token_id = v.image_token_id
        self.embeds: dict[str, torch.Tensor] = {}

    def splice(
        self, model, x: torch.Tensor, tokens: list[int], row0: int, first: int, seq_id: str
    ) -> list[ImageEncode]:
        """Overwrite the rows of positions first.. (x rows row0.., fed `tokens`) that image tokens occupy."""
        last = first + len(tokens)
        live = [s for s in self.spans if s[1] > first]
        for digest in set(self.embeds) - {s[2] for s in live}:
            del self.embeds[digest]
        encodes = []
        for start, end, digest, pixels in live:
            lo, hi = max(start, first), min(end, last)
            if lo >= hi:
                continue
            wrong = [p for p in range(lo, hi) if tokens[p - first] != self.token_id]
            if wrong:
                raise ValueError(
                    f"token_ids: position {wrong[0]} holds {tokens[wrong[0] - first]}, not the image "
                    f"token {self.token_id} of the image at {start}..{end}"
                )
            if digest not in self.embeds:
                t0 = time.perf_counter()
                self.embeds[digest] = encode_image(model, pixels).to(x.dtype)
                encodes.append(ImageEncode(seq_id, end - start, time.perf_counter() - t0))
            x[row0 + lo - first : row0 + hi - first] = self.embeds[digest][lo - start : hi - start].to(x.device)
        return encodes
