"""The replica autoscaler: a pure decision function over one ModelService's fleet.

    decide(policy, current, sample, history, now) -> ScalingDecision

Inputs are plain values (no Kubernetes, no HTTP): the policy (bounds, stabilization windows,
per-lane targets), the replicas running now, one window of fleet metrics (from Prometheus or a
simulation), the recent recommendations (the caller keeps them, so the function needs no memory
of its own) and the time. The output is the desired replica count, why, and the history to store.
The operator calls it on a timer for each ModelService with spec.autoscaling (operator/controllers/scaling.py).

Rules:
  1. Bounds first: the answer is always in [minReplicas, maxReplicas].
  2. Missing data (metrics unavailable, or the sample older than `max_sample_age_s`, or no KV
     usage and no lane with enough requests) -> hold at the current count. The hold is
     recorded as a recommendation of the current count, so a scale-down needs a full window
     of good data after a gap.
  3. Each decision makes one recommendation, the largest that any signal asks for:
     - The load now (a lane's sample carries `waiting`, and `replica_running_shares` or
       `running_share` for the running signal). These react at once, where latencies of
       ended requests lag by the window:
       * Running: a lane's running sequences on a replica, as a share of its
         maxActiveSequences, against `running_share_target`. Running sequences grow about
         as the square of the arrival rate near saturation, so a replica's load in target
         units is sqrt(share / target); below a quarter of the target (half the target's
         rate) they grow in proportion to it (Little's law at a constant service time), so
         the load there is the chord 2 x share / target (`replica_load`). Loads in these
         units add up (they are arrival rates), so the fleet needs the sum of each ready
         replica's own load + `headroom_replicas` (spare capacity for what arrives during a
         start-up). With only the replicas' mean share it needs ready x the mean's load,
         which reads a replica that just joined as loaded as the saturated one it relieves.
         Above current x (1 + tolerance) -> that many; comfortably below -> it sizes the
         scale-down.
       * Queue: the requests waiting now / the rate the ready replicas served them (Little's
         law: the wait of a request that arrives now) against the lane's queue delay target.
         Above it, the replicas are saturated, so what each served is its capacity: the
         lane needs serving replicas x arrivals / (served x `target_utilization`), where
         `serving_replicas` is how many served the window on average. When that is no more
         than the current count, they drain the queue and nothing is added.
       * SLO attainment (of ended requests) only blocks a scale-down: it lags by the window,
         and sizing by it added replicas for backlogs that were already draining.
     - Samples without those fields (the ratio signals): any target violated by more than
       `tolerance` (queue delay p95 above its target, SLO attainment below its target) ->
       ceil(ready x worst ratio), at least one replica more than are ready. While replicas
       are starting these wait for them: such a ratio measures a backlog that grows until
       they are ready, not the capacity that is missing.
     - KV usage above its target -> ceil(ready x usage / target), at least one more than ready.
     - Every lane comfortably inside its targets -> the largest size that the KV usage and the
       running signal project.
     - Otherwise (between the two) -> the current count (the hysteresis band).
     Only ready replicas produced the measurements, so only they are scaled; replicas still
     starting count towards the answer, so a recommendation they already cover adds nothing
     (as HPA treats unready pods). One step reaches at most max(2 x current, current + 4);
     a scale-down goes no lower than half the current count, a limit applied after
     stabilization (as HPA's rate policies), so the history keeps what the load asked for.
  4. Stabilization, as HPA's `behavior`: a scale-up goes to the lowest recommendation of the
     scale-up window (0 s: at once), so only a sustained violation scales up; a scale-down
     goes to the highest recommendation of the scale-down window, and only once the history
     covers that whole window, so one quiet sample never removes replicas and an
     oscillating load never flaps.

Scale to zero (`min_replicas` 0; the router holds the requests that arrive meanwhile):
  - At zero replicas, demand the router saw (requests held now, or requests that arrived
    with no ready replica during the window) -> 1 at once: no stabilization window, a held
    request waits for the cold start already. No demand, or no metrics -> stay at zero.
  - With replicas, no request for `scale_to_zero_after_s` (none held, none in flight, none
    arriving at the router over that span, all three measured) -> 0 at once: that span is
    the scale-down's stabilization window.
  - Otherwise the rules above, which never go below one replica on their own.

A lane with fewer than `min_requests` requests in the window has no latency verdict (its
percentiles mean nothing). See docs/fleet.md for the inputs the operator reads from Prometheus.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

from tokenlane.operator.api.enums import StrEnum


class ScalingAction(StrEnum):
    """Which way one decision moves the replicas."""

    UP = "up"
    DOWN = "down"
    HOLD = "hold"


UP, DOWN, HOLD = ScalingAction.UP, ScalingAction.DOWN, ScalingAction.HOLD


class ScalingReason(StrEnum):
    """status.autoscaling.reason: what the last decision did, or why it held."""

    SCALED_UP = "ScaledUp"
    SCALED_DOWN = "ScaledDown"
    HOLDING = "Holding"
    METRICS_UNAVAILABLE = "MetricsUnavailable"  # no sample, or Prometheus could not be read
    SCALED_FROM_ZERO = "ScaledFromZero"  # woken by demand the router holds
    SCALED_TO_ZERO = "ScaledToZero"  # at zero replicas (idle for scaleToZeroAfter)

MAX_HISTORY = 256  # recommendations kept in status at most
# The load now (a lane's waiting requests and running share) is averaged over this share of the
# sample's window, by whoever builds the sample: one scrape alone is noisy, the window lags.
LOAD_NOW_SHARE = 0.25
# Below this share of the running share target (half the target's arrival rate), a replica's
# running sequences grow in proportion to its arrival rate, not as its square (replica_load).
LINEAR_BELOW = 0.25


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
    # A lane's running sequences per ready replica, as a share of its maxActiveSequences, at
    # which a replica counts as fully loaded (None: the running signal is off).
    running_share_target: Optional[float] = None
    # Spare capacity, in replicas, on top of what the running signal measures: what may arrive
    # during one start-up, which reactive scaling cannot cover.
    headroom_replicas: float = 0.0
    # The share of their measured throughput that saturated replicas should run at after a
    # scale-up sized by the queue.
    target_utilization: float = 0.8
    # With min_replicas 0: how long the fleet must see no request before it scales to zero.
    scale_to_zero_after_s: float = 900.0

    def __post_init__(self) -> None:
        if self.min_replicas < 0:
            raise ValueError(f"minReplicas must be >= 0, got {self.min_replicas}")
        if not self.scale_to_zero_after_s > 0:
            raise ValueError(f"scaleToZeroAfter must be > 0 s, got {self.scale_to_zero_after_s!r}")
        if self.max_replicas < 1:
            raise ValueError(f"maxReplicas must be >= 1, got {self.max_replicas}")
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
        if self.running_share_target is not None and not 0 < self.running_share_target <= 1:
            raise ValueError(f"runningShareTarget must be in (0, 1], got {self.running_share_target!r}")
        if not 0 <= self.headroom_replicas <= 1000:
            raise ValueError(f"headroomReplicas must be in [0, 1000], got {self.headroom_replicas!r}")
        if not 0 < self.target_utilization <= 1:
            raise ValueError(f"targetUtilization must be in (0, 1], got {self.target_utilization!r}")
        names = [t.lane for t in self.lanes]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate lane targets: {sorted(n for n in set(names) if names.count(n) > 1)}")

    def clamp(self, replicas: int) -> int:
        """Within the bounds, and at least one replica: only the scale-to-zero rule reaches 0."""
        return max(self.min_replicas, 1, min(self.max_replicas, replicas))


@dataclass(frozen=True)
class LaneSample:
    """One lane over the window, over all replicas."""

    request_rate: float = 0.0  # requests that ended in the window (any outcome) per second
    queue_delay_p95_s: Optional[float] = None
    slo_attainment: Optional[float] = None  # fraction in [0, 1] that met the lane's SLO
    # The load now (None: not measured; then the queue delay p95 above judges the queue):
    waiting: Optional[float] = None  # requests in the lane's queues at the sample's time, all replicas
    arrival_rate: Optional[float] = None  # requests that arrived per second over the window (admitted or refused)
    served_rate: Optional[float] = None  # admitted requests that ended per second over the window
    running_share: Optional[float] = None  # running / maxActiveSequences at the sample's time, mean of the replicas
    # The same share for each ready replica on its own (None: only the mean is known). The
    # running signal then sums the replicas' loads instead of scaling the mean's.
    replica_running_shares: Optional[tuple[float, ...]] = None


@dataclass(frozen=True)
class FleetSample:
    """The fleet over one window ending at `at`."""

    at: float
    window_s: float
    lanes: Mapping[str, LaneSample] = field(default_factory=dict)
    kv_usage: Optional[float] = None  # average KV usage ratio over the replicas
    # Replicas that served the window (ready ones). None: unknown, all `current` count as ready.
    ready_replicas: Optional[int] = None
    # The replicas that served over the window, on average (a replica ready for half of it
    # counts a half): what the lanes' served rates are divided by to give one replica's
    # throughput. None: unknown, the ready replicas count.
    serving_replicas: Optional[float] = None
    available: bool = True
    error: str = ""  # why not available
    # Scale from zero (None: not measured). Requests the router holds for want of a ready
    # replica, now (the most over the last part of the window); requests that arrived at the
    # router with no ready replica over the window; requests queued or running on the replicas
    # now; requests that arrived at the router over the last `scale_to_zero_after_s`.
    held_requests: Optional[float] = None
    arrivals_without_replica: Optional[float] = None
    in_flight: Optional[float] = None
    idle_window_requests: Optional[float] = None

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
    action: ScalingAction
    reason: str
    recommendation: int
    history: tuple[Recommendation, ...]


# How a signal becomes a replica count (rule 3 of the module docstring).
RATIO = "ratio"  # a latency ratio of ended requests: ceil(ready x ratio); waits for starting replicas
KV = "kv"  # KV usage: ceil(ready x ratio)
RUNNING = "running"  # the running signal: ceil(needed)
QUEUE = "queue"  # the queue now: ceil(needed), which may be no more than ready (the queue drains)


@dataclass(frozen=True)
class _Signal:
    what: str  # e.g. "lane interactive queue delay p95 3.2s (target 0.5s)"
    ratio: float  # above 1 + tolerance: an overload
    kind: str = RATIO
    needed: Optional[float] = None  # RUNNING and QUEUE: the replicas the lane needs, unrounded


# --------------------------------------------------------------------------- the decision


def decide(policy: AutoscalingPolicy, current: int, sample: Optional[FleetSample],
           history: Sequence[Recommendation], now: float) -> ScalingDecision:
    """One autoscaling step. Pure: the same inputs always give the same decision."""
    if current < 0:
        raise ValueError(f"current replicas must be >= 0, got {current}")
    if policy.min_replicas == 0:
        zero = _zero_rules(policy, current, sample, history, now)
        if zero is not None:
            return zero
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


def _zero_rules(policy: AutoscalingPolicy, current: int, sample: Optional[FleetSample],
                history: Sequence[Recommendation], now: float) -> Optional[ScalingDecision]:
    """The scale-to-zero rules (module docstring), or None when the other rules decide."""
    missing = _sample_unavailable(policy, sample, now)
    if current == 0:
        if missing:
            desired, reason = 0, f"holding at 0: {missing}; no demand can be seen"
        else:
            assert sample is not None
            held = sample.held_requests or 0.0
            unserved = sample.arrivals_without_replica or 0.0
            if held > 0 or unserved > 0:
                desired = min(1, policy.max_replicas)
                reason = (f"scale from zero 0 -> {desired}: the router holds {held:.0f} request(s), "
                          f"{unserved:.0f} arrived with no replica in the last {sample.window_s:.0f}s")
            elif sample.held_requests is None and sample.arrivals_without_replica is None:
                desired, reason = 0, ("at zero replicas: the router's held requests are not in the metrics "
                                      "(is the router scraped?); no demand can be seen")
            else:
                desired, reason = 0, "at zero replicas: no request held or arriving at the router"
        return ScalingDecision(desired, _direction(0, desired), reason, desired,
                               _remember(history, Recommendation(now, desired), policy, now))
    if missing:
        return None
    assert sample is not None
    idle = (sample.held_requests, sample.in_flight, sample.idle_window_requests)
    if any(value is None for value in idle) or any(value > 0 for value in idle):  # type: ignore[operator]
        return None
    reason = (f"scale to zero {current} -> 0: no request held, in flight or arriving in the last "
              f"{policy.scale_to_zero_after_s:.0f}s (scaleToZeroAfter)")
    return ScalingDecision(0, DOWN, reason, 0, _remember(history, Recommendation(now, 0), policy, now))


def _sample_unavailable(policy: AutoscalingPolicy, sample: Optional[FleetSample], now: float) -> str:
    """Why there is no usable sample at all (none, unavailable, stale), or "" when there is:
    all that scaling to and from zero needs; the other rules need more (`_missing_data`)."""
    if sample is None:
        return "no metrics yet"
    if not sample.available:
        return f"metrics unavailable ({sample.error or 'no reason given'})"
    age = now - sample.at
    if age > policy.max_sample_age_s:
        return f"metrics are stale ({age:.0f}s old, limit {policy.max_sample_age_s:.0f}s)"
    return ""


def _direction(current: int, desired: int) -> ScalingAction:
    return UP if desired > current else DOWN if desired < current else HOLD


def _missing_data(policy: AutoscalingPolicy, sample: Optional[FleetSample], now: float) -> str:
    """Why the sample cannot be used, or "" when it can."""
    missing = _sample_unavailable(policy, sample, now)
    if missing or sample is None:
        return missing
    has_kv = sample.kv_usage is not None and policy.kv_usage_target is not None
    if not has_kv and not any(_counts(policy, sample, t.lane) for t in policy.lanes):
        return "no KV usage and too few requests in every lane to judge latency"
    return ""


def _counts(policy: AutoscalingPolicy, sample: FleetSample, lane: str) -> Optional[LaneSample]:
    """The lane's sample when it has enough requests for its signals to mean anything."""
    data = sample.lanes.get(lane)
    if data is None:
        return None
    seen = max(data.request_rate, data.arrival_rate or 0.0) * sample.window_s
    if seen < policy.min_requests and (data.waiting or 0.0) < policy.min_requests:
        return None
    return data


def _signals(policy: AutoscalingPolicy, sample: FleetSample, current: int) -> tuple[list[_Signal], bool]:
    """Every measured signal, and whether every lane is comfortably inside its targets."""
    signals: list[_Signal] = []
    comfortable = True
    ready = max(ready_of(current, sample), 1)
    for target in policy.lanes:
        data = _counts(policy, sample, target.lane)
        if data is None:
            continue
        if data.waiting is not None:
            serving = ready if sample.serving_replicas is None else max(sample.serving_replicas, 0.0)
            lane_signals, lane_comfortable = _load_now_signals(policy, target, data, ready, serving, current)
            signals += lane_signals
            comfortable = comfortable and lane_comfortable
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
                               sample.kv_usage / policy.kv_usage_target, KV))
    return signals, comfortable


def _load_now_signals(policy: AutoscalingPolicy, target: LaneScalingTarget, data: LaneSample, ready: int,
                      serving: float, current: int) -> tuple[list[_Signal], bool]:
    """The running and queue signals of a lane whose sample carries the load now."""
    signals: list[_Signal] = []
    comfortable = True
    measured = _running_load(policy, data, ready)
    if measured is not None:
        load, what = measured
        needed = load + policy.headroom_replicas
        ratio = needed / max(current, 1)
        signals.append(_Signal(f"lane {target.lane} {what} (target {policy.running_share_target:.0%}, headroom "
                               f"{policy.headroom_replicas:g}) needs {needed:.2f} replicas", ratio, RUNNING, needed))
        comfortable = comfortable and ratio <= 1.0
    if target.queue_delay_p95_s is not None:
        waiting = max(0.0, data.waiting or 0.0)
        served = max(0.0, data.served_rate or 0.0)
        wait = 0.0 if waiting == 0 else (waiting / served if served > 0 else math.inf)
        ratio = wait / target.queue_delay_p95_s
        if served > 0 and data.arrival_rate is not None and serving > 0:
            # One replica's throughput is what the window's serving replicas served each; a
            # replica that became ready late in the window has not shown its capacity yet.
            needed = serving * max(0.0, data.arrival_rate) / (served * policy.target_utilization)
            sizing = (f"arrivals {data.arrival_rate:.3g}/s against {served:.3g}/s served "
                      f"(utilization target {policy.target_utilization:.0%}) need {needed:.2f} replicas")
        else:
            needed = ready + 1.0  # nothing served in the window: no throughput to size by
            sizing = "nothing served in the window"
        signals.append(_Signal(f"lane {target.lane} {waiting:.0f} waiting, about {wait:.3g}s of queue on {ready} "
                               f"ready (target {target.queue_delay_p95_s:.3g}s); {sizing}", ratio, QUEUE, needed))
        comfortable = comfortable and ratio <= policy.comfort
    if target.slo_attainment is not None and data.slo_attainment is not None:
        comfortable = comfortable and data.slo_attainment >= target.slo_attainment
    return signals, comfortable


def _running_load(policy: AutoscalingPolicy, data: LaneSample, ready: int) -> Optional[tuple[float, str]]:
    """The lane's load in replicas at the running share target, and how it was read; None when
    the running signal is off or not measured."""
    target = policy.running_share_target
    if target is None:
        return None
    if data.replica_running_shares is not None:
        shares = [max(0.0, s) for s in data.replica_running_shares]
        load = sum(replica_load(s, target) for s in shares)
        listed = ", ".join(f"{s:.0%}" for s in shares[:8]) + (", ..." if len(shares) > 8 else "")
        return load, f"running shares [{listed}] on {len(shares)} replicas, a load of {load:.2f}"
    if data.running_share is None:
        return None
    load = ready * replica_load(data.running_share, target)
    return load, f"running share {data.running_share:.0%} on {ready} ready"


def replica_load(share: float, target: float) -> float:
    """One replica's load in replicas at the running share `target`, from its running share.

    Near saturation the share grows about as the square of the arrival rate, so the load is
    sqrt(share / target). A light load grows it in proportion to the rate instead (a request
    holds its slot for its decode, however idle the replica): on the simulated H200 the share
    halves, not quarters, when a light load is spread over twice the replicas (benchmarks.md,
    section 5). Below LINEAR_BELOW x target the load is therefore the chord from zero to the
    curve there, which reads the same load whether it runs on one replica or is spread thin."""
    share = max(0.0, share)
    knee = LINEAR_BELOW * target
    if share >= knee:
        return math.sqrt(share / target)
    return share / math.sqrt(knee * target)


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
    signals, comfortable = _signals(policy, sample, current)
    ready = ready_of(current, sample)
    base = max(ready, 1)
    starting = current - ready
    over = [s for s in signals if s.ratio > 1.0 + policy.tolerance]
    if over:

        def wants(signal: _Signal) -> int:
            if signal.kind == RUNNING:
                assert signal.needed is not None
                # Within the tolerance of the need is enough, as for the scale-down below, so
                # that the size it reaches does not ask to go back.
                return policy.clamp(math.ceil(min(signal.needed, policy.max_replicas) - policy.tolerance - 1e-9))
            if signal.kind == QUEUE:
                assert signal.needed is not None
                return policy.clamp(math.ceil(min(signal.needed, policy.max_replicas) - 1e-9))
            wanted = policy.clamp(max(ready + 1, math.ceil(base * signal.ratio)))
            if starting and signal.kind == RATIO:
                # A latency ratio measures the backlog, which grows until the starting
                # replicas are ready, not the capacity that is missing: it waits for them.
                return min(wanted, current)
            return wanted

        worst = max(over, key=lambda s: (wants(s), s.ratio))
        wanted = wants(worst)
        if wanted <= current:
            if starting:  # the starting replicas cover it: add nothing
                return policy.clamp(current), (f"{worst.what} is x{worst.ratio:.2f} of target on {ready} ready; "
                                               f"awaiting {starting} starting replica(s)")
            return policy.clamp(current), (f"{worst.what} is x{worst.ratio:.2f} of target; "
                                           f"the {ready} ready replicas drain it")
        limited = min(wanted, scale_up_limit(current))
        step = "" if limited == wanted else f", one step is limited to {limited}"
        return policy.clamp(limited), f"{worst.what} is x{worst.ratio:.2f} of target{step}"
    if not comfortable:
        return policy.clamp(current), "load within the targets' tolerance band"
    # Comfortable: the largest size that KV usage and the running signal project.
    projections = []
    for signal in signals:
        if signal.kind == KV:
            projections.append((math.ceil(base * signal.ratio), signal.what))
        elif signal.kind == RUNNING:
            assert signal.needed is not None
            # The tolerance also applies downwards: a size within it of the need is enough.
            projections.append((math.ceil(signal.needed - policy.tolerance - 1e-9), signal.what))
    if not projections:
        return policy.clamp(current), "targets met; no KV usage or running share to size a scale-down by"
    wanted, what = max(projections)
    wanted = min(current, wanted)
    return policy.clamp(wanted), f"{what}, latency targets comfortably met"


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
        limited = max(desired, scale_down_limit(current))
        step = "" if limited == desired else f"; one step is limited to {limited}"
        return limited, (f"scale down {current} -> {limited}: highest recommendation in the last "
                         f"{policy.scale_down_stabilization_s:.0f}s is {desired}{step} ({why})")
    return current, f"holding at {current}: {why}"
