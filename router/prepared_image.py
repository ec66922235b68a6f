"""An image as the engine sees it once the API layer has decoded it (router/images.py): its pixels, digest and
token count; where its placeholder run sits in a prompt; and what the prefix cache hashes for it. Plus the limits
the deployment sets on image input. Pure data and functions: no decoding, no HTTP."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from expertmesh.model.config import VisionConfig


@dataclass(frozen=True)
class ImageLimits:
    max_bytes: int = 20 * 2**20  # encoded bytes of one image (data URL, base64 or fetched)
    max_source_pixels: int = 50_000_000  # decoded width × height of one image, before resizing
    max_side: int = 16_384  # decoded width or height of one image
    max_aspect: float = 200.0  # the longer side over the shorter (Qwen2-VL's bound)
    max_images_per_request: int = 16
    max_pixels_per_request: int = 16_777_216  # encoder pixels (after resizing) over a request's images
    fetch_allow: tuple[str, ...] = ()  # hosts ("host" or "host:port") remote URLs may come from
    fetch_timeout: float = 10.0


@dataclass(eq=False)
class PreparedImage:
    pixels: np.ndarray  # uint8 [H, W, 3], H and W multiples of the merged patch
    digest: str  # SHA-256 of the pixels and their shape
    tokens: int  # image tokens it becomes
    source_size: tuple[int, int]  # (width, height) as decoded

    def __eq__(self, other) -> bool:  # messages holding images compare by content (reasoning memory keys)
        return isinstance(other, PreparedImage) and other.digest == self.digest

    def __hash__(self) -> int:
        return hash(self.digest)

    @property
    def pixel_count(self) -> int:
        return int(self.pixels.shape[0] * self.pixels.shape[1])

    def hash_words(self) -> list[int]:
        """What the prefix-cache hash reads for this image's placeholder positions: one 32-bit word per token,
        all ≥ 2³¹ (never a token id) and each depending on the whole digest, so different images never share a
        prefix key however few tokens they have."""
        seed = bytes.fromhex(self.digest)
        return [
            0x80000000 | int.from_bytes(hashlib.sha256(seed + i.to_bytes(4, "little")).digest()[:4], "little")
            for i in range(self.tokens)
        ]


def image_positions(prompt: list[int], images: list[PreparedImage], v: VisionConfig) -> list[int]:
    """The position of each image's first placeholder token in `prompt`: the images in order, each matched to the
    next run ⟨image start⟩ ⟨image token⟩×tokens ⟨image end⟩. ValueError when one is missing."""
    out, i = [], 0
    for k, img in enumerate(images):
        n = img.tokens
        while i < len(prompt):
            if (
                prompt[i] == v.image_start_token_id
                and prompt[i + 1 : i + 1 + n] == [v.image_token_id] * n
                and i + 1 + n < len(prompt)
                and prompt[i + 1 + n] == v.image_end_token_id
            ):
                break
            i += 1
        else:
            raise ValueError(f"images[{k}]: no run of {n} image tokens for it in the prompt")
        out.append(i + 1)
        i += n + 2
    return out


def hash_view(tokens: list[int], spans: list[tuple[int, PreparedImage]]) -> list[int]:
    """`tokens` with each image's placeholder positions replaced by its hash words (PreparedImage.hash_words):
    what the prefix cache hashes, so a key covers the pixels and not just the placeholders."""
    if not spans:
        return tokens
    out = list(tokens)
    for pos, img in spans:
        out[pos : pos + img.tokens] = img.hash_words()
    return out
