"""Kopf handlers for `MoEDeployment`: thin — they read the world, call the pure functions (placement_policy.py: which
plan; children.py: the child objects; pods.py + status.py: what the pods say and the status), and write the results
back through the Kubernetes API edge (kube.py).

    create / update(spec) / resume → validate → plan (previous plan's shards stay) → apply children
                                     (owner references via kopf.adopt) → status (kopf's patch.status)
    pod events (worker/router pods) → readiness counts; a lost expert pod → Degraded, and once it has been
                                     lost for placement.replanGraceSeconds a re-plan onto the survivors when
                                     some expert has no live replica left; a LeaderWorkerSet group recreated
                                     (a new leader uid) → counted, bounded (lws_restarts.py)
    StatefulSet events (attention   → an autoscaled pool resized by its HorizontalPodAutoscaler: its replicas are kept
      pools' replicas)               (never reset to the spec's) and the router's worker lists follow (re-applied:
                                     the router rolls)
    timer (every REBALANCE_TICK)   → Degraded / Deploying: re-assess (a re-plan may be due, or rolled out); Ready: every
                                     placement.rebalanceIntervalSeconds read the router's /v1/load and re-plan
                                     when the observed imbalance exceeds placement.imbalanceThreshold
    (deletion: children carry owner references, the garbage collector removes them; Kopf's finalizer only
     lets the timer stop first)

Errors: a spec that cannot be deployed (bad field or name: InvalidSpec; MTP speculation without MTP layers:
NoMTPLayers; a node directory outside the allow-list: HostPathNotAllowed; licence not accepted: LicenseNotAccepted /
LicenseMismatch, nothing fetched or deployed; cluster too small: ClusterTooSmall; past the planning budget:
PlanBudgetExceeded; a child the API would refuse: ObjectTooLarge) → phase Failed + a condition naming the field +
`kopf.PermanentError` (Kopf does not retry until the spec changes); a transient API error → `kopf.TemporaryError`
with exponential backoff. Planning runs in planning.PlanRunner's process, never on Kopf's event loop, after
budget.check_plan_budget agreed to its estimated cost.

Edges are injectable through `Deps` (cluster_io.py, passed to Kopf as `memo`): `kube` (the Kubernetes API: kube.Kube, lightkube's
async client), `fetch_load` (the HTTP GET of the router's load) and `planning` (the planning process).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import kopf

from expertmesh.operator.budget import (
    BudgetError,
    check_plan_budget,
)
from expertmesh.operator.children import build_children, load_configmap, revision, template_hashes
from expertmesh.operator.cluster_io import (  # Deps, _api, _read_load, _fetch_load_http: also imported from here
    Deps,
    _api,
    _apply_children,
    _changed,
    _fetch_load_http,  # noqa: F401
    _fetch_progress,
    _observed_replicas,
    _pods,
    _pool_sizes,
    _read_load,
    _read_plan,
)
from expertmesh.operator.kube import KubeError
from expertmesh.operator.lws import LWS_RESOURCE
from expertmesh.operator.lws_restarts import account, bounded_sets, lws_groups
from expertmesh.operator.model_license import license_verdict
from expertmesh.operator.naming import (
    COMPONENT_ATTENTION,
    COMPONENT_PREFILL,
    LABEL_COMPONENT,
    LABEL_INSTANCE,
    LABEL_MANAGED_BY,
    OPERATOR_NAME,
    POD_MANAGED_LABELS,
    endpoints,
    load_configmap_name,
    load_url,
    name_error,
)
from expertmesh.operator.placement_policy import moved_from, parse_load, plan_for, rebalance, replan_around
from expertmesh.operator.planning import PlanningFailed
from expertmesh.operator.pod_security import host_path_error
from expertmesh.operator.pods import assess, pod_info
from expertmesh.operator.spec import API_VERSION, GROUP, KIND, PLURAL, VERSION, SpecError, parse_spec, resolve_model
from expertmesh.operator.status import (
    decide,
    failed_status,
    license_refused_status,
    now_rfc3339,
    placement_status,
    seconds_since,
    set_condition,
    summarize_plan,
    with_license,
    with_weights,
)
from expertmesh.placement.planner import PlanError

log = logging.getLogger("expertmesh.operator")

PERSISTENCE_PREFIX = "expertmesh.dev"
REBALANCE_TICK = 15.0  # the timer's period; each resource's own interval is checked against it


def configure_settings(settings: kopf.OperatorSettings, peering_lifetime: int | None = None) -> None:
    """Keep Kopf's bookkeeping in annotations under our prefix (status stays the CRD's structural status)."""
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=PERSISTENCE_PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=PERSISTENCE_PREFIX, key="last-handled-configuration"
    )
    settings.persistence.finalizer = f"{PERSISTENCE_PREFIX}/finalizer"
    settings.posting.level = logging.WARNING
    settings.networking.request_timeout = 60.0
    settings.watching.server_timeout = 300
    settings.queueing.error_delays = (1, 2, 5, 10, 30, 60)
    # a timer caught mid-run by a deletion is checked again after this (Kopf's default, 60 s, holds the
    # resource's deletion that long)
    settings.background.cancellation_polling = 1.0
    if peering_lifetime is not None:  # with --peering: how long a silent leader's entry lasts
        settings.peering.lifetime = peering_lifetime


# ------------------------------------------------------------------------------------------------ reconcile
async def reconcile(
    *,
    name: str,
    namespace: str,
    spec,
    meta,
    status,
    body,
    patch,
    memo,
    logger,
    retry: int = 0,
    expertmesh_pods=None,
    **_: Any,
) -> None:
    deps: Deps = memo.deps
    generation = meta.get("generation")
    status = dict(status or {})

    def fail(message: str, reason: str) -> kopf.PermanentError:
        patch.status.update(failed_status(status, message, generation, reason=reason))
        return kopf.PermanentError(f"{reason}: {message}")

    try:
        parsed = parse_spec(dict(spec))
        bad_name = name_error(name)
        if bad_name:
            raise SpecError(bad_name)
        cfg = resolve_model(parsed)
        check_plan_budget(parsed, cfg, memory=deps.plan_memory, work=deps.plan_work)
    except BudgetError as e:
        raise fail(str(e), "PlanBudgetExceeded") from None
    except SpecError as e:
        raise fail(str(e), e.reason) from None
    outside = host_path_error(parsed, deps.allowed_host_paths)
    if outside:
        raise fail(outside, "HostPathNotAllowed")
    licence = license_verdict(parsed.model)
    if licence is not None and not licence.accepted:  # before anything is fetched: no child, no pod
        patch.status.update(license_refused_status(status, licence, generation))
        raise kopf.PermanentError(f"{licence.reason}: {licence.message}")

    async with deps.lock((namespace, name)):
        previous = await _read_plan(deps, namespace, name, retry)
        try:
            plan = await deps.planning.run(plan_for, parsed, cfg, previous=previous)
        except PlanError as e:
            raise fail(str(e), "ClusterTooSmall") from None
        except PlanningFailed as e:
            raise fail(f"spec.expertWorkers: {e}", "PlanBudgetExceeded") from None
        observed = await _observed_replicas(deps, namespace, name, parsed, retry)
        try:
            rev, templates = await _apply_children(deps, body, name, namespace, parsed, cfg, plan, retry, observed)
        except BudgetError as e:
            raise fail(str(e), "ObjectTooLarge") from None
        except KubeError as e:  # not transient: the API refused a child (e.g. a quota or an admission webhook)
            patch.status.update(failed_status(status, f"applying children: {e}", generation, reason="ApplyFailed"))
            raise kopf.PermanentError(f"applying children: {e}") from None

        new_plan = plan.plan_hash() != (status.get("placement") or {}).get("planHash")
        base = dict(status)
        if rev != status.get("revision") or base.get("phase") in (None, "Pending", "Planning", "Failed"):
            base["phase"] = "Deploying"  # something changed: pods roll; missing ones are not losses
        if new_plan:
            base["placement"] = {}
        pods = _pods(expertmesh_pods, namespace, name)
        a = assess(parsed, plan, pods, templates, _pool_sizes(name, parsed, observed))
        decision = decide(name, parsed, plan, base, a, generation)
        conds = set_condition(
            decision.status.get("conditions", []), "PlacementReady", "True", "Planned", summarize_plan(plan), generation
        )
        conds = with_license(conds, licence, generation)
        lost = [] if new_plan else (status.get("placement") or {}).get("lostWorkers", [])
        update = with_weights(
            {**decision.status, "conditions": conds},
            status,
            parsed,
            pods,
            await _fetch_progress(deps, namespace, pods),
            generation,
        )
        patch.status.update(
            {
                **update,
                "observedGeneration": generation,
                "revision": rev,
                "placement": placement_status(plan, lost_workers=lost, moved=moved_from(previous, plan, cfg)),
                "endpoints": endpoints(name, namespace, parsed),
            }
        )
        logger.info(f"plan {plan.plan_hash()} applied: {summarize_plan(plan)}")


# ------------------------------------------------------------------------------------------------ pods
async def observe(deps: Deps, namespace: str, name: str, index, logger) -> None:
    """Re-assess one MoEDeployment against its pods; re-plan around lost expert pods when needed; follow an
    autoscaled pool's new size (its StatefulSet's replicas, set by its HorizontalPodAutoscaler) into the router's
    worker lists."""
    async with deps.lock((namespace, name)):
        body = await _api(deps.kube.get(API_VERSION, KIND, namespace, name))
        if body is None or (body.get("metadata") or {}).get("deletionTimestamp"):
            return
        status = body.get("status") or {}
        if status.get("phase") in (None, "Failed"):
            return  # not reconciled yet, or waiting for a spec fix
        try:
            spec = parse_spec(body.get("spec") or {})
            cfg = resolve_model(spec)
        except SpecError:
            return  # the spec handler reports it
        plan = await _read_plan(deps, namespace, name)
        if plan is None or plan.plan_hash() != (status.get("placement") or {}).get("planHash"):
            return  # a reconciliation is writing a new plan right now; its status comes next
        observed = await _observed_replicas(deps, namespace, name, spec)
        generation = (body.get("metadata") or {}).get("generation")
        children = build_children(name, namespace, spec, cfg, plan, observed, bounded_sets(status, generation))
        rev, templates = revision(children), template_hashes(children)
        follow: dict = {}
        if rev != status.get("revision"):
            if not observed or status.get("observedGeneration") != generation:
                return  # the spec changed and its reconciliation has not finished: its status comes next
            # the spec is handled, so what changed is an autoscaled pool's size: keep it, re-render the router
            try:
                rev, templates = await _apply_children(deps, body, name, namespace, spec, cfg, plan, observed=observed)
            except BudgetError as e:
                logger.warning(f"following the autoscaled pools' size {observed}: {e}")
                return
            logger.info(f"autoscaled pools now {_pool_sizes(name, spec, observed)}: router worker lists re-rendered")
            follow = {"revision": rev}
            status = {
                **status,
                **follow,
                "phase": "Deploying" if status.get("phase") == "Ready" else status.get("phase"),
            }
        pods = _pods(index, namespace, name)
        # LeaderWorkerSet groups recreated: counted; at the bound their set's restartPolicy becomes None (re-applied)
        restarts = account(spec, status, pods, lws_groups(name, spec, observed), generation, now_rfc3339())
        if restarts.rerender:
            body = {**body, "status": {**status, **restarts.status}}
            rev, templates = await _apply_children(deps, body, name, namespace, spec, cfg, plan, observed=observed)
            follow = {**follow, "revision": rev}
        status = {**status, **restarts.status, **follow}
        a = assess(spec, plan, pods, templates, _pool_sizes(name, spec, observed))
        decision = decide(name, spec, plan, status, a, generation)
        update = decision.status
        if decision.replan_excluding is not None:
            update = await _replan_around(
                deps,
                body,
                name,
                namespace,
                spec,
                cfg,
                plan,
                status,
                update,
                decision.replan_excluding,
                generation,
                logger,
            )
        if update:
            update = with_weights(update, status, spec, pods, await _fetch_progress(deps, namespace, pods), generation)
        update = {**follow, **restarts.status, **update}
        if update and (follow or restarts.status or _changed(status, update)):
            await _api(deps.kube.patch_status(namespace, name, update))


async def _replan_around(
    deps: Deps,
    body: dict,
    name: str,
    namespace: str,
    spec,
    cfg,
    plan,
    status: dict,
    update: dict,
    lost: list[int],
    generation,
    logger,
) -> dict:
    loads = deps.loads.get((namespace, name))
    if loads is None:  # this operator has not read the load since it started: the last one kept in the cluster
        loads = await _read_load(deps, namespace, name, cfg)

    def degraded(reason: str, message: str) -> dict:
        conds = set_condition(update["conditions"], "Degraded", "True", reason, message, generation)
        return {**update, "phase": "Degraded", "message": message, "conditions": conds}

    try:
        new = await deps.planning.run(replan_around, spec, cfg, plan, lost, loads=loads)
    except PlanError as e:
        return degraded(
            "InsufficientMemory", f"expert workers {lost} lost and the survivors cannot hold the model: {e}"
        )
    except PlanningFailed as e:
        return degraded("PlanBudgetExceeded", f"re-planning around expert workers {lost}: spec.expertWorkers: {e}")
    if not lost and new.plan_hash() == plan.plan_hash():  # rejoined without moving anything
        conds = set_condition(update["conditions"], "Degraded", "False", "AllReplicasServing", "", generation)
        return {**update, "phase": "Ready", "message": None, "conditions": conds, "placement": placement_status(new)}
    try:
        rev, _ = await _apply_children(deps, body, name, namespace, spec, cfg, new)
    except BudgetError as e:
        return degraded("ObjectTooLarge", f"re-planning around expert workers {lost}: {e}")
    what = f"re-planned around lost expert workers {lost}" if lost else "re-planned onto every expert worker"
    logger.info(f"{what}: plan {new.plan_hash()}, {new.figures.moved_shards} shards moved")
    conds = set_condition(update["conditions"], "PlacementReady", "True", "Replanned", summarize_plan(new), generation)
    if lost:
        conds = set_condition(
            conds,
            "Degraded",
            "True",
            "ReplannedOntoSurvivors",
            f"{what}; rolling out plan {new.plan_hash()}",
            generation,
        )
    return {
        **update,
        "phase": "Deploying",
        "message": f"{what}; rolling out plan {new.plan_hash()}",
        "conditions": conds,
        "revision": rev,
        "placement": placement_status(new, lost_workers=lost),
    }


# ------------------------------------------------------------------------------------------------ load
async def check_load(
    *, name: str, namespace: str, spec, status, body, patch, memo, logger, expertmesh_pods=None, **_: Any
) -> None:
    """The timer: re-assess a Degraded deployment (a re-plan may be due once its grace period is over) and
    read the load of a Ready one every placement.rebalanceIntervalSeconds."""
    deps: Deps = memo.deps
    status = dict(status or {})
    if status.get("phase") in ("Degraded", "Deploying") or any(
        p.fetch == "running" for p in _pods(expertmesh_pods, namespace, name)
    ):
        # a re-plan due, a re-plan rolled out with no pod event to tell (nothing restarts for a plan), or a
        # checkpoint fetch whose progress goes to the status
        await observe(deps, namespace, name, expertmesh_pods, logger)
        return
    if status.get("phase") != "Ready":
        return  # rebalance only a settled deployment (not while rolling out or failed)
    try:
        parsed = parse_spec(dict(spec))
        cfg = resolve_model(parsed)
    except SpecError:
        return
    key = (namespace, name)
    now = time.monotonic()
    interval = parsed.placement.rebalance_interval_seconds
    if (
        now - deps.last_check.get(key, float("-inf")) < interval
        or seconds_since(status.get("lastRebalanceTime")) < interval
    ):  # status: survives a restart or failover
        return
    deps.last_check[key] = now
    try:
        payload = await deps.fetch_load(load_url(name, namespace, parsed), deps.load_timeout)
        loads = parse_load(payload, cfg)
    except Exception as e:  # the router may be restarting: try again next interval
        logger.warning(f"reading the router's load failed: {type(e).__name__}: {e}")
        return
    deps.loads[key] = loads
    try:  # kept in the cluster for a restarted operator or a new leader (a failure only loses that)
        cm = load_configmap(name, namespace, parsed, cfg, loads, now_rfc3339())
        kopf.adopt(cm, owner=body)
        await _api(deps.kube.apply(cm))
    except (KubeError, kopf.TemporaryError) as e:
        logger.warning(f"keeping the observed load in {load_configmap_name(name)} failed: {e}")
    async with deps.lock(key):
        plan = await _read_plan(deps, namespace, name)
        if plan is None or plan.plan_hash() != (status.get("placement") or {}).get("planHash"):
            return
        try:
            verdict = await deps.planning.run(rebalance, parsed, cfg, plan, loads)
        except PlanningFailed as e:  # keep the plan in force; tried again next interval
            logger.warning(f"rebalancing: {e}")
            patch.status.update({"lastRebalanceTime": now_rfc3339()})
            return
        placement = dict(status.get("placement") or {})
        placement["observedImbalance"] = round(verdict.observed, 4)
        update: dict = {"lastRebalanceTime": now_rfc3339(), "placement": placement}
        if verdict.plan is not None:
            try:
                update["revision"], _ = await _apply_children(deps, body, name, namespace, parsed, cfg, verdict.plan)
            except BudgetError as e:  # the rebalanced plan would not fit its ConfigMap: keep the one in force
                logger.warning(f"rebalancing: {e}")
                patch.status.update(update)
                return
            generation = (body.get("metadata") or {}).get("generation")
            conds = set_condition(
                status.get("conditions", []),
                "PlacementReady",
                "True",
                "Rebalanced",
                f"{verdict.reason}; {summarize_plan(verdict.plan)}",
                generation,
            )
            update.update(
                phase="Deploying",
                conditions=conds,
                message=verdict.reason,
                placement=placement_status(verdict.plan, moved=verdict.moved, observed_imbalance=verdict.observed),
            )
            logger.info(f"rebalanced: {verdict.reason}, {verdict.moved} shards moved")
        patch.status.update(update)


# ------------------------------------------------------------------------------------------------ registry
def build_registry(
    *,
    rebalance_tick: float = REBALANCE_TICK,
    login: Callable[..., Any] | None = None,
    peering_lifetime: int | None = None,
) -> kopf.OperatorRegistry:
    """A fresh registry with every handler (no module-level state, so tests can run several operators).

    login: Kopf's authentication handler; default `kopf.login_via_client` (as kubectl: the pod's service
    account in a cluster, else KUBECONFIG / ~/.kube/config)."""
    reg = kopf.OperatorRegistry()
    res = dict(group=GROUP, version=VERSION, plural=PLURAL, registry=reg)
    kopf.on.login(id="login", registry=reg)(login or kopf.login_via_client)

    @kopf.on.startup(id="configure", registry=reg)
    def _configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        configure_settings(settings, peering_lifetime)

    @kopf.on.cleanup(id="planning", registry=reg)
    def _stop_planning(memo, **_: Any) -> None:
        deps = getattr(memo, "deps", None)
        if deps is not None:
            deps.planning.close()

    @kopf.index("v1", "pods", id="expertmesh_pods", labels=POD_MANAGED_LABELS, registry=reg)
    def expertmesh_pods(namespace: str, body, **_: Any):
        info = pod_info(body)
        if info is None:
            return {}
        return {(namespace, body["metadata"]["labels"][LABEL_INSTANCE]): info}

    kopf.on.resume(id="reconcile", **res)(reconcile)
    kopf.on.create(id="reconcile", **res)(reconcile)
    kopf.on.update(id="reconcile", field="spec", **res)(reconcile)

    @kopf.on.event("v1", "pods", id="pod_event", labels=POD_MANAGED_LABELS, registry=reg)
    async def pod_event(namespace: str, body, memo, logger, expertmesh_pods, **_: Any) -> None:
        instance = (body.get("metadata", {}).get("labels") or {}).get(LABEL_INSTANCE)
        if instance:
            try:
                await observe(memo.deps, namespace, instance, expertmesh_pods, logger)
            except kopf.TemporaryError as e:  # event handlers are not retried: the next pod event will be
                logger.warning(f"observing pods of {instance}: {e}")

    @kopf.on.event(*LWS_RESOURCE, id="lws_scale", labels={LABEL_MANAGED_BY: OPERATOR_NAME}, registry=reg)
    @kopf.on.event(
        "apps", "v1", "statefulsets", id="pool_scale", labels={LABEL_MANAGED_BY: OPERATOR_NAME}, registry=reg
    )
    async def pool_scale(namespace: str, body, memo, logger, expertmesh_pods, **_: Any) -> None:
        """An attention pool's StatefulSet or LeaderWorkerSet changed size (its HorizontalPodAutoscaler): re-assess its
        deployment, which re-renders the router's worker lists. Other changes (its status) are skipped."""
        meta = body.get("metadata") or {}
        lab = meta.get("labels") or {}
        instance, replicas = lab.get(LABEL_INSTANCE), (body.get("spec") or {}).get("replicas")
        key = (namespace, meta.get("name"))
        if (
            lab.get(LABEL_COMPONENT) not in (COMPONENT_ATTENTION, COMPONENT_PREFILL)
            or not instance
            or memo.deps.scales.get(key) == replicas
        ):
            return
        memo.deps.scales[key] = replicas
        try:
            await observe(memo.deps, namespace, instance, expertmesh_pods, logger)
        except kopf.TemporaryError as e:  # event handlers are not retried: forget the size, the next event retries
            memo.deps.scales.pop(key, None)
            logger.warning(f"following the size of {key[1]}: {e}")

    kopf.timer(id="check_load", interval=rebalance_tick, initial_delay=rebalance_tick, **res)(check_load)
    return reg
