"""Published relatives' config.json, inline: tiny sizes of their architectures, as a spec may carry them."""

# DeepSeek-V3.2 (model_type deepseek_v32): DSA layers, the first dense
DEEPSEEK_V32 = {
    "model_type": "deepseek_v32",
    "name": "dsv32",
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "n_routed_experts": 16,
    "num_experts_per_tok": 4,
    "n_group": 4,
    "topk_group": 2,
    "q_lora_rank": 32,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "index_topk": 8,
    "index_head_dim": 16,
    "index_n_heads": 2,
    "first_k_dense_replace": 1,
}
