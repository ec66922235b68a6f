"""Images in requests: limits and what a request pays for, the resize policy, remote fetches, decoding off the
event loop, and what the prefix cache keys on.

An image part (OpenAI `image_url`, Anthropic `image`, Responses `input_image`) becomes a `PreparedImage`: RGB
pixels decoded with Pillow (PNG, JPEG, WebP, GIF's first frame), scaled down by kimi_k25's policy when larger
than the encoder takes (`navit_resize`: never up, at most `max_patches` patches and `max_patches_per_side` per
side, aspect kept) and padded with black to whole image tokens (28×28 px). Its digest (SHA-256 of the pixels fed
to the encoder) is what the prefix cache keys on, so the same image in a later turn or request hits the cache.

Work proportional to what was paid for: as the message parser meets an image (`ImageBudget`), only its header is
read — format, width, height — and everything it will cost is checked then, before any pixel is decoded: encoded
bytes, decoded pixels, each side and the aspect ratio (a 97 KB PNG of 1×49,999,999 pixels was decoded on the event
loop in 7 s and 2.5 GB), the image tokens it becomes, the request's images and encoder pixels, and the context
those tokens take. Decoding and resizing then run in a bounded pool of decoder processes (router/image_decode.py)
while the event loop serves everything else (`ImageBudget.decode`).

Remote `http(s)` URLs are fetched only from hosts on an allow-list (empty by default: fetching arbitrary URLs from
the router is an SSRF hole), within one deadline for the whole fetch (connect, headers and every byte), a byte
limit and no redirects; a URL is logged without its userinfo and query string. Every refusal is an `ImageError`
naming the part (e.g. `messages[1].content[2]`), answered with 400, and nothing else in the batch is affected.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import logging
import math
import re
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx
import numpy as np
from PIL import Image

from expertmesh.model.config import VisionConfig
from expertmesh.router.errors import APIError
from expertmesh.router.image_decode import FORMATS as PIL_FORMATS
from expertmesh.router.image_decode import DecodeFailed, ImageDecoder
from expertmesh.router.prepared_image import ImageLimits, PreparedImage

log = logging.getLogger("expertmesh.router.images")


class RedactURLs(logging.Filter):
    """httpx logs each request at INFO with its whole URL (userinfo and presigned query strings included): its
    records' URL arguments are logged as `loggable_url` gives them."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(
                loggable_url(str(a)) if isinstance(a, httpx.URL) or (isinstance(a, str) and is_remote(a)) else a
                for a in record.args
            )
        return True


logging.getLogger("httpx").addFilter(RedactURLs())

FORMATS = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp", "GIF": "image/gif"}
DETAILS = ("auto", "low", "high")
LOW_DETAIL_PATCHES = 256  # detail "low": at most 16×16 patches (64 image tokens)
_DATA_URL = re.compile(
    r"^data:(?P<type>[\w.+-]+/[\w.+-]+)?(?P<params>(;[\w.+-]+=[^;,]*)*)(?P<b64>;base64)?,", re.IGNORECASE
)


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


@dataclass
class ImagePlan:
    """What an image will be, decided from its header: the source size (width, height), the resized and padded
    sizes (width, height) and the image tokens it becomes."""

    source: tuple[int, int]
    resized: tuple[int, int]
    padded: tuple[int, int]
    tokens: int

    @property
    def encoder_pixels(self) -> int:
        return self.padded[0] * self.padded[1]


def read_header(data: bytes, param: str, limits: ImageLimits) -> tuple[int, int]:
    """(width, height) from the image's header — nothing decoded — checked against the per-image limits:
    encoded bytes, decoded pixels, each side and the aspect ratio. ImageError naming `param` otherwise."""
    if len(data) > limits.max_bytes:
        raise ImageError(param, f"{len(data)} bytes exceed the limit of {limits.max_bytes} bytes per image")
    try:
        with Image.open(io.BytesIO(data), formats=list(PIL_FORMATS)) as im:
            w, h = im.size
    except Exception as e:  # Pillow raises many kinds for a corrupt or unknown file
        raise ImageError(param, f"not a decodable image ({', '.join(FORMATS)}): {type(e).__name__}: {e}") from None
    if w < 1 or h < 1:
        raise ImageError(param, f"{w}×{h} pixels: an image needs at least one pixel each way")
    if w * h > limits.max_source_pixels:
        raise ImageError(param, f"{w}×{h} pixels exceed the limit of {limits.max_source_pixels} pixels per image")
    if max(w, h) > limits.max_side:
        raise ImageError(param, f"{w}×{h} pixels: a side over the limit of {limits.max_side} pixels per side")
    if max(w, h) > limits.max_aspect * min(w, h):
        raise ImageError(param, f"{w}×{h} pixels: an aspect ratio over the limit of {limits.max_aspect:g}:1")
    return w, h


def plan_image(data: bytes, param: str, v: VisionConfig, limits: ImageLimits, detail: str = "auto") -> ImagePlan:
    """Encoded image bytes → what decoding them will give (read from the header alone), or ImageError."""
    if detail not in DETAILS:
        raise ImageError(f"{param}.detail", f"{detail!r} is not one of {', '.join(DETAILS)}")
    w, h = read_header(data, param, limits)
    max_patches = min(v.max_patches, LOW_DETAIL_PATCHES) if detail == "low" else v.max_patches
    (rh, rw), (ph, pw) = navit_resize(h, w, v, max_patches)
    return ImagePlan((w, h), (rw, rh), (pw, ph), v.tokens_for(ph, pw))


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
    return decode_base64(url[m.end() :], param)


def is_remote(url) -> bool:
    return isinstance(url, str) and url[:8].lower().startswith(("http://", "https://"))


def loggable_url(url: str) -> str:
    """`url` as it may be logged or echoed: scheme, host, port and path — no userinfo (`alice:hunter2@`), no query
    string or fragment (presigned signatures)."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
        port = f":{parts.port}" if parts.port else ""
    except ValueError:
        return "<malformed URL>"
    host = f"[{host}]" if ":" in host else host
    return f"{parts.scheme}://{host}{port}{parts.path}"


def url_parts(url: str, param: str) -> tuple[str, int | None]:
    """(host, port) of a remote URL; a 400 naming what is malformed (the port, the host)."""
    try:
        parts = urlsplit(url)
    except ValueError as e:
        raise ImageError(param, f"malformed URL ({e})") from None
    if not parts.hostname:
        raise ImageError(param, "malformed URL: no host")
    try:
        port = parts.port
    except ValueError:
        port_text = parts.netloc.rsplit("@", 1)[-1].rsplit("]", 1)[-1].partition(":")[2]
        raise ImageError(param, f"malformed URL: port {port_text[:16]!r} is not a port number (0-65535)") from None
    if any(c in url for c in " \t\r\n\\"):
        raise ImageError(param, "malformed URL: it holds whitespace or a backslash")
    return parts.hostname.lower(), port


def check_allowed(url: str, param: str, limits: ImageLimits) -> None:
    """Refuse a remote URL unless its host (or host:port) is on the allow-list."""
    if not limits.fetch_allow:
        raise ImageError(
            param,
            "remote image URLs are not enabled on this server (send a data URL; the operator "
            "can allow hosts with --image-fetch-allow)",
        )
    host, port = url_parts(url, param)
    with_port = f"{host}:{port}" if port else host
    if host not in limits.fetch_allow and with_port not in limits.fetch_allow:
        raise ImageError(param, f"host {with_port!r} is not on this server's image fetch allow-list")


async def fetch_remote(urls: dict[str, str], limits: ImageLimits) -> dict[str, bytes]:
    """{param: url} of remote image URLs → {url: bytes}, fetched concurrently (allow-listed hosts only, no
    redirects, at most `max_bytes` read), each within `fetch_timeout` seconds in all — connecting, the headers and
    every byte of the body (a server that drips its body held a fetch for as long as it kept dripping)."""
    if not urls:
        return {}
    for param, url in urls.items():
        check_allowed(url, param, limits)

    async def one(client, param: str, url: str) -> tuple[str, bytes]:
        shown = loggable_url(url)
        log.info("fetching image %s for %s", shown, param)
        try:
            async with asyncio.timeout(limits.fetch_timeout):
                async with client.stream("GET", url) as r:
                    if r.status_code != 200:
                        raise ImageError(param, f"fetching {shown} answered HTTP {r.status_code}")
                    body = bytearray()
                    async for chunk in r.aiter_bytes():
                        body += chunk
                        if len(body) > limits.max_bytes:
                            raise ImageError(
                                param, f"{shown}: more than {limits.max_bytes} bytes (the per-image limit)"
                            )
                    return url, bytes(body)
        except TimeoutError:
            raise ImageError(
                param, f"fetching {shown} took longer than {limits.fetch_timeout:g} s (--image-fetch-timeout)"
            ) from None
        except httpx.HTTPError as e:
            raise ImageError(param, f"fetching {shown} failed: {type(e).__name__}") from None
        except (ValueError, UnicodeError) as e:  # httpx's own URL parsing (InvalidURL is not an HTTPError)
            raise ImageError(param, f"malformed URL: {type(e).__name__}") from None

    async with httpx.AsyncClient(timeout=limits.fetch_timeout, follow_redirects=False, trust_env=False) as client:
        return dict(await asyncio.gather(*(one(client, p, u) for p, u in urls.items())))


@dataclass
class ImageBudget:
    """One request's images, each checked from its header against the per-request limits and the context as it is
    added (nothing decoded yet), then decoded together off the event loop (`decode`)."""

    v: VisionConfig | None
    limits: ImageLimits
    fetched: dict[str, bytes] = field(default_factory=dict)
    decoder: ImageDecoder | None = None
    context: int | None = None  # the model's context: the images' tokens must fit in it
    images: list[PreparedImage] = field(default_factory=list)
    pixels: int = 0
    tokens: int = 0
    pending: list[tuple[PreparedImage, bytes, ImagePlan, str]] = field(default_factory=list)

    def _vision(self, param: str) -> VisionConfig:
        if self.v is None:
            raise ImageError(param, "this model takes text only (no vision encoder)")
        if len(self.images) >= self.limits.max_images_per_request:
            raise ImageError(
                param, f"more than {self.limits.max_images_per_request} images in one request (max_images_per_request)"
            )
        return self.v

    def _add(self, data: bytes, param: str, detail: str = "auto") -> PreparedImage:
        plan = plan_image(data, param, self._vision(param), self.limits, detail)
        if self.pixels + plan.encoder_pixels > self.limits.max_pixels_per_request:
            raise ImageError(
                param,
                f"the request's images come to more than {self.limits.max_pixels_per_request} "
                f"encoder pixels (the per-request pixel budget)",
            )
        tokens = self.tokens + plan.tokens + 2  # its tokens between the image start and end markers
        if self.context is not None and tokens > self.context:
            raise APIError(
                f"{param}: the request's images take {tokens} tokens, more than the model's context of "
                f"{self.context} tokens",
                param=param,
                code="context_length_exceeded",
            )
        self.pixels += plan.encoder_pixels
        self.tokens = tokens
        img = PreparedImage(None, "", plan.tokens, plan.source)
        self.images.append(img)
        self.pending.append((img, data, plan, param))
        return img

    def from_url(self, url, param: str, detail: str = "auto") -> PreparedImage:
        """A data URL, or a remote URL fetched beforehand (fetch_remote)."""
        self._vision(param)
        if not isinstance(url, str) or not url:
            raise ImageError(param, "expected a URL string")
        if is_remote(url):
            check_allowed(url, param, self.limits)
            data = self.fetched[url]
        elif url[:5].lower() == "data:":
            data = data_url_bytes(url, param)
        else:
            raise ImageError(param, "expected a data: URL or an http(s) URL")
        return self._add(data, param, detail)

    def from_base64(self, media_type, data, param: str) -> PreparedImage:
        self._vision(param)
        if media_type not in FORMATS.values():
            raise ImageError(
                f"{param}.source.media_type", f"{media_type!r} is not one of {', '.join(FORMATS.values())}"
            )
        return self._add(decode_base64(data, f"{param}.source.data"), param)

    async def decode(self) -> None:
        """Decode every image added (concurrently, in the decoder pool): their pixels and digests filled in, or the
        first failure as an ImageError naming its part (429 when the decoder is busy)."""
        pending, self.pending = self.pending, []
        if not pending:
            return
        decoder = self.decoder or default_decoder()
        results = await asyncio.gather(
            *(decoder.decode(data, plan.source, plan.resized, plan.padded) for _, data, plan, _ in pending),
            return_exceptions=True,
        )
        for (img, _, plan, param), result in zip(pending, results):
            if isinstance(result, DecodeFailed):
                if result.busy:
                    raise APIError(f"{param}: {result}", param=param, code="image_decoder_busy", kind="rate_limit")
                raise ImageError(param, str(result))
            if isinstance(result, BaseException):
                raise result
            raw, digest = result
            pw, ph = plan.padded
            img.pixels = np.frombuffer(raw, dtype=np.uint8).reshape(ph, pw, 3).copy()
            img.digest = digest


_DEFAULT_DECODER: ImageDecoder | None = None


def default_decoder() -> ImageDecoder:
    """The process's decoder pool when the app was not given one."""
    global _DEFAULT_DECODER
    if _DEFAULT_DECODER is None:
        _DEFAULT_DECODER = ImageDecoder()
    return _DEFAULT_DECODER


async def request_images(
    v: VisionConfig | None,
    limits: ImageLimits,
    urls: dict[str, str],
    *,
    decoder: ImageDecoder | None = None,
    context: int | None = None,
) -> ImageBudget:
    """A request's ImageBudget, the remote image URLs it holds ({part: url}) fetched first."""
    return ImageBudget(v, limits, await fetch_remote(urls, limits), decoder, context)
