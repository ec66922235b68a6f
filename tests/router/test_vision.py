"""Image input (#17): the encoder against transformers' kimi_k25 vision tower, and images through the OpenAI chat,
Anthropic messages and Responses APIs of one deployment, with the official clients."""

import base64
import io

import anthropic
import openai
import pytest
import torch
from PIL import Image
from support.api_deployment import API_KEY, MAX_IMAGE_BYTES, MAX_IMAGES_PER_REQUEST

from expertmesh.entry.cluster import free_port
from expertmesh.model.config import preset
from expertmesh.model.transformer import Transformer
from expertmesh.model.vision import encode_image

SIDE = 112  # 8×8 patches → 4×4 = 16 image tokens on the tiny encoder
IMAGE_TOKENS = (SIDE // 28) ** 2


def test_encoder_matches_transformers_kimi_k25():
    """Our tower + projector, loaded from transformers' Kimi_K25VisionModel / MultimodalProjection state dicts by
    name, give the same image rows (non-square grids that resample the position table, and one that does not)."""
    from transformers.models.kimi_k25.configuration_kimi_k25 import Kimi_K25Config, Kimi_K25VisionConfig
    from transformers.models.kimi_k25.modeling_kimi_k25 import Kimi_K25MultimodalProjection, Kimi_K25VisionModel

    cfg = preset("tiny")
    v = cfg.vision
    vc = Kimi_K25VisionConfig(
        patch_size=v.patch_size,
        pos_emb_height=v.pos_emb_height,
        pos_emb_width=v.pos_emb_width,
        num_attention_heads=v.num_attention_heads,
        num_hidden_layers=v.num_hidden_layers,
        hidden_size=v.hidden_size,
        intermediate_size=v.intermediate_size,
        merge_kernel_size=list(v.merge_kernel_size),
        rope_parameters={"rope_type": "axial", "rope_theta": v.rope_theta},
    )
    full = Kimi_K25Config(
        vision_config=vc.to_dict(),
        projection_hidden_size=v.hidden_size,
        text_config={"model_type": "deepseek_v3", "hidden_size": cfg.hidden_size},
    )
    gen = torch.Generator().manual_seed(3)
    tower, proj = Kimi_K25VisionModel(vc).eval(), Kimi_K25MultimodalProjection(full).eval()
    with torch.no_grad():
        for p in list(tower.parameters()) + list(proj.parameters()):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    ours = Transformer(cfg)
    theirs = {f"vision_tower.{k}": t for k, t in tower.state_dict().items()} | {
        f"mm_projector.{k}": t for k, t in proj.state_dict().items()
    }
    assert set(theirs) == {k for k in ours.state_dict() if k.startswith(("vision_tower.", "mm_projector."))}
    ours.load_state_dict(theirs, strict=False)
    p = v.patch_size
    for h, w in ((84, 140), (224, 224), (448, 56)):
        pixels = torch.randint(0, 256, (h, w, 3), dtype=torch.uint8, generator=gen)
        x = (pixels.float() / 255 - 0.5) / 0.5  # the kimi_k25 processor's rescale + normalize, patchified
        pv = x.permute(2, 0, 1).reshape(3, h // p, p, w // p, p).permute(1, 3, 0, 2, 4).reshape(-1, 3, p, p)
        with torch.no_grad():
            ref = proj(tower(pv, grid_thw=torch.tensor([[1, h // p, w // p]])).pooler_output).squeeze(1)
        got = encode_image(ours, pixels)
        assert got.shape == ref.shape == ((h // 28) * (w // 28), cfg.hidden_size)
        torch.testing.assert_close(got, ref, atol=2e-4, rtol=2e-4)


def png(seed: int, side: int = SIDE, fmt: str = "PNG") -> bytes:
    g = torch.Generator().manual_seed(seed)
    arr = torch.randint(0, 256, (side, side, 3), dtype=torch.uint8, generator=g).numpy()
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format=fmt)
    return buf.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def deployment(api_deployment):
    """The session's shared deployment (tests/support/api_deployment.py) and its file server, holding cat.png."""
    (api_deployment.files_dir / "cat.png").write_bytes(png(7))
    return api_deployment.http_url, api_deployment.files_port


@pytest.fixture
def oai(deployment):
    return openai.OpenAI(base_url=deployment[0] + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def chat(oai, parts, **kw):
    return oai.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": parts}],
        max_tokens=4,
        temperature=0,
        reasoning_effort="none",
        **kw,
    )


def image_part(url: str, detail: str = "auto") -> dict:
    return {"type": "image_url", "image_url": {"url": url, "detail": detail}}


TEXT = {"type": "text", "text": "What is in this picture? Answer in one word, please."}


def test_openai_image_grows_prompt_changes_output_and_is_cached(oai):
    plain = chat(oai, [TEXT])
    a = chat(oai, [image_part(data_url(png(1))), TEXT], logprobs=True)
    # the image adds its tokens plus its start and end markers
    assert a.usage.prompt_tokens == plain.usage.prompt_tokens + IMAGE_TOKENS + 2
    b = chat(oai, [image_part(data_url(png(2))), TEXT], logprobs=True)
    assert b.usage.prompt_tokens == a.usage.prompt_tokens
    # same text, different pixels: the model sees them (first-token log-probabilities differ)
    assert (
        a.choices[0].logprobs.content[0].top_logprobs != b.choices[0].logprobs.content[0].top_logprobs
        or a.choices[0].logprobs.content[0].logprob != b.choices[0].logprobs.content[0].logprob
    )
    # the same image again (JPEG of other bytes would differ; this is the same PNG): its prefix is cached, and the
    # cached run covers the image (it starts at position 3: ⟨bos⟩ ⟨user⟩ ⟨image⟩)
    again = chat(oai, [image_part(data_url(png(1))), TEXT], logprobs=True)
    assert again.usage.prompt_tokens_details.cached_tokens >= 3 + IMAGE_TOKENS
    assert again.choices[0].message.content == a.choices[0].message.content
    assert again.choices[0].logprobs.content[0].logprob == pytest.approx(
        a.choices[0].logprobs.content[0].logprob, abs=1e-4
    )
    # a third image with the same text shares no cached prefix with them (keys hash the pixels)
    other = chat(oai, [image_part(data_url(png(3))), TEXT])
    assert other.usage.prompt_tokens_details.cached_tokens == 0
    # detail "low" is honoured (a large image is scaled to at most 256 patches = 64 tokens)
    buf = io.BytesIO()
    Image.linear_gradient("L").resize((448, 448)).convert("RGB").save(buf, format="PNG")  # compresses small
    low = chat(oai, [image_part(data_url(buf.getvalue()), "low"), TEXT])
    high = chat(oai, [image_part(data_url(buf.getvalue()), "high"), TEXT])
    assert low.usage.prompt_tokens == plain.usage.prompt_tokens + 64 + 2
    assert high.usage.prompt_tokens == plain.usage.prompt_tokens + 256 + 2


def test_bad_images_get_400_naming_the_part(oai):
    too_large = png(5, side=640)  # random pixels: the PNG is about as large as they are
    assert len(too_large) > MAX_IMAGE_BYTES
    cases = [
        (data_url(b"\x89PNG\r\n\x1a\n this is not a png"), "not a decodable image"),
        (data_url(too_large), "exceed the limit"),  # > --max-image-bytes
        ("data:image/png;base64,%%%", "not valid base64"),
        (data_url(b"GIF87a", "image/tiff"), "media type"),
    ]
    for url, why in cases:
        with pytest.raises(openai.BadRequestError) as e:
            oai.chat.completions.create(
                model="tiny",
                max_tokens=4,
                messages=[
                    {"role": "system", "content": "be brief"},
                    {"role": "user", "content": [TEXT, image_part(url)]},
                ],
            )
        assert "messages[1].content[1]" in e.value.message and why in e.value.message, e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        chat(oai, [image_part(data_url(png(1)), "ultra"), TEXT])
    assert "detail" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:  # one image over --max-images-per-request
        chat(oai, [image_part(data_url(png(i))) for i in range(MAX_IMAGES_PER_REQUEST + 1)] + [TEXT])
    assert f"messages[0].content[{MAX_IMAGES_PER_REQUEST}]" in e.value.message
    assert "max_images_per_request" in e.value.message
    assert chat(oai, [image_part(data_url(png(1))), TEXT]).choices[0].finish_reason  # the server still serves


def test_remote_urls_only_from_the_allow_list(oai, deployment):
    _, port = deployment
    ok = chat(oai, [TEXT, image_part(f"http://127.0.0.1:{port}/cat.png")])
    plain = chat(oai, [TEXT])
    assert ok.usage.prompt_tokens == plain.usage.prompt_tokens + IMAGE_TOKENS + 2
    for url in (f"http://localhost:{port}/cat.png", f"http://127.0.0.1:{free_port()}/cat.png"):
        with pytest.raises(openai.BadRequestError) as e:
            chat(oai, [TEXT, image_part(url)])
        assert "messages[0].content[1]" in e.value.message and "allow-list" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:  # allowed host, missing file
        chat(oai, [TEXT, image_part(f"http://127.0.0.1:{port}/missing.png")])
    assert "HTTP 404" in e.value.message


def test_anthropic_and_responses_images(deployment, oai):
    url, _ = deployment
    client = anthropic.Anthropic(base_url=url, api_key=API_KEY, max_retries=0, timeout=60)

    def ask(*blocks):
        return client.messages.create(
            model="tiny",
            max_tokens=4,
            messages=[{"role": "user", "content": [{"type": "text", "text": TEXT["text"]}, *blocks]}],
        )

    plain = ask()
    for fmt, mime in (("JPEG", "image/jpeg"), ("WEBP", "image/webp"), ("GIF", "image/gif")):
        block = {
            "type": "image",
            "source": {"type": "base64", "media_type": mime, "data": base64.b64encode(png(6, fmt=fmt)).decode()},
        }
        r = ask(block)
        grown = r.usage.input_tokens + (r.usage.cache_read_input_tokens or 0)
        assert grown == plain.usage.input_tokens + (plain.usage.cache_read_input_tokens or 0) + IMAGE_TOKENS + 2
    with pytest.raises(anthropic.BadRequestError) as e:
        ask({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "bm90IGFuIGltYWdl"}})
    assert "messages.0.content.1" in str(e.value)
    plain = oai.responses.create(
        model="tiny",
        max_output_tokens=4,
        input=[{"role": "user", "content": [{"type": "input_text", "text": TEXT["text"]}]}],
    )
    r = oai.responses.create(
        model="tiny",
        max_output_tokens=4,
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": TEXT["text"]},
                    {"type": "input_image", "image_url": data_url(png(1)), "detail": "auto"},
                ],
            }
        ],
    )
    assert r.usage.input_tokens == plain.usage.input_tokens + IMAGE_TOKENS + 2
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(
            model="tiny",
            max_output_tokens=4,
            input=[{"role": "user", "content": [{"type": "input_image", "image_url": data_url(b"junk")}]}],
        )
    assert "input[0].content[0]" in e.value.message
