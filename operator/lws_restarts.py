"""A bounded restart loop for `workload: leaderworkerset` (issue #56): the LWS controller recreates a whole group
each time one of its pods restarts (restartPolicy RecreateGroupOnPodRestart), with no limit — a group whose pod
crashes at start is torn down and rebuilt forever, and with it every pod of the group (the expert workers' group: all
of them). The operator counts each group's recreations and bounds them. Pure: the status and the observed leader pods
in, what to merge into the status and which sets to render with restartPolicy None out.

    a group's leader pod seen with a new uid on the same template revision  → one recreation of the group
      (a new revision is a rollout, not counted; the LWS status has no restart counter: api/leaderworkerset/v1)
    spec.leaderWorkerSet.maxGroupRestarts recreations, each within groupRestartWindowSeconds of the one before
                                                                            → that set's restartPolicy None (pods
      restart alone, the group stays), condition GroupRestartsBounded=True naming the group; held until the spec
      changes (a new generation: the answer of whoever fixed the cause), then the set's counts start again
    no recreation for groupRestartWindowSeconds                             → the group's count starts again

The records live in `status.groupRestarts` (spec_platform.GroupRestarts), so an operator restart or a new leader
keeps counting where the last one stopped; a recreation the operator did not see (two between its looks) counts once.
"""

from __future__ import annotations

import datetime as _dt
from collections.abc import Iterable
from dataclasses import dataclass, field

from expertmesh.operator.lws import lws_settings, uses_lws
from expertmesh.operator.naming import expert_name
from expertmesh.operator.pods import PodInfo
from expertmesh.operator.pools import attention_pools
from expertmesh.operator.spec import MoEDeploymentSpec
from expertmesh.operator.status import condition, seconds_since, set_condition

CONDITION = "GroupRestartsBounded"
REASON_BOUNDED, REASON_CLEAR = "GroupRestartLimit", "WithinRestartLimit"


@dataclass(frozen=True)
class RestartAccount:
    status: dict = field(default_factory=dict)  # merged into the status (groupRestarts, conditions): {} = no change
    bounded: frozenset[str] = frozenset()  # the sets to render with restartPolicy None, from now
    rerender: bool = False  # `bounded` differs from what the children were rendered with


def bounded_sets(status: dict | None, generation: int | None) -> frozenset[str]:
    """The LeaderWorkerSets rendered with restartPolicy None: those a group of which reached the bound at this spec
    generation (children.build_children's `restart_bounded`)."""
    return frozenset(
        r["set"]
        for r in (status or {}).get("groupRestarts") or []
        if r.get("boundAtGeneration") is not None and r.get("boundAtGeneration") == generation
    )


def lws_groups(name: str, spec: MoEDeploymentSpec, observed: dict[str, int] | None = None) -> dict[str, int]:
    """Each LeaderWorkerSet the spec renders → its groups: an attention pool's replicas (`observed`: an autoscaled
    pool's now), the expert workers' one group."""
    return {p.statefulset: p.replicas for p in attention_pools(name, spec, observed)} | {expert_name(name): 1}


def account(
    spec: MoEDeploymentSpec,
    status: dict,
    pods: Iterable[PodInfo],
    groups: dict[str, int],
    generation: int | None,
    now: str,
) -> RestartAccount:
    """Count the recreations `pods` show against `status.groupRestarts`. `groups`: each LeaderWorkerSet of the spec →
    its groups now (lws_groups; records of others are dropped). The status to merge carries the conditions with
    GroupRestartsBounded set when it changes."""
    conditions = list(status.get("conditions") or [])
    before = list(status.get("groupRestarts") or [])
    if not uses_lws(spec):
        return RestartAccount(status={"groupRestarts": []} if before else {})
    lw = lws_settings(spec)
    counting = lw.restart_policy == "RecreateGroupOnPodRestart"
    was_bounded = bounded_sets(status, generation)
    records: dict[tuple[str, int], dict] = {}
    for r in before:
        r = dict(r)
        if r.get("set") not in groups or not 0 <= r.get("group", -1) < groups[r["set"]]:
            continue  # a set or group the spec no longer has
        if r.get("boundAtGeneration") is not None and r["boundAtGeneration"] != generation:
            r.pop("boundAtGeneration")  # the spec changed since the bound: lifted, counting starts again
            r["restarts"] = 0
        if r.get("boundAtGeneration") is None and seconds_since(r.get("lastRestartTime"), _time(now)) > (
            lw.group_restart_window_seconds
        ):
            r["restarts"] = 0  # quiet for a window: the count starts again
        records[(r["set"], r["group"])] = r
    for p in pods:
        if p.lws_leader is None or p.deleting or not p.uid:
            continue
        set_name, group, rev = p.lws_leader
        if not 0 <= group < groups.get(set_name, 0):
            continue  # not a set of this spec, or a group past its size (scaling down)
        r = records.get((set_name, group))
        if r is None:  # first seen: nothing to compare with
            records[(set_name, group)] = {
                "set": set_name,
                "group": group,
                "leaderUid": p.uid,
                "revision": rev,
                "restarts": 0,
            }
            continue
        if r["leaderUid"] == p.uid:
            continue
        if counting and r["revision"] == rev:  # the same template: the group was recreated, not rolled
            r["restarts"] = int(r.get("restarts") or 0) + 1
            r["lastRestartTime"] = now
            limit = lw.max_group_restarts
            if limit and r["restarts"] >= limit and set_name not in was_bounded and r.get("boundAtGeneration") is None:
                r["boundAtGeneration"] = generation
        r["leaderUid"], r["revision"] = p.uid, rev
    after = [records[k] for k in sorted(records)]
    bounded = bounded_sets({"groupRestarts": after}, generation)
    conds = _with_condition(conditions, after, bounded, lw.group_restart_window_seconds, generation, now)
    update = {}
    if after != before:
        update["groupRestarts"] = after
    if conds != conditions:
        update["conditions"] = conds
    return RestartAccount(status=update, bounded=bounded, rerender=bounded != was_bounded)


def _with_condition(
    conditions: list[dict], records: list[dict], bounded: frozenset[str], window: int, generation, now: str
) -> list[dict]:
    """GroupRestartsBounded: True naming the groups that reached the bound; False once none has (kept absent when
    no group ever did)."""
    if bounded:
        hit = [r for r in records if r["set"] in bounded and r.get("boundAtGeneration") is not None]
        groups = ", ".join(f"{r['set']} group {r['group']} ({r['restarts']} recreations)" for r in hit)
        message = (
            f"LeaderWorkerSet {groups}, each within {window}s of the last: restartPolicy None for "
            f"{', '.join(sorted(bounded))} (pods restart alone, the group is kept) until the spec changes"
        )
        return set_condition(conditions, CONDITION, "True", REASON_BOUNDED, message, generation, now)
    if (condition({"conditions": conditions}, CONDITION) or {}).get("status") == "True":
        return set_condition(conditions, CONDITION, "False", REASON_CLEAR, "", generation, now)
    return conditions


def _time(rfc3339: str) -> _dt.datetime:
    return _dt.datetime.fromisoformat(rfc3339.replace("Z", "+00:00"))
