"""The router's state under the metric names the serving ecosystem reads (`vllm:` — vLLM's): the Gateway API
Inference Extension's endpoint pickers, llm-d, KServe and Dynamo, and the dashboards and autoscaler rules written
for vLLM read these four from a model server's /metrics. Beside the router's own `expertmesh_` metrics (same
values, read at scrape time from the same engine), never instead of them.

  * `vllm:num_requests_running`, `vllm:num_requests_waiting` — requests in the running batch / waiting to enter it;
  * `vllm:kv_cache_usage_perc` — used / total KV blocks over the live attention workers, 0..1 (vLLM's name, its
    fraction);
  * `vllm:cache_config_info` — 1, its labels the KV cache's shape: `block_size` (tokens per block), `num_gpu_blocks`
    (device blocks over the live attention workers: block_size × num_gpu_blocks tokens fit), `enable_prefix_caching`.

Labels as vLLM's: `model_name` (the served model) and `engine` ("0": the router is one engine to its callers), plus
`pool` — one series per attention pool (router/disagg.py): "mixed" in a colocated deployment; "prefill" and
"decode" beside a prefill pool, each counted as a vLLM instance of that role counts (the decode pool's waiting
requests include the sequences waiting for their hand-off, the prefill pool runs only the prompts it computes).
"""

from __future__ import annotations

from prometheus_client.core import GaugeMetricFamily

from expertmesh.router.disagg import pool_load

LABELS = ["model_name", "engine", "pool"]
ENGINE = "0"


def vllm_metrics(eng):
    """The vLLM-named families for engine `eng` (router/engine.py), per pool."""
    model = eng.model_name
    running = GaugeMetricFamily("vllm:num_requests_running", "Requests in the running batch", labels=LABELS)
    waiting = GaugeMetricFamily("vllm:num_requests_waiting", "Requests waiting to enter the batch", labels=LABELS)
    if not eng.started:  # no worker asked yet: nothing runs, the queue by the pool each request is bound for
        queued = [eng.pools.bound_for(len(r.prompt), frozenset()) for r in list(eng.waiting)]
        for pool in sorted(set(eng.pools.kinds)):
            running.add_metric([model, ENGINE, pool], 0)
            waiting.add_metric([model, ENGINE, pool], queued.count(pool))
        yield running
        yield waiting
        return
    down = frozenset(eng.attention_down)
    waiting_reqs, running_reqs = list(eng.waiting), list(eng.running)
    loads = pool_load(eng.pools, eng.kv, down, waiting_reqs, running_reqs)
    usage = GaugeMetricFamily(
        "vllm:kv_cache_usage_perc",
        "KV-cache usage: used / total blocks of the live attention workers (0..1)",
        labels=LABELS,
    )
    info = GaugeMetricFamily(
        "vllm:cache_config_info",
        "The KV cache's configuration (labels; the value is 1)",
        labels=[*LABELS, "block_size", "num_gpu_blocks", "enable_prefix_caching"],
    )
    for pool, load in loads.items():
        labels = [model, ENGINE, pool]
        running.add_metric(labels, sum(1 for r in running_reqs if running_in(eng.pools, r, pool)))
        waiting.add_metric(labels, load.requests_waiting)
        usage.add_metric(labels, load.kv_utilization)
        live = [eng.kv.workers[w] for w in eng.pools.members(pool) if w not in down]
        block_size = live[0].block_size if live else eng.kv.workers[min(eng.pools.members(pool))].block_size
        info.add_metric([*labels, str(block_size), str(sum(w.total_blocks for w in live)), "True"], 1.0)
    yield running
    yield waiting
    yield usage
    yield info


def running_in(pools, req, pool: str) -> bool:
    """Whether running request `req` counts as running in `pool`: placed on one of its workers, and — on a
    prefill worker — still computing its prompt (one done there waits for its hand-off: the decode pool's)."""
    if req.worker < 0 or pools.name(req.worker) != pool:
        return False
    return pool != "prefill" or req.computed < len(req.prompt)
