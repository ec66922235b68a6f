"""Server-kept state of the Responses API: stored responses, bounded in count and bytes, least recently used
first out, expiring after a time to live.

A stored response keeps what a follow-up needs to continue the conversation token-exactly: the conversation as
segments (each message's exact prompt tokens, and each generated turn's exact output tokens, reasoning and
tool-call markup included) and the response object the API returns. Nothing survives a router restart: the
store is process memory, like the KV prefix cache it feeds (a follow-up after a restart gets 404
`previous_response_not_found` and the client resends the history).

Memory: every byte a stored response holds counts against the store's byte bound — its response object and input
items, each segment's text and tokens (kept as 4-byte arrays), and the pixels of the images its conversation holds
(a 12 KB segment held 7.2 MB of pixels outside the bound). Segments and images shared by a chain of responses (a
follow-up keeps its predecessor's segments) count once, for as long as one response holds them.

Callers: a response belongs to the API key that created it (a hash of it, never the key): with a router that
accepts several keys (none configured, keys checked in front of it) another key's response is not found.

Several router replicas: a response id names the replica that holds it (`resp_<replica>_<hex>`). A replica
asked to continue another's response answers 404 `previous_response_not_found` naming the owner, so a load
balancer can route follow-ups by the id's replica part (sticky sessions), which also keeps the KV prefix on the
workers of that replica.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import sys
import threading
import time
import uuid
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field

from expertmesh.chat.format import Message


@dataclass
class Segment:
    """One message of a conversation and its exact tokens (None: rendered from `message` when needed —
    a chat template that cannot be rendered piece by piece)."""

    message: Message
    ids: list[int] | None = None
    item_ids: tuple[str, ...] = ()  # output item ids of a generated assistant turn (rs_…, msg_…, fc_…)

    @property
    def role(self) -> str:
        return self.message.role

    def nbytes(self) -> int:
        """The segment's own bytes: its texts and tokens (its images are counted apart: `held`)."""
        m = self.message
        strings = (
            [m.content, m.reasoning or ""]
            + [s for c in m.tool_calls for s in (c.arguments, c.name, c.id)]
            + [p for p in m.parts or () if isinstance(p, str)]
            + list(self.item_ids)
        )
        ids = self.ids.itemsize * len(self.ids) if isinstance(self.ids, array) else 36 * len(self.ids or ())
        return sum(sys.getsizeof(s) for s in strings) + ids + 200

    def compact(self) -> None:
        """Its tokens as a 4-byte array (a list of ints takes 36 bytes a token)."""
        if self.ids is not None and not isinstance(self.ids, array):
            self.ids = array("i", self.ids)

    def held(self) -> list[tuple[object, int]]:
        """What a stored segment keeps alive, with its bytes: itself and each image's pixels."""
        out: list[tuple[object, int]] = [(self, self.nbytes())]
        for p in self.message.parts or ():
            if not isinstance(p, str):
                pixels = getattr(p, "pixels", None)
                out.append((p, (pixels.nbytes if pixels is not None else 0) + 300))
        return out


@dataclass
class StoredResponse:
    id: str
    response: dict  # the Response object as returned (GET /v1/responses/{id})
    input_items: list[dict]  # the items this request added, with ids (GET …/input_items)
    segments: list[Segment]  # the conversation the model saw, its answer last
    created: float = field(default_factory=time.monotonic)
    nbytes: int = 0  # its own bytes: the response object and input items
    owner: str = ""  # the API key that created it, hashed (owner_of)


def owner_of(api_key: str | None) -> str:
    """Whose a stored response is: a hash of the API key the request presented ("" for none)."""
    return hashlib.sha256(api_key.encode()).hexdigest()[:32] if api_key else ""


class ResponseStore:
    """Thread-safe LRU of stored responses, bounded by count and by bytes, each living at most `ttl` seconds."""

    def __init__(
        self,
        *,
        max_responses: int = 1024,
        max_bytes: int = 256 * 2**20,
        ttl: float = 3600.0,
        replica: str = "r0",
        clock=time.monotonic,
    ):
        if not re.fullmatch(r"[a-z0-9-]{1,24}", replica):
            raise ValueError(f"replica {replica!r}: expected 1-24 lowercase letters, digits or '-'")
        self.max_responses, self.max_bytes, self.ttl, self.replica, self.clock = (
            max_responses,
            max_bytes,
            ttl,
            replica,
            clock,
        )
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self._by_item: dict[str, str] = {}  # output item id → response id
        self._held: dict[int, list] = {}  # id(segment or image) → [responses holding it, bytes, it]
        self.bytes = 0
        self._lock = threading.Lock()

    def new_id(self) -> str:
        return f"resp_{self.replica}_{uuid.uuid4().hex[:24]}"

    @staticmethod
    def replica_of(response_id: str) -> str | None:
        m = re.fullmatch(r"resp_([a-z0-9-]{1,24})_[0-9a-f]{24}", response_id)
        return m.group(1) if m else None

    def put(self, stored: StoredResponse) -> None:
        for s in stored.segments:
            s.compact()
        stored.nbytes = 2 * len(repr(stored.response)) + 2 * len(repr(stored.input_items)) + 500
        stored.created = self.clock()
        with self._lock:
            self._drop(stored.id)
            self._items[stored.id] = stored
            self.bytes += stored.nbytes
            for obj, nbytes in (x for s in stored.segments for x in s.held()):
                entry = self._held.setdefault(id(obj), [0, nbytes, obj])
                if entry[0] == 0:
                    self.bytes += nbytes
                entry[0] += 1
            for s in stored.segments[-1:]:
                for item_id in s.item_ids:
                    self._by_item[item_id] = stored.id
            self._expire()
            while self._items and (len(self._items) > self.max_responses or self.bytes > self.max_bytes):
                self._drop(next(iter(self._items)))

    def get(self, response_id: str, owner: str = "") -> StoredResponse | None:
        """The stored response, when `owner` (owner_of the caller's key) created it; else None."""
        with self._lock:
            self._expire()
            stored = self._items.get(response_id)
            if stored is None or not hmac.compare_digest(stored.owner, owner):
                return None
            self._items.move_to_end(response_id)
            return stored

    def by_output_item(self, item_id: str, owner: str = "") -> StoredResponse | None:
        """The stored response whose answer produced this output item (a client sending the history back)."""
        with self._lock:
            rid = self._by_item.get(item_id)
        return self.get(rid, owner) if rid else None

    def delete(self, response_id: str, owner: str = "") -> bool:
        with self._lock:
            stored = self._items.get(response_id)
            return stored is not None and hmac.compare_digest(stored.owner, owner) and self._drop(response_id)

    def __len__(self) -> int:
        with self._lock:
            self._expire()
            return len(self._items)

    def _drop(self, response_id: str) -> bool:
        stored = self._items.pop(response_id, None)
        if stored is None:
            return False
        self.bytes -= stored.nbytes
        for obj, _ in (x for s in stored.segments for x in s.held()):
            entry = self._held[id(obj)]
            entry[0] -= 1
            if entry[0] == 0:
                self.bytes -= entry[1]
                del self._held[id(obj)]
        for s in stored.segments[-1:]:
            for item_id in s.item_ids:
                if self._by_item.get(item_id) == response_id:
                    del self._by_item[item_id]
        return True

    def _expire(self) -> None:
        now = self.clock()
        for k in [k for k, v in self._items.items() if now - v.created > self.ttl]:
            self._drop(k)


def default_replica() -> str:
    """This router replica's name in response ids: $EXPERTMESH_REPLICA, else $HOSTNAME (the pod name), else r0."""
    raw = os.environ.get("EXPERTMESH_REPLICA") or os.environ.get("HOSTNAME") or "r0"
    name = re.sub(r"[^a-z0-9-]", "-", raw.lower())[-24:].strip("-")
    return name or "r0"


class ReasoningMemory:
    """Reasoning continuity for chat-completions clients that drop it (the Agents SDK over chat completions,
    LangChain): the reasoning and the exact tokens of each answer this router generated, keyed by a hash of what
    clients do send back — the conversation before the answer (without reasoning) and the answer's content and
    tool calls with their ids. An assistant message that matches one and arrives without reasoning gets it back,
    and one whose reasoning is the generated one (given back or sent back) is rendered as the generated tokens,
    so the prompt is token for token the one the model produced. Bounded LRU."""

    def __init__(self, max_entries: int = 4096):
        self.max_entries = max_entries
        self._items: OrderedDict[str, tuple[str, list[int] | None]] = OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def key(before: list[Message], answer: Message) -> str:
        def plain(m: Message) -> list:
            return [m.role, m.content or "", [[c.id, c.name, c.arguments] for c in m.tool_calls], m.tool_call_id]

        return hashlib.sha256(json.dumps([[plain(m) for m in before], plain(answer)]).encode()).hexdigest()

    def remember(self, before: list[Message], answer: Message, ids: list[int] | None = None) -> None:
        """`before`: the conversation the answer was generated for; `ids`: the answer's exact tokens as a history
        renders them (None: a format that renders history from text)."""
        with self._lock:
            k = self.key(before, answer)
            self._items[k] = (answer.reasoning or "", ids)
            self._items.move_to_end(k)
            while len(self._items) > self.max_entries:
                self._items.popitem(last=False)

    def fill(self, messages: list[Message]) -> list[list[int] | None]:
        """Put the reasoning back into assistant messages that match a generated answer and lack it; returns, per
        message, the exact tokens to render it with (None: render its text)."""
        exact: list[list[int] | None] = []
        for i, m in enumerate(messages):
            found = None
            if m.role == "assistant":
                with self._lock:
                    found = self._items.get(self.key(messages[:i], m))
            if found is not None:
                reasoning, ids = found
                if not m.reasoning and reasoning:
                    m.reasoning = reasoning
                if (m.reasoning or "") != reasoning:
                    ids = None  # the client changed the reasoning: render what it sent
            exact.append(found[1] if found is not None and ids is not None else None)
        return exact
