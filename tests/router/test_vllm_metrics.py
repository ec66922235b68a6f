"""The router's /metrics carries vLLM's four names (router/vllm_metrics.py) beside its own, parsed with
prometheus_client's own text parser from a real router HTTP app over an in-process engine: the families, their
labels (model_name, engine, pool), values that follow the engine (a request running holds KV; the cache's shape
matches the attention workers'), one series per pool beside a prefill pool."""

from __future__ import annotations

import json

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from expertmesh.checkpoint.loader import Checkpoint
from expertmesh.entry.cluster import free_port
from expertmesh.entry.local import build_local_engine
from expertmesh.router.http import build_app, serve_http

NAMES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:cache_config_info")


def scrape(url: str) -> dict[str, list]:
    """{family name: [samples]} of the vLLM families at url/metrics (also checks the router's own are there)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    families = {f.name: f.samples for f in text_string_to_metric_families(text)}
    assert "expertmesh_requests_running" in families  # beside the router's own, not instead
    return {name: families[name] for name in NAMES}


@pytest.fixture
def served(request, tiny_checkpoint_dir):
    engine = build_local_engine(Checkpoint(tiny_checkpoint_dir), kv_blocks=64, **getattr(request, "param", {}))
    port = free_port()
    srv, thread = serve_http(build_app(engine), "127.0.0.1", port)
    yield engine, f"http://127.0.0.1:{port}"
    srv.should_exit = True
    thread.join(timeout=10)
    engine.close()


def by_pool(samples) -> dict[str, object]:
    return {s.labels["pool"]: s for s in samples}


def test_vllm_gauges_follow_a_running_request(served):
    engine, url = served
    idle = scrape(url)
    for name in NAMES:
        (sample,) = idle[name]
        assert sample.labels["model_name"] == engine.model_name and sample.labels["engine"] == "0"
        assert sample.labels["pool"] == "mixed"
    assert idle["vllm:num_requests_running"][0].value == 0
    assert idle["vllm:num_requests_waiting"][0].value == 0
    assert idle["vllm:kv_cache_usage_perc"][0].value == 0
    (info,) = idle["vllm:cache_config_info"]
    assert info.value == 1
    (worker,) = engine.kv.workers
    assert info.labels["block_size"] == str(worker.block_size) == "16"
    assert info.labels["num_gpu_blocks"] == str(worker.total_blocks)
    assert info.labels["enable_prefix_caching"] == "True"

    body = {"model": engine.model_name, "messages": [{"role": "user", "content": "count"}], "max_tokens": 400}
    body.update(stream=True, temperature=0, ignore_eos=True)
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: ") and json.loads(line[6:])["choices"])
        busy = scrape(url)
    assert busy["vllm:num_requests_running"][0].value == 1
    assert 0 < busy["vllm:kv_cache_usage_perc"][0].value <= 1
    used = worker.total_blocks - worker.free_blocks
    assert busy["vllm:kv_cache_usage_perc"][0].value == pytest.approx(used / worker.total_blocks, abs=0.2)


@pytest.mark.parametrize("served", [{"prefill_workers": 1}], indirect=True)
def test_one_series_per_pool_beside_a_prefill_pool(served):
    engine, url = served
    families = scrape(url)
    for name in NAMES:
        assert set(by_pool(families[name])) == {"prefill", "decode"}, name
    infos = by_pool(families["vllm:cache_config_info"])
    for pool, sample in infos.items():
        (w,) = [engine.kv.workers[i] for i in engine.pools.members(pool)]
        assert sample.labels["num_gpu_blocks"] == str(w.total_blocks)
    assert all(s.value == 0 for s in families["vllm:num_requests_waiting"])
