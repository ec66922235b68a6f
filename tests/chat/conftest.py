"""Fixtures of the K3 chat tests (test_k3_*.py, test_tiktoken_tokenizer.py): the tiny K3 tokenizer of
support/k3_fixtures.py, written once, and the K3Chat loaded from it (read-only, so one serves every test)."""

import pytest
from support.k3_fixtures import write_k3_tokenizer

from expertmesh.chat.k3 import K3Chat
from expertmesh.chat.load import load_chat


@pytest.fixture(scope="session")
def k3_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("k3")
    write_k3_tokenizer(d)
    return d


@pytest.fixture(scope="session")
def k3_chat(k3_dir) -> K3Chat:
    chat = load_chat(k3_dir)
    assert isinstance(chat, K3Chat)
    return chat
