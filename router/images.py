"""Images in requests: decoding, limits, the resize policy, remote fetches, and what the prefix cache keys on.

An image part (OpenAI `image_url`, Anthropic `image`, Responses `input_image`) becomes a `PreparedImage`: RGB
pixels decoded with Pillow (PNG, JPEG, WebP, GIF's first frame), scaled down by kimi_k25's policy when larger
than the encoder takes (`navit_resize`: never up, at most `max_patches` patches and `max_patches_per_side` per
side, aspect kept) and padded with black to whole image tokens (28×28 px). Its digest (SHA-256 of the pixels fed
to the encoder) is what the prefix cache keys on, so the same image in a later turn or request hits the cache.

Limits (router flags, `ImageLimits`): encoded bytes and decoded pixels per image (a decompression bomb is
refused before it is decoded), images and encoder pixels per request. Remote `http(s)` URLs are fetched only
from hosts on an allow-list (empty by default: fetching arbitrary URLs from the router is an SSRF hole), with a
timeout, a byte limit and no redirects. Every refusal is an `ImageError` naming the part (e.g.
`messages[1].content[2]`), answered with 400, and nothing else in the batch is affected.
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import io
import math
import re
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx
import numpy as np
from PIL import Image

from expertmesh.config import VisionConfig
from expertmesh.router.errors import APIError
from expertmesh.router.prepared_image import ImageLimits, PreparedImage

FORMATS = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp", "GIF": "image/gif"}
DETAILS = ("auto", "low", "high")
LOW_DETAIL_PATCHES = 256          # detail "low": at most 16×16 patches (64 image tokens)
_DATA_URL = re.compile(r"^data:(?P<type>[\w.+-]+/[\w.+-]+)?(?P<params>(;[\w.+-]+=[^;,]*)*)(?P<b64>;base64)?,",
                       re.IGNORECASE)


class ImageError(APIError):
    """A refused image (→ 400), naming the part it came from."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}", param=param, code="invalid_image")


def navit_resize(height: int, width: int, v: VisionConfig, max_patches: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """kimi_k25's resize policy → ((resized h, w), (padded h, w)): scale down (never up) to at most
    `max_patches` patches and `v.max_patches_per_side` per side, then pad to whole merged patches."""
    p = v.patch_size
    patches = max(1.0, height // p) * max(1.0, width // p)
    side = v.max_patches_per_side * p
    scale = min(1.0, math.sqrt(max_patches / patches), side / height, side / width)
    h, w = min(max(1, int(height * scale)), side), min(max(1, int(width * scale)), side)
    mh, mw = v.merge_pixels
    return (h, w), (-(-h // mh) * mh, -(-w // mw) * mw)


def decode_image(data: bytes, param: str, v: VisionConfig, limits: ImageLimits, detail: str = "auto"
                 ) -> PreparedImage:
    """Encoded image bytes → a PreparedImage (decoded, resized, padded), or ImageError naming `param`."""
    if detail not in DETAILS:
        raise ImageError(f"{param}.detail", f"{detail!r} is not one of {', '.join(DETAILS)}")
    if len(data) > limits.max_bytes:
        raise ImageError(param, f"{len(data)} bytes exceed the limit of {limits.max_bytes} bytes per image")
    try:
        im = Image.open(io.BytesIO(data), formats=list(FORMATS))
        w, h = im.size
        if w * h > limits.max_source_pixels:
            raise ImageError(param, f"{w}×{h} pixels exceed the limit of {limits.max_source_pixels} pixels per image")
        im.seek(0)                                   # GIF / animated WebP: the first frame
        im = im.convert("RGB")
    except ImageError:
        raise
    except Image.DecompressionBombError as e:
        raise ImageError(param, f"too many pixels to decode ({e})") from None
    except Exception as e:                           # Pillow raises many kinds for a corrupt or unknown file
        raise ImageError(param, f"not a decodable image ({', '.join(FORMATS)}): {type(e).__name__}: {e}") from None
    max_patches = min(v.max_patches, LOW_DETAIL_PATCHES) if detail == "low" else v.max_patches
    (rh, rw), (ph, pw) = navit_resize(h, w, v, max_patches)
    if (rh, rw) != (h, w):
        im = im.resize((rw, rh), Image.Resampling.BICUBIC)
    canvas = Image.new("RGB", (pw, ph))
    canvas.paste(im, (0, 0))
    pixels = np.array(canvas, dtype=np.uint8)                       # [ph, pw, 3], writable
    digest = hashlib.sha256(canvas.tobytes() + f"{ph}x{pw}".encode()).hexdigest()
    return PreparedImage(pixels, digest, v.tokens_for(ph, pw), (w, h))


def decode_base64(data, param: str) -> bytes:
    if not isinstance(data, str):
        raise ImageError(param, f"expected base64 text, found {type(data).__name__}")
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ImageError(param, f"not valid base64 ({e})") from None


def data_url_bytes(url: str, param: str) -> bytes:
    m = _DATA_URL.match(url)
    if m is None or not m.group("b64"):
        raise ImageError(param, "expected a data URL of the form data:image/<png|jpeg|webp|gif>;base64,<data>")
    if m.group("type") and m.group("type").lower() not in FORMATS.values():
        raise ImageError(param, f"media type {m.group('type')!r} is not one of {', '.join(FORMATS.values())}")
    return decode_base64(url[m.end():], param)


def is_remote(url) -> bool:
    return isinstance(url, str) and url[:8].lower().startswith(("http://", "https://"))


def check_allowed(url: str, param: str, limits: ImageLimits) -> None:
    """Refuse a remote URL unless its host (or host:port) is on the allow-list."""
    if not limits.fetch_allow:
        raise ImageError(param, "remote image URLs are not enabled on this server (send a data URL; the operator "
                                "can allow hosts with --image-fetch-allow)")
    parts = urlsplit(url)
    host = (parts.hostname or "").lower()
    with_port = f"{host}:{parts.port}" if parts.port else host
    if host not in limits.fetch_allow and with_port not in limits.fetch_allow:
        raise ImageError(param, f"host {with_port!r} is not on this server's image fetch allow-list")


async def fetch_remote(urls: dict[str, str], limits: ImageLimits) -> dict[str, bytes]:
    """{param: url} of remote image URLs → {url: bytes}, fetched concurrently (allow-listed hosts only, no
    redirects, `fetch_timeout` each, at most `max_bytes` read)."""
    if not urls:
        return {}
    for param, url in urls.items():
        check_allowed(url, param, limits)

    async def one(client, param: str, url: str) -> tuple[str, bytes]:
        try:
            async with client.stream("GET", url) as r:
                if r.status_code != 200:
                    raise ImageError(param, f"fetching {url} answered HTTP {r.status_code}")
                body = bytearray()
                async for chunk in r.aiter_bytes():
                    body += chunk
                    if len(body) > limits.max_bytes:
                        raise ImageError(param, f"{url}: more than {limits.max_bytes} bytes (the per-image limit)")
                return url, bytes(body)
        except httpx.HTTPError as e:
            raise ImageError(param, f"fetching {url} failed: {type(e).__name__}: {e}") from None

    async with httpx.AsyncClient(timeout=limits.fetch_timeout, follow_redirects=False, trust_env=False) as client:
        return dict(await asyncio.gather(*(one(client, p, u) for p, u in urls.items())))


@dataclass
class ImageBudget:
    """One request's images, checked against its per-request limits as they are added."""
    v: VisionConfig | None
    limits: ImageLimits
    fetched: dict[str, bytes] = field(default_factory=dict)
    images: list[PreparedImage] = field(default_factory=list)
    pixels: int = 0

    def _vision(self, param: str) -> VisionConfig:
        if self.v is None:
            raise ImageError(param, "this model takes text only (no vision encoder)")
        if len(self.images) >= self.limits.max_images_per_request:
            raise ImageError(param, f"more than {self.limits.max_images_per_request} images in one request "
                                    f"(max_images_per_request)")
        return self.v

    def _add(self, img: PreparedImage, param: str) -> PreparedImage:
        if self.pixels + img.pixel_count > self.limits.max_pixels_per_request:
            raise ImageError(param, f"the request's images come to more than {self.limits.max_pixels_per_request} "
                                    f"encoder pixels (the per-request pixel budget)")
        self.pixels += img.pixel_count
        self.images.append(img)
        return img

    def from_url(self, url, param: str, detail: str = "auto") -> PreparedImage:
        """A data URL, or a remote URL fetched beforehand (fetch_remote)."""
        v = self._vision(param)
        if not isinstance(url, str) or not url:
            raise ImageError(param, "expected a URL string")
        if is_remote(url):
            check_allowed(url, param, self.limits)
            data = self.fetched[url]
        elif url[:5].lower() == "data:":
            data = data_url_bytes(url, param)
        else:
            raise ImageError(param, "expected a data: URL or an http(s) URL")
        return self._add(decode_image(data, param, v, self.limits, detail), param)

    def from_base64(self, media_type, data, param: str) -> PreparedImage:
        v = self._vision(param)
        if media_type not in FORMATS.values():
            raise ImageError(f"{param}.source.media_type", f"{media_type!r} is not one of {', '.join(FORMATS.values())}")
        return self._add(decode_image(decode_base64(data, f"{param}.source.data"), param, v, self.limits), param)


async def request_images(v: VisionConfig | None, limits: ImageLimits, urls: dict[str, str]) -> ImageBudget:
    """A request's ImageBudget, the remote image URLs it holds ({part: url}) fetched first."""
    return ImageBudget(v, limits, await fetch_remote(urls, limits))
