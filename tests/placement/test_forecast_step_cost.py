"""The forecast prices a step once per distinct layer (kind, MoE or dense, attention parameters), not once per layer:
the same StepCost, bit for bit, as summing every layer, at a handful of layer evaluations instead of ~100 — an SLO
search (`expertmesh plan --slo`) prices thousands of steps."""

from __future__ import annotations

import pytest

from expertmesh.forecast import predict as forecast
from expertmesh.forecast.gpus import gpu
from expertmesh.forecast.models import resolve_model
from expertmesh.forecast.predict import Layout, pool_shape, step_cost
from expertmesh.forecast.terms import StepCost


@pytest.mark.parametrize("model", ["full-2.8t", "kimi-k3", "deepseek-v3"])
@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_a_step_costs_what_its_layers_sum_to_pricing_each_distinct_layer_once(model, phase, monkeypatch):
    cfg, g = resolve_model(model), gpu("h200")
    shape = pool_shape(cfg, g, 32, Layout(gpus=32, tp=8), "single")
    step = dict(phase=phase, rows=64.0, seqs=16.0, ctx=3000.0, weights="mxfp4", attention="bf16")

    by_layer = StepCost()  # the definition: every layer priced and summed in order, then the head
    for i, kind in enumerate(cfg.layer_types):
        by_layer = by_layer.merged(forecast._layer(cfg, g, shape, kind, cfg.is_moe_layer(i), i=i, **step))
    head = StepCost()
    rows = step["rows"] if phase == "decode" else step["seqs"]
    forecast.block(
        head,
        g,
        weight_bytes=2 * cfg.vocab_size * cfg.hidden_size / shape.attn_tp,
        flops=2 * cfg.vocab_size * cfg.hidden_size * rows / shape.attn_tp,
        kernels=forecast.terms.KERNELS["head"],
    )
    by_layer = by_layer.merged(head)

    calls = []
    real = forecast._layer

    def counted(*args, **kwargs):
        calls.append(args[3:5])  # (kind, moe)
        return real(*args, **kwargs)

    monkeypatch.setattr(forecast, "_layer", counted)
    got = step_cost(cfg, g, shape, **step)
    assert got.seconds == by_layer.seconds  # exactly: the same terms added in the same order
    distinct = {(kind, cfg.is_moe_layer(i)) for i, kind in enumerate(cfg.layer_types)}
    assert sorted(calls) == sorted(distinct) and len(calls) < cfg.n_layers / 4
