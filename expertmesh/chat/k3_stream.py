"""Parsing K3's output incrementally: `K3StreamParser` gives what chat/k3_parse.py gives for the whole output, piece
by piece — reasoning and content text as each token arrives (never half a character; markup held back only while it
could still be a tag), each tools section's calls when the section is complete. The concatenation of its pieces
equals `parse_output` for any split of the tokens; it keeps all state in the parser object (one per stream), and the
format object is read-only."""

from __future__ import annotations

import codecs

from expertmesh.chat.format import ParsedOutput, Phase, ToolCall
from expertmesh.chat.k3_markup import CLOSE, MAX_TAG_BYTES, OPEN, RAW, TEXT, Item, K3Vocab, is_blank, make_tag
from expertmesh.chat.k3_parse import CallDraft, argument_value, finish_calls, loads_strict, schema_types


class K3StreamParser:
    """Generated ids → ("reasoning", text), ("content", text) and ("tool_call", ToolCall) pieces as they arrive;
    `feed` each id, then `finish` once; `result()` is then what `K3Chat.parse_output` gives for the same ids.
    A state machine over the same items as `lex`, built incrementally: text is decoded as it comes (an incremental
    UTF-8 decoder per run, so a token holding part of a character waits for the rest), a tag is held from its
    ⟨open⟩/⟨close⟩ to its ⟨sep⟩, text after the response waits for its run to end (whitespace there is dropped),
    and a tools section is held until it closes."""

    def __init__(self, vocab: K3Vocab, *, phase: Phase, salt: str = "", tools: list[dict] | None = None):
        self.vocab, self.salt, self.types = vocab, salt, schema_types(tools)
        self.tok, self.n_base = vocab.tokenizer, vocab.n_base
        self.markers = {vocab.open_id: OPEN, vocab.close_id: CLOSE}
        self.state = {"reasoning": "reasoning_start", "content": "content_start", "maybe": "maybe"}[phase]
        self.n = 0  # ids fed before the first stop id
        self.stopped = self.finished = False
        self.pending: tuple[str, bytearray] | None = None  # an unfinished tag: its marker and text bytes
        self.utf8 = None  # the current text run's decoder (None: no run)
        self.held = ""  # a text run after the response, until it ends
        self.reasoning: list[str] = []
        self.content: list[str] = []
        self.calls: list[ToolCall] = []
        self.finished_thinking, self.reasoning_tokens = phase != "reasoning", 0
        self._section_reset()
        self.out: list = []

    def _section_reset(self) -> None:
        self.sec_raw: list[str] = []
        self.sec_text = ""
        self.sec_calls: list[CallDraft] = []
        self.sub, self.cur, self.key, self.kind, self.value = "between", None, "", None, []

    # --- output
    def _emit(self, kind: str, text: str) -> None:
        if text:
            (self.reasoning if kind == "reasoning" else self.content).append(text)
            self.out.append((kind, text))

    def _emit_calls(self) -> None:
        for call in finish_calls(self.sec_calls, len(self.calls), self.salt):
            self.calls.append(call)
            self.out.append(("tool_call", call))

    # --- lexing
    def feed(self, token: int) -> list:
        """The pieces this id completes."""
        self.out = []
        token = int(token)
        if self.stopped or self.finished:
            return self.out
        if token in self.vocab.stop:
            self.stopped = True
            return self.out
        if not 0 <= token < self.tok.vocab_size:  # a model's padded rows: no token (as parse_output)
            return self.out
        self.n += 1
        text = token < self.n_base
        if self.pending is not None:
            marker, body = self.pending
            if text:
                body += self.tok.token_bytes(token)
                if len(body) > MAX_TAG_BYTES:  # not a tag: the marker is markup, its text starts a run
                    self.pending = None
                    self._item(Item(RAW, marker, 0))
                    self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
                    self._text(self.utf8.decode(bytes(body)))
                return self.out
            self.pending = None
            if token == self.vocab.sep_id:
                self._item(make_tag(marker, body.decode("utf-8", errors="replace"), self.n))
                return self.out
            self._item(Item(RAW, marker + body.decode("utf-8", errors="replace"), self.n - 1))
        if text:
            if self.utf8 is None:
                self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
            self._text(self.utf8.decode(self.tok.token_bytes(token)))
            return self.out
        self._end_run()
        if token in self.markers:
            self.pending = (self.markers[token], bytearray())
        else:
            self._item(Item(RAW, self.tok.id_to_special[token], self.n))
        return self.out

    def feed_many(self, tokens) -> list:
        out = []
        for t in tokens:
            out += self.feed(t)
        return out

    def finish(self) -> list:
        """The pieces the end of the output completes (an unfinished tag, run or section)."""
        self.out = []
        if self.finished:
            return self.out
        if self.pending is not None:
            marker, body = self.pending
            self.pending = None
            self._item(Item(RAW, marker + body.decode("utf-8", errors="replace"), self.n))
        self._end_run()
        if self.state == "section":
            if self.sub == "between":
                self._emit_calls()
            else:
                self._emit("content", "".join(self.sec_raw))
        if self.state in ("reasoning_start", "reasoning"):
            self.finished_thinking, self.reasoning_tokens = False, self.n
        self.finished = True
        return self.out

    def result(self) -> ParsedOutput:
        return ParsedOutput(
            "".join(self.reasoning),
            "".join(self.content),
            list(self.calls),
            self.reasoning_tokens,
            self.finished_thinking,
        )

    def _end_run(self) -> None:
        if self.utf8 is None:
            return
        self._text(self.utf8.decode(b"", final=True))
        self.utf8 = None
        if self.state == "after":
            if self.held.strip():
                self._emit("content", self.held)
            self.held = ""
        elif self.state == "section":
            item, self.sec_text = Item(TEXT, self.sec_text, self.n), ""
            self._section(item)

    # --- parsing
    def _text(self, piece: str) -> None:
        if self.state == "maybe":
            self.state = "content_start"
        if self.state == "reasoning_start":
            self.state = "reasoning"
        if self.state == "content_start":
            self.state = "content"
        if self.state == "reasoning":
            self._emit("reasoning", piece)
        elif self.state == "content":
            self._emit("content", piece)
        elif self.state == "after":
            self.held += piece
        elif self.state == "section":
            self.sec_text += piece

    def _item(self, it: Item) -> None:
        s = self.state
        if s == "done":
            return
        if s == "maybe":
            if it.is_tag(True, "think"):
                self.state = "reasoning"
                return
            s = self.state = "content_start"
        if s == "reasoning_start":
            s = self.state = "reasoning"
            if it.is_tag(True, "think"):
                return
        if s == "reasoning":
            if it.is_tag(False, "think") or it.is_tag(True, "response"):
                self.finished_thinking, self.reasoning_tokens = True, it.end
                self.state = "content_start" if it.is_tag(False, "think") else "content"
            else:
                self._emit("reasoning", it.text)
            return
        if s == "content_start":
            s = self.state = "content"
            if it.is_tag(True, "response"):
                return
        if s == "section":
            self._section(it)
        elif it.is_tag(True, "tools"):
            self.state = "section"
            self._section_reset()
            self.sec_raw.append(it.text)
        elif it.is_tag(False, "message"):
            self.state = "done"
        elif s == "content" and it.is_tag(False, "response"):
            self.state = "after"
        elif s in ("content", "after"):
            self._emit("content", it.text)

    def _section(self, it: Item) -> None:
        """One item of a tools section (parse_section's rules, one item at a time)."""
        sub = self.sub
        if sub == "between":
            if is_blank(it):
                pass
            elif it.is_tag(True, "call") and it.attr("tool"):
                self.cur, self.sub = CallDraft(it.attr("tool"), {}), "call"
            elif it.is_tag(False, "tools") or it.is_tag(False, "message"):
                self._emit_calls()
                self.state = "after"
                if it.is_tag(False, "message"):
                    self._item(it)
                return
            else:
                return self._malformed(it)
        elif sub == "call":
            if is_blank(it):
                pass
            elif it.is_tag(True, "argument") and it.attr("key") is not None:
                self.sub, self.key, self.kind, self.value = "arg", it.attr("key"), it.attr("type"), []
            elif it.is_tag(True, "json"):
                self.sub, self.value = "json", []
            elif it.is_tag(False, "call"):
                self.sec_calls.append(self.cur)
                self.sub = "between"
            else:
                return self._malformed(it)
        elif sub == "arg":
            if it.is_tag(False, "argument"):
                self.cur.args[self.key] = argument_value(
                    "".join(self.value), self.kind, self.types.get(self.cur.name, {}).get(self.key)
                )
                self.sub = "call"
            else:
                self.value.append(it.text)
        else:
            if it.is_tag(False, "json"):
                try:
                    obj = loads_strict("".join(self.value))
                except ValueError:
                    obj = None
                if not isinstance(obj, dict):
                    return self._malformed(it)
                self.cur.args.update(obj)
                self.sub = "call"
            else:
                self.value.append(it.text)
        self.sec_raw.append(it.text)

    def _malformed(self, it: Item) -> None:
        """The section so far is content; `it` is read again as content."""
        self._emit("content", "".join(self.sec_raw))
        self.state = "content"
        self._section_reset()
        if it.kind == TEXT:
            self._text(it.text)
        else:
            self._item(it)
