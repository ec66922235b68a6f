"""Kimi K3's chat format (XTML): `K3Chat` composes rendering as `Kimi-K3.jinja` renders (chat/k3_render.py), parsing
K3's output at once (chat/k3_parse.py) and incrementally (chat/k3_stream.py) over the markup's lexer
(chat/k3_markup.py), and the grammars that constrain K3's own tool-call and response markup (chat/k3_grammar.py).

Markup. `⟨open⟩ ⟨close⟩ ⟨sep⟩ ⟨eom⟩` are the special tokens `<|open|>`, `<|close|>`, `<|sep|>`, `<|end_of_msg|>`;
tag names and attributes are ordinary text: `open_tag(t, attrs) = ⟨open⟩ t( k="v")* ⟨sep⟩` (attribute values
escaped `&`→`&amp;`, `"`→`&quot;`; bodies are raw), `close_tag(t) = ⟨close⟩ t ⟨sep⟩`. Every message is
`open_tag(message, role=…) body close_tag(message) ⟨eom⟩`; no BOS, nothing between messages. In order:

    tool declarations (when tools)   role="system" type="tool-declare": "# Tools\\n…```json\\n" + tools + "\\n```"
    thinking effort (thinking on and thinking_effort low|high|max)   role="system" type="thinking-effort"
    the messages: system / user (text; images as their media blocks), assistant (open_tag(think) reasoning
        close_tag(think) — only with thinking on, kept for every assistant message — then open_tag(response)
        content close_tag(response), then its tool calls in a tools section: open_tag(call, tool=, index=) with
        open_tag(argument, key=, type=) value close_tag(argument) per argument, strings raw and other values as
        JSON), tool results (role="tool" tool="name" index="n", a run of them re-ordered into the call order)
    tool_choice required / none      role="system" type="tool-choice"
    response_format json_object / json_schema   role="system" type="response-format"
    generation prompt                open_tag(message, role=assistant) open_tag(think)  (or open_tag(response))

JSON in declarations and schemas has its keys sorted at every level, case-sensitively (codepoint order: K3's
reference encoder sorts with `sort_keys`, and llama.cpp's `dictsort` compares case-sensitively, where Python
jinja2's `dictsort` would fold case); other JSON is `json.dumps(ensure_ascii=False)` (Python's number forms:
llama.cpp's Jinja writes the float 1.0 as `1`, Python and K3's reference encoder as `1.0`).

Ids, not text: the renderer emits the markers as special ids and tokenizes every text run between two of them with
`encode_plain`, so text a user, a tool or the model wrote never becomes a control token. That is what K3's own
renderer does under vLLM (`apply_chat_template(tokenize=True)`); llama.cpp tokenizes the rendered string with
special-token parsing, which differs only when message text contains a special-token string. Images (a user
message's `parts`) become `<|media_begin|>image WxH<|media_content|>` + `<|media_pad|>`×tokens + `<|media_end|>`,
as vLLM expands K3's `<|kimi_image_placeholder|>` (W×H the uploaded size): the vision path's image run is
⟨media_content⟩ ⟨media_pad⟩×n ⟨media_end⟩ (VisionConfig image_start / image / image_end token ids).

Prefix stability: turn N+1's prompt starts with turn N's prompt and output when the model's output is what the
template writes back (reasoning and content verbatim, `trim_whitespace` off; non-string argument values in
`json.dumps` form, as K3 writes them) and three things stay put between the turns, as the template dictates:
the thinking effort (its system message comes before the conversation: a new tier recomputes everything), thinking
on or off (it decides whether history keeps its think sections), and tool_choice / response_format (their system
messages come after the conversation and are not part of the next turn's history).

Parsing (the output after the generation prompt; the first stop id ends it):

    [reasoning ⟨close⟩think⟨sep⟩] [⟨open⟩response⟨sep⟩] content [⟨close⟩response⟨sep⟩]
    [⟨open⟩tools⟨sep⟩ call* ⟨close⟩tools⟨sep⟩] ⟨close⟩message⟨sep⟩ ⟨eom⟩

- reasoning runs to `⟨close⟩think⟨sep⟩` or, when the model skips that closer, to `⟨open⟩response⟨sep⟩` (as
  llama.cpp); unfinished reasoning (a budget or max_tokens cut) is reasoning, `finished_thinking` False;
- content runs to `⟨close⟩response⟨sep⟩`, `⟨open⟩tools⟨sep⟩` or `⟨close⟩message⟨sep⟩`; the response opener is
  optional. Other markup in reasoning or content (stray tags, lone markers, other special tokens) stays there as
  its text, and so does text after the response outside any section (whitespace there is dropped); anything after
  `⟨close⟩message⟨sep⟩` is not part of the message;
- a tools section is taken whole or not at all, the way the other formats treat tool-call markup: when it is
  well formed (calls with a `tool` attribute, each holding `argument` tags with a `key` attribute or a `json`
  block holding a JSON object, whitespace between them) its calls become `tool_calls`; at the first item that
  does not fit, the section so far goes to the content as text and parsing goes on from that item as content.
  A section cut short by the end of the output keeps its calls when it was between calls, else is content;
- argument values are typed by the declared tool schema when `tools` declares the tool and the property has one
  JSON type (string: the raw text; any other type: the text as JSON, the raw text when it is not JSON); otherwise
  by the `type="…"` attribute the model wrote (string or missing: raw text; others as JSON, raw on failure).
  So the schema takes precedence, as in llama.cpp (vLLM reads the attribute only); the two agree whenever the
  model's attribute matches the schema, and when they disagree the schema's type is what the client gets, while
  the next turn re-renders the attribute from the value's type. Calls to undeclared tools are returned (vLLM);
  llama.cpp drops them.
- tool-call ids are `chat.tool_call_id` (deterministic per request salt); attribute values are unescaped.

`K3StreamParser` gives the same result piece by piece: reasoning and content text as each token arrives (never half
a character; markup held back only while it could still be a tag), each tools section's calls when the section is
complete. The concatenation of its pieces equals `parse_output` for any split of the tokens; it keeps all state in
the parser object (one per stream), and the format object is read-only.
"""

from __future__ import annotations

from expertmesh.chat.format import ChatMarkers, Message, ParsedOutput, Phase, RenderedPrompt
from expertmesh.chat.k3_grammar import response_grammar, tool_call_grammar
from expertmesh.chat.k3_markup import NOT_IN_ANSWER, K3Vocab, lex
from expertmesh.chat.k3_parse import parse_items, schema_types
from expertmesh.chat.k3_render import RenderOptions, render_pieces, validate
from expertmesh.chat.k3_stream import K3StreamParser


class K3Chat(K3Vocab):
    """Kimi K3's chat format over its TikToken tokenizer (see the module docstring)."""

    supports_thinking = True
    trim_whitespace = False
    states_tool_choice = True  # tool_choice none keeps the tools declared and says so in the prompt

    def __init__(self, tokenizer):
        super().__init__(tokenizer)
        stop = self.stop
        self.markers = ChatMarkers(
            stop=stop,
            end_of_turn=self.eom_id,
            think_start=None,
            think_end=self.close_id,
            think_end_ids=(
                self.close_id,
                *tokenizer.encode_plain("think"),
                self.sep_id,
                self.open_id,
                *tokenizer.encode_plain("response"),
                self.sep_id,
            ),
            not_in_answer=frozenset(self.id_of[t] for t in NOT_IN_ANSWER if t in self.id_of) - set(stop),
        )

    # --- rendering (chat/k3_render.py)
    def render_ids(self, messages: list[Message], **options) -> list[int]:
        """The prompt ids (RenderOptions fields as keywords; `add_generation_prompt` too)."""
        o = RenderOptions(**options)
        validate(messages, o.add_generation_prompt)
        return render_pieces(self, messages, o).ids()

    def render_text(self, messages: list[Message], **options) -> str:
        """The prompt as the template's text (markers as their strings)."""
        o = RenderOptions(**options)
        validate(messages, o.add_generation_prompt)
        return render_pieces(self, messages, o).text_form()

    def render(
        self,
        messages: list[Message],
        *,
        tools: list[dict] | None = None,
        thinking: bool = True,
        thinking_effort: str | None = None,
        tool_choice=None,
        response_format=None,
    ) -> RenderedPrompt:
        """The chat prompt: the generation prompt opens the think section (phase "reasoning") or, with thinking
        off, the response section (phase "content"). `thinking_effort` None renders no thinking-effort message
        (the template's own default, when the variable is not given at all, is "max")."""
        ids = self.render_ids(
            messages,
            tools=tools,
            thinking=thinking,
            thinking_effort=thinking_effort,
            tool_choice=tool_choice,
            response_format=response_format,
        )
        return RenderedPrompt(ids, "reasoning" if thinking else "content")

    # --- parsing (chat/k3_parse.py at once, chat/k3_stream.py incrementally)
    def parse_output(
        self, tokens: list[int], *, phase: Phase, salt: str = "", tools: list[dict] | None = None
    ) -> ParsedOutput:
        """Reasoning, content and tool calls of generated ids (the module docstring's rules)."""
        body = []
        for t in map(int, tokens):
            if t in self.markers.stop:
                break
            if 0 <= t < self.tokenizer.vocab_size:  # a model's padded rows are no tokens (decode drops them)
                body.append(t)
        return parse_items(lex(self, body), len(body), phase, schema_types(tools), salt)

    def stream_parser(self, *, phase: Phase, salt: str = "", tools: list[dict] | None = None) -> K3StreamParser:
        """A parser for one stream (never share one between requests)."""
        return K3StreamParser(self, phase=phase, salt=salt, tools=tools)

    # --- constrained decoding (chat/k3_grammar.py)
    def response_grammar(self, schema: dict | None, *, thinking: bool) -> str:
        return response_grammar(self, schema, thinking=thinking)

    def tool_call_grammar(self, tools: list[dict], *, thinking: bool) -> str:
        return tool_call_grammar(self, tools, thinking=thinking)
