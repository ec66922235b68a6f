"""Which chat format a checkpoint speaks (`load_chat`): Kimi K3's XTML format (chat/k3.py) for a K3 checkpoint,
its own Jinja chat template with its tokenizer.json (chat/jinja_template.py), the built-in format over the byte tokenizer
(chat/format.py) for synthetic checkpoints, or none — a tokenizer without a template serves completions only
(`NoChatTemplate`)."""

from __future__ import annotations

import logging
from pathlib import Path

from expertmesh.chat.format import (
    BuiltinChat,
    ChatError,
    ChatFormat,
    ChatMarkers,
    ParsedOutput,
    Phase,
    RenderedPrompt,
    check_render_options,
    split_reasoning,
)
from expertmesh.chat.jinja_template import load_template_chat
from expertmesh.chat.k3 import K3Chat
from expertmesh.chat.k3_markup import XTML_TOKENS
from expertmesh.chat.tiktoken_tokenizer import TikTokenTokenizer
from expertmesh.chat.tokenizer import ByteTokenizer, load_tokenizer
from expertmesh.chat.tokenizer_files import TokenizerError, read_json

log = logging.getLogger("expertmesh.chat.load")


class NoChatTemplate:
    """A checkpoint with a tokenizer.json but no chat template: completions work, chat requests are refused."""

    supports_thinking = False
    trim_whitespace = False

    def __init__(self, tokenizer, directory: Path):
        self.tokenizer, self.directory = tokenizer, directory
        self.markers = ChatMarkers(stop=tuple(tokenizer.eos_ids), end_of_turn=tokenizer.eos_ids[0])

    def render(
        self, messages, *, tools=None, thinking=True, thinking_effort=None, tool_choice=None, response_format=None
    ) -> RenderedPrompt:
        check_render_options(thinking_effort=thinking_effort, tool_choice=tool_choice, response_format=response_format)
        raise ChatError(
            f"messages: this model has no chat template ({self.directory} has neither "
            f"chat_template.jinja nor a chat_template in tokenizer_config.json); use /v1/completions"
        )

    def parse_output(self, tokens: list[int], *, phase: Phase, salt: str = "", tools=None) -> ParsedOutput:
        split = split_reasoning(tokens, self.markers, "content")
        return ParsedOutput("", self.tokenizer.decode(split.content_ids), [], 0, True)


def is_kimi_k3(directory: Path) -> bool:
    """config.json says `model_type: kimi_k3`."""
    path = directory / "config.json"
    return path.exists() and read_json(path).get("model_type") == "kimi_k3"


def load_chat(checkpoint_dir: str | Path | None = None, *, model_vocab_size: int | None = None) -> ChatFormat:
    """The chat format of a checkpoint: Kimi K3's for a `kimi_k3` config.json, or for a tiktoken.model whose
    special tokens include K3's XTML markers; else its chat template over its tokenizer.json; else (another
    tiktoken.model, or a tokenizer.json without a template) completions only; without a tokenizer, the built-in
    format over the byte tokenizer. Errors name the file that cannot be used, or a tokenizer with more ids than
    the model's embedding has rows."""
    directory = Path(checkpoint_dir) if checkpoint_dir is not None else None
    if directory is not None and is_kimi_k3(directory) and not (directory / "tiktoken.model").exists():
        raise TokenizerError(
            f"{directory}: a kimi_k3 checkpoint needs its tiktoken.model (and "
            f"tokenizer_config.json) for K3's chat format"
        )
    tokenizer = load_tokenizer(checkpoint_dir)
    if model_vocab_size is not None and tokenizer.vocab_size > model_vocab_size:
        where = (
            "byte tokenizer"
            if isinstance(tokenizer, ByteTokenizer)
            else f"{checkpoint_dir}/{'tiktoken.model' if isinstance(tokenizer, TikTokenTokenizer) else 'tokenizer.json'}"
        )
        raise TokenizerError(
            f"{where}: {tokenizer.vocab_size} token ids, but the model's vocab_size is {model_vocab_size}"
        )
    if isinstance(tokenizer, ByteTokenizer):
        return BuiltinChat(tokenizer)
    if isinstance(tokenizer, TikTokenTokenizer):
        if is_kimi_k3(directory) or all(t in tokenizer.special_to_id for t in XTML_TOKENS):
            return K3Chat(tokenizer)
        log.warning(
            "%s: a tiktoken.model without Kimi K3's XTML tokens: no chat format for it, completions only", directory
        )
        return NoChatTemplate(tokenizer, directory)
    return load_template_chat(directory, tokenizer) or NoChatTemplate(tokenizer, directory)
