"""What the checkpoint tokenizers (chat/hf_tokenizer.py, chat/tiktoken_tokenizer.py) read from a checkpoint's
files alike: JSON files with errors that name them, tokenizer_config.json's named special tokens, the EOS ids from
the configs, and the check that text is valid Unicode."""

from __future__ import annotations

import json
from pathlib import Path


class TokenizerError(ValueError):
    """A checkpoint's tokenizer files cannot be used; the message names the file and what was expected."""


NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def read_json(path: Path, error=TokenizerError) -> dict:
    """A JSON object from `path`, or `error` naming the file."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise error(f"{path}: not a readable JSON file ({first_line(e)})") from None
    if not isinstance(data, dict):
        raise error(f"{path}: expected a JSON object, found {type(data).__name__}")
    return data


def first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def token_content(value) -> str | None:
    """A special-token entry of tokenizer_config.json: a string or an AddedToken dict {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def added_token(value):
    """A named special token as transformers adds it: a dict keeps its flags, a string is special, not normalized."""
    from tokenizers import AddedToken

    if isinstance(value, dict):
        flags = {k: value[k] for k in ("single_word", "lstrip", "rstrip", "normalized") if k in value}
        return AddedToken(value["content"], special=True, **flags)
    return AddedToken(value, special=True, normalized=False)


class NamedSpecials:
    """What a checkpoint's tokenizer derives from its `eos_ids` and tokenizer_config.json's named tokens."""

    eos_ids: tuple[int, ...]
    named_special: dict[str, str | None]

    @property
    def eos_id(self) -> int:
        """The first EOS id (callers that take one id; prefer `eos_ids`)."""
        return self.eos_ids[0]

    @property
    def template_tokens(self) -> dict[str, str]:
        """bos_token, eos_token, … as a chat template sees them (transformers' special_tokens_map)."""
        return {name: value for name, value in self.named_special.items() if value is not None}


def checkpoint_eos_ids(directory: Path, named_eos: int | None, vocab_size: int) -> tuple[int, ...]:
    """The ids that end generation: generation_config.json and config.json `eos_token_id` (an id or a list; a
    wrapper config's `text_config` when the top level has none), then the id of tokenizer_config.json's
    `eos_token` (`named_eos`)."""
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        path = directory / name
        config = read_json(path) if path.exists() else {}
        value = config.get("eos_token_id")
        if value is None and isinstance(config.get("text_config"), dict):
            value = config["text_config"].get("eos_token_id")
        for i in value if isinstance(value, list) else [value]:
            if isinstance(i, int) and not isinstance(i, bool) and i not in ids:
                ids.append(i)
    if named_eos is not None and named_eos not in ids:
        ids.append(named_eos)
    if not ids:
        raise TokenizerError(
            f"{directory}: no end-of-sequence token: expected eos_token_id in "
            f"generation_config.json or config.json, or eos_token in tokenizer_config.json"
        )
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise TokenizerError(
            f"{directory}: eos_token_id {bad[0]} is outside the tokenizer's vocabulary [0, {vocab_size})"
        )
    return tuple(ids)


def check_unicode(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"text is not valid Unicode: {e.reason} at character {e.start} ({text[e.start : e.end]!r})"
        ) from None
