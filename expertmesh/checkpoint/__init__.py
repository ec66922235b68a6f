"""Checkpoints: the native and Hugging Face layouts, their configs read without torch, conversion and fetching."""
