"""The embedded default: the K3+DSA-shaped model trained here on WordNet's English (scripts/train_tiny.py) and
shipped in the repository as a Kimi K3 Hugging Face directory, `models/k3-tiny/`. `expertmesh up` and
`expertmesh generate` serve it when no checkpoint or preset is named; an install without the repository's files
(a wheel) falls back to the synthetic `tiny` preset."""

from __future__ import annotations

from pathlib import Path

EMBEDDED_NAME = "k3-tiny"
EMBEDDED_DIR = Path(__file__).resolve().parents[2] / "models" / EMBEDDED_NAME
FALLBACK_PRESET = "tiny"


def embedded_checkpoint() -> Path | None:
    """The shipped checkpoint's directory, or None when this install does not carry it."""
    return EMBEDDED_DIR if (EMBEDDED_DIR / "config.json").is_file() else None


def default_checkpoint_dir(preset_name: str | None) -> Path:
    """What to serve when no --checkpoint is given: the named preset's synthetic checkpoint, else the embedded
    default, else the synthetic fallback preset (created on first use)."""
    if preset_name is None:
        embedded = embedded_checkpoint()
        if embedded is not None:
            return embedded
        preset_name = FALLBACK_PRESET
    from expertmesh.checkpoint.loader import default_checkpoint  # torch: only to write a synthetic checkpoint

    return default_checkpoint(preset_name)
