"""Thin kopf handlers: everything interesting happens in builders / planner / status (pure).

One reconcile function per ModelService does it all: read the ModelService and its lanes,
build the desired objects, plan against what exists, apply, write status (only changed keys).
Every trigger funnels into it, serialised per ModelService by an asyncio lock:

- ModelService create / update / resume, a 60 s timer (drift and status), its Deployments' and
  LeaderWorkerSets' events (pod readiness -> status, no polling), and its deletion (owned objects removed
  explicitly, besides owner-reference garbage collection);
- ServingLane create / update / resume / delete: the lane's ModelService is re-rendered, so
  its ConfigMap changes in place and pods hot-reload the budgets (no restart). A lane whose
  ModelService does not exist gets Ready=False/ModelServiceNotFound; the ModelService's own
  reconcile lists its lanes, so the lane is picked up when the ModelService appears.

Errors: an invalid spec -> status conditions + a Warning Event + `kopf.PermanentError` (no
retry until the spec changes); API trouble (409, 429, 5xx, no connection) ->
`kopf.TemporaryError(delay=...)`. The operator never writes spec.

Autoscaling: a timer per ModelService (scaling.py) writes `status.autoscaling` and, when the
desired replicas change, runs the reconcile, which renders them (builders.shared_replicas).

Tuning hook: a tuner writes ModelService `status.overrides` and then awaits
`reconcile_model_service(op, namespace, name)` (or waits for the 60 s timer); it should hold
`op.lock_for(namespace, name)` only around its own status writes, not around the call.
The budget path end to end: docs/architecture.md.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import kopf

from tokenlane.operator.desired import builders, planner, precedence
from tokenlane.operator.clients import kube as k8s, last_known_good, reads
from tokenlane.operator.controllers import metrics, scaling
from tokenlane.operator.desired import status as status_mod
from tokenlane.operator.api.resources import parse_model_service, parse_serving_lane

log = logging.getLogger("tokenlane.operator")

GROUP, VERSION = "tokenlane.dev", "v1alpha1"
RETRY_DELAY_S = 10.0
TIMER_INTERVAL_S = 60.0
SERVICE_MONITOR_CHECK_S = 300.0
# kopf keeps the finalizer of a ModelService being deleted until each of its timers has returned,
# and looks again only this often while one is still running (a tuning or autoscaling run waiting
# on Prometheus or the API): kopf's default, 60 s, made `kubectl delete` hang a minute now and then.
TIMER_EXIT_POLL_S = 1.0


@dataclass
class Operator:
    """State shared by the handlers of one operator process."""

    connection: Any = None  # kopf.ConnectionInfo, set by the login handler
    client: Optional[k8s.KubeClient] = None
    locks: dict[tuple[str, str], asyncio.Lock] = field(default_factory=dict)
    _service_monitor: tuple[float, bool] = (0.0, False)
    _inference_pool: tuple[float, bool] = (0.0, False)
    _leader_worker_sets_seen: float = 0.0  # when the server last said it serves LeaderWorkerSets
    _pool_warned: set = field(default_factory=set)  # (namespace, name, generation) told the CRD is missing
    timer_interval_s: float = TIMER_INTERVAL_S
    autoscaling: scaling.Autoscaling = field(default_factory=scaling.Autoscaling)  # its timer's clock and memory

    def __post_init__(self) -> None:
        if self.client is None:
            self.client = k8s.KubeClient(lambda: self.connection, on_request=metrics.observe_api_request)
        self.executor = k8s.Executor(self.client)

    def lock_for(self, namespace: str, name: str) -> asyncio.Lock:
        return self.locks.setdefault((namespace, name), asyncio.Lock())

    async def service_monitor_available(self) -> bool:
        checked_at, available = self._service_monitor
        if time.monotonic() - checked_at > SERVICE_MONITOR_CHECK_S:
            try:
                available = await self.client.has_resource(k8s.SERVICE_MONITORS)
            except k8s.ApiError:
                available = False
            self._service_monitor = (time.monotonic(), available)
        return available


    async def inference_pool_available(self) -> bool:
        """Whether the server serves InferencePools (the Gateway API Inference Extension's CRD)."""
        checked_at, available = self._inference_pool
        if time.monotonic() - checked_at > SERVICE_MONITOR_CHECK_S:
            try:
                available = await self.client.has_resource(k8s.INFERENCE_POOLS)
            except k8s.ApiError:
                available = False
            self._inference_pool = (time.monotonic(), available)
        return available

    async def leader_worker_sets_available(self) -> bool:
        """Whether the server serves LeaderWorkerSets (the lws project's CRD). A yes is kept a
        while; a no is asked again at every reconcile that needs them, so an installed CRD is
        picked up by the next one (the 60 s timer's at the latest)."""
        if time.monotonic() - self._leader_worker_sets_seen <= SERVICE_MONITOR_CHECK_S:
            return True
        try:
            available = await self.client.has_resource(k8s.LEADER_WORKER_SETS)
        except k8s.ApiError:
            available = False
        if available:
            self._leader_worker_sets_seen = time.monotonic()
        return available


# --------------------------------------------------------------------------- helpers


async def _write_status(op: Operator, res: k8s.Resource, body: dict, wanted: dict, clear: tuple = ()) -> bool:
    """Merge-patch the status keys that differ (and drop stale `clear` keys); no request when
    nothing changed."""
    meta = body.get("metadata") or {}
    patch = status_mod.status_patch(body.get("status") or {}, wanted, clear)
    if patch is None:
        return False
    await op.client.merge_patch(res, meta.get("namespace"), meta["name"], {"status": patch}, subresource="status")
    return True


def _transient(exc: k8s.ApiError) -> kopf.TemporaryError:
    # 403 is RBAC or an admission policy, fixed out of band: retry as soon as a transient error.
    # kopf keeps the delay on the object, so even a restarted operator waits it out.
    soon = exc.transient or exc.status == 403
    return kopf.TemporaryError(f"Kubernetes API: {exc}", delay=RETRY_DELAY_S if soon else 6 * RETRY_DELAY_S)


class InvalidSpec(Exception):
    pass


class Unservable(InvalidSpec):
    """A valid spec the cluster cannot serve as it is (a CRD it needs is not installed): status
    and an Event say why, nothing is applied (what runs keeps running), and the 60 s timer
    tries again."""


LWS_UNAVAILABLE = "LeaderWorkerSetUnavailable"


# --------------------------------------------------------------------------- reconcile


def _overrides_in_force(msvc: Any, lanes: list) -> dict:
    """status.overrides less the tuner's overrides of knobs the user edited since: the edit is
    in force from this reconcile on (the tuning timer drops them from status on its next run)."""
    overrides = (msvc.status or {}).get("overrides") or {}
    if not overrides.get(precedence.LEARNED_FROM):
        return overrides
    try:
        spec = precedence.budgets_of(builders.build(msvc, lanes))
    except ValueError:
        return overrides  # the spec alone does not render: reported below
    return precedence.in_force(overrides, spec)


async def reconcile_model_service(op: Operator, namespace: str, name: str) -> Optional[builders.Desired]:
    """Bring the objects and status of ModelService namespace/name to what its spec says.

    Returns the desired state, or None when the ModelService does not exist (lanes referring
    to it are marked) or its namespace is being deleted. Raises InvalidSpec (status and Event already written) or k8s.ApiError.
    """
    async with op.lock_for(namespace, name):
        started = time.monotonic()
        try:
            result = await _reconcile(op, namespace, name)
        except InvalidSpec:
            metrics.RECONCILES.labels(kind="ModelService", result="invalid").inc()
            raise
        except Exception:
            metrics.RECONCILES.labels(kind="ModelService", result="error").inc()
            raise
        metrics.RECONCILES.labels(kind="ModelService", result="ok").inc()
        metrics.RECONCILE_SECONDS.observe(time.monotonic() - started)
        return result


async def _mark_orphans(op: Operator, namespace: str, parent: str) -> None:
    lanes, bodies = await reads.list_lanes(op.client, namespace, parent)
    by_name = {b["metadata"]["name"]: b for b in bodies}
    for lane in lanes:
        if lane.deleting:
            continue
        wanted = status_mod.lane_status(lane, None, None, {}, k8s.timestamp())
        if await _write_status(op, k8s.SERVING_LANES, by_name[lane.ref.name], wanted, status_mod.LANE_KEYS):
            await k8s.post_event(op.client, by_name[lane.ref.name], "Warning", "ModelServiceNotFound",
                                 f"ModelService {parent!r} not found; the lane is served once it exists")


async def _reconcile(op: Operator, namespace: str, name: str) -> Optional[builders.Desired]:
    body = await reads.model_service_body(op.client, namespace, name)
    if body is None:
        await _mark_orphans(op, namespace, name)
        return None
    if (body.get("metadata") or {}).get("deletionTimestamp"):
        return None
    generation = int(body["metadata"].get("generation") or 0)
    try:
        msvc = parse_model_service(body)
    except ValueError as exc:
        await _reject(op, k8s.MODEL_SERVICES, body, generation, str(exc))
        raise InvalidSpec(str(exc)) from None

    lanes, lane_bodies = await reads.list_lanes(op.client, namespace, name)
    overrides = _overrides_in_force(msvc, lanes)
    # While a rollback (or the fallback) is in force, the rollout guard's last-known-good
    # inputs are rendered instead of the spec (the spec itself is untouched).
    msvc, lanes = await last_known_good.inputs_in_force(op.client, msvc, lanes)
    parallelism = msvc.settings.parallelism
    if parallelism.grouped and not await op.leader_worker_sets_available():
        message = (f"spec.parallelism.pipeline is {parallelism.pipeline}: each replica is a LeaderWorkerSet group "
                   f"of {parallelism.pipeline} pods, but the server does not serve {k8s.LEADER_WORKER_SETS.api_version} "
                   "LeaderWorkerSets: install the LeaderWorkerSet controller and its CRD "
                   "(https://lws.sigs.k8s.io); nothing was changed")
        await _reject(op, k8s.MODEL_SERVICES, body, generation, message, reason=LWS_UNAVAILABLE)
        raise Unservable(message)
    pool_available = not msvc.settings.inference_pool.enabled or await op.inference_pool_available()
    try:
        desired = builders.build(msvc, lanes, overrides=builders.Overrides.from_status({"overrides": overrides}),
                                 service_monitor_available=await op.service_monitor_available(),
                                 inference_pool_available=pool_available)
    except ValueError as exc:
        await _reject(op, k8s.MODEL_SERVICES, body, generation, str(exc))
        raise InvalidSpec(str(exc)) from None
    if not pool_available and (namespace, name, generation) not in op._pool_warned:
        op._pool_warned.add((namespace, name, generation))
        await k8s.post_event(op.client, body, "Warning", "InferencePoolUnavailable",
                             "spec.gateway.inferencePool is enabled but the server does not serve "
                             "inference.networking.k8s.io/v1 InferencePools: install the Gateway API Inference "
                             "Extension's CRDs; the rest is rendered")

    observed = await op.executor.observe(namespace, name)
    actions = planner.plan(desired.objects, observed, name)
    try:
        results = await op.executor.execute(actions)
    except k8s.ApiError as exc:
        if not exc.namespace_terminating:
            raise
        # Its namespace is going away (the ModelService with it): nothing left to render.
        log.info("namespace %s is being deleted: not rendering ModelService %s", namespace, name)
        return None
    for action in actions:
        metrics.ACTIONS.labels(verb=action.verb, kind=action.key[1]).inc()
    current = {planner.key_of(o): o for o in observed}
    current.update(results)
    # The pools' pods by pool name, from the kind rendered now (while a switch between a Deployment
    # and a LeaderWorkerSet deletes the other, both exist for a moment under one name).
    workload_kind = "LeaderWorkerSet" if msvc.settings.parallelism.grouped else "Deployment"
    deployments = {key[3]: obj for key, obj in current.items() if key[1] == workload_kind}

    pods, pods_error = None, None
    if msvc.settings.model_source.fetched is not None:
        try:
            pods = await reads.runtime_pods(op.executor, namespace, name)
        except k8s.ApiError as exc:
            if exc.status != 403:
                raise
            # RBAC without `list pods` (an older install): the condition says so, the rest goes on.
            pods_error = str(exc)
            log.warning("ModelService %s/%s: cannot list its pods for ModelAvailable: %s", namespace, name, exc)
    now = k8s.timestamp()
    wanted = status_mod.model_service_status(msvc, desired, deployments, now, pods=pods, pods_error=pods_error)
    if await _write_status(op, k8s.MODEL_SERVICES, body, wanted):
        await _event_on_fetch_failure(op, body, wanted)

    by_name = {b["metadata"]["name"]: b for b in lane_bodies}
    for lane in lanes:
        if lane.deleting:
            continue
        lane_body = by_name[lane.ref.name]
        lane_body.setdefault("apiVersion", k8s.SERVING_LANES.api_version)
        lane_body.setdefault("kind", "ServingLane")
        wanted_lane = status_mod.lane_status(lane, msvc, desired, deployments, now, overrides=overrides)
        changed = await _write_status(op, k8s.SERVING_LANES, lane_body, wanted_lane, status_mod.LANE_KEYS)
        if changed and lane.ref.name in desired.rejected:
            await k8s.post_event(op.client, lane_body, "Warning", "Rejected", desired.rejected[lane.ref.name])
    if actions:
        summary = ", ".join(f"{a.verb} {a.key[1]}/{a.key[3]}" for a in actions)
        log.info("reconciled ModelService %s/%s: %s", namespace, name, summary)
        await k8s.post_event(op.client, body, "Normal", "Reconciled", summary)
    return desired


async def _event_on_fetch_failure(op: Operator, body: dict, wanted: dict) -> None:
    """A Warning Event when ModelAvailable turns Failed: once per transition (the kubelet keeps
    retrying the fetch with its crash-loop back-off; the operator never touches the source)."""
    def model_available(conditions: Any) -> dict:
        return next((c for c in conditions or () if c.get("type") == status_mod.MODEL_AVAILABLE), {})

    old = model_available((body.get("status") or {}).get("conditions"))
    new = model_available(wanted.get("conditions"))
    if new.get("reason") == status_mod.FETCH_FAILED and old.get("reason") != status_mod.FETCH_FAILED:
        await k8s.post_event(op.client, body, "Warning", "ModelFetchFailed", new.get("message", ""))


async def _reject(op: Operator, res: k8s.Resource, body: dict, generation: int, message: str,
                  reason: str = "InvalidSpec") -> None:
    wanted = status_mod.invalid_status(body.get("status") or {}, generation, message, k8s.timestamp(), reason)
    if await _write_status(op, res, body, wanted):
        await k8s.post_event(op.client, body, "Warning", reason, message)


async def delete_owned(op: Operator, namespace: str, name: str) -> list[planner.Action]:
    """Delete every object the ModelService owns (garbage collection does too; this is immediate)."""
    async with op.lock_for(namespace, name):
        observed = await op.executor.observe(namespace, name)
        actions = planner.plan([], observed, name)
        await op.executor.execute(actions)
    await _mark_orphans(op, namespace, name)
    return actions


# --------------------------------------------------------------------------- kopf wiring


def register(registry: kopf.OperatorRegistry, op: Operator, *,
             login: Optional[Callable[..., Any]] = None) -> kopf.OperatorRegistry:
    """Register every handler of the operator on `registry` (tests use their own registry)."""
    MSVC = dict(group=GROUP, version=VERSION, plural="modelservices", registry=registry)
    LANE = dict(group=GROUP, version=VERSION, plural="servinglanes", registry=registry)

    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        # Handler progress lives in annotations, so status holds only what the CRD schema allows.
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="tokenlane.dev")
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
            prefix="tokenlane.dev", key="last-handled-configuration")
        settings.persistence.finalizer = "tokenlane.dev/finalizer"
        settings.posting.level = logging.WARNING  # Events for warnings/errors from kopf itself; ours are explicit
        settings.watching.server_timeout = 300
        settings.networking.request_timeout = 60
        settings.background.cancellation_polling = TIMER_EXIT_POLL_S

    if login is not None:
        @kopf.on.login(registry=registry)
        async def do_login(**kwargs: Any) -> Any:
            info = login(**kwargs)
            if asyncio.iscoroutine(info):
                info = await info
            op.connection = info
            return info

    @kopf.on.cleanup(registry=registry)
    async def close(**_: Any) -> None:
        await op.client.close()

    async def run_model_service(namespace: str, name: str) -> None:
        try:
            await reconcile_model_service(op, namespace, name)
        except Unservable as exc:
            raise kopf.PermanentError(f"cannot serve: {exc}") from None  # the timer tries again
        except InvalidSpec as exc:
            raise kopf.PermanentError(f"invalid spec: {exc}") from None
        except k8s.ApiError as exc:
            raise _transient(exc) from None

    @kopf.on.resume(**MSVC)
    @kopf.on.create(**MSVC)
    @kopf.on.update(**MSVC)
    async def model_service_changed(namespace: str, name: str, **_: Any) -> None:
        await run_model_service(namespace, name)

    @kopf.on.timer(**MSVC, interval=op.timer_interval_s, initial_delay=op.timer_interval_s, idle=None)
    async def model_service_timer(namespace: str, name: str, **_: Any) -> None:
        try:
            await reconcile_model_service(op, namespace, name)
        except InvalidSpec:
            pass  # already reported; the timer does not retry a broken spec
        except k8s.ApiError as exc:
            log.warning("periodic reconcile of %s/%s: %s", namespace, name, exc)

    @kopf.on.timer(**MSVC, interval=op.autoscaling.tick_s, initial_delay=op.autoscaling.tick_s, idle=None)
    async def autoscaling_timer(namespace: str, name: str, spec: Any, status: Any, **_: Any) -> None:
        try:
            await scaling.tick(op.autoscaling, op.client, op.executor, op.lock_for(namespace, name), namespace, name,
                               spec, status, functools.partial(reconcile_model_service, op))
        except InvalidSpec:
            pass  # already reported by the reconcile
        except k8s.ApiError as exc:
            log.warning("autoscaling %s/%s: %s", namespace, name, exc)

    @kopf.on.delete(**MSVC)
    async def model_service_deleted(namespace: str, name: str, **_: Any) -> None:
        try:
            actions = await delete_owned(op, namespace, name)
        except k8s.ApiError as exc:
            raise _transient(exc) from None
        log.info("ModelService %s/%s deleted; removed %d owned object(s)", namespace, name, len(actions))

    @kopf.on.event("apps", "v1", "deployments", registry=registry,
                   labels={builders.LABEL_MANAGED_BY: builders.MANAGED_BY})
    async def deployment_event(body: Any, namespace: str, type: Optional[str], **_: Any) -> None:
        owner = ((body.get("metadata") or {}).get("labels") or {}).get(builders.LABEL_MODEL_SERVICE)
        if not owner or type is None:  # type None = the initial listing; resume handlers cover it
            return
        try:
            await reconcile_model_service(op, namespace, owner)
        except (InvalidSpec, k8s.ApiError) as exc:
            log.debug("status refresh of %s/%s after a Deployment event: %s", namespace, owner, exc)

    # A group's readiness (status.readyReplicas counts groups), as for the Deployments above.
    # Without the LeaderWorkerSet CRD kopf warns that it cannot watch them (at start and when
    # CRDs change), and watches them once the CRD is installed.
    @kopf.on.event(k8s.LEADER_WORKER_SETS.group, k8s.LEADER_WORKER_SETS.version, k8s.LEADER_WORKER_SETS.plural,
                   registry=registry, labels={builders.LABEL_MANAGED_BY: builders.MANAGED_BY})
    async def leader_worker_set_event(body: Any, namespace: str, type: Optional[str], **_: Any) -> None:
        await deployment_event(body=body, namespace=namespace, type=type)

    async def run_lane(body: Any, namespace: str, old_parent: Optional[str] = None) -> None:
        generation = int((body.get("metadata") or {}).get("generation") or 0)
        raw = dict(body)
        try:
            lane = parse_serving_lane(raw)
        except ValueError as exc:
            try:
                await _reject(op, k8s.SERVING_LANES, {**raw, "apiVersion": k8s.SERVING_LANES.api_version,
                                                      "kind": "ServingLane"}, generation, str(exc))
                parent = ((raw.get("spec") or {}).get("modelServiceRef") or {}).get("name")
                if parent:  # drop the lane from its ModelService if it was served before
                    await reconcile_model_service(op, namespace, parent)
            except k8s.ApiError as api_exc:
                raise _transient(api_exc) from None
            except InvalidSpec:
                pass
            raise kopf.PermanentError(f"invalid spec: {exc}") from None
        parents = [lane.parent] + ([old_parent] if old_parent and old_parent != lane.parent else [])
        try:
            for parent in parents:
                await reconcile_model_service(op, namespace, parent)
        except InvalidSpec:
            pass  # the ModelService's status says why; the lane is re-rendered when it is fixed
        except k8s.ApiError as exc:
            raise _transient(exc) from None

    @kopf.on.resume(**LANE)
    @kopf.on.create(**LANE)
    async def lane_created(body: Any, namespace: str, **_: Any) -> None:
        await run_lane(body, namespace)

    @kopf.on.update(**LANE)
    async def lane_updated(body: Any, namespace: str, old: Any, **_: Any) -> None:
        old_parent = (((old or {}).get("spec") or {}).get("modelServiceRef") or {}).get("name")
        await run_lane(body, namespace, old_parent)

    @kopf.on.delete(**LANE)
    async def lane_deleted(body: Any, namespace: str, **_: Any) -> None:
        parent = ((body.get("spec") or {}).get("modelServiceRef") or {}).get("name")
        if not parent:
            return
        try:
            await reconcile_model_service(op, namespace, parent)  # the deleting lane is left out
        except InvalidSpec:
            pass
        except k8s.ApiError as exc:
            raise _transient(exc) from None

    return registry
