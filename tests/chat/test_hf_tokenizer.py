"""A checkpoint's tokenizer.json gives the ids transformers' AutoTokenizer gives, decodes like it, streams whole
characters, and stops at the checkpoint's EOS ids; bad files are refused in one line naming the file."""

import json

import pytest
from support.hf_fixtures import auto_tokenizer, write_checkpoint

from expertmesh.chat.hf_tokenizer import CheckpointTokenizer
from expertmesh.chat.tokenizer import ByteTokenizer, load_tokenizer
from expertmesh.chat.tokenizer_files import TokenizerError

TEXTS = [
    "Hello world",
    "The weather in Paris is sunny today.",
    "  leading and trailing spaces  ",
    "café ✓ 日本語 🌍 mixed",
    "special strings <|im_end|> and <think> inside",
    "line\nbreaks\n\n\ttabs",
    "x",
]

LAYOUTS = {
    # tokenizer.json's post-processor adds BOS; tokenizer_config.json says nothing about it
    "post-processor": dict(),
    # transformers 5 ignores tokenizer_config.json's add_bos_token / add_eos_token beside a tokenizer.json: no
    # post-processor, no BOS (DeepSeek's tokenizer_class LlamaTokenizerFast is loaded as TokenizersBackend) ...
    "add_bos_token ignored": dict(
        post_processor_bos=False,
        config={"tokenizer_class": "LlamaTokenizerFast", "add_bos_token": True, "add_eos_token": True},
    ),
    # ... and the post-processor's BOS stays although add_bos_token is false
    "add_bos_token false ignored": dict(config={"add_bos_token": False}),
}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def pair(request, tmp_path_factory):
    d = write_checkpoint(tmp_path_factory.mktemp("tok"), **LAYOUTS[request.param])
    return CheckpointTokenizer(d), auto_tokenizer(d)


def test_prompt_ids_are_autotokenizers(pair):
    ours, theirs = pair
    for text in TEXTS:
        assert ours.encode_prompt(text) == theirs(text)["input_ids"], text
        assert ours.encode(text) == theirs(text, add_special_tokens=False)["input_ids"], text


def test_layouts_really_differ_in_special_tokens(tmp_path):
    """Not all layouts add the same special tokens: the equality above is not one case three times."""
    ids = {
        name: CheckpointTokenizer(write_checkpoint(tmp_path / name.replace(" ", "_"), **kw)).encode_prompt("x")
        for name, kw in LAYOUTS.items()
    }
    assert [len(ids[name]) for name in LAYOUTS] == [2, 1, 2]


def test_decode_is_transformers_decode(pair):
    ours, theirs = pair
    for text in TEXTS:
        ids = theirs(text)["input_ids"] + [theirs.convert_tokens_to_ids("<|im_end|>")]
        for skip in (True, False):
            assert ours.decode(ids, skip_special=skip) == theirs.decode(ids, skip_special_tokens=skip)
    padded = [5, ours.vocab_size, 6, ours.vocab_size + 90]  # ids of a model's padded vocabulary rows
    assert ours.decode(padded, skip_special=False) == theirs.decode(padded) == ours.decode([5, 6], skip_special=False)


@pytest.mark.parametrize("make", [lambda d: CheckpointTokenizer(write_checkpoint(d)), lambda d: ByteTokenizer()])
def test_stream_decoder_emits_whole_characters_only(make, tmp_path):
    tok = make(tmp_path)
    text = "naïve café ✓ 日本語のテキスト 🌍!"
    ids = tok.encode(text)
    assert any("\ufffd" in tok.decode([i]) for i in ids)  # some tokens really are partial characters
    stream = tok.stream_decoder()
    pieces = [stream.feed(i) for i in ids] + [stream.flush()]
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)


def test_eos_ids_from_generation_config_config_and_tokenizer_config(tmp_path):
    from transformers import GenerationConfig

    d = write_checkpoint(tmp_path, generation_eos=["</s>"])
    (d / "config.json").write_text(json.dumps({"eos_token_id": [1, 3]}))
    tok, theirs = CheckpointTokenizer(d), auto_tokenizer(d)
    expected = [GenerationConfig.from_pretrained(d).eos_token_id[0], 1, 3, theirs.eos_token_id]
    assert list(tok.eos_ids) == list(dict.fromkeys(expected))
    assert set(tok.eos_ids) == {theirs.convert_tokens_to_ids("</s>"), theirs.convert_tokens_to_ids("<|im_end|>")}


def test_special_tokens_named_in_config_but_missing_are_added_like_transformers(tmp_path):
    d = write_checkpoint(tmp_path, config={"pad_token": "<pad>", "additional_special_tokens": ["<|extra|>"]})
    tok, theirs = CheckpointTokenizer(d), auto_tokenizer(d)
    assert tok.vocab_size == len(theirs)
    text = "a <pad> b <|extra|> c"
    assert tok.encode_prompt(text) == theirs(text)["input_ids"]
    assert tok.special("<pad>") == theirs.convert_tokens_to_ids("<pad>")
    assert tok.decode(tok.encode(text)) == theirs.decode(
        theirs.encode(text, add_special_tokens=False), skip_special_tokens=True
    )


def test_special_lookup_and_plain_encoding(tmp_path):
    tok = CheckpointTokenizer(write_checkpoint(tmp_path))
    assert tok.decode([tok.special("<|im_end|>")], skip_special=False) == "<|im_end|>"
    with pytest.raises(ValueError, match="not a single token"):
        tok.special("hello there")
    assert tok.special("<|im_end|>") not in tok.encode_plain("say <|im_end|> please")
    assert tok.special("<|im_end|>") in tok.encode("say <|im_end|> please")


def test_load_tokenizer_picks_tokenizer_json_else_bytes(tmp_path):
    assert isinstance(load_tokenizer(None), ByteTokenizer)
    assert isinstance(load_tokenizer(tmp_path), ByteTokenizer)
    assert isinstance(load_tokenizer(write_checkpoint(tmp_path / "hf")), CheckpointTokenizer)


@pytest.mark.parametrize(
    "damage, file, needle",
    [
        (
            lambda d: (d / "tokenizer.json").write_text('{"model": {"type": "BPE", "vocab": 7}}'),
            "tokenizer.json",
            "not a Hugging Face tokenizers file",
        ),
        (lambda d: (d / "tokenizer.json").write_text("{not json"), "tokenizer.json", "not a Hugging Face tokenizers"),
        (lambda d: (d / "tokenizer_config.json").write_text("{oops"), "tokenizer_config.json", "not a readable JSON"),
        (
            lambda d: (d / "tokenizer_config.json").write_text("[1, 2]"),
            "tokenizer_config.json",
            "expected a JSON object",
        ),
        (lambda d: (d / "tokenizer_config.json").write_text("{}"), "", "no end-of-sequence token"),
        (lambda d: (d / "generation_config.json").write_text('{"eos_token_id": 99999}'), "", "outside the tokenizer"),
    ],
)
def test_bad_files_are_refused_in_one_line_naming_the_file(tmp_path, damage, file, needle):
    d = write_checkpoint(tmp_path)
    damage(d)
    with pytest.raises(TokenizerError) as e:
        CheckpointTokenizer(d)
    message = str(e.value)
    assert needle in message and str(d / file) in message and "\n" not in message
