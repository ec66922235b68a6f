"""`spec.slo` of a MoEDeployment (issue #55): the latency a deployment must meet, the GPU type it runs on and the
workload shape the forecast (expertmesh/forecast/) sizes it for; and `status.predicted`, what the forecast says the
deployment's layout serves. operator/forecast.py turns one into the other."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from expertmesh.forecast.gpus import GPU_NAMES
from expertmesh.forecast.predict import WEIGHT_DTYPES
from expertmesh.operator.spec_fields import SpecModel

MAX_SLO_TOKENS = 2**24  # a prompt or an answer, tokens (as spec.kv.maxContext's bound)


class SLOSpec(SpecModel):
    """TTFT and TPOT to meet, on `gpu` GPUs, for prompts of `inputTokens` and answers of `outputTokens`. The
    forecast reads the attention (and prefill) pools as its layout: each pod's GPUs as attention tensor parallelism
    (one GPU a pod: DP attention), the routed experts spread over those GPUs (expertmesh's expert pods hold them
    instead, so its KV capacity is a lower bound)."""

    model_config = ConfigDict(**SpecModel.model_config, frozen=True)  # hashable: the forecast is cached per SLO

    ttft_seconds: float = Field(gt=0, le=3600, description="time to first token to meet, seconds")
    tpot_milliseconds: float = Field(gt=0, le=60_000, description="time per output token to meet, milliseconds")
    gpu: Literal[GPU_NAMES] = Field(description="the GPU type the pods run on (expertmesh predict's --gpu)")
    input_tokens: int = Field(8192, ge=1, le=MAX_SLO_TOKENS, description="prompt tokens the forecast assumes")
    output_tokens: int = Field(1024, ge=1, le=MAX_SLO_TOKENS, description="answer tokens the forecast assumes")
    cache_hit: float = Field(0.0, ge=0, lt=1, description="share of prompt tokens found in the KV cache")
    weights: Literal[WEIGHT_DTYPES] = Field(
        "mxfp4", description="the routed experts' dtype (fp8 also quantises the other linear layers)"
    )


class _Status(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")


Bound = Literal[
    "weights read", "KV read", "FLOPs", "attention kernel", "expert all-to-all", "all-reduce", "kernel launches"
]


class PredictedBound(_Status):
    prefill: Bound
    decode: Bound


class PredictedStatus(_Status):
    """What the forecast says the spec's layout serves at the largest decode batch within spec.slo's TPOT."""

    gpu: str = Field(max_length=16)
    gpus: int = Field(ge=0, le=1_000_000, description="the attention and prefill GPUs the forecast lays out")
    sequences: int = Field(ge=0, le=10**9, description="sequences decoding at once within the TPOT")
    kv_capacity_sequences: int = Field(ge=0, le=10**9, description="sequences of input + output tokens the KV holds")
    # bounded like every CRD number (test_operator_hardening): far beyond any forecast a layout can give
    ttft_seconds: float = Field(ge=0, le=1e9)
    tpot_milliseconds: float = Field(ge=0, le=1e9)
    prefill_tokens_per_second: float = Field(ge=0, le=1e15, description="the deployment's, all prefilling GPUs")
    decode_tokens_per_second: float = Field(ge=0, le=1e15, description="the deployment's, all decoding GPUs")
    bound: PredictedBound = Field(description="the term that bounds each phase")
    meets_slo: bool
