"""Torch threads for decode-sized work that overlaps another worker's on the same cores.

While an attention worker waits for a MoE layer's expert calls it computes the layer's shared experts, and the
expert workers compute the routed ones at the same time. Where both processes share the cores (`expertmesh up` on
one machine), each running its full thread count puts twice as many threads as cores on them: both wait for
descheduled OpenMP partners. A worker started with `decode_threads` runs that overlapping work — an expert
worker's calls, an attention worker's shared experts — on that many threads when it has at most `DECODE_ROWS`
token rows (decode steps); larger (prefill) work keeps every thread. Measured with `up` on 2 cores, one sequence
decoding: 1 thread each took the layer's shared experts from 0.83-0.86 to 0.50 ms and its routed ones from
0.90-0.94 to 0.72 ms (no partner to wait for), and the inter-token latency from 42.3-43.8 to 39.1-41.3 ms. In a pod with cores
of its own a worker keeps the default (None: all threads).

Which thread computes which output never changes its bits: every kernel the overlapping work runs (the MXFP4 MoE
kernel, the row-invariant linear, the group partial sums) splits outputs across threads, never a reduction.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

DECODE_ROWS = 16  # token rows up to which work counts as decode-sized


class DecodeThreads:
    """A worker's thread counts: `decode` for decode-sized overlapping work, `full` (the process's count when the
    worker is built) for the rest. `decode` None: nothing is ever changed."""

    def __init__(self, decode: int | None):
        if decode is not None and (isinstance(decode, bool) or not isinstance(decode, int) or decode < 1):
            raise ValueError(f"decode_threads: expected a positive integer or None, found {decode!r}")
        self.decode = decode
        self.full = torch.get_num_threads()

    def count(self, rows: int) -> int:
        """Threads for work of `rows` token rows."""
        return self.decode if self.decode is not None and rows <= DECODE_ROWS else self.full

    @contextmanager
    def rows(self, rows: int):
        """Run the block on `count(rows)` threads, then back on `full`. The count is set for the calling thread
        (OpenMP's omp_set_num_threads; torch also keeps it as the default of threads that start using torch
        meanwhile) and reset to `full` after every use, so a worker thread that picked the decode count up that
        way is back on `full` from its next call on."""
        if self.decode is None:
            yield
            return
        n = self.count(rows)
        if torch.get_num_threads() != n:
            torch.set_num_threads(n)
        try:
            yield
        finally:
            if torch.get_num_threads() != self.full:
                torch.set_num_threads(self.full)
