"""Which chat format a checkpoint speaks (`load_chat`): its own Jinja chat template with its tokenizer.json
(chat_template.py), the built-in format over the byte tokenizer (chat.py) for synthetic checkpoints, or none — a
tokenizer without a template serves completions only (`NoChatTemplate`)."""
from __future__ import annotations

from pathlib import Path

from expertmesh.chat import (
    BuiltinChat,
    ChatError,
    ChatFormat,
    ChatMarkers,
    ParsedOutput,
    Phase,
    RenderedPrompt,
    split_reasoning,
)
from expertmesh.chat_template import load_template_chat
from expertmesh.tokenizer import ByteTokenizer, TokenizerError, load_tokenizer


class NoChatTemplate:
    """A checkpoint with a tokenizer.json but no chat template: completions work, chat requests are refused."""

    supports_thinking = False
    trim_whitespace = False

    def __init__(self, tokenizer, directory: Path):
        self.tokenizer, self.directory = tokenizer, directory
        self.markers = ChatMarkers(stop=tuple(tokenizer.eos_ids), end_of_turn=tokenizer.eos_ids[0])

    def render(self, messages, *, tools=None, thinking=True) -> RenderedPrompt:
        raise ChatError(f"messages: this model has no chat template ({self.directory} has neither "
                        f"chat_template.jinja nor a chat_template in tokenizer_config.json); use /v1/completions")

    def parse_output(self, tokens: list[int], *, phase: Phase, salt: str = "") -> ParsedOutput:
        split = split_reasoning(tokens, self.markers, "content")
        return ParsedOutput("", self.tokenizer.decode(split.content_ids), [], 0, True)


def load_chat(checkpoint_dir: str | Path | None = None, *, model_vocab_size: int | None = None) -> ChatFormat:
    """The chat format of a checkpoint: its tokenizer.json and chat template when it has them, else the built-in
    format over the byte tokenizer. Errors name the file that cannot be used, or a tokenizer with more ids than
    the model's embedding has rows."""
    tokenizer = load_tokenizer(checkpoint_dir)
    if model_vocab_size is not None and tokenizer.vocab_size > model_vocab_size:
        where = f"{checkpoint_dir}/tokenizer.json" if not isinstance(tokenizer, ByteTokenizer) else "byte tokenizer"
        raise TokenizerError(f"{where}: {tokenizer.vocab_size} token ids, but the model's vocab_size is "
                             f"{model_vocab_size}")
    if isinstance(tokenizer, ByteTokenizer):
        return BuiltinChat(tokenizer)
    return load_template_chat(Path(checkpoint_dir), tokenizer) or NoChatTemplate(tokenizer, Path(checkpoint_dir))
