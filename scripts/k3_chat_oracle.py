#!/usr/bin/env python3
"""Expected K3 prompts from the reference template: writes tests/data/k3/chat_cases.json.

Each conversation below is rendered through `Kimi-K3.jinja` — the chat template llama.cpp ships for Kimi K3, read
from the llama-cpp-python 0.3.36 sdist (downloaded with `pip download --no-binary :all: --no-deps` into the cache
directory when it is not there; never committed) — by jinja2, then tokenized the way llama.cpp tokenizes a
rendered prompt: special-token strings become their ids (parse_special), the text between them goes through the
BPE with Kimi's pre-tokenizer regex, no BOS. The tokenizer is the tiny K3 directory tests/support/k3_fixtures.py writes,
loaded here with tiktoken directly (not with expertmesh's tokenizer, which is what the test checks). Checked once
against llama.cpp itself: the tiny tokenizer converted to a vocab-only GGUF (convert_hf_to_gguf.py, pre-tokenizer
kimi-k2) and every case's text through `llama-tokenize --no-bos --no-escape` gave these ids, all 19 cases.

jinja2 is set up as llama.cpp's Jinja engine behaves where the two differ for this template: `dictsort` compares
keys case-sensitively (llama.cpp common/jinja/value.cpp; K3's reference encoder sorts with `sort_keys` too), where
jinja2's default folds case. `tojson` is Python's json.dumps (llama.cpp's matches it for the values used here:
strings, integers, objects, arrays; it writes floats in C++'s form).

For every assistant message of a conversation without tool_choice / response_format, the data also holds the ids
that message adds to the prompt before it (`outputs`: what the model generates there, up to <|end_of_msg|>):
the template itself keeps that prefix property, and the test parses those ids back.

    python scripts/k3_chat_oracle.py [--sdist PATH] [--cache DIR] [--out tests/data/k3/chat_cases.json]
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from support.k3_fixtures import tokenizer_digest, write_k3_tokenizer  # noqa: E402

SDIST = "llama_cpp_python-0.3.36.tar.gz"
TEMPLATE = "vendor/llama.cpp/models/templates/Kimi-K3.jinja"
KIMI_PAT = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",  # noqa: E501
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",  # noqa: E501
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)


# ----------------------------------------------------------------------------------------------- conversations
def fn(name: str, properties: dict, required=(), description: str = "") -> dict:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": properties, "required": list(required)},
        },
    }


def call(id_: str, name: str, arguments) -> dict:
    return {
        "id": id_,
        "type": "function",
        "function": {
            "name": name,
            "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False),
        },
    }


WEATHER = fn(
    "get_weather",
    {
        "city": {"type": "string", "description": "City name"},
        "days": {"type": "integer"},
        "Units": {"type": "string", "enum": ["C", "F"]},
    },
    required=["city"],
    description="Weather forecast for a city.",
)
SEARCH = fn(
    "search",
    {
        "query": {"type": "string"},
        "filters": {"type": "object"},
        "limit": {"type": "number"},
        "exact": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "cursor": {"type": ["string", "null"]},
    },
    required=["query"],
)
QUOTED = fn("note", {'say "hi" & bye': {"type": "string"}, "Zeta": {"type": "number"}, "alpha": {"type": "string"}})
LONG = "Line {} of the log: everything is fine, nothing to report; the value is {}.\n"
LONG_RESULT = "".join(LONG.format(i, i * 37 % 1000) for i in range(80))  # ~5 KB

TOOL_HISTORY = [
    {"role": "system", "content": "You are a weather agent. Be brief."},
    {"role": "user", "content": "Weather in Paris and Oslo for 2 days?"},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "Two cities: call the tool twice in parallel.",
        "tool_calls": [
            call("call_p", "get_weather", {"city": "Paris", "days": 2}),
            call("call_o", "get_weather", {"city": "Oslo", "days": 2, "Units": "C"}),
        ],
    },
    # results out of order: the template puts them in the order of the calls
    {"role": "tool", "tool_call_id": "call_o", "content": "Oslo: 12 C, rain"},
    {"role": "tool", "tool_call_id": "call_p", "content": "Paris: 18 C, sun"},
    {
        "role": "assistant",
        "content": "Paris 18 C and sunny; Oslo 12 C with rain.",
        "reasoning_content": "Both results are in; summarize them.",
    },
    {"role": "user", "content": "And search the news about it."},
    {
        "role": "assistant",
        "content": "Searching.",
        "reasoning_content": "Use search with filters.",
        "tool_calls": [
            call(
                "call_s",
                "search",
                {
                    "query": "Paris weather news",
                    "filters": {"lang": "fr", "n": 3},
                    "limit": 2.5,
                    "exact": False,
                    "tags": ["météo", "news"],
                    "cursor": None,
                },
            )
        ],
    },
    {"role": "tool", "tool_call_id": "call_s", "content": LONG_RESULT},
    {"role": "assistant", "content": "Nothing unusual in the news.", "reasoning_content": "  The log is calm.\n"},
    {"role": "user", "content": "Thanks!"},
]

UNICODE = [
    {"role": "system", "content": "Réponds en français. 日本語も大丈夫。"},
    {
        "role": "user",
        "content": "天气怎么样？ Привет 🌍🚀 — naïve café, مرحبا\u200f, e\u0301 combining, tab\tand\r\nCRLF",
    },
    {
        "role": "assistant",
        "content": "晴れ ☀️",
        "reasoning_content": "L'utilisateur veut « la météo » 🌦",
        "tool_calls": [
            call("c1", "note", {'say "hi" & bye': '«quoted» & <tag> "dq"', "Zeta": 7, "alpha": "ü\nmulti\nline"})
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "ok ✓"},
    {"role": "user", "content": "Encore une fois: 東京?"},
]

ODD = [
    {"role": "user", "content": "Edge cases."},
    {"role": "assistant", "content": "", "reasoning_content": "   "},  # blank reasoning: an empty think
    {"role": "user", "content": "again"},
    {"role": "assistant", "content": "no reasoning at all"},
    {"role": "user", "content": "a call with text arguments"},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "raw text args",
        "tool_calls": [
            call("t1", "search", "not json at all"),
            call("t2", "search", "[1, 2]"),
            call("t3", "search", ""),
        ],
    },
    {"role": "tool", "tool_call_id": "t1", "content": "r1"},
    {"role": "tool", "tool_call_id": "t3", "content": "r3"},
    {"role": "tool", "tool_call_id": "t2", "content": "r2"},
    {"role": "user", "content": ""},
]

SCHEMA = {
    "type": "object",
    "properties": {
        "Zeta": {"type": "integer"},
        "answer": {"type": "string"},
        "Alpha": {"type": "array", "items": {"type": "number"}},
        "nested": {"type": "object", "properties": {"b": {"type": "boolean"}, "B": {"type": "null"}}},
    },
    "required": ["answer"],
    "additionalProperties": False,
}

IMAGE_USER = [
    {
        "role": "user",
        "content": [
            {"type": "text", "text": "What is in "},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}},
            {"type": "text", "text": " and in "},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AB=="}},
            {"type": "text", "text": "?"},
        ],
    }
]


def cases() -> list[dict]:
    out = []

    def add(name, messages, tools=None, images=None, **options):
        out.append(
            {
                "name": name,
                "messages": messages,
                "tools": tools,
                "images": images,
                "options": {
                    "thinking": True,
                    "thinking_effort": "max",
                    "tool_choice": None,
                    "response_format": None,
                    "add_generation_prompt": True,
                    **options,
                },
            }
        )

    hello = [{"role": "user", "content": "Hello, who are you?"}]
    add("hello, thinking max", hello)
    add("hello, thinking low", [{"role": "system", "content": "Be terse."}] + hello, thinking_effort="low")
    add("hello, thinking high", hello, thinking_effort="high")
    add("hello, thinking on without an effort message", hello, thinking_effort=None)
    add("hello, thinking off", hello, thinking=False)
    for effort in ("low", "high", "max"):
        add(f"tool history, thinking {effort}", TOOL_HISTORY, [WEATHER, SEARCH], thinking_effort=effort)
    add("tool history, thinking off", TOOL_HISTORY, [WEATHER, SEARCH], thinking=False)
    add("tool history, tool_choice required", TOOL_HISTORY[:2], [WEATHER, SEARCH], tool_choice="required")
    add("tool history, tool_choice none", TOOL_HISTORY, [WEATHER, SEARCH], tool_choice="none")
    add(
        "tool history, named tool_choice renders nothing",
        TOOL_HISTORY[:2],
        [WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    add(
        "response_format json_schema",
        hello,
        response_format={"type": "json_schema", "json_schema": {"name": "reply", "schema": SCHEMA, "strict": True}},
    )
    add("response_format json_object, thinking off", hello, thinking=False, response_format={"type": "json_object"})
    add("response_format text renders nothing", hello, response_format={"type": "text"})
    add("unicode, quotes and ampersands", UNICODE, [QUOTED], thinking_effort="high")
    add("text arguments, blank reasoning, empty messages", ODD, [SEARCH])
    add("tool history, no generation prompt", TOOL_HISTORY[:-1], [WEATHER, SEARCH], add_generation_prompt=False)
    add("images", IMAGE_USER, images=[{"tokens": 4, "size": [640, 480]}, {"tokens": 1, "size": [28, 56]}])
    return out


# ----------------------------------------------------------------------------------------------- template
def template_text(sdist: Path | None, cache: Path) -> str:
    if sdist is None:
        sdist = cache / SDIST
        if not sdist.exists():
            cache.mkdir(parents=True, exist_ok=True)
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pip",
                    "download",
                    "--no-binary",
                    ":all:",
                    "--no-deps",
                    "llama-cpp-python==0.3.36",
                    "-d",
                    str(cache),
                ],
                check=True,
            )
    with tarfile.open(sdist) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith("/" + TEMPLATE))
        return tar.extractfile(member).read().decode("utf-8")


def environment():
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def dictsort(value, case_sensitive=False, by="key", reverse=False):  # llama.cpp: always case-sensitive
        return sorted(value.items(), key=lambda kv: kv[0 if by == "key" else 1], reverse=reverse)

    env = ImmutableSandboxedEnvironment(extensions=[loopcontrols])
    env.filters.update(tojson=tojson, dictsort=dictsort)
    env.globals["raise_exception"] = raise_exception
    return env


def template_messages(messages: list[dict]) -> list[dict]:
    """As a serving layer hands them to the template (vLLM, transformers): tool-call arguments that are a JSON
    object become a dict; image parts become {type: image}."""
    out = copy.deepcopy(messages)
    for m in out:
        for c in m.get("tool_calls") or ():
            try:
                value = json.loads(c["function"]["arguments"])
            except ValueError:
                continue
            if isinstance(value, dict):
                c["function"]["arguments"] = value
        if isinstance(m.get("content"), list):
            m["content"] = [{"type": "image"} if p["type"] == "image_url" else p for p in m["content"]]
    return out


def image_prompt(image: dict) -> str:
    """What vLLM puts for K3's image placeholder: the media block of the uploaded size, one pad per token."""
    w, h = image["size"]
    return f"<|media_begin|>image {w}x{h}<|media_content|>" + "<|media_pad|>" * image["tokens"] + "<|media_end|>"


def render(template, case: dict, messages: list[dict] | None = None, add_generation_prompt: bool | None = None):
    o = case["options"]
    variables = {
        "messages": template_messages(case["messages"] if messages is None else messages),
        "add_generation_prompt": o["add_generation_prompt"] if add_generation_prompt is None else add_generation_prompt,
        "thinking": o["thinking"],
        "thinking_effort": o["thinking_effort"],
    }
    if case["tools"]:
        variables["tools"] = case["tools"]
    for key in ("tool_choice", "response_format"):
        if o[key] is not None:
            variables[key] = o[key]
    if case["images"]:
        variables["image_prompts"] = [image_prompt(i) for i in case["images"]]
    return template.render(**variables)


# ----------------------------------------------------------------------------------------------- tokenizer
def tiktoken_encoding(directory: Path):
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe

    ranks = load_tiktoken_bpe(str(directory / "tiktoken.model"))
    config = json.loads((directory / "tokenizer_config.json").read_text())
    named = {int(k): v["content"] for k, v in config["added_tokens_decoder"].items()}
    n = len(ranks)
    specials = {named.get(i, f"<|reserved_token_{i}|>"): i for i in range(n, n + config["num_reserved_special_tokens"])}
    return tiktoken.Encoding(name="k3-oracle", pat_str=KIMI_PAT, mergeable_ranks=ranks, special_tokens=specials)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sdist", type=Path, help=f"a local {SDIST} (else the cache, downloading it when absent)")
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "expertmesh" / "k3-oracle")
    ap.add_argument("--out", type=Path, default=ROOT / "tests" / "data" / "k3" / "chat_cases.json")
    args = ap.parse_args()
    source = template_text(args.sdist, args.cache)
    template = environment().from_string(source)
    with tempfile.TemporaryDirectory() as tmp:
        ids = write_k3_tokenizer(Path(tmp), config=False)
        enc, digest = tiktoken_encoding(Path(tmp)), tokenizer_digest(Path(tmp))
    encode = lambda text: enc.encode(text, allowed_special="all")  # noqa: E731 - llama.cpp's parse_special
    out = []
    for case in cases():
        text = render(template, case)
        entry = {**case, "text": text, "ids": encode(text), "outputs": []}
        o = case["options"]
        if o["tool_choice"] is None and o["response_format"] is None:
            for k, m in enumerate(case["messages"]):
                if m["role"] != "assistant":
                    continue
                prompt = encode(render(template, case, case["messages"][:k], add_generation_prompt=True))
                whole = encode(render(template, case, case["messages"][: k + 1], add_generation_prompt=False))
                if whole[: len(prompt)] != prompt:
                    raise SystemExit(
                        f"{case['name']}: the template's own prompt before messages[{k}] is not a "
                        f"prefix of its rendering with messages[{k}]"
                    )
                entry["outputs"].append({"message": k, "ids": whole[len(prompt) :]})
        out.append(entry)
        print(f"{case['name']}: {len(entry['ids'])} ids, {len(entry['outputs'])} outputs")
    data = {
        "source": f"llama-cpp-python 0.3.36 sdist, {TEMPLATE}",
        "template_sha256": hashlib.sha256(source.encode()).hexdigest(),
        "tokenizer_digest": digest,
        "special_tokens": ids,
        "cases": out,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(data, ensure_ascii=False, indent=1)
    # id lists on one line each (json.dumps puts each element on its own line; a string never holds a newline)
    text = re.sub(r"\[\n\s*(\d+(?:,\n\s*\d+)*)\n\s*\]", lambda m: "[" + re.sub(r"\s+", "", m[1]) + "]", text)
    args.out.write_text(text + "\n")
    print(f"wrote {args.out} ({len(out)} cases)")


if __name__ == "__main__":
    main()
