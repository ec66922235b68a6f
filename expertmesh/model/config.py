"""Model configuration, presets and the arithmetic derived from them (parameters, bytes, KV).

`ModelConfig` describes the reference architecture: a stack of Kimi Delta Attention (KDA) and gated DSA
(MLA + lightning indexer + top-k sparse attention) layers, each followed by a dense SwiGLU MLP (the first
`first_k_dense` layers) or a Mixture-of-Experts block (sigmoid gate with a selection-only correction bias,
group-limited top-k, renormalised weights × routed scaling, routed experts in MXFP4, shared experts).

Presets: `tiny` (tests), `small` (CPU benchmarks), `full-2.8t` (planning and memory arithmetic only); their fields
are data in expertmesh/model/presets.py, validated here by `preset`.
"""

from __future__ import annotations

import math
from functools import cached_property
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from expertmesh.model.presets import PRESETS

if TYPE_CHECKING:
    import torch

# kda: Kimi Delta Attention; mla: full multi-head latent attention (Kimi Linear's global layers); dsa: MLA whose
# queries each attend only to the lightning indexer's top-k past tokens (DeepSeek-V3.2).
LayerType = Literal["kda", "mla", "dsa"]
ModelType = Literal["expertmesh", "kimi_linear", "deepseek_v32", "kimi_k3"]
MXFP4_BLOCK = 32  # values per E8M0 scale (OCP MX v1.0)
MXFP4_BITS_PER_WEIGHT = 4 + 8 / MXFP4_BLOCK  # 4.25
# state-dict name endings of the parameters the published models keep in fp32 whatever the compute dtype (routing
# weight and bias, KDA A_log / dt_bias, the indexer's head weights): a bf16 copy would change which expert wins a
# near-tie. `ModelConfig.fp32_params` counts them (placement/sizing.py's dense bytes)
FP32_PARAMETERS = ("moe.router.weight", "moe.router_bias", "attn.A_log", "attn.dt_bias", "attn.index_w.weight")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class MoEConfig(_Strict):
    n_routed_experts: int = Field(gt=0)
    n_shared_experts: int = Field(ge=0)
    top_k: int = Field(gt=0)
    expert_intermediate_size: int = Field(gt=0, description="width of one routed (and shared) expert's gated MLP")
    n_group: int = Field(1, gt=0, description="expert groups for group-limited routing")
    topk_group: int = Field(1, gt=0, description="groups a token may route into")
    routed_scaling_factor: float = Field(1.0, gt=0)
    norm_topk_prob: bool = True
    combine_group_size: int | None = Field(
        None,
        gt=0,
        description="experts per combine group: the unit an expert worker pre-reduces and the order of "
        "the canonical combine (kernels/moe/combine.py); a fixed partition, so the sum never "
        "depends on placement. Default: the routing group size (n_routed_experts / n_group)",
    )
    latent_size: int | None = Field(
        None,
        gt=0,
        description="latent MoE (Kimi K3's routed_expert_hidden_size): the routed experts compute on a "
        "down-projection of the layer's normed input to this width, and their weighted sum is "
        "RMS-normed (latent_norm) and projected back up; the router and the shared experts read "
        "the full-width input. None: the experts compute at the hidden size",
    )
    latent_norm: bool = Field(True, description="RMSNorm on the latent experts' weighted sum (K3: latent_moe_use_norm)")

    @property
    def combine_groups(self) -> int:
        """Combine groups per layer (group c = experts [c·S, (c+1)·S), S = combine_group_size)."""
        return self.n_routed_experts // (self.combine_group_size or self.n_routed_experts // self.n_group)

    @model_validator(mode="after")
    def _check(self) -> MoEConfig:
        if self.combine_group_size is not None and self.n_routed_experts % self.combine_group_size:
            raise ValueError(
                f"moe.combine_group_size={self.combine_group_size} does not divide "
                f"moe.n_routed_experts={self.n_routed_experts}"
            )
        if self.top_k > self.n_routed_experts:
            raise ValueError(f"moe.top_k={self.top_k} exceeds moe.n_routed_experts={self.n_routed_experts}")
        if self.n_routed_experts % self.n_group:
            raise ValueError(
                f"moe.n_routed_experts={self.n_routed_experts} is not divisible by moe.n_group={self.n_group}"
            )
        if self.topk_group > self.n_group:
            raise ValueError(f"moe.topk_group={self.topk_group} exceeds moe.n_group={self.n_group}")
        reachable = self.topk_group * (self.n_routed_experts // self.n_group)
        if self.top_k > reachable:
            raise ValueError(
                f"moe.top_k={self.top_k} exceeds the {reachable} experts reachable through "
                f"moe.topk_group={self.topk_group} of moe.n_group={self.n_group} groups"
            )
        if self.latent_size is not None and self.latent_size % MXFP4_BLOCK:
            raise ValueError(
                f"moe.latent_size={self.latent_size} must be a multiple of the MXFP4 block size {MXFP4_BLOCK}"
            )
        if self.expert_intermediate_size % MXFP4_BLOCK:
            raise ValueError(
                f"moe.expert_intermediate_size={self.expert_intermediate_size} must be a multiple of the "
                f"MXFP4 block size {MXFP4_BLOCK}"
            )
        return self


class MLAConfig(_Strict):
    """Multi-head latent attention (the attention of MLA and DSA layers)."""

    n_heads: int = Field(gt=0)
    q_lora_rank: int | None = Field(gt=0, description="None: one full-rank q projection (Kimi Linear)")
    kv_lora_rank: int = Field(gt=0)
    qk_nope_head_dim: int = Field(gt=0)
    qk_rope_head_dim: int = Field(gt=0)
    v_head_dim: int = Field(gt=0)
    rope: Literal["interleaved", "half", "none"] = Field(
        "interleaved",
        description="layout of the rotary dims: DeepSeek's interleaved pairs, rotate-half, or NoPE "
        "(Kimi Linear: the rope slice of the key is kept but never rotated)",
    )
    gated_output: bool = Field(
        False,
        description="sigmoid gate on the attention output, from the layer's normed input (gated DSA; K3's gated MLA)",
    )
    norm_eps: float = Field(1e-6, gt=0, description="eps of the q / kv latent RMSNorms (published: 1e-6)")

    @model_validator(mode="after")
    def _check(self) -> MLAConfig:
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"mla.qk_rope_head_dim={self.qk_rope_head_dim} must be even (RoPE rotates pairs)")
        return self


class IndexerConfig(_Strict):
    """The DSA lightning indexer (DeepSeek-V3.2): q from the query latent, k = LayerNorm(W_k x), both rotated on
    their first `mla.qk_rope_head_dim` dims (rotate-half layout); score = Σ_h w_h · ReLU(q_h·k) / sqrt(Hi·Di)."""

    n_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    index_topk: int = Field(2048, gt=0, description="past tokens each query attends to")
    rope: bool = Field(True, description="rotate the first qk_rope_head_dim dims of the indexer q and k")


class KDAConfig(_Strict):
    """Kimi Delta Attention: gated delta rule with a per-channel forget gate and a short causal conv."""

    n_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    conv_kernel_size: int = Field(4, gt=0)
    gate_low_rank: int = Field(gt=0, description="rank of the forget-gate and output-gate projections")
    conv_bias: bool = Field(False, description="the short convolutions carry a bias")
    output_gate_bias: bool = Field(False, description="the output gate's up-projection carries a bias")
    output_gate: Literal["low_rank", "full_rank"] = Field(
        "low_rank",
        description="the sigmoid output gate: g_b(g_a(x)) of rank gate_low_rank (Kimi Linear) or one "
        "full-rank g_proj (Kimi K3)",
    )
    gate_lower_bound: float | None = Field(
        None,
        lt=0,
        description="Kimi K3: the forget gate's log-decay is lb·σ(exp(A_log)·f) ∈ (lb, 0) instead of "
        "−exp(A_log)·softplus(f) (Kimi Linear)",
    )
    l2_norm_eps: float = Field(
        1e-6,
        gt=0,
        description="eps of q / k's L2 normalisation (FLA's and transformers' "
        "1e-6; llama.cpp's kimi-k3 uses rms_norm_eps)",
    )


class YarnConfig(_Strict):
    """YaRN context extension (the `rope_scaling` / `rope_parameters` of type yarn), as DeepSeek-V3 defines it."""

    factor: float = Field(gt=0)
    original_max_position_embeddings: int = Field(gt=0)
    beta_fast: float = Field(32.0, gt=0)
    beta_slow: float = Field(1.0, gt=0)
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = Field(None, description="cos/sin scale; None: from factor and the mscales")
    truncate: bool = True


class ActivationConfig(_Strict):
    """The gated MLPs' activation act(gate, up) (dense layers, shared and routed experts): SwiGLU silu(g)·u, or
    Kimi K3's SiTU β·tanh(g/β)·σ(g) · β_lin·tanh(u/β_lin) (β_lin = 0: u uncapped)."""

    kind: Literal["swiglu", "situ"] = "swiglu"
    beta: float = Field(4.0, gt=0, description="SiTU's gate soft cap (activation_situ_beta)")
    linear_beta: float = Field(25.0, ge=0, description="SiTU's up soft cap (activation_situ_linear_beta; 0: none)")


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


class RopeConfig(_Strict):
    theta: float = Field(50_000.0, gt=0)
    yarn: YarnConfig | None = None

    def inv_freq(self, dim: int) -> torch.Tensor:
        """Inverse frequencies [dim/2] (float64) of a `dim`-wide rotary slice, YaRN-blended when configured:
        high frequencies kept (extrapolation), low ones divided by `factor` (interpolation), a linear ramp
        between the correction dims of beta_fast / beta_slow rotations."""
        import torch

        base = self.theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
        extrapolated = 1.0 / base
        y = self.yarn
        if y is None:
            return extrapolated
        interpolated = 1.0 / (y.factor * base)

        def correction_dim(rotations: float) -> float:
            return (
                dim
                * math.log(y.original_max_position_embeddings / (rotations * 2 * math.pi))
                / (2 * math.log(self.theta))
            )

        low, high = correction_dim(y.beta_fast), correction_dim(y.beta_slow)
        if y.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
        keep = 1 - ramp  # 1: extrapolate (high frequency), 0: interpolate
        return interpolated * (1 - keep) + extrapolated * keep

    @property
    def attention_factor(self) -> float:
        """The factor YaRN multiplies cos and sin by (1 without YaRN)."""
        y = self.yarn
        if y is None:
            return 1.0
        if y.attention_factor is not None:
            return y.attention_factor
        if y.mscale and y.mscale_all_dim:
            return _yarn_mscale(y.factor, y.mscale) / _yarn_mscale(y.factor, y.mscale_all_dim)
        return _yarn_mscale(y.factor)

    @property
    def softmax_mscale(self) -> float:
        """DeepSeek-V3's extra attention-logit scale under YaRN: mscale(factor, mscale_all_dim)²."""
        y = self.yarn
        if y is None or not y.mscale_all_dim:
            return 1.0
        return _yarn_mscale(y.factor, y.mscale_all_dim) ** 2


class VisionConfig(_Strict):
    """A MoonViT-style vision tower and projector: 14-px patches embedded by a conv, a learned position grid
    resampled to each image's patch grid, 2-D axial RoPE, pre-norm ViT layers; each 2×2 block of patches merges
    into one image token, projected into the LM's hidden size.

    Two layouts (`layout`), the same maths where their settings coincide:
    - `kimi_k25` (expertmesh/model/vision.py): transformers' `kimi_k25` (`Kimi_K25VisionConfig` plus the projector
      fields of `Kimi_K25Config`) — LayerNorms and biases everywhere, q/k/v as wide as the tower, bicubic position
      resampling, the `patchmerger` projector (LayerNorm, Linear, GELU, Linear). Its variant fields keep those values.
    - `kimi_k3` (expertmesh/model/vision_k3.py): the published MoonViT3d of Kimi K3 (`kimi_k3_vision`) under its
      own tensor names, every variant field honoured: `norm_type`, the three bias flags, `qkv_hidden_size`,
      `pos_emb_type` divided_fixed (a learned 2-D grid plus a fixed sinusoid per frame, `pos_emb_time` frames),
      its interpolation mode, `mlp_type` mlp2, and the `patchmerger` or `patchmergerv2` projector (Linear, GELU,
      Linear, RMSNorm; no biases)."""

    layout: Literal["kimi_k25", "kimi_k3"] = "kimi_k25"
    patch_size: int = Field(14, gt=0)
    hidden_size: int = Field(1152, gt=0)
    num_hidden_layers: int = Field(27, gt=0)
    num_attention_heads: int = Field(16, gt=0)
    intermediate_size: int = Field(4304, gt=0)
    hidden_act: Literal["gelu_pytorch_tanh", "gelu"] = "gelu_pytorch_tanh"
    pos_emb_height: int = Field(64, gt=0)
    pos_emb_width: int = Field(64, gt=0)
    merge_kernel_size: tuple[int, int] = (2, 2)
    rope_theta: float = Field(10_000.0, gt=0)
    projection_layer_norm_eps: float = Field(1e-5, gt=0)
    # the variants (K3's vision_config); the defaults are kimi_k25's
    norm_type: Literal["layernorm", "rmsnorm"] = "layernorm"
    attn_bias: bool = True
    linear_bias: bool = True
    patch_embed_proj_bias: bool = True
    qkv_hidden_size: int | None = Field(None, gt=0, description="q, k and v width (all heads); None: hidden_size")
    pos_emb_type: Literal["divided_fixed"] = "divided_fixed"
    pos_emb_time: int = Field(4, gt=0, description="frames the fixed time sinusoid covers (an image is one)")
    pos_emb_interpolation_mode: Literal["bicubic", "bilinear"] = "bicubic"
    mlp_type: Literal["mlp2"] = "mlp2"
    projector_type: Literal["patchmerger", "patchmergerv2"] = "patchmerger"
    projector_hidden_act: Literal["gelu", "gelu_pytorch_tanh"] = "gelu"
    image_token_id: int = Field(ge=0, description="the placeholder token each image token's row replaces")
    image_start_token_id: int = Field(ge=0, description="opens an image in a prompt")
    image_end_token_id: int = Field(ge=0, description="closes an image in a prompt")
    max_patches: int = Field(16_384, gt=0, description="patches per image; larger images are scaled down to fit")
    max_patches_per_side: int = Field(512, gt=0, description="patches along either side; likewise")

    @model_validator(mode="after")
    def _check(self) -> VisionConfig:
        head_dim, rem = divmod(self.qkv_width, self.num_attention_heads)
        if rem or head_dim % 4:
            raise ValueError(
                f"vision.{'qkv_hidden_size' if self.qkv_hidden_size else 'hidden_size'}={self.qkv_width} / "
                f"num_attention_heads={self.num_attention_heads} must be a whole head dim divisible by 4 (2-D RoPE)"
            )
        if self.layout == "kimi_k25":  # the kimi_k25 modules implement its own settings only
            for name, k25 in K25_VISION_VARIANT.items():
                if getattr(self, name) != k25:
                    raise ValueError(
                        f"vision.{name}={getattr(self, name)!r}: the kimi_k25 layout has {k25!r} "
                        f"(other values need layout kimi_k3)"
                    )
        return self

    @property
    def qkv_width(self) -> int:
        return self.qkv_hidden_size or self.hidden_size

    @property
    def merge_pixels(self) -> tuple[int, int]:
        """Pixels of one image token along (height, width): image sides are padded to multiples of these."""
        return self.patch_size * self.merge_kernel_size[0], self.patch_size * self.merge_kernel_size[1]

    def tokens_for(self, height: int, width: int) -> int:
        """Image tokens of a (resized, padded) image of height × width pixels."""
        mh, mw = self.merge_pixels
        return (height // mh) * (width // mw)

    def params(self, lm_hidden: int) -> int:
        """Parameters of the tower and the projector into an LM of hidden size `lm_hidden`."""
        d, i, p, q = self.hidden_size, self.intermediate_size, self.patch_size, self.qkv_width
        norm = 2 * d if self.norm_type == "layernorm" else d
        attn = 4 * q * d + ((3 * q + d) if self.attn_bias else 0)  # q, k, v [q, d] and the output [d, q]
        mlp = 2 * d * i + ((i + d) if self.linear_bias else 0)
        layer = attn + mlp + 2 * norm
        tower = (
            3 * p * p * d
            + (d if self.patch_embed_proj_bias else 0)
            + self.pos_emb_height * self.pos_emb_width * d
            + self.num_hidden_layers * layer
            + norm
        )
        merged = d * self.merge_kernel_size[0] * self.merge_kernel_size[1]
        if self.projector_type == "patchmergerv2":  # Linear, Linear (no biases), RMSNorm over the LM width
            return tower + merged * merged + merged * lm_hidden + lm_hidden
        return tower + 2 * d + merged * merged + merged + merged * lm_hidden + lm_hidden  # norm, in_proj, out_proj


# kimi_k25's values of the variant fields (VisionConfig): what its layout's modules compute
K25_VISION_VARIANT = {
    "norm_type": "layernorm",
    "attn_bias": True,
    "linear_bias": True,
    "patch_embed_proj_bias": True,
    "qkv_hidden_size": None,
    "pos_emb_interpolation_mode": "bicubic",
    "projector_type": "patchmerger",
    "projector_hidden_act": "gelu",
}


class ModelConfig(_Strict):
    name: str
    model_type: ModelType = Field("expertmesh", description="the published family whose math and layout it follows")
    vocab_size: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    layer_types: tuple[LayerType, ...] = Field(min_length=1)
    first_k_dense: int = Field(ge=0, description="leading layers with a dense MLP instead of MoE")
    dense_intermediate_size: int = Field(gt=0)
    moe: MoEConfig
    mla: MLAConfig
    indexer: IndexerConfig
    kda: KDAConfig
    rope: RopeConfig = RopeConfig()
    max_context: int = Field(gt=0)
    rms_norm_eps: float = Field(1e-6, gt=0)
    activation: ActivationConfig = ActivationConfig()
    attn_res_block_size: int | None = Field(
        None,
        gt=0,
        description="attention residuals (Kimi K3): each layer's attention and MLP input is a learned "
        "softmax mix of block sums of the residual stream, a block every this many layers; "
        "None: the plain residual stream",
    )
    tie_word_embeddings: bool = False
    init_std: float = Field(0.02, gt=0, description="std of the synthetic checkpoint's random weights")
    vision: VisionConfig | None = Field(None, description="image input (expertmesh/model/vision.py); None: text only")
    n_mtp_layers: int = Field(
        0,
        ge=0,
        description="multi-token-prediction layers after the main ones (HF num_nextn_predict_layers): served as "
        "the speculative drafter (expertmesh/model/speculative.py), never part of the main forward",
    )

    @model_validator(mode="after")
    def _check(self) -> ModelConfig:
        if self.hidden_size % MXFP4_BLOCK:
            raise ValueError(f"hidden_size={self.hidden_size} must be a multiple of the MXFP4 block size {MXFP4_BLOCK}")
        if self.first_k_dense > self.n_layers:
            raise ValueError(f"first_k_dense={self.first_k_dense} exceeds the {self.n_layers} layers")
        if self.n_dsa_layers and self.mla.q_lora_rank is None:
            raise ValueError("DSA layers need mla.q_lora_rank: the indexer's queries come from the query latent")
        if self.n_dsa_layers and self.indexer.rope and self.indexer.head_dim < self.mla.qk_rope_head_dim:
            raise ValueError(
                f"indexer.head_dim={self.indexer.head_dim} is narrower than the "
                f"mla.qk_rope_head_dim={self.mla.qk_rope_head_dim} dims its RoPE rotates"
            )
        return self

    # ------------------------------------------------------------------ structure
    @property
    def n_layers(self) -> int:
        return len(self.layer_types)

    @property
    def mtp_layer_type(self) -> LayerType:
        """The MTP layers' attention: DSA when the model has DSA layers, else full MLA."""
        return "dsa" if self.n_dsa_layers else "mla"

    @property
    def n_kda_layers(self) -> int:
        return sum(t == "kda" for t in self.layer_types)

    @property
    def n_dsa_layers(self) -> int:
        return sum(t == "dsa" for t in self.layer_types)

    @property
    def n_mla_layers(self) -> int:
        return sum(t == "mla" for t in self.layer_types)

    @property
    def latent_kv_layers(self) -> list[int]:
        """Layers that keep a per-token latent KV cache (MLA and DSA)."""
        return [i for i, t in enumerate(self.layer_types) if t != "kda"]

    @property
    def moe_layers(self) -> list[int]:
        return list(range(self.first_k_dense, self.n_layers))

    @property
    def n_moe_layers(self) -> int:
        return self.n_layers - self.first_k_dense

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense

    @property
    def n_logical_experts(self) -> int:
        """(layer, expert) pairs: the units the planner places."""
        return self.n_moe_layers * self.moe.n_routed_experts

    # ------------------------------------------------------------------ parameter counts
    def _kda_layer_params(self) -> int:
        h, a = self.hidden_size, self.kda
        inner = a.n_heads * a.head_dim
        qkv = 3 * h * inner + 3 * inner * a.conv_kernel_size  # projections + depthwise convs
        qkv += 3 * inner if a.conv_bias else 0
        forget = h * a.gate_low_rank + a.gate_low_rank * inner + a.n_heads + inner  # low-rank g, A_log, dt_bias
        beta = h * a.n_heads
        out_gate = (h * inner if a.output_gate == "full_rank" else h * a.gate_low_rank + a.gate_low_rank * inner) + (
            inner if a.output_gate_bias else 0
        )
        return qkv + forget + beta + out_gate + a.head_dim + inner * h  # + output norm + o_proj

    def _latent_layer_params(self, indexed: bool) -> int:
        h, m, ix = self.hidden_size, self.mla, self.indexer
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        if m.q_lora_rank is None:
            q = h * m.n_heads * qk
        else:
            q = h * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * m.n_heads * qk
        kv = (
            h * (m.kv_lora_rank + m.qk_rope_head_dim)
            + m.kv_lora_rank
            + m.kv_lora_rank * m.n_heads * (m.qk_nope_head_dim + m.v_head_dim)
        )
        gate = h * m.n_heads * m.v_head_dim if m.gated_output else 0
        out = m.n_heads * m.v_head_dim * h
        indexer = (m.q_lora_rank or 0) * ix.n_heads * ix.head_dim + h * ix.head_dim + 2 * ix.head_dim + h * ix.n_heads
        return q + kv + gate + out + (indexer if indexed else 0)

    def attention_params(self, layer: int) -> int:
        kind = self.layer_types[layer]
        return self._kda_layer_params() if kind == "kda" else self._latent_layer_params(indexed=kind == "dsa")

    @property
    def expert_hidden_size(self) -> int:
        """The width routed experts read and write: the latent (latent MoE) or the hidden size."""
        return self.moe.latent_size or self.hidden_size

    @property
    def expert_params(self) -> int:
        """Parameters of one routed expert (gate, up, down)."""
        return 3 * self.expert_hidden_size * self.moe.expert_intermediate_size

    def ffn_params(self, layer: int, active_only: bool = False) -> int:
        h = self.hidden_size
        if not self.is_moe_layer(layer):
            return 3 * h * self.dense_intermediate_size
        routed = (self.moe.top_k if active_only else self.moe.n_routed_experts) * self.expert_params
        shared = self.moe.n_shared_experts * 3 * h * self.moe.expert_intermediate_size  # at the full width
        router = self.moe.n_routed_experts * h + self.moe.n_routed_experts  # gate weight + correction bias
        latent = 0
        if self.moe.latent_size is not None:  # down and up projections (+ the latent norm)
            latent = 2 * h * self.moe.latent_size + (self.moe.latent_size if self.moe.latent_norm else 0)
        return routed + shared + router + latent

    @property
    def attn_res_params(self) -> int:
        """Attention residuals: a norm and a projection vector per mix (two per layer, one at the output)."""
        return 0 if self.attn_res_block_size is None else 2 * self.hidden_size * (2 * self.n_layers + 1)

    @property
    def embedding_params(self) -> int:
        """Token embeddings and LM head, plus the vision tower and projector (they feed the embedding rows)."""
        n = self.vocab_size * self.hidden_size
        vision = self.vision.params(self.hidden_size) if self.vision is not None else 0
        return (n if self.tie_word_embeddings else 2 * n) + vision

    def _layers_params(self, active_only: bool) -> int:
        return self.attn_res_params + sum(
            self.attention_params(i) + self.ffn_params(i, active_only) + 2 * self.hidden_size
            for i in range(self.n_layers)
        )

    @cached_property
    def total_params(self) -> int:
        return self.embedding_params + self.hidden_size + self._layers_params(active_only=False)

    @cached_property
    def active_params(self) -> int:
        """Parameters touched per token: everything but the routed experts not chosen."""
        return self.embedding_params + self.hidden_size + self._layers_params(active_only=True)

    @property
    def routed_expert_params(self) -> int:
        return self.n_logical_experts * self.expert_params

    @property
    def fp32_params(self) -> int:
        """Parameters held in fp32 whatever the compute dtype (FP32_PARAMETERS): the router's weight and
        correction bias per MoE layer, A_log and dt_bias per KDA layer, the indexer's head weights per DSA layer."""
        h, e, a = self.hidden_size, self.moe.n_routed_experts, self.kda
        router = self.n_moe_layers * (e * h + e)
        decay = self.n_kda_layers * (a.n_heads + a.n_heads * a.head_dim)
        index_heads = self.n_dsa_layers * h * self.indexer.n_heads
        return router + decay + index_heads

    # ------------------------------------------------------------------ bytes
    @property
    def expert_bytes_mxfp4(self) -> int:
        """Bytes of one routed expert in MXFP4: K/2 bytes of nibbles + K/32 bytes of scales per row."""
        h, i = self.expert_hidden_size, self.moe.expert_intermediate_size
        gate_up = 2 * i * (h // 2 + h // MXFP4_BLOCK)
        down = h * (i // 2 + i // MXFP4_BLOCK)
        return gate_up + down

    @property
    def routed_expert_bytes(self) -> int:
        return self.n_logical_experts * self.expert_bytes_mxfp4

    @property
    def dense_bytes_bf16(self) -> int:
        """Everything but the routed experts, stored in bf16."""
        return 2 * (self.total_params - self.routed_expert_params)

    @property
    def checkpoint_bytes(self) -> int:
        return self.routed_expert_bytes + self.dense_bytes_bf16

    def kv_bytes_per_token(self, layer_type: LayerType, dtype_bytes: int = 2) -> int:
        """KV cache bytes one token adds to one layer: MLA keeps the latent (c_kv ‖ k_rope), DSA also the
        indexer key; KDA keeps a fixed-size state instead, so it adds nothing per token."""
        if layer_type == "kda":
            return 0
        index = self.indexer.head_dim if layer_type == "dsa" else 0
        return dtype_bytes * (self.mla.kv_lora_rank + self.mla.qk_rope_head_dim + index)

    def kv_bytes_per_token_all_layers(self, dtype_bytes: int = 2) -> int:
        return sum(self.kv_bytes_per_token(t, dtype_bytes) for t in self.layer_types)

    @property
    def recurrent_state_bytes_per_layer(self) -> int:
        """One KDA layer's state (fp32 [H, K, V]) plus its short-conv tails (bf16, kernel-1 steps of q, k, v)."""
        a = self.kda
        inner = a.n_heads * a.head_dim
        state = 4 * a.n_heads * a.head_dim * a.head_dim
        conv = 2 * 3 * inner * (a.conv_kernel_size - 1)
        return state + conv

    @property
    def recurrent_state_bytes_per_sequence(self) -> int:
        """The KDA state and short-conv tails over all KDA layers."""
        return self.n_kda_layers * self.recurrent_state_bytes_per_layer

    def describe(self) -> list[tuple[str, str]]:
        """(figure, value) rows for `expertmesh model describe`."""
        rows = [
            ("preset", self.name),
            (
                "layers",
                f"{self.n_layers} ({self.n_kda_layers} KDA + {self.n_dsa_layers} DSA"
                + (f" + {self.n_mla_layers} MLA" if self.n_mla_layers else "")
                + "; "
                f"{self.first_k_dense} dense, {self.n_moe_layers} MoE)",
            ),
            ("hidden size", f"{self.hidden_size}"),
            (
                "routed experts / layer",
                f"{self.moe.n_routed_experts} (top-{self.moe.top_k}"
                + (f" in {self.moe.topk_group} of {self.moe.n_group} groups" if self.moe.n_group > 1 else ", ungrouped")
                + f", {self.moe.n_shared_experts} shared, width {self.moe.expert_intermediate_size}"
                + (f", on a {self.moe.latent_size} latent" if self.moe.latent_size else "")
                + ")",
            ),
            (
                "MLP activation",
                self.activation.kind
                if self.activation.kind == "swiglu"
                else f"situ (β {self.activation.beta:g}, β_lin {self.activation.linear_beta:g})",
            ),
            (
                "attention residuals",
                f"blocks of {self.attn_res_block_size} layers" if self.attn_res_block_size else "none",
            ),
            ("total parameters", _human(self.total_params)),
            ("active parameters / token", _human(self.active_params)),
            ("routed expert parameters", _human(self.routed_expert_params)),
            ("expert weights (MXFP4, 4.25 bit)", _bytes(self.routed_expert_bytes)),
            ("other weights (bf16)", _bytes(self.dense_bytes_bf16)),
            ("checkpoint total", f"{_bytes(self.checkpoint_bytes)} ({self.checkpoint_bytes / 1e12:.3f} TB)"),
            ("DSA index top-k", f"{self.indexer.index_topk}"),
            ("max context", f"{self.max_context:,} tokens"),
            ("KV bytes / token / DSA layer (bf16)", f"{self.kv_bytes_per_token('dsa'):,}"),
            ("KV bytes / token / KDA layer", f"{self.kv_bytes_per_token('kda')}"),
            ("KV bytes / token, all layers", f"{self.kv_bytes_per_token_all_layers():,}"),
            ("KV at max context / sequence", _bytes(self.kv_bytes_per_token_all_layers() * self.max_context)),
            ("recurrent state / sequence", _bytes(self.recurrent_state_bytes_per_sequence)),
        ]
        return rows


def _bytes(n: int) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{n:,} B"


def _human(n: int) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:,.2f}{unit} ({n:,})"
    return f"{n:,}"


PRESET_NAMES = tuple(PRESETS)


def preset(name: str) -> ModelConfig:
    """A preset by name (`tiny`, `small`, `full-2.8t`)."""
    try:
        fields = PRESETS[name]()
    except KeyError:
        raise ValueError(f"unknown preset {name!r}: expected one of {', '.join(PRESET_NAMES)}") from None
    return ModelConfig.model_validate(fields)


def load_config(path) -> ModelConfig:
    """Read an expertmesh `config.json` (as written by `ModelConfig.model_dump_json`); Hugging Face configs are
    mapped by `expertmesh.checkpoint.hf_layout`."""
    import json
    from pathlib import Path

    text = Path(path).read_text()
    try:
        data = json.loads(text)
        if isinstance(data, dict):  # older configs carried thinking budgets: serving policy now (chat/thinking.py)
            data.pop("thinking", None)
        return ModelConfig.model_validate(data)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
