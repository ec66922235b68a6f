"""Router hardening round 2 (#33, findings 4 and 9) on the Responses API of the shared deployment: stored
responses count their images' pixels against the byte bound (and the store counts shared segments once), client
item ids and metadata are bounded, `include` on input items is honoured or refused. Each test failed on the main it
was written against."""

from __future__ import annotations

import httpx
import pytest
from support.api_deployment import API_KEY
from support.router_hardening import data_url, post


def test_stored_responses_count_their_images_pixels_against_the_byte_bound(api_deployment):
    """#4: a segment accounted as 12 KB held 7.2 MB of pixels; with --stored-responses-mib 1, 21.7 MB of pixels
    stayed retrievable. Now the pixels count: a 1 MiB store keeps one response holding a 448×448 image (602 KB of
    pixels), never three."""
    import io

    import numpy as np
    from PIL import Image

    c = api_deployment.cluster
    ids = []
    for seed in range(3):
        buf = io.BytesIO()
        Image.fromarray(np.random.default_rng(seed).integers(0, 256, (448, 448, 3), dtype=np.uint8)).save(
            buf, format="PNG"
        )
        r = post(
            c,
            "/v1/responses",
            {
                "model": "tiny",
                "max_output_tokens": 2,
                "reasoning": {"effort": "none"},
                "input": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "input_text", "text": "What is it?"},
                            {"type": "input_image", "image_url": data_url(buf.getvalue())},
                        ],
                    }
                ],
            },
        )
        assert r.status_code == 200, r.text
        ids.append(r.json()["id"])

    kept = [
        i
        for i in ids
        if httpx.get(f"{c.http_url}/v1/responses/{i}", headers={"authorization": f"Bearer {API_KEY}"}).status_code
        == 200
    ]
    assert kept == ids[-1:], kept
    # the one kept is continued with its image
    r = post(
        c,
        "/v1/responses",
        {
            "model": "tiny",
            "max_output_tokens": 2,
            "previous_response_id": ids[-1],
            "input": "And now?",
            "reasoning": {"effort": "none"},
        },
    )
    assert r.status_code == 200 and r.json()["usage"]["input_tokens"] > 256, r.text


def test_the_store_counts_pixels_and_shared_segments_once():
    """#4 in the store itself: pixels count, and a chain's shared segments and images count once."""
    import numpy as np

    from expertmesh.chat.format import Message
    from expertmesh.router.prepared_image import PreparedImage
    from expertmesh.router.response_store import ResponseStore, Segment, StoredResponse

    img = PreparedImage(np.zeros((1400, 1792, 3), dtype=np.uint8), "d" * 64, 3200, (1792, 1400))  # 7.5 MB
    seg = Segment(Message("user", "look", parts=[img, "look"]), list(range(3300)))
    store = ResponseStore(max_bytes=2**20, replica="x")
    store.put(StoredResponse("resp_x_" + "0" * 24, {}, [], [seg]))
    assert len(store) == 0 and store.bytes == 0  # 7.5 MB of pixels do not fit in 1 MiB
    store = ResponseStore(max_bytes=64 * 2**20, replica="x")
    answers = [Segment(Message("assistant", f"answer {i}"), list(range(10))) for i in range(3)]
    for i in range(3):  # a chain: each keeps the segments before
        store.put(StoredResponse(f"resp_x_{i:024d}", {}, [], [seg] + answers[: i + 1]))
    assert img.pixels.nbytes <= store.bytes < img.pixels.nbytes + 64 * 1024
    for i in range(3):
        store.delete(f"resp_x_{i:024d}")
    assert store.bytes == 0 and not store._held


@pytest.mark.parametrize(
    "item,param",
    [
        ({"type": "message", "role": "user", "content": "hi", "id": 42}, "input[0].id"),
        ({"type": "message", "role": "user", "content": "hi", "id": {"nested": "object"}}, "input[0].id"),
        ({"type": "message", "role": "user", "content": "hi", "id": "x" * 129}, "input[0].id"),
        ({"type": "function_call_output", "call_id": "c" * 129, "output": "18 C"}, "input[0].call_id"),
        ({"type": "function_call", "call_id": ["a"], "name": "f", "arguments": "{}"}, "input[0].call_id"),
    ],
)
def test_client_item_ids_are_bounded_strings(api_deployment, item, param):
    """#9: client item ids of any JSON type (and any length) were stored and echoed."""
    c = api_deployment.cluster
    r = post(c, "/v1/responses", {"model": "tiny", "max_output_tokens": 1, "input": [item]})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_metadata_is_bounded_as_openai_bounds_it(api_deployment):
    """#9: 3 MB of metadata was accepted and stored; OpenAI allows 16 pairs of 64 / 512 characters."""
    c = api_deployment.cluster
    base = {"model": "tiny", "max_output_tokens": 1, "input": "hi", "reasoning": {"effort": "none"}}
    for metadata in (
        {f"k{i}": "v" for i in range(17)},
        {"k" * 65: "v"},
        {"k": "v" * 513},
        {"k": 1},
        {"k": "v" * 3_000_000},
    ):
        r = post(c, "/v1/responses", {**base, "metadata": metadata})
        assert r.status_code in (400, 413) and "metadata" in r.text[:400] or r.status_code == 413, r.text[:300]
    ok = {f"k{i}": "v" * 512 for i in range(16)}
    r = post(c, "/v1/responses", {**base, "metadata": ok})
    assert r.status_code == 200 and r.json()["metadata"] == ok


def test_include_on_input_items_is_honoured_or_refused(api_deployment):
    """#9: `include=foo` on input_items was silently accepted."""

    c = api_deployment.cluster
    rid = post(
        c, "/v1/responses", {"model": "tiny", "max_output_tokens": 1, "input": "hi", "reasoning": {"effort": "none"}}
    ).json()["id"]
    h = {"authorization": f"Bearer {API_KEY}"}
    r = httpx.get(f"{c.http_url}/v1/responses/{rid}/input_items", params={"include": "foo"}, headers=h)
    assert r.status_code == 400 and r.json()["error"]["param"] == "include[0]", r.text
    r = httpx.get(
        f"{c.http_url}/v1/responses/{rid}/input_items", params={"include": "reasoning.encrypted_content"}, headers=h
    )
    assert r.status_code == 200 and r.json()["data"][0]["content"][0]["text"] == "hi"
