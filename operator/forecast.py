"""The forecast (expertmesh/forecast/) as the operator and `expertmesh plan --slo` use it: an SLO from text, the
smallest layout that meets it, and that layout written as a MoEDeployment annotated with its forecast."""

from __future__ import annotations

import json
import math

from expertmesh.forecast.gpus import gpu as gpu_named
from expertmesh.forecast.models import resolve_model
from expertmesh.forecast.predict import MEMORY_FRACTION, Workload, expert_bytes
from expertmesh.forecast.slo import SLO, Proposal, smallest_layout

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
