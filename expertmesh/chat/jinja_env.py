"""transformers' Jinja environment for chat templates (sandboxed, trim_blocks + lstrip_blocks, loop controls,
`{% generation %}`, `raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII, `namespace`, `dict`), the
messages in the shape a template reads, and the sanitizing of control tokens inside user strings
(`apply_chat_template(..., sanitize_control_tokens=True)`)."""

from __future__ import annotations

import json
import re
from datetime import datetime
from functools import lru_cache

from expertmesh.chat.format import ChatError, Message
from expertmesh.chat.hf_tokenizer import CheckpointTokenizer

MARK_START, MARK_END = "\U000f0000", "\U000f0001"  # transformers' private-use marks around sanitized tokens


@lru_cache(maxsize=8)
def compile_template(text: str):
    """The template compiled in transformers' environment (chat templates are untrusted: sandboxed)."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(Extension):
        """`{% generation %}…{% endgeneration %}` marks assistant text for training masks: rendered as is."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    class Namespace(jinja2.utils.Namespace):
        """`namespace(...)` without underscore attributes (no route to Python internals)."""

        def __init__(*args, **kwargs):
            self, attrs = args[0], dict(*args[1:], **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r}: underscore names not allowed")

    class TemplateDict:
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationBlock, loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals.update(
        raise_exception=raise_exception,
        strftime_now=lambda fmt: datetime.now().strftime(fmt),
        dict=TemplateDict(),
        namespace=Namespace,
    )
    return env.from_string(text)


def template_literals(text: str) -> str:
    """The template's literal text and string constants, joined by NUL (what transformers searches for the added
    tokens a template writes itself)."""
    import jinja2.nodes

    ast = compile_template(text).environment.parse(text)
    literals = {n.data for n in ast.find_all(jinja2.nodes.TemplateData)}
    literals |= {n.value for n in ast.find_all(jinja2.nodes.Const) if isinstance(n.value, str)}
    return "\0".join(literals)


def template_variables(text: str) -> frozenset[str]:
    import jinja2.meta

    return frozenset(jinja2.meta.find_undeclared_variables(compile_template(text).environment.parse(text)))


def template_messages(messages: list[Message], *, arguments_as_text: bool = False) -> list[dict]:
    """Messages as a chat template reads them (OpenAI shape, as transformers passes them). Tool-call arguments
    are a dict, or the JSON text for templates that concatenate them as strings (DeepSeek's)."""
    out = []
    for m in messages:
        d: dict = {"role": m.role, "content": m.content}
        if m.tool_calls:
            d["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {
                        "name": c.name,
                        "arguments": c.arguments if arguments_as_text else arguments_value(c.arguments),
                    },
                }
                for c in m.tool_calls
            ]
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        if m.reasoning is not None:
            d = {"thinking": m.reasoning, **d, "reasoning_content": m.reasoning}
        out.append(d)
    return out


def arguments_value(arguments: str):
    """Tool-call arguments as templates expect them: a dict when the JSON text is an object."""
    try:
        value = json.loads(arguments)
    except (ValueError, TypeError):
        return arguments
    return value if isinstance(value, dict) else arguments


def mark_control_tokens(value, pattern: re.Pattern):
    """Wrap control tokens inside user strings in private-use marks (after removing any marks already there, so
    none can be forged); dict keys are left alone, as transformers leaves them."""
    if isinstance(value, str):
        value = value.replace(MARK_START, "").replace(MARK_END, "")
        return pattern.sub(lambda m: MARK_START + m.group(0) + MARK_END, value)
    if isinstance(value, dict):
        return {k: mark_control_tokens(v, pattern) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [mark_control_tokens(v, pattern) for v in value]
    return value


def encode_marked(tok: CheckpointTokenizer, text: str, marks: re.Pattern) -> list[int]:
    """Rendered text → ids: marked control tokens as plain text, everything else (the template's own control tokens
    included) as usual. Each piece after the first is encoded behind a newline that is then dropped, so that a
    SentencePiece tokenizer adds no word-start space mid-text (transformers does the same)."""
    pieces = marks.split(text)
    newline = tok.encode("\n")
    ids = tok.encode(pieces[0])
    for i, piece in enumerate(pieces[1:], start=1):
        if not piece:
            continue
        as_text = i % 2 == 1
        encode = tok.encode_plain if as_text else tok.encode
        piece_ids = encode("\n" + piece)
        piece_ids = piece_ids[len(newline) :] if piece_ids[: len(newline)] == newline else encode(piece)
        if as_text and tok.backend.token_to_id(piece) in piece_ids:
            raise ChatError(f"messages: {piece!r} cannot be sanitized: the tokenizer makes it from plain text")
        ids += piece_ids
    return ids
