"""What the benchmarks share: the JSON results file, and the full-2.8t arithmetic of one sequence's cache."""

from __future__ import annotations

import json
from pathlib import Path

from expertmesh.model.config import preset


def write_json(path: str | None, args, **payload) -> None:
    """{"args": the command line's values, **payload} to `path` (nothing when `path` is empty)."""
    if not path:
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, **payload}, indent=2))
    print(f"wrote {path}")


def sequence_cache_bytes(tokens: int) -> tuple[int, int]:
    """(latent KV + indexer-key bytes in bf16, KDA recurrent + conv state bytes in fp32) of one `tokens`-token
    sequence of the full-2.8t model: what a restore or a hand-off moves."""
    cfg = preset("full-2.8t")
    return tokens * cfg.kv_bytes_per_token_all_layers(2), cfg.recurrent_state_bytes_per_sequence
