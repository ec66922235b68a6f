"""A checkpoint's `tiktoken.model` (Kimi K2 / K3's TikToken vocabulary), set up as Kimi's tokenization_kimi.py
sets it up, and its streaming decoder."""

from __future__ import annotations

import base64
import binascii
import codecs
import re
from functools import lru_cache
from pathlib import Path

from expertmesh.chat.tokenizer_files import (
    NAMED_SPECIAL_TOKENS,
    NamedSpecials,
    TokenizerError,
    check_unicode,
    checkpoint_eos_ids,
    first_line,
    read_json,
    token_content,
)

# Kimi K2's pre-tokenizer (`pat_str` of its tokenization_kimi.py; llama.cpp's `kimi-k2` pre-tokenizer): Han runs,
# cased words with English contractions, numbers in threes, punctuation runs, newlines, spaces.
KIMI_PATTERN = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"""
        r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"""
        r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)
KIMI_RESERVED_SPECIAL_TOKENS = 256  # tokenization_kimi.py: the ids after the BPE ranks, named or reserved
TIKTOKEN_MAX_ENCODE_CHARS = 400_000  # tokenization_kimi.py encodes in windows of this many characters ...
MAX_RUN_CHARS = 25_000  # ... each split where whitespace / non-whitespace runs grow longer


def read_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    """`tiktoken.model`: one `base64(token bytes) rank` per line, ranks 0 .. N-1 (the BPE merges are implicit in
    them). TokenizerError names the file and line that is wrong."""
    try:
        lines = path.read_bytes().splitlines()
    except OSError as e:
        raise TokenizerError(f"{path}: cannot be read ({first_line(e)})") from None
    ranks: dict[bytes, int] = {}
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        fields = line.split()
        try:
            if len(fields) != 2:
                raise ValueError("expected 'base64 rank'")
            token, rank = base64.b64decode(fields[0], validate=True), int(fields[1])
        except (ValueError, binascii.Error) as e:
            raise TokenizerError(f"{path}:{n}: not a tiktoken rank line ({first_line(e)})") from None
        if token in ranks:
            raise TokenizerError(f"{path}:{n}: token {token!r} appears twice (ranks {ranks[token]} and {rank})")
        ranks[token] = rank
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise TokenizerError(f"{path}: ranks must be 0 .. {len(ranks) - 1}, each once")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise TokenizerError(f"{path}: byte 0x{missing[0]:02x} has no token (a byte-level BPE needs all 256)")
    return ranks


@lru_cache(maxsize=4)
def _long_runs(limit: int) -> re.Pattern:
    return re.compile(rf"\s{{{limit + 1},}}|\S{{{limit + 1},}}")


def split_long_runs(text: str, limit: int = MAX_RUN_CHARS):
    """`text` cut so that no piece holds more than `limit` consecutive whitespace or non-whitespace characters,
    where tokenization_kimi.py cuts it (its `_split_whitespaces_or_nonwhitespaces`: a run is cut every `limit`
    characters from its start; tiktoken is quadratic on one long piece)."""
    start = 0
    for m in _long_runs(limit).finditer(text):
        for cut in range(m.start() + limit, m.end(), limit):
            yield text[start:cut]
            start = cut
    yield text[start:]


class TikTokenTokenizer(NamedSpecials):
    """A checkpoint's `tiktoken.model` with `tokenizer_config.json`, set up as Kimi's `tokenization_kimi.py`
    (TikTokenTokenizer, what vLLM and transformers load with trust_remote_code) sets it up:

    - the BPE ranks of tiktoken.model are ids 0 .. N-1; the `KIMI_RESERVED_SPECIAL_TOKENS` ids after them (or
      tokenizer_config.json `num_reserved_special_tokens`) are special tokens: those named in `added_tokens_decoder`
      by their content, the rest `<|reserved_token_{id}|>`;
    - Kimi K2's pre-tokenizer regex (`KIMI_PATTERN`), text encoded in 400,000-character windows and runs longer
      than 25,000 characters cut, as tokenization_kimi.py does (llama.cpp does not cut: beyond those lengths the
      two differ, and this follows the checkpoint's own tokenizer);
    - no BOS or EOS is added (`encode_prompt` == `encode`): K3's prompts start with its first message.

    Special-token strings in text: `encode` recognizes them (tokenization_kimi.py's `encode` does, and so does a
    raw /v1/completions prompt here, as with a tokenizer.json); `encode_plain` never does, and is what the chat
    format uses for every piece of user, tool and assistant text. That follows K3's own renderer as vLLM runs it
    (`apply_chat_template(tokenize=True)`: structural markers are special ids, message text is ordinary text),
    not llama.cpp, which renders the Jinja template to one string and tokenizes it with special-token parsing, so
    a user who types `<|open|>` there injects the control token.

    EOS ids: as CheckpointTokenizer (config.json `eos_token_id` — for K3 `<|end_of_msg|>` — then the
    `eos_token` of tokenizer_config.json, `[EOS]`).
    """

    def __init__(self, directory: str | Path):
        import tiktoken

        self.directory = Path(directory)
        ranks = read_tiktoken_ranks(self.directory / "tiktoken.model")
        config_path = self.directory / "tokenizer_config.json"
        self.config = read_json(config_path) if config_path.exists() else {}
        self.n_base = len(ranks)
        named = self._added_tokens(config_path)
        n_reserved = self.config.get("num_reserved_special_tokens", KIMI_RESERVED_SPECIAL_TOKENS)
        if not isinstance(n_reserved, int) or isinstance(n_reserved, bool) or n_reserved < 0:
            raise TokenizerError(
                f"{config_path}: num_reserved_special_tokens: expected a non-negative integer, found {n_reserved!r}"
            )
        self.vocab_size = max([self.n_base + n_reserved] + [i + 1 for i in named])
        self.id_to_special = {i: named.get(i, f"<|reserved_token_{i}|>") for i in range(self.n_base, self.vocab_size)}
        self.special_to_id = {t: i for i, t in self.id_to_special.items()}
        if len(self.special_to_id) != len(self.id_to_special):
            seen: dict[str, int] = {}
            for i, t in self.id_to_special.items():
                if t in seen:
                    raise TokenizerError(f"{config_path}: added_tokens_decoder: {t!r} is both id {seen[t]} and {i}")
                seen[t] = i
        self.named_special = {name: token_content(self.config.get(name)) for name in NAMED_SPECIAL_TOKENS}
        self._bytes = [b""] * self.n_base
        for token, rank in ranks.items():
            self._bytes[rank] = token
        self.encoding = tiktoken.Encoding(
            name=f"expertmesh:{self.directory.name}",
            pat_str=KIMI_PATTERN,
            mergeable_ranks=ranks,
            special_tokens=self.special_to_id,
        )
        eos = self.named_special.get("eos_token")
        self.eos_ids = checkpoint_eos_ids(self.directory, self.special_to_id.get(eos) if eos else None, self.vocab_size)

    def _added_tokens(self, config_path: Path) -> dict[int, str]:
        raw = self.config.get("added_tokens_decoder") or {}
        if not isinstance(raw, dict):
            raise TokenizerError(f"{config_path}: added_tokens_decoder: expected an object of id → token")
        named: dict[int, str] = {}
        for key, value in raw.items():
            content = token_content(value)
            try:
                i = int(key)
            except ValueError:
                i = -1
            if i < self.n_base or content is None:
                raise TokenizerError(
                    f"{config_path}: added_tokens_decoder[{key!r}]: expected an id ≥ "
                    f"{self.n_base} (after tiktoken.model's ranks) with a token `content`"
                )
            named[i] = content
        return named

    def _windows(self, text: str):
        check_unicode(text)
        for i in range(0, len(text), TIKTOKEN_MAX_ENCODE_CHARS):
            yield from split_long_runs(text[i : i + TIKTOKEN_MAX_ENCODE_CHARS])

    def encode(self, text: str) -> list[int]:
        """Text → ids, special-token strings in it becoming their tokens (tokenization_kimi.py's `encode`)."""
        return [t for piece in self._windows(text) for t in self.encoding.encode(piece, allowed_special="all")]

    def encode_plain(self, text: str) -> list[int]:
        """Text → ids, special-token strings in it tokenized as ordinary text (message text inside a chat)."""
        return [t for piece in self._windows(text) for t in self.encoding.encode_ordinary(piece)]

    def encode_prompt(self, text: str) -> list[int]:
        return self.encode(text)

    def special(self, token: str) -> int:
        try:
            return self.special_to_id[token]
        except KeyError:
            raise ValueError(
                f"{token!r} is not a special token of {self.directory / 'tokenizer_config.json'}"
            ) from None

    def token_bytes(self, i: int) -> bytes:
        """The bytes of an ordinary (BPE) id; b"" for a special id or one outside the vocabulary."""
        return self._bytes[i] if 0 <= i < self.n_base else b""

    def decode_bytes(self, ids) -> bytes:
        return b"".join(self.token_bytes(int(i)) for i in ids)

    def decode(self, ids, *, skip_special: bool = True) -> str:
        """As tokenization_kimi.py decodes: the bytes of the ordinary ids as UTF-8 (invalid sequences as U+FFFD),
        each special token as its string (or nothing when `skip_special`; a skipped one does not cut the bytes
        around it), ids outside the vocabulary (a model's padded rows) dropped."""
        out: list[str] = []
        buf = bytearray()
        for i in map(int, ids):
            if 0 <= i < self.n_base:
                buf += self._bytes[i]
            elif not skip_special and i in self.id_to_special:
                out.append(buf.decode("utf-8", errors="replace"))
                buf.clear()
                out.append(self.id_to_special[i])
        out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)

    def stream_decoder(self, *, skip_special: bool = True) -> TikTokenStreamDecoder:
        return TikTokenStreamDecoder(self, skip_special)


class TikTokenStreamDecoder:
    """TikToken ids → text as soon as each UTF-8 sequence is complete (a token may hold part of a character);
    the concatenation equals `decode` of all the ids."""

    def __init__(self, tok: TikTokenTokenizer, skip_special: bool):
        self.tok, self.skip_special = tok, skip_special
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token: int) -> str:
        token = int(token)
        if 0 <= token < self.tok.n_base:
            return self.utf8.decode(self.tok.token_bytes(token))
        if self.skip_special or token not in self.tok.id_to_special:
            return ""
        return self.utf8.decode(b"", final=True) + self.tok.id_to_special[token]

    def flush(self) -> str:
        return self.utf8.decode(b"", final=True)
