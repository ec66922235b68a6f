"""The small K3+DSA training shape the train tests share: every part of the architecture at the smallest widths
MXFP4 and the kernels take, so a forward, an export and a serving load take well under a second."""

from expertmesh.train.export import Shape

SMALL = Shape(
    hidden=64,
    dense_intermediate=96,
    heads=2,
    kda_head_dim=16,
    experts=8,
    top_k=2,
    expert_intermediate=32,
    latent=32,
    q_lora=32,
    kv_lora=32,
    qk_nope=16,
    qk_rope=8,
    v_head=16,
    index_heads=2,
    index_head_dim=16,
    index_topk=8,
)
