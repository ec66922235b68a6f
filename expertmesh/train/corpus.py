"""English training text for the embedded default model, made from WordNet 3.0: plain paragraphs that define each
word, and chat conversations (user asks, assistant answers, with reasoning whose length follows the thinking effort).

Source: the Debian package `wordnet-base` (1:3.0-37), i.e. Princeton's WordNet 3.0 database files, under the
WordNet 3.0 licence ("WordNet 3.0 Copyright 2006 by Princeton University. All rights reserved."; permission to
use, copy, modify and distribute for any purpose without fee, provided the copyright notice and the disclaimer
appear on all copies — a permissive, BSD-like licence). `wordnet_dir` finds the files or fetches the package with
`apt-get download` (no root needed) and unpacks it with `dpkg-deb -x`.

A deterministic ~3% of synsets is held out (`held_out`): neither their definitions nor their examples appear in
any training text, so a trained model can be tested on words it has not seen defined.

    load_wordnet(wordnet_dir()) -> [Synset]     (file order: noun, verb, adj, adv; offsets ascending)
    plain_documents(synsets) -> [str]           one paragraph per synset
    conversations(synsets, seed) -> [ChatSample]
"""

from __future__ import annotations

import hashlib
import random
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from expertmesh.chat.format import Message

REPO_ROOT = Path(__file__).resolve().parents[2]
SYSTEM_WORDNET = Path("/usr/share/wordnet")
DATA_FILES = {"n": "data.noun", "v": "data.verb", "a": "data.adj", "r": "data.adv"}
INDEX_FILES = {"n": "index.noun", "v": "index.verb", "a": "index.adj", "r": "index.adv"}
NOUN_PERSON = 18  # lexicographer file noun.person: "Who was Einstein?"
HELD_OUT_PER_MILLE = 30
HELD_OUT_SALT = "expertmesh-wordnet-split-1"  # chosen so that "sea" (division of an ocean) stays in training
EFFORTS = ("low", None, "high", "max")
THINKING_OFF_SHARE = 0.2
OTHER_POS_SHARE = 0.3  # share of verbs and adjectives that get a conversation (every noun gets one)
SYSTEM_PROMPT = "You are a helpful assistant."


class CorpusError(RuntimeError):
    """WordNet could not be found, fetched or read; the message says what failed and how to fix it."""


# --- finding the files


def _has_data(directory: Path) -> bool:
    return all((directory / name).is_file() for name in DATA_FILES.values())


def wordnet_dir(cache: Path | None = None) -> Path:
    """A folder holding WordNet 3.0's data.noun / data.verb / data.adj / data.adv: /usr/share/wordnet when it has
    them, else `<cache>/wordnet-base/usr/share/wordnet`, fetched there once (`apt-get download wordnet-base`,
    unpacked with `dpkg-deb -x`). Default cache: `<repo>/.cache`."""
    if _has_data(SYSTEM_WORDNET):
        return SYSTEM_WORDNET
    cache = Path(cache) if cache is not None else REPO_ROOT / ".cache"
    extracted = cache / "wordnet-base"
    found = extracted / "usr/share/wordnet"
    if _has_data(found):
        return found
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache, prefix="wordnet-fetch-") as tmp:
        debs = _download_deb(Path(tmp))
        unpacked = Path(tmp) / "root"
        _run(["dpkg-deb", "-x", str(debs[0]), str(unpacked)], f"unpacking {debs[0].name}")
        if not _has_data(unpacked / "usr/share/wordnet"):
            raise CorpusError(f"{debs[0].name} holds no usr/share/wordnet/data.{{noun,verb,adj,adv}}")
        if not _has_data(found):  # another process may have finished first
            shutil.rmtree(extracted, ignore_errors=True)
            unpacked.rename(extracted)
    return found


def _download_deb(directory: Path) -> list[Path]:
    _run(["apt-get", "download", "wordnet-base"], "downloading the Debian package wordnet-base", cwd=directory)
    debs = sorted(directory.glob("wordnet-base_*.deb"))
    if not debs:
        raise CorpusError(f"`apt-get download wordnet-base` left no wordnet-base_*.deb in {directory}")
    return debs


def _run(command: list[str], what: str, cwd: Path | None = None) -> None:
    fix = (
        "install WordNet with `apt-get install wordnet-base` (it puts the files in /usr/share/wordnet), or run "
        "`apt-get update` first if the package is unknown, or unpack wordnet-base's .deb into <cache>/wordnet-base"
    )
    try:
        done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise CorpusError(f"WordNet 3.0: {what} failed: `{' '.join(command)}`: {e}; {fix}") from None
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise CorpusError(
            f"WordNet 3.0: {what} failed: `{' '.join(command)}` exited {done.returncode} ({' / '.join(tail)}); {fix}"
        )


# --- parsing


@dataclass(frozen=True)
class Synset:
    offset: int  # byte offset in its data file: the synset's id within its part of speech
    pos: str  # n | v | a (adjective, satellites included) | r (adverb)
    lexfile: int  # lexicographer file number (18: noun.person)
    words: tuple[str, ...]  # underscores as spaces, adjective markers such as "(p)" removed
    definition: str  # the gloss before its first quoted example
    examples: tuple[str, ...]  # the gloss's double-quoted parts
    hypernyms: tuple[int, ...]  # offsets (same pos) of `@` and `@i` pointers
    instance: bool  # the hypernyms are `@i`: this is one named thing (Paris), not a kind
    sense: int  # this synset's place among the senses of its first word (1: the most frequent); 0 when unlisted

    @property
    def key(self) -> str:
        return f"{self.pos}{self.offset:08d}"


def _split_gloss(gloss: str) -> tuple[str, tuple[str, ...]]:
    parts = gloss.split(";")
    first_example = next((i for i, p in enumerate(parts) if p.strip().startswith('"')), len(parts))
    definition = ";".join(parts[:first_example]).strip().rstrip(";").strip()
    examples = re.findall(r'"([^"]+)"', ";".join(parts[first_example:]))
    return definition.replace("`", "'"), tuple(e.strip() for e in examples if e.strip())


def _parse_line(line: str, pos: str) -> tuple[Synset, str]:
    head, _, gloss = line.partition(" | ")
    fields = head.split()
    offset, lexfile, n_words = int(fields[0]), int(fields[1]), int(fields[3], 16)
    words = tuple(re.sub(r"\([a-z]+\)$", "", w).replace("_", " ") for w in fields[4 : 4 + 2 * n_words : 2])
    at = 4 + 2 * n_words
    n_pointers = int(fields[at])
    hypernyms, instance = [], False
    for i in range(at + 1, at + 1 + 4 * n_pointers, 4):
        symbol, target, target_pos = fields[i], int(fields[i + 1]), fields[i + 2]
        if symbol in ("@", "@i") and target_pos == pos:
            hypernyms.append(target)
            instance = instance or symbol == "@i"
    definition, examples = _split_gloss(gloss.strip())
    synset = Synset(offset, pos, lexfile, words, definition, examples, tuple(hypernyms), instance, 0)
    return synset, re.sub(r"\([a-z]+\)$", "", fields[4].lower())


def _sense_order(directory: Path, pos: str) -> dict[str, list[int]]:
    """index.<pos>: lemma → its synset offsets, most frequent sense first (missing file: no order)."""
    path = directory / INDEX_FILES[pos]
    if not path.is_file():
        return {}
    order = {}
    for line in path.read_text(encoding="latin-1").splitlines():
        if line.startswith("  ") or not line.strip():
            continue
        fields = line.split()
        n_senses, n_pointers = int(fields[2]), int(fields[3])
        order[fields[0]] = [int(o) for o in fields[6 + n_pointers : 6 + n_pointers + n_senses]]
    return order


def load_wordnet(directory: Path) -> list[Synset]:
    """Every synset of data.noun, data.verb, data.adj, data.adv in file order (the licence header, lines that start
    with two spaces, skipped). CorpusError names a file that is missing or a line that does not parse."""
    directory = Path(directory)
    synsets: list[Synset] = []
    for pos, name in DATA_FILES.items():
        path = directory / name
        try:
            text = path.read_text(encoding="latin-1")
        except OSError as e:
            raise CorpusError(f"{path}: cannot be read ({e}); wordnet_dir() finds or fetches WordNet 3.0") from None
        senses = _sense_order(directory, pos)
        for n, line in enumerate(text.splitlines(), start=1):
            if line.startswith("  ") or not line.strip():
                continue
            try:
                synset, lemma = _parse_line(line, pos)
            except (ValueError, IndexError) as e:
                raise CorpusError(f"{path}:{n}: not a WordNet data line ({e})") from None
            order = senses.get(lemma, [])
            sense = order.index(synset.offset) + 1 if synset.offset in order else 0
            synsets.append(replace(synset, sense=sense))
    return synsets


def held_out(synset: Synset) -> bool:
    """The deterministic ~3% evaluation split (SHA-256 of a salt, the pos and the offset; never Python's hash)."""
    digest = hashlib.sha256(f"{HELD_OUT_SALT}:{synset.pos}{synset.offset:08d}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % 1000 < HELD_OUT_PER_MILLE


# --- sentences

# a gloss that starts with one of these needs no article before it ("any of various ...", "someone who ...")
_NO_ARTICLE = set(
    "a an the any some someone something anything everything one two three four five six several many much more most "
    "each every either neither no none all both this that these those its his her their what which who whom whose "
    "how when where whatever whoever in on of at by for from with without to as into about under over like not "
    "very widely chiefly especially usually often mostly formerly and or but if".split()
)
_DOMAIN_DROP = {"of", "usually", "often", "especially", "used", "followed", "sometimes", "informal", "formal", "a"}
_VOWEL_SOUND_EXCEPTIONS_A = ("uni", "use", "usu", "uti", "eu", "one", "once", "ure", "ewe")
_VOWEL_SOUND_EXCEPTIONS_AN = ("hour", "honest", "honor", "honour", "heir")


def indefinite(word: str) -> str:
    """'a' or 'an' before `word` (by its first letter, with the common exceptions: a unit, an hour)."""
    w = word.lower()
    if w.startswith(_VOWEL_SOUND_EXCEPTIONS_AN):
        return "an"
    if w.startswith(_VOWEL_SOUND_EXCEPTIONS_A):
        return "a"
    return "an" if w[:1] in "aeiou" else "a"


def is_proper(word: str) -> bool:
    return word[:1].isupper()


def capitalize(text: str) -> str:
    return text[:1].upper() + text[1:]


def sentence(text: str) -> str:
    """First letter capital, a full stop at the end unless it already ends a sentence."""
    text = capitalize(text.strip())
    return text if text.endswith((".", "!", "?")) else text + "."


def plural(word: str) -> str:
    if word.endswith(("s", "x", "z", "ch", "sh")):
        return word + "es"
    if word.endswith("y") and word[-2:-1] not in ("a", "e", "i", "o", "u"):
        return word[:-1] + "ies"
    return word + "s"


def _domain_and_rest(definition: str) -> tuple[str | None, str]:
    """A leading "(chemistry)" becomes a domain ("In chemistry, ..."); other leading remarks ("(of a person)",
    "(usually followed by 'to')") are dropped, so the sentence reads on."""
    m = re.match(r"\(([^()]*)\)\s*(.*)", definition)
    if not m or not m.group(2):
        return None, definition
    remark, rest = m.group(1).strip(), m.group(2)
    words = remark.split()
    if re.fullmatch(r"[A-Za-z ]+", remark) and 1 <= len(words) <= 3 and words[0].lower() not in _DOMAIN_DROP:
        return remark, rest
    return None, rest


def _noun_complement(definition: str) -> str:
    """The definition as the complement of "X is ...": an article added before a bare noun phrase ("binary
    compound that ..." → "a binary compound that ...")."""
    first = definition.split(" ", 1)[0]
    bare = first.lower().strip(",")
    plural_like = bare.endswith("s") and not bare.endswith(("ss", "us", "is", "ous"))
    if (
        not first[:1].isalpha()
        or bare in _NO_ARTICLE
        or bare.endswith(("ing", "ed", "ly"))
        or plural_like
        or bare in ("people", "men", "women", "children")
    ):
        return definition
    return f"{indefinite(first)} {definition}"


def noun_subject(synset: Synset, article: str) -> str:
    """The subject of a definition: "The sea", "A dog", "An apple", "Paris" (`article`: "the" or "a")."""
    word = synset.words[0]
    if is_proper(word) or synset.instance:
        return word
    return f"The {word}" if article == "the" else f"{capitalize(indefinite(word))} {word}"


def definition_sentence(synset: Synset, article: str = "a") -> str:
    """The synset's definition as one English sentence: "The sea is a division of an ocean ...", "To breathe is to
    draw air into ...", "Able means having ...". Empty when the synset has no definition."""
    if not synset.definition:
        return ""
    domain, rest = _domain_and_rest(synset.definition)
    word = synset.words[0]
    if synset.pos == "n":
        verb = "was" if synset.lexfile == NOUN_PERSON and re.search(r"\(\d+[^()]*\d+\)$", rest) else "is"
        subject = noun_subject(synset, article)
        text = f"{subject} {verb} {_noun_complement(rest)}"
    elif synset.pos == "v":
        text = f"To {word} is to {rest}"
    else:
        text = f"{capitalize(word)} means {rest}"
    if domain:
        keep = domain if is_proper(domain) else domain.lower()
        proper_subject = synset.pos != "v" and (is_proper(word) or synset.instance)
        text = f"In {keep}, {text if proper_subject else text[:1].lower() + text[1:]}"
    return sentence(text)


def kind_sentence(synset: Synset, hypernym: Synset) -> str:
    """What a synset is a kind of: "A sea is a kind of body of water.", "Paris is a national capital.", and for
    a verb "To respire is a way to breathe." (the hypernym's first word only, never its gloss)."""
    word, parent = synset.words[0], hypernym.words[0]
    if synset.pos == "v":
        return f"To {word} is a way to {parent}."
    if synset.instance:
        return f"{word} is {indefinite(parent)} {parent}."
    return f"{noun_subject(synset, 'a')} is a kind of {parent}."


def plain_documents(synsets: list[Synset], *, include_held_out: bool = False) -> list[str]:
    """One short paragraph per synset that is not held out (`include_held_out`: those too — the evaluation's text)
    and has a definition: its definition as a sentence, its examples as sentences, what it is a kind of, and its
    other names."""
    by_key = {s.key: s for s in synsets}
    documents = []
    for s in synsets:
        if (held_out(s) and not include_held_out) or not s.definition:
            continue
        article = "the" if int.from_bytes(hashlib.sha256(s.key.encode()).digest()[:2], "big") % 2 else "a"
        parts = [definition_sentence(s, article)]
        parts += [sentence(e) for e in s.examples]
        parent = hypernym_of(s, by_key)
        if parent is not None:
            parts.append(kind_sentence(s, parent))
        if s.pos == "n" and len(s.words) > 1:
            parts.append(f"It is also called {_join_or(s.words[1:])}.")
        documents.append(" ".join(parts))
    return documents


def hypernym_of(synset: Synset, by_key: dict[str, Synset]) -> Synset | None:
    for offset in synset.hypernyms:
        parent = by_key.get(f"{synset.pos}{offset:08d}")
        if parent is not None:
            return parent
    return None


def _join_or(words) -> str:
    words = list(words)
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1]


# --- conversations


@dataclass
class ChatSample:
    messages: list[Message]
    thinking: bool
    thinking_effort: str | None  # low | None (the default) | high | max; None too when thinking is off


def _noun_question(s: Synset, rng: random.Random) -> tuple[str, str]:
    """(the user's question, the article the answer starts with)."""
    word = s.words[0]
    if is_proper(word) or s.instance:
        who = "Who" if s.lexfile == NOUN_PERSON else "What"
        verb = "was" if s.lexfile == NOUN_PERSON and re.search(r"\(\d+[^()]*\d+\)$", s.definition) else "is"
        templates = [f"Tell me about {word}.", f"{who} {verb} {word}?", f"What do you know about {word}?"]
        return rng.choice(templates), "a"
    a = indefinite(word)
    templates = [
        (f"Tell me about the {word}.", "the"),
        (f"What is the {word}?", "the"),
        (f"What is {a} {word}?", "a"),
        (f"Describe {a} {word}.", "a"),
        (f"What does '{word}' mean?", "a"),
        (f"Explain what {a} {word} is.", "a"),
        (f"What is the meaning of the word '{word}'?", "a"),
        (f"Define '{word}'.", "a"),
    ]
    if " " not in word:
        templates.append((f"Can you tell me about {plural(word)}?", "a"))
    return rng.choice(templates)


def _question(s: Synset, rng: random.Random) -> tuple[str, str]:
    word = s.words[0]
    if s.sense > 1:  # a later sense of a word: asked as such, so "What is the sea?" keeps one answer
        return rng.choice([f"What else can '{word}' mean?", f"Does '{word}' have another meaning?"]), "a"
    if s.pos == "n":
        return _noun_question(s, rng)
    if s.pos == "v":
        return rng.choice([f"What does it mean to {word}?", f"What does '{word}' mean?", f"Define '{word}'."]), "a"
    return rng.choice([f"What does '{word}' mean?", f"What does the word '{word}' mean?", f"Define '{word}'."]), "a"


def _answer_head(s: Synset, article: str) -> str:
    if s.sense > 1:
        meaning = _domain_and_rest(s.definition)[1]
        meaning = {"n": _noun_complement(meaning), "v": f"to {meaning}"}.get(s.pos, meaning)
        return sentence(f"The word '{s.words[0]}' can also mean {meaning}")
    return definition_sentence(s, article)


def answer_text(s: Synset, article: str, parent: Synset | None, rng: random.Random) -> str:
    parts = [_answer_head(s, article)]
    if s.examples and rng.random() < 0.4:
        parts.append(f'For example: "{rng.choice(s.examples)}".')
    if parent is not None and rng.random() < 0.5:
        kind = kind_sentence(s, parent)
        parts.append("It is " + kind.split(" is ", 1)[1] if s.pos == "n" else kind)
    if s.pos == "n" and len(s.words) > 1 and rng.random() < 0.3:
        parts.append(f"It is also called {_join_or(s.words[1:])}.")
    return " ".join(parts)


def _restatement(s: Synset, article: str, rng: random.Random) -> str:
    word = s.words[0]
    if s.sense > 1:
        return f"The user asks for another meaning of '{word}'."
    if s.pos == "n":
        subject = noun_subject(s, article)
        subject = subject if is_proper(word) or s.instance else subject[:1].lower() + subject[1:]
        return rng.choice([f"The user asks about {subject}.", f"The question is about the word '{word}'."])
    if s.pos == "v":
        return f"The user asks what it means to {word}."
    return f"The user asks what '{word}' means."


_FILLERS = [
    "Let me recall what the word means.",
    "I should make sure I have the right sense of the word.",
    "The answer should be short and clear.",
    "I will start with the definition.",
    "A simple definition is what helps most here.",
    "Let me check what kind of thing it is.",
    "The user wants a plain explanation.",
    "I know this word.",
    "One or two sentences will do.",
]


def reasoning_text(s: Synset, article: str, effort: str | None, by_key: dict[str, Synset], rng: random.Random) -> str:
    """Longer with more effort: low one sentence, default one or two, high 3-5, max 6-10."""
    restated = _restatement(s, article, rng)
    if effort == "low":
        return restated
    chain, node = [], s
    for _ in range(3 if effort == "max" else 1):
        parent = hypernym_of(node, by_key)
        if parent is None:
            break
        chain.append((node, parent))
        node = parent
    if effort is None:
        if chain and rng.random() < 0.5:
            return f"{restated} {kind_sentence(*chain[0])}"
        return restated if rng.random() < 0.5 else f"{restated} {rng.choice(_FILLERS)}"
    facts = []
    for child, parent in chain:
        facts.append(kind_sentence(child, parent))
        if parent.definition and not held_out(parent):
            facts.append(definition_sentence(parent, "a"))
    if len(s.words) > 1:
        facts.append(f"Other words for it: {', '.join(s.words[1:])}.")
    if s.examples and effort == "max":
        facts.append(f'An example of its use: "{s.examples[0]}".')
    low, high = (3, 5) if effort == "high" else (6, 10)
    target = rng.randint(low, high)
    closing = "So I will answer with the definition." if effort == "max" else "I will give the definition."
    body = facts[: target - 2]
    fillers = rng.sample(_FILLERS, len(_FILLERS))
    while len(body) < target - 2:
        body.append(fillers.pop())
    return " ".join([restated, *body, closing])


def conversations(synsets: list[Synset], seed: int, *, include_held_out: bool = False) -> list[ChatSample]:
    """One user question and assistant answer for every noun with a definition and for OTHER_POS_SHARE of the verbs
    and adjectives (held-out synsets only with `include_held_out`), deterministic for `seed`: thinking off in THINKING_OFF_SHARE of
    them, else an effort of EFFORTS (reasoning length growing with it); now and then a system prompt first."""
    rng = random.Random(seed)
    by_key = {s.key: s for s in synsets}
    samples = []
    for s in synsets:
        if (held_out(s) and not include_held_out) or not s.definition or s.pos == "r":
            continue
        if s.pos != "n" and rng.random() >= OTHER_POS_SHARE:
            continue
        question, article = _question(s, rng)
        thinking = rng.random() >= THINKING_OFF_SHARE
        effort = rng.choice(EFFORTS) if thinking else None
        parent = hypernym_of(s, by_key)
        reasoning = reasoning_text(s, article, effort, by_key, rng) if thinking else None
        messages = [Message("system", SYSTEM_PROMPT)] if rng.random() < 0.1 else []
        messages.append(Message("user", question))
        messages.append(Message("assistant", answer_text(s, article, parent, rng), reasoning=reasoning))
        samples.append(ChatSample(messages, thinking, effort))
    return samples
