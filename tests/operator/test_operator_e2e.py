"""End to end: the operator (Kopf, for real) against kmock's Kubernetes emulator, with `kube_harness.LocalNode`
playing the StatefulSet/Deployment controllers and the kubelet — every pod runs as a real local process (the
workers and the router from the pods' own command lines), marked Ready when it prints READY.

A `tiny` MoEDeployment (1 attention worker, 2 expert workers holding a replica of every expert, 1 router) whose
checkpoint is served over loopback HTTP (slowly) is fetched by each pod's init container into the node's cache —
once for the node, every file verified, `Downloading N%` in the status meanwhile — and reaches Ready; a chat request is served through the router at the endpoint the status reports, with the spec's thinking
limits and context length as the router's (`spec.thinking` / `spec.kv.maxContext` → router flags); an expert pod is deleted
(its process SIGKILLed) while requests stream in: every request still succeeds with the same greedy tokens, the
resource goes Degraded (ReplicasServing) and back to Ready once the StatefulSet's pod is recreated and serving,
and the router takes the worker back. Then `redundantExperts` changes under traffic: a new plan is published, no pod
template changes and no pod restarts, the router adopts the plan live (the expert pods load / drop shards in place)
and every request in flight completes with the same greedy tokens. Every process exits at the end. A checkpoint with a corrupted file is
refused: the fetch fails and the WeightsReady condition names the file.

Nothing of ours is mocked; the only stand-ins are Kubernetes itself (emulator + LocalNode) and its networking
(loopback ports for pod/Service DNS names — also used by the operator's real HTTP read of the router's load).
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import time

import httpx
import kmock
import openai
import pytest
from support.fetch_server import Faults, FileServer
from support.kopf_cluster import NS, eventually, operator, pod_uids, tiny_spec
from support.kube_harness import LocalNode

from expertmesh.checkpoint.fetch_index import INDEX_NAME, write_index
from expertmesh.operator.handlers import _fetch_load_http
from expertmesh.operator.naming import attention_name, expert_name, pod_dns, router_name, worker_tls_secret_name
from expertmesh.operator.spec import GROUP, PLURAL, VERSION
from expertmesh.operator.status import condition
from expertmesh.wire.clients import RemoteAttention, RemoteExpert
from expertmesh.wire.worker_api import WorkerUnavailable

pytestmark = [
    pytest.mark.asyncio,
    pytest.mark.slow,
    pytest.mark.timeout(240),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]  # kmock's importlib.resources use

NAME = "kimi"
MAX_TOKENS = 8
PROMPTS = ["Hello there", "What is a mixture of experts?"]
THINKING = {"low": 3, "high": 5, "max": 7}  # spec.thinking: reasoning-token limits per tier
MAX_CONTEXT = 1024  # spec.kv.maxContext
MAX_BACKGROUND = 200  # bound on the requests sent while the pod is lost and recovers (one every ~0.5 s)


def _versions(c, since: int) -> list[dict]:
    """The MoEDeployment's stored versions from index `since` on (the emulator keeps every write, so a
    short-lived phase cannot be missed by polling)."""
    hist = c.emu.objects[kmock.resource(f"{GROUP}/{VERSION}/{PLURAL}"), NS, NAME].history
    return [json.loads(json.dumps(v.raw, default=dict)) for v in list(hist)[since:] if v is not None]


def phases_since(c, since: int) -> list[str]:
    """The phases the MoEDeployment went through since version `since`, repeats collapsed."""
    out: list[str] = []
    for v in _versions(c, since):
        phase = (v.get("status") or {}).get("phase")
        if phase and (not out or out[-1] != phase):
            out.append(phase)
    return out


def history_len(c) -> int:
    return len(c.emu.objects[kmock.resource(f"{GROUP}/{VERSION}/{PLURAL}"), NS, NAME].history)


async def chat(client: openai.AsyncOpenAI, prompt: str):
    raw = await client.chat.completions.with_raw_response.create(
        model="tiny", messages=[{"role": "user", "content": prompt}], max_completion_tokens=MAX_TOKENS, temperature=0
    )
    return raw.status_code, raw.parse()


async def send(client: openai.AsyncOpenAI, prompt: str, results: list) -> None:
    """One chat request; appends (start, end, prompt, the message or the error)."""
    start = time.monotonic()
    try:
        code, resp = await chat(client, prompt)
        out = resp.choices[0].message if code == 200 else f"HTTP {code}"
    except openai.APIError as e:
        out = e
    results.append((start, time.monotonic(), prompt, out))


@pytest.fixture(scope="module")
def published(tmp_path_factory, tiny_checkpoint_copy):
    """The tiny checkpoint as a web server would publish it: its files and their sha256 index."""
    d = tiny_checkpoint_copy(tmp_path_factory.mktemp("published") / "tiny")
    write_index(d)
    return d


async def test_tiny_deployment_serves_and_survives_an_expert_pod_loss(published, tmp_path):
    node: LocalNode | None = None

    async def fetch_load(url: str, timeout: float) -> dict:  # the operator's real HTTP GET, via the Service
        return await _fetch_load_http(node.resolve_url(url), timeout)

    async def read_log(namespace: str, pod: str, container: str) -> str:  # the API's pods/log
        return await node.read_log(namespace, pod, container)

    faults = Faults(delay=0.1)  # a slow link: the fetch takes a few seconds, long enough to watch its progress
    with FileServer(published, faults) as srv:
        async with operator(fetch_load=fetch_load, tick=0.2, read_log=read_log) as c:
            node = LocalNode(c.emu, NS, tmp_path / "node")
            try:
                async with node:
                    await run_scenario(c, node, srv.url)
                    procs = await node.stop()
                # 4. clean shutdown: every process exited, no orphans; the processes running at the end stopped
                # cleanly on SIGTERM (0), the lost pod's was SIGKILLed (a run that crashed on its own and was
                # restarted, e.g. a router started before its attention worker served, may have any code)
                assert all(p.popen.poll() is not None for p in procs), node.logs()
                assert [p.pod for p in procs if p.killed] == [f"{NAME}-expert-1"]
                assert [p.popen.returncode for p in procs if p.killed] == [-9]
                assert [p.popen.returncode for p in node.running.values()] == [0] * 4, node.logs()
                assert node.orphans() == []
                assert node.errors == []
            finally:
                node.kill_all()
    # fetched once for the node: each file was served once (pods on the node share its cache directory)
    served = [p for p, _, status in faults.requests if status == 200 and p != INDEX_NAME]
    assert sorted(served) == sorted(x["path"] for x in json.loads((published / INDEX_NAME).read_text())["files"])


def worker(node: LocalNode, client, statefulset: str, ordinal: int):
    """A client of one worker pod, dialled at its pod DNS name with the deployment's client certificate (as an
    administrator holding the Secret would)."""
    return node.tls_client(client, pod_dns(NAME, NS, statefulset, ordinal), worker_tls_secret_name(NAME), timeout=10)


async def run_scenario(c, node: LocalNode, source: str) -> None:
    # 1. a tiny MoEDeployment: 2 expert pods, 16 redundant slots per layer → every expert on both pods
    # with serving overrides the router must enforce (tiny's own: thinking 8/24/48, context 4096)
    # the checkpoint comes over (loopback) HTTP: each pod's init container fetches it into the node's cache
    spec = tiny_spec(experts=2, slots_per_pod=48, redundant=16)
    spec.update(thinking=THINKING, kv={"maxContext": MAX_CONTEXT})
    spec["model"]["checkpoint"] = {"uri": source + "/"}
    await c.create_moe(NAME, spec)
    try:
        await eventually(lambda: c.status(NAME).get("phase") == "Ready", timeout=90, what="phase Ready")
    except AssertionError as e:
        raise AssertionError(f"{e}\nstatus: {c.status(NAME)}\n{node.logs()}\n{node.errors}") from None
    st = c.status(NAME)
    conds = {x["type"]: x["status"] for x in st["conditions"]}
    assert conds == {
        "PlacementReady": "True",
        "WeightsReady": "True",
        "WorkersReady": "True",
        "RouterReady": "True",
        "Degraded": "False",
    }
    assert c.condition(NAME, "WeightsReady")["reason"] == "Verified"
    # the download's progress was in the status while it ran: `Downloading N%`, rising
    seen = [
        int(mt.group(1))
        for v in _versions(c, 0)
        if (mt := re.match(r"Downloading (\d+)%", (v.get("status") or {}).get("message") or ""))
    ]
    assert seen and seen == sorted(seen) and any(0 < p < 100 for p in seen), seen
    assert (st["readyWorkers"], st["desiredWorkers"], st["router"]) == (3, 3, {"ready": 1, "desired": 1})
    plan = c.plan(NAME)
    assert all(len(plan.replicas(layer, e)) == 2 for layer, e in plan.experts_of(0))
    expert_pods = [f"{NAME}-expert-0", f"{NAME}-expert-1"]
    # each pod ran its own command line: names from $(POD_NAME) / the hostname, the expert's ordinal from its
    # hostname (through /bin/sh), its experts from the plan in the ConfigMap volume, reached at its pod DNS name
    for i, pod in enumerate(expert_pods):
        with worker(node, RemoteExpert, expert_name(NAME), i) as w:
            info = await asyncio.to_thread(w.info)
        assert info["name"] == pod and sorted(info["experts"]) == sorted(plan.experts_of(i))
    with worker(node, RemoteAttention, attention_name(NAME), 0) as w:
        assert (await asyncio.to_thread(w.info))["name"] == f"{NAME}-attention-0"
    # the workers serve mutual TLS with the deployment's own certificates (Secret <name>-worker-tls): a client
    # without them is refused
    with RemoteExpert(node.resolve(pod_dns(NAME, NS, expert_name(NAME), 0)), timeout=5) as w:
        with pytest.raises(WorkerUnavailable):
            await asyncio.to_thread(w.info)

    # 2. a chat request through the router, at the endpoint the status reports
    base = node.resolve_url(f"http://{st['endpoints']['http']}")
    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=30)
    status, r = await chat(client, PROMPTS[0])
    assert status == 200
    assert r.usage.prompt_tokens > 0 and 0 < r.usage.completion_tokens <= MAX_TOKENS
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.choices[0].finish_reason in ("stop", "length")
    expected = {PROMPTS[0]: r.choices[0].message}
    status, r = await chat(client, PROMPTS[1])
    assert status == 200
    expected[PROMPTS[1]] = r.choices[0].message
    # the spec's overrides are what the router serves: thinking limits per tier (a random model never ends its
    # thinking by itself, so it thinks exactly up to the limit) and the context length
    for effort, tier in (("low", "low"), ("medium", "high")):
        r = await client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": PROMPTS[0]}],
            max_completion_tokens=40,
            temperature=0,
            reasoning_effort=effort,
        )
        assert r.usage.completion_tokens_details.reasoning_tokens == THINKING[tier], (tier, r.usage)
    models = await client.models.list()
    assert models.data[0].max_model_len == MAX_CONTEXT
    with pytest.raises(openai.BadRequestError) as e:
        await client.completions.create(model="tiny", prompt=[1] * 10, max_tokens=MAX_CONTEXT)
    assert e.value.code == "context_length_exceeded" and f"{MAX_CONTEXT} tokens" in e.value.message
    # the operator read the router's real /v1/load through the router Service (it rebalances a Ready deployment)
    await eventually(lambda: c.status(NAME).get("lastRebalanceTime"), timeout=10, what="a load read")
    assert c.status(NAME)["placement"]["observedImbalance"] >= 1.0

    # 3. requests keep flowing while an expert pod is lost and comes back
    results: list[tuple[float, float, str, object]] = []  # (start, end, prompt, message or error)
    stop = asyncio.Event()

    async def background():
        for i in range(MAX_BACKGROUND):
            if stop.is_set():
                return
            await send(client, PROMPTS[i % len(PROMPTS)], results)
            await asyncio.sleep(0.2)

    health_down: list[list[int]] = []

    async def watch_health():  # what the router says about its expert workers while this goes on
        async with httpx.AsyncClient(base_url=base, timeout=5) as h:
            while not stop.is_set():
                health_down.append((await h.get("/health")).json()["expert_workers_down"])
                await asyncio.sleep(0.1)

    tasks = [asyncio.create_task(background()), asyncio.create_task(watch_health())]
    try:
        await eventually(lambda: len(results) >= 1, timeout=30, what="a first background request")
        lost = node.process(expert_pods[1])
        mark = history_len(c)
        await c.delete_pod(expert_pods[1])
        await eventually(lambda: lost.killed and lost.popen.poll() is not None, timeout=5, what="the process killed")
        killed_at = time.monotonic()
        assert lost.popen.returncode == -9
        try:
            await eventually(lambda: "Degraded" in phases_since(c, mark), timeout=10, what="Degraded")
            await eventually(lambda: phases_since(c, mark)[-1:] == ["Ready"], timeout=60, what="Ready again")
        except AssertionError as e:
            raise AssertionError(f"{e}\nstatus: {c.status(NAME)}\n{node.logs()}\n{node.errors}") from None
        recovered_at = time.monotonic()
        assert phases_since(c, mark) == ["Degraded", "Ready"]
        degraded = {
            condition(v["status"], "Degraded")["reason"]
            for v in _versions(c, mark)
            if (v.get("status") or {}).get("phase") == "Degraded"
        }
        assert degraded == {"ReplicasServing"}  # every expert the lost pod held had a live replica
        assert c.condition(NAME, "Degraded")["status"] == "False"
        assert c.plan(NAME).plan_hash() == plan.plan_hash()  # replicas served: nothing was re-planned
        back = node.process(expert_pods[1])
        assert back is not lost and back.address and back.restarts == 0  # a new pod (new uid), not a restart
        # the router takes the worker back once it answers its health check
        await eventually(lambda: health_down and health_down[-1] == [], timeout=20, what="router /health ok")
        n_done = len(results)
        await eventually(lambda: len(results) >= n_done + 1, timeout=30, what="a request after recovery")
    finally:
        stop.set()
        done = await asyncio.gather(*tasks, return_exceptions=True)
    assert done == [None, None], done

    failures = [(p, out) for _, _, p, out in results if not isinstance(out, openai.types.chat.ChatCompletionMessage)]
    assert failures == []
    assert all(out.content == expected[p].content for _, _, p, out in results)  # same greedy tokens throughout
    during = [r for r in results if r[1] > killed_at and r[0] < recovered_at]
    assert during, "no request was served while the expert pod was lost"
    assert [1] in health_down  # the router noticed the loss and failed over to the replicas
    assert len(results) < MAX_BACKGROUND

    # a request after recovery
    status, r = await chat(client, PROMPTS[0])
    assert status == 200 and r.choices[0].message.content == expected[PROMPTS[0]].content

    # 5. a live re-plan under traffic: redundantExperts 16 → 4 publishes a new plan; no pod template changes, no
    # pod restarts, the router adopts it (expert workers warm / drop shards, the table switches between steps)
    # and every request in flight completes with the same greedy tokens
    await live_replan(c, node, client, base, expected)


def templates(c) -> str:
    return json.dumps(
        [
            c.get(r, n)["spec"]["template"]
            for r, n in (
                ("apps/v1/statefulsets", expert_name(NAME)),
                ("apps/v1/statefulsets", attention_name(NAME)),
                ("apps/v1/deployments", router_name(NAME)),
            )
        ],
        sort_keys=True,
    )


async def live_replan(c, node: LocalNode, client: openai.AsyncOpenAI, base: str, expected: dict) -> None:
    before, uids, old = templates(c), pod_uids(c), c.plan(NAME)
    results: list[tuple[float, float, str, object]] = []
    stop = asyncio.Event()

    async def traffic(i: int):
        while not stop.is_set():
            await send(client, PROMPTS[i % len(PROMPTS)], results)
            i += 1

    async def served_plan() -> str:
        async with httpx.AsyncClient(base_url=base, timeout=5) as h:
            return (await h.get("/v1/load")).json()["plan_hash"]

    assert await served_plan() == old.plan_hash()
    tasks = [asyncio.create_task(traffic(i)) for i in range(2)]
    try:
        await eventually(lambda: len(results) >= 2, timeout=30, what="traffic")
        start = time.monotonic()
        await c.patch_moe(NAME, {"spec": {"expertWorkers": {"redundantExperts": 4}}})
        await eventually(lambda: c.status(NAME)["placement"]["planHash"] != old.plan_hash(), what="a new plan")
        new = c.plan(NAME)
        deadline = time.monotonic() + 60
        while await served_plan() != new.plan_hash():
            assert time.monotonic() < deadline, f"the router did not adopt plan {new.plan_hash()}\n{node.logs()}"
            await asyncio.sleep(0.1)
        switched = time.monotonic()
        n = len(results)
        await eventually(lambda: len(results) >= n + 2, timeout=30, what="requests on the new plan")
    finally:
        stop.set()
        await asyncio.gather(*tasks)
    assert new.figures.physical_experts < old.figures.physical_experts
    assert templates(c) == before and pod_uids(c) == uids  # byte-identical templates, nothing restarted
    assert c.status(NAME)["phase"] == "Ready"
    for i in range(2):  # each expert pod holds exactly its new shards once drained (--replan-drain-seconds later)
        with worker(node, RemoteExpert, expert_name(NAME), i) as w:
            deadline = time.monotonic() + 30
            while sorted((await asyncio.to_thread(w.info))["experts"]) != sorted(new.experts_of(i)):
                assert time.monotonic() < deadline, f"expert-{i} did not drop the shards the plan took away"
                await asyncio.sleep(0.2)
    failures = [(p, out) for _, _, p, out in results if not isinstance(out, openai.types.chat.ChatCompletionMessage)]
    assert failures == []
    assert all(out.content == expected[p].content for _, _, p, out in results)
    assert any(a < switched and b > start for a, b, *_ in results)  # requests were in flight across the switch


async def test_a_corrupted_checkpoint_file_is_refused_and_named_in_the_status(published, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(published, bad)
    name = "model-layers-00001-00001.safetensors"
    data = bytearray((bad / name).read_bytes())
    data[100] ^= 0x01  # one bit: same size, another sha256
    (bad / name).write_bytes(bytes(data))
    node: LocalNode | None = None

    async def read_log(namespace: str, pod: str, container: str) -> str:
        return await node.read_log(namespace, pod, container)

    with FileServer(bad) as srv:
        async with operator(tick=0.2, read_log=read_log) as c:
            node = LocalNode(c.emu, NS, tmp_path / "node", backoff=(5.0,))
            try:
                async with node:
                    spec = tiny_spec(experts=1, slots_per_pod=48)
                    spec["model"]["checkpoint"] = {"uri": srv.url}
                    await c.create_moe(NAME, spec)
                    cond = await eventually(
                        lambda: (x := c.condition(NAME, "WeightsReady")).get("reason") == "FetchFailed" and x,
                        timeout=40,
                        what="FetchFailed",
                    )
                    assert cond["status"] == "False" and name in cond["message"] and "sha256" in cond["message"]
                    assert c.status(NAME)["phase"] == "Deploying" and name in c.status(NAME)["message"]
                    assert not any(p.container != "fetch" for p in node.history)  # no worker ever started
                    await node.stop()
            finally:
                node.kill_all()
