"""The kopf side of issue 7: a timer per ModelService running the rollout guard and the tuner.

Every `tick_s` kopf calls `tick` for each ModelService; the work runs when the object's
`spec.tuning.interval` has passed since the last run (`status.tuning.lastRunAt`):

1. Render the spec alone (no tuned values) with the operator's builders: its hash is the
   revision (rollout.revision_of). Read the pods' readiness from the owned Deployments and,
   when `spec.tuning.prometheusUrl` is set, one metrics window from Prometheus.
2. Rollout guard (rollout.evaluate): verify a new revision, promote it to last-known-good
   (its inputs and rendered objects go to the ConfigMap `<name>-rollout`), or roll it back:
   RolledBack=True with the failing numbers, a Warning Event, and the operator's reconcile
   renders the last-known-good inputs from then on (`inputs_in_force`, called by handlers)
   while the spec stays as the user wrote it. When even the last-known-good misses its SLOs
   badly, the declared fallback profile goes into `status.overrides`.
3. Tuner (tuner.decide), when `spec.tuning.enabled` and no revision is being verified: the
   new budgets go into `status.overrides` and the operator's reconcile re-renders the
   ConfigMap (pods hot-reload, no restart). Every decision goes to `status.tuning`
   (effective budgets, the last decisions), the SLOMet conditions (per ServingLane, and the
   ModelService aggregate) and, when something changed or the tuner starts/stops holding, an
   Event. Prometheus unreachable or thin data: the budgets are held and the `Tuning`
   condition says why.
"""

from __future__ import annotations

import copy
import json
import logging
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Mapping, Optional

import kopf
import yaml

from tokenlane.operator import builders, k8s, rollout, tuner
from tokenlane.operator import status as status_mod
from tokenlane.operator.model import ModelService, ServingLane, parse_duration, parse_model_service
from tokenlane.operator.prometheus import PrometheusClient

log = logging.getLogger("tokenlane.operator.tuning")

TICK_S = 10.0
HISTORY = 30  # decisions kept in status.tuning.history (consecutive holds share one)
ROLLOUT_CONFIGMAP_SUFFIX = "-rollout"
COMPONENT_ROLLOUT = "rollout-guard"

# (prometheusUrl, served model name, window seconds, lane names, namespace=...) -> one sample
SampleReader = Callable[..., Awaitable[tuner.MetricSample]]


async def read_prometheus(url: str, model: str, window_s: float, lanes: list[str], *,
                          namespace: Optional[str] = None) -> tuner.MetricSample:
    """Series of `model` in the ModelService's namespace only: two ModelServices serving the
    same model name in different namespaces must not mix. The `namespace` target label is set
    by the Prometheus Operator (ServiceMonitor) and by manifests/monitoring/prometheus/prometheus.yml."""
    return await PrometheusClient(url).read_sample(model, window_s, lanes=lanes,
                                                   extra_matchers={"namespace": namespace} if namespace else None)


@dataclass
class Tuning:
    """What the timer needs besides the operator: a clock and a metrics reader (tests inject)."""

    op: Any  # handlers.Operator
    clock: Callable[[], float] = time.time
    read_sample: SampleReader = read_prometheus
    tick_s: float = TICK_S


# --------------------------------------------------------------------------- pure helpers


def settings_from_spec(spec: Mapping[str, Any]) -> tuner.TunerSettings:
    t = spec.get("tuning") or {}
    bounds = (t.get("bounds") or {}).get("kvCacheHighWatermark")
    global_bounds = {}
    if bounds and "min" in bounds and "max" in bounds:
        global_bounds["kvCacheHighWatermark"] = tuner.Bounds(float(bounds["min"]), float(bounds["max"]))
    window = parse_duration(t.get("window") or "5m")
    return tuner.TunerSettings(
        cooldown_s=parse_duration(t.get("cooldown") or "300s"),
        window_s=window,
        max_step_fraction=float(t.get("maxStepPercent", 25)) / 100.0,
        reject_watermark=float(spec["scheduler"]["kvCacheRejectWatermark"]),
        global_bounds=global_bounds,
    )


def lane_targets(msvc: ModelService, desired: builders.Desired,
                 budgets: tuner.EffectiveBudgets) -> list[tuner.LaneTarget]:
    """Each served lane with its SLO and the bounds the tuner may use: the ModelService's
    `spec.tuning.bounds` as defaults, the ServingLane's `spec.tuning.bounds` over them; a lane
    with `tuning.enabled: false` gets none. A bound with one side only keeps the other side at
    the current value (the tuner may move that knob in one direction)."""
    defaults = (msvc.spec.get("tuning") or {}).get("bounds") or {}
    sched = msvc.spec["scheduler"]
    out = []
    for lane in desired.admitted:
        lane_tuning = lane.spec.get("tuning") or {}
        declared = {} if lane_tuning.get("enabled") is False else {**defaults, **(lane_tuning.get("bounds") or {})}
        bounds = {}
        for knob in tuner.LANE_KNOBS:
            b = declared.get(knob)
            current = budgets.get(lane.lane_name, knob)
            if not b or current is None:
                continue
            bounds[knob] = tuner.Bounds(b.get("min", current), b.get("max", current))
            if knob in tuner.GLOBAL_CAPPED:
                bounds[knob] = tuner.capped_by_global(bounds[knob], sched[knob])
        slo = lane.spec.get("slo") or {}
        out.append(tuner.LaneTarget(lane.lane_name, lane.spec["class"], lane.spec["priority"],
                                    slo.get("ttftP95Ms"), slo.get("tpotP95Ms"), bounds))
    return out


def budgets_of(desired: builders.Desired) -> tuner.EffectiveBudgets:
    """The budgets in force over every pool (lanes) and the shared pool (global knobs)."""
    lanes: dict[str, dict] = {}
    for pool in desired.pools:
        part = tuner.budgets_from_config(pool.config)
        for name in pool.lanes:
            lanes[name] = dict(part.lanes[name])
    shared = tuner.budgets_from_config(desired.shared.config)
    return tuner.EffectiveBudgets(lanes, dict(shared.global_))


def tuned_overrides(current: Mapping[str, Any], spec_budgets: tuner.EffectiveBudgets,
                    tuned: tuner.EffectiveBudgets) -> dict[str, Any]:
    """`status.overrides` with the tuned knobs: only values that differ from the spec's own
    (a knob back at its spec value is dropped, so the spec stays the source of truth)."""
    out = copy.deepcopy(dict(current or {}))
    lanes = {k: dict(v) for k, v in (out.get("lanes") or {}).items()}
    for lane, values in tuned.lanes.items():
        entry = lanes.setdefault(lane, {})
        for knob, value in values.items():
            if spec_budgets.get(lane, knob) == value:
                entry.pop(knob, None)
            else:
                entry[knob] = value
        if not entry:
            lanes.pop(lane)
    sched = dict(out.get("scheduler") or {})
    for knob, value in tuned.global_.items():
        if spec_budgets.get(tuner.GLOBAL, knob) == value:
            sched.pop(knob, None)
        else:
            sched[knob] = value
    out["lanes"], out["scheduler"] = lanes, sched
    return {k: v for k, v in out.items() if v}


def spec_revision(msvc: ModelService, lanes: list[ServingLane]) -> tuple[str, builders.Desired]:
    """The revision of what the spec alone renders (no tuned or fallback values)."""
    spec_only = ModelService(ref=msvc.ref, spec=msvc.spec, labels=msvc.labels, status={})
    desired = builders.build(spec_only, lanes, overrides=builders.Overrides())
    return rollout.revision_of(desired.objects), desired


def _condition_list(current: Optional[list], updates: list[dict], generation: int, now: str) -> list[dict]:
    return status_mod.merge_conditions(current, updates, generation, now)


def _iso(ts: float) -> str:
    import datetime

    return datetime.datetime.fromtimestamp(ts, datetime.timezone.utc).replace(microsecond=0).isoformat().replace(
        "+00:00", "Z")


# --------------------------------------------------------------------------- the rollout ConfigMap


def rollout_configmap_name(name: str) -> str:
    return f"{name}{ROLLOUT_CONFIGMAP_SUFFIX}"


def _rollout_configmap(msvc: ModelService, revision: str, lanes: list[ServingLane], objects: list[dict]) -> dict:
    labels = {builders.LABEL_NAME: "tokenlane", builders.LABEL_INSTANCE: msvc.name,
              builders.LABEL_COMPONENT: COMPONENT_ROLLOUT, builders.LABEL_MODEL_SERVICE: msvc.name}
    meta: dict[str, Any] = {"name": rollout_configmap_name(msvc.name), "namespace": msvc.namespace, "labels": labels}
    owner = builders.owner_reference(msvc)
    if owner:
        meta["ownerReferences"] = [owner]
    inputs = {"revision": revision, "modelService": msvc.spec,
              "lanes": {lane.ref.name: lane.spec for lane in lanes}}
    return {
        "apiVersion": "v1", "kind": "ConfigMap", "metadata": meta,
        "data": {
            "revision": revision,
            "inputs.json": json.dumps(inputs, sort_keys=True),
            "objects.yaml": yaml.safe_dump_all(objects, sort_keys=False),
        },
    }


async def _save_last_known_good(op: Any, cm: dict) -> None:
    meta = cm["metadata"]
    try:
        await op.client.create(k8s.CONFIG_MAPS, cm)
    except k8s.ApiError as exc:
        if exc.status != 409:
            raise
        await op.client.apply(k8s.CONFIG_MAPS, cm)
    log.info("saved last-known-good revision %s of %s/%s", cm["data"]["revision"], meta["namespace"], meta["name"])


async def _load_last_known_good(op: Any, namespace: str, name: str) -> Optional[dict]:
    # A labelled list rather than a get: the operator's RBAC grants list on ConfigMaps, not get.
    found = await op.client.list(k8s.CONFIG_MAPS, namespace,
                                 {builders.LABEL_INSTANCE: name, builders.LABEL_COMPONENT: COMPONENT_ROLLOUT})
    cm = next((c for c in found if c["metadata"]["name"] == rollout_configmap_name(name)), None)
    if not cm:
        return None
    try:
        return json.loads((cm.get("data") or {}).get("inputs.json") or "")
    except ValueError:
        log.warning("ConfigMap %s/%s holds no readable inputs.json", namespace, rollout_configmap_name(name))
        return None


async def inputs_in_force(op: Any, msvc: ModelService,
                          lanes: list[ServingLane]) -> tuple[ModelService, list[ServingLane]]:
    """What the operator's reconcile should render: the spec, or, while a rollback or the
    fallback is in force, the last-known-good inputs (spec untouched; replicas stay the
    user's, since scaling is not a revision). Lanes added since the LKG are left out (marked
    deleting) until the spec changes again."""
    state = rollout.RolloutState.from_dict((msvc.status or {}).get("rollout"))
    if state is None or state.phase not in (rollout.ROLLED_BACK, rollout.FALLBACK) or not state.lkg:
        return msvc, lanes
    try:
        revision, _ = spec_revision(msvc, lanes)
    except ValueError:
        revision = None
    if state.phase == rollout.ROLLED_BACK and revision != state.rolled_back:
        return msvc, lanes  # the user changed the spec: the guard verifies the new revision
    if state.phase == rollout.FALLBACK and revision not in (state.rolled_back, state.lkg):
        return msvc, lanes
    inputs = await _load_last_known_good(op, msvc.namespace, msvc.name)
    if not inputs or inputs.get("revision") != state.lkg:
        log.warning("%s/%s: last-known-good %s not found in its ConfigMap; rendering the spec",
                    msvc.namespace, msvc.name, state.lkg)
        return msvc, lanes
    spec = copy.deepcopy(inputs["modelService"])
    spec["replicas"] = msvc.spec["replicas"]
    pinned = ModelService(ref=msvc.ref, spec=spec, labels=msvc.labels, status=msvc.status)
    lane_specs = inputs.get("lanes") or {}
    pinned_lanes = []
    for lane in lanes:
        if lane.ref.name in lane_specs:
            pinned_lanes.append(ServingLane(ref=lane.ref, spec=lane_specs[lane.ref.name], created=lane.created,
                                            deleting=lane.deleting, status=lane.status))
        else:
            pinned_lanes.append(ServingLane(ref=lane.ref, spec=lane.spec, created=lane.created, deleting=True,
                                            status=lane.status))
    return pinned, pinned_lanes


# --------------------------------------------------------------------------- one tick


async def _pod_readiness(op: Any, namespace: str, name: str) -> rollout.PodReadiness:
    deployments = await op.executor.observe(namespace, name, kinds=(k8s.DEPLOYMENTS,))
    desired = updated = ready = 0
    for dep in deployments:
        want = int((dep.get("spec") or {}).get("replicas") or 0)
        st = dep.get("status") or {}
        desired += want
        updated += min(want, int(st.get("updatedReplicas") or 0))
        ready += min(want, int(st.get("readyReplicas") or 0))
    return rollout.PodReadiness(desired, updated, ready)


async def tick(t: Tuning, namespace: str, name: str) -> Optional[dict]:
    """One run for ModelService namespace/name if it is due; returns what was written (tests)."""
    from tokenlane.operator import handlers  # handlers imports this module lazily, too

    op = t.op
    body = await op.client.get(k8s.MODEL_SERVICES, namespace, name)
    if body is None or (body.get("metadata") or {}).get("deletionTimestamp"):
        return None
    body.setdefault("apiVersion", k8s.MODEL_SERVICES.api_version)
    body.setdefault("kind", "ModelService")
    try:
        msvc = parse_model_service(body)
    except ValueError:
        return None  # the operator reports the invalid spec
    now = t.clock()
    status = msvc.status or {}
    spec_tuning = msvc.spec.get("tuning") or {}
    interval = parse_duration(spec_tuning.get("interval") or "60s")
    last_run = ((status.get("tuning") or {}).get("lastRunAt"))
    if last_run is not None and now - float(last_run) < interval:
        return None

    lanes, lane_bodies = await handlers._list_lanes(op, namespace, name)
    try:
        revision, spec_desired = spec_revision(msvc, lanes)
        desired = builders.build(msvc, lanes, overrides=builders.Overrides.from_status(status))
    except ValueError:
        return None
    pinned_msvc, pinned_lanes = await inputs_in_force(op, msvc, lanes)
    if pinned_msvc is not msvc:
        try:
            desired = builders.build(pinned_msvc, pinned_lanes, overrides=builders.Overrides.from_status(status))
        except ValueError:
            pass
    budgets = budgets_of(desired)
    targets = lane_targets(msvc, desired, budgets)
    settings = settings_from_spec(msvc.spec)
    url = spec_tuning.get("prometheusUrl")
    lane_names = [lane.name for lane in targets]
    model = desired.shared.config.model.name
    policy = rollout.RolloutPolicy.from_spec(msvc.spec.get("rollout"), metrics=bool(url))
    if url:
        window = min(settings.window_s, policy.verification_window_s)
        sample = await t.read_sample(url, model, window, lane_names, namespace=namespace)
    else:
        sample = tuner.MetricSample.unavailable("spec.tuning.prometheusUrl is not set", settings.window_s)

    events: list[tuple[str, str, str]] = []
    conditions: list[dict] = []
    patch: dict[str, Any] = {}
    reconcile = False

    # ---- rollout guard
    state = rollout.RolloutState.from_dict(status.get("rollout"))
    pods = await _pod_readiness(op, namespace, name)
    guard = rollout.evaluate(policy, state, revision, now, pods, sample, targets)
    if guard.state != state:
        patch["rollout"] = guard.state.to_dict()
    if guard.action == rollout.START:
        events.append(("Normal", "VerifyingRevision", guard.message))
        if state is not None and state.phase in (rollout.ROLLED_BACK, rollout.FALLBACK, rollout.FAILED):
            conditions.append(status_mod.condition("RolledBack", False, "NewRevision", guard.message))
            if state.phase == rollout.FALLBACK:
                patch["overrides"] = _without_fallback(status.get("overrides") or {})
                reconcile = True
    elif guard.action == rollout.PROMOTE:
        cm = _rollout_configmap(msvc, revision, lanes, desired.objects)
        await _save_last_known_good(op, cm)
        events.append(("Normal", "LastKnownGood", guard.message))
        conditions.append(status_mod.condition("RolledBack", False, guard.reason, guard.message))
    elif guard.action == rollout.ROLLBACK:
        events.append(("Warning", "RolledBack", guard.message))
        conditions.append(status_mod.condition("RolledBack", True, guard.reason, guard.message))
        reconcile = True
    elif guard.action == rollout.FALLBACK_ACTION:
        profile = policy.fallback
        inputs = await _load_last_known_good(op, namespace, name)
        base = (inputs or {}).get("modelService", msvc.spec)["scheduler"]
        overrides = dict(status.get("overrides") or {})
        for key, value in profile.overrides(base).items():
            overrides[key] = {**(overrides.get(key) or {}), **value}
        patch["overrides"] = overrides
        events.append(("Warning", "FallbackApplied", guard.message))
        conditions.append(status_mod.condition("RolledBack", True, "FallbackApplied", guard.message))
        reconcile = True
    elif guard.action == rollout.FAIL:
        if state is None or state.phase != rollout.FAILED:
            events.append(("Warning", "RolloutFailed", guard.message))
            conditions.append(status_mod.condition("RolledBack", False, guard.reason, guard.message))

    # ---- tuner
    tuning_status = dict(status.get("tuning") or {})
    tuning_status["lastRunAt"] = now
    verifying = guard.state.phase == rollout.VERIFYING
    if spec_tuning.get("enabled") and guard.state.phase != rollout.FALLBACK:
        history = [tuner.DecisionRecord.from_dict(r) for r in tuning_status.get("history") or []]
        if verifying:
            decision = tuner.Decision(now, tuner.HOLD, budgets, f"holding budgets: verifying revision {revision}",
                                      slo={lane.name: tuner.lane_slo(lane, sample, settings) for lane in targets})
        else:
            decision = tuner.decide(targets, settings, budgets, sample, history, now)
        held = _hold_category(decision, sample, verifying)
        if decision.changed:
            spec_budgets = budgets_of(spec_desired)
            patch["overrides"] = tuned_overrides(patch.get("overrides", status.get("overrides")), spec_budgets,
                                                 decision.budgets)
            reconcile = True
            kind = "Warning" if decision.action == tuner.REVERT else "Normal"
            reason = {tuner.REVERT: "TuningReverted", tuner.PROBE: "TuningProbe"}.get(decision.action, "BudgetsTuned")
            events.append((kind, reason, f"{', '.join(map(str, decision.changes))}: {decision.reason}"))
        elif held and tuning_status.get("held") != held:  # an Event when a hold starts, not every interval
            kind = "Warning" if held == "PrometheusUnavailable" else "Normal"
            events.append((kind, "TuningHeld", decision.reason))
        if held:
            tuning_status["held"] = held
        else:
            tuning_status.pop("held", None)
        record = decision.record()
        if (record.action == tuner.HOLD and record.judged is None and history
                and history[-1].action == tuner.HOLD and history[-1].judged is None):
            history[-1] = record  # consecutive holds keep one entry: changes and reverts stay visible
        else:
            history.append(record)
        tuning_status["history"] = [r.to_dict() for r in history[-HISTORY:]]
        tuning_status["lastDecision"] = {"at": _iso(now), "action": decision.action, "reason": decision.reason}
        tuning_status["effectiveBudgets"] = decision.budgets.to_dict()
        tuning_status["revision"] = revision
        conditions.append(status_mod.condition("Tuning", not held, held or "Tuning",
                                               decision.reason if held else f"{decision.action}: {decision.reason}"))
        conditions += _slo_conditions(decision.slo)
        lane_slo = decision.slo
    else:
        why = "tuning disabled (spec.tuning.enabled: false)" if not spec_tuning.get("enabled") \
            else "fallback profile in force: budgets are the declared conservative ones"
        conditions.append(status_mod.condition("Tuning", False, "Disabled" if not spec_tuning.get("enabled")
                                               else "Fallback", why))
        lane_slo = {lane.name: tuner.lane_slo(lane, sample, settings) for lane in targets} if url else {}
        if lane_slo:
            conditions += _slo_conditions(lane_slo)
    patch["tuning"] = tuning_status

    # ---- write (under the operator's lock, on a fresh read), then reconcile if needed
    async with op.lock_for(namespace, name):
        fresh = await op.client.get(k8s.MODEL_SERVICES, namespace, name)
        if fresh is None:
            return None
        fresh_status = fresh.get("status") or {}
        generation = int((fresh.get("metadata") or {}).get("generation") or 0)
        stamp = _iso(now)
        if conditions:
            patch["conditions"] = _condition_list(fresh_status.get("conditions"), conditions, generation, stamp)
        status_patch = {key: diff_patch(fresh_status.get(key), value) if key != "conditions" else value
                        for key, value in patch.items() if fresh_status.get(key) != value}
        if status_patch:
            await op.client.merge_patch(k8s.MODEL_SERVICES, namespace, name, {"status": status_patch},
                                        subresource="status")
        await _write_lane_slo(op, lane_bodies, lane_slo, targets, stamp)
    for type_, reason, message in events:
        await post_event(op, body, type_, reason, message, now)
        log.info("%s/%s %s: %s", namespace, name, reason, message)
    if reconcile:
        try:
            await handlers.reconcile_model_service(op, namespace, name)
        except (handlers.InvalidSpec, k8s.ApiError) as exc:
            log.warning("reconcile of %s/%s after a tuning decision: %s", namespace, name, exc)
    return patch


def _without_fallback(overrides: Mapping[str, Any]) -> dict:
    """Overrides with the fallback profile's keys removed (the tuner's stay)."""
    out = copy.deepcopy(dict(overrides))
    out.pop("engine", None)
    sched = {k: v for k, v in (out.get("scheduler") or {}).items() if k not in _GLOBAL_CAPPED}
    out["scheduler"] = sched
    return {k: v for k, v in out.items() if v}


def diff_patch(old: Any, new: Any) -> Any:
    """A JSON merge patch turning `old` into `new` (None deletes a key)."""
    if not isinstance(old, dict) or not isinstance(new, dict):
        return new
    patch = {k: None for k in old if k not in new}
    for k, v in new.items():
        if k not in old:
            patch[k] = v
        elif old[k] != v:
            patch[k] = diff_patch(old[k], v)
    return patch


async def post_event(op: Any, body: Mapping[str, Any], type_: str, reason: str, message: str, now: float) -> None:
    """A Warning/Normal Event about the ModelService (the operator's one Event helper)."""
    body = {"apiVersion": k8s.MODEL_SERVICES.api_version, "kind": "ModelService", **body}
    await k8s.post_event(op.client, body, type_, reason, message, now=now)


def _hold_category(decision: tuner.Decision, sample: tuner.MetricSample, verifying: bool) -> Optional[str]:
    """Why the tuner could not act on data (for the Tuning condition), or None."""
    if decision.changed:
        return None
    if not sample.available:
        return "PrometheusUnavailable"
    if verifying:
        return "VerifyingRevision"
    if "too few requests" in decision.reason:
        return "InsufficientData"
    return None


def _slo_conditions(slo: Mapping[str, tuner.LaneSLO]) -> list[dict]:
    """The ModelService's aggregate SLOMet: False if any lane misses, True if all with data meet."""
    judged = {name: s for name, s in slo.items() if s.met is not None}
    missing = sorted(name for name, s in judged.items() if not s.met)
    if missing:
        msg = "; ".join(f"{n}: {slo[n].message}" for n in missing)
        return [status_mod.condition("SLOMet", False, "LanesMissSLO", msg[:4000])]
    if judged:
        return [status_mod.condition("SLOMet", True, "AllLanesWithinSLO",
                                     "; ".join(f"{n}: {s.message}" for n, s in sorted(judged.items()))[:4000])]
    reasons = sorted({s.reason for s in slo.values()})
    if not reasons:
        return []
    return [{"type": "SLOMet", "status": "Unknown", "reason": reasons[0],
             "message": "; ".join(f"{n}: {s.message}" for n, s in sorted(slo.items()))[:4000]}]


async def _write_lane_slo(op: Any, lane_bodies: list[dict], slo: Mapping[str, tuner.LaneSLO],
                          targets: list[tuner.LaneTarget], stamp: str) -> None:
    by_lane = {}
    for body in lane_bodies:
        spec = body.get("spec") or {}
        by_lane[spec.get("laneName") or body["metadata"]["name"]] = body
    target_of = {lane.name: lane for lane in targets}
    for lane_name, s in slo.items():
        body = by_lane.get(lane_name)
        if body is None:
            continue
        target = target_of[lane_name]
        observed = {k: v for k, v in (("ttftP95Ms", s.ttft_p95_ms), ("tpotP95Ms", s.tpot_p95_ms),
                                      ("targetTtftP95Ms", target.ttft_p95_ms),
                                      ("targetTpotP95Ms", target.tpot_p95_ms)) if v is not None}
        status = "Unknown" if s.met is None else ("True" if s.met else "False")
        cond = {"type": "SLOMet", "status": status, "reason": s.reason, "message": s.message}
        generation = int(body["metadata"].get("generation") or 0)
        current = body.get("status") or {}
        conds = _condition_list(current.get("conditions"), [cond], generation, stamp)
        wanted = {"slo": {**observed, "met": status, "updated": stamp} if observed else {"met": status},
                  "conditions": conds}
        if current.get("conditions") == conds and (current.get("slo") or {}).get("met") == status \
                and {k: v for k, v in (current.get("slo") or {}).items() if k != "updated"} == \
                {k: v for k, v in wanted["slo"].items() if k != "updated"}:
            continue
        try:
            await op.client.merge_patch(k8s.SERVING_LANES, body["metadata"].get("namespace"), body["metadata"]["name"],
                                        {"status": wanted}, subresource="status")
        except k8s.ApiError as exc:
            if exc.status != 404:
                raise


# --------------------------------------------------------------------------- kopf wiring


def register(registry: kopf.OperatorRegistry, op: Any, *, tuning: Optional[Tuning] = None) -> Tuning:
    """Register the tuning timer on `registry` (operator/main.py calls this next to
    handlers.register). Returns the Tuning object (tests use it to drive the clock)."""
    t = tuning or Tuning(op)

    @kopf.timer("tokenlane.dev", "v1alpha1", "modelservices", registry=registry, interval=t.tick_s,
                initial_delay=t.tick_s, idle=None)
    async def tuning_timer(namespace: str, name: str, **_: Any) -> None:
        try:
            await tick(t, namespace, name)
        except k8s.ApiError as exc:
            log.warning("tuning %s/%s: %s", namespace, name, exc)

    return t
