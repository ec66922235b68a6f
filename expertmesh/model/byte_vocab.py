"""The byte vocabulary of synthetic checkpoints (the `tiny` and `small` presets): ids 0..255 are the bytes of the
UTF-8 text, the special tokens follow in this order, and the vocabulary keeps room for more. A fact of the
architecture config (its vocabulary size, the vision tower's image tokens) that the byte tokenizer
(expertmesh/chat/tokenizer.py) reads, so the config needs nothing from the chat room."""

SPECIAL_TOKENS = (
    "<|pad|>",
    "<|bos|>",
    "<|eos|>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|tool|>",
    "<|end|>",
    "<|think|>",
    "<|/think|>",
    "<|tool_call|>",
    "<|/tool_call|>",
    "<|tools|>",
    "<|/tools|>",
    "<|image|>",
    "<|/image|>",
    "<|image_pad|>",  # an image: start, one pad per image token, end
)
N_BYTES = 256
N_SPECIAL_SLOTS = 32  # room for more special tokens without changing the vocabulary size
VOCAB_SIZE = N_BYTES + N_SPECIAL_SLOTS


def special_id(token: str) -> int:
    """The id of one of SPECIAL_TOKENS."""
    return N_BYTES + SPECIAL_TOKENS.index(token)
