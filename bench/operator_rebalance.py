"""A re-plan under traffic, measured in the kubelet harness: the operator (Kopf, for real) against kmock's Kubernetes
emulator, every pod a real process (tests/support/kube_harness.py). A tiny MoEDeployment on 4 expert pods serves a stream
of chat requests; `expertWorkers.redundantExperts` goes from 0 to 1, so the planner adds one replica per MoE layer
(minimal movement). The published plan changes no pod template and restarts nothing: the router adopts it live
(expert workers warm the new shards, the router switches its replica table between steps, the old shards are
dropped). The table: shards the planner moved, pods restarted, requests served / failed while it happened, whether
every served answer kept its greedy tokens, and how long until the router served the new plan.

    python bench/operator_rebalance.py [--out bench/results/operator_rebalance.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import httpx  # noqa: E402
import openai  # noqa: E402
from support.kopf_cluster import NS, eventually, operator, tiny_spec  # noqa: E402
from support.kopf_cluster import pod_uids as uids  # noqa: E402
from support.kube_harness import LocalNode  # noqa: E402

from expertmesh.checkpoint.loader import create_checkpoint  # noqa: E402
from expertmesh.model.config import preset  # noqa: E402
from expertmesh.operator.naming import expert_name, pod_dns, router_name, worker_tls_secret_name  # noqa: E402

NAME = "kimi"
PROMPTS = ["Hello there", "What is a mixture of experts?"]
CLIENTS = 4  # concurrent chat clients, back to back


async def chat(node: LocalNode, endpoint: str, prompt: str):
    base = node.resolve_url(f"http://{endpoint}")  # the Service's ready pod, now (the router may have moved)
    async with openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=30) as client:
        r = await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": prompt}], max_completion_tokens=8, temperature=0
        )
    msg = r.choices[0].message
    return json.dumps([getattr(msg, "reasoning_content", None), msg.content])  # the greedy tokens, as text


async def served_plan(node: LocalNode, endpoint: str) -> str | None:
    """The plan hash the router serves (its /v1/load)."""
    try:
        async with httpx.AsyncClient(timeout=5) as client:
            r = await client.get(f"{node.resolve_url(f'http://{endpoint}')}/v1/load")
        return r.json().get("plan_hash")
    except (httpx.HTTPError, ValueError):
        return None


def experts_held(node: LocalNode, plan) -> bool:
    """Every expert pod holds exactly its shards of `plan` (asked over gRPC)."""
    from expertmesh.wire.clients import RemoteExpert

    for o in range(plan.cluster.pods):
        with node.tls_client(
            RemoteExpert, pod_dns(NAME, NS, expert_name(NAME), o), worker_tls_secret_name(NAME), timeout=10
        ) as w:  # the workers serve mutual TLS
            if sorted(w.info()["experts"]) != sorted(plan.experts_of(o)):
                return False
    return True


async def run(tmp: Path) -> dict:
    create_checkpoint(preset("tiny"), tmp / "pv" / "tiny", seed=0)
    async with operator(tick=0.2) as c:
        node = LocalNode(c.emu, NS, tmp / "node", volumes={"weights": tmp / "pv"})
        try:
            async with node:
                await c.create_moe(NAME, tiny_spec(experts=4, slots_per_pod=18))
                await eventually(lambda: c.status(NAME).get("phase") == "Ready", timeout=180, what="Ready")
                endpoint = c.status(NAME)["endpoints"]["http"]
                expected = {p: await chat(node, endpoint, p) for p in PROMPTS}
                before, templates = (
                    uids(c),
                    {
                        k: c.get(*k)["spec"]["template"]
                        for k in (
                            ("apps/v1/statefulsets", expert_name(NAME)),
                            ("apps/v1/deployments", router_name(NAME)),
                        )
                    },
                )
                results: list[tuple[float, float, str, object]] = []  # (start, end, prompt, answer or error)
                stop = asyncio.Event()

                async def traffic(i: int):
                    while not stop.is_set():
                        p = PROMPTS[i % 2]
                        start = time.monotonic()
                        try:
                            out = await chat(node, endpoint, p)
                        except Exception as e:  # connection refused, 5xx, no ready router pod
                            out = e
                        results.append((start, time.monotonic(), p, out))
                        i += 1

                tasks = [asyncio.create_task(traffic(i)) for i in range(CLIENTS)]
                await eventually(lambda: len(results) >= CLIENTS, timeout=30, what="traffic")
                old_hash = c.status(NAME)["placement"]["planHash"]
                t0 = time.monotonic()
                await c.patch_moe(NAME, {"spec": {"expertWorkers": {"redundantExperts": 1}}})
                await eventually(lambda: c.status(NAME)["placement"]["planHash"] != old_hash, timeout=30, what="plan")
                new_hash = c.status(NAME)["placement"]["planHash"]
                await eventually(lambda: c.status(NAME).get("phase") == "Ready", timeout=240, what="Ready again")
                while await served_plan(node, endpoint) != new_hash:
                    if time.monotonic() - t0 > 120:
                        raise TimeoutError("the router did not adopt the new plan within 120 s")
                    await asyncio.sleep(0.1)
                t1 = time.monotonic()
                n = len(results)
                await eventually(lambda: len(results) >= n + 2 * CLIENTS, timeout=60, what="traffic after")
                stop.set()
                await asyncio.gather(*tasks)
                while (
                    not (held := await asyncio.to_thread(experts_held, node, c.plan(NAME)))
                    and time.monotonic() - t1 < 30
                ):  # drained --replan-drain-seconds after the switch
                    await asyncio.sleep(0.2)
                after = uids(c)
                same_templates = all(c.get(*k)["spec"]["template"] == v for k, v in templates.items())
                st = c.status(NAME)
                await node.stop()
        finally:
            node.kill_all()
    failed = [r for *_, r in results if not isinstance(r, str)]
    return {
        "shards_moved": st["placement"]["movedShards"],
        "physical_experts": st["placement"]["physicalExperts"],
        "pods_restarted": sorted(p for p in before if after.get(p) != before[p]),
        "pods_kept": sorted(p for p in before if after.get(p) == before[p]),
        "pod_templates_unchanged": same_templates,
        "expert_pods_hold_the_new_plan": held,
        "requests": len(results),
        "requests_failed": len(failed),
        "requests_during_replan": sum(1 for a, b, *_ in results if a < t1 and b > t0),
        "failures": sorted({type(e).__name__ for e in failed}),
        "tokens_changed": sum(1 for _, _, p, r in results if isinstance(r, str) and r != expected[p]),
        "replan_seconds": round(t1 - t0, 1),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "operator_rebalance.json")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        r = asyncio.run(run(Path(tmp)))
    width = max(map(len, r))
    for k, v in r.items():
        print(f"{k:<{width}}  {v}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(r, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
