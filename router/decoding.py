"""Generated tokens → text as it may go out: incremental detokenization (never half a character), a chat answer's
reasoning apart from its content with tool-call markup held back (`ChatDecoder`, or a format's own stream parser:
`decoder_for`), and stop strings (`StopCut`)."""

from __future__ import annotations

from typing import Protocol

from expertmesh.chat.format import ChatFormat, Phase


class TokenDecoder(Protocol):
    """What a chat run streams through: ("reasoning" | "content", text) pieces per token, the rest at the end."""

    done: bool

    def feed(self, token: int) -> list[tuple[str, str]]: ...

    def flush(self) -> list[tuple[str, str]]: ...


def decoder_for(fmt: ChatFormat, phase: Phase, salt: str = "", tools: list[dict] | None = None) -> TokenDecoder:
    """The format's own incremental parser when it has one (K3: its markup is not single marker tokens), else the
    marker-token decoder; either way its pieces concatenate to what parse_output gives for the same tokens."""
    if hasattr(fmt, "stream_parser"):
        return ParserDecoder(fmt.stream_parser(phase=phase, salt=salt, tools=tools))
    return ChatDecoder(fmt, phase)


class ParserDecoder:
    """A format's stream parser as a TokenDecoder: its tool calls are held back (the run's parse_output returns
    them structured at the end, as ChatDecoder holds tool-call markup back)."""

    def __init__(self, parser):
        self.parser = parser

    @property
    def done(self) -> bool:
        return self.parser.stopped

    @staticmethod
    def _text(pieces) -> list[tuple[str, str]]:
        return [(kind, text) for kind, text in pieces if kind != "tool_call"]

    def feed(self, token: int) -> list[tuple[str, str]]:
        return self._text(self.parser.feed(token))

    def flush(self) -> list[tuple[str, str]]:
        return self._text(self.parser.finish())


class ChatDecoder:
    """Generated tokens → ("reasoning" | "content", text) pieces: incremental detokenization (never half a
    character), the thinking section apart from the answer, tool-call markup held back (the format's parse_output
    turns it into structured calls). For a format that strips the whitespace around reasoning and content, the
    pieces do too: leading whitespace is dropped, trailing whitespace waits for more text."""

    def __init__(self, fmt: ChatFormat, phase: Phase):
        self.tok, self.m, self.trim = fmt.tokenizer, fmt.markers, fmt.trim_whitespace
        self.phase = phase
        self.in_call = False
        self.done = False
        self.text = self.tok.stream_decoder()
        self.started, self.held = False, ""  # this section has emitted text; whitespace not yet emitted

    def _emit(self, kind: str, piece: str, out: list) -> None:
        if not self.trim:
            out += [(kind, piece)] if piece else []
            return
        piece = piece if self.started else piece.lstrip()
        body = piece.rstrip()
        if body:
            out.append((kind, self.held + body))
            self.held, self.started = "", True
        if self.started:
            self.held += piece[len(body) :]

    def feed(self, token: int) -> list[tuple[str, str]]:
        m, out = self.m, []
        if token in m.stop:
            self.done = True
            return out
        if self.phase == "maybe":  # the model may open thinking with its first token
            self.phase = "reasoning" if token == m.think_start else "content"
            if self.phase == "reasoning":
                return out
        if self.phase == "reasoning":
            if token == m.think_end:
                self._emit("reasoning", self.text.flush(), out)
                self.text = self.tok.stream_decoder()
                self.phase, self.started, self.held = "content", False, ""
            else:
                self._emit("reasoning", self.text.feed(token), out)
            return out
        if token == m.tool_open:
            self.in_call = True
        elif m.tool_close is not None and token == m.tool_close:
            self.in_call = False
        elif not self.in_call:
            self._emit("content", self.text.feed(token), out)
        return out

    def flush(self) -> list[tuple[str, str]]:
        out: list = []
        self._emit(self.phase, self.text.flush(), out)
        return out


class StopCut:
    """Stop strings over the content pieces (never the reasoning): text before the first match goes out, a piece
    that could be the start of a stop string waits for the next one, and after a match nothing more."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) - 1 for s in self.stops), default=0)
        self.buf, self.hit = "", None

    def feed(self, kind: str, text: str) -> list[tuple[str, str]]:
        if kind != "content" or not self.stops:
            return [(kind, text)] if text else []
        self.buf += text
        found = [(i, s) for s in self.stops if (i := self.buf.find(s)) >= 0]
        if found:
            i, self.hit = min(found)
            out, self.buf = self.buf[:i], ""
        else:
            cut = max(0, len(self.buf) - self.hold)
            out, self.buf = self.buf[:cut], self.buf[cut:]
        return [("content", out)] if out else []

    def flush(self) -> list[tuple[str, str]]:
        out, self.buf = self.buf, ""
        return [("content", out)] if out else []


class TextStream:
    """A completion's tokens → its text through the stop strings: `feed` returns what may go out now, `flush` the
    rest once generation is over; `stopped` once a stop string matched (nothing after it goes out)."""

    def __init__(self, tokenizer, stops: list[str]):
        self.decoder, self.cut = tokenizer.stream_decoder(), StopCut(stops)
        self.text = ""

    @property
    def stopped(self) -> bool:
        return self.cut.hit is not None

    def _out(self, pieces: list[tuple[str, str]]) -> str:
        out = "".join(text for _, text in pieces)
        self.text += out
        return out

    def feed(self, token: int) -> str:
        return "" if self.stopped else self._out(self.cut.feed("content", self.decoder.feed(token)))

    def flush(self) -> str:
        if self.stopped:
            return ""
        out = self._out(self.cut.feed("content", self.decoder.flush()))
        return out + ("" if self.stopped else self._out(self.cut.flush()))
