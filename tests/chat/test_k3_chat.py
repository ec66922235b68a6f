"""K3Chat (expertmesh/chat/k3.py) as a whole: the markers the router's thinking budget and stop use, and
load_chat picking K3's format. Its parts have their own files: test_k3_render.py, test_k3_parse.py,
test_k3_stream.py, test_k3_grammar.py; the TikToken tokenizer is in test_tiktoken_tokenizer.py."""

import json

import pytest
from support.k3_chat import ids_of
from support.k3_fixtures import write_k3_tokenizer

from expertmesh.chat.format import BuiltinChat, thinking_control
from expertmesh.chat.k3 import K3Chat
from expertmesh.chat.load import NoChatTemplate, load_chat
from expertmesh.chat.thinking import ThinkingState
from expertmesh.chat.tokenizer_files import TokenizerError


def test_markers_for_the_thinking_budget_and_the_stop(k3_chat):
    m, tok = k3_chat.markers, k3_chat.tokenizer
    assert m.stop[0] == tok.special("<|end_of_msg|>") == m.end_of_turn and tok.special("[EOS]") in m.stop
    assert m.think_end == tok.special("<|close|>") == m.think_end_ids[0]
    assert tok.decode(m.think_end_ids, skip_special=False) == "<|close|>think<|sep|><|open|>response<|sep|>"
    assert (
        not {k3_chat.open_id, k3_chat.close_id, k3_chat.sep_id} & m.not_in_answer
        and tok.special("[BOS]") in m.not_in_answer
    )
    # the sampler's thinking control forces the whole close at the limit (three reasoning tokens, then the close)
    state = ThinkingState(thinking_control(m, "reasoning", 3 + len(m.think_end_ids)))
    text = tok.encode_plain("a b c d e f g h i j k l m n o p")
    fed = []
    for t in text:
        fed.append(state.next_token(t))
        state.observe(fed[-1])
        if state.answering:
            break
    assert fed == text[:3] + list(m.think_end_ids) and state.reasoning_tokens == 3 + len(m.think_end_ids)
    out = fed + tok.encode_plain("Done.") + ids_of(k3_chat, "<|close|>response<|sep|>")
    parsed = k3_chat.parse_output(out, phase="reasoning")
    assert parsed.reasoning == tok.decode(text[:3]) and parsed.content == "Done." and parsed.finished_thinking


def test_load_chat_picks_k3(tmp_path):
    bare = tmp_path / "bare"  # tiktoken.model + XTML specials, no config.json
    write_k3_tokenizer(bare, config=False)
    assert isinstance(load_chat(bare), K3Chat)
    other = tmp_path / "other"  # a tiktoken vocabulary without K3's markers
    write_k3_tokenizer(other, config=False)
    cfg = json.loads((other / "tokenizer_config.json").read_text())
    cfg["added_tokens_decoder"] = {k: v for k, v in cfg["added_tokens_decoder"].items() if v["content"] != "<|sep|>"}
    (other / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert isinstance(load_chat(other), NoChatTemplate)
    no_vocab = tmp_path / "no_vocab"
    no_vocab.mkdir()
    (no_vocab / "config.json").write_text(json.dumps({"model_type": "kimi_k3"}))
    with pytest.raises(TokenizerError, match="kimi_k3 checkpoint needs its tiktoken.model"):
        load_chat(no_vocab)
    with pytest.raises(TokenizerError, match="tiktoken.model: 740 token ids, but the model's vocab_size is 700"):
        load_chat(bare, model_vocab_size=700)
    assert isinstance(load_chat(None), BuiltinChat)
