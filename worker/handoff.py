"""Hand-offs between attention workers (prefill pool → decode pool): a sequence past its prompt leaves as a host
snapshot of its cache, its sampler's generator state and its output tokens, and opens on the receiver bit for bit
— the next token sampled there is the one the sender would have sampled. `HandOffs` is the part of
AttentionWorker (worker/attention.py) that does it; it reads the worker's pool, sequences and locks."""

from __future__ import annotations

import functools
import threading
import time

import torch

from expertmesh.runtime import telemetry
from expertmesh.wire.kv_snapshot import PrefixSnapshot
from expertmesh.wire.sampling_params import SamplingParams
from expertmesh.wire.worker_api import (
    HandOffFailed,
    HandOffResult,
    NotFound,
    OutOfBlocks,
    WorkerError,
)
from expertmesh.worker.kv import PagedDSACache, PagedSequenceKV
from expertmesh.worker.kv_tiers import synchronize, to_device
from expertmesh.worker.sequences import CachedPrefix, SequenceState
from expertmesh.worker.transfer_engine import TransferLink

_LINK_LOCK = threading.Lock()


class HandOffs:
    def transfer_link(self) -> TransferLink:
        """This worker's Mooncake transfer engine for hand-offs (worker/transfer_engine.py), made on first use: it
        starts only when a hand-off names the "mooncake" transport."""
        with _LINK_LOCK:
            link = getattr(self, "_transfer_link", None)
            if link is None:
                link = self._transfer_link = TransferLink()
            return link

    def export_sequence(self, seq_id: str) -> tuple[SamplingParams, PrefixSnapshot, bytes, list[int]]:
        """A host copy of a sequence past its prompt: (params, its cache as a snapshot — KV [0, length), indexer
        keys, KDA recurrent + conv state —, its sampler's generator state, the output tokens fed so far). The
        sequence stays open here (hand_off closes it once the receiver has it).

        Without the step lock: a sequence being handed off is in no step (the router leaves it out), and its pages
        are copied through a fork of its block table (the full blocks retained under the pool's own lock), so
        nothing frees them under the copy — the hand-off does not wait for the step in progress."""
        self._try_merge()
        with self._arrivals_lock:
            seq = self.sequences.get(seq_id) or self._arrivals.get(seq_id)
        if seq is None:
            raise NotFound(f"seq_id {seq_id!r}: no such sequence on {self.name}")
        if not seq.generating:
            raise WorkerError(
                f"seq_id {seq_id!r}: its prompt is not done (a sequence is handed off after its first sampled token)"
            )
        length = seq.cache.length
        kv = seq.kv.fork(length)
        try:
            kda = {i: (c.state, c.conv) for i, c in enumerate(seq.cache.layers) if self.cfg.layer_types[i] == "kda"}
            snap = self._snapshot(CachedPrefix(kv=kv, kda_states=kda, length=length))
        finally:
            kv.free()
        return seq.params, snap, seq.sampler.generator.get_state().numpy().tobytes(), list(seq.observed)

    def import_sequence(
        self,
        seq_id: str,
        params: SamplingParams,
        snap: PrefixSnapshot,
        sampler_state: bytes,
        observed: list[int],
        *,
        reserve_tokens: int,
        owner: str = "",
        identity: str = "",
    ) -> int:
        """Open `seq_id` from another worker's export_sequence: its cache copied in bit for bit, its sampler
        rebuilt from `params` at the generator state given with `observed` (output tokens already fed) replayed —
        the next token sampled here is the one the sender would have sampled. `identity`: the sender's
        handoff_identity (checked when given). Returns the free blocks after."""
        if identity and identity != self.handoff_identity:
            raise WorkerError(
                f"identity: the cache comes from another model or dtype ({identity!r}, this worker "
                f"takes {self.handoff_identity!r})"
            )
        self._check_snapshot(snap)
        sampler = self._sampler(params)
        try:
            sampler.generator.set_state(torch.frombuffer(bytearray(sampler_state), dtype=torch.uint8))
        except (RuntimeError, ValueError) as e:
            raise WorkerError(f"sampler_state: not a generator state of this build ({e})") from None
        for t in observed:
            sampler.observe(t)
        if not snap.length < reserve_tokens <= self.cfg.max_context:
            raise WorkerError(
                f"reserve_tokens={reserve_tokens}: expected more than the {snap.length} tokens handed "
                f"off (room for the next one), at most {self.cfg.max_context}"
            )
        # no step lock: the blocks taken here are this sequence's alone (the pool's free list has its own lock), so
        # the copy runs beside a step in progress and the sequence is there for the next one
        kv, states = self._load(snap, reserve_tokens)
        cache = self.model.new_cache()
        for layer, (state, conv) in states.items():
            cache.layers[layer].state, cache.layers[layer].conv = state, conv
        for i in self.cfg.latent_kv_layers:
            cache.layers[i] = PagedDSACache(kv, i)
        cache.length = snap.length
        seq = SequenceState(
            kv=kv, cache=cache, sampler=sampler, params=params, generating=True, owner=owner, observed=list(observed)
        )
        # its drafter starts here (worker/speculation.py: an MTP cache from this point on, drafts after the next step)
        seq.spec = self.spec.new_state(sampler) if self.spec is not None else None
        with self._arrivals_lock:
            if seq_id in self.sequences or seq_id in self._arrivals:
                kv.free()
                raise WorkerError(f"seq_id {seq_id!r}: a sequence with this id is already open")
            self._arrivals[seq_id] = seq
        self.calls += 1
        self.renew(owner)
        self.handoffs["received"] += 1
        self.handoff_bytes["received"] += snap.nbytes
        self._try_merge()
        return self.pool.free_blocks

    @functools.cached_property
    def _kda_shapes(self) -> dict[str, tuple[int, ...]]:
        """The shapes a handed-off KDA state must have (read once from a fresh cache)."""
        fresh = self.model.new_cache()
        return {
            f"kda_{part}.{i}": tuple(getattr(c, part).shape)
            for i, c in enumerate(fresh.layers)
            if self.cfg.layer_types[i] == "kda"
            for part in ("state", "conv")
        }

    def _check_snapshot(self, snap: PrefixSnapshot) -> None:
        """WorkerError naming the tensor when a snapshot does not fit this worker's model and KV layout."""
        if not 0 < snap.length < self.cfg.max_context:
            raise WorkerError(f"length={snap.length}: expected 1..{self.cfg.max_context - 1}")
        want = {f"latent.{i}": (snap.length, self.pool.latent[i].shape[-1]) for i in self.cfg.latent_kv_layers}
        want |= {f"index_k.{i}": (snap.length, t.shape[-1]) for i, t in self.pool.index_k.items()}
        want |= self._kda_shapes
        got = dict(snap.named_tensors())
        for name in sorted(set(want) | set(got)):
            if name not in got:
                raise WorkerError(f"tensors: {name} missing")
            if name not in want:
                raise WorkerError(f"tensors: {name} is not a tensor of this model")
            dtype = torch.float32 if name.startswith("kda") else self.dtype
            if tuple(got[name].shape) != want[name] or got[name].dtype != dtype:
                raise WorkerError(
                    f"tensors: {name} expected {str(dtype).removeprefix('torch.')} {list(want[name])}, "
                    f"found {str(got[name].dtype).removeprefix('torch.')} {list(got[name].shape)}"
                )

    def hand_off(
        self, seq_id: str, to, to_seq_id: str, *, reserve_tokens: int, owner: str = "", transport: str = "grpc"
    ) -> HandOffResult:
        """Move sequence `seq_id` to attention worker `to` (an AttentionWorker, or a client of it: RemoteAttention,
        collective.CollectiveAttention) as `to_seq_id`, then close it here. OutOfBlocks: the receiver has no room;
        HandOffFailed: it refused or could not be reached — in both cases the sequence stays open here, unchanged.
        `transport`: what the gRPC servicer picks `to`'s client by; here `to` is called as given."""
        start = time.perf_counter()
        with telemetry.tracer().start_as_current_span(
            "kv.send", attributes={"expertmesh.kv.to": str(getattr(to, "address", getattr(to, "name", "")))}
        ) as span:
            params, snap, state, observed = self.export_sequence(seq_id)
            span.set_attribute("expertmesh.kv.tokens", snap.length)
            span.set_attribute("expertmesh.kv.bytes", snap.nbytes)
            try:
                to.import_sequence(
                    to_seq_id,
                    params,
                    snap,
                    state,
                    observed,
                    reserve_tokens=reserve_tokens,
                    owner=owner,
                    identity=self.handoff_identity,
                )
            except OutOfBlocks:
                raise
            except Exception as e:
                raise HandOffFailed(f"to {getattr(to, 'name', to)}: {type(e).__name__}: {e}") from None
            with self._arrivals_lock:  # closed under the step lock (_merge_arrivals)
                self._leaving.add(seq_id)
        self._try_merge()
        free = self.pool.free_blocks
        seconds = time.perf_counter() - start
        self.handoffs["sent"] += 1
        self.handoff_bytes["sent"] += snap.nbytes
        self.handoff_seconds += seconds
        return HandOffResult(free, snap.nbytes, seconds)

    def _load(self, snap: PrefixSnapshot, reserve_tokens: int) -> tuple[PagedSequenceKV, dict]:
        """A host snapshot into new device blocks reserving `reserve_tokens` (≥ its length; OutOfBlocks when the
        pool cannot, nothing kept) → (block table of `snap.length` tokens, KDA layer → (state, conv) on the device)."""
        kv = PagedSequenceKV(self.pool)
        try:
            kv.reserve(max(reserve_tokens, snap.length))
        except OutOfBlocks:
            kv.free()
            raise
        for layer in self.cfg.latent_kv_layers:
            ik = snap.index_k.get(layer)
            kv.write(
                layer, 0, to_device(snap.latent[layer], self.device), None if ik is None else to_device(ik, self.device)
            )
        kv.length = snap.length
        states = {
            i: (to_device(state, self.device), to_device(conv, self.device)) for i, (state, conv) in snap.kda.items()
        }
        synchronize(self.device)
        return kv, states
