"""Checkpoints: safetensors shards + `config.json`, routed experts in MXFP4 (gpt-oss layout).

Two layouts load through one `Checkpoint`:
  - the native layout below (what `expertmesh checkpoint create` writes);
  - Hugging Face directories of the published relatives (config.json model_type `kimi_linear` or
    `deepseek_v32`), their names, dtypes and expert layouts mapped by `expertmesh.checkpoint.hf_layout`.

Native layout of a checkpoint directory:
  config.json                        the ModelConfig
  model.safetensors.index.json       {"metadata": {...}, "weight_map": {tensor name: shard file}}
  model-embed.safetensors            embed.weight, norm.weight, lm_head.weight
  model-layers-00000-00000.safetensors   one file per group of layers (default: one layer per file), so a
                                     worker opens only the files of the layers its plan gives it

Routed experts of layer L: `layers.L.moe.experts.gate_up.blocks` uint8 [E, 2I, H/2] (two E2M1 codes per byte,
even element in the low nibble), `...gate_up.scales` uint8 [E, 2I, H/32] (E8M0, bias 127), and the same for
`down` ([E, H, I/2], [E, H, I/32]). Every other tensor is under its module path in bf16, except those the
published models keep in fp32 (`model.config.FP32_PARAMETERS`: routing weights and bias, KDA A_log / dt_bias, the DSA
indexer's head weights). A tied LM head is stored once, as `embed.weight`.

The loader checks every name, dtype and shape against the config and names the file, the tensor, what it
expected and what it found.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from pydantic import ValidationError
from safetensors import safe_open
from safetensors.torch import save_file

from expertmesh.checkpoint.config import is_hugging_face, mapped_config_error, native_config, read_raw_config
from expertmesh.checkpoint.files import CONFIG_FILE, INDEX_FILE, CheckpointError, read_header
from expertmesh.checkpoint.hf_layout import HFLayout
from expertmesh.model.config import ModelConfig, preset
from expertmesh.model.moe import RoutedExperts
from expertmesh.model.transformer import Transformer, init_random_, materialize_, module_shapes, stored_dtype

FORMAT = "expertmesh-mxfp4"
DEFAULT_CHECKPOINT_DIR = Path.home() / ".cache" / "expertmesh" / "checkpoints"  # synthetic ones, per preset
FORMAT_VERSION = 2  # 2: published-math modules (indexer k-norm, conv [D, 1, K], fp32 routing tensors)
_EXPERT_BUFFERS = ("gate_up_blocks", "gate_up_scales", "down_blocks", "down_scales")
_DTYPE_NAMES = {
    torch.bfloat16: "BF16",
    torch.uint8: "U8",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.float8_e4m3fn: "F8_E4M3",
}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    layer: int | None  # None: embedding / final norm / head

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=self.dtype).element_size()


def checkpoint_name(module_name: str) -> str:
    """Module state-dict name → checkpoint name (experts' `gate_up_blocks` → `gate_up.blocks`)."""
    for buf in _EXPERT_BUFFERS:
        if module_name.endswith("." + buf):
            proj, kind = buf.rsplit("_", 1)
            return module_name[: -len(buf)] + f"{proj}.{kind}"
    return module_name


def module_name(ckpt_name: str) -> str:
    for buf in _EXPERT_BUFFERS:
        proj, kind = buf.rsplit("_", 1)
        if ckpt_name.endswith(f".{proj}.{kind}"):
            return ckpt_name[: -len(f"{proj}.{kind}")] + buf
    return ckpt_name


def _layer_of(name: str) -> int | None:
    return int(name.split(".")[1]) if name.startswith("layers.") else None


def is_routed_expert(name: str) -> bool:
    return ".moe.experts." in name


def expected_tensors(cfg: ModelConfig) -> dict[str, TensorSpec]:
    """Every tensor a native checkpoint of `cfg` holds, with its stored dtype and shape."""
    specs: dict[str, TensorSpec] = {}
    for name, shape in module_shapes(cfg).items():
        ck = checkpoint_name(name)
        dtype = torch.uint8 if is_routed_expert(ck) else stored_dtype(name)
        specs[ck] = TensorSpec(ck, dtype, shape, _layer_of(ck))
    return specs


def shard_file_of(spec: TensorSpec, layers_per_shard: int) -> str:
    if spec.layer is None:
        return "model-embed.safetensors"
    first = spec.layer // layers_per_shard * layers_per_shard
    return f"model-layers-{first:05d}-{first + layers_per_shard - 1:05d}.safetensors"


# ----------------------------------------------------------------------------------------------- writing
def save_checkpoint(model, out_dir: str | os.PathLike, *, layers_per_shard: int = 1, progress: bool = False) -> Path:
    """Write `model` (a Transformer) as a checkpoint directory; returns its path."""
    cfg: ModelConfig = model.cfg
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    specs = expected_tensors(cfg)
    state = {checkpoint_name(k): v for k, v in model.state_dict().items()}
    by_file: dict[str, dict[str, torch.Tensor]] = {}
    for name, spec in specs.items():
        t = state[name].to(spec.dtype)
        by_file.setdefault(shard_file_of(spec, layers_per_shard), {})[name] = t.contiguous()
    files = sorted(by_file)
    iterator: Iterable[str] = files
    if progress:
        from tqdm import tqdm

        iterator = tqdm(files, desc="writing shards", unit="file")
    for fname in iterator:
        save_file(by_file[fname], str(out / fname), metadata={"format": FORMAT})
    index = {
        "metadata": {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "model": cfg.name,
            "layers_per_shard": layers_per_shard,
            "total_size": sum(s.nbytes for s in specs.values()),
        },
        "weight_map": {name: shard_file_of(spec, layers_per_shard) for name, spec in sorted(specs.items())},
    }
    (out / INDEX_FILE).write_text(json.dumps(index, indent=1) + "\n")
    (out / CONFIG_FILE).write_text(cfg.model_dump_json(indent=1) + "\n")
    return out


def create_checkpoint(
    cfg: ModelConfig, out_dir, *, seed: int = 0, layers_per_shard: int = 1, progress: bool = False
) -> Path:
    """A synthetic checkpoint: seeded random weights, experts quantised to MXFP4."""
    model = init_random_(Transformer(cfg), seed)
    return save_checkpoint(model, out_dir, layers_per_shard=layers_per_shard, progress=progress)


def default_checkpoint(preset_name: str, seed: int = 0) -> Path:
    """The synthetic checkpoint for a preset, created on first use under ~/.cache/expertmesh."""
    path = DEFAULT_CHECKPOINT_DIR / f"{preset_name}-seed{seed}-v{FORMAT_VERSION}"
    if not (path / INDEX_FILE).exists():
        # built beside it and renamed into place: a run that dies half-way (full disk, Ctrl-C) leaves no
        # half-written checkpoint that later runs would trip on; one left by an older version is replaced
        print(f"creating synthetic {preset_name} checkpoint in {path} ...", file=sys.stderr)
        tmp = path.with_name(f"{path.name}.partial-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            create_checkpoint(preset(preset_name), tmp, seed=seed, progress=True)
            shutil.rmtree(path, ignore_errors=True)
            os.replace(tmp, path)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return path


# ----------------------------------------------------------------------------------------------- reading
class Checkpoint:
    """A validated view of a checkpoint directory. Opening it checks the config, the index, every file's
    header and every tensor's name, dtype and shape; tensors are read lazily (memory-mapped)."""

    def __init__(self, path: str | os.PathLike, expect_config: ModelConfig | None = None):
        self.path = Path(path)
        cfg_path = self.path / CONFIG_FILE
        raw = read_raw_config(self.path)
        self.hf = None  # the Hugging Face layout, when the directory is one
        if is_hugging_face(raw):
            try:
                self.hf = HFLayout(self.path, raw)
            except ValidationError as e:
                raise mapped_config_error(self.path, e) from None
            self.cfg = self.hf.cfg
        else:
            self.cfg = native_config(self.path)
        if expect_config is not None and expect_config != self.cfg:
            diff = _config_diff(expect_config.model_dump(), self.cfg.model_dump())
            raise CheckpointError(f"{cfg_path}: config does not match the expected one ({diff})")
        if self.hf is not None:
            return
        index_path = self.path / INDEX_FILE
        if not index_path.exists():
            raise CheckpointError(f"{index_path}: missing")
        try:
            index = json.loads(index_path.read_text())
            self.weight_map: dict[str, str] = dict(index["weight_map"])
            self.metadata = dict(index.get("metadata", {}))
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index_path}: not a valid index ({e!r})") from None
        self.specs = expected_tensors(self.cfg)
        self._validate()

    @property
    def layout(self) -> str:
        """ "expertmesh" (native) or the Hugging Face model_type."""
        return self.cfg.model_type if self.hf is not None else FORMAT

    def _validate(self) -> None:
        missing = sorted(set(self.specs) - set(self.weight_map))
        if missing:
            raise CheckpointError(
                f"{self.path / INDEX_FILE}: tensor {missing[0]!r} missing from the index"
                + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
            )
        unexpected = sorted(set(self.weight_map) - set(self.specs))
        if unexpected:
            raise CheckpointError(
                f"{self.path / INDEX_FILE}: unexpected tensor {unexpected[0]!r} (not part of a {self.cfg.name!r} model)"
            )
        by_file: dict[str, list[str]] = {}
        for name, fname in self.weight_map.items():
            by_file.setdefault(fname, []).append(name)
        for fname, names in sorted(by_file.items()):
            fpath = self.path / fname
            if not fpath.exists():
                raise CheckpointError(f"{fpath}: missing (holds {names[0]!r} and {len(names) - 1} more)")
            header = read_header(fpath)
            for name in sorted(names):
                spec = self.specs[name]
                if name not in header:
                    raise CheckpointError(f"{fpath}: tensor {name!r} missing (the index says it is here)")
                dtype, shape = header[name]
                if dtype != _DTYPE_NAMES[spec.dtype]:
                    raise CheckpointError(
                        f"{fpath}: tensor {name!r} has dtype {dtype}, expected {_DTYPE_NAMES[spec.dtype]}"
                    )
                if tuple(shape) != spec.shape:
                    raise CheckpointError(
                        f"{fpath}: tensor {name!r} has shape {list(shape)}, expected {list(spec.shape)}"
                    )

    # ---------------------------------------------------------------- tensors
    def _open(self, fname: str):
        return safe_open(str(self.path / fname), framework="pt")

    def tensor(self, name: str) -> torch.Tensor:
        if name not in self.weight_map:
            raise KeyError(f"tensor {name!r} not in checkpoint {self.path}")
        with self._open(self.weight_map[name]) as f:
            return f.get_tensor(name)

    def expert_slice(self, name: str, expert_ids: list[int]) -> torch.Tensor:
        """Rows `expert_ids` of an [E, ...] routed-expert tensor, read without loading the other experts."""
        n_experts = self.specs[name].shape[0]
        for e in expert_ids:
            if not 0 <= e < n_experts:
                raise CheckpointError(f"expert {e} out of range for {name!r} ([0, {n_experts}))")
        with self._open(self.weight_map[name]) as f:
            sl = f.get_slice(name)
            parts = [sl[e : e + 1] for e in expert_ids]
        spec = self.specs[name]
        return torch.cat(parts) if parts else torch.empty((0,) + spec.shape[1:], dtype=spec.dtype)

    def iter_dense_tensors(self):
        """(module state-dict name, tensor as stored) of every tensor except the routed experts, one at a time."""
        if self.hf is not None:
            shapes = module_shapes(self.cfg)
            for name in self.hf.names:
                yield name, self.hf.dense(name, shapes[name])
            return
        by_file: dict[str, list[str]] = {}
        for name in self.specs:
            if not is_routed_expert(name):
                by_file.setdefault(self.weight_map[name], []).append(name)
        for fname, names in by_file.items():
            with self._open(fname) as f:
                for name in names:
                    yield module_name(name), f.get_tensor(name)

    def load_dense_state(self, *, float_dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        """Every tensor except the routed experts, as module state-dict names, floats cast to `float_dtype`."""
        return {name: t.to(float_dtype) for name, t in self.iter_dense_tensors()}

    def _expert_buffers(self, layer: int, expert_ids: list[int]) -> dict[str, torch.Tensor]:
        n_experts = self.cfg.moe.n_routed_experts
        for e in expert_ids:
            if not 0 <= e < n_experts:
                raise CheckpointError(f"expert {e} out of range for layer {layer} ([0, {n_experts}))")
        if self.hf is not None:
            return self.hf.expert_weights(layer, expert_ids)
        return {
            buf: self.expert_slice(checkpoint_name(f"layers.{layer}.moe.experts.{buf}"), expert_ids)
            for buf in _EXPERT_BUFFERS
        }

    def load_model(
        self, *, experts: bool = True, dense_attention: bool = False, device="cpu", dtype: torch.dtype = torch.float32
    ):
        """The reference Transformer, on `device` in `dtype` (fp32 by default; `FP32_PARAMETERS` always fp32).

        Built on the meta device and given storage only for what it holds, then filled tensor by tensor from the
        files (one stored tensor in host memory at a time). `experts=False` builds no routed-expert buffers at
        all (attention workers: each MoE layer's `experts` holds zero experts)."""
        with torch.device("meta"):
            model = Transformer(self.cfg, dense_attention=dense_attention, routed_experts=experts)
        materialize_(model, device, dtype)
        every = dict(model.named_parameters(remove_duplicate=False))  # a tied head under both names
        required = set(dict(model.named_parameters()))
        loaded, unexpected = set(), []
        with torch.no_grad():
            for name, t in self.iter_dense_tensors():
                p = every.get(name)
                if p is None or tuple(p.shape) != tuple(t.shape):
                    unexpected.append(name)
                    continue
                p.copy_(t)
                loaded.add(name)
                if self.cfg.tie_word_embeddings and name == "embed.weight":
                    loaded.add("lm_head.weight")
            if experts:
                ids = list(range(self.cfg.moe.n_routed_experts))
                for layer in model.layers:
                    if layer.is_moe:
                        for buf, t in self._expert_buffers(layer.index, ids).items():
                            getattr(layer.moe.experts, buf).copy_(t)
        missing = sorted(required - loaded)
        if missing or unexpected:
            raise CheckpointError(f"{self.path}: state mismatch: missing {missing[:3]}, unexpected {unexpected[:3]}")
        return model.eval()

    def load_experts(self, layer: int, expert_ids: list[int]):
        """A `RoutedExperts` module holding only `expert_ids` of `layer` (an expert worker's shard)."""
        mtp = self.hf is not None and 0 <= layer - self.cfg.n_layers < self.cfg.n_mtp_layers  # an MTP layer's MoE
        if not (self.cfg.is_moe_layer(layer) or mtp):
            raise CheckpointError(f"layer {layer} has no routed experts (MoE layers: {self.cfg.moe_layers})")
        ids = sorted(expert_ids)
        with torch.device("meta"):  # no zero buffers first: the packed tensors are the storage
            mod = RoutedExperts(self.cfg, expert_ids=ids)
        for buf, t in self._expert_buffers(layer, ids).items():
            setattr(mod, buf, t)
        mod.reset_index("cpu")
        return mod

    def stored_tensors(self) -> list[tuple[TensorSpec, str, bool]]:
        """Every tensor in the files as (spec, file name, is a routed expert), whichever the layout."""
        if self.hf is None:
            return [(spec, self.weight_map[n], is_routed_expert(n)) for n, spec in self.specs.items()]
        dtypes = {v: k for k, v in _DTYPE_NAMES.items()}
        out = []
        for name, (dtype, shape) in self.hf.files.header.items():
            m = re.match(r"(?:language_model\.)?model\.layers\.(\d+)\.", name)
            spec = TensorSpec(name, dtypes.get(dtype, torch.uint8), tuple(shape), int(m.group(1)) if m else None)
            out.append((spec, self.hf.files.file_of[name].name, ".experts." in name))
        return out

    def files(self) -> list[Path]:
        if self.hf is not None:
            return list(self.hf.files.files)
        return sorted({self.path / f for f in self.weight_map.values()})


def _config_diff(a: dict, b: dict, prefix: str = "") -> str:
    for key in sorted(set(a) | set(b)):
        va, vb = a.get(key), b.get(key)
        if isinstance(va, dict) and isinstance(vb, dict):
            d = _config_diff(va, vb, f"{prefix}{key}.")
            if d:
                return d
        elif va != vb:
            return f"{prefix}{key}: expected {va!r}, found {vb!r}"
    return ""


# ----------------------------------------------------------------------------------------------- inspect
def inspect_checkpoint(path) -> dict:
    """Figures for `expertmesh checkpoint inspect` (either layout): counts, bytes, bits per expert weight, and a
    per-layer summary."""
    ck = Checkpoint(path)
    stored = ck.stored_tensors()
    tensor_bytes = sum(s.nbytes for s, _, _ in stored)
    file_bytes = sum(p.stat().st_size for p in ck.files())
    n_layers = ck.cfg.n_layers
    # layers past num_hidden_layers (multi-token prediction) are not served: counted apart, so the bits per
    # expert weight are the served experts' own
    extra = [(s, e) for s, _, e in stored if s.layer is not None and s.layer >= n_layers]
    expert_bytes = sum(s.nbytes for s, _, expert in stored if expert) - sum(s.nbytes for s, e in extra if e)
    expert_weights = ck.cfg.routed_expert_params
    layers = []
    for i, kind in enumerate(ck.cfg.layer_types):
        mine = [(s, f, e) for s, f, e in stored if s.layer == i]
        layers.append(
            {
                "layer": i,
                "type": kind,
                "ffn": "moe" if ck.cfg.is_moe_layer(i) else "dense",
                "tensors": len(mine),
                "bytes": sum(s.nbytes for s, _, _ in mine),
                "expert_bytes": sum(s.nbytes for s, _, e in mine if e),
                "file": ", ".join(sorted({f for _, f, _ in mine})),
            }
        )
    return {
        "path": str(ck.path),
        "model": ck.cfg.name,
        "layout": ck.layout,
        "files": len(ck.files()),
        "tensors": len(stored),
        "tensor_bytes": tensor_bytes,
        "file_bytes": file_bytes,
        "file_overhead_bytes": file_bytes - tensor_bytes,
        "expert_weights": expert_weights,
        "expert_bytes": expert_bytes,
        "bits_per_expert_weight": 8 * expert_bytes / expert_weights if expert_weights else 0.0,
        "other_bytes": tensor_bytes - expert_bytes - sum(s.nbytes for s, _ in extra),
        "mtp_layers": sorted({s.layer for s, _ in extra}),
        "mtp_bytes": sum(s.nbytes for s, _ in extra),
        "layers": layers,
    }
