"""Decoding images away from the HTTP event loop: a bounded pool of spawned processes, each under a memory limit.

What runs in a decoder process is `decode_pixels` (Pillow and numpy only: a spawned child imports this module and
nothing of the router, torch never): the encoded bytes → the pixels the encoder is fed (RGB, resized to the size
the router decided from the header, padded with black) and their digest. The router decides everything a request
pays for before any pixel is decoded (router/images.py reads the header: sides, aspect ratio, pixels, tokens,
context); this module only does the work.

`ImageDecoder` is the pool: at most `workers` decodes at a time, at most `max_pending` waiting (past that a
request is told to retry: 429), each child process limited to `memory_bytes` of data segment beyond what it has
at start (RLIMIT_DATA: a decode that needs more fails with MemoryError, reported as a refused image; the router's
own memory is not touched). A child that dies is replaced. Processes rather than threads: a thread pool keeps the
event loop free too (Pillow releases the GIL while decoding), but its decodes' memory is the router's, bounded only
by workers × the largest image; bench/image_decode.py measures both.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import multiprocessing
import os
import select
import threading
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from expertmesh.runtime.process_limits import data_segment_bytes, limit_data_segment

FORMATS = ("PNG", "JPEG", "WEBP", "GIF")


class DecodeFailed(Exception):
    """A decode the pool could not finish: the image's fault (`message`) or the pool's (busy, memory, a crash)."""

    def __init__(self, message: str, *, busy: bool = False):
        super().__init__(message)
        self.busy = busy


def decode_pixels(
    data: bytes, source: tuple[int, int], resized: tuple[int, int], padded: tuple[int, int]
) -> tuple[bytes, str]:
    """Encoded bytes → (RGB bytes of the padded canvas, row-major [h, w, 3], and their digest). `source`,
    `resized`, `padded`: (width, height) as decided from the header. Raises ValueError for an image that does not
    decode to what its header said."""
    from PIL import Image

    im = Image.open(io.BytesIO(data), formats=list(FORMATS))
    if im.size != tuple(source):
        raise ValueError(f"decodes to {im.size[0]}×{im.size[1]}, not the {source[0]}×{source[1]} of its header")
    im.seek(0)  # GIF / animated WebP: the first frame
    im = im.convert("RGB")
    if im.size != tuple(resized):
        im = im.resize(tuple(resized), Image.Resampling.BICUBIC)
    canvas = Image.new("RGB", tuple(padded))
    canvas.paste(im, (0, 0))
    raw = canvas.tobytes()
    pw, ph = padded
    return raw, hashlib.sha256(raw + f"{ph}x{pw}".encode()).hexdigest()


def _decode_in_child(data, source, resized, padded):
    """decode_pixels in a decoder process: every failure comes back as (None, message)."""
    try:
        return decode_pixels(data, source, resized, padded)
    except MemoryError:
        return None, "needs more memory to decode than the image decoder allows"
    except Exception as e:  # Pillow raises many kinds for a corrupt file
        return None, f"not a decodable image: {type(e).__name__}: {e}"


def _init_decoder(memory_bytes: int, router_pid: int) -> None:
    """Decoder process initializer: cap the data segment at what it holds now plus `memory_bytes`, and end this
    process when the router does."""
    limit_data_segment(memory_bytes)
    threading.Thread(target=_exit_with, args=(router_pid,), daemon=True, name="router-watch").start()


def _exit_with(pid: int) -> None:
    """Exit when process `pid` ends. A decoder would outlive a killed router otherwise: each worker holds the
    writing end of the pool's call queue (so its read never sees EOF) and the forkserver's liveness pipe (so the
    forkserver stays too) — three processes left behind per router."""
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):  # no pidfd (not Linux ≥ 5.3): poll
        fd = None
    if fd is not None:
        select.select([fd], [], [])
    else:
        while True:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            except PermissionError:
                pass
            time.sleep(1.0)
    os._exit(0)


def _forkserver():
    """The forkserver context: decoder processes forked from a clean single-threaded server process (the router
    has threads: forking it is unsafe), which imports only this module (spawn would re-import the main module)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    return ctx


class ImageDecoder:
    """The bounded decoder pool (see the module docstring). `processes=False`: a thread pool instead (the
    comparison bench/image_decode.py makes; also where spawning is not possible)."""

    def __init__(
        self,
        workers: int | None = None,
        *,
        max_pending: int = 64,
        memory_bytes: int = 768 * 2**20,
        processes: bool = True,
    ):
        self.workers = workers or max(1, min(2, os.cpu_count() or 1))
        self.max_pending, self.memory_bytes, self.processes = max_pending, memory_bytes, processes
        self._pool = None
        self._lock = threading.Lock()
        self._pending = 0

    def _executor(self):
        with self._lock:
            if self._pool is None:
                if self.processes:
                    self._pool = ProcessPoolExecutor(
                        self.workers,
                        mp_context=_forkserver(),
                        initializer=_init_decoder,
                        initargs=(self.memory_bytes, os.getpid()),
                    )
                else:
                    self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="image-decode")
            return self._pool

    def _broken(self, pool) -> None:
        with self._lock:
            if self._pool is pool:
                self._pool = None
        pool.shutdown(wait=False, cancel_futures=True)

    def warm(self) -> None:
        """Start the pool's processes now (in the background), not on the first image."""
        pool = self._executor()
        if self.processes:
            for _ in range(self.workers):
                pool.submit(data_segment_bytes)

    async def decode(self, data: bytes, source, resized, padded) -> tuple[bytes, str]:
        """One image's pixels and digest (decode_pixels), decoded in the pool; DecodeFailed when it cannot be."""
        with self._lock:
            if self._pending >= self.max_pending:
                raise DecodeFailed(
                    f"the image decoder is busy ({self.max_pending} images waiting); retry later", busy=True
                )
            self._pending += 1
        try:
            pool = self._executor()
            try:
                raw, result = await asyncio.wrap_future(pool.submit(_decode_in_child, data, source, resized, padded))
            except BrokenProcessPool:
                self._broken(pool)
                raise DecodeFailed("the image decoder process died decoding it (memory limit)") from None
            if raw is None:
                raise DecodeFailed(result)
            return raw, result
        finally:
            with self._lock:
                self._pending -= 1

    def close(self, wait: bool = False) -> None:
        """Stop the pool. `wait`: until its processes have exited, and multiprocessing's forkserver and resource
        tracker too (the router's shutdown: nothing of it stays behind once it has exited)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=wait, cancel_futures=True)
        if wait and self.processes:
            for module, helper in (("forkserver", "_forkserver"), ("resource_tracker", "_resource_tracker")):
                # CPython's own stop methods (its tests use them): close the helper's pipe, reap the process
                stop = getattr(getattr(getattr(multiprocessing, module, None), helper, None), "_stop", None)
                if stop is not None:
                    stop()
