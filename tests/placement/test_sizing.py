"""Torch-free sizing (expertmesh/placement/sizing.py): its dense-weight arithmetic equals the built model's tensors
byte for byte, and neither it nor the planner loads torch."""

import math
import subprocess
import sys

import pytest

from expertmesh.model.config import FP32_PARAMETERS, preset
from expertmesh.placement import sizing


def _variants():
    """Every preset, tied and untied, and shapes the presets leave out: full-rank q and plain MLA layers (Kimi Linear),
    a low-rank KDA output gate with biases, experts at the hidden size."""
    for name in ("tiny", "small", "full-2.8t"):
        cfg = preset(name)
        yield pytest.param(cfg, id=name)
        yield pytest.param(
            cfg.model_copy(update={"tie_word_embeddings": not cfg.tie_word_embeddings}), id=f"{name}-tie"
        )
    tiny = preset("tiny")
    kimi_linear = tiny.model_copy(
        update={
            "layer_types": ("kda", "mla", "kda", "mla"),
            "mla": tiny.mla.model_copy(update={"q_lora_rank": None, "gated_output": False}),
            "kda": tiny.kda.model_copy(update={"conv_bias": True, "output_gate_bias": True}),
        }
    )
    yield pytest.param(kimi_linear, id="tiny-kimi-linear")
    full = preset("full-2.8t")
    flat = full.model_copy(
        update={"moe": full.moe.model_copy(update={"latent_size": None}), "attn_res_block_size": None}
    )
    yield pytest.param(flat, id="full-2.8t-no-latent")


def _measured_dense_bytes(cfg, dtype_bytes: int) -> int:
    """The non-expert tensors of the model built on the meta device, FP32_PARAMETERS in fp32 (as the worker holds)."""
    from expertmesh.checkpoint.loader import checkpoint_name, is_routed_expert
    from expertmesh.model.transformer import module_shapes

    return sum(
        math.prod(shape) * (4 if name.endswith(FP32_PARAMETERS) else dtype_bytes)
        for name, shape in module_shapes(cfg).items()
        if not is_routed_expert(checkpoint_name(name))
    )


@pytest.mark.parametrize("cfg", list(_variants()))
def test_dense_weight_bytes_equal_the_built_tensors(cfg):
    for dtype, width in (("bfloat16", 2), ("float32", 4)):
        assert sizing.dense_weight_bytes(cfg, dtype) == _measured_dense_bytes(cfg, width)


def test_dtypes_by_name_width_or_itemsize():
    import torch

    cfg = preset("tiny")
    figures = {sizing.kv_block_bytes(cfg, 16, d) for d in ("bfloat16", 2, torch.bfloat16)}
    assert len(figures) == 1 and sizing.kv_block_bytes(cfg, 16, torch.float32) == 2 * figures.pop()
    with pytest.raises(sizing.DeviceError, match="--dtype"):
        sizing.dense_weight_bytes(cfg, "float16")


def test_cpu_expert_workspace_needs_the_dequantize_cache_bound():
    cfg = preset("tiny")
    with pytest.raises(ValueError, match="dequant_cache_bytes"):
        sizing.expert_workspace_bytes(cfg, "cpu")
    small, large = (sizing.expert_workspace_bytes(cfg, "cpu", dequant_cache_bytes=n) for n in (0, 2**20))
    assert large - small == 2**20
    assert sizing.expert_workspace_bytes(cfg, "cuda") < small  # no cache and no fp32 expert on GPUs


def test_sizing_and_planner_load_no_torch():
    code = (
        "import sys\n"
        "from expertmesh.model.config import preset\n"
        "from expertmesh.placement import sizing\n"
        "from expertmesh.placement.planner import ClusterShape, plan_placement\n"
        "cfg = preset('full-2.8t')\n"
        "plan = plan_placement(cfg, ClusterShape(16, 8, 141 * 2**30), redundant_slots=8)\n"
        "mem = sizing.plan_expert_memory(cfg, plan, 0)\n"
        "assert mem.weights_bytes > 0 and sizing.attention_memory(cfg, kv_blocks=0, block_size=16).weights_bytes > 0\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-P", "-c", code], check=True, timeout=300)
