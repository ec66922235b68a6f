"""The forecast (expertmesh/forecast/) as the operator and `expertmesh plan --slo` use it: an SLO from text, the
smallest layout that meets it, and that layout written as a MoEDeployment annotated with its forecast."""

from __future__ import annotations

import functools
import json
import math

from expertmesh.forecast.gpus import gpu as gpu_named
from expertmesh.forecast.models import resolve_model
from expertmesh.forecast.predict import MEMORY_FRACTION, Layout, Prediction, Workload, expert_bytes, predict
from expertmesh.forecast.slo import SLO, Proposal, largest_batch_within_tpot, smallest_layout
from expertmesh.model.config import ModelConfig
from expertmesh.operator.spec_slo import PredictedStatus

GIB = 2**30


def parse_slo(text: str) -> SLO:
    """'ttft=2,tpot=50': TTFT in seconds, TPOT in milliseconds; anything else is refused naming --slo."""
    fields = {}
    for part in text.split(","):
        key, _, value = part.partition("=")
        try:
            fields[key.strip()] = float(value.rstrip("ms").rstrip("s") if key.strip() == "ttft" else value.rstrip("ms"))
        except ValueError:
            raise ValueError(f"--slo {text!r}: expected ttft=SECONDS,tpot=MILLISECONDS") from None
    if set(fields) != {"ttft", "tpot"} or min(fields.values()) <= 0:
        raise ValueError(f"--slo {text!r}: expected ttft=SECONDS,tpot=MILLISECONDS, both positive")
    return SLO(ttft_s=fields["ttft"], tpot_ms=fields["tpot"])


def propose(model: str, gpu: str, slo: SLO, workload: Workload, weights: str) -> Proposal:
    return smallest_layout(model, gpu, slo, workload, weights=weights)


def forecast_summary(p: Proposal) -> dict:
    pr = p.prediction
    return {
        "gpu": pr.gpu,
        "gpus": p.layout.gpus,
        "nodes": p.nodes,
        "batchPerGpu": round(p.batch_per_gpu, 2),
        "kvCapacitySequences": pr.kv_capacity_sequences,
        "ttftSeconds": round(pr.ttft_s, 3),
        "tpotMilliseconds": round(pr.tpot_ms, 2),
        "prefillTokensPerSecondPerGpu": round(pr.prefill_tokens_per_s_per_gpu),
        "decodeTokensPerSecondPerGpu": round(pr.decode_tokens_per_s_per_gpu),
        "bound": pr.bound,
    }


def deployment_manifest(name: str, preset: str, p: Proposal, *, weights: str) -> dict:
    """The proposal as a MoEDeployment: attention pods as the decode instances (DP attention: one GPU each), a
    prefill pool when the layout has one, expert pods of whole nodes holding every routed expert, annotated with
    the forecast it was sized from."""
    cfg = resolve_model(preset)
    g = gpu_named(p.prediction.gpu)
    shape = p.prediction.assumed
    attn_tp = 1 if p.layout.dp_attention else p.layout.tp
    decode_gpus = shape["decode_gpus"] or p.layout.gpus
    routed = cfg.n_logical_experts * expert_bytes(cfg, weights)
    expert_pods = max(1, math.ceil(routed / (g.hbm_bytes * MEMORY_FRACTION * g.gpus_per_node)))
    spec = {
        "model": {"preset": preset, "checkpoint": {"pvc": {"claimName": "weights", "path": f"/models/{preset}"}}},
        "attentionWorkers": {"replicas": max(1, decode_gpus // attn_tp), "gpusPerPod": attn_tp},
        "expertWorkers": {
            "replicas": expert_pods,
            "gpusPerPod": g.gpus_per_node,
            "gpuMemoryGiB": round(g.hbm_bytes / GIB, 1),
        },
    }
    if shape["prefill_gpus"]:
        spec["prefillWorkers"] = {"replicas": max(1, shape["prefill_gpus"] // attn_tp), "gpusPerPod": attn_tp}
    return {
        "apiVersion": "expertmesh.dev/v1alpha1",
        "kind": "MoEDeployment",
        "metadata": {"name": name, "annotations": {"expertmesh.dev/forecast": json.dumps(forecast_summary(p))}},
        "spec": spec,
    }


# ---------------------------------------------------------------------------------------------- a deployment's SLO
def spec_layout(spec) -> Layout:
    """The forecast's layout for a spec (its attention and prefill pools, at their spec or minimum replicas): each
    pod's GPUs as attention TP, one GPU a pod as DP attention, the routed experts over all those GPUs."""
    aw, pw = spec.attention_workers, spec.prefill_workers

    def gpus(pool) -> int:
        pods = pool.autoscale.min_replicas if pool.autoscale is not None else pool.replicas
        return pods * max(1, pool.gpus_per_pod)

    tp = max(1, aw.gpus_per_pod)
    decode = gpus(aw)
    if not pw.enabled:
        return Layout(gpus=decode, tp=tp, dp_attention=tp == 1 and decode > 1)
    prefill = gpus(pw)
    return Layout(decode + prefill, tp=tp, dp_attention=tp == 1, prefill_gpus=prefill, decode_gpus=decode)


@functools.lru_cache(maxsize=64)
def _forecast(cfg_json: str, layout: Layout, slo) -> Prediction:
    cfg = ModelConfig.model_validate_json(cfg_json)
    w = Workload(slo.input_tokens, slo.output_tokens, cache_hit=slo.cache_hit)

    def at(batch: float) -> Prediction:
        shaped = Workload(w.input_len, w.output_len, batch_per_gpu=batch, cache_hit=w.cache_hit)
        return predict(cfg, slo.gpu, layout, shaped, weights=slo.weights)

    return largest_batch_within_tpot(at, slo.tpot_milliseconds)


def spec_forecast(spec, cfg) -> Prediction:
    """The spec's layout forecast at the largest decode batch within spec.slo's TPOT (cached per model, layout and
    SLO: the operator asks on every status update). Raises ValueError when the layout cannot hold the model."""
    return _forecast(cfg.model_dump_json(), spec_layout(spec), spec.slo)  # spec.slo is frozen: hashable


def predicted_status(spec, cfg) -> tuple[dict | None, tuple[str, str, str]]:
    """status.predicted (camelCase) and the SLOAttainable condition (status, reason, message) for a spec with an
    SLO; the message names the term that bounds the phase that misses."""
    slo = spec.slo
    try:
        p = spec_forecast(spec, cfg)
    except ValueError as e:
        return None, ("False", "ForecastImpossible", f"spec.slo: the forecast refuses this layout: {e}")
    layout = spec_layout(spec)
    prefill_gpus = layout.prefill_gpus or layout.gpus
    decode_gpus = layout.decode_gpus or layout.gpus
    instances = decode_gpus // (1 if layout.dp_attention else layout.tp)
    ttft_ok, tpot_ok = p.ttft_s <= slo.ttft_seconds, p.tpot_ms <= slo.tpot_milliseconds
    predicted = PredictedStatus(
        gpu=p.gpu,
        gpus=layout.gpus,
        sequences=round(p.sequences_per_decode_instance * instances),
        kv_capacity_sequences=p.kv_capacity_sequences,
        ttft_seconds=round(p.ttft_s, 3),
        tpot_milliseconds=round(p.tpot_ms, 2),
        prefill_tokens_per_second=round(p.prefill_tokens_per_s_per_gpu * prefill_gpus),
        decode_tokens_per_second=round(p.decode_tokens_per_s_per_gpu * decode_gpus),
        bound=p.bound,
        meets_slo=ttft_ok and tpot_ok,
    ).model_dump(by_alias=True)
    if ttft_ok and tpot_ok:
        message = (
            f"forecast on {layout.gpus} {p.gpu} GPUs: TTFT {p.ttft_s:.3g} s <= {slo.ttft_seconds:g} s, TPOT "
            f"{p.tpot_ms:.3g} ms <= {slo.tpot_milliseconds:g} ms at {predicted['sequences']} sequences"
        )
        return predicted, ("True", "ForecastMeetsSLO", message)
    misses = []
    if not tpot_ok:
        misses.append(
            f"TPOT {p.tpot_ms:.3g} ms > spec.slo.tpotMilliseconds {slo.tpot_milliseconds:g} even at one sequence a "
            f"GPU (decode bound by {p.bound['decode']})"
        )
    if not ttft_ok:
        misses.append(
            f"TTFT {p.ttft_s:.3g} s > spec.slo.ttftSeconds {slo.ttft_seconds:g} (prefill bound by {p.bound['prefill']})"
        )
    hint = "more GPUs, a faster --gpu, or a looser SLO (expertmesh plan --slo proposes a layout)"
    return predicted, (
        "False",
        "ForecastMissesSLO",
        f"forecast on {layout.gpus} {p.gpu} GPUs: {'; '.join(misses)}: {hint}",
    )


def derived_target(metric: str, p: Prediction, slo, pool_gpus_per_pod: int, role: str) -> float:
    """An autoscaled pool's HPA target from the forecast, when the spec gives none: the waiting a pod can clear
    within the TTFT (prompt tokens, or requests of spec.slo.inputTokens), or the KV share its decode batch within
    the TPOT fills."""
    per_pod = max(1, pool_gpus_per_pod)
    if metric == "kv_utilization":
        capacity = p.kv_capacity_sequences / max(1, p.assumed["decode_gpus"] or p.assumed["gpus"]) * per_pod
        share = p.sequences_per_decode_instance / max(capacity, 1e-9)
        return round(min(1.0, max(0.05, share)), 3)
    tokens = p.prefill_tokens_per_s_per_gpu * per_pod * slo.ttft_seconds
    if metric == "prefill_tokens_waiting":
        return float(max(1, round(tokens)))
    if role == "decode":  # a decode pod takes a handed-off request a step; it keeps up with its batch
        return float(max(1, round(p.sequences_per_decode_instance)))
    return float(max(1, math.floor(tokens / slo.input_tokens)))


def fill_autoscale_targets(spec, cfg) -> list[str]:
    """Give each autoscaled pool without a `target` the forecast's (spec.slo needed); returns, for the caller's
    error, each field that still lacks one and why."""
    missing = []
    pools = (("attentionWorkers", spec.attention_workers), ("prefillWorkers", spec.prefill_workers))
    for field, pool in pools:
        a = pool.autoscale
        if a is None or a.target is not None:
            continue
        if spec.slo is None:
            missing.append(f"spec.{field}.autoscale.target: required without spec.slo")
            continue
        try:
            prediction = spec_forecast(spec, cfg)
        except ValueError as e:
            missing.append(f"spec.{field}.autoscale.target: absent, and the forecast of spec.slo's layout fails ({e})")
            continue
        role = "prefill" if field == "prefillWorkers" else ("decode" if spec.prefill_workers.enabled else "mixed")
        a.target = derived_target(a.metric, prediction, spec.slo, pool.gpus_per_pod, role)
    return missing
