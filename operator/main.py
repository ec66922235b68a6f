"""`expertmesh operator`: run the MoEDeployment operator (Kopf) against the current cluster.

Connects as kubectl does (the pod's service account in a cluster, else KUBECONFIG / ~/.kube/config), watches
one or more namespaces (`--namespace`, repeatable) or the whole cluster, and serves a liveness endpoint
(`--liveness`, Kopf's health probe: 200 while the operator's watch loops are alive). Runs standalone (one
replica) unless `--peering` names a ClusterKopfPeering (cluster-wide) or KopfPeering (with `--namespace`): then
several replicas elect a leader through it — each takes a distinct priority (`--priority`, random by default),
the highest live one handles everything and the others stand by, paused, until its peering entry goes (a clean
exit removes it at once; a crashed leader's expires after `--peering-lifetime` seconds). A MoEDeployment may mount
node directories (hostPath) only under `--allowed-host-paths`, the cluster admin's allow-list.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import secrets
import sys

DEFAULT_LIVENESS = "http://0.0.0.0:8080/healthz"
DEFAULT_ALLOWED_HOST_PATHS = "/var/cache/expertmesh"  # pod_security.DEFAULT_ALLOWED_HOST_PATHS (not imported: slow)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--namespace",
        "-n",
        action="append",
        default=[],
        metavar="NS",
        help="watch only this namespace (repeatable; globs allowed); default: the whole cluster",
    )
    p.add_argument(
        "--liveness",
        default=DEFAULT_LIVENESS,
        metavar="URL",
        help=f"liveness endpoint to serve (default {DEFAULT_LIVENESS}; 'none' to disable)",
    )
    p.add_argument(
        "--peering",
        default=None,
        metavar="NAME",
        help="(Cluster)KopfPeering name for several operator replicas: one leader, the rest standing by "
        "(default: standalone)",
    )
    p.add_argument(
        "--priority",
        type=int,
        default=None,
        metavar="N",
        help="peering priority, the highest live replica leads (default: random, so replicas never tie: "
        "Kopf pauses every replica of a tie)",
    )
    p.add_argument(
        "--peering-lifetime",
        type=int,
        default=60,
        metavar="SECONDS",
        help="how long a replica's peering entry outlives its last keep-alive (a crashed leader is "
        "replaced after this; default 60)",
    )
    p.add_argument(
        "--rebalance-tick",
        type=float,
        default=None,
        metavar="SECONDS",
        help="how often to check whether a resource's rebalance interval has passed (default 15)",
    )
    p.add_argument(
        "--allowed-host-paths",
        default=DEFAULT_ALLOWED_HOST_PATHS,
        metavar="PATHS",
        help="comma-separated node directories a MoEDeployment may mount as hostPath volumes, each with what is "
        "below it (spec.model.checkpoint.cache.hostPath, spec.kv.disk.hostPath); a spec naming another is refused; "
        f"'' allows none (default {DEFAULT_ALLOWED_HOST_PATHS}, the checkpoint cache's default)",
    )
    p.add_argument("--verbose", "-v", action="store_true", help="debug logging")


def operator_kwargs(args) -> dict:
    """The `kopf.operator(...)` keyword arguments for parsed CLI arguments (no registry/memo)."""
    liveness = None if str(args.liveness).lower() in ("", "none", "off") else args.liveness
    kw: dict = {"liveness_endpoint": liveness}
    if args.namespace:
        kw["namespaces"] = list(args.namespace)
    else:
        kw["clusterwide"] = True
    if args.peering:
        kw["peering_name"] = args.peering
        kw["priority"] = args.priority if args.priority is not None else 1 + secrets.randbelow(2**31 - 1)
    else:
        kw["standalone"] = True
    return kw


def run(args) -> int:
    # Kopf and the handlers load here, not at import: `expertmesh` builds this subcommand's parser for every command
    # (importing Kopf takes seconds)
    import kopf
    from lightkube import ConfigError

    from expertmesh.operator.handlers import REBALANCE_TICK, Deps, build_registry
    from expertmesh.operator.kube import Kube
    from expertmesh.operator.pod_security import parse_allowed_host_paths

    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    try:
        allowed = parse_allowed_host_paths(args.allowed_host_paths)
    except ValueError as e:
        print(f"expertmesh operator: {e}", file=sys.stderr)
        return 2
    try:
        deps = Deps(kube=Kube.from_environment(), allowed_host_paths=allowed)
    except ConfigError as e:
        print(
            f"expertmesh operator: no Kubernetes credentials (not in a cluster, and no usable KUBECONFIG or "
            f"~/.kube/config): {e}",
            file=sys.stderr,
        )
        return 2
    registry = build_registry(
        rebalance_tick=args.rebalance_tick or REBALANCE_TICK, peering_lifetime=args.peering_lifetime
    )

    # Kopf handles SIGINT/SIGTERM itself: it stops watching, lets running handlers finish, then returns
    asyncio.run(kopf.operator(registry=registry, memo=kopf.Memo(deps=deps), **operator_kwargs(args)))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="expertmesh operator", description=__doc__.split("\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
