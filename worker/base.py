"""What both worker roles do first: the model source (a checkpoint, or on --device meta a bare ModelConfig), the
name, the device kind and the decode thread count (worker/threads.py) — one prologue, one set of refusals."""

from __future__ import annotations

from expertmesh.checkpoint.loader import Checkpoint
from expertmesh.model import memory
from expertmesh.model.config import ModelConfig
from expertmesh.worker.threads import DecodeThreads


class WorkerBase:
    """Sets `threads`, `ckpt` (None for a bare config), `cfg`, `name` and `device_kind`. `error`: the role's
    ValueError subclass, what a bad argument raises (the servicers answer it with INVALID_ARGUMENT)."""

    def __init__(
        self,
        checkpoint: Checkpoint | str | ModelConfig,
        *,
        name: str,
        device: str,
        decode_threads: int | None,
        error: type[ValueError],
    ):
        try:
            self.threads = DecodeThreads(decode_threads)
        except ValueError as e:
            raise error(str(e)) from None
        if isinstance(checkpoint, ModelConfig):
            if device != "meta":
                raise error("checkpoint: a model config without weights only builds on --device meta")
            self.ckpt, self.cfg = None, checkpoint
        else:
            self.ckpt = checkpoint if isinstance(checkpoint, Checkpoint) else Checkpoint(checkpoint)
            self.cfg = self.ckpt.cfg
        self.name = name
        self.device_kind = memory.check_device(device)
