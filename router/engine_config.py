"""The engine's settings, one frozen value built once by each composition root: `expertmesh router` parses it from
its flags (what the operator renders, operator/children.py; `EngineConfig.from_args`), `expertmesh up` checks the
router flags it passes by parsing them the same way before it starts a process, and the in-process deployment
(expertmesh/entry/local.py) builds it from keyword arguments. The Engine reads nothing else at construction."""

from __future__ import annotations

from dataclasses import dataclass, field

from expertmesh.router.prefix_scope import SCOPES
from expertmesh.router.prepared_image import ImageLimits
from expertmesh.router.scheduler import Limits
from expertmesh.router.work_deadline import DEADLINE_CAP

TRANSPORTS = ("grpc", "collective")
STEP_TRANSPORTS = ("tcp", "grpc")  # expertmesh/wire/step_channel.TRANSPORTS
HANDOFF_TRANSPORTS = ("grpc", "collective", "mooncake")
SPECULATIVE_METHODS = ("mtp", "ngram")  # model/speculative.METHODS (the router loads no torch)


def step_deadline(call_timeout: float, expert_workers: int) -> float:
    """A step's deadline over remote workers: it may wait out one expert call's deadline per expert worker (each is
    failed over after its first) and compute."""
    return call_timeout * (expert_workers + 1)


@dataclass(frozen=True)
class EngineConfig:
    # ---- scheduling limits (router/scheduler.py's Limits, with the model's context)
    prefill_chunk: int = 16  # the prefix cache's granularity: prompt chunks end (and prefixes are saved) at multiples
    prefill_tokens: int = 0  # prompt chunks end at its multiples (0: at prefill_chunk's)
    # the attention work one prompt chunk may do, in row·context units (scheduler.chunk_work): None derives it from
    # prefill_tokens (step_prefill_work: unchanged chunks through the prompt's first 2 × prefill_tokens); 0: unbounded
    prefill_work: int | None = None
    max_batch_tokens: int | None = None  # tokens per step (None: 256, or prefill_tokens + max_running if more)
    max_running: int = 64
    max_waiting: int = 256
    max_queue_wait: float = 300.0  # seconds a request may wait for KV room before it is refused (429)
    kv_growth: int = 256  # tokens of KV a sequence reserves ahead (at placement and each time it runs out)
    # ---- speculative decoding: drafts per step the attention workers verify (0: off) and their drafter, which every
    # attention worker must run with the same (--speculative-tokens / --speculative-method; checked at start)
    speculative_tokens: int = 0
    speculative_method: str = ""
    # an attention worker running more sequences than this drafts and verifies nothing (vLLM's
    # speculative_disable_by_batch_size): a large batch is compute-bound, where drafts cost more than they save
    speculative_max_batch: int = 16
    # ---- pools (router/disagg.py): prompts shorter than this skip the prefill pool
    prefill_min_tokens: int = 0
    # ---- transport and timeouts
    transport: str = "grpc"  # attention ↔ expert exchange per MoE layer: grpc | collective (worker/collective.py)
    # prefill → decode hand-offs: "" (as `transport`), grpc, collective or mooncake (the receiver reads the cache
    # with Mooncake's transfer engine, worker/transfer_engine.py; gRPC when an engine is unavailable)
    handoff_transport: str = ""
    # router → attention worker steps: "grpc", or "tcp" (RunStep over a plain TCP connection per worker, gRPC when it
    # cannot form: expertmesh/wire/step_channel.py; not the default: slower end to end in `up` as measured so far)
    step_transport: str = "grpc"
    call_timeout: float = 60.0  # seconds one step's results may take (remote: step_deadline)
    health_interval: float = 1.0  # seconds between heartbeats (and expert probes of the attention workers)
    startup_timeout: float = 120.0  # Engine.start waits this long for a worker still starting
    # ---- the prefix index across router replicas
    prefix_salt: bytes | None = None  # the replicas' shared secret prefix keys are salted with (None: a random one)
    prefix_index_refresh: float = 5.0  # seconds between reads of every worker's prefixes (0: only on take-back)
    prefix_cache_scope: str = "key"  # cached prefixes are each API key's own, or "shared" (prefix_scope.py)
    kv_store: bool = False  # the attention workers share a cluster KV store (worker/kv_store.py, --kv-store): every
    # prefix they save is written through to it, restorable on any of them
    # ---- what the APIs accept
    model_name: str | None = None  # None: the model config's name
    image_limits: ImageLimits = field(default_factory=ImageLimits)

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport: expected grpc or collective, found {self.transport!r}")
        if self.handoff_transport not in ("", *HANDOFF_TRANSPORTS):
            raise ValueError(
                f"handoff_transport: expected one of {', '.join(HANDOFF_TRANSPORTS)}, found {self.handoff_transport!r}"
            )
        if self.step_transport not in STEP_TRANSPORTS:
            raise ValueError(
                f"step_transport: expected one of {', '.join(STEP_TRANSPORTS)}, found {self.step_transport!r}"
            )
        if self.prefill_tokens and self.prefill_tokens % self.prefill_chunk:
            raise ValueError(
                f"prefill_tokens: {self.prefill_tokens} is not a multiple of prefill_chunk {self.prefill_chunk}"
            )
        if self.prefill_work is not None and (not isinstance(self.prefill_work, int) or self.prefill_work < 0):
            raise ValueError(f"prefill_work: expected an integer >= 0 (0: unbounded), found {self.prefill_work!r}")
        if self.prefix_salt is not None and not self.prefix_salt:
            raise ValueError("prefix_salt: empty; expected the router replicas' shared secret")
        if not isinstance(self.speculative_tokens, int) or self.speculative_tokens < 0:
            raise ValueError(f"speculative_tokens: expected an integer >= 0, found {self.speculative_tokens!r}")
        if not isinstance(self.speculative_max_batch, int) or self.speculative_max_batch < 1:
            raise ValueError(f"speculative_max_batch: expected an integer >= 1, found {self.speculative_max_batch!r}")
        if self.speculative_tokens and self.speculative_method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative_method: expected one of {', '.join(SPECULATIVE_METHODS)} with speculative_tokens "
                f"{self.speculative_tokens}, found {self.speculative_method!r}"
            )
        if self.prefix_cache_scope not in SCOPES:
            raise ValueError(
                f"prefix_cache_scope: expected one of {', '.join(SCOPES)}, found {self.prefix_cache_scope!r}"
            )

    @property
    def hand_off_over(self) -> str:
        """The transport hand-offs take (`handoff_transport`, else the exchange's)."""
        return self.handoff_transport or self.transport

    @property
    def step_prefill_tokens(self) -> int:
        """Prompt tokens a sequence may prefill per step (at least one chunk)."""
        return max(self.prefill_tokens, self.prefill_chunk)

    @property
    def step_prefill_work(self) -> int:
        """The attention work a prompt chunk may do (0: unbounded): `prefill_work`, or by default what a full chunk
        of step_prefill_tokens rows does from 1.5 chunks in (2 × step_prefill_tokens²) — a prompt's first two
        chunks keep their rows, the later ones have fewer the further in they start."""
        if self.prefill_work is not None:
            return self.prefill_work
        return 2 * self.step_prefill_tokens**2

    @property
    def step_timeout_cap(self) -> float:
        """The longest a step may take (router/work_deadline.py: a long step's deadline grows with its work up to
        this): the deadline of a remote worker's RunStep call."""
        return DEADLINE_CAP * self.call_timeout

    @property
    def batch_tokens(self) -> int:
        """Tokens per step: a prompt chunk always fits beside every decoding sequence."""
        return max(
            self.max_batch_tokens or max(256, self.step_prefill_tokens + self.max_running), self.step_prefill_tokens
        )

    def limits(self, *, max_context: int, snapshot_within_step: bool) -> Limits:
        """The scheduler's settings; the context and the snapshot rule come from the model config in force."""
        return Limits(
            prefill_chunk=self.prefill_chunk,
            prefill_tokens=self.step_prefill_tokens,
            prefill_work=self.step_prefill_work,
            max_batch_tokens=self.batch_tokens,
            max_running=self.max_running,
            kv_growth=max(1, self.kv_growth),
            max_context=max_context,
            max_queue_wait=self.max_queue_wait,
            snapshot_within_step=snapshot_within_step,
            speculative_tokens=self.speculative_tokens,
            speculative_max_batch=self.speculative_max_batch,
        )

    @classmethod
    def from_args(cls, args, *, prefix_salt: bytes | None = None) -> EngineConfig:
        """The config `expertmesh router`'s flags describe (router/server.py's add_arguments). ValueError naming the
        flag when they disagree. `prefix_salt`: --prefix-salt-file's bytes (read by the caller)."""
        if args.prefill_tokens % args.prefill_chunk:
            raise ValueError(
                f"--prefill-tokens {args.prefill_tokens} is not a multiple of --prefill-chunk {args.prefill_chunk}"
            )
        return cls(
            prefill_chunk=args.prefill_chunk,
            prefill_tokens=args.prefill_tokens,
            prefill_work=args.prefill_work,
            max_batch_tokens=args.max_batch_tokens,
            max_waiting=args.max_waiting,
            max_queue_wait=args.max_queue_wait,
            kv_growth=args.kv_growth,
            speculative_tokens=args.speculative_tokens,
            speculative_method=args.speculative_method or "",
            speculative_max_batch=args.speculative_max_batch,
            prefill_min_tokens=args.prefill_min_tokens,
            transport=args.transport,
            handoff_transport=args.handoff_transport or "",
            step_transport=args.step_transport,
            call_timeout=step_deadline(args.call_timeout, len([e for e in args.experts.split(",") if e])),
            prefix_salt=prefix_salt,
            prefix_index_refresh=args.prefix_index_refresh_s,
            prefix_cache_scope=args.prefix_cache_scope,
            kv_store=args.kv_store is not None,
            image_limits=ImageLimits(
                max_bytes=args.max_image_bytes,
                max_source_pixels=args.max_image_source_pixels,
                max_side=args.max_image_side,
                max_aspect=args.max_image_aspect,
                max_images_per_request=args.max_images_per_request,
                max_pixels_per_request=args.max_image_pixels_per_request,
                fetch_allow=tuple(h.strip().lower() for h in args.image_fetch_allow.split(",") if h.strip()),
                fetch_timeout=args.image_fetch_timeout,
            ),
        )
