"""The TikToken tokenizer (expertmesh/chat/tiktoken_tokenizer.py) on the tiny K3 tokenizer of
support/k3_fixtures.py: its id layout, text round trips and stream decoding, long runs cut as Kimi's tokenizer cuts
them, and bad tiktoken.model files named."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.k3_fixtures import write_k3_tokenizer

from expertmesh.chat.tiktoken_tokenizer import TikTokenTokenizer, split_long_runs
from expertmesh.chat.tokenizer_files import TokenizerError


def test_tiktoken_tokenizer_layout_and_text(k3_dir, k3_chat):
    tok = k3_chat.tokenizer
    assert isinstance(tok, TikTokenTokenizer) and tok.vocab_size == tok.n_base + 64
    assert tok.id_to_special[tok.n_base + 3] == f"<|reserved_token_{tok.n_base + 3}|>"
    assert tok.eos_ids == (tok.special("<|end_of_msg|>"), tok.special("[EOS]"))
    text = "café ✓ 日本語のテキスト 🌍 <|open|> [BOS] x"
    assert tok.encode(text).count(tok.special("<|open|>")) == 1 and tok.special("<|open|>") not in tok.encode_plain(
        text
    )
    for ids in (tok.encode(text), tok.encode_plain(text)):
        assert tok.decode(ids, skip_special=False) == text and tok.encode_prompt(text) == tok.encode(text)
        d = tok.stream_decoder(skip_special=False)
        pieces = [d.feed(i) for i in ids] + [d.flush()]
        assert "".join(pieces) == text and all("\ufffd" not in p for p in pieces)
    assert tok.decode([tok.special("[BOS]"), 5, tok.vocab_size + 3]) == tok.decode([5])
    assert tok.decode_bytes(tok.encode_plain("日本")) == "日本".encode()
    with pytest.raises(ValueError, match="not valid Unicode"):
        tok.encode_plain("a\ud800")


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(["a", "bb", " ", "\n\n", "\u3000", "é"]), max_size=40), st.integers(1, 6))
def test_long_runs_are_cut_where_kimis_tokenizer_cuts_them(parts, limit):
    """tokenization_kimi.py's character loop (its `_split_whitespaces_or_nonwhitespaces`), as the reference."""
    s = "".join(parts)

    def reference(s, limit):
        n, space, start = 0, s[:1].isspace(), 0
        for i, ch in enumerate(s):
            if space ^ ch.isspace():
                n, space = 1, ch.isspace()
            else:
                n += 1
                if n > limit:
                    yield s[start:i]
                    start, n = i, 1
        yield s[start:]

    assert list(split_long_runs(s, limit)) == list(reference(s, limit))


def test_bad_tiktoken_files_are_named(tmp_path):
    write_k3_tokenizer(tmp_path)
    model = tmp_path / "tiktoken.model"
    lines = model.read_text().splitlines()
    model.write_text("\n".join(lines[:5] + ["not-base64!! x"] + lines[6:]))
    with pytest.raises(TokenizerError, match=r"tiktoken.model:6: not a tiktoken rank line"):
        TikTokenTokenizer(tmp_path)
    model.write_text("\n".join(lines[1:]))
    with pytest.raises(TokenizerError, match="ranks must be"):
        TikTokenTokenizer(tmp_path)
