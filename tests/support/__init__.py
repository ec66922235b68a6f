"""Helpers the tests share: fixtures that write checkpoints and tokenizers, local servers, harnesses."""
