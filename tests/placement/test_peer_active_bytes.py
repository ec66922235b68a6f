"""bench/_peer_limit.py's weight bytes per decoded token (bench/peer.py's physical limit): a hand count for a tiny
DeepSeek-V3.2 config as each system holds it, and with every expert active the parameter count of the model
transformers builds from that config (so no tensor is missed or counted twice)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("bench_peer_limit", REPO / "bench" / "_peer_limit.py")
limit = sys.modules["bench_peer_limit"] = importlib.util.module_from_spec(_spec)  # its dataclasses look it up
_spec.loader.exec_module(limit)

TINY = dict(
    vocab_size=10,
    hidden_size=8,
    intermediate_size=6,
    moe_intermediate_size=4,
    num_hidden_layers=2,
    first_k_dense_replace=1,
    num_attention_heads=2,
    num_key_value_heads=2,
    q_lora_rank=4,
    kv_lora_rank=4,
    qk_nope_head_dim=2,
    qk_rope_head_dim=2,
    v_head_dim=2,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_shared_experts=1,
    n_group=1,
    topk_group=1,
    index_n_heads=2,
    index_head_dim=4,
    index_topk=4,
    tie_word_embeddings=False,
)

# by hand, in parameters, for TINY (h 8, 2 layers: 1 dense + 1 MoE)
ATTENTION = 2 * (
    (8 * 4 + 4 + 4 * 2 * (2 + 2))  # q_a, q_a norm, q_b
    + (8 * (4 + 2) + 4 + 4 * 2 * (2 + 2))  # kv_a, kv_a norm, kv_b
    + 2 * 2 * 8  # o_proj
)  # 368
INDEXER = 2 * (4 * 2 * 4 + 8 * 4 + 2 * 4)  # wq_b, wk, k_norm weight + bias: 144
INDEX_HEADS = 2 * 8 * 2  # weights_proj: 32
DENSE = 3 * 8 * 6  # 144
SHARED = 3 * 8 * 4  # 96
ROUTER = 4 * 8 + 4  # gate + correction bias: 36
ROUTED = 2 * 3 * 8 * 4  # top-2 of width 4: 192
NORMS = (2 * 2 + 1) * 8  # 40
EMBEDDING_ROW, HEAD = 8, 10 * 8


def test_expertmesh_bf16_reads_mxfp4_experts_and_fp32_routing():
    parts = limit.active_weight_bytes(TINY, limit.expertmesh_holding("bfloat16"))
    assert parts == {
        "attention": 2 * ATTENTION,
        "indexer": 2 * INDEXER + 4 * INDEX_HEADS,
        "dense_mlp": 2 * DENSE,
        "shared_experts": 2 * SHARED,
        "router": 4 * ROUTER,
        "routed_experts": ROUTED * 4.25 / 8,
        "norms": 2 * NORMS,
        "embedding_row": 2 * EMBEDDING_ROW,
        "lm_head": 2 * HEAD,
        "total": 2134.0,
    }


def test_vllm_reads_every_weight_in_the_served_dtype_and_no_indexer():
    bf16 = limit.active_weight_bytes(TINY, limit.vllm_holding("bfloat16"))
    assert bf16["indexer"] == 0 and bf16["routed_experts"] == 2 * ROUTED and bf16["router"] == 2 * ROUTER
    assert bf16["total"] == 2 * (ATTENTION + DENSE + SHARED + ROUTER + ROUTED + NORMS + EMBEDDING_ROW + HEAD) == 1928
    assert limit.active_weight_bytes(TINY, limit.vllm_holding("float32"))["total"] == 2 * 1928


def test_without_q_lora_the_queries_project_from_the_hidden_state():
    cfg = dict(TINY, q_lora_rank=None)
    parts = limit.active_weight_bytes(cfg, limit.Holding(1, 1, 1, True, 1))
    assert parts["attention"] == 2 * (8 * 2 * (2 + 2) + 8 * (4 + 2) + 4 + 4 * 2 * (2 + 2) + 2 * 2 * 8)
    assert parts["indexer"] == 2 * (8 * 2 * 4 + 8 * 4 + 2 * 4) + INDEX_HEADS


def test_the_mxfp4_width_is_expertmeshs():
    from expertmesh.model.config import MXFP4_BITS_PER_WEIGHT

    assert limit.MXFP4_BITS == MXFP4_BITS_PER_WEIGHT


def test_fraction_of_limit():
    assert limit.fraction_of_limit(10.0, 1e9, 20e9) == pytest.approx(0.5)
    assert limit.fraction_of_limit(None, 1e9, 20e9) is None and limit.fraction_of_limit(10.0, 1e9, None) is None


def test_every_expert_active_counts_every_parameter_transformers_builds():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.DeepseekV32ForCausalLM(transformers.DeepseekV32Config(**TINY))
    every = dict(TINY, num_experts_per_tok=TINY["n_routed_experts"])
    counted = limit.active_weight_bytes(every, limit.Holding(1, 1, 1, True, 1))["total"]
    # the embedding: a token reads one row of vocab; the state dict holds the correction bias (a buffer)
    assert counted + (TINY["vocab_size"] - 1) * TINY["hidden_size"] == sum(
        t.numel() for t in model.state_dict().values()
    )
