"""The WordNet corpus: parsing (the sea's synset, glosses split into definition and examples, hypernyms), the
held-out split, the plain paragraphs and the chat samples (thinking off and every effort, reasoning that grows with
the effort). Uses WordNet 3.0 from /usr/share/wordnet or fetched once into <repo>/.cache (`apt-get download`)."""

from __future__ import annotations

import re
from collections import Counter

import pytest

from expertmesh.train import corpus
from expertmesh.train.corpus import (
    CorpusError,
    conversations,
    held_out,
    load_wordnet,
    plain_documents,
    wordnet_dir,
)

SEA = ("n", 9426788)
SEA_DEFINITION = "a division of an ocean or a large body of salt water partially enclosed by land"


@pytest.fixture(scope="module")
def synsets():
    return load_wordnet(wordnet_dir())


@pytest.fixture(scope="module")
def by_key(synsets):
    return {(s.pos, s.offset): s for s in synsets}


@pytest.fixture(scope="module")
def documents(synsets):
    return plain_documents(synsets)


@pytest.fixture(scope="module")
def samples(synsets):
    return conversations(synsets, seed=0)


def test_sea_is_parsed_with_its_gloss_and_hypernym_and_is_trained_on(synsets, by_key, documents):
    sea = by_key[SEA]
    assert sea.words == ("sea",) and sea.definition == SEA_DEFINITION and sea.examples == () and sea.sense == 1
    assert [by_key[("n", o)].words[0] for o in sea.hypernyms] == ["body of water"] and not sea.instance
    assert not held_out(sea)
    paragraph = next(d for d in documents if SEA_DEFINITION in d)
    assert paragraph.split(" is ", 1)[0] in ("The sea", "A sea")
    assert paragraph.endswith(f"sea is {SEA_DEFINITION}. A sea is a kind of body of water.")
    assert len(synsets) == 117659  # WordNet 3.0: 82115 nouns, 13767 verbs, 18156 adjectives, 3621 adverbs
    assert Counter(s.pos for s in synsets) == {"n": 82115, "v": 13767, "a": 18156, "r": 3621}


def test_gloss_examples_are_split_out_and_words_cleaned(by_key, documents):
    dog = by_key[("n", 2084071)]
    assert dog.words == ("dog", "domestic dog", "Canis familiaris")
    assert dog.definition.startswith("a member of the genus Canis") and dog.definition.endswith("occurs in many breeds")
    assert dog.examples == ("the dog barked all night",)
    breathe = by_key[("v", 1740)]
    assert breathe.definition == "draw air into, and expel out of, the lungs"
    assert breathe.examples == ("I can breathe better when the air is clean", "The patient is respiring")
    galore = by_key[("a", 14358)]  # "galore(ip)": the adjective marker goes
    assert galore.words == ("abounding", "galore")
    paris = by_key[("n", 8932568)]
    assert paris.words[0] == "Paris" and paris.instance and paris.sense == 1
    assert (
        "To breathe is to draw air into, and expel out of, the lungs. I can breathe better when the air is "
        "clean. The patient is respiring." in documents
    )
    assert any(d.startswith("Paris is the capital") for d in documents)


def test_held_out_is_a_deterministic_three_percent(synsets):
    flags = [held_out(s) for s in synsets]
    assert flags == [held_out(s) for s in synsets]
    assert 0.025 < sum(flags) / len(flags) < 0.035
    assert {s.pos for s, f in zip(synsets, flags) if f} == {"n", "v", "a", "r"}


def test_held_out_synsets_never_reach_the_training_text(synsets, documents, samples):
    training = "\n".join(documents) + "\n".join(
        m.content + "\n" + (m.reasoning or "") for sample in samples for m in sample.messages
    )
    held = [s for s in synsets if held_out(s) and len(s.definition) >= 40]
    found = [s.definition for s in held[:: len(held) // 150] if s.definition in training]
    # a held-out definition may still occur inside a kept synset's own gloss ("... of Canada and northeastern
    # United States"): that is the kept synset's text, not a leak
    kept_glosses = "\n".join(s.definition for s in synsets if not held_out(s))
    assert [d for d in found if d not in kept_glosses] == []
    kept = [s.definition for s in synsets if not held_out(s) and len(s.definition) >= 40]
    assert all(d in training for d in kept[::5000])  # the check above can fail: kept definitions are found


def test_held_out_hypernyms_lend_their_word_but_not_their_gloss(synsets):
    held_parents = {(s.pos, s.offset): s for s in synsets if held_out(s) and s.pos == "n" and s.definition}
    children = [
        s for s in synsets if s.pos == "n" and s.hypernyms and not held_out(s) and ("n", s.hypernyms[0]) in held_parents
    ]
    assert len(children) > 200
    parents = {held_parents[("n", c.hypernyms[0])] for c in children}
    samples = conversations(children + sorted(parents, key=lambda s: s.offset), seed=3)
    assert len(samples) == len(children)
    text = "\n".join(m.content + "\n" + (m.reasoning or "") for sample in samples for m in sample.messages)
    assert sum(f"kind of {p.words[0]}" in text for p in parents) > len(parents) / 2
    # a child's own gloss may hold the parent's words ("implement for beating dust out of carpets")
    own = "\n".join(c.definition + "\n" + "\n".join(c.examples) for c in children)
    bare = {p.definition: re.sub(r"^(an?|the) ", "", p.definition) for p in parents}
    assert [p.definition for p in parents if p.definition in text and bare[p.definition] not in own] == []
    assert plain_documents(sorted(parents, key=lambda s: s.offset)) == []


def test_conversations_cover_thinking_off_and_every_effort(samples):
    assert len(samples) > 80_000
    shares = Counter((s.thinking, s.thinking_effort) for s in samples)
    assert set(shares) == {(False, None), (True, "low"), (True, None), (True, "high"), (True, "max")}
    assert 0.17 < shares[(False, None)] / len(samples) < 0.23
    for sample in samples:
        roles = [m.role for m in sample.messages]
        assert roles in (["user", "assistant"], ["system", "user", "assistant"])
        assistant = sample.messages[-1]
        assert assistant.content and (assistant.reasoning is not None) == sample.thinking
    reasoning = {
        e: [len(s.messages[-1].reasoning) for s in samples if s.thinking and s.thinking_effort == e]
        for e in ("low", None, "high", "max")
    }
    means = {e: sum(v) / len(v) for e, v in reasoning.items()}
    assert means["low"] < means[None] < means["high"] < means["max"] and means["max"] > 3 * means["low"]


def test_conversations_are_deterministic_and_answer_about_the_sea(synsets, samples):
    head = synsets[:3000]
    assert conversations(head, seed=0) == conversations(head, seed=0)
    assert conversations(head, seed=0) != conversations(head, seed=1)
    sea = [s for s in samples if SEA_DEFINITION in s.messages[-1].content]
    assert len(sea) == 1
    question, answer = sea[0].messages[-2].content, sea[0].messages[-1].content
    assert "sea" in question and answer.split(" is ", 1)[0] in ("The sea", "A sea")
    assert not any(s.messages[-1].content[:1].islower() for s in samples)  # "9/11 is ...", ".22 caliber means ..."


def test_missing_wordnet_names_what_failed_and_the_fix(tmp_path, monkeypatch):
    monkeypatch.setattr(corpus, "SYSTEM_WORDNET", tmp_path / "none")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no apt-get on PATH
    with pytest.raises(CorpusError, match=r"apt-get download wordnet-base.*apt-get install wordnet-base"):
        wordnet_dir(tmp_path / "cache")
    with pytest.raises(CorpusError, match="data.noun: cannot be read"):
        load_wordnet(tmp_path)
