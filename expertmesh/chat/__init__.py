"""Chat: tokenizers, chat formats (built-in, Kimi K3's XTML, Jinja templates), tool-call parsing, grammars and thinking."""
