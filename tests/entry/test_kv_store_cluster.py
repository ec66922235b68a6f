"""The cluster KV tier as `expertmesh up --kv-store mooncake` runs it (LocalCluster: mooncake_master and its store
process as supervised children, two attention workers its clients), one deployment shared by the tests: the master
killed fails no request (the workers serve from their local tiers, every store call bounded by its deadline) and,
restarted, the store takes puts again; a session's prefix that reached the store (written through when it was
saved: no memory pressure needed) survives its attention worker's SIGKILL — the next turn, placed on the other
worker, restores it from the store (cached ≥ 0.9 of the previous prompt) and gives the reference's tokens."""

import random
import time

import httpx
import pytest

pytest.importorskip("mooncake.store", reason="the Mooncake wheel (mooncake-transfer-engine-non-cuda)")

from support.router_client import EOS, grpc_generate  # noqa: E402

from expertmesh.entry.cluster import LocalCluster, free_port  # noqa: E402
from expertmesh.model.transformer import generate  # noqa: E402
from expertmesh.wire.sampling_params import SamplingParams  # noqa: E402
from expertmesh.worker.kv_store import connect_mooncake  # noqa: E402

CHUNK = 16
PROMPT = 48  # three chunks: prefixes saved at 16, 32 and 48 tokens
ANSWER = 4
REQUEST_S = 20.0  # a request answered within this (the client's deadline is 120 s)


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return tiny_checkpoint.load_model()


@pytest.fixture(scope="module")
def cluster(tiny_checkpoint):
    with LocalCluster(
        tiny_checkpoint.path,
        attention_workers=2,
        expert_workers=1,
        kv_blocks=16,
        kv_store="mooncake",
        attention_metrics=True,
        router_args=["--prefix-index-refresh-s", "0.3"],
        http_port=free_port(),
        grpc_port=free_port(),
    ) as c:
        yield c


def metric(url: str, name: str, tier: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{") and f'tier="{tier}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def reference(model, prompt: list[int]) -> list[int]:
    return generate(model, prompt, SamplingParams(max_tokens=ANSWER, stop_token_ids=(EOS,)), prefill_chunk=CHUNK).tokens


def ask(cluster, model, prompt: list[int]):
    """One request through the router: answered within REQUEST_S, the reference's tokens; its Finish."""
    start = time.monotonic()
    tokens, finish = grpc_generate(f"127.0.0.1:{cluster.grpc_port}", prompt, ANSWER)
    assert time.monotonic() - start < REQUEST_S
    assert tokens == reference(model, prompt)
    return tokens, finish


def until(check, what: str, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while not (found := check()):
        assert time.monotonic() < deadline, what
        time.sleep(0.1)
    return found


def router_health(cluster) -> dict:
    return httpx.get(f"http://127.0.0.1:{cluster.http_port}/health", timeout=10).json()


def store_takes_puts(cluster) -> None:
    """Wait until the store takes a put (a restarted master: the store process has mounted its memory again)."""
    s = cluster.kv_store
    client = until(lambda: try_connect(s), "the store never took a client")
    until(lambda: client.upsert("expertmesh-test/probe", b"x") == 0, "the store never took a put")
    client.close()


def try_connect(service):
    try:
        return connect_mooncake(service.master_address, service.metadata_url, "127.0.0.1")
    except RuntimeError:
        return None


def stored_on(cluster) -> list[float]:
    """Each attention worker's puts made in the store so far (a counter: the router's drops do not lower it)."""
    out = []
    for url in cluster.metrics_urls:
        lines = httpx.get(f"{url}/metrics", timeout=10).text.splitlines()
        out.append(sum(float(x.rsplit(" ", 1)[1]) for x in lines if x.startswith("expertmesh_kv_store_puts_total{")))
    return out


def session(cluster, model, seed: int, puts: int) -> tuple[list[int], list[int], int]:
    """A new session's first turn, `puts` of its saved prefixes in the store → (prompt, answer, the worker that
    served it)."""
    before = stored_on(cluster)
    prompt = [random.Random(seed).randrange(256) for _ in range(PROMPT)]
    answer, _ = ask(cluster, model, prompt)
    after = until(
        lambda: (now := stored_on(cluster)) and max(a - b for a, b in zip(now, before)) >= puts and now,
        f"fewer than {puts} prefixes of the session reached the store",
        10,
    )
    worker = max(range(len(after)), key=lambda i: after[i] - before[i])
    time.sleep(1.5)  # the router's index reads the workers' listings (tier "store") every 0.3 s
    return prompt, answer, worker


def test_the_master_killed_fails_no_request_and_restarted_the_store_takes_puts_again(cluster, model):
    session(cluster, model, seed=1, puts=PROMPT // CHUNK)
    cluster.kill("kv-store-master")  # the binary dies with its wrapper: the master is really gone
    rng = random.Random(2)
    for _ in range(2):  # saves (write-through puts) and lookups meet a dead master: answered from the local tiers
        ask(cluster, model, [rng.randrange(256) for _ in range(PROMPT)])
    assert router_health(cluster)["attention_workers_down"] == []
    cluster.restart("kv-store-master")
    store_takes_puts(cluster)
    time.sleep(2.5)  # the workers' back-off after the failed calls (retry_after_s 2 s)
    session(cluster, model, seed=3, puts=1)  # its puts land


def test_a_killed_workers_prefix_is_restored_from_the_store_on_the_other_worker(cluster, model):
    store_takes_puts(cluster)
    prompt, answer, worker = session(cluster, model, seed=4, puts=PROMPT // CHUNK)  # up to the prompt's end
    other = 1 - worker
    hits = metric(cluster.metrics_urls[other], "expertmesh_kv_tier_hits_total", "store")
    cluster.kill(f"attention-{worker}")
    until(lambda: worker in router_health(cluster)["attention_workers_down"], "the router never saw it down", 15)
    turn2 = prompt + answer + [random.Random(5).randrange(256) for _ in range(CHUNK)]
    _, finish = ask(cluster, model, turn2)
    assert finish.usage.cached_tokens >= 0.9 * len(prompt)
    assert metric(cluster.metrics_urls[other], "expertmesh_kv_tier_hits_total", "store") >= hits + 1


def test_up_refuses_a_bad_kv_store_flag_naming_it(capsys):
    from expertmesh.entry.cli import main

    assert main(["up", "--kv-store-gib", "0"]) == 2
    assert "--kv-store-gib 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["up", "--kv-store", "redis"])
    assert "--kv-store" in capsys.readouterr().err
