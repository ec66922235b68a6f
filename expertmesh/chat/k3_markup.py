"""Kimi K3's XTML markup (see chat/k3.py for the format): its special tokens and their ids in a TikToken tokenizer
(`K3Vocab`), attribute escaping, and lexing generated ids into items — text runs, tags and other markup — which both
parsers (chat/k3_parse.py at once, chat/k3_stream.py incrementally) read."""

from __future__ import annotations

import re
from dataclasses import dataclass

from expertmesh.chat.tokenizer_files import TokenizerError

OPEN, CLOSE, SEP, END_OF_MSG = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"
XTML_TOKENS = (OPEN, CLOSE, SEP, END_OF_MSG)
MEDIA_TOKENS = ("<|media_begin|>", "<|media_content|>", "<|media_pad|>", "<|media_end|>")
NOT_IN_ANSWER = ("[BOS]", "[PAD]", "[UNK]", "<|kimi_image_placeholder|>") + MEDIA_TOKENS
MAX_TAG_BYTES = 1024  # a tag whose text grows past this without ⟨sep⟩ is not a tag: its opener is plain markup


class K3Vocab:
    """The XTML markers' ids in a TikToken tokenizer and the ids that stop generation: what rendering, lexing, the
    stream parser and the grammars read (K3Chat is one)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.n_base = getattr(tokenizer, "n_base", None)
        if self.n_base is None:
            raise TokenizerError("Kimi K3's chat format needs a TikToken tokenizer (tiktoken.model)")
        missing = [t for t in XTML_TOKENS if t not in tokenizer.special_to_id]
        if missing:
            raise TokenizerError(
                f"{tokenizer.directory / 'tokenizer_config.json'}: Kimi K3's chat format needs "
                f"the special tokens {', '.join(XTML_TOKENS)}; missing {', '.join(missing)}"
            )
        self.id_of = dict(tokenizer.special_to_id)
        self.open_id, self.close_id, self.sep_id, self.eom_id = (self.id_of[t] for t in XTML_TOKENS)
        self.stop = tuple(dict.fromkeys([self.eom_id, *tokenizer.eos_ids]))


def escape_attr(value) -> str:
    return str(value).replace("&", "&amp;").replace('"', "&quot;")


def unescape_attr(value: str) -> str:
    return re.sub(r"&(amp|quot);", lambda m: "&" if m[1] == "amp" else '"', value)


# ----------------------------------------------------------------------------------------------- lexing
TEXT, TAG, RAW = "text", "tag", "raw"
_NAME = r"[A-Za-z_][A-Za-z0-9_.:-]*"
_OPEN_TAG = re.compile(rf'({_NAME})((?: {_NAME}="[^"]*")*)')
_ATTR = re.compile(rf' ({_NAME})="([^"]*)"')


@dataclass(frozen=True)
class Item:
    """A piece of the output: a text run (`text` decoded), a tag (`text` its markup), or other markup (`text` as
    written: a lone marker, an unfinished tag, another special token). `end`: the index after its last token."""

    kind: str
    text: str
    end: int
    opens: bool = False
    name: str = ""
    attrs: tuple = ()

    def attr(self, key: str) -> str | None:
        return dict(self.attrs).get(key)

    def is_tag(self, opens: bool, name: str) -> bool:
        return self.kind == TAG and self.opens == opens and self.name == name


def make_tag(marker: str, body: str, end: int) -> Item:
    raw = marker + body + SEP
    if marker == CLOSE:
        return Item(TAG, raw, end, False, body) if re.fullmatch(_NAME, body) else Item(RAW, raw, end)
    m = _OPEN_TAG.fullmatch(body)
    if m is None:
        return Item(RAW, raw, end)
    attrs = tuple((k, unescape_attr(v)) for k, v in _ATTR.findall(m[2]))
    return Item(TAG, raw, end, True, m[1], attrs)


def lex(vocab: K3Vocab, tokens: list[int]) -> list[Item]:
    """Generated ids (in the vocabulary, before any stop id) → items (the reference: the whole output at once)."""
    tok, n_base = vocab.tokenizer, vocab.n_base
    markers = {vocab.open_id: OPEN, vocab.close_id: CLOSE}

    def is_text(t: int) -> bool:
        return t < n_base

    items: list[Item] = []
    run = bytearray()
    i, n = 0, len(tokens)
    while i < n:
        t = tokens[i]
        if is_text(t):
            run += tok.token_bytes(t)
            i += 1
            continue
        if run:
            items.append(Item(TEXT, run.decode("utf-8", errors="replace"), i))
            run = bytearray()
        if t in markers:
            j, body, aborted = i + 1, bytearray(), False
            while j < n and is_text(tokens[j]):
                body += tok.token_bytes(tokens[j])
                j += 1
                if len(body) > MAX_TAG_BYTES:
                    aborted = True
                    break
            if aborted:
                items.append(Item(RAW, markers[t], i + 1))
                i += 1
            elif j < n and tokens[j] == vocab.sep_id:
                items.append(make_tag(markers[t], body.decode("utf-8", errors="replace"), j + 1))
                i = j + 1
            else:
                items.append(Item(RAW, markers[t] + body.decode("utf-8", errors="replace"), j))
                i = j
            continue
        items.append(Item(RAW, tok.id_to_special[t], i + 1))
        i += 1
    if run:
        items.append(Item(TEXT, run.decode("utf-8", errors="replace"), n))
    return items


def is_blank(item: Item) -> bool:
    return item.kind == TEXT and not item.text.strip()
