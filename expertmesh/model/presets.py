"""The presets as plain data: each builder returns the fields of a ModelConfig (nested configs as dicts), which
`expertmesh.model.config.preset` validates. Data, not config objects, so the config module can read them without
the two importing each other.

Presets: `tiny` (tests), `small` (CPU benchmarks), `full-2.8t` (planning and memory arithmetic only). The tiny and
small presets use the byte vocabulary of synthetic checkpoints (expertmesh/model/byte_vocab.py).
"""

from __future__ import annotations

from expertmesh.model.byte_vocab import VOCAB_SIZE, special_id


def interleaved_layer_types(n_layers: int, n_dsa: int) -> tuple[str, ...]:
    """Spread `n_dsa` DSA layers evenly through `n_layers`, the last layer always DSA (the KDA:DSA ≈ 3:1
    hybrid of Kimi Linear): layer i is DSA when floor((i+1)·n_dsa/n_layers) steps up."""
    types: list[str] = []
    for i in range(n_layers):
        steps_up = (i + 1) * n_dsa // n_layers > i * n_dsa // n_layers
        types.append("dsa" if steps_up else "kda")
    return tuple(types)


def _tiny_vision() -> dict:
    """The tiny and small presets' encoder: kimi_k25's structure (14-px patches, 2×2 merge) at toy width, so every
    image path runs in tests and CPU benchmarks; image tokens are the byte tokenizer's image specials."""
    return dict(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        pos_emb_height=16,
        pos_emb_width=16,
        image_token_id=special_id("<|image_pad|>"),
        image_start_token_id=special_id("<|image|>"),
        image_end_token_id=special_id("<|/image|>"),
        max_patches=4096,
        max_patches_per_side=64,
    )


def _tiny() -> dict:
    """Tests: four layers (KDA, DSA, KDA, DSA; layer 0 dense), 16 experts top-4 in 4 groups so placement and
    replicas matter, DSA top-k 16 (far below test prompt lengths)."""
    return dict(
        name="tiny",
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        layer_types=("kda", "dsa", "kda", "dsa"),
        first_k_dense=1,
        dense_intermediate_size=128,
        moe=dict(
            n_routed_experts=16,
            n_shared_experts=1,
            top_k=4,
            expert_intermediate_size=32,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
        ),
        mla=dict(
            n_heads=4,
            q_lora_rank=32,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            gated_output=True,
        ),
        indexer=dict(n_heads=2, head_dim=16, index_topk=16),
        kda=dict(n_heads=2, head_dim=16, conv_kernel_size=4, gate_low_rank=16),
        max_context=4096,
        init_std=0.08,
        vision=_tiny_vision(),
    )


def _small() -> dict:
    """CPU benchmarks: 8 layers (6 KDA + 2 DSA), hidden 1024, 32 experts top-4 of width 512."""
    return dict(
        name="small",
        vocab_size=VOCAB_SIZE,
        hidden_size=1024,
        layer_types=interleaved_layer_types(8, 2),
        first_k_dense=1,
        dense_intermediate_size=2816,
        moe=dict(
            n_routed_experts=32,
            n_shared_experts=1,
            top_k=4,
            expert_intermediate_size=512,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
        ),
        mla=dict(
            n_heads=8,
            q_lora_rank=384,
            kv_lora_rank=256,
            qk_nope_head_dim=64,
            qk_rope_head_dim=32,
            v_head_dim=64,
            gated_output=True,
        ),
        indexer=dict(n_heads=4, head_dim=64, index_topk=256),
        kda=dict(n_heads=8, head_dim=128, conv_kernel_size=4, gate_low_rank=128),
        max_context=32768,
        vision=_tiny_vision(),
    )


def _full_2_8t() -> dict:
    """Kimi K3 at its published figures with a DSA indexer on its full-attention layers (the model of the brief);
    used for planning and memory arithmetic only.

    Published (Kimi K3, `moonshotai/Kimi-K3`): 93 layers = 69 KDA + 24 full attention, hidden 7168, 896 routed
    experts top-16 on a 3,584-wide latent (latent MoE with its norm), 2 shared experts, SiTU (β 4, β_lin 25),
    attention residuals, ungrouped sigmoid routing with a correction bias, NoPE gated MLA with KV LoRA rank 512 and
    a 64-wide (unrotated) rope slice, KDA 96 heads × 128 with short conv 4, a full-rank output gate and gate lower
    bound −5, vocabulary 163,840, 1,048,576-token context, routed experts in MXFP4; 2.8T total / 104B active.
    The brief: the 24 full-attention layers are gated DSA, top-2,048 over the MLA latent KV.

    Assumed (the public record leaves them open; chosen to reproduce the totals, in Kimi K2's / DeepSeek-V3.2's
    style): expert width 3,072; first layer dense (SiTU width 18,432); full-attention layers spread evenly with the
    last one full (KDA:full ≈ 3:1); MLA 64 heads, q LoRA rank 1,536, nope/v head dims 128/128; attention-residual
    blocks of 6 layers; routed scaling 2.5; the indexer DeepSeek-V3.2's 64 heads × 128 dims (no RoPE: the model is
    NoPE); combine groups of 56 experts (one per expert pod per layer at 16 pods). Its thinking budgets are serving
    policy: expertmesh/chat/thinking.py.
    """
    return dict(
        name="full-2.8t",
        model_type="kimi_k3",
        vocab_size=163_840,
        hidden_size=7168,
        layer_types=interleaved_layer_types(93, 24),
        first_k_dense=1,
        dense_intermediate_size=18_432,
        moe=dict(
            n_routed_experts=896,
            n_shared_experts=2,
            top_k=16,
            expert_intermediate_size=3072,
            n_group=1,
            topk_group=1,
            routed_scaling_factor=2.5,
            combine_group_size=56,
            latent_size=3584,
        ),
        mla=dict(
            n_heads=64,
            q_lora_rank=1536,
            kv_lora_rank=512,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
            rope="none",
            gated_output=True,
        ),
        indexer=dict(n_heads=64, head_dim=128, index_topk=2048, rope=False),
        kda=dict(
            n_heads=96,
            head_dim=128,
            conv_kernel_size=4,
            gate_low_rank=128,
            output_gate="full_rank",
            gate_lower_bound=-5.0,
        ),
        activation=dict(kind="situ", beta=4.0, linear_beta=25.0),
        attn_res_block_size=6,
        max_context=1_048_576,
    )


PRESETS = {"tiny": _tiny, "small": _small, "full-2.8t": _full_2_8t}  # name → builder of its ModelConfig fields
