"""The replica autoscaler: a pure decision function over one ModelService's fleet.

    decide(policy, current, sample, history, now) -> ScalingDecision

Inputs are plain values (no Kubernetes, no HTTP): the policy (bounds, stabilization windows,
per-lane targets), the replicas running now, one window of fleet metrics (from Prometheus or a
simulation), the recent recommendations (kept in status, so the function needs no memory of
its own) and the time. The output is the desired replica count, why, and the history to store.
The operator calls it on a timer for each ModelService with spec.autoscaling (operator/scaling.py).

Rules:
  1. Bounds first: the answer is always in [minReplicas, maxReplicas].
  2. Missing data (metrics unavailable, or the sample older than `max_sample_age_s`, or no KV
     usage and no lane with enough requests) -> hold at the current count. The hold is
     recorded as a recommendation of the current count, so a scale-down needs a full window
     of good data after a gap.
  3. Each decision makes one recommendation:
     - Any target violated by more than `tolerance` (a lane's queue delay p95 above its
       target, a lane's SLO attainment below its target, or fleet KV usage above the target)
       -> scale up in proportion to the worst overload: ceil(ready x ratio), at least one
       replica more than are ready, at most max(2 x current, current + 4) (the step HPA
       allows by default). Only ready replicas produced the measurements, so only they are
       scaled by the ratio; replicas still starting count towards the answer, so a
       recommendation they already cover adds nothing (as HPA treats unready pods). While
       replicas are starting, only KV usage (which grows in proportion to the load) may add
       more: a latency ratio then measures a backlog that grows until they are ready.
     - Every lane comfortably inside its targets (queue delay at most `comfort` x target,
       attainment at or above target) -> the size that brings KV usage back to its target:
       ceil(current x kvUsage / kvTarget), never below half the current count per decision.
     - Otherwise (between the two) -> the current count (the hysteresis band).
  4. Stabilization, as HPA's `behavior`: a scale-up goes to the lowest recommendation of the
     scale-up window (0 s: at once), so only a sustained violation scales up; a scale-down
     goes to the highest recommendation of the scale-down window, and only once the history
     covers that whole window, so one quiet sample never removes replicas and an
     oscillating load never flaps.

Ratios (observed / target, > 1 is overload): queue delay p95 / target; SLO misses
(1 - attainment) / (1 - target); KV usage / target. A lane with fewer than `min_requests`
requests in the window has no latency verdict (its p95s mean nothing).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

UP = "up"
DOWN = "down"
HOLD = "hold"

MAX_HISTORY = 256  # recommendations kept in status at most


@dataclass(frozen=True)
class LaneScalingTarget:
    """One lane's scaling targets (each optional: an unset target is not checked)."""

    lane: str
    queue_delay_p95_s: Optional[float] = None
    slo_attainment: Optional[float] = None  # fraction of requests that meet the lane's SLO, in (0, 1)

    def __post_init__(self) -> None:
        if self.queue_delay_p95_s is not None and not self.queue_delay_p95_s > 0:
            raise ValueError(f"lane {self.lane!r}: queueDelayP95 target must be > 0 s, got {self.queue_delay_p95_s!r}")
        if self.slo_attainment is not None and not 0 < self.slo_attainment < 1:
            raise ValueError(f"lane {self.lane!r}: sloAttainment target must be in (0, 1), got {self.slo_attainment!r}")


@dataclass(frozen=True)
class AutoscalingPolicy:
    min_replicas: int
    max_replicas: int
    lanes: tuple[LaneScalingTarget, ...] = ()
    kv_usage_target: Optional[float] = 0.75  # fleet-average KV usage to size for (KV is per replica, not per lane)
    scale_up_stabilization_s: float = 0.0
    scale_down_stabilization_s: float = 300.0
    tolerance: float = 0.1  # ratios within 1 +- tolerance are on target
    comfort: float = 0.5  # a lane's queue delay at most this x its target counts as comfortable
    min_requests: int = 20  # requests per window for a lane's latency signals to count
    max_sample_age_s: float = 120.0  # an older sample is stale

    def __post_init__(self) -> None:
        if self.min_replicas < 1:
            raise ValueError(f"minReplicas must be >= 1 (scale from zero is not supported), got {self.min_replicas}")
        if self.max_replicas < self.min_replicas:
            raise ValueError(f"maxReplicas ({self.max_replicas}) must be >= minReplicas ({self.min_replicas})")
        if self.kv_usage_target is not None and not 0 < self.kv_usage_target <= 1:
            raise ValueError(f"kvUsage target must be in (0, 1], got {self.kv_usage_target!r}")
        for name in ("scale_up_stabilization_s", "scale_down_stabilization_s", "tolerance"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if not 0 < self.comfort <= 1:
            raise ValueError(f"comfort must be in (0, 1], got {self.comfort!r}")
        if not self.max_sample_age_s > 0:
            raise ValueError(f"max_sample_age_s must be > 0, got {self.max_sample_age_s!r}")
        names = [t.lane for t in self.lanes]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate lane targets: {sorted(n for n in set(names) if names.count(n) > 1)}")

    def clamp(self, replicas: int) -> int:
        return max(self.min_replicas, min(self.max_replicas, replicas))


@dataclass(frozen=True)
class LaneSample:
    """One lane over the window, over all replicas."""

    request_rate: float = 0.0  # requests that ended in the window (any outcome) per second
    queue_delay_p95_s: Optional[float] = None
    slo_attainment: Optional[float] = None  # fraction in [0, 1] that met the lane's SLO


@dataclass(frozen=True)
class FleetSample:
    """The fleet over one window ending at `at`."""

    at: float
    window_s: float
    lanes: Mapping[str, LaneSample] = field(default_factory=dict)
    kv_usage: Optional[float] = None  # average KV usage ratio over the replicas
    # Replicas that served the window (ready ones). None: unknown, all `current` count as ready.
    ready_replicas: Optional[int] = None
    available: bool = True
    error: str = ""  # why not available

    @classmethod
    def unavailable(cls, at: float, error: str) -> "FleetSample":
        return cls(at=at, window_s=0.0, available=False, error=error)


@dataclass(frozen=True)
class Recommendation:
    """One decision's recommendation (status keeps the recent ones)."""

    at: float
    replicas: int

    def to_dict(self) -> dict:
        return {"at": self.at, "replicas": self.replicas}

    @classmethod
    def from_dict(cls, data: Mapping) -> "Recommendation":
        return cls(at=float(data["at"]), replicas=int(data["replicas"]))


@dataclass(frozen=True)
class ScalingDecision:
    desired: int
    action: str  # up | down | hold
    reason: str
    recommendation: int
    history: tuple[Recommendation, ...]


@dataclass(frozen=True)
class _Signal:
    what: str  # e.g. "lane interactive queue delay p95 3.2s (target 0.5s)"
    ratio: float


# --------------------------------------------------------------------------- the decision


def decide(policy: AutoscalingPolicy, current: int, sample: Optional[FleetSample],
           history: Sequence[Recommendation], now: float) -> ScalingDecision:
    """One autoscaling step. Pure: the same inputs always give the same decision."""
    if current < 0:
        raise ValueError(f"current replicas must be >= 0, got {current}")
    held = policy.clamp(current)
    missing = _missing_data(policy, sample, now)
    if missing:
        history = _remember(history, Recommendation(now, held), policy, now)
        reason = f"holding at {held}: {missing}" if held == current else (
            f"{current} replicas is outside [{policy.min_replicas}, {policy.max_replicas}]: {held} ({missing})")
        return ScalingDecision(held, _direction(current, held), reason, held, history)
    assert sample is not None
    recommendation, why = _recommend(policy, current, sample)
    history = _remember(history, Recommendation(now, recommendation), policy, now)
    desired, reason = _stabilize(policy, current, recommendation, why, history, now)
    if policy.clamp(desired) != desired:
        reason = (f"{desired} replicas is outside [{policy.min_replicas}, {policy.max_replicas}]: "
                  f"{policy.clamp(desired)} ({reason})")
        desired = policy.clamp(desired)
    return ScalingDecision(desired, _direction(current, desired), reason, recommendation, history)


def _direction(current: int, desired: int) -> str:
    return UP if desired > current else DOWN if desired < current else HOLD


def _missing_data(policy: AutoscalingPolicy, sample: Optional[FleetSample], now: float) -> str:
    """Why the sample cannot be used, or "" when it can."""
    if sample is None:
        return "no metrics yet"
    if not sample.available:
        return f"metrics unavailable ({sample.error or 'no reason given'})"
    age = now - sample.at
    if age > policy.max_sample_age_s:
        return f"metrics are stale ({age:.0f}s old, limit {policy.max_sample_age_s:.0f}s)"
    has_kv = sample.kv_usage is not None and policy.kv_usage_target is not None
    if not has_kv and not any(_counts(policy, sample, t.lane) for t in policy.lanes):
        return "no KV usage and too few requests in every lane to judge latency"
    return ""


def _counts(policy: AutoscalingPolicy, sample: FleetSample, lane: str) -> Optional[LaneSample]:
    """The lane's sample when it has enough requests for its percentiles to mean anything."""
    data = sample.lanes.get(lane)
    if data is None or data.request_rate * sample.window_s < policy.min_requests:
        return None
    return data


def _signals(policy: AutoscalingPolicy, sample: FleetSample) -> tuple[list[_Signal], bool]:
    """Every measured ratio, and whether every lane is comfortably inside its targets."""
    signals: list[_Signal] = []
    comfortable = True
    for target in policy.lanes:
        data = _counts(policy, sample, target.lane)
        if data is None:
            continue
        if target.queue_delay_p95_s is not None and data.queue_delay_p95_s is not None:
            ratio = data.queue_delay_p95_s / target.queue_delay_p95_s
            signals.append(_Signal(f"lane {target.lane} queue delay p95 {data.queue_delay_p95_s:.3g}s "
                                   f"(target {target.queue_delay_p95_s:.3g}s)", ratio))
            comfortable = comfortable and ratio <= policy.comfort
        if target.slo_attainment is not None and data.slo_attainment is not None:
            ratio = (1.0 - data.slo_attainment) / (1.0 - target.slo_attainment)
            signals.append(_Signal(f"lane {target.lane} SLO attainment {data.slo_attainment:.1%} "
                                   f"(target {target.slo_attainment:.1%})", ratio))
            comfortable = comfortable and data.slo_attainment >= target.slo_attainment
    if policy.kv_usage_target is not None and sample.kv_usage is not None:
        signals.append(_Signal(f"KV usage {sample.kv_usage:.0%} (target {policy.kv_usage_target:.0%})",
                               sample.kv_usage / policy.kv_usage_target))
    return signals, comfortable


def scale_up_limit(current: int) -> int:
    """The most replicas one decision may reach from `current` (HPA's default step)."""
    return max(2 * current, current + 4)


def scale_down_limit(current: int) -> int:
    """The fewest replicas one decision may reach from `current`."""
    return math.ceil(current / 2)


def ready_of(current: int, sample: FleetSample) -> int:
    """The replicas whose load the sample measured: the ready ones, at most `current`."""
    if sample.ready_replicas is None:
        return current
    if sample.ready_replicas < 0:
        raise ValueError(f"ready replicas must be >= 0, got {sample.ready_replicas}")
    return min(current, sample.ready_replicas)


def _recommend(policy: AutoscalingPolicy, current: int, sample: FleetSample) -> tuple[int, str]:
    signals, comfortable = _signals(policy, sample)
    ready = ready_of(current, sample)
    base = max(ready, 1)
    over = [s for s in signals if s.ratio > 1.0 + policy.tolerance]
    if over:
        starting = current - ready

        def wants(signal: _Signal) -> int:
            wanted = policy.clamp(max(ready + 1, math.ceil(base * signal.ratio)))
            if starting and not signal.what.startswith("KV usage"):
                # A latency ratio measures the backlog, which grows until the starting
                # replicas are ready, not the capacity that is missing: it waits for them.
                return min(wanted, current)
            return wanted

        worst = max(over, key=lambda s: (wants(s), s.ratio))
        wanted = wants(worst)
        if starting and wanted <= current:  # the starting replicas cover it: add nothing
            return policy.clamp(current), (f"{worst.what} is x{worst.ratio:.2f} of target on {ready} ready; "
                                           f"awaiting {starting} starting replica(s)")
        limited = min(wanted, scale_up_limit(current))
        step = "" if limited == wanted else f", one step is limited to {limited}"
        return policy.clamp(limited), f"{worst.what} is x{worst.ratio:.2f} of target{step}"
    kv = next((s for s in signals if s.what.startswith("KV usage")), None)
    if comfortable and kv is not None:
        wanted = min(current, math.ceil(base * kv.ratio))
        return policy.clamp(max(wanted, scale_down_limit(current))), f"{kv.what}, latency targets comfortably met"
    if not comfortable:
        return policy.clamp(current), "load within the targets' tolerance band"
    return policy.clamp(current), "targets met; no KV usage to size a scale-down by"


def _remember(history: Sequence[Recommendation], record: Recommendation, policy: AutoscalingPolicy,
              now: float) -> tuple[Recommendation, ...]:
    """History plus `record`, pruned to the longest window and the one record before it (the
    proof that the history covers the whole window)."""
    horizon = now - max(policy.scale_up_stabilization_s, policy.scale_down_stabilization_s)
    ordered = sorted((r for r in history if r.at <= now), key=lambda r: r.at) + [record]
    inside = [r for r in ordered if r.at > horizon]
    before = [r for r in ordered if r.at <= horizon]
    kept = before[-1:] + inside
    return tuple(kept[-MAX_HISTORY:])


def _stabilize(policy: AutoscalingPolicy, current: int, recommendation: int, why: str,
               history: Sequence[Recommendation], now: float) -> tuple[int, str]:
    if recommendation > current:
        window = [r.replicas for r in history if r.at > now - policy.scale_up_stabilization_s] or [recommendation]
        desired = max(current, min(window))
        if desired == current:
            return current, (f"holding at {current}: scale-up to {recommendation} waits for "
                             f"{policy.scale_up_stabilization_s:.0f}s of sustained overload ({why})")
        return desired, f"scale up {current} -> {desired}: {why}"
    if recommendation < current:
        start = now - policy.scale_down_stabilization_s
        if not any(r.at <= start for r in history):
            return current, (f"holding at {current}: scale-down to {recommendation} waits for "
                             f"{policy.scale_down_stabilization_s:.0f}s of recommendations ({why})")
        window = [r.replicas for r in history if r.at > start] or [recommendation]
        desired = min(current, max(window))
        if desired == current:
            return current, (f"holding at {current}: a recommendation of {max(window)} in the last "
                             f"{policy.scale_down_stabilization_s:.0f}s ({why})")
        return desired, (f"scale down {current} -> {desired}: highest recommendation in the last "
                         f"{policy.scale_down_stabilization_s:.0f}s ({why})")
    return current, f"holding at {current}: {why}"
