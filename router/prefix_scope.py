"""Whom a request's cached prompt prefixes are shared with.

A prefix-cache hit is visible to its caller — `cached_tokens` in the usage, and a faster first token — so a cache
shared between callers tells one whether another sent the same prompt (a 64-token block at a time: enough to
recover a secret by guessing). The prefix keys are therefore computed within a scope (router/kv.py PrefixHasher):
requests hit only the prefixes of requests with the same scope, in every tier, across the prefill → decode hand-off
and across router replicas (whose keys agree because their salt does).

The scope is made of:
  * the API key the request was let in with (`--prefix-cache-scope key`, the default): each key its own cache.
    With no API key configured there is one tenant, and the key part is empty: everyone shares. `--prefix-cache-scope
    shared` leaves the key out for deployments whose keys trust each other;
  * `cache_salt` (vLLM's request field): a caller's own further scope — requests share cache only with the same
    cache_salt (whatever the deployment's mode);
  * `prompt_cache_key` (OpenAI's): its requests' cache affinity, honoured as a further scope — requests share cache
    only with the same prompt_cache_key.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

SCOPES = ("key", "shared")  # --prefix-cache-scope


@dataclass(frozen=True)
class PrefixScope:
    tenant: str = ""  # the API key the request presented, when keys are configured ("" otherwise)
    cache_salt: str | None = None
    prompt_cache_key: str | None = None

    def digest(self, mode: str = "key") -> bytes:
        """The bytes the prefix keys are scoped with under `mode` (SCOPES); b"" when nothing scopes the request
        (shared by every request that sets nothing either)."""
        if mode not in SCOPES:
            raise ValueError(f"prefix cache scope: expected one of {', '.join(SCOPES)}, found {mode!r}")
        parts = [
            [name, value]
            for name, value in (
                ("key", self.tenant if mode == "key" else ""),
                ("cache_salt", self.cache_salt or ""),
                ("prompt_cache_key", self.prompt_cache_key or ""),
            )
            if value
        ]
        return hashlib.sha256(json.dumps(parts).encode()).digest() if parts else b""
