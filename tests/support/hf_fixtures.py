"""Small Hugging Face tokenizer directories for the tokenizer / chat-template tests: a byte-level BPE trained here
on a few sentences, special tokens as chat models have them, and realistic chat templates."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

SENTENCES = [
    "The weather in Paris is sunny today.",
    "Tomorrow it will rain in Oslo, café au lait.",
    "def get_weather(city): return 18",
    "Ça va très bien ✓ 日本語のテキスト",
    "Thinking step by step: 2+2=4.",
    '{"city": "Paris", "unit": "C"}',
    "You are a helpful assistant. Use tools when needed.",
]
SPECIAL = ["<s>", "</s>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
KIMI_TOOL_TOKENS = [
    "<|tool_calls_section_begin|>",
    "<|tool_calls_section_end|>",
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
]

# ChatML with reasoning in every assistant turn (prefix-stable), Hermes tool calls, enable_thinking.
CHATML = r"""
{%- if messages[0].role == 'system' or tools %}
{{- '<|im_start|>system\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content }}{%- endif %}
{%- if tools %}
{{- '\n\n# Tools\n<tools>' }}
{%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}
{{- '\n</tools>\nCall a tool as <tool_call>{"name": ..., "arguments": ...}</tool_call>' }}
{%- endif %}
{{- '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}
{%- if not loop.first %}{{- raise_exception('a system message is only allowed first') }}{%- endif %}
{%- elif message.role == 'user' %}
{{- '<|im_start|>user\n' + message.content + '<|im_end|>\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant\n<think>\n' + (message.reasoning_content or '') + '\n</think>\n\n' }}
{%- if message.content %}{{- message.content }}{%- endif %}
{%- for call in message.tool_calls or [] %}
{{- '<tool_call>\n{"name": "' + call.function.name + '", "arguments": ' + (call.function.arguments | tojson) + '}\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\n' }}
{%- elif message.role == 'tool' %}
{{- '<|im_start|>tool\n<tool_response>\n' + message.content + '\n</tool_response><|im_end|>\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}
{%- else %}{{- '<think>\n' }}{%- endif %}
{%- endif %}
"""

# As Qwen3 does: reasoning only for the assistant turns after the last user message (breaks prefix stability).
CHATML_DROPS_OLD_REASONING = CHATML.replace(
    "{%- for message in messages %}",
    "{%- set ns = namespace(last_user=-1) %}{%- for m in messages %}{%- if m.role == 'user' %}"
    "{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}\n{%- for message in messages %}",
    1,
).replace(
    "(message.reasoning_content or '')", "((message.reasoning_content or '') if loop.index0 > ns.last_user else '')"
)

# No think tokens at all: a model without thinking.
CHATML_NO_THINKING = r"""
{%- for message in messages %}
{{- '<|im_start|>' + message.role + '\n' + (message.content or '') + '<|im_end|>\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""

# Kimi K2's tool-call layout (ids as functions.NAME:INDEX).
KIMI = r"""
{%- for message in messages %}
{%- if message.role == 'assistant' %}
{{- '<|im_start|>assistant\n<think>' + (message.reasoning_content or '') + '</think>' + (message.content or '') }}
{%- if message.tool_calls %}
{{- '<|tool_calls_section_begin|>' }}
{%- for call in message.tool_calls %}
{{- '<|tool_call_begin|>' + call.id + '<|tool_call_argument_begin|>' + (call.function.arguments | tojson) + '<|tool_call_end|>' }}
{%- endfor %}
{{- '<|tool_calls_section_end|>' }}
{%- endif %}
{{- '<|im_end|>' }}
{%- else %}
{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n<think>' }}{%- endif %}
"""

# DeepSeek V3.1's layout: arguments concatenated as text, the `thinking` variable, fullwidth-bar tokens.
DEEPSEEK_TOKENS = [
    "<｜User｜>",
    "<｜Assistant｜>",
    "<｜end▁of▁sentence｜>",
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁sep｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁calls▁end｜>",
    "<｜tool▁output▁begin｜>",
    "<｜tool▁output▁end｜>",
]
DEEPSEEK = r"""
{{- bos_token }}
{%- for message in messages %}
{%- if message.role == 'system' %}{{- message.content }}
{%- elif message.role == 'user' %}{{- '<｜User｜>' + message.content }}
{%- elif message.role == 'assistant' %}
{{- '<｜Assistant｜>' }}
{%- if message.reasoning_content %}{{- '<think>' + message.reasoning_content + '</think>' }}
{%- else %}{{- '</think>' }}{%- endif %}
{{- message.content or '' }}
{%- if message.tool_calls %}
{{- '<｜tool▁calls▁begin｜>' }}
{%- for tool in message.tool_calls %}
{{- '<｜tool▁call▁begin｜>' + tool.function.name + '<｜tool▁sep｜>' + tool.function.arguments + '<｜tool▁call▁end｜>' }}
{%- endfor %}
{{- '<｜tool▁calls▁end｜>' }}
{%- endif %}
{{- '<｜end▁of▁sentence｜>' }}
{%- elif message.role == 'tool' %}{{- '<｜tool▁output▁begin｜>' + message.content + '<｜tool▁output▁end｜>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<｜Assistant｜>' + ('<think>' if thinking else '</think>') }}{%- endif %}
"""


def build_tokenizer(*, post_processor_bos: bool = True, extra_special: list[str] = ()) -> Tokenizer:
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=420,
        special_tokens=SPECIAL + list(extra_special),
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tk.train_from_iterator(SENTENCES * 3, trainer)
    # Qwen keeps its tool-call tags as added tokens that are not special
    tk.add_tokens(
        [
            AddedToken("<tool_call>", special=False, normalized=False),
            AddedToken("</tool_call>", special=False, normalized=False),
        ]
    )
    if post_processor_bos:
        tk.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tk.token_to_id("<s>"))]
        )
    return tk


def build_large_bpe(vocab_size: int = 32_000, seed: int = 0) -> Tokenizer:
    """A byte-level BPE of `vocab_size` ids as user checkpoints ship them (Llama-3 / Qwen style: GPT-2's byte
    alphabet, tens of thousands of merges, the chat tokens as added tokens), trained here on the test sentences and
    pseudo-words drawn from a seeded generator (so English, JSON and tool-call text split into multi-byte tokens,
    and some tokens end inside a UTF-8 character)."""
    import random

    rng = random.Random(seed)
    letters = "etaoinshrdlucmfwypvbgkjqxz"
    words = [
        "".join(rng.choice(letters[: rng.randint(8, 26)]) for _ in range(rng.randint(2, 9))) for _ in range(60_000)
    ]
    corpus = (
        SENTENCES * 50
        + [" ".join(words[i : i + 12]) for i in range(0, len(words), 12)]
        + ["日本語のテキスト ✓ café"] * 20
    )
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tk.train_from_iterator(corpus, trainer)
    tk.add_tokens(
        [
            AddedToken("<tool_call>", special=False, normalized=False),
            AddedToken("</tool_call>", special=False, normalized=False),
        ]
    )
    return tk


def write_checkpoint(
    directory: Path,
    *,
    template: str | list | None = CHATML,
    config: dict | None = None,
    post_processor_bos: bool = True,
    extra_special: list[str] = (),
    generation_eos: list[str] | None = None,
    jinja_file: str | None = None,
    tokenizer: Tokenizer | None = None,
) -> Path:
    """tokenizer.json + tokenizer_config.json (+ generation_config.json, chat_template.jinja) in `directory`;
    `tokenizer`: another tokenizer than build_tokenizer's (build_large_bpe)."""
    directory.mkdir(parents=True, exist_ok=True)
    tk = tokenizer or build_tokenizer(post_processor_bos=post_processor_bos, extra_special=extra_special)
    tk.save(str(directory / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "TokenizersBackend",
        "bos_token": "<s>",
        "eos_token": "<|im_end|>",
        "pad_token": "</s>",
        **(config or {}),
    }
    if template is not None:
        cfg["chat_template"] = template
    (directory / "tokenizer_config.json").write_text(json.dumps(cfg))
    if generation_eos is not None:
        (directory / "generation_config.json").write_text(
            json.dumps({"eos_token_id": [tk.token_to_id(t) for t in generation_eos]})
        )
    if jinja_file is not None:
        (directory / "chat_template.jinja").write_text(jinja_file)
    return directory


def auto_tokenizer(directory: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory))
