"""The kopf side of the budget path: a timer per ModelService running the rollout guard and the tuner.

Every `tick_s` kopf calls `tick` for each ModelService; the work runs when the object's
`spec.tuning.interval` has passed since the last run (until then a tick makes no request,
`Tuning.may_be_due`). The last run is kept in the operator's
memory (`Tuning.last_run`) and exported as a metric, never written to status: status is
written only when a condition or value changes (a restarted operator runs once at once). One run is
a pipeline of small steps (docs/architecture.md, "The budget path"):

1. `_prepare`: read the ModelService and its lanes, render the spec alone (its hash is the
   revision, rollout.spec_revision) and what is in force (the spec or the last-known-good,
   with status.overrides), read the pods' readiness and, when `spec.tuning.prometheusUrl` is
   set, one metrics window from Prometheus.
2. `_guard` (rollout.evaluate): verify a new revision, promote it to last-known-good (its
   inputs and rendered objects go to the ConfigMap `<name>-rollout`), or roll it back:
   RolledBack=True with the failing numbers, a Warning Event, and the operator's reconcile
   renders the last-known-good inputs from then on (last_known_good.inputs_in_force) while
   the spec stays as the user wrote it. When even the last-known-good misses its SLOs badly,
   the declared fallback profile goes into `status.overrides`.
3. `_tune` (tuner.decide), when `spec.tuning.enabled` and the window is good: no revision
   being verified or rolled back in this run, and the config in force (`config_key`) the
   same through the whole window (`no_decision_reason`, docs/tuning.md). Then the
   new budgets go into `status.overrides` and the operator's reconcile re-renders the
   ConfigMap (pods hot-reload, no restart). Every decision goes to `status.tuning`
   (effective budgets, the last decisions), the SLOMet conditions (per ServingLane, and the
   ModelService aggregate) and, when something changed or the tuner starts/stops holding, an
   Event. Prometheus unreachable or thin data: the budgets are held and the `Tuning`
   condition says why.
4. `_write_status`, `_post_events`, then `_reconcile` when the run changed what is rendered.
   A run that only holds writes nothing: consecutive holds keep the first hold's record, the
   Tuning and SLOMet conditions keep the message of their last transition while their
   status and reason hold, and an Event equal to the last one posted about the object (same
   type, reason and message) is not posted again (`EventMemo`).
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import re
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Mapping, Optional

import kopf

from tokenlane.operator.desired import builders, precedence
from tokenlane.operator.clients import dumps, kube as k8s, last_known_good, reads
from tokenlane.operator.controllers import handlers, metrics
from tokenlane.operator.policy import rollout, tuner
from tokenlane.operator.desired import status as status_mod
from tokenlane.operator.api.resources import ModelService, ServingLane, parse_model_service
from tokenlane.operator.api.spec import ModelServiceSettings, TuningSpec
from tokenlane.operator.clients.prometheus import PrometheusClient
from tokenlane.operator.api.tuning_types import (
    GLOBAL,
    GLOBAL_KNOBS,
    HOLD,
    LANE_KNOBS,
    PROBE,
    REVERT,
    Bounds,
    Decision,
    DecisionRecord,
    EffectiveBudgets,
    HoldReason,
    LaneSLO,
    LaneTarget,
    MetricSample,
    TunerSettings,
    Verdict,
)
from tokenlane.runtime.config import CAP_MIN, FALLBACK_SCALED_KEYS
from tokenlane.runtime.config import knob as knob_of

log = logging.getLogger("tokenlane.operator.controllers.tuning")

TICK_S = 10.0
HISTORY = 30  # decisions kept in status.tuning.history (consecutive holds share one)

# (prometheusUrl, served model name, window seconds, lane names, namespace=...) -> one sample
SampleReader = Callable[..., Awaitable[MetricSample]]


async def read_prometheus(url: str, model: str, window_s: float, lanes: list[str], *,
                          namespace: Optional[str] = None) -> MetricSample:
    """Series of `model` in the ModelService's namespace only: two ModelServices serving the
    same model name in different namespaces must not mix. The `namespace` target label is set
    by the Prometheus Operator (ServiceMonitor) and by manifests/monitoring/prometheus/prometheus.yml."""
    return await PrometheusClient(url).read_sample(model, window_s, lanes=lanes,
                                                   extra_matchers={"namespace": namespace} if namespace else None)


class EventMemo:
    """The last Event posted about each object, in memory: the same type, reason and message
    again is not re-posted while the state holds (a hold every interval says it once). An Event
    series (count/lastTimestamp patches) would still be one write per interval, so the memo
    drops the repeats; after an operator restart the first one is posted again."""

    def __init__(self) -> None:
        self._last: dict[tuple[str, str, str], tuple[str, str, str]] = {}

    def is_repeat(self, body: Mapping[str, Any], event: tuple[str, str, str]) -> bool:
        return self._last.get(_object_key(body)) == event

    def remember(self, body: Mapping[str, Any], event: tuple[str, str, str]) -> None:
        self._last[_object_key(body)] = event


def _object_key(body: Mapping[str, Any]) -> tuple[str, str, str]:
    meta = body.get("metadata") or {}
    return str(body.get("kind", "")), str(meta.get("namespace", "")), str(meta.get("name", ""))


def tuning_interval_s(spec: Mapping[str, Any]) -> float:
    """`spec.tuning.interval` of a camelCase spec (kopf's cached one) in seconds, the CRD's
    default when absent; ValueError if invalid."""
    return TuningSpec.from_spec(spec.get("tuning")).interval_s


@dataclass
class Tuning:
    """What the timer needs besides the operator: a clock and a metrics reader (tests inject),
    and what it remembers between runs: when each ModelService last ran (not in status, see
    the module docstring) and the Events it last posted."""

    op: Any  # handlers.Operator
    clock: Callable[[], float] = time.time
    read_sample: SampleReader = read_prometheus
    tick_s: float = TICK_S
    last_run: dict[tuple[str, str], float] = field(default_factory=dict)  # (namespace, name) -> clock time
    events: EventMemo = field(default_factory=EventMemo)

    def last_run_at(self, namespace: str, name: str) -> Optional[float]:
        return self.last_run.get((namespace, name))

    def interval_passed(self, namespace: str, name: str, interval_s: float, now: float) -> bool:
        last_run = self.last_run_at(namespace, name)
        return last_run is None or now - last_run >= interval_s

    def may_be_due(self, namespace: str, name: str, spec: Mapping[str, Any]) -> bool:
        """False when `spec.tuning.interval` (of kopf's cached spec) has not passed since the last
        run: a tick that is not due reads nothing, so a short tick costs no API requests. `_due`
        decides on a fresh read."""
        try:
            interval_s = tuning_interval_s(spec)
        except (ValueError, TypeError):
            return True  # `_due` reads the object and leaves the invalid spec to the operator
        return self.interval_passed(namespace, name, interval_s, self.clock())

    def record_run(self, namespace: str, name: str, now: float, outcome: str) -> None:
        self.last_run[(namespace, name)] = now
        metrics.TUNING_LAST_RUN.labels(namespace=namespace, modelservice=name).set(now)
        metrics.TUNING_RUNS.labels(namespace=namespace, modelservice=name, outcome=outcome).inc()


# --------------------------------------------------------------------------- pure helpers


def tuner_settings(settings: ModelServiceSettings) -> TunerSettings:
    """The tuner's settings from a ModelService's typed spec."""
    t = settings.tuning
    global_bounds = {}
    for knob in GLOBAL_KNOBS:  # moved only with both sides declared
        bounds = t.bounds.get(knob)
        if bounds is not None and bounds.complete:
            global_bounds[knob] = Bounds(float(bounds.min), float(bounds.max))
    return TunerSettings(
        cooldown_s=t.cooldown_s,
        window_s=t.window_s,
        max_step_fraction=float(t.max_step_percent) / 100.0,
        reject_watermark=settings.reject_watermark,
        global_bounds=global_bounds,
    )


def settings_from_spec(spec: Mapping[str, Any]) -> TunerSettings:
    """The tuner's settings from a camelCase ModelService spec."""
    return tuner_settings(ModelServiceSettings.from_spec(spec))


def lane_targets(msvc: ModelService, desired: builders.Desired,
                 budgets: EffectiveBudgets) -> list[LaneTarget]:
    """Each served lane with its SLO and the bounds the tuner may use: the ModelService's
    `spec.tuning.bounds` as defaults, the ServingLane's `spec.tuning.bounds` over them; a lane
    with `tuning.enabled: false` gets none. A bound with one side only keeps the other side at
    the current value (the tuner may move that knob in one direction)."""
    defaults = msvc.settings.tuning.bounds
    sched = msvc.spec["scheduler"]
    out = []
    for lane in desired.admitted:
        lane_settings = lane.settings
        declared = {**defaults, **lane_settings.bounds} if lane_settings.tuning_enabled else {}
        bounds = {}
        for knob in LANE_KNOBS:
            b = declared.get(knob)
            current = budgets.get(lane.lane_name, knob)
            if b is None or not b.declared or current is None:
                continue
            bounds[knob] = Bounds(current if b.min is None else b.min, current if b.max is None else b.max)
            if knob_of(knob).cap == CAP_MIN:
                bounds[knob] = bounds[knob].capped_at(sched[knob])
        slo = lane_settings.slo
        out.append(LaneTarget(lane.lane_name, lane_settings.lane_class, lane_settings.priority,
                              slo.ttft_p95_ms, slo.tpot_p95_ms, bounds, slo.max_refused_share))
    return out


budgets_of = precedence.budgets_of


def tuned_overrides(current: Mapping[str, Any], spec_budgets: EffectiveBudgets,
                    tuned: EffectiveBudgets) -> dict[str, Any]:
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
        if spec_budgets.get(GLOBAL, knob) == value:
            sched.pop(knob, None)
        else:
            sched[knob] = value
    out["lanes"], out["scheduler"] = lanes, sched
    return precedence.with_learned_from({k: v for k, v in out.items() if v}, spec_budgets)


def _without_fallback(overrides: Mapping[str, Any]) -> dict:
    """Overrides with the fallback profile's keys removed (the tuner's stay)."""
    out = copy.deepcopy(dict(overrides))
    out.pop("engine", None)
    out["scheduler"] = {k: v for k, v in (out.get("scheduler") or {}).items() if k not in FALLBACK_SCALED_KEYS}
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


# --------------------------------------------------------------------------- one run


@dataclass
class _Run:
    """What one run works from: read and rendered once, at its start."""

    body: dict
    msvc: ModelService
    lanes: list[ServingLane]
    lane_bodies: list[dict]
    now: float
    revision: str  # of what the spec alone renders
    spec_desired: builders.Desired  # the spec alone
    desired: builders.Desired  # in force: the spec or the last-known-good, with the overrides in force
    overrides: dict  # status.overrides less those of knobs the user edited since (precedence.py)
    dropped: list  # those precedence.DroppedOverride
    targets: list[LaneTarget]
    budgets: EffectiveBudgets
    settings: TunerSettings
    policy: rollout.RolloutPolicy
    pods: rollout.PodReadiness
    sample: MetricSample

    @property
    def status(self) -> dict:
        return self.msvc.status or {}

    @property
    def spec_tuning(self) -> TuningSpec:
        return self.msvc.settings.tuning


@dataclass
class _Outcome:
    """What one run decided: status keys to write, conditions, Events, and a reconcile."""

    patch: dict[str, Any] = field(default_factory=dict)
    conditions: list[dict] = field(default_factory=list)
    events: list[tuple[str, str, str]] = field(default_factory=list)  # (type, reason, message)
    lane_slo: Mapping[str, LaneSLO] = field(default_factory=dict)
    reconcile: bool = False  # what the operator renders changed: reconcile after the writes
    outcome: str = "off"  # the tuner's action this run (hold | adjust | probe | revert), off when it did not run
    quiet_conditions: set[str] = field(default_factory=lambda: {"SLOMet"})  # types whose message waits for a transition


async def tick(t: Tuning, namespace: str, name: str) -> Optional[dict]:
    """One run for ModelService namespace/name if it is due; returns the status patch (tests)."""
    run = await _prepare(t, namespace, name)
    if run is None:
        return None
    out = _Outcome(outcome="error")
    try:
        _precedence(run, out)
        guard = await _guard(t.op, run, out)
        out.outcome = "off"
        _tune(run, guard, out)
        if not await _write_status(t.op, run, out):
            return None
        await _post_events(t, run, out)
        if out.reconcile:
            await _reconcile(t.op, namespace, name)
        return out.patch
    finally:  # a failed run waits for the next interval too
        t.record_run(namespace, name, run.now, out.outcome)


async def _due(t: Tuning, namespace: str, name: str) -> Optional[tuple[dict, ModelService, float]]:
    """The ModelService, when it exists, is valid and its `spec.tuning.interval` has passed."""
    body = await reads.model_service_body(t.op.client, namespace, name)
    if body is None or (body.get("metadata") or {}).get("deletionTimestamp"):
        return None
    try:
        msvc = parse_model_service(body)
    except ValueError:
        return None  # the operator reports the invalid spec
    now = t.clock()
    if not t.interval_passed(namespace, name, msvc.settings.tuning.interval_s, now):
        return None
    return body, msvc, now


async def _render(client: k8s.KubeClient, msvc: ModelService, lanes: list[ServingLane]
                  ) -> Optional[tuple[str, builders.Desired, builders.Desired, dict, list]]:
    """(revision, the spec alone, what is in force, the overrides in force, the overrides the
    user's edits dropped), rendering each only once; None when the spec with its overrides
    cannot be rendered."""
    status = msvc.status or {}
    try:
        revision, spec_desired = rollout.spec_revision(msvc, lanes)
        dropped = precedence.stale_overrides(status.get("overrides") or {}, budgets_of(spec_desired))
        overrides = precedence.without(status.get("overrides") or {}, dropped)
        in_force = builders.Overrides.from_status({"overrides": overrides})
        desired = spec_desired
        if overrides:
            desired = builders.build(msvc, lanes, overrides=in_force)
    except ValueError:
        return None
    pinned_msvc, pinned_lanes = await last_known_good.inputs_in_force(client, msvc, lanes, revision=revision)
    if pinned_msvc is not msvc:
        try:
            desired = builders.build(pinned_msvc, pinned_lanes, overrides=in_force)
        except ValueError:
            pass
    return revision, spec_desired, desired, overrides, dropped


async def _prepare(t: Tuning, namespace: str, name: str) -> Optional[_Run]:
    due = await _due(t, namespace, name)
    if due is None:
        return None
    body, msvc, now = due
    lanes, lane_bodies = await reads.list_lanes(t.op.client, namespace, name)
    rendered = await _render(t.op.client, msvc, lanes)
    if rendered is None:
        return None
    revision, spec_desired, desired, overrides, dropped = rendered
    budgets = budgets_of(desired)
    targets = lane_targets(msvc, desired, budgets)
    settings = tuner_settings(msvc.settings)
    url = msvc.settings.tuning.prometheus_url
    policy = rollout.RolloutPolicy.from_spec(msvc.settings.rollout, metrics=bool(url))
    if url:
        window = min(settings.window_s, policy.verification_window_s)
        sample = await t.read_sample(url, desired.shared.config.model.name, window, [lane.name for lane in targets],
                                     namespace=namespace)
    else:
        sample = MetricSample.unavailable("spec.tuning.prometheusUrl is not set", settings.window_s)
    pods = await reads.pod_readiness(t.op.executor, namespace, name)
    return _Run(body, msvc, lanes, lane_bodies, now, revision, spec_desired, desired, overrides, dropped, targets,
                budgets, settings, policy, pods, sample)


def _precedence(run: _Run, out: _Outcome) -> None:
    """A user's edit wins over the tuner: drop the overrides of edited knobs from status (the
    reconcile already renders without them) and say so once."""
    if run.dropped:
        out.patch["overrides"] = run.overrides
        out.events.append(("Normal", "OverrideDropped", "; ".join(map(str, run.dropped))))


async def _guard(op: Any, run: _Run, out: _Outcome) -> rollout.RolloutDecision:
    """Run the rollout guard and act on its decision (the LKG ConfigMap, the fallback)."""
    state = rollout.RolloutState.from_dict(run.status.get("rollout"))
    guard = rollout.evaluate(run.policy, state, run.revision, run.now, run.pods, run.sample, run.targets)
    if guard.state != state:
        out.patch["rollout"] = guard.state.to_dict()
    if guard.action == rollout.START:
        out.events.append(("Normal", "VerifyingRevision", guard.message))
        if state is not None and state.phase in (rollout.ROLLED_BACK, rollout.FALLBACK, rollout.FAILED):
            out.conditions.append(status_mod.condition("RolledBack", False, "NewRevision", guard.message))
            if state.phase == rollout.FALLBACK:
                out.patch["overrides"] = _without_fallback(run.overrides)
                out.reconcile = True
    elif guard.action == rollout.PROMOTE:
        cm = last_known_good.configmap(run.msvc, run.revision, run.lanes, run.desired.objects)
        await last_known_good.save(op.client, cm)
        out.events.append(("Normal", "LastKnownGood", guard.message))
        out.conditions.append(status_mod.condition("RolledBack", False, guard.reason, guard.message))
    elif guard.action == rollout.ROLLBACK:
        # The failing revision's pods dump their flight recorders before the LKG replaces them.
        dumped = await dumps.dump_runtimes(run.spec_tuning.prometheus_url, run.msvc.namespace,
                                           run.desired.shared.config.model.name,
                                           f"rollback of revision {run.revision}",
                                           tenant_key_digests=list(run.msvc.settings.tenant_key_digests))
        out.events.append(("Warning", "RolledBack", f"{guard.message.rstrip('.')}. {dumped}" if dumped else guard.message))
        out.conditions.append(status_mod.condition("RolledBack", True, guard.reason, guard.message))
        out.reconcile = True
    elif guard.action == rollout.FALLBACK_ACTION:
        inputs = await last_known_good.load(op.client, run.msvc.namespace, run.msvc.name)
        base = (inputs or {}).get("modelService", run.msvc.spec)["scheduler"]
        overrides = copy.deepcopy(run.overrides)
        for key, value in run.policy.fallback.overrides(base).items():
            overrides[key] = {**(overrides.get(key) or {}), **value}
            for knob in value:  # the fallback's value, not a tuner's, is in force for these
                ((overrides.get(precedence.LEARNED_FROM) or {}).get(key) or {}).pop(knob, None)
        out.patch["overrides"] = overrides
        out.events.append(("Warning", "FallbackApplied", guard.message))
        out.conditions.append(status_mod.condition("RolledBack", True, "FallbackApplied", guard.message))
        out.reconcile = True
    elif guard.action == rollout.FAIL:
        if state is None or state.phase != rollout.FAILED:
            out.events.append(("Warning", "RolloutFailed", guard.message))
            out.conditions.append(status_mod.condition("RolledBack", False, guard.reason, guard.message))
    return guard


def _tune(run: _Run, guard: rollout.RolloutDecision, out: _Outcome) -> None:
    """Run the tuner (or say why it does not run) into status.tuning, conditions and Events."""
    tuning_status = dict(run.status.get("tuning") or {})
    tuning_status.pop("lastRunAt", None)  # written by older operators: now a metric
    enabled = run.spec_tuning.enabled
    if enabled and guard.state.phase != rollout.FALLBACK:
        _decide(run, guard, tuning_status, out)
    else:
        why = "tuning disabled (spec.tuning.enabled: false)" if not enabled \
            else "fallback profile in force: budgets are the declared conservative ones"
        out.conditions.append(status_mod.condition("Tuning", False, "Fallback" if enabled else "Disabled", why))
        if run.spec_tuning.prometheus_url:
            out.lane_slo = _lane_slo(run)
            out.conditions += _slo_conditions(out.lane_slo)
    out.patch["tuning"] = tuning_status


def _lane_slo(run: _Run) -> dict[str, LaneSLO]:
    return {lane.name: tuner.lane_slo(lane, run.sample, run.settings) for lane in run.targets}


def _decide(run: _Run, guard: rollout.RolloutDecision, tuning_status: dict, out: _Outcome) -> None:
    history = [DecisionRecord.from_dict(r) for r in tuning_status.get("history") or []]
    verifying = guard.state.phase == rollout.VERIFYING
    state_before = rollout.RolloutState.from_dict(run.status.get("rollout"))
    since = _config_in_force_since(tuning_status, config_key(run.revision, state_before, run.overrides), run.now)
    own_change = next((r.at for r in reversed(history) if r.changes), None)
    bad_window = no_decision_hold(guard.action, guard.state.phase, since, run.now, run.sample.window_s,
                                  guard.state.revision, own_change_at=own_change)
    pending = tuner.pending_experiment(history)
    if run.dropped:
        # The user's edit is in force now: a change in flight can no longer be judged (nor
        # reverted over the edit); the tuner re-learns from the spec value after a cooldown.
        pending = tuner.pending_experiment(history)
        edited = ", ".join(f"{'' if d.scope == GLOBAL else d.scope + '.'}{d.knob}" for d in run.dropped)
        decision = Decision(run.now, HOLD, run.budgets,
                            f"user edited {edited}: the spec value is in force, the tuner re-learns from it",
                            slo=_lane_slo(run), judged=pending.at if pending else None,
                            verdict=Verdict.INCONCLUSIVE if pending else None)
    elif verifying:
        decision = Decision(run.now, HOLD, run.budgets, f"holding budgets: verifying revision {run.revision}",
                            slo=_lane_slo(run), **_straddled(pending, since))
    elif bad_window:
        decision = Decision(run.now, HOLD, run.budgets, bad_window[1], slo=_lane_slo(run),
                            **_straddled(pending, since))
    else:
        decision = tuner.decide(run.targets, run.settings, run.budgets, run.sample, history, run.now)
    held = _hold_category(decision, run.sample, verifying, bad_window[0] if bad_window else None)
    out.outcome = str(decision.action)
    if decision.changed:
        out.patch["overrides"] = tuned_overrides(out.patch.get("overrides", run.overrides),
                                                 budgets_of(run.spec_desired), decision.budgets)
        out.reconcile = True
        kind = "Warning" if decision.action == REVERT else "Normal"
        reason = {REVERT: "TuningReverted", PROBE: "TuningProbe"}.get(decision.action, "BudgetsTuned")
        out.events.append((kind, reason, f"{', '.join(map(str, decision.changes))}: {decision.reason}"))
    elif held and tuning_status.get("held") != held:  # an Event when a hold starts, not every interval
        # Only an outage the tuner cannot wait out is a Warning; verifying a revision is routine.
        out.events.append(("Warning" if held == HoldReason.PROMETHEUS_UNAVAILABLE else "Normal", "TuningHeld",
                           decision.reason))
    # This run may change what is in force (a rollback, the tuner's change): the next window starts now.
    _config_in_force_since(tuning_status, config_key(run.revision, guard.state,
                                                      out.patch.get("overrides", run.overrides)), run.now)
    if held:
        tuning_status["held"] = str(held)
    else:
        tuning_status.pop("held", None)
    record = decision.record()
    still_holding = (record.action == HOLD and record.judged is None and history
                     and history[-1].action == HOLD and history[-1].judged is None
                     and _words(history[-1].reason) == _words(record.reason)
                     and tuning_status.get("lastDecision"))
    if still_holding:
        # Consecutive holds keep the first hold's entry ("holding since"): changes and reverts
        # stay visible, and a run that only holds writes nothing.
        out.quiet_conditions.add("Tuning")
    else:
        history.append(record)
        tuning_status["lastDecision"] = {"at": k8s.timestamp(run.now), "action": str(decision.action),
                                         "reason": decision.reason}
    tuning_status["history"] = [r.to_dict() for r in history[-HISTORY:]]
    tuning_status["effectiveBudgets"] = decision.budgets.to_dict()
    tuning_status["revision"] = run.revision
    out.conditions.append(status_mod.condition("Tuning", not held, str(held) if held else "Tuning",
                                               decision.reason if held else f"{decision.action}: {decision.reason}"))
    out.conditions += _slo_conditions(decision.slo)
    out.lane_slo = decision.slo


async def _write_status(op: Any, run: _Run, out: _Outcome) -> bool:
    """Write the status keys that changed and the lanes' SLOMet, under the operator's lock on a
    fresh read; False when the ModelService is gone."""
    meta = run.body["metadata"]
    namespace, name = meta.get("namespace"), meta["name"]
    async with op.lock_for(namespace, name):
        fresh = await op.client.get(k8s.MODEL_SERVICES, namespace, name)
        if fresh is None:
            return False
        fresh_status = fresh.get("status") or {}
        generation = int((fresh.get("metadata") or {}).get("generation") or 0)
        stamp = k8s.timestamp(run.now)
        if out.conditions:
            out.patch["conditions"] = status_mod.merge_conditions(fresh_status.get("conditions"), out.conditions,
                                                                  generation, stamp,
                                                                  keep_message_of=out.quiet_conditions)
        status_patch = {key: diff_patch(fresh_status.get(key), value) if key != "conditions" else value
                        for key, value in out.patch.items() if fresh_status.get(key) != value}
        if status_patch:
            await op.client.merge_patch(k8s.MODEL_SERVICES, namespace, name, {"status": status_patch},
                                        subresource="status")
        await _write_lane_slo(op, run.lane_bodies, out.lane_slo, run.targets, stamp)
    return True


async def _post_events(t: Tuning, run: _Run, out: _Outcome) -> None:
    meta = run.body["metadata"]
    for event in out.events:
        type_, reason, message = event
        if t.events.is_repeat(run.body, event):
            metrics.EVENTS_SUPPRESSED.labels(reason=reason).inc()
            continue
        if await k8s.post_event(t.op.client, run.body, type_, reason, message, now=run.now):
            t.events.remember(run.body, event)
        log.info("%s/%s %s: %s", meta.get("namespace"), meta["name"], reason, message)


async def _reconcile(op: Any, namespace: str, name: str) -> None:
    try:
        await handlers.reconcile_model_service(op, namespace, name)
    except (handlers.InvalidSpec, k8s.ApiError) as exc:
        log.warning("reconcile of %s/%s after a tuning decision: %s", namespace, name, exc)


# status.tuning.inForce: {config: `config_key` of what is in force, since: when it came in
# (absent: before this operator kept track, taken as settled)}. A window is attributed to one
# config only if it lies wholly after `since`.
IN_FORCE = "inForce"
ROLLING_BACK = "holding budgets: rolling back"


def config_key(revision: str, state: Optional[rollout.RolloutState], overrides: Mapping[str, Any]) -> str:
    """What is in force, as a short hash: the spec's revision, the last-known-good pinned over
    it while a rollback or the fallback holds, and the overrides (tuner and fallback values)."""
    pinned = [state.phase, state.lkg] if state is not None and state.phase in (rollout.ROLLED_BACK,
                                                                               rollout.FALLBACK) else None
    values = {k: v for k, v in overrides.items() if k != precedence.LEARNED_FROM}
    text = json.dumps([revision, pinned, values], sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _config_in_force_since(tuning_status: dict, config: str, now: float) -> Optional[float]:
    """Since when `config` is in force, recording it in status.tuning.inForce: a config other
    than the recorded one came in `now`."""
    recorded = dict(tuning_status.get(IN_FORCE) or {})
    if recorded.get("config") not in (None, config):
        recorded = {"since": now}
    recorded["config"] = config
    tuning_status[IN_FORCE] = recorded
    return recorded.get("since")


def no_decision_hold(guard_action: str, phase: str, since: Optional[float], now: float, window_s: float,
                     revision: str, *, own_change_at: Optional[float] = None) -> Optional[tuple[HoldReason, str]]:
    """Why this run's metrics window may not be used for a tuning decision, or None.

    The guard rolls a revision back in this run (the window is the bad revision's), a revision
    is being verified, or the window does not lie wholly after the config in force came in (it
    mixes two configs: a rollback, a user's edit, a new revision). The tuner's own last change
    (`own_change_at`) is not such a change: the tuner waits a full window after it and judges
    it. Pure: the guard-baseline property tests drive it too."""
    if guard_action == rollout.ROLLBACK:
        return HoldReason.ROLLING_BACK, f"{ROLLING_BACK} revision {revision}: its window is not used for decisions"
    if phase == rollout.VERIFYING:
        return HoldReason.VERIFYING_REVISION, f"holding budgets: verifying revision {revision}"
    if since is not None and since != own_change_at and now - since < window_s:
        return HoldReason.SETTLING_WINDOW, (f"holding budgets: the config in force changed {now - since:.0f}s ago; "
                                            f"no decision on a window ({window_s:.0f}s) that spans the change")
    return None


def no_decision_reason(guard_action: str, phase: str, since: Optional[float], now: float, window_s: float,
                       revision: str, *, own_change_at: Optional[float] = None) -> Optional[str]:
    """The text of `no_decision_hold`, or None."""
    hold = no_decision_hold(guard_action, phase, since, now, window_s, revision, own_change_at=own_change_at)
    return None if hold is None else hold[1]


def _straddled(pending: Optional[DecisionRecord], since: Optional[float]) -> dict:
    """Mark the experiment in flight inconclusive when something else changed the config after
    it: its window no longer measures it alone (no credit for a rollback's improvement)."""
    if pending is not None and since is not None and since > pending.at:
        return {"judged": pending.at, "verdict": Verdict.INCONCLUSIVE}
    return {}


def _words(reason: str) -> str:
    """A reason without its numbers: "cooldown: last change 30s ago" is the same hold at 40s."""
    return re.sub(r"[0-9.]+", "#", reason)


def _hold_category(decision: Decision, sample: MetricSample, verifying: bool,
                   bad_window: Optional[HoldReason] = None) -> Optional[HoldReason]:
    """Why the tuner could not act on data (for the Tuning condition), or None."""
    if decision.changed:
        return None
    if verifying:  # the reason says "verifying revision" whether or not Prometheus is up
        return HoldReason.VERIFYING_REVISION
    if bad_window is not None:
        # A rollback's hold, or one on a window that spans a change (verifying is handled above).
        return HoldReason.ROLLING_BACK if bad_window == HoldReason.ROLLING_BACK else HoldReason.SETTLING_WINDOW
    if not sample.available:
        return HoldReason.PROMETHEUS_UNAVAILABLE
    return decision.held


def _slo_conditions(slo: Mapping[str, LaneSLO]) -> list[dict]:
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


async def _write_lane_slo(op: Any, lane_bodies: list[dict], slo: Mapping[str, LaneSLO],
                          targets: list[LaneTarget], stamp: str) -> None:
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
        conds = status_mod.merge_conditions(current.get("conditions"), [cond], generation, stamp,
                                            keep_message_of={"SLOMet"})
        wanted = {"slo": {**observed, "met": status} if observed else {"met": status}, "conditions": conds}
        targets = ("targetTtftP95Ms", "targetTpotP95Ms")
        if current.get("conditions") == conds and "updated" not in (current.get("slo") or {}) \
                and all((current.get("slo") or {}).get(k) == wanted["slo"].get(k) for k in targets):
            continue  # the SLO verdict holds: the observed p95s of its transition stay (live ones are metrics)
        if "updated" in (current.get("slo") or {}):
            wanted["slo"]["updated"] = None  # a per-run stamp written by older operators
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
    async def tuning_timer(namespace: str, name: str, spec: Any, **_: Any) -> None:
        if not t.may_be_due(namespace, name, spec):
            return
        try:
            await tick(t, namespace, name)
        except k8s.ApiError as exc:
            log.warning("tuning %s/%s: %s", namespace, name, exc)

    return t
