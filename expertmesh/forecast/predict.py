"""Predict a deployment: prefill and decode tokens/s per GPU and per node, TTFT, TPOT, KV capacity in sequences,
and the term that bounds each phase, from a model, a GPU, a layout, dtypes and a workload.

A step is the sum over layers of its blocks' roofline times (expertmesh/forecast/terms.py). Layouts: attention
either tensor-parallel over `tp` GPUs or data-parallel (`dp_attention`: one attention instance per GPU, its weights
replicated); routed experts split `ep` ways (each expert also sliced over tp / ep GPUs when ep < tp). With
`prefill_gpus` / `decode_gpus` the phases run on their own pools (each pool its own EP group unless `ep` is given);
without, on the same GPUs, each request's prefill stalling the decode batch once (chunked prefill), which is how a
single-pool benchmark at a fixed concurrency runs. Two-batch overlap (DeepSeek's and SGLang's large-EP recipes)
hides the all-to-all behind compute when the EP group spans more than one NVLink domain; both micro-batches then
stream the weights.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from expertmesh.forecast import terms
from expertmesh.forecast.gpus import GPU
from expertmesh.forecast.gpus import gpu as gpu_named
from expertmesh.forecast.models import resolve_model
from expertmesh.forecast.terms import StepCost, block
from expertmesh.model.config import ModelConfig
from expertmesh.placement.sizing import attention_workspace_bytes, dense_weight_bytes, expert_slot_bytes

WEIGHT_DTYPES = ("bf16", "fp8", "int4", "mxfp4", "nvfp4")
ATTENTION_DTYPES = ("bf16", "fp8")
# bits per routed-expert weight, scales included (mxfp4 comes from sizing: 4.25)
_EXPERT_BITS = {"bf16": 16, "fp8": 8 + 32 / 128**2, "int4": 4 + 16 / 32, "nvfp4": 4 + 8 / 16}
# the tensor-core dtype experts compute in (fp4 falls back to fp8 on GPUs without FP4; int4 is W4A16)
_EXPERT_COMPUTE = {"bf16": "bf16", "fp8": "fp8", "int4": "bf16", "mxfp4": "fp4", "nvfp4": "fp4"}
# share of HBM the serving engine takes (SGLang's --mem-fraction-static is of this order) — assumed
MEMORY_FRACTION = 0.88
PREFILL_TOKENS_PER_GPU = 16_384  # a prefill pool's batch per GPU per step (SGLang's large-EP recipes' chunk)


@dataclass(frozen=True)
class Layout:
    gpus: int
    tp: int = 1
    ep: int | None = None  # None: the whole pool (wide EP)
    dp_attention: bool = False
    prefill_gpus: int | None = None
    decode_gpus: int | None = None


@dataclass(frozen=True)
class Workload:
    input_len: int
    output_len: int
    concurrency: float | None = None
    batch_per_gpu: float | None = None
    cache_hit: float = 0.0
    accepted_tokens: float = 1.0
    context_len: float | None = None  # decode's mean KV length; None: input + output / 2
    prefill_tokens_per_gpu: int = PREFILL_TOKENS_PER_GPU
    # the busiest EP rank's expert load over the mean (terms.EP_IMBALANCE); 1.0 for a run with routing simulated
    # balanced, as DeepSeek's published profile and LMSYS's "perfect EPLB" runs are
    expert_imbalance: float = terms.EP_IMBALANCE


@dataclass
class PoolShape:
    """One pool's parallelism, resolved and checked."""

    gpus: int
    attn_tp: int
    ep: int
    moe_group: int
    overlap: bool
    imbalance: float = 1.0  # the busiest rank's routed-expert load over the mean (EP > 1)

    @property
    def instances(self) -> int:
        return self.gpus // self.attn_tp


@dataclass
class Prediction:
    model: str
    gpu: str
    assumed: dict
    prefill_tokens_per_s_per_gpu: float
    decode_tokens_per_s_per_gpu: float
    prefill_tokens_per_s_per_node: float
    decode_tokens_per_s_per_node: float
    ttft_s: float
    tpot_ms: float
    kv_capacity_sequences: int
    sequences_per_decode_instance: float
    bound: dict[str, str]
    step_seconds: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def total_tokens_per_s_per_gpu(self) -> float:
        return self.prefill_tokens_per_s_per_gpu + self.decode_tokens_per_s_per_gpu

    def to_dict(self) -> dict:
        out = asdict(self)
        out["total_tokens_per_s_per_gpu"] = self.total_tokens_per_s_per_gpu
        return out


# ---------------------------------------------------------------------------------------------- bytes
def dense_dtype(weights: str) -> str:
    """Non-expert weights: FP8 checkpoints quantise every linear layer, 4-bit ones only the routed experts."""
    return "fp8" if weights == "fp8" else "bf16"


def expert_bytes(cfg: ModelConfig, weights: str) -> float:
    if weights == "mxfp4":
        return expert_slot_bytes(cfg)
    return cfg.expert_params * _EXPERT_BITS[weights] / 8


def weights_per_gpu(cfg: ModelConfig, shape: PoolShape, weights: str) -> float:
    dense = dense_weight_bytes(cfg, 1 if dense_dtype(weights) == "fp8" else 2) / shape.attn_tp
    slots = math.ceil(cfg.moe.n_routed_experts / shape.ep) * cfg.n_moe_layers
    return dense + slots * expert_bytes(cfg, weights) / (shape.moe_group // shape.ep)


def kv_bytes_per_sequence(cfg: ModelConfig, tokens: float, attention: str, attn_tp: int) -> float:
    """One sequence on one GPU of its instance: the latent KV (every TP rank keeps it whole) and its share of the
    KDA state."""
    ab = 1 if attention == "fp8" else 2
    return tokens * cfg.kv_bytes_per_token_all_layers(ab) + cfg.recurrent_state_bytes_per_sequence / attn_tp


# ---------------------------------------------------------------------------------------------- one step
def _attention(cost, cfg, g, kind, *, phase, rows, seqs, ctx, attn_tp, weights, attention, i, share=1.0):
    dd, ab = dense_dtype(weights), (1 if attention == "fp8" else 2)
    params = cfg.attention_params(i)
    block(
        cost,
        g,
        weight_bytes=params * (1 if dd == "fp8" else 2) / attn_tp,
        flops=2 * params * rows / attn_tp,
        dtype=dd,
        kernels=terms.KERNELS[kind] + (terms.KERNELS["attn_res"] if cfg.attn_res_block_size else 0),
        compute_share=share,
    )
    if kind == "kda":
        a = cfg.kda
        state = cfg.recurrent_state_bytes_per_layer  # per layer: counting the KDA layers here cost a third of a search
        per_token = (8 if phase == "prefill" else 4) * a.n_heads * a.head_dim * a.head_dim
        block(
            cost,
            g,
            kv_bytes=2 * seqs * state / attn_tp,
            flops=rows * per_token / attn_tp,
            kernels=1,
            attention=True,
            compute_share=share,
        )
        return
    m, ix = cfg.mla, cfg.indexer
    main = min(ctx, ix.index_topk) if kind == "dsa" else ctx
    heads = m.n_heads / attn_tp
    if phase == "decode":  # absorbed: MQA over the latent (c_kv ‖ k_rope), values from c_kv
        flops = rows * heads * 2 * (2 * m.kv_lora_rank + m.qk_rope_head_dim) * main
    else:  # prefill: MHA over the decompressed keys and values
        flops = rows * heads * 2 * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim) * main
    kv = seqs * main * (m.kv_lora_rank + m.qk_rope_head_dim) * ab
    block(cost, g, kv_bytes=kv, flops=flops, dtype=attention, kernels=1, attention=True, compute_share=share)
    if kind == "dsa":  # the lightning indexer scores every past token (FP8, as DeepSeek-V3.2 runs it)
        block(
            cost,
            g,
            kv_bytes=seqs * ctx * ix.head_dim,
            flops=rows * ix.n_heads / attn_tp * 2 * ix.head_dim * ctx,
            dtype="fp8",
            kernels=1,
            attention=True,
            compute_share=share,
        )


def _ffn(cost, cfg, g, shape, *, rows, weights, moe, compute_share):
    dd = dense_dtype(weights)
    db = 1 if dd == "fp8" else 2
    h, attn_tp = cfg.hidden_size, shape.attn_tp
    if not moe:
        params = 3 * h * cfg.dense_intermediate_size
        block(
            cost,
            g,
            weight_bytes=params * db / attn_tp,
            flops=2 * params * rows / attn_tp,
            dtype=dd,
            kernels=terms.KERNELS["dense_ffn"],
            compute_share=compute_share,
        )
        return
    e = cfg.moe
    shared = e.n_shared_experts * 3 * h * e.expert_intermediate_size + e.n_routed_experts * h
    latent = 2 * h * e.latent_size if e.latent_size else 0
    block(
        cost,
        g,
        weight_bytes=(shared + latent) * db / attn_tp,
        flops=2 * (shared + latent) * rows / attn_tp,
        dtype=dd,
        kernels=terms.KERNELS["moe"] - 4 + (terms.KERNELS["latent"] if latent else 0),
        compute_share=compute_share,
    )
    # routed experts: the group's tokens spread over every expert; a GPU streams the ones it holds that got any
    # (the step waits for the busiest rank: its experts get `imbalance` times the mean's tokens)
    group_tokens = rows * shape.moe_group / attn_tp * shape.imbalance
    touched = math.ceil(e.n_routed_experts / shape.ep) * (1 - (1 - e.top_k / e.n_routed_experts) ** group_tokens)
    block(
        cost,
        g,
        weight_bytes=touched * expert_bytes(cfg, weights) / (shape.moe_group // shape.ep),
        flops=2 * cfg.expert_params * rows * e.top_k / attn_tp * shape.imbalance,
        dtype=_EXPERT_COMPUTE[weights],
        kernels=4,
        compute_share=compute_share,
    )


def _all_to_all(cost, cfg, g, shape, *, phase, rows) -> None:
    """DeepEP-style dispatch (FP8) and combine (BF16) of the rows leaving this GPU."""
    ep = shape.ep
    pairs = rows * cfg.moe.top_k / shape.attn_tp
    width = cfg.expert_hidden_size
    if ep <= g.nvlink_domain:
        bw = g.nvlink_one_way * terms.NVLINK_EFFICIENCY
        seconds = pairs * (1 - 1 / ep) * width * 3 / bw
    else:
        nic = g.network_bytes_per_s / terms.DEEPEP_NIC_BYTES_PER_S
        if phase == "decode":
            sent = pairs * (1 - 1 / ep) * width
            seconds = sent / (terms.interpolate(terms.DEEPEP_LL_DISPATCH, ep) * 1e9 * nic) + 2 * sent / (
                terms.interpolate(terms.DEEPEP_LL_COMBINE, ep) * 1e9 * nic
            )
        else:  # normal kernels send a token once per remote node, then forward over NVLink
            nodes = math.ceil(ep / g.nvlink_domain)
            sent = rows / shape.attn_tp * min(cfg.moe.top_k, nodes) * (1 - 1 / nodes) * width
            seconds = sent / (terms.interpolate(terms.DEEPEP_NORMAL_DISPATCH, ep) * 1e9 * nic) + 2 * sent / (
                terms.interpolate(terms.DEEPEP_NORMAL_COMBINE, ep) * 1e9 * nic
            )
    # the busiest rank receives `imbalance` times the mean, and every rank waits for it at the combine
    seconds = max(seconds * shape.imbalance, 2 * terms.KERNEL_FLOOR_S)
    cost.add("expert all-to-all", seconds)


def _all_reduce(cost, cfg, g, shape, rows) -> None:
    if shape.attn_tp == 1:
        return
    t = shape.attn_tp
    data = rows * cfg.hidden_size * 2
    per = terms.ALLREDUCE_LATENCY_S + 2 * (t - 1) / t * data / (g.nvlink_one_way * terms.NVLINK_EFFICIENCY)
    cost.add("all-reduce", 2 * per)


def _layer(cfg, g, shape, kind, moe, *, phase, rows, seqs, ctx, weights, attention, i) -> StepCost:
    """One layer at `rows` tokens: compute and communication, overlapped over two micro-batches or in series."""
    halves = 2 if shape.overlap and rows >= 2 else 1
    share = 1 - terms.DEEPEP_NORMAL_SM_SHARE if (halves == 2 and phase == "prefill") else 1.0
    compute, comm = StepCost(), StepCost()
    r, s = rows / halves, seqs / halves
    _attention(
        compute,
        cfg,
        g,
        kind,
        phase=phase,
        rows=r,
        seqs=s,
        ctx=ctx,
        attn_tp=shape.attn_tp,
        weights=weights,
        attention=attention,
        i=i,
        share=share,
    )
    _ffn(compute, cfg, g, shape, rows=r, weights=weights, moe=moe, compute_share=share)
    if moe and shape.ep > 1:
        _all_to_all(comm, cfg, g, shape, phase=phase, rows=r)
    _all_reduce(comm, cfg, g, shape, r)
    compute, comm = compute.scaled(halves), comm.scaled(halves)
    both = compute.merged(comm)
    if halves == 2:  # credited to the terms in proportion, at the overlapped time
        longer = max(compute.total, comm.total)
        speedup = terms.TWO_BATCH_OVERLAP_SPEEDUP if phase == "prefill" else terms.TWO_BATCH_OVERLAP_SPEEDUP_DECODE
        return both.scaled(max(longer, both.total / speedup) / both.total)
    return both


def step_cost(cfg, g, shape, *, phase, rows, seqs, ctx, weights, attention, drafts=0) -> StepCost:
    """One step of `rows` tokens from `seqs` sequences per attention instance, each attending `ctx` positions."""
    cost = StepCost()
    # a layer's cost depends on its index only through its kind, MoE-ness and attention parameters: a 2.8T model's
    # ~100 layers have a handful of distinct ones, and an SLO search prices thousands of steps
    distinct: dict[tuple, StepCost] = {}
    for i, kind in enumerate(cfg.layer_types):
        moe = cfg.is_moe_layer(i)
        key = (kind, moe, cfg.attention_params(i))
        if key not in distinct:
            distinct[key] = _layer(
                cfg,
                g,
                shape,
                kind,
                moe,
                phase=phase,
                rows=rows,
                seqs=seqs,
                ctx=ctx,
                weights=weights,
                attention=attention,
                i=i,
            )
        cost = cost.merged(distinct[key])
    head_rows = rows if phase == "decode" else seqs
    head = cfg.vocab_size * cfg.hidden_size
    block(
        cost,
        g,
        weight_bytes=2 * head / shape.attn_tp,
        flops=2 * head * head_rows / shape.attn_tp,
        kernels=terms.KERNELS["head"],
    )
    for _ in range(drafts):  # an MTP draft: one more MoE layer and the head over the batch's newest tokens
        cost = cost.merged(
            _layer(
                cfg,
                g,
                shape,
                cfg.mtp_layer_type,
                True,
                phase=phase,
                rows=seqs,
                seqs=seqs,
                ctx=ctx,
                weights=weights,
                attention=attention,
                i=cfg.latent_kv_layers[-1],
            )
        )
        block(
            cost,
            g,
            weight_bytes=2 * head / shape.attn_tp,
            flops=2 * head * seqs / shape.attn_tp,
            kernels=terms.KERNELS["head"],
        )
    return cost


# ---------------------------------------------------------------------------------------------- layouts
def pool_shape(cfg: ModelConfig, g: GPU, gpus: int, layout: Layout, pool: str) -> PoolShape:
    """Resolve and check one pool's parallelism; an impossible one is refused naming the flag."""
    where = f" (the {pool} pool's {gpus} GPUs)" if pool != "single" else ""
    if gpus % layout.tp:
        raise ValueError(f"--tp {layout.tp} does not divide --gpus {gpus}{where}")
    attn_tp = 1 if layout.dp_attention else layout.tp
    ep = layout.ep if layout.ep is not None else gpus
    if gpus % ep:
        raise ValueError(f"--ep {ep} does not divide the {gpus} GPUs{where}")
    if ep > cfg.moe.n_routed_experts:
        raise ValueError(f"--ep {ep} exceeds the model's {cfg.moe.n_routed_experts} routed experts")
    moe_group = max(ep, layout.tp)
    if moe_group % ep:
        raise ValueError(f"--ep {ep} must divide --tp {layout.tp} when smaller (experts sliced over tp / ep GPUs)")
    return PoolShape(gpus, attn_tp, ep, moe_group, overlap=ep > g.nvlink_domain)


def _check(w: Workload, weights: str, attention: str) -> None:
    for flag, value in (("--input-len", w.input_len), ("--output-len", w.output_len)):
        if value < 1:
            raise ValueError(f"{flag} {value}: expected a positive number of tokens")
    if not 0 <= w.cache_hit < 1:
        raise ValueError(f"--cache-hit {w.cache_hit}: expected a fraction in [0, 1)")
    if w.expert_imbalance < 1:
        raise ValueError(f"--expert-imbalance {w.expert_imbalance}: expected >= 1 (busiest rank over the mean)")
    if w.accepted_tokens < 1:
        raise ValueError(f"--accepted-tokens {w.accepted_tokens}: expected >= 1 (tokens per decode step)")
    if w.concurrency is not None and w.batch_per_gpu is not None:
        raise ValueError("--concurrency and --batch-per-gpu: give one")
    for flag, value in (("--concurrency", w.concurrency), ("--batch-per-gpu", w.batch_per_gpu)):
        if value is not None and value <= 0:
            raise ValueError(f"{flag} {value}: expected a positive number")
    if weights not in WEIGHT_DTYPES:
        raise ValueError(f"--weights {weights!r}: expected one of {', '.join(WEIGHT_DTYPES)}")
    if attention not in ATTENTION_DTYPES:
        raise ValueError(f"--attention-dtype {attention!r}: expected one of {', '.join(ATTENTION_DTYPES)}")


def predict(
    model: str | ModelConfig,
    gpu: str | GPU,
    layout: Layout,
    workload: Workload,
    *,
    weights: str = "bf16",
    attention: str = "bf16",
) -> Prediction:
    cfg = resolve_model(model) if isinstance(model, str) else model
    g = gpu_named(gpu) if isinstance(gpu, str) else gpu
    w = workload
    _check(w, weights, attention)
    if (layout.prefill_gpus is None) != (layout.decode_gpus is None):
        raise ValueError("--prefill-gpus and --decode-gpus: give both or neither")
    disaggregated = layout.prefill_gpus is not None
    if disaggregated and layout.prefill_gpus + layout.decode_gpus != layout.gpus:
        raise ValueError(
            f"--gpus {layout.gpus} must equal --prefill-gpus {layout.prefill_gpus} + --decode-gpus {layout.decode_gpus}"
        )
    pf = pool_shape(
        cfg, g, layout.prefill_gpus if disaggregated else layout.gpus, layout, "prefill" if disaggregated else "single"
    )
    dc = pool_shape(cfg, g, layout.decode_gpus, layout, "decode") if disaggregated else pf
    for shape in (pf, dc):
        shape.imbalance = w.expert_imbalance if shape.ep > 1 else 1.0
    context = w.context_len if w.context_len is not None else w.input_len + w.output_len / 2
    usable = MEMORY_FRACTION * g.hbm_bytes
    for shape, name in ((pf, "prefill"), (dc, "decode")):
        resident = weights_per_gpu(cfg, shape, weights) + attention_workspace_bytes(cfg, step_tokens=256)
        if resident >= usable:
            raise ValueError(
                f"--ep {shape.ep} / --tp {layout.tp}: {resident / 1e9:,.1f} GB of weights per {g.name} GPU in the "
                f"{name} pool leave no room for KV in its {usable / 1e9:,.1f} usable GB (more GPUs, a wider --ep, "
                f"--tp instead of --dp-attention, or smaller --weights)"
            )
    # decode: sequences per attention instance
    free = usable - weights_per_gpu(cfg, dc, weights) - attention_workspace_bytes(cfg, step_tokens=256)
    per_seq = kv_bytes_per_sequence(cfg, w.input_len + w.output_len, attention, dc.attn_tp)
    capacity_per_instance = int(free // per_seq)
    if w.batch_per_gpu is not None:
        seqs, flag = w.batch_per_gpu * dc.attn_tp, "--batch-per-gpu"
    else:
        seqs, flag = (w.concurrency or 1) / dc.instances, "--concurrency"
    if seqs > capacity_per_instance:
        raise ValueError(
            f"{flag}: {seqs:g} sequences per decode instance exceed its KV capacity of {capacity_per_instance} "
            f"sequences of {w.input_len + w.output_len} tokens"
        )
    drafts = math.ceil(w.accepted_tokens - 1) if cfg.n_mtp_layers else 0
    step_seqs = max(seqs, 1.0)
    dec = step_cost(
        cfg,
        g,
        dc,
        phase="decode",
        rows=step_seqs * (1 + drafts),
        seqs=step_seqs,
        ctx=context,
        weights=weights,
        attention=attention,
        drafts=drafts,
    )
    new = w.input_len * (1 - w.cache_hit)
    pf_ctx = w.input_len * w.cache_hit + new / 2
    one = step_cost(cfg, g, pf, phase="prefill", rows=new, seqs=1, ctx=pf_ctx, weights=weights, attention=attention)
    if disaggregated:
        rows = max(w.prefill_tokens_per_gpu * pf.attn_tp, new)
        full = step_cost(
            cfg, g, pf, phase="prefill", rows=rows, seqs=rows / new, ctx=pf_ctx, weights=weights, attention=attention
        )
        prefill_rate = rows / (1 - w.cache_hit) / full.total / pf.attn_tp
        decode_rate = seqs * w.accepted_tokens / dec.total / dc.attn_tp
        ttft = math.ceil(new / rows) * full.total
        tpot = dec.total / w.accepted_tokens
        prefill_cost = full
    else:  # one pool: each of the instance's sequences stalls the decode batch once for its prefill
        e2e = seqs * one.total + w.output_len / w.accepted_tokens * dec.total
        prefill_rate = seqs * w.input_len / e2e / pf.attn_tp
        decode_rate = seqs * w.output_len / e2e / pf.attn_tp
        ttft = one.total
        tpot = (max(seqs - 1, 0) * one.total + w.output_len / w.accepted_tokens * dec.total) / w.output_len
        prefill_cost = one
    assumed = {
        "model": cfg.name,
        "gpu": g.name,
        "gpus": layout.gpus,
        "tp": layout.tp,
        "ep": {"prefill": pf.ep, "decode": dc.ep},
        "dp_attention": layout.dp_attention,
        "prefill_gpus": pf.gpus if disaggregated else None,
        "decode_gpus": dc.gpus if disaggregated else None,
        "two_batch_overlap": {"prefill": pf.overlap, "decode": dc.overlap},
        "weights": weights,
        "dense_weights": dense_dtype(weights),
        "attention_dtype": attention,
        "input_len": w.input_len,
        "output_len": w.output_len,
        "concurrency": seqs * dc.instances,
        "batch_per_gpu": seqs / dc.attn_tp,
        "cache_hit": w.cache_hit,
        "accepted_tokens": w.accepted_tokens,
        "mtp_drafts_per_step": drafts,
        "decode_context_len": context,
        "prefill_tokens_per_gpu": w.prefill_tokens_per_gpu if disaggregated else None,
        "expert_imbalance": {"prefill": pf.imbalance, "decode": dc.imbalance},
        "memory_fraction": MEMORY_FRACTION,
    }
    return Prediction(
        model=cfg.name,
        gpu=g.name,
        assumed=assumed,
        prefill_tokens_per_s_per_gpu=prefill_rate,
        decode_tokens_per_s_per_gpu=decode_rate,
        prefill_tokens_per_s_per_node=prefill_rate * g.gpus_per_node,
        decode_tokens_per_s_per_node=decode_rate * g.gpus_per_node,
        ttft_s=ttft,
        tpot_ms=tpot * 1e3,
        kv_capacity_sequences=capacity_per_instance * dc.instances,
        sequences_per_decode_instance=seqs,
        bound={"prefill": prefill_cost.bound, "decode": dec.bound},
        step_seconds={"prefill": prefill_cost.seconds, "decode": dec.seconds},
    )
