"""The rollout guard: a pure function that verifies each new revision and decides its fate.

    evaluate(policy, state, revision, now, pods, sample, lanes) -> RolloutDecision

A *revision* is any spec change that yields a new runtime configuration or pod template
(`revision_of` hashes exactly those rendered parts, leaving out the tuner's budgets and the
replica count). After a new revision appears the guard verifies it: its pods must all be
ready and updated within `progressDeadline`, then, over a `verificationWindow` of traffic,
no lane's TTFT / TPOT p95 may regress beyond the thresholds against the last-known-good
(LKG) revision's numbers. Then:

  promote   the revision becomes the LKG (the caller stores its rendered objects)
  rollback  the caller restores the LKG objects, sets RolledBack=True with the failing
            numbers and emits an Event; the spec is left as the user wrote it, and while the
            spec still renders the bad revision the guard keeps the LKG in force
            (`hold_rolled_back`) instead of fighting the user or GitOps
  fallback  even the LKG misses its SLOs badly (p95 above `fallbackMissFactor` x target):
            the caller applies the declared conservative profile (lower budgets and/or
            continuousBatching: false)
  wait / none / fail   nothing to do yet / nothing to do / a bad revision with no LKG to
            restore (the caller reports Degraded)

The state lives in the ModelService status (`status.rollout`), so the operator can restart
at any time without losing track.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Optional, Sequence

from tokenlane.operator.desired import builders
from tokenlane.operator.api.resources import ModelService, ServingLane
from tokenlane.operator.api.enums import StrEnum
from tokenlane.operator.api.spec import FallbackPolicy, RolloutSpec
from tokenlane.operator.api.tuning_types import LaneTarget, MetricSample, too_few_requests
from tokenlane.runtime.config import FALLBACK_SCALED_KEYS


class Phase(StrEnum):
    """Where the guard stands with the spec's revision (status.rollout.phase)."""

    VERIFYING = "Verifying"
    STABLE = "Stable"
    ROLLED_BACK = "RolledBack"
    FALLBACK = "Fallback"
    FAILED = "Failed"


class GuardAction(StrEnum):
    """The guard's verdict on one step: what the caller does (module docstring)."""

    NONE = "none"
    WAIT = "wait"
    START = "start"
    PROMOTE = "promote"
    ROLLBACK = "rollback"
    HOLD_ROLLED_BACK = "hold_rolled_back"
    FALLBACK = "fallback"
    FAIL = "fail"


VERIFYING, STABLE, ROLLED_BACK, FALLBACK, FAILED = Phase
NONE, WAIT, START, PROMOTE, ROLLBACK, HOLD_ROLLED_BACK, FALLBACK_ACTION, FAIL = GuardAction


# --------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class FallbackProfile:
    """The declared conservative profile (spec.rollout.fallback)."""

    continuous_batching: Optional[bool] = None  # False = request-level static batching
    budget_scale: Optional[float] = None  # multiply sequence/token budgets by this (0..1]
    scheduler: Mapping[str, Any] = field(default_factory=dict)  # explicit scheduler values

    def __post_init__(self) -> None:
        if self.budget_scale is not None and not 0 < self.budget_scale <= 1:
            raise ValueError(f"rollout.fallback.budgetScale must be in (0, 1], got {self.budget_scale}")

    def describe(self) -> str:
        parts = []
        if self.continuous_batching is False:
            parts.append("continuousBatching: false")
        if self.budget_scale is not None:
            parts.append(f"budgets x{self.budget_scale:g}")
        parts += [f"{k}: {v}" for k, v in sorted(self.scheduler.items())]
        return ", ".join(parts) or "(empty)"

    def overrides(self, scheduler: Mapping[str, Any]) -> dict[str, Any]:
        """The profile as operator overrides (`status.overrides` shape) over the given global
        scheduler budgets: `engine` and `scheduler` keys; budgets only go down."""
        out: dict[str, Any] = {}
        if self.continuous_batching is not None:
            out["engine"] = {"continuousBatching": self.continuous_batching}
        sched: dict[str, Any] = {}
        if self.budget_scale is not None:
            for key in FALLBACK_SCALED_KEYS:
                if key in scheduler:
                    sched[key] = max(1, int(scheduler[key] * self.budget_scale))
        sched.update(self.scheduler)
        if sched:
            out["scheduler"] = sched
        return out


@dataclass(frozen=True)
class RolloutPolicy:
    """spec.rollout."""

    enabled: bool = True
    verification_window_s: float = 300.0
    progress_deadline_s: float = 600.0
    max_ttft_regression: float = 0.25  # allowed relative rise of a lane's TTFT p95 vs the LKG
    max_tpot_regression: float = 0.25
    max_failed_share_increase: float = 0.05  # allowed rise of the rejected/timed-out share
    min_requests: int = 20  # per lane in the window to compare it
    fallback: Optional[FallbackProfile] = None
    fallback_miss_factor: float = 2.0  # LKG p95 above this x target -> fallback
    fallback_after_s: float = 300.0  # ... sustained this long
    metrics: bool = True  # False: no Prometheus configured, verify pod readiness only

    @classmethod
    def from_spec(cls, spec: "RolloutSpec | Mapping[str, Any] | None", *, metrics: bool = True) -> "RolloutPolicy":
        """From the typed `spec.rollout` (`ModelService.settings.rollout`), or its camelCase
        mapping. `metrics`: whether a Prometheus is configured (without one, verification is
        pod readiness only)."""
        if not isinstance(spec, RolloutSpec):
            spec = RolloutSpec.from_spec(spec)
        fb = spec.fallback
        scale = float(fb.budget_percent) / 100.0
        fallback = None
        if fb.policy == FallbackPolicy.CONSERVATIVE:
            fallback = FallbackProfile(budget_scale=scale)
        elif fb.policy == FallbackPolicy.STATIC_BATCHING:
            fallback = FallbackProfile(continuous_batching=False, budget_scale=scale)
        return cls(
            verification_window_s=spec.verification_window_s,
            progress_deadline_s=spec.progress_deadline_s,
            max_ttft_regression=float(spec.regression.ttft_p95_percent) / 100.0,
            max_tpot_regression=float(spec.regression.tpot_p95_percent) / 100.0,
            max_failed_share_increase=float(spec.regression.error_rate_percent) / 100.0,
            fallback=fallback,
            fallback_miss_factor=float(fb.miss_factor),
            fallback_after_s=fb.after_s,
            metrics=metrics,
        )


@dataclass(frozen=True)
class PodReadiness:
    desired: int  # replicas the revision asks for
    updated: int  # pods running the revision's template
    ready: int  # of those, ready

    @property
    def complete(self) -> bool:
        return self.updated >= self.desired and self.ready >= self.desired


@dataclass(frozen=True)
class LaneBaseline:
    """A revision's measured numbers for one lane (what the next revision is compared with)."""

    ttft_p95_ms: Optional[float] = None
    tpot_p95_ms: Optional[float] = None
    failed_share: float = 0.0

    def to_dict(self) -> dict:
        return {k: v for k, v in (("ttftP95Ms", self.ttft_p95_ms), ("tpotP95Ms", self.tpot_p95_ms),
                                  ("failedShare", self.failed_share)) if v is not None}

    @classmethod
    def from_dict(cls, d: Mapping) -> "LaneBaseline":
        return cls(d.get("ttftP95Ms"), d.get("tpotP95Ms"), float(d.get("failedShare", 0.0)))


@dataclass(frozen=True)
class RolloutState:
    """status.rollout: where the guard stands (all times in the caller's clock, seconds)."""

    phase: Phase
    revision: str  # the spec's revision the guard last saw
    started_at: float  # when that revision appeared
    ready_at: Optional[float] = None  # when its pods were all ready (verification starts)
    lkg: Optional[str] = None  # last-known-good revision
    baseline: Mapping[str, LaneBaseline] = field(default_factory=dict)  # the LKG's numbers
    rolled_back: Optional[str] = None  # the revision that was rolled back (still in spec)
    bad_since: Optional[float] = None  # since when the LKG misses its SLOs badly
    message: str = ""

    def to_dict(self) -> dict:
        # Plain strings in status: the enum's value, byte for byte.
        out: dict = {"phase": str(self.phase), "revision": self.revision, "startedAt": self.started_at}
        for key, value in (("readyAt", self.ready_at), ("lastKnownGood", self.lkg),
                           ("rolledBackRevision", self.rolled_back), ("badSince", self.bad_since)):
            if value is not None:
                out[key] = value
        if self.baseline:
            out["baseline"] = {k: v.to_dict() for k, v in sorted(self.baseline.items())}
        if self.message:
            out["message"] = self.message
        return out

    @classmethod
    def from_dict(cls, d: Optional[Mapping]) -> Optional["RolloutState"]:
        if not d or "revision" not in d:
            return None
        return cls(
            phase=Phase(d.get("phase", VERIFYING)),
            revision=d["revision"],
            started_at=float(d.get("startedAt", 0.0)),
            ready_at=d.get("readyAt"),
            lkg=d.get("lastKnownGood"),
            baseline={k: LaneBaseline.from_dict(v) for k, v in (d.get("baseline") or {}).items()},
            rolled_back=d.get("rolledBackRevision"),
            bad_since=d.get("badSince"),
            message=d.get("message", ""),
        )


@dataclass(frozen=True)
class Regression:
    lane: str
    metric: str  # ttft | tpot | failed
    before: float
    after: float
    limit: float  # allowed relative (ttft/tpot) or absolute (failed) increase

    def __str__(self) -> str:
        if self.metric == "failed":
            return (f"{self.lane} failed share {self.after:.1%} vs {self.before:.1%} "
                    f"(+{self.after - self.before:.1%} > +{self.limit:.1%})")
        rise = (self.after / self.before - 1.0) if self.before > 0 else float("inf")
        return (f"{self.lane} {self.metric.upper()} p95 {self.after:.0f}ms vs {self.before:.0f}ms "
                f"(+{rise:.0%} > +{self.limit:.0%})")


@dataclass(frozen=True)
class RolloutDecision:
    action: GuardAction
    state: RolloutState
    reason: str  # CamelCase reason for conditions/Events
    message: str  # human sentence with the numbers
    regressions: tuple[Regression, ...] = ()
    restore_revision: Optional[str] = None  # for rollback / fallback: the LKG to restore


# --------------------------------------------------------------------------- revisions


_VOLATILE_KEYS = {"status", "resourceVersion", "uid", "creationTimestamp", "generation", "managedFields"}


def revision_of(objects: Sequence[Mapping[str, Any]]) -> str:
    """Hash of the rendered objects that make a revision (runtime config, pod template).

    The caller renders the objects from the spec alone (no tuned budgets); the replica count
    is left out, so `kubectl scale` and an HPA never start a verification.
    """
    canonical = []
    for obj in objects:
        obj = json.loads(json.dumps(obj))
        meta = obj.get("metadata", {})
        for key in _VOLATILE_KEYS:
            meta.pop(key, None)
        # The applied-hash annotation covers the replica count too: not part of a revision.
        annotations = {k: v for k, v in (meta.get("annotations") or {}).items() if not k.endswith("/applied-hash")}
        if annotations:
            meta["annotations"] = annotations
        else:
            meta.pop("annotations", None)
        obj.pop("status", None)
        if obj.get("kind") in ("Deployment", "LeaderWorkerSet"):
            obj.get("spec", {}).pop("replicas", None)
        canonical.append(obj)
    canonical.sort(key=lambda o: (o.get("kind", ""), o.get("metadata", {}).get("name", "")))
    text = json.dumps(canonical, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def spec_revision(msvc: ModelService, lanes: list[ServingLane]) -> tuple[str, builders.Desired]:
    """The revision of what the spec alone renders (no tuned or fallback values), and that render.
    Raises ValueError when the spec cannot be rendered."""
    spec_only = ModelService(ref=msvc.ref, spec=msvc.spec, labels=msvc.labels, status={})
    desired = builders.build(spec_only, lanes, overrides=builders.Overrides())
    return revision_of(desired.objects), desired


def baseline_from(sample: MetricSample, lanes: Sequence[LaneTarget], min_requests: int) -> dict[str, LaneBaseline]:
    """Per-lane numbers of a window, for lanes with enough requests."""
    out = {}
    for lane in lanes:
        m = sample.lanes.get(lane.name)
        if not sample.available or too_few_requests(m, min_requests, sample.window_s):
            continue
        total = m.request_rate + m.rejection_rate
        out[lane.name] = LaneBaseline(
            None if m.ttft_p95_s is None else m.ttft_p95_s * 1000.0,
            None if m.tpot_p95_s is None else m.tpot_p95_s * 1000.0,
            m.rejection_rate / total if total > 0 else 0.0,
        )
    return out


def regressions(policy: RolloutPolicy, before: Mapping[str, LaneBaseline],
                after: Mapping[str, LaneBaseline]) -> list[Regression]:
    out = []
    for lane in sorted(set(before) & set(after)):
        b, a = before[lane], after[lane]
        for metric, limit, old, new in (
            ("ttft", policy.max_ttft_regression, b.ttft_p95_ms, a.ttft_p95_ms),
            ("tpot", policy.max_tpot_regression, b.tpot_p95_ms, a.tpot_p95_ms),
        ):
            if old is not None and new is not None and new > old * (1.0 + limit):
                out.append(Regression(lane, metric, old, new, limit))
        if a.failed_share > b.failed_share + policy.max_failed_share_increase:
            out.append(Regression(lane, "failed", b.failed_share, a.failed_share, policy.max_failed_share_increase))
    return out


def _badly_missing(policy: RolloutPolicy, lanes: Sequence[LaneTarget],
                   now_numbers: Mapping[str, LaneBaseline]) -> list[str]:
    out = []
    for lane in lanes:
        n = now_numbers.get(lane.name)
        if n is None:
            continue
        for key, target, value in (("TTFT", lane.ttft_p95_ms, n.ttft_p95_ms),
                                   ("TPOT", lane.tpot_p95_ms, n.tpot_p95_ms)):
            if target is not None and value is not None and value > policy.fallback_miss_factor * target:
                out.append(f"{lane.name} {key} p95 {value:.0f}ms > {policy.fallback_miss_factor:g} x {target:.0f}ms")
    return out


# --------------------------------------------------------------------------- the guard


def evaluate(
    policy: RolloutPolicy,
    state: Optional[RolloutState],
    revision: str,
    now: float,
    pods: PodReadiness,
    sample: MetricSample,
    lanes: Sequence[LaneTarget],
) -> RolloutDecision:
    """One step of the guard. Pure: the caller applies objects and writes status/Events."""
    if state is None:
        # First sight of this ModelService: verify its first revision (there is no LKG yet).
        new = RolloutState(VERIFYING, revision, now, message="first revision")
        return RolloutDecision(START, new, "NewRevision", f"verifying revision {revision} (first revision)")

    if revision != state.revision and revision != state.rolled_back:
        if revision == state.lkg:
            # The user went back to the last-known-good spec: nothing to verify.
            new = replace(state, phase=STABLE, revision=revision, started_at=now, ready_at=None,
                          rolled_back=None, bad_since=None, message="back on the last-known-good revision")
            return RolloutDecision(PROMOTE, new, "LastKnownGood", f"revision {revision} is the last-known-good")
        new = replace(state, phase=VERIFYING, revision=revision, started_at=now, ready_at=None,
                      rolled_back=None, bad_since=None, message=f"verifying revision {revision}")
        return RolloutDecision(START, new, "NewRevision", f"verifying revision {revision} against "
                               f"last-known-good {state.lkg or '(none)'}")

    if state.phase in (ROLLED_BACK, FALLBACK) or (revision == state.rolled_back):
        return _while_rolled_back(policy, state, now, sample, lanes)

    if state.phase == VERIFYING:
        return _verify(policy, state, now, pods, sample, lanes)

    if state.phase == FAILED:
        if pods.complete:  # pods finally came up (e.g. capacity freed): verify them now
            new = replace(state, phase=VERIFYING, ready_at=now, message="pods became ready")
            return RolloutDecision(WAIT, new, "Verifying", "pods became ready; verifying")
        return RolloutDecision(NONE, state, "ProgressDeadlineExceeded", state.message)

    # Stable: keep the promotion's baseline; fall back if even the LKG misses badly.
    numbers = baseline_from(sample, lanes, policy.min_requests)
    return _check_fallback(policy, state, now, numbers, lanes)


def _verify(policy: RolloutPolicy, state: RolloutState, now: float, pods: PodReadiness,
            sample: MetricSample, lanes: Sequence[LaneTarget]) -> RolloutDecision:
    if not pods.complete:
        waited = now - state.started_at
        if waited < policy.progress_deadline_s:
            return RolloutDecision(WAIT, state, "Progressing",
                                   f"{pods.ready}/{pods.desired} pods ready after {waited:.0f}s "
                                   f"(deadline {policy.progress_deadline_s:.0f}s)")
        message = (f"revision {state.revision}: {pods.ready}/{pods.desired} pods ready "
                   f"({pods.updated} updated) after {waited:.0f}s, progress deadline "
                   f"{policy.progress_deadline_s:.0f}s exceeded")
        return _roll_back(state, "ProgressDeadlineExceeded", message, ())
    if state.ready_at is None:
        new = replace(state, ready_at=now, message="pods ready; verifying SLOs")
        return RolloutDecision(WAIT, new, "Verifying",
                               f"all {pods.desired} pods ready; verifying SLOs for "
                               f"{policy.verification_window_s:.0f}s")
    watched = now - state.ready_at
    if watched < policy.verification_window_s:
        return RolloutDecision(WAIT, state, "Verifying",
                               f"verifying revision {state.revision}: {watched:.0f}/"
                               f"{policy.verification_window_s:.0f}s")
    if not policy.metrics or (not sample.available and watched >= 2 * policy.verification_window_s):
        why = "no Prometheus configured" if not policy.metrics else f"metrics unavailable ({sample.error})"
        # No verified window: the previous revision's numbers are not this one's baseline.
        new = replace(state, phase=STABLE, lkg=state.revision, baseline={},
                      message=f"revision {state.revision} is last-known-good (pods ready; {why}: "
                              "SLOs not compared)")
        return RolloutDecision(PROMOTE, new, "Promoted", new.message)
    if not sample.available:
        return RolloutDecision(WAIT, state, "MetricsUnavailable",
                               f"cannot verify revision {state.revision} yet: {sample.error}")
    after = baseline_from(sample, lanes, policy.min_requests)
    found = regressions(policy, state.baseline, after) if state.lkg else []
    if found:
        message = f"revision {state.revision} regressed against {state.lkg}: " + "; ".join(map(str, found))
        return _roll_back(state, "SLORegression", message, tuple(found))
    compared = sorted(set(state.baseline) & set(after))
    note = (f"no regression in {', '.join(compared)}" if compared
            else "no lane had enough traffic to compare" if state.lkg else "first revision")
    # The baseline is this verified window, frozen until the next promotion (a lane with too
    # little traffic in it has none: later windows may hold a probe or a rollback).
    new = replace(state, phase=STABLE, lkg=state.revision, baseline=after,
                  message=f"revision {state.revision} is last-known-good ({note})")
    return RolloutDecision(PROMOTE, new, "Promoted", new.message)


def _roll_back(state: RolloutState, reason: str, message: str, found: tuple[Regression, ...]) -> RolloutDecision:
    if state.lkg is None:
        new = replace(state, phase=FAILED, message=message + "; no last-known-good revision to restore")
        return RolloutDecision(FAIL, new, reason, new.message, found)
    new = replace(state, phase=ROLLED_BACK, rolled_back=state.revision, ready_at=None, bad_since=None,
                  message=f"{message}; restored {state.lkg}")
    return RolloutDecision(ROLLBACK, new, reason, new.message, found, restore_revision=state.lkg)


def _while_rolled_back(policy: RolloutPolicy, state: RolloutState, now: float, sample: MetricSample,
                       lanes: Sequence[LaneTarget]) -> RolloutDecision:
    numbers = baseline_from(sample, lanes, policy.min_requests)
    decision = _check_fallback(policy, state, now, numbers, lanes)
    if decision.action != NONE:
        return decision
    # Keep the LKG in force while the spec still asks for the bad revision.
    return RolloutDecision(HOLD_ROLLED_BACK, decision.state, "RolledBack" if state.phase == ROLLED_BACK else "Fallback",
                           state.message, restore_revision=state.lkg)


def _check_fallback(policy: RolloutPolicy, state: RolloutState, now: float, numbers: Mapping[str, LaneBaseline],
                    lanes: Sequence[LaneTarget]) -> RolloutDecision:
    # The baseline is never touched here: it is the last-known-good's verified window, frozen
    # at promotion. A later window may hold a probe, a revert or a rollback.
    if state.phase == FALLBACK or policy.fallback is None or state.lkg is None:
        return RolloutDecision(NONE, state, str(state.phase), state.message)
    bad = _badly_missing(policy, lanes, numbers)
    if not bad:
        return RolloutDecision(NONE, replace(state, bad_since=None), str(state.phase), state.message)
    since = state.bad_since if state.bad_since is not None else now
    if now - since < policy.fallback_after_s:
        new = replace(state, bad_since=since)
        return RolloutDecision(NONE, new, str(state.phase),
                               f"SLOs badly missed for {now - since:.0f}s: " + "; ".join(bad))
    message = (f"the last-known-good revision {state.lkg} misses its SLOs badly for {now - since:.0f}s ("
               + "; ".join(bad) + f"): applying the fallback profile {policy.fallback.describe()}")
    new = replace(state, phase=FALLBACK, bad_since=since, message=message)
    return RolloutDecision(FALLBACK_ACTION, new, "FallbackApplied", message, restore_revision=state.lkg)
