"""The command lines of a MoEDeployment's pods (operator/children.py builds the pods): the expert and attention
workers' arguments with their KV tiers, and the router's serving and pool arguments; speculative decoding's flags on
the router and every attention worker (the expert workers serve verify steps like any other)."""

from __future__ import annotations

import shlex

from expertmesh.operator.gateway import router_epp_args
from expertmesh.operator.kv_store import kv_store_router_args
from expertmesh.operator.lws import expert_addresses, uses_lws
from expertmesh.operator.naming import (
    HEALTH_PORT,
    KV_DISK_MOUNT,
    PLAN_PATH,
    WORKER_PORT,
    checkpoint_path,
    expert_name,
    statefulset_addresses,
)
from expertmesh.operator.pools import MIXED, Pool, PoolKV, attention_pools, spec_pool_kv
from expertmesh.operator.router_salt import kv_disk_key_args, router_salt_volume
from expertmesh.operator.spec import MoEDeploymentSpec
from expertmesh.operator.worker_tls import worker_tls_args


def expert_worker_command(spec: MoEDeploymentSpec) -> list[str]:
    """The expert container's command: a shell that takes the ordinal from the StatefulSet hostname
    (`<name>-expert-<ordinal>`) and execs the worker (the worker is PID 1's only child; signals reach it)."""
    fixed = [
        "expertmesh",
        "worker",
        "--role",
        "expert",
        "--plan",
        PLAN_PATH,
        "--checkpoint",
        checkpoint_path(spec),
        "--host",
        "0.0.0.0",
        "--port",
        str(WORKER_PORT),
        "--health-port",
        str(HEALTH_PORT),
        *worker_tls_args(spec, "expert"),
    ]
    return ["/bin/sh", "-c", f'exec {shlex.join(fixed)} --ordinal "${{HOSTNAME##*-}}" --name "$HOSTNAME"']


def attention_worker_args(spec: MoEDeploymentSpec, cfg, role: str = MIXED) -> list[str]:
    """An attention worker of a pool (`role`: mixed, prefill or decode — pools.py): its KV sized for the role
    (pools.pool_kv), `--pool` unless mixed (the worker's default)."""
    kv = spec_pool_kv(spec, cfg, role)
    return [
        "worker",
        "--role",
        "attention",
        "--checkpoint",
        checkpoint_path(spec),
        "--host",
        "0.0.0.0",
        "--port",
        str(WORKER_PORT),
        "--health-port",
        str(HEALTH_PORT),
        "--name",
        "$(POD_NAME)",
        "--kv-blocks",
        str(kv.blocks),
        "--block-size",
        str(spec.kv.block_size),
        *(["--pool", role] if role != MIXED else []),
        *kv_tier_args(kv),
        *speculative_args(spec),
        *worker_tls_args(spec, "attention"),
    ]


def speculative_args(spec: MoEDeploymentSpec) -> list[str]:
    """spec.speculative → `--speculative-method M --speculative-tokens K`, the same on the router and on every
    attention worker (prefill and decode pools alike: one deployment, one drafter); absent: nothing (off)."""
    s = spec.speculative
    return [] if s is None else ["--speculative-method", s.method, "--speculative-tokens", str(s.tokens)]


# the disk tier's folder: one the worker creates inside its volume, private to its user (0700) — the volume's own root
# is not (an emptyDir is world-writable, a claim's or node folder's root belongs to root or to the fsGroup), and the
# worker refuses a tier folder anyone else may write
KV_DISK_TIER_DIR = f"{KV_DISK_MOUNT}/tier"


def kv_tier_args(kv: PoolKV) -> list[str]:
    """A pool's KV tiers (spec.kv.hostGiB / spec.kv.disk, where pools.pool_kv puts them) → the attention worker's
    tier flags (the disk tier in its volume, its files keyed by the deployment's salt Secret: router_salt.py)."""
    out = ["--kv-host-gib", f"{kv.host_gib:g}"] if kv.host_gib else []
    if kv.disk is not None:
        out += ["--kv-disk-dir", KV_DISK_TIER_DIR, "--kv-disk-gib", f"{kv.disk.size_gib:g}", *kv_disk_key_args(kv.disk)]
    return out


def router_serving_args(spec: MoEDeploymentSpec) -> list[str]:
    """The spec's serving limits as router flags: `kv.maxContext` → `--max-context` (prompt + output per
    sequence), `thinking` → `--thinking-budgets LOW,HIGH,MAX` (the reasoning-token limits the router enforces).
    Unset fields add nothing: the router serves the checkpoint's own limits."""
    out: list[str] = []
    if spec.kv.max_context is not None:
        out += ["--max-context", str(spec.kv.max_context)]
    if spec.thinking is not None:
        t = spec.thinking
        out += ["--thinking-budgets", f"{t.low},{t.high},{t.max}"]
    return out


def router_pool_args(name: str, namespace: str, spec: MoEDeploymentSpec, pools: list[Pool]) -> list[str]:
    """The router's worker lists: `--attention` the attention StatefulSet's pods (the decode pool beside a prefill
    pool), `--experts` the expert pods, and with a prefill pool `--prefill` its pods (and `--prefill-min-tokens`
    when set) — each pool's pods as many as it has now (an autoscaled pool's change re-renders them: the router
    rolls)."""

    def addresses(pool: Pool) -> str:
        return ",".join(statefulset_addresses(name, namespace, pool.statefulset, pool.replicas))

    exp = (expert_addresses if uses_lws(spec) else statefulset_addresses)(
        name, namespace, expert_name(name), spec.expert_workers.replicas
    )
    out = ["--attention", addresses(pools[0]), "--experts", ",".join(exp)]
    for pool in pools[1:]:
        out += ["--prefill", addresses(pool)]
        if pool.workers.min_prompt_tokens:
            out += ["--prefill-min-tokens", str(pool.workers.min_prompt_tokens)]
    return out


def router_args(name: str, namespace: str, spec: MoEDeploymentSpec, pools: list[Pool] | None = None) -> list[str]:
    pools = pools or attention_pools(name, spec)
    return [
        "router",
        "--checkpoint",
        checkpoint_path(spec),
        "--plan",
        PLAN_PATH,
        *router_pool_args(name, namespace, spec, pools),
        "--host",
        "0.0.0.0",
        "--http-port",
        str(spec.router.http_port),
        "--grpc-port",
        str(spec.router.grpc_port),
        *router_epp_args(name, namespace, spec),
        *(["--transport", spec.transport] if spec.transport != "grpc" else []),
        *router_serving_args(spec),
        *kv_store_router_args(spec),
        *speculative_args(spec),
        *worker_tls_args(spec, "router"),
        *router_salt_volume(name, spec)[2],
    ]
