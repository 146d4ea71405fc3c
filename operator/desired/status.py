"""Pure status computation: conditions with transition times, and "only write when changed".

The operator owns these status keys of a ModelService: observedGeneration, replicas,
readyReplicas, updatedReplicas, selector, lanes, laneNames, restartHash, configHash,
endpoint, effectiveBudgets and the conditions Ready, Progressing, Degraded, ModelAvailable. Other writers
(the tuner and the rollout guard, tuning.py) own status.overrides / tuning / rollout and the
conditions SLOMet, RolledBack and Tuning; `merge_conditions` keeps theirs untouched.
"""

from __future__ import annotations

from typing import Any, Collection, Mapping, Optional

from tokenlane.operator.desired import precedence
from tokenlane.operator.desired import builders
from tokenlane.operator.desired.builders import Desired, Pool, endpoint, selector_string, serving_selector
from tokenlane.operator.api.resources import ModelService, ServingLane

MODEL_SERVICE_KEYS = ("observedGeneration", "replicas", "readyReplicas", "updatedReplicas", "selector", "lanes",
                      "laneNames", "restartHash", "configHash", "endpoint", "effectiveBudgets")
LANE_KEYS = ("observedGeneration", "laneName", "modelService", "endpoint", "replicas", "readyReplicas",
             "effectiveBudgets", "budgets", "overriddenKnobs")


def condition(type_: str, status: bool, reason: str, message: str) -> dict:
    return {"type": type_, "status": "True" if status else "False", "reason": reason, "message": message}


def merge_conditions(current: Optional[list], updates: list[dict], generation: int, now: str,
                     keep_message_of: Collection[str] = ()) -> list[dict]:
    """Replace the conditions of the updated types; keep lastTransitionTime when status is unchanged.

    For the types in `keep_message_of` (conditions whose message carries live numbers, such as
    SLOMet's p95s) the message of the last transition is kept while status and reason hold, so
    an unchanged verdict is not a status write; the live numbers are metrics."""
    by_type = {c.get("type"): dict(c) for c in current or []}
    for new in updates:
        old = by_type.get(new["type"])
        merged = {**new, "observedGeneration": generation}
        if old is not None and old.get("status") == new["status"] and old.get("lastTransitionTime"):
            merged["lastTransitionTime"] = old["lastTransitionTime"]
            if new["type"] in keep_message_of and old.get("reason") == new.get("reason") and "message" in old:
                merged["message"] = old["message"]
        else:
            merged["lastTransitionTime"] = now
        by_type[new["type"]] = merged
    return sorted(by_type.values(), key=lambda c: c.get("type", ""))


def status_patch(current: Mapping[str, Any], wanted: Mapping[str, Any], clear: tuple = ()) -> Optional[dict]:
    """The merge patch turning `current` into `wanted` on the keys of `wanted` (and removing
    the keys of `clear` that `wanted` lacks), or None if nothing differs."""
    patch: dict[str, Any] = {k: v for k, v in wanted.items() if current.get(k) != v}
    patch.update({k: None for k in clear if k not in wanted and k in current})  # null = delete
    return patch or None


def _deployment_counts(dep: Optional[Mapping[str, Any]]) -> tuple[int, int, int, list[dict]]:
    st = (dep or {}).get("status") or {}
    return (int(st.get("replicas") or 0), int(st.get("readyReplicas") or 0), int(st.get("updatedReplicas") or 0),
            list(st.get("conditions") or []))


def pool_conditions(pool: Pool, dep: Optional[Mapping[str, Any]]) -> tuple[bool, bool, Optional[str]]:
    """(ready, progressing, failure message) of one pool from its Deployment's status."""
    replicas, ready, updated, conds = _deployment_counts(dep)
    want = pool.replicas
    failure = None
    for c in conds:
        if c.get("type") == "Progressing" and c.get("reason") == "ProgressDeadlineExceeded":
            failure = f"{pool.object_name}: {c.get('message') or 'progress deadline exceeded'}"
        if c.get("type") == "ReplicaFailure" and c.get("status") == "True":
            failure = f"{pool.object_name}: {c.get('message') or 'replica failure'}"
    is_ready = ready >= want and updated >= want and replicas <= want
    return is_ready, not is_ready, failure


# --------------------------------------------------------------------------- ModelAvailable

MODEL_AVAILABLE = "ModelAvailable"
# Reasons of ModelAvailable.
NO_DOWNLOAD = "NoDownload"  # pvc, hostPath, tinyModel or weights in the image: nothing to fetch
DOWNLOADING = "Downloading"
FETCHED = "Ready"
FETCH_FAILED = "Failed"
NO_PODS = "NoPods"
PODS_UNREADABLE = "PodsUnreadable"
# Waiting reasons of the fetch-model init container that mean it cannot run as it is: its
# Secret or key is missing, its image cannot be pulled, or it keeps failing (crash-loop back-off).
_FAILED_WAITING = frozenset({"CrashLoopBackOff", "CreateContainerConfigError", "CreateContainerError",
                             "ErrImagePull", "ImagePullBackOff", "InvalidImageName", "RunContainerError"})


def _fetch_state(pod: Mapping[str, Any]) -> tuple[str, str]:
    """("done" | "fetching" | "failed", message) of one pod's fetch-model init container."""
    statuses = ((pod.get("status") or {}).get("initContainerStatuses")) or []
    st = next((s for s in statuses if s.get("name") == builders.FETCH_MODEL_CONTAINER), None)
    if st is None:
        return "fetching", "not started"
    state = st.get("state") or {}
    last = (st.get("lastState") or {}).get("terminated") or {}
    last_failed = bool(last) and last.get("exitCode", 0) != 0

    def said(term: Mapping[str, Any]) -> str:
        return ((term.get("message") or "").strip() or term.get("reason") or "failed") + \
            f" (exit code {term.get('exitCode')})"

    term = state.get("terminated")
    if term is not None:
        return ("done", "") if term.get("exitCode", 0) == 0 else ("failed", said(term))
    waiting = state.get("waiting")
    if waiting is not None and waiting.get("reason") in _FAILED_WAITING:
        if waiting["reason"] == "CrashLoopBackOff" and last_failed:
            return "failed", said(last)
        return "failed", f"{waiting['reason']}: {waiting.get('message') or 'init container cannot run'}"
    if last_failed:  # running again after a failure: failed until a try succeeds
        return "failed", said(last)
    return "fetching", ""


def model_available(msvc: ModelService, pods: Optional[list[Mapping[str, Any]]],
                    pods_error: Optional[str] = None) -> dict:
    """The ModelAvailable condition: for a huggingFace or s3 source, from the fetch-model init
    containers of `pods` (the runtime pods fetching the current source); the operator itself
    never touches the source. Failed wins over the others (one failing pod is a problem to see),
    then Ready (a pod has the weights), then Downloading."""
    source = msvc.settings.model_source
    if source.fetched is None:
        model = msvc.spec["model"]
        raw = model.get("source") or {}
        why = {
            "pvc": lambda: f"mounted from PersistentVolumeClaim {raw['pvc']['claimName']}",
            "hostPath": lambda: f"mounted from node path {raw['hostPath']['path']}",
            "tinyModel": lambda: "generated at pod start (tinyModel)",
            None: lambda: f"read from the image at {model['path']}",
        }[source.kind]()
        return condition(MODEL_AVAILABLE, True, NO_DOWNLOAD, f"{why}; nothing to download")
    what = source.description
    if pods_error:  # e.g. RBAC without `list pods`: the rest of the reconcile goes on
        return {"type": MODEL_AVAILABLE, "status": "Unknown", "reason": PODS_UNREADABLE,
                "message": f"cannot read the pods fetching {what}: {pods_error}"[:4000]}
    current = sorted((p for p in pods or ()
                      if not (p.get("metadata") or {}).get("deletionTimestamp")
                      and ((p.get("metadata") or {}).get("annotations") or {}).get(builders.ANNOTATION_MODEL_SOURCE)
                      == what),
                     key=lambda p: p["metadata"]["name"])
    if not current:
        return {"type": MODEL_AVAILABLE, "status": "Unknown", "reason": NO_PODS,
                "message": f"no pods: {what} is fetched when a pod starts"}
    states = [(p["metadata"]["name"], *_fetch_state(p)) for p in current]
    failed = [(name, msg) for name, state, msg in states if state == "failed"]
    if failed:
        name, msg = failed[0]
        more = f" (and {len(failed) - 1} more pod(s))" if len(failed) > 1 else ""
        return condition(MODEL_AVAILABLE, False, FETCH_FAILED, f"fetching {what} failed in pod {name}{more}: {msg}"[:4000])
    if any(state == "done" for _, state, _ in states):
        cached = " into the cache" if source.cache is not None else ""
        return condition(MODEL_AVAILABLE, True, FETCHED, f"{what} fetched{cached}")
    return condition(MODEL_AVAILABLE, False, DOWNLOADING,
                     f"fetching {what} (init container {builders.FETCH_MODEL_CONTAINER})")


def model_service_status(msvc: ModelService, desired: Desired, deployments: Mapping[str, Mapping[str, Any]],
                         now: str, pods: Optional[list[Mapping[str, Any]]] = None,
                         pods_error: Optional[str] = None) -> dict:
    """The full status the operator wants (operator-owned keys + merged conditions). `pods`:
    the runtime pods, read only for a source an init container fetches (ModelAvailable);
    `pods_error`: why they could not be read."""
    shared = desired.shared
    replicas, ready, updated, _ = _deployment_counts(deployments.get(shared.object_name))
    not_ready, progressing, failures = [], False, []
    for pool in desired.pools:
        ok, prog, failure = pool_conditions(pool, deployments.get(pool.object_name))
        progressing = progressing or prog
        if not ok:
            _, r, _, _ = _deployment_counts(deployments.get(pool.object_name))
            not_ready.append(f"{pool.object_name} {r}/{pool.replicas} ready")
        if failure:
            failures.append(failure)
    updates = []
    autoscaling = msvc.spec.get("autoscaling") or {}
    if autoscaling.get("enabled") and shared.replicas == 0 and not not_ready:
        # Scaled to zero by the autoscaler (minReplicas 0): still serving, through the router,
        # which holds the next request while the pool wakes up.
        updates.append(condition("Ready", True, "ScaledToZero",
                                 "no request for scaleToZeroAfter: 0 pods; the router holds the next request "
                                 "until a pod is ready"))
    elif msvc.spec["replicas"] == 0 and not not_ready:
        updates.append(condition("Ready", False, "ScaledToZero", "spec.replicas is 0"))
    elif not_ready:
        updates.append(condition("Ready", False, "PodsNotReady", "; ".join(not_ready)))
    else:
        updates.append(condition("Ready", True, "Ready", f"{ready} pod(s) ready, {len(desired.admitted)} lane(s)"))
    updates.append(condition("Progressing", progressing, "RollingOut" if progressing else "Stable",
                             "waiting for pods: " + "; ".join(not_ready) if progressing else "all pools up to date"))
    if failures:
        updates.append(condition("Degraded", True, "DeploymentFailed", "; ".join(failures)))
    elif desired.rejected:
        msg = "; ".join(f"{name}: {why}" for name, why in sorted(desired.rejected.items()))
        updates.append(condition("Degraded", True, "LanesRejected", msg[:4000]))
    else:
        updates.append(condition("Degraded", False, "AsExpected", "no problems"))
    updates.append(model_available(msvc, pods, pods_error))
    return {
        "observedGeneration": msvc.ref.generation,
        "replicas": replicas,
        "readyReplicas": ready,
        "updatedReplicas": updated,
        # The API-serving pods (a group's leader): what an HPA on the scale subresource counts.
        "selector": selector_string(serving_selector(msvc, shared.name)),
        "lanes": len(desired.admitted),
        "laneNames": sorted(l.lane_name for l in desired.admitted),
        "restartHash": shared.config.restart_hash(),
        "configHash": desired.objects[0]["metadata"]["annotations"]["tokenlane.dev/config-hash"],
        "endpoint": endpoint(msvc, shared),
        "effectiveBudgets": desired.effective_budgets,
        "conditions": merge_conditions(msvc.status.get("conditions"), updates, msvc.ref.generation, now),
    }


def invalid_status(current: Mapping[str, Any], generation: int, message: str, now: str,
                   reason: str = "InvalidSpec") -> dict:
    """Status of an object whose spec is invalid (ModelService or ServingLane), or that the
    cluster cannot serve as it is (`reason`, e.g. LeaderWorkerSetUnavailable)."""
    return {
        "observedGeneration": generation,
        "conditions": merge_conditions(current.get("conditions"), [
            condition("Ready", False, reason, message[:4000]),
            condition("Degraded", True, reason, message[:4000]),
        ], generation, now),
    }


def lane_status(lane: ServingLane, msvc: Optional[ModelService], desired: Optional[Desired],
                deployments: Mapping[str, Mapping[str, Any]], now: str,
                overrides: Optional[Mapping[str, Any]] = None) -> dict:
    """The lane's status; `overrides` (status.overrides in force) say each tuned knob's source."""
    gen = lane.ref.generation
    out: dict[str, Any] = {"observedGeneration": gen, "laneName": lane.lane_name, "modelService": lane.parent}
    if msvc is None or desired is None:
        conds = [condition("Ready", False, "ModelServiceNotFound",
                           f"ModelService {lane.parent!r} not found in namespace {lane.ref.namespace}; "
                           "the lane is served once it exists"),
                 condition("Degraded", True, "ModelServiceNotFound", f"ModelService {lane.parent!r} not found")]
        out["conditions"] = merge_conditions(lane.status.get("conditions"), conds, gen, now)
        return out
    if lane.ref.name in desired.rejected:
        why = desired.rejected[lane.ref.name]
        conds = [condition("Ready", False, "Rejected", why[:4000]), condition("Degraded", True, "Rejected", why[:4000])]
        out["conditions"] = merge_conditions(lane.status.get("conditions"), conds, gen, now)
        return out
    pool = next(p for p in desired.pools if lane.lane_name in p.lanes)
    out["endpoint"] = endpoint(msvc, pool)
    out["effectiveBudgets"] = desired.effective_budgets["lanes"][lane.lane_name]
    out["budgets"] = precedence.lane_sources(overrides or {}, lane.lane_name, out["effectiveBudgets"])
    out["overriddenKnobs"] = sum(1 for b in out["budgets"].values() if b["source"] != precedence.SPEC)
    ok, _, failure = pool_conditions(pool, deployments.get(pool.object_name))
    if lane.dedicated:
        replicas, ready, _, _ = _deployment_counts(deployments.get(pool.object_name))
        out["replicas"], out["readyReplicas"] = replicas, ready
    _, ready, _, _ = _deployment_counts(deployments.get(pool.object_name))
    if ok and pool.replicas > 0:
        ready_cond = condition("Ready", True, "Serving", f"served by {pool.object_name}")
    elif ok and pool is desired.shared and (msvc.spec.get("autoscaling") or {}).get("enabled"):
        ready_cond = condition("Ready", True, "ScaledToZero",
                               f"{pool.object_name} is scaled to zero; the router holds the next request until a "
                               "pod is ready")
    else:
        ready_cond = condition("Ready", False, "PodsNotReady", f"{pool.object_name}: {ready}/{pool.replicas} ready")
    conds = [ready_cond, condition("Degraded", bool(failure), "DeploymentFailed" if failure else "AsExpected",
                                   failure or "no problems")]
    out["conditions"] = merge_conditions(lane.status.get("conditions"), conds, gen, now)
    return out
