"""K3 sees images (#50): a tiny Kimi K3 checkpoint with a vision tower (tests/support/k3_checkpoint.py, vision=True)
and its K3+DSA twin, served in process over HTTP with the official clients. Images go through chat completions,
Anthropic messages and Responses, placed by K3's own template (`<|media_begin|>image WxH<|media_content|>`,
`<|media_pad|>` per image token, `<|media_end|>`); a whole request's greedy tokens and log-probs equal a reference
forward — the model's own Transformer with the float64 reference features (tests/support/k3_vision_reference.py)
spliced at the image rows; a text-only K3 checkpoint refuses images with a 400 naming the content part."""

import base64
import io
import json

import anthropic
import httpx
import openai
import pytest
import torch
from PIL import Image
from support.api_deployment import file_server
from support.k3_checkpoint import write_k3_checkpoint
from support.k3_vision_reference import reference_features

from expertmesh.chat.load import load_chat
from expertmesh.checkpoint.loader import Checkpoint
from expertmesh.entry.cluster import free_port
from expertmesh.entry.local import build_local_engine
from expertmesh.model.cache import Segment
from expertmesh.router.http import build_app, serve_http
from expertmesh.router.prepared_image import ImageLimits

SIDE = 112  # 8×8 patches → 4×4 = 16 image tokens
IMAGE_TOKENS = (SIDE // 28) ** 2
QUESTION = "What is in this picture?"
MAX_TOKENS = 6


def pixels(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (SIDE, SIDE, 3), dtype=torch.uint8, generator=g)


def png(seed: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(pixels(seed).numpy()).save(buf, format="PNG")
    return buf.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def serve(path, tmp, fetch_allow=()):
    ckpt = Checkpoint(path)
    chat = load_chat(path, model_vocab_size=ckpt.cfg.vocab_size)
    engine = build_local_engine(ckpt, serving_cfg=ckpt.cfg, image_limits=ImageLimits(fetch_allow=fetch_allow))
    port = free_port()
    srv, thread = serve_http(build_app(engine, chat=chat), "127.0.0.1", port)
    return ckpt, chat, engine, srv, thread, f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module", params=["k3", "k3+dsa"])
def k3v(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("k3img")
    path = write_k3_checkpoint(root / "ckpt", vision=True, with_indexer=request.param == "k3+dsa")
    www = root / "www"
    www.mkdir()
    (www / "cat.png").write_bytes(png(7))
    files = file_server(www)
    files_port = files.server_address[1]
    ckpt, chat, engine, srv, thread, url = serve(path, root, fetch_allow=(f"127.0.0.1:{files_port}",))
    yield {
        "path": path,
        "ckpt": ckpt,
        "chat": chat,
        "url": url,
        "files_port": files_port,
        "oai": openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120),
    }
    srv.should_exit = True
    thread.join(timeout=10)
    engine.close()
    files.shutdown()


def ask(oai, image_url: str | None, **kw):
    content = [{"type": "text", "text": QUESTION}]
    if image_url is not None:
        content.append({"type": "image_url", "image_url": {"url": image_url}})
    return oai.chat.completions.create(
        model=oai.models.list().data[0].id,
        messages=[{"role": "user", "content": content}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        reasoning_effort="none",
        logprobs=True,
        **kw,
    )


def tokenize(url: str, image_url: str | None) -> list[int]:
    content = [{"type": "text", "text": QUESTION}]
    if image_url is not None:
        content.append({"type": "image_url", "image_url": {"url": image_url}})
    r = httpx.post(
        url + "/tokenize",
        json={"messages": [{"role": "user", "content": content}], "reasoning_effort": "none"},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


@torch.no_grad()
def reference_answer(k3v, prompt: list[int], image: torch.Tensor) -> tuple[list[int], list[float]]:
    """Greedy tokens and their log-probs from the checkpoint's own Transformer, the float64 reference features
    spliced at the `<|media_pad|>` rows of the prompt."""
    model = Checkpoint(k3v["path"]).load_model()
    v = model.cfg.vision
    rows = [i for i, t in enumerate(prompt) if t == v.image_token_id]
    assert len(rows) == IMAGE_TOKENS and rows == list(range(rows[0], rows[0] + IMAGE_TOKENS))
    features = reference_features(k3v["path"], image).float()
    cache = model.new_cache()
    x = model.embed(torch.tensor(prompt))
    x[rows[0] : rows[0] + IMAGE_TOKENS] = features
    h = model.hidden_states(x, [Segment(0, len(prompt), cache)])
    cache.length += len(prompt)
    logits = model.logits(h[-1:])
    tokens, logprobs = [], []
    for _ in range(MAX_TOKENS):
        lp = torch.log_softmax(logits[-1].double(), -1)
        t = int(lp.argmax())
        tokens.append(t)
        logprobs.append(float(lp[t]))
        logits = model.step([t], cache)
    return tokens, logprobs


# ----------------------------------------------------------------------------------------------- the proofs
def test_tokenize_places_the_image_as_k3s_template(k3v):
    """The image message's tokens are the text-only message's with K3's media block where the part is."""
    tok = k3v["chat"].tokenizer
    v = k3v["ckpt"].cfg.vision
    plain = tokenize(k3v["url"], None)
    with_image = tokenize(k3v["url"], data_url(png(1)))
    added = json.loads((k3v["path"] / "tokenizer_config.json").read_text())["added_tokens_decoder"]
    ids = {t["content"]: int(i) for i, t in added.items()}  # the ids the checkpoint's tokenizer files give
    assert (ids["<|media_pad|>"], ids["<|media_content|>"], ids["<|media_end|>"]) == (
        v.image_token_id,
        v.image_start_token_id,
        v.image_end_token_id,
    )
    block = (
        [ids["<|media_begin|>"]]
        + tok.encode_plain(f"image {SIDE}x{SIDE}")
        + [ids["<|media_content|>"]]
        + [ids["<|media_pad|>"]] * IMAGE_TOKENS
        + [ids["<|media_end|>"]]
    )
    start = with_image.index(ids["<|media_begin|>"])
    assert with_image[start : start + len(block)] == block
    assert with_image[:start] + with_image[start + len(block) :] == plain
    r = ask(k3v["oai"], data_url(png(1)))
    assert r.usage.prompt_tokens == len(with_image)


def test_greedy_tokens_and_logprobs_equal_the_reference_forward(k3v):
    url = data_url(png(1))
    prompt = tokenize(k3v["url"], url)
    ref_tokens, ref_logprobs = reference_answer(k3v, prompt, pixels(1))
    r = ask(k3v["oai"], url)
    served = [c.logprob for c in r.choices[0].logprobs.content]
    text = k3v["chat"].tokenizer.decode(ref_tokens)
    assert len(served) == len(ref_logprobs), (served, ref_logprobs, text)
    worst = max(abs(a - b) for a, b in zip(served, ref_logprobs))
    print(f"max |served - reference| log-prob over {len(served)} greedy tokens = {worst:.2e}")
    assert worst < 2e-3
    tokens_of = [c.token for c in r.choices[0].logprobs.content]
    assert tokens_of == [k3v["chat"].tokenizer.decode([t], skip_special=False) for t in ref_tokens]
    other = ask(k3v["oai"], data_url(png(2)))  # the same text, other pixels: another greedy answer
    assert [c.token for c in other.choices[0].logprobs.content] != tokens_of


def test_url_and_base64_agree_and_the_image_is_cached(k3v):
    by_url = ask(k3v["oai"], f"http://127.0.0.1:{k3v['files_port']}/cat.png")
    by_b64 = ask(k3v["oai"], data_url(png(7)))
    assert by_url.choices[0].message.content == by_b64.choices[0].message.content
    assert [c.logprob for c in by_url.choices[0].logprobs.content] == [
        c.logprob for c in by_b64.choices[0].logprobs.content
    ]
    assert by_b64.usage.prompt_tokens_details.cached_tokens >= IMAGE_TOKENS  # its prefix was saved by the first
    assert by_b64.usage.prompt_tokens == tokenize(k3v["url"], None).__len__() + IMAGE_TOKENS + 3 + len(
        k3v["chat"].tokenizer.encode_plain(f"image {SIDE}x{SIDE}")
    )


def test_anthropic_and_responses_serve_images(k3v):
    oai = k3v["oai"]
    model = oai.models.list().data[0].id
    first = ask(oai, data_url(png(3)))
    client = anthropic.Anthropic(base_url=k3v["url"], api_key="x", max_retries=0, timeout=120)
    block = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": base64.b64encode(png(3)).decode()},
    }
    msg = client.messages.create(
        model=model,
        max_tokens=MAX_TOKENS,
        extra_body={"temperature": 0},
        messages=[{"role": "user", "content": [{"type": "text", "text": QUESTION}, block]}],
    )
    assert msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0) == first.usage.prompt_tokens
    assert "".join(b.text for b in msg.content if b.type == "text") == first.choices[0].message.content
    resp = oai.responses.create(
        model=model,
        max_output_tokens=MAX_TOKENS,
        temperature=0,
        reasoning={"effort": "none"},
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": QUESTION},
                    {"type": "input_image", "image_url": data_url(png(3)), "detail": "auto"},
                ],
            }
        ],
    )
    assert resp.usage.input_tokens == first.usage.prompt_tokens
    assert resp.output_text == first.choices[0].message.content


def test_text_only_k3_refuses_images_naming_the_part(tmp_path):
    path = write_k3_checkpoint(tmp_path / "ckpt")
    _, _, engine, srv, thread, url = serve(path, tmp_path)
    try:
        oai = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
        with pytest.raises(openai.BadRequestError) as e:
            ask(oai, data_url(png(1)))
        assert "messages[0].content[1]" in e.value.message and "text only" in e.value.message, e.value.message
        assert ask(oai, None).choices[0].finish_reason  # still serving
    finally:
        srv.should_exit = True
        thread.join(timeout=10)
        engine.close()
