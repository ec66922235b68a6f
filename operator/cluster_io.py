"""What the MoEDeployment handlers (handlers.py) read from and write to the world: the injectable edges (`Deps`: the
Kubernetes API, the router's load over HTTP, the planning process, pod logs) and the reads and writes the handlers
share — the plan and load ConfigMaps, the observed sizes of autoscaled pools, the Secrets made once, applying the
children and deleting those the spec no longer has, the pods of a deployment and their checkpoint fetches' progress.
A transient API failure becomes `kopf.TemporaryError` (Kopf retries the handler after a backoff)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import aiohttp
import kopf

from expertmesh.checkpoint.fetch import parse_progress
from expertmesh.operator.budget import PLAN_MEMORY_BUDGET, PLAN_WORK_BUDGET, check_children
from expertmesh.operator.children import absent_children, build_children, revision, template_hashes
from expertmesh.operator.kube import Kube, KubeError
from expertmesh.operator.lws import workload_kind
from expertmesh.operator.lws_restarts import bounded_sets
from expertmesh.operator.naming import (
    FETCH_CONTAINER,
    load_configmap_name,
    plan_configmap_name,
    router_salt_secret_name,
    worker_tls_secret_name,
)
from expertmesh.operator.placement_policy import parse_load
from expertmesh.operator.planning import PlanRunner
from expertmesh.operator.pod_security import DEFAULT_ALLOWED_HOST_PATHS
from expertmesh.operator.pods import PodInfo
from expertmesh.operator.pools import attention_pools
from expertmesh.operator.router_salt import SALT_BYTES, router_salt_secret, shares_salt
from expertmesh.operator.worker_tls import missing_hosts, worker_tls_hosts, worker_tls_secret
from expertmesh.placement.plan import PlacementPlan
from expertmesh.runtime.tls import pki_pems

log = logging.getLogger("expertmesh.operator")

LOAD_TIMEOUT = 10.0  # seconds for the router's /v1/load
MAX_BACKOFF = 120.0


# ------------------------------------------------------------------------------------------------ edges
async def _fetch_load_http(url: str, timeout: float) -> dict:
    """GET the router's load statistics (JSON)."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session:
        async with session.get(url) as resp:
            resp.raise_for_status()
            return await resp.json()


@dataclass
class Deps:
    """Everything the handlers reach outside the process (given to Kopf as `memo`)."""

    kube: Kube
    fetch_load: Callable[[str, float], Awaitable[dict]] = _fetch_load_http
    load_timeout: float = LOAD_TIMEOUT
    # the tail of a container's log (namespace, pod, container) → text; default: the API's pods/log
    read_log: Callable[[str, str, str], Awaitable[str]] | None = None
    # per-resource state: one reconciliation at a time per MoEDeployment; plans parsed once per hash;
    # the last observed load (used when re-planning around a lost pod)
    locks: dict = field(default_factory=dict)
    plans: dict = field(default_factory=dict)
    loads: dict = field(default_factory=dict)
    last_check: dict = field(default_factory=dict)
    scales: dict = field(default_factory=dict)  # (namespace, StatefulSet) → the attention pool's replicas last seen
    # planning: its process (deadline, memory limit) and the estimated cost the operator agrees to compute
    planning: PlanRunner = field(default_factory=PlanRunner)
    plan_memory: int = PLAN_MEMORY_BUDGET
    plan_work: int = PLAN_WORK_BUDGET
    # the node directories a spec may mount (hostPath), as the cluster admin gave them (--allowed-host-paths)
    allowed_host_paths: tuple[str, ...] = DEFAULT_ALLOWED_HOST_PATHS

    def __post_init__(self):
        if self.read_log is None:
            self.read_log = self.kube.read_log

    def lock(self, key) -> asyncio.Lock:
        return self.locks.setdefault(key, asyncio.Lock())


# ------------------------------------------------------------------------------------------------ helpers
def _backoff(retry: int) -> float:
    return min(MAX_BACKOFF, 2.0 ** min(retry, 10))


async def _api(call: Awaitable, retry: int = 0):
    """Await a Kube call; a transient failure becomes kopf.TemporaryError (Kopf retries the handler after a
    backoff), a refusal stays a KubeError."""
    try:
        return await call
    except KubeError as e:
        if e.transient:
            raise kopf.TemporaryError(f"Kubernetes API: {e}", delay=_backoff(retry)) from None
        raise


async def _read_plan(deps: Deps, namespace: str, name: str, retry: int = 0) -> PlacementPlan | None:
    cm = await _api(deps.kube.get("v1", "ConfigMap", namespace, plan_configmap_name(name)), retry)
    text = ((cm or {}).get("data") or {}).get("plan.json")
    if not text:
        return None
    key = (namespace, name, hash(text))
    if key not in deps.plans:
        try:
            deps.plans = {k: v for k, v in deps.plans.items() if k[:2] != (namespace, name)}
            deps.plans[key] = await asyncio.to_thread(PlacementPlan.from_json, text)  # up to 1 MiB to validate
        except ValueError as e:
            log.warning("%s/%s: ignoring the unreadable plan in its ConfigMap: %s", namespace, name, e)
            return None
    return deps.plans[key]


async def _read_load(deps: Deps, namespace: str, name: str, cfg):
    """The load kept in the `<name>-load` ConfigMap (None when absent or unreadable)."""
    try:
        cm = await _api(deps.kube.get("v1", "ConfigMap", namespace, load_configmap_name(name)))
        text = ((cm or {}).get("data") or {}).get("load.json")
        return parse_load(json.loads(text), cfg) if text else None
    except (KubeError, kopf.TemporaryError, ValueError) as e:
        log.warning("%s/%s: no usable kept load: %s", namespace, name, e)
        return None


async def _ensure_worker_tls(deps: Deps, owner: dict, name: str, namespace: str, spec, retry: int = 0) -> None:
    """Create the deployment's worker mutual-TLS Secret once: kept as it is across re-plans and operator restarts
    (new certificates would split running pods into two trust domains); deleted with the resource (owner)."""
    if not spec.security.worker_tls:
        return
    existing = await _api(deps.kube.get("v1", "Secret", namespace, worker_tls_secret_name(name)), retry)
    if existing is not None:
        missing = missing_hosts(existing, worker_tls_hosts(name, namespace)) if spec.prefill_workers.enabled else []
        if missing:  # made by an operator before the prefill pool's name was in it: kept (see docs/operator.md)
            log.warning(
                "%s/%s: the Secret %s names no %s: the router cannot verify the prefill workers; delete it and "
                "restart the pods to re-issue",
                namespace,
                name,
                worker_tls_secret_name(name),
                ", ".join(missing),
            )
        return
    secret = worker_tls_secret(name, namespace, spec, pki_pems(worker_tls_hosts(name, namespace), days=3650))
    kopf.adopt(secret, owner=owner)
    await _api(deps.kube.create_once(secret), retry)


async def _ensure_router_salt(deps: Deps, owner: dict, name: str, namespace: str, spec, retry: int = 0) -> None:
    """Create the deployment's salt Secret once (router_salt.shares_salt: router replicas > 1, whose prefix keys it
    salts alike, or a KV disk tier, whose files' MAC key it is): kept as it is
    across reconciles and operator restarts (a new salt would orphan every cached prefix); deleted with the
    resource (owner)."""
    if not shares_salt(spec):
        return
    if await _api(deps.kube.get("v1", "Secret", namespace, router_salt_secret_name(name)), retry) is not None:
        return
    secret = router_salt_secret(name, namespace, spec, os.urandom(SALT_BYTES))
    kopf.adopt(secret, owner=owner)
    await _api(deps.kube.create_once(secret), retry)


async def _observed_replicas(deps: Deps, namespace: str, name: str, spec, retry: int = 0) -> dict[str, int]:
    """component → the replicas of each autoscaled attention pool's StatefulSet now (what its HorizontalPodAutoscaler
    set); a pool whose StatefulSet does not exist yet is left out (pools.pool_replicas: minReplicas)."""
    out: dict[str, int] = {}
    for pool in attention_pools(name, spec):
        if pool.autoscale is None:
            continue
        sts = await _api(deps.kube.get(*workload_kind(spec), namespace, pool.statefulset), retry)  # or its LWS
        replicas = ((sts or {}).get("spec") or {}).get("replicas")
        if isinstance(replicas, int) and not isinstance(replicas, bool):
            out[pool.component] = replicas
    return out


def _pool_sizes(name: str, spec, observed: dict[str, int]) -> dict[str, int]:
    return {p.component: p.replicas for p in attention_pools(name, spec, observed)}


async def _delete_absent(deps: Deps, owner: dict, name: str, namespace: str, spec, retry: int = 0) -> None:
    """Delete the children this spec no longer has, of every kind (children.absent_children) — only those this
    MoEDeployment owns."""
    uid = (owner.get("metadata") or {}).get("uid")
    for api_version, kind, child in absent_children(name, spec, other_kinds=True):
        obj = await _api(deps.kube.get(api_version, kind, namespace, child), retry)
        owners = ((obj or {}).get("metadata") or {}).get("ownerReferences") or []
        if obj is not None and uid and any(r.get("uid") == uid for r in owners):
            await _api(deps.kube.delete(api_version, kind, namespace, child), retry)
            log.info("%s/%s: deleted %s %s (no longer in the spec)", namespace, name, kind, child)


async def _apply_children(
    deps: Deps,
    owner: dict,
    name: str,
    namespace: str,
    spec,
    cfg,
    plan,
    retry: int = 0,
    observed: dict[str, int] | None = None,
) -> tuple[str, dict[str, str]]:
    """Apply every child; returns the revision (hash of the desired children, for `status.revision`) and the
    pod-template hashes per component. BudgetError (nothing sent) when a child is larger than the API takes.
    `observed`: the autoscaled pools' replicas now (read here when not given): kept as they are."""
    if observed is None:
        observed = await _observed_replicas(deps, namespace, name, spec, retry)
    generation = (owner.get("metadata") or {}).get("generation")
    bounded = bounded_sets(owner.get("status"), generation)  # sets whose group restarts reached the bound
    children = build_children(name, namespace, spec, cfg, plan, observed, bounded)
    check_children(children)
    await _ensure_worker_tls(deps, owner, name, namespace, spec, retry)  # before the pods that mount it
    await _ensure_router_salt(deps, owner, name, namespace, spec, retry)
    rev, templates = revision(children), template_hashes(children)
    kopf.adopt(children, owner=owner)  # owner references (garbage collection), namespace, owner labels
    for child in children:
        await _api(deps.kube.apply(child), retry)
    await _delete_absent(deps, owner, name, namespace, spec, retry)
    return rev, templates


def _pods(index, namespace: str, name: str) -> list[PodInfo]:
    try:
        return [p for p in index.get((namespace, name), []) if p is not None]
    except (AttributeError, TypeError):
        return []


async def _fetch_progress(deps: Deps, namespace: str, pods: list[PodInfo]) -> dict[str, float | None]:
    """pod → the percentage of its checkpoint fetch, from the last progress line of its fetch container's log
    (None when the log cannot be read yet)."""

    async def one(p: PodInfo) -> float | None:
        try:
            return parse_progress(await deps.read_log(namespace, p.name, FETCH_CONTAINER))
        except Exception:  # not started, gone, or the API refused: no figure this time
            return None

    fetching = [p for p in pods if p.fetch == "running"]
    return dict(zip([p.name for p in fetching], await asyncio.gather(*(one(p) for p in fetching))))


def _changed(current: dict, update: dict) -> bool:
    return any(current.get(k) != v for k, v in update.items())
