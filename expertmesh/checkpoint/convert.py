"""`expertmesh checkpoint convert`: a Hugging Face directory with float (bf16 / fp32 / FP8) routed experts → the same
directory layout with the experts in MXFP4, so workers load 4.25-bit experts without quantizing at start-up.

The output keeps everything else verbatim (names, dtypes, FP8 scales, the multi-token-prediction layers,
tokenizer and chat-template files); each MoE layer's experts become fused `experts.gate_up_proj_blocks/_scales`
and `experts.down_proj_blocks/_scales` (gate rows first, blocks [E, rows, K/2]: even element in the low nibble,
scales E8M0), which `hf_layout` reads as they are.

Streaming: one output shard per layer, written from the source shard by shard through memory-mapped reads; the
float weights of one expert at a time are resident (the packed layer, 4.25 bits per weight, is what accumulates).
Resumable: a shard is written to `*.partial` and renamed when complete; a rerun skips finished shards.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from safetensors.torch import save_file

from expertmesh.checkpoint.files import INDEX_FILE, CheckpointError
from expertmesh.checkpoint.loader import Checkpoint

_LAYER = re.compile(r"model\.layers\.(\d+)\.")


@dataclass
class ConvertReport:
    out: Path
    shards: int
    skipped: int  # already converted by an earlier run
    bytes_read: int  # source tensor bytes of the shards converted now
    bytes_written: int
    seconds: float

    @property
    def gb_per_s(self) -> float:
        return self.bytes_read / 1e9 / self.seconds if self.seconds > 0 else 0.0


def _shard_name(group: str) -> str:
    return f"model-{group}.safetensors"


def convert_checkpoint(src: str | Path, out: str | Path, *, progress: bool = False) -> ConvertReport:
    """Convert `src` (a kimi_linear / deepseek_v32 directory) into `out`; see the module docstring."""
    src, out = Path(src), Path(out)
    ck = Checkpoint(src)
    if ck.hf is None:
        raise CheckpointError(f"{src}: already an expertmesh checkpoint (experts in MXFP4); nothing to convert")
    if out.resolve() == src.resolve():
        raise CheckpointError(f"--out {out}: must differ from the source directory")
    hf = ck.hf
    out.mkdir(parents=True, exist_ok=True)
    expert_names = {layer: {n for n in hf.files.header if n.startswith(lay.base)} for layer, lay in hf.experts.items()}
    groups: dict[str, list[str]] = {}
    for name in hf.files.header:
        m = _LAYER.match(name)
        groups.setdefault(f"layer-{int(m.group(1)):05d}" if m else "embed", []).append(name)
    todo = sorted(groups)
    skipped = [g for g in todo if (out / _shard_name(g)).exists()]
    iterator = todo
    if progress:
        from tqdm import tqdm

        iterator = tqdm(todo, desc="converting", unit="shard")
    weight_map: dict[str, str] = {}
    bytes_read = bytes_written = 0
    start = time.perf_counter()
    for group in iterator:
        path = out / _shard_name(group)
        layer = int(group.split("-")[1]) if group.startswith("layer-") else None
        experts = expert_names.get(layer, set())
        kept = [n for n in groups[group] if n not in experts]
        names = kept + (
            [f"{hf.experts[layer].base}{p}_{k}" for p in ("gate_up_proj", "down_proj") for k in ("blocks", "scales")]
            if experts
            else []
        )
        weight_map.update({n: path.name for n in names})
        if group in skipped:
            continue
        tensors = {n: hf.files.read(n).contiguous() for n in kept}
        bytes_read += sum(t.numel() * t.element_size() for t in tensors.values())
        if experts:
            packed = hf.expert_weights(layer, list(range(ck.cfg.moe.n_routed_experts)))
            bytes_read += sum(_nbytes(hf.files.header[n]) for n in experts)
            base = hf.experts[layer].base
            for ours, theirs in (("gate_up", "gate_up_proj"), ("down", "down_proj")):
                tensors[f"{base}{theirs}_blocks"] = packed[f"{ours}_blocks"].contiguous()
                tensors[f"{base}{theirs}_scales"] = packed[f"{ours}_scales"].contiguous()
        partial = path.with_suffix(".partial")
        save_file(tensors, str(partial), metadata={"format": "pt"})
        partial.rename(path)
        bytes_written += path.stat().st_size
    seconds = time.perf_counter() - start
    index = {
        "metadata": {"converted_by": "expertmesh checkpoint convert", "experts": "mxfp4"},
        "weight_map": dict(sorted(weight_map.items())),
    }
    (out / INDEX_FILE).write_text(json.dumps(index, indent=1) + "\n")
    for f in src.iterdir():  # config, tokenizer, chat template, generation config, ...
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != INDEX_FILE:
            shutil.copy2(f, out / f.name)
    Checkpoint(out)  # the result validates like any other checkpoint
    return ConvertReport(out, len(todo), len(skipped), bytes_read, bytes_written, seconds)


def _nbytes(info: tuple[str, list[int]]) -> int:
    dtype, shape = info
    size = {"F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1, "U8": 1}.get(dtype, 4)
    n = 1
    for s in shape:
        n *= s
    return n * size
