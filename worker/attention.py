"""The attention role: embeddings, attention, gating, shared experts, dense layers, LM head and sampling — and
the expert exchange: a scheduler step for a batch of sequences is one call, `run_step(segments)`.

A step runs the model's own layer loop (`Transformer.hidden_states`) with the expert exchange as its routed
experts' backend (worker/exchange.ExchangeExperts): at an MoE layer the gate picks the experts and
`ExpertExchange` sends the (token, expert) pairs straight to the expert workers that hold them (one call per
expert worker, concurrently) while the shared experts compute here, and folds their pre-reduced answers into
the routed sum in the canonical order (kernels/moe/combine.py). After the last layer: logits, sampling, log-probs → StepDone. The router only plans steps and reads sampled tokens; it is
never in the per-layer path. Attention, conv and recurrent state are per sequence; everything else works row
by row, so a sequence's numbers do not depend on the batch it is in.
"""

from __future__ import annotations

import logging
import threading
import time

import torch

from expertmesh.chat.grammar import ll_tokenizer
from expertmesh.chat.tokenizer import load_tokenizer
from expertmesh.checkpoint.loader import Checkpoint
from expertmesh.kernels import cpu_warmup
from expertmesh.model import memory
from expertmesh.model.cache import Segment
from expertmesh.model.config import ModelConfig
from expertmesh.model.sampling import Sampler
from expertmesh.model.transformer import Transformer, materialize_
from expertmesh.model.vision import SequenceImages
from expertmesh.placement import sizing
from expertmesh.placement.planner import placed_layers
from expertmesh.runtime import telemetry
from expertmesh.wire.kv_snapshot import CorruptFile, PrefixSnapshot, SnapshotLayout, layout_identity
from expertmesh.wire.sampling_params import SamplingParams
from expertmesh.wire.worker_api import (
    NotConnected,
    NotFound,
    OutOfBlocks,
    StepDone,
    StepSegment,
    TokenLogprobs,
    WorkerError,
    snapshot_parts,
)
from expertmesh.worker.base import WorkerBase
from expertmesh.worker.exchange import ExchangeExperts, ExpertExchange
from expertmesh.worker.handoff import HandOffs
from expertmesh.worker.kv import BlockPool, PagedDSACache, PagedSequenceKV
from expertmesh.worker.kv_tiers import KVTiers, synchronize, to_host
from expertmesh.worker.sequences import CachedPrefix, SequenceState, token_logprobs
from expertmesh.worker.speculation import Speculation

POOLS = ("mixed", "prefill", "decode")

log = logging.getLogger("expertmesh.worker")


class AttentionWorker(HandOffs, WorkerBase):
    def __init__(
        self,
        checkpoint: Checkpoint | str | ModelConfig,
        *,
        kv_blocks: int | None = 512,
        block_size: int = 16,
        name: str = "attention-0",
        device: str = "cpu",
        dtype=None,
        gpu_memory_utilization: float | None = None,
        device_memory_bytes: int | None = None,
        lease_seconds: float = 30.0,
        kv_host_bytes: int = 0,
        kv_disk_dir: str | None = None,
        kv_disk_bytes: int = 0,
        kv_disk_key: bytes | None = None,
        pool: str = "mixed",
        decode_threads: int | None = None,
        speculative_method: str | None = None,
        speculative_tokens: int = 0,
    ):
        """`device` cpu|cuda|meta (meta: built as on a GPU with no memory; `checkpoint` may then be a ModelConfig,
        nothing is read); `dtype` default follows the device (memory.compute_dtype). With
        `gpu_memory_utilization` the KV pool gets the blocks that fit in that fraction of the device
        (`device_memory_bytes`, default the CUDA device's total) after weights and workspace; else `kv_blocks`.
        `kv_host_bytes` / `kv_disk_bytes` (in `kv_disk_dir`): the lower tiers' bounds for demoted prefixes
        (worker/kv_tiers.py; 0: no such tier, a demoted prefix is dropped); `kv_disk_key`: the secret its files are
        authenticated under (None: a random key of this process). `pool`: prefill | decode | mixed — the
        label its metrics and Info carry (the router decides what runs where; any worker computes anything).
        `decode_threads`: torch threads for a decode step's shared experts, which run while the expert workers
        compute (worker/threads.py: for expert workers on the same cores; None: all). `speculative_method` mtp |
        ngram with `speculative_tokens` K > 0: speculative decoding (worker/speculation.py; mtp loads the
        checkpoint's MTP layer here, refused when it has none)."""
        if pool not in POOLS:
            raise WorkerError(f"--pool: expected one of {', '.join(POOLS)}, found {pool!r}")
        self.pool_role = pool
        super().__init__(checkpoint, name=name, device=device, decode_threads=decode_threads, error=WorkerError)
        self.dtype = memory.compute_dtype(self.device_kind, dtype)
        self.device = memory.torch_device(self.device_kind)
        self.device_label = sizing.device_label(self.device_kind)
        if self.ckpt is None:
            with torch.device("meta"):
                self.model = materialize_(Transformer(self.cfg, routed_experts=False), "meta", self.dtype).eval()
        else:
            self.model = self.ckpt.load_model(experts=False, device=self.device, dtype=self.dtype)
        self.spec = self._speculation(speculative_method, speculative_tokens)
        if gpu_memory_utilization is not None:
            if device_memory_bytes is None:
                if self.device_kind != "cuda":
                    raise WorkerError(
                        "--gpu-memory-utilization: needs --device cuda, or the device's memory "
                        "(--device-memory-gib) on --device meta/cpu"
                    )
                device_memory_bytes = torch.cuda.get_device_properties(self.device).total_memory
            kv_blocks = sizing.kv_blocks_for_memory(
                self.cfg,
                device_bytes=device_memory_bytes,
                utilization=gpu_memory_utilization,
                dtype=self.dtype,
                block_size=block_size,
            )
        self.pool = BlockPool(self.cfg, kv_blocks, block_size, device=self.device, dtype=self.dtype)
        if self.device_kind == "cpu":
            cpu_warmup.load(cpu_warmup.ATTENTION)  # before serving: not on the first request
        self.sequences: dict[str, SequenceState] = {}
        # sequences handed off to this worker, installed without waiting for the step in progress (import_sequence),
        # and those handed off from it, still open: merged into / closed in `sequences` under the step lock
        # (_merge_arrivals: at once when no step runs, else by the merger thread when the step ends)
        self._arrivals: dict[str, SequenceState] = {}
        self._leaving: set[str] = set()
        self._arrivals_lock = threading.Lock()
        self._merge_wanted = threading.Event()  # the merger thread merges once the step in progress ends
        self.prefixes: dict[str, CachedPrefix] = {}  # on the device; lower tiers in self.tiers
        self.device_prefix_hits = 0  # sequences opened from a prefix on the device
        self.prompt_tokens_computed = 0  # prompt tokens this worker's steps computed
        self.handoffs = {"sent": 0, "received": 0}  # sequences moved to / from another attention worker
        self.handoff_bytes = {"sent": 0, "received": 0}
        self.handoff_seconds = 0.0  # sender side: export + transfer + import
        if kv_disk_bytes and kv_disk_dir is None:
            raise WorkerError("--kv-disk-gib: needs --kv-disk-dir")
        self.tiers = KVTiers(
            kv_host_bytes,
            layout_identity(self.cfg.model_dump_json(), self.dtype, block_size),
            kv_disk_dir,
            kv_disk_bytes,
            disk_key=kv_disk_key,
            layout=self._snapshot_layout(),
        )
        # what a handed-off cache must come from: the same model and dtype (any block size: it travels as tokens)
        self.handoff_identity = layout_identity(self.cfg.model_dump_json(), self.dtype, 0)
        self.lock = threading.RLock()  # one step at a time touches the model and the pool
        self._lltok_lock = threading.Lock()  # the grammar tokenizer is built once (_grammar_tokenizer)
        self.calls = 0
        self.exchange = None  # worker/exchange.ExpertExchange, set by connect_experts
        # leases: a router renews its own with every call naming it (Info heartbeats once a second); the sequences
        # of an owner silent for `lease_seconds` are closed — a dead router's leftovers never hold KV forever
        self.lease_seconds = lease_seconds
        self.last_seen: dict[str, float] = {}
        self.expired = 0
        if lease_seconds > 0:
            threading.Thread(target=self._sweep, name="lease-sweep", daemon=True).start()
        threading.Thread(target=self._merger, name="handoff-merge", daemon=True).start()

    def _speculation(self, method: str | None, k: int) -> Speculation | None:
        """The worker's speculation (None: off — no method or K = 0), its MTP layer loaded for `mtp`."""
        if not method or not k:
            return None
        if method == "mtp" and self.ckpt is not None:
            if self.ckpt.hf is None or not self.cfg.n_mtp_layers:
                raise WorkerError(
                    f"--speculative-method mtp: the checkpoint {self.ckpt.path} has no MTP layer "
                    f"(num_nextn_predict_layers); use --speculative-method ngram or leave speculation off"
                )
            self.ckpt.hf.load_mtp(self.model, experts=False)  # its routed experts: on the expert workers
        elif method == "mtp":
            raise WorkerError("--speculative-method mtp: needs a checkpoint (its MTP layer)")
        return Speculation(self.model, method, k, experts=lambda: ExchangeExperts(self.exchange, self.threads))

    def memory(self):
        """Resident bytes (sizing.WorkerMemory) measured from the built tensors; workspace from placement/sizing.py."""
        mem = sizing.WorkerMemory()
        weights = sum(p.numel() * p.element_size() for p in self.model.parameters()) + sum(
            b.numel() * b.element_size() for n, b in self.model.named_buffers() if n.endswith(("_blocks", "_scales"))
        )
        kv = sum(
            t.numel() * t.element_size() for t in list(self.pool.latent.values()) + list(self.pool.index_k.values())
        )
        mem.add(
            self.device_label, weights=weights, kv=kv, workspace=sizing.attention_workspace_bytes(self.cfg, self.dtype)
        )
        return mem

    # ------------------------------------------------------------------ info
    def renew(self, owner: str) -> None:
        if owner:
            self.last_seen[owner] = time.monotonic()

    def _sweep(self) -> None:
        while True:
            time.sleep(max(0.05, self.lease_seconds / 4))
            now = time.monotonic()
            with self.lock:
                self._merge_arrivals()
                stale = [
                    s
                    for s, seq in self.sequences.items()
                    if seq.owner and now - self.last_seen.get(seq.owner, 0.0) > self.lease_seconds
                ]
                for seq_id in stale:
                    self.sequences.pop(seq_id).kv.free()
                self.expired += len(stale)

    def info(self, owner: str = "") -> dict:
        self.renew(owner)
        with self._arrivals_lock:
            arriving = len(self._arrivals)
        return {
            "name": self.name,
            "model": self.cfg.name,
            "block_size": self.pool.block_size,
            "total_blocks": self.pool.num_blocks,
            "free_blocks": self.pool.free_blocks,
            "sequences": len(self.sequences) + arriving,
            "prefixes": len(self.prefixes),
            "experts_down": sorted(self.exchange.down) if self.exchange is not None else [],
            "pool": self.pool_role,
            "speculative_tokens": self.spec.k if self.spec is not None else 0,
            "speculative_method": self.spec.method if self.spec is not None else "",
        }

    # ------------------------------------------------------------------ sequences
    def open_sequence(
        self,
        seq_id: str,
        params: SamplingParams,
        *,
        reserve_tokens: int,
        prefix_key: str | None = None,
        owner: str = "",
        images: list | None = None,
    ) -> int:
        """Create a sequence with room for `reserve_tokens` tokens, starting from a cached prefix when given.
        `images` (worker_api.ImageSpan) are encoded when the prefill reaches them. Returns the number of tokens
        already cached (0 without a prefix)."""
        seq_images = self._sequence_images(images) if images else None
        sampler = self._sampler(params)
        with self.lock:
            self.calls += 1
            self._check_new(seq_id, reserve_tokens)
            cache = self.model.new_cache()
            if prefix_key is not None:
                prefix = self.prefixes.get(prefix_key)
                if prefix is None:
                    prefix = self._restore(prefix_key, reserve_tokens)
                else:
                    self.device_prefix_hits += 1
                kv = prefix.kv.fork(prefix.length)
                for layer, (state, conv) in prefix.kda_states.items():
                    cache.layers[layer].state = state.clone()
                    cache.layers[layer].conv = conv.clone()
                cache.length = prefix.length
            else:
                kv = PagedSequenceKV(self.pool)
            try:
                kv.reserve(reserve_tokens - kv.length)
            except OutOfBlocks:
                kv.free()
                raise
            for i in self.cfg.latent_kv_layers:
                cache.layers[i] = PagedDSACache(kv, i)
            self.sequences[seq_id] = SequenceState(
                kv=kv, cache=cache, sampler=sampler, params=params, owner=owner, images=seq_images
            )
            self.sequences[seq_id].spec = self.spec.new_state(sampler) if self.spec is not None else None
            self.renew(owner)
            return cache.length

    def _sampler(self, params: SamplingParams) -> Sampler:
        """The sequence's sampler (its grammar compiled), made before the step lock: a large schema never holds up
        the steps, and bad params (an uncompilable grammar, a tokenizer that cannot serve grammars) fail before any
        block is reserved, as the request's own error — never an internal one the router would retry."""
        try:
            return Sampler(params, self._grammar_tokenizer() if params.grammar is not None else None)
        except WorkerError:
            raise
        except Exception as e:
            raise WorkerError(
                f"params: {e}"
                if isinstance(e, ValueError)
                else f"params: grammar: constrained decoding failed on {self.name}: {type(e).__name__}: {e}"
            ) from None

    def _check_new(self, seq_id: str, reserve_tokens: int) -> None:
        self._merge_arrivals()
        if seq_id in self.sequences:
            raise WorkerError(f"seq_id {seq_id!r}: a sequence with this id is already open")
        if reserve_tokens <= 0 or reserve_tokens > self.cfg.max_context:
            raise WorkerError(f"reserve_tokens={reserve_tokens}: expected 1..{self.cfg.max_context}")

    def _grammar_tokenizer(self):
        """The llguidance view of the checkpoint's tokenizer, built on the first constrained request (it reads
        every token's bytes once) and shared by every sequence's own matcher; built outside the step lock."""
        with self._lltok_lock:
            if getattr(self, "_lltok", None) is None:
                if self.ckpt is None:
                    raise WorkerError("grammar: no checkpoint (hence no tokenizer) on this worker")
                self._lltok = ll_tokenizer(load_tokenizer(self.ckpt.path))
            return self._lltok

    def _sequence_images(self, images: list):
        if self.cfg.vision is None:
            raise WorkerError(f"images: model {self.cfg.name!r} has no vision encoder (text only)")
        try:
            return SequenceImages(images, self.cfg.vision, self.cfg.max_context)
        except ValueError as e:
            raise WorkerError(str(e)) from None

    def extend_sequence(self, seq_id: str, reserve_tokens: int) -> int:
        """Grow the sequence's reservation to `reserve_tokens` tokens (OutOfBlocks when the pool cannot); returns
        the free blocks after."""
        with self.lock:
            self.calls += 1
            seq = self._seq(seq_id)
            if not 0 < reserve_tokens <= self.cfg.max_context:
                raise WorkerError(f"reserve_tokens={reserve_tokens}: expected 1..{self.cfg.max_context}")
            seq.kv.reserve(reserve_tokens - seq.kv.length)
            return self.pool.free_blocks

    def close_sequence(self, seq_id: str) -> int:
        with self.lock:
            self.calls += 1
            self._merge_arrivals()
            seq = self.sequences.pop(seq_id, None)
            if seq is None:
                raise NotFound(f"seq_id {seq_id!r}: no such sequence on {self.name}")
            seq.kv.free()
            return self.pool.free_blocks

    def save_prefix(self, seq_id: str, key: str) -> int:
        """Keep the sequence's current cache (its pages and recurrent state) as prefix `key`."""
        with self.lock:
            seq = self._seq(seq_id)
            self._save_prefix(seq, key)
            return self.pool.free_blocks

    def _save_prefix(self, seq: SequenceState, key: str, length: int | None = None, kda=None) -> None:
        """The sequence's cache (or its first `length` tokens: its pages, and `kda` — the KDA states at that length
        a step held — or none, a model without KDA layers) as prefix `key`."""
        if key in self.prefixes:
            return
        length = seq.cache.length if length is None else length
        kv = seq.kv.fork(length)
        if kda is None:
            kda = {i: (c.state, c.conv) for i, c in enumerate(seq.cache.layers) if self.cfg.layer_types[i] == "kda"}
        states = {i: (state.clone(), conv.clone()) for i, (state, conv) in kda.items()}
        self.prefixes[key] = CachedPrefix(kv=kv, kda_states=states, length=length)
        store = self.tiers.store
        if store is not None and store.accepts_put():  # write-through: put off this thread (worker/kv_store.py)
            store.put_later(key, self._snapshot(self.prefixes[key]))

    def drop_prefix(self, key: str) -> int:
        """Forget prefix `key` in every tier."""
        with self.lock:
            self.calls += 1
            prefix = self.prefixes.pop(key, None)
            if prefix is not None:
                prefix.kv.free()
            self.tiers.discard(key)
            return self.pool.free_blocks

    def demote_prefix(self, key: str) -> tuple[int, list[str]]:
        """Move prefix `key` off the device pool into the lower tiers (dropped where there are none) → (free
        blocks after, keys now dropped for good: `key` itself when no tier holds it, older ones a full tier let
        go). A key held only below the device stays there."""
        with self.lock:
            self.calls += 1
            prefix = self.prefixes.pop(key, None)
            if prefix is None:
                return self.pool.free_blocks, [] if self.tiers.tier_of(key) else [key]
            dropped = self.tiers.put(key, self._snapshot(prefix)) if self.tiers.enabled else [key]
            prefix.kv.free()
            return self.pool.free_blocks, dropped

    def list_prefixes(self) -> list[tuple[str, int, str]]:
        """(key, length, tier) of every cached prefix: device, host, disk (a restarted router's index, or the one
        that marked this worker down, learns them back)."""
        with self.lock:
            return [(k, p.length, "device") for k, p in self.prefixes.items()] + self.tiers.keys()

    def _snapshot(self, prefix: CachedPrefix) -> PrefixSnapshot:
        """A host copy of a device prefix: its pages gathered to [length, D] per layer, its KDA states."""
        latent, index_k = {}, {}
        for layer in self.cfg.latent_kv_layers:
            lat, ik = prefix.kv.read(layer, prefix.length)
            latent[layer] = to_host(lat)
            if ik is not None:
                index_k[layer] = to_host(ik)
        kda = {i: (to_host(state), to_host(conv)) for i, (state, conv) in prefix.kda_states.items()}
        synchronize(self.device)
        return PrefixSnapshot(prefix.length, latent, index_k, kda)

    def _snapshot_layout(self) -> SnapshotLayout:
        """The tensors a prefix of this model holds (what every disk file is checked against before it is read)."""
        dtype = str(self.dtype).removeprefix("torch.")
        rows = {f"latent.{i}": (dtype, self.pool.latent[i].shape[-1]) for i in self.cfg.latent_kv_layers}
        rows |= {f"index_k.{i}": (dtype, t.shape[-1]) for i, t in self.pool.index_k.items()}
        states = {name: ("float32", shape) for name, shape in self._kda_shapes.items()}
        return SnapshotLayout(rows, states, self.cfg.max_context)

    def _restore(self, key: str, reserve_tokens: int) -> CachedPrefix:
        """Copy a prefix held in a lower tier back into device blocks (bit-identical) and cache it there again;
        NotFound when no tier holds it or its file fails a check, OutOfBlocks when the pool cannot hold it and a
        sequence of `reserve_tokens` forked from it (then it stays where it was)."""
        length = self.tiers.length_of(key)
        if length is None:
            raise NotFound(f"prefix_key {key!r}: no such cached prefix on {self.name}")
        bs = self.pool.block_size
        need = -(-max(reserve_tokens, length) // bs) + (1 if length % bs else 0)  # + a partial block's copy
        if self.pool.free_blocks < need:
            raise OutOfBlocks(
                f"KV pool: {self.pool.free_blocks} free blocks, restoring prefix {key!r} for "
                f"{reserve_tokens} tokens needs {need}"
            )
        start = time.perf_counter()  # the time counted and traced includes reading (and checking) a file
        with telemetry.tracer().start_as_current_span(
            "kv.restore", attributes={"expertmesh.kv.tier": self.tiers.tier_of(key), "expertmesh.kv.tokens": length}
        ) as span:
            try:
                snap, tier = self.tiers.load(key)
            except CorruptFile as e:
                log.warning("prefix %s: disk copy not served: %s", key, e)
                raise NotFound(f"prefix_key {key!r}: its disk copy failed a check; not served") from None
            span.set_attribute("expertmesh.kv.bytes", snap.nbytes)
            kv, states = self._load(snap, snap.length)
        self.tiers.restored(key, tier, snap.nbytes, time.perf_counter() - start)
        prefix = self.prefixes[key] = CachedPrefix(kv=kv, kda_states=states, length=snap.length)
        return prefix

    def _merge_arrivals(self) -> None:
        """Move the sequences handed off to this worker into `sequences`, close those handed off from it (the
        caller holds the step lock)."""
        if not self._arrivals and not self._leaving:  # the common case, every step: no lock taken
            return
        with self._arrivals_lock:
            self.sequences.update(self._arrivals)
            self._arrivals.clear()
            leaving, self._leaving = self._leaving, set()
        for seq_id in leaving:
            seq = self.sequences.pop(seq_id, None)
            if seq is not None:
                seq.kv.free()

    def _try_merge(self) -> None:
        """_merge_arrivals now if no step runs, else as soon as the step in progress ends (the merger thread)."""
        if self.lock.acquire(blocking=False):
            try:
                self._merge_arrivals()
            finally:
                self.lock.release()
        else:
            self._merge_wanted.set()

    def _merger(self) -> None:
        while True:
            self._merge_wanted.wait()
            self._merge_wanted.clear()
            with self.lock:
                self._merge_arrivals()

    def _seq(self, seq_id: str) -> SequenceState:
        self._merge_arrivals()
        seq = self.sequences.get(seq_id)
        if seq is None:
            raise NotFound(f"seq_id {seq_id!r}: no such sequence on {self.name}")
        return seq

    # ------------------------------------------------------------------ experts
    def connect_experts(self, clients: list, table, *, probe_interval: float = 1.0) -> None:
        """Dispatch to these expert workers (plan ordinal order; in process: ExpertWorker objects, remote:
        RemoteExpert clients) by `table` (worker/exchange.ReplicaTable). Replaces any earlier connection."""
        moe, layers = self.cfg.moe, placed_layers(self.cfg, mtp=self.spec is not None and self.spec.method == "mtp")
        if list(table.moe_layers) != layers or table.table.shape[1] != moe.n_routed_experts:
            raise WorkerError(
                f"replicas: expected a table for MoE layers {layers} x "
                f"{moe.n_routed_experts} experts, found {list(table.moe_layers)} x {table.table.shape[1]}"
            )
        if table.table.size and int(table.table.max()) >= len(clients):
            raise WorkerError(f"replicas: worker ordinal {int(table.table.max())} but {len(clients)} expert workers")
        exchange = ExpertExchange(
            clients, table, n_experts=moe.n_routed_experts, n_groups=moe.combine_groups, probe_interval=probe_interval
        )
        with self.lock:
            old, self.exchange = self.exchange, exchange
        if old is not None:
            old.close()

    def expert_load(self) -> dict[int, list[int]]:
        """Tokens routed per (MoE layer, expert) by this worker since it started (for rebalancing)."""
        return self.exchange.load_stats() if self.exchange is not None else {}

    # ------------------------------------------------------------------ steps
    @torch.no_grad()
    def run_step(
        self, step_id: int, segments: list[StepSegment], snapshot_keys: dict[str, str | tuple[str, int]] | None = None
    ) -> StepDone:
        """Run one step for `segments` (each a sequence's next tokens): every layer, the expert exchange, then
        sampling. `snapshot_keys[seq_id]` saves that sequence's cache as a prefix after the step: a key (the whole
        cache), or (key, length) for its first `length` tokens — inside the step only where the model has no
        recurrent (KDA) layers, whose state exists at a step's end alone. Sequences whose experts had no live
        replica are reported in `failed` (their caches do not advance); the others go on."""
        with self.lock:
            self.calls += 1
            began = time.perf_counter()
            if self.exchange is None and self.cfg.moe_layers:
                raise NotConnected(f"{self.name}: no expert workers connected yet")
            if not segments:
                raise WorkerError("segments: expected at least one")
            tokens, segs, start = [], [], 0
            seen, with_images = set(), []
            snapshots = {seq_id: snapshot_parts(v) for seq_id, v in (snapshot_keys or {}).items()}
            held = {}  # snapshots at the length a sequence's last step held (hold_at): its state kept then
            for seq_id, (key, length) in list(snapshots.items()):
                seq = self.sequences.get(seq_id)
                states = seq.take_held(length) if seq is not None and length else None
                if states is not None:
                    held[seq_id] = (key, length, states)
                    del snapshots[seq_id]
            for s in segments:
                if s.seq_id in seen:
                    raise WorkerError(f"segments: seq_id {s.seq_id!r} appears twice in one step")
                seen.add(s.seq_id)
                seq = self._seq(s.seq_id)
                if not s.token_ids:
                    raise WorkerError(f"segments[{s.seq_id}].token_ids: expected at least one token")
                bad = [t for t in s.token_ids if not 0 <= t < self.cfg.vocab_size]
                if bad:
                    raise WorkerError(f"segments[{s.seq_id}].token_ids: id {bad[0]} outside [0, {self.cfg.vocab_size})")
                room = len(seq.kv.blocks) * self.pool.block_size - seq.kv.length
                if len(s.token_ids) > room:
                    raise WorkerError(
                        f"segments[{s.seq_id}]: {len(s.token_ids)} more tokens exceed the "
                        f"{len(seq.kv.blocks) * self.pool.block_size} reserved for the sequence"
                    )
                saving = s.seq_id in snapshots
                drafts = self.spec.drafts_for(seq, s.token_ids, s.max_new, room, saving) if self.spec else []
                tokens += s.token_ids + drafts
                segs.append(Segment(start, len(s.token_ids) + len(drafts), seq.cache, verify=bool(drafts)))
                if seq.images is not None:
                    with_images.append((seq, s, start))
                start += segs[-1].length
            fed = {s.seq_id: seg.length for s, seg in zip(segments, segs)}
            for seq_id, (_, length) in snapshots.items():
                if length and seq_id in self.sequences:
                    self._check_snapshot_length(
                        seq_id, self.sequences[seq_id].cache.length + fed.get(seq_id, 0), length
                    )
            bytes_before = self.exchange.bytes_sent + self.exchange.bytes_received if self.exchange else 0
            x = self.model.embed(torch.tensor(tokens, dtype=torch.int64, device=self.device))
            image_encodes = []
            for seq, s, row0 in with_images:
                try:
                    image_encodes += seq.images.splice(self.model, x, s.token_ids, row0, seq.cache.length, s.seq_id)
                except ValueError as e:
                    raise WorkerError(f"segments[{s.seq_id}].{e}") from None
            experts = ExchangeExperts(self.exchange, self.threads)
            x = self.model.hidden_states(x, segs, experts)  # the model's own layer loop, experts over the exchange
            failed = {}
            for seg, s in zip(segs, segments):
                rows = range(seg.start, seg.start + seg.length)
                why = next((experts.failed_rows[r] for r in rows if r in experts.failed_rows), None)
                if why is not None:
                    failed[s.seq_id] = why
            done = self._finish_step(step_id, segs, segments, tokens, x, failed, snapshots)
            for seq_id, (key, length, states) in held.items():
                if seq_id not in failed:
                    self._save_prefix(self.sequences[seq_id], key, length, states)
            done.image_encodes = image_encodes
            if any(seg.verify for seg in segs):
                self.spec.timed(time.perf_counter() - began)
            if self.exchange is not None:
                done.experts_down = sorted(self.exchange.down)
                done.exchange_bytes = self.exchange.bytes_sent + self.exchange.bytes_received - bytes_before
            return done

    def _finish_step(
        self,
        step_id: int,
        segs: list[Segment],
        segments: list[StepSegment],
        tokens: list[int],
        x: torch.Tensor,
        failed: dict[str, str],
        snapshots: dict[str, tuple[str, int]],
    ) -> StepDone:
        """Logits (every row of a segment scoring its prompt, else the last), sampling, log-probs, snapshots."""
        keep = [i for i, s in enumerate(segments) if s.seq_id not in failed]
        seqs = [self.sequences[segments[i].seq_id] for i in keep]
        rows = [
            list(range(segs[i].start, segs[i].start + segs[i].length))
            if seq.params.prompt_logprobs is not None or segs[i].verify
            else [segs[i].start + segs[i].length - 1]
            for i, seq in zip(keep, seqs)
        ]
        flat = [r for rs in rows for r in rs]
        logits = self.model.logits(x[flat]) if flat else None
        out, more, logprobs, first, spec_items = {}, {}, [], 0, []
        for i, seq, rs in zip(keep, seqs, rows):
            seg, seg_in = segs[i], segments[i]
            seg_logits = logits[first : first + len(rs)]
            first += len(rs)
            fed = tokens[seg.start : seg.start + seg.length]
            if seq.generating and not seg.verify:  # past the prompt, every fed token is output (sampled or forced)
                for t in fed:
                    seq.sampler.observe(t)
                seq.observed += fed
            elif not seq.generating:
                self.prompt_tokens_computed += len(fed)
            try:  # a sampler that fails (e.g. parameters it cannot compute with) fails its sequence only
                if seg.verify:  # speculation (worker/speculation.py): the rows accepted, the caches rolled back
                    emitted, entries = self.spec.verify(seg_in.seq_id, seq, fed, seg_logits, seg.cache.length)
                    out[seg_in.seq_id], more[seg_in.seq_id] = emitted[0], emitted[1:]
                    logprobs += entries
                    seg.cache.length += seg.length
                    seq.hold(seg_in.hold_at, seg.cache.length - seg.length + len(emitted))  # before the rollback
                    seg.cache.roll_back(seg.cache.length - seg.length + len(emitted))
                    seq.kv.length = seg.cache.length
                    spec_items.append((seq, fed[: len(emitted)], seg.start, emitted[-1]))
                    continue
                if seg_in.sample:
                    out[seg_in.seq_id] = seq.sampler.sample(seg_logits[-1])
                    seq.generating = True
                logprobs += self._logprobs(
                    seg_in.seq_id, seq, seg.cache.length, fed, seg_logits, out.get(seg_in.seq_id)
                )
            except Exception as e:
                out.pop(seg_in.seq_id, None)
                failed[seg_in.seq_id] = f"sampling failed: {type(e).__name__}: {e}"
                continue
            seg.cache.length += seg.length
            seq.kv.length = seg.cache.length
            seq.hold(seg_in.hold_at, seg.cache.length)
            if seq.spec is not None:
                spec_items.append((seq, fed, seg.start, out.get(seg_in.seq_id)))
        if spec_items:  # feed the drafters what was kept and draft, unless the router speculates for none of the batch
            self.spec.advance(spec_items, x, draft=any(s.max_new > 1 for s in segments))
        for seq_id, (key, length) in snapshots.items():
            if seq_id in self.sequences and seq_id not in failed:
                self._save_prefix(self.sequences[seq_id], key, length or None)
        drafted = {segments[i].seq_id: segs[i].length - 1 for i in keep if segs[i].verify}
        return StepDone(step_id, out, self.pool.free_blocks, logprobs, failed, more_tokens=more, drafted=drafted)

    def _check_snapshot_length(self, seq_id: str, after: int, length: int) -> None:
        """WorkerError naming the field unless a snapshot of `length` tokens fits the sequence, `after` tokens long
        after the step: 0 < length ≤ after, and length = after where the model has recurrent (KDA) layers."""
        if not 0 < length <= after:
            raise WorkerError(
                f"snapshot_keys[{seq_id}].length: expected 1..{after} (the sequence's length after "
                f"the step), found {length}"
            )
        if length < after and self.cfg.n_kda_layers:
            raise WorkerError(
                f"snapshot_keys[{seq_id}].length: {length} is inside the step, but this model's "
                f"recurrent (KDA) state exists at a step's end alone ({after}); give 0"
            )

    @staticmethod
    def _logprobs(
        seq_id: str, seq: SequenceState, start: int, fed: list[int], logits: torch.Tensor, sampled: int | None
    ) -> list[TokenLogprobs]:
        """Entries for a segment of `fed` tokens at positions start.. whose logits rows are `logits` (all rows
        when scoring the prompt, else the last): prompt tokens this segment fed (the first one scored by the
        previous segment's pending row), and the sampled token."""
        p = seq.params
        out = []
        if p.prompt_logprobs is not None:
            lp = torch.log_softmax(logits, dim=-1)  # [L, V]
            scored = lp[:-1] if seq.pending is None else torch.cat([seq.pending[None], lp[:-1]])
            targets = fed[1:] if seq.pending is None else fed
            if targets:
                out.append(token_logprobs(seq_id, start + len(fed) - len(targets), scored, targets, p.prompt_logprobs))
            seq.pending = lp[-1] if sampled is None else None
        if sampled is not None and p.logprobs is not None:
            lp = torch.log_softmax(logits[-1:], dim=-1)
            out.append(token_logprobs(seq_id, start + len(fed), lp, [sampled], p.logprobs))
        return out
