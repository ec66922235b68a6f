"""Malformed checkpoints, table-driven: each is refused with a message naming the file and what is wrong
(the HTTP and gRPC cases: tests/router/test_bad_input.py)."""

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from expertmesh.checkpoint.files import CheckpointError
from expertmesh.checkpoint.loader import Checkpoint


@pytest.fixture(scope="module")
def ckpt_dir(tiny_checkpoint_dir):
    return tiny_checkpoint_dir  # the session's shared tiny checkpoint (tests/conftest.py)


# ----------------------------------------------------------------------------------------------- checkpoints
def _rewrite(path, fn):
    tensors = load_file(str(path))
    fn(tensors)
    save_file(tensors, str(path))


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _header_len(path, n):
    data = path.read_bytes()
    path.write_bytes(n.to_bytes(8, "little") + data[8:])


def _garble_header(path):
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    path.write_bytes(data[:8] + b"{" * n + data[8 + n :])


EMBED, L1, L2, L3 = (
    "model-embed.safetensors",
    "model-layers-00001-00001.safetensors",
    "model-layers-00002-00002.safetensors",
    "model-layers-00003-00003.safetensors",
)
SCALES = "layers.3.moe.experts.down.scales"
CKPT_CASES = [
    pytest.param(lambda d: _truncate(d / EMBED), [EMBED, "truncated"], id="truncated-file"),
    pytest.param(lambda d: (d / EMBED).write_bytes(b""), [EMBED, "truncated (no safetensors header)"], id="empty-file"),
    pytest.param(
        lambda d: _header_len(d / EMBED, 10**12),
        [EMBED, "truncated", "header of 1000000000000 bytes"],
        id="header-length-beyond-file",
    ),
    pytest.param(lambda d: _garble_header(d / EMBED), [EMBED, "corrupt safetensors header"], id="garbage-header"),
    pytest.param(
        lambda d: _rewrite(d / L3, lambda t: t.__setitem__(SCALES, t[SCALES].float())),
        [f"'{SCALES}' has dtype F32, expected U8"],
        id="wrong-dtype",
    ),
    pytest.param(
        lambda d: _rewrite(
            d / L2, lambda t: t.__setitem__("layers.2.attn.q_proj.weight", torch.zeros(8, 8, dtype=torch.bfloat16))
        ),
        ["'layers.2.attn.q_proj.weight' has shape [8, 8], expected [32, 64]"],
        id="wrong-shape",
    ),
    pytest.param(
        lambda d: _rewrite(d / L1, lambda t: t.pop("layers.1.moe.router.weight")),
        [L1, "'layers.1.moe.router.weight' missing"],
        id="missing-tensor",
    ),
    pytest.param(lambda d: (d / L1).unlink(), [L1, "missing"], id="missing-shard"),
    pytest.param(
        lambda d: (d / "config.json").write_text("{not json"), ["config.json", "not valid JSON"], id="config-not-json"
    ),
    pytest.param(lambda d: (d / "config.json").unlink(), ["config.json", "missing"], id="config-missing"),
    pytest.param(
        lambda d: (d / "model.safetensors.index.json").write_text("garbage"),
        ["model.safetensors.index.json", "not a valid index"],
        id="index-not-json",
    ),
    pytest.param(lambda d: shutil.rmtree(d), ["not a checkpoint directory"], id="no-such-directory"),
]


@pytest.mark.parametrize("corrupt, needles", CKPT_CASES)
def test_checkpoint_bad_input(ckpt_dir, tmp_path, corrupt, needles):
    d = tmp_path / "ck"
    shutil.copytree(ckpt_dir, d)
    corrupt(d)
    with pytest.raises(CheckpointError) as e:
        Checkpoint(d)
    missing = [n for n in needles if n not in str(e.value)]
    assert not missing, f"{str(e.value)!r} does not name {missing}"
