"""The router knows what reached the cluster store without waiting for the workers' listings (`--kv-store`, set by
`expertmesh up --kv-store mooncake`): every prefix an attention worker saves is written through to the store, so the
router counts it there when it records the save. A worker SIGKILLed right after a turn — the router's listing
refresh far away (60 s) — loses no prefix from the router's view: the next turn, placed on the other worker,
restores the whole prompt from the store and gives the reference's tokens (without the flag the router forgot the
dead worker's prefixes and the turn started cold)."""

import random
import time

import httpx
import pytest

pytest.importorskip("mooncake.store", reason="the Mooncake wheel (mooncake-transfer-engine-non-cuda)")

from support.router_client import EOS, grpc_generate  # noqa: E402

from expertmesh.entry.cluster import LocalCluster, free_port  # noqa: E402
from expertmesh.model.transformer import generate  # noqa: E402
from expertmesh.wire.sampling_params import SamplingParams  # noqa: E402

CHUNK = 16
PROMPT = 48  # prefixes saved at 16, 32 and 48 tokens
ANSWER = 4


def metric(url: str, name: str, tier: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{") and f'tier="{tier}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def stored_on(cluster) -> list[float]:
    """Each attention worker's puts made in the store so far."""
    out = []
    for url in cluster.metrics_urls:
        lines = httpx.get(f"{url}/metrics", timeout=10).text.splitlines()
        out.append(sum(float(x.rsplit(" ", 1)[1]) for x in lines if x.startswith("expertmesh_kv_store_puts_total{")))
    return out


def until(check, what: str, timeout: float):
    deadline = time.monotonic() + timeout
    while not (found := check()):
        assert time.monotonic() < deadline, what
        time.sleep(0.05)
    return found


def down(cluster) -> list[int]:
    return httpx.get(f"http://127.0.0.1:{cluster.http_port}/health", timeout=10).json()["attention_workers_down"]


def test_a_worker_killed_right_after_a_turn_loses_no_prefix_from_the_routers_view(tiny_checkpoint):
    model = tiny_checkpoint.load_model()

    def reference(prompt):
        params = SamplingParams(max_tokens=ANSWER, stop_token_ids=(EOS,))
        return generate(model, prompt, params, prefill_chunk=CHUNK).tokens

    with LocalCluster(
        tiny_checkpoint.path,
        attention_workers=2,
        expert_workers=1,
        kv_blocks=16,
        kv_store="mooncake",
        attention_metrics=True,
        router_args=["--prefix-index-refresh-s", "60"],  # no listing read between the turn and the kill
        http_port=free_port(),
        grpc_port=free_port(),
    ) as cluster:
        address = f"127.0.0.1:{cluster.grpc_port}"
        before = stored_on(cluster)
        prompt = [random.Random(7).randrange(256) for _ in range(PROMPT)]
        answer, _ = grpc_generate(address, prompt, ANSWER)
        assert answer == reference(prompt)
        after = until(  # the worker's write-through puts made (the router is not told: it counted them at the save)
            lambda: (now := stored_on(cluster)) and max(a - b for a, b in zip(now, before)) >= PROMPT // CHUNK and now,
            "the session's prefixes never reached the store",
            10,
        )
        worker = max(range(2), key=lambda i: after[i] - before[i])
        other = 1 - worker
        hits = metric(cluster.metrics_urls[other], "expertmesh_kv_tier_hits_total", "store")
        cluster.kill(f"attention-{worker}")
        until(lambda: worker in down(cluster), "the router never saw it down", 15)
        turn2 = prompt + answer + [random.Random(8).randrange(256) for _ in range(CHUNK)]
        tokens, finish = grpc_generate(address, turn2, ANSWER)
        assert tokens == reference(turn2)
        assert finish.usage.cached_tokens >= 0.9 * len(prompt)
        assert metric(cluster.metrics_urls[other], "expertmesh_kv_tier_hits_total", "store") >= hits + 1
