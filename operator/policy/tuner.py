"""The SLO tuner: a pure decision function over per-lane budgets.

    decide(lanes, settings, budgets, sample, history, now) -> Decision

Inputs are plain values (no Kubernetes, no HTTP): the lanes' SLO targets and tuning bounds,
the effective budgets in force, one window of metrics per lane (from Prometheus, or from a
simulation), the recent decisions, and the time. The output is the new effective budgets,
the knob changes with their reasons, and whether each lane meets its SLO. The kopf timer in
tuning.py reads Prometheus, calls this, and writes the result.

Policy (one group of changes per decision, so every change is an experiment that can be
judged on its own):
  1. Prometheus unreachable, or too few requests in the window -> hold and say so.
  2. A change is being evaluated -> wait for a full window after it; if the objective (SLO
     violation, then throughput) got worse, revert it and block that move for a while.
  3. Cooldown since the last change -> hold.
  4. KV usage near the reject watermark with preemptions -> fewer active sequences in the
     lowest-priority lane (multiplicative decrease), else a lower high watermark.
  5. A lane refuses more than its slo.maxRefusedShare (429/503, 504 queue timeouts) ->
     when it gets 429 queue_full because a donor lane fills the shared waiting queue, lower
     that donor's maxWaitingRequests; else more of each step for it, less for a donor.
     A lane misses its TTFT target because requests queue -> additive increase of its token
     and sequence budgets, multiplicative decrease of a lane with slack (batch first).
     A TTFT miss without queueing -> bigger prefill chunks for it, smaller for the donor.
     A TTFT miss while the KV pool is above the high watermark (no prefill starts there) ->
     first the KV shares: a larger kvCacheReserved for the lane, a smaller maxKvCacheShare
     for the first lower-priority donor.
  6. A lane misses TPOT -> a decode waits for the whole step, so the first donor's tokens
     per step and prefill chunk shrink (its running set too when KV usage is high: KV reads
     dominate decode steps), the other donors' chunks shrink; then the lane's own chunks.
  7. Every lane comfortably inside its SLO -> relax the KV shares (a lane's reserve down,
     protected lanes first) while the pool is below the high watermark; then, where work is
     queueing, probe one knob upward for throughput (additive increase; maxKvCacheShare too).
Hysteresis: a lane misses above its target, and counts as having slack only below
`comfort_ratio` x target; in between nothing moves. Values are always clamped into the
declared bounds; a knob without declared bounds is never touched; no step moves a knob by
more than `max_step_fraction` of its value, and each knob moves at most once per decision.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Iterable, Mapping, Optional, Sequence

from tokenlane.operator.api.tuning_types import (
    ADJUST,
    GLOBAL,
    HOLD,
    PROBE,
    REVERT,
    STEP,
    Bounds,
    Decision,
    DecisionRecord,
    EffectiveBudgets,
    HoldReason,
    KnobChange,
    LaneMetrics,
    LaneSLO,
    LaneTarget,
    MetricSample,
    Objective,
    TunerAction,
    TunerSettings,
    Verdict,
    too_few_requests,
)
from tokenlane.runtime.config import knob as _knob

# --------------------------------------------------------------------------- the decision


def decide(
    lanes: Sequence[LaneTarget],
    settings: TunerSettings,
    budgets: EffectiveBudgets,
    sample: MetricSample,
    history: Sequence[DecisionRecord],
    now: float,
) -> Decision:
    """One tuning step. Pure: the same inputs always give the same decision."""
    slo = {lane.name: lane_slo(lane, sample, settings) for lane in lanes}

    def hold(reason: str, **extra) -> Decision:
        return Decision(now, HOLD, budgets, reason, slo=slo, **extra)

    if not sample.available:
        return hold(f"holding budgets: Prometheus unavailable ({sample.error})",
                    held=HoldReason.PROMETHEUS_UNAVAILABLE)

    current = objective(lanes, sample, settings)
    window = sample.window_s
    slo_lanes = [lane for lane in lanes if lane.has_slo]
    thin = [lane.name for lane in slo_lanes
            if too_few_requests(sample.lanes.get(lane.name), settings.min_requests, window)]
    if slo_lanes and len(thin) == len(slo_lanes):
        return hold(
            f"holding budgets: too few requests to judge ({', '.join(thin)}: under "
            f"{settings.min_requests} requests in {window:.0f}s)",
            held=HoldReason.INSUFFICIENT_DATA,
        )

    # ---- judge the change in flight, if any
    pending = _pending_experiment(history)
    judged: dict = {}
    if pending is not None:
        elapsed = now - pending.at
        if elapsed < window:
            return hold(
                f"evaluating {', '.join(map(str, pending.changes))}: waiting for a full window "
                f"after the change ({elapsed:.0f}/{window:.0f}s)"
            )
        verdict, why = _judge(pending, current, settings)
        if verdict == Verdict.REVERTED:
            reverted = budgets
            inverse = []
            for change in pending.changes:
                reverted = reverted.with_value(change.scope, change.knob, change.old)
                inverse.append(change.inverse(f"revert: {why}"))
            return Decision(
                now, REVERT, reverted.consistent(), f"reverting {', '.join(map(str, pending.changes))}: {why}",
                tuple(inverse), slo, current, judged=pending.at, verdict=verdict,
            )
        judged = {"judged": pending.at, "verdict": verdict}
        judged_note = f"kept {', '.join(map(str, pending.changes))} ({why}); "
    else:
        judged_note = ""

    # ---- cooldown since the last change of any kind
    last = _last_change(history)
    cooldown = settings.effective_cooldown_s
    if last is not None and now - last.at < cooldown:
        return hold(f"{judged_note}cooldown: last change {now - last.at:.0f}s ago (cooldown {cooldown:.0f}s)",
                    objective=current, **judged)

    plan = _Planner(lanes, settings, budgets, history, now)
    action, reason = _policy(lanes, settings, sample, slo, plan)
    if not plan.changes:
        return hold(judged_note + reason, objective=current, **judged)
    new_budgets = plan.budgets.consistent()
    return Decision(now, action, new_budgets, judged_note + reason, tuple(plan.changes), slo, current, **judged)


def _judge(pending: DecisionRecord, after: Optional[Objective], settings: TunerSettings) -> tuple[Verdict, str]:
    """Did the change make things worse? -> (verdict, why)."""
    before = pending.objective
    if after is None or before is None:
        return Verdict.INCONCLUSIVE, "no comparable data after the change"
    lo, hi = before.request_rate / settings.load_change_limit, before.request_rate * settings.load_change_limit
    if before.request_rate > 0 and not lo <= after.request_rate <= hi:
        return Verdict.INCONCLUSIVE, (
            f"offered load changed from {before.request_rate:.2f} to {after.request_rate:.2f} req/s"
        )
    worse_by = after.violation - before.violation
    if worse_by > settings.revert_abs_tolerance and worse_by > settings.revert_tolerance * before.level:
        return Verdict.REVERTED, f"SLO violation rose from {before.violation:.3f} to {after.violation:.3f}"
    if pending.action == PROBE:
        floor = before.throughput_tokens_s * (1.0 - settings.throughput_tolerance)
        if after.throughput_tokens_s < floor and after.violation >= before.violation - settings.revert_abs_tolerance:
            return Verdict.REVERTED, (
                f"throughput fell from {before.throughput_tokens_s:.1f} to {after.throughput_tokens_s:.1f} tokens/s"
            )
    return Verdict.KEPT, f"violation {before.violation:.3f}->{after.violation:.3f}, throughput " \
                   f"{before.throughput_tokens_s:.1f}->{after.throughput_tokens_s:.1f} tokens/s"


def _policy(lanes: Sequence[LaneTarget], settings: TunerSettings, sample: MetricSample,
            slo: Mapping[str, LaneSLO], plan: _Planner) -> tuple[TunerAction, str]:
    """Choose this interval's moves into `plan`; returns (action, reason)."""
    window = sample.window_s
    metrics = {lane.name: sample.lanes.get(lane.name) for lane in lanes}
    thin = {lane.name for lane in lanes if too_few_requests(metrics[lane.name], settings.min_requests, window)}
    ratios = {lane.name: _ratios(lane, metrics[lane.name]) for lane in lanes if lane.name not in thin}

    def has_slack(lane: LaneTarget) -> bool:
        # Lanes without an SLO, or without enough traffic to matter, can always give.
        if not lane.has_slo or lane.name in thin:
            return True
        return all(r < settings.comfort_ratio for r in ratios[lane.name].values())

    # ---- KV pressure: preemptions near the reject watermark waste work for everyone
    kv = sample.kv_usage
    if kv is not None and kv >= settings.reject_watermark - settings.kv_pressure_margin and sample.preemption_rate > 0:
        why = (f"KV usage {kv:.2f} near the reject watermark {settings.reject_watermark:.2f} with "
               f"{sample.preemption_rate:.2f} preemptions/s")
        for donor in _donor_order(lanes):
            if plan.step(donor.name, "maxActiveSequences", -1, why):
                return ADJUST, f"{why}: fewer active sequences in {donor.name}"
        if plan.step(GLOBAL, "kvCacheHighWatermark", -1, why):
            return ADJUST, f"{why}: lower high watermark"
        return HOLD, f"{why}, but every knob is at its bound"

    # ---- SLO misses, most important lane first
    missing = [
        lane for lane in lanes
        if lane.name in ratios and any(r > 1.0 for r in ratios[lane.name].values())
    ]
    missing.sort(key=lambda lane: (-lane.priority, -max(ratios[lane.name].values())))
    for lane in missing:
        r = ratios[lane.name]
        m = metrics[lane.name]
        donors = [d for d in _donor_order(lanes)
                  if d.name != lane.name and d.priority <= lane.priority and has_slack(d)]
        if r.get("refused", 0.0) > 1.0:
            moved = _fix_refusals(lane, m, donors, metrics, plan)
            if moved is not None:
                return moved
        if not (r.get("ttft", 0.0) > 1.0 or r.get("tpot", 0.0) > 1.0):
            continue  # only refusals, and no knob could move for them
        if r.get("ttft", 0.0) > 1.0 and r.get("ttft", 0.0) >= r.get("tpot", 0.0):
            moved = _protect_kv_share(lane, m, donors, sample, plan)
            if moved is not None:
                return moved
        if r.get("ttft", 0.0) >= r.get("tpot", 0.0):
            ttft_ms = m.ttft_p95_s * 1000.0
            queue_ms = (m.queue_delay_p95_s or 0.0) * 1000.0
            queueing = queue_ms >= settings.queueing_share * ttft_ms
            why = (f"{lane.name} TTFT p95 {ttft_ms:.0f}ms > {lane.ttft_p95_ms:.0f}ms "
                   f"({'queueing' if queueing else 'prefill'}: queue delay p95 {queue_ms:.0f}ms)")
            knobs = ("maxBatchedTokens", "maxActiveSequences") if queueing else ("prefillChunkSize",)
            grown = [k for k in knobs if plan.step(lane.name, k, +1, why)]
            given = []
            for donor in donors:
                given = [k for k in knobs if plan.step(donor.name, k, -1, why)]
                if given:
                    given_from = donor.name
                    break
            if grown or given:
                parts = []
                if grown:
                    parts.append(f"more {'/'.join(grown)} for {lane.name}")
                if given:
                    parts.append(f"less {'/'.join(given)} for {given_from}")
                return ADJUST, f"{why}: {' and '.join(parts)}"
        else:
            tpot_ms = m.tpot_p95_s * 1000.0
            # A decode waits for the whole step: the prefill tokens batched with it (compute)
            # and every running sequence's KV reads (memory). Shrink the first donor's tokens
            # per step and chunk size (its running set too when KV is well used), and the
            # other donors' chunk sizes.
            why = f"{lane.name} TPOT p95 {tpot_ms:.0f}ms > {lane.tpot_p95_ms:.0f}ms: long steps stall decodes"
            knobs = ["maxBatchedTokens", "prefillChunkSize"]
            if sample.kv_usage is not None and sample.kv_usage >= settings.kv_busy:
                knobs.append("maxActiveSequences")
            shrunk = [f"{d.name}.{k}" for d in donors[:1] for k in knobs if plan.step(d.name, k, -1, why)]
            shrunk += [f"{d.name}.prefillChunkSize" for d in donors[1:]
                       if plan.step(d.name, "prefillChunkSize", -1, why)]
            if not shrunk and plan.step(lane.name, "prefillChunkSize", -1, why):
                shrunk = [f"{lane.name}.prefillChunkSize"]
            if shrunk:
                return ADJUST, f"{why}: smaller {', '.join(shrunk)}"
    if missing:
        names = ", ".join(lane.name for lane in missing)
        return HOLD, f"{names} missing SLO but no knob can move (bounds reached or move blocked after a revert)"

    # ---- headroom everywhere: probe upward for throughput where work queues
    judged_lanes = [lane for lane in lanes if lane.has_slo and lane.name not in thin]
    comfortable = all(has_slack(lane) for lane in judged_lanes)
    if not comfortable:
        return HOLD, "all lanes within SLO (inside the hysteresis band: no change)"
    if not settings.probe:
        return HOLD, "all lanes within SLO with headroom (probing disabled)"
    high = plan.budgets.get(GLOBAL, "kvCacheHighWatermark")
    if kv is None or high is None or kv < high:
        why = "all lanes have SLO headroom and the KV pool is below the high watermark: relaxing KV shares"
        for lane in reversed(_donor_order(lanes)):  # protected lanes hold reserves: they give first
            if plan.step(lane.name, "kvCacheReserved", -1, why):
                return PROBE, f"{why} (kvCacheReserved of {lane.name})"
    backlog = [
        lane for lane in _donor_order(lanes)
        if (m := metrics[lane.name]) is not None and (m.rejection_rate > 0 or m.waiting >= 1.0)
    ]
    if not backlog:
        return HOLD, "all lanes within SLO with headroom; no queued work to probe for"
    preempting = sample.preemption_rate > 0
    for lane in backlog:
        why = f"all lanes have SLO headroom and {lane.name} has queued work: probing for throughput"
        for knob in ("maxBatchedTokens", "maxActiveSequences", "maxKvCacheShare"):
            if plan.step(lane.name, knob, +1, why):
                return PROBE, f"{why} ({knob})"
    if not preempting and plan.step(GLOBAL, "kvCacheHighWatermark", +1, "probing for throughput: no preemptions"):
        return PROBE, "all lanes have SLO headroom and no preemptions: probing a higher KV high watermark"
    return HOLD, "all lanes within SLO with headroom; every probe knob is at its bound"


def _fix_refusals(lane: LaneTarget, m: LaneMetrics, donors: Sequence[LaneTarget],
                  metrics: Mapping[str, Optional[LaneMetrics]], plan: "_Planner") -> Optional[tuple[TunerAction, str]]:
    """Moves for a lane refusing more than its slo.maxRefusedShare, or None if none can move.

    Shared-queue starvation first: the lane gets 429 queue_full while its own queue is far from
    its own cap, so the global waiting queue is full, held by a donor lane with more waiting:
    lower that donor's per-lane maxWaitingRequests (its overflow is refused instead). Else the
    lane's queue drains too slowly (queue full or timed out): more of each step for the lane,
    less for a donor, as for a TTFT miss from queueing."""
    target = lane.refused_share_target
    why = f"{lane.name} refused {m.refused_share:.1%} of its requests > {target:.1%}"
    own_cap = plan.budgets.get(lane.name, "maxWaitingRequests")
    if m.queue_full_rate > 0 and (own_cap is None or m.waiting < own_cap / 2):
        hogs = [d for d in donors if (dm := metrics.get(d.name)) is not None and dm.waiting > m.waiting]
        hogs.sort(key=lambda d: -metrics[d.name].waiting)
        for hog in hogs:
            held = metrics[hog.name].waiting
            starving = f"{why} (queue_full: {hog.name} holds {held:.0f} of the shared waiting queue)"
            if plan.step(hog.name, "maxWaitingRequests", -1, starving):
                return ADJUST, f"{starving}: lower maxWaitingRequests for {hog.name}"
    grown = [k for k in ("maxBatchedTokens", "maxActiveSequences") if plan.step(lane.name, k, +1, why)]
    for donor in donors:
        given = [k for k in ("maxBatchedTokens", "maxActiveSequences") if plan.step(donor.name, k, -1, why)]
        if given:
            parts = ([f"more {'/'.join(grown)} for {lane.name}"] if grown else []) + \
                    [f"less {'/'.join(given)} for {donor.name}"]
            return ADJUST, f"{why}: {' and '.join(parts)}"
    if grown:
        return ADJUST, f"{why}: more {'/'.join(grown)} for {lane.name}"
    return None


def _protect_kv_share(lane: LaneTarget, m: LaneMetrics, donors: Sequence[LaneTarget], sample: MetricSample,
                     plan: "_Planner") -> Optional[tuple[TunerAction, str]]:
    """Moves for a TTFT miss while the KV pool is above the high watermark, or None.

    Above it no prefill starts, except in a lane inside its kvCacheReserved, so the lane waits
    for other lanes' sequences to finish: reserve one step more of the pool for it, and cap the
    first lower-priority donor's maxKvCacheShare one step lower (its blocks come back as its
    sequences end; the reserve preempts the rest by recompute)."""
    high = plan.budgets.get(GLOBAL, "kvCacheHighWatermark")
    kv = sample.kv_usage
    if kv is None or high is None or kv < high:
        return None
    why = (f"{lane.name} TTFT p95 {m.ttft_p95_s * 1000.0:.0f}ms > {lane.ttft_p95_ms:.0f}ms with KV usage "
           f"{kv:.2f} above the high watermark {high:.2f}")
    parts = []
    if plan.step(lane.name, "kvCacheReserved", +1, why):
        parts.append(f"more kvCacheReserved for {lane.name}")
    for donor in donors:
        if donor.priority < lane.priority and plan.step(donor.name, "maxKvCacheShare", -1, why):
            parts.append(f"less maxKvCacheShare for {donor.name}")
            break
    return (ADJUST, f"{why}: {' and '.join(parts)}") if parts else None


# --------------------------------------------------------------------------- helpers


def _round(knob: str, value: float) -> float:
    step = STEP[knob]
    if _knob(knob).type is float:
        return round(round(value / step) * step, 4)
    return int(round(value / step) * step) or int(step)


def _ms(seconds: Optional[float]) -> Optional[float]:
    return None if seconds is None else seconds * 1000.0

def _ratios(lane: LaneTarget, m: LaneMetrics) -> dict[str, float]:
    """observed / target for each SLO the lane declares and the window observed: the p95s, and
    the refused share against slo.maxRefusedShare."""
    out = {}
    if lane.ttft_p95_ms is not None and m.ttft_p95_s is not None:
        out["ttft"] = m.ttft_p95_s * 1000.0 / lane.ttft_p95_ms
    if lane.tpot_p95_ms is not None and m.tpot_p95_s is not None:
        out["tpot"] = m.tpot_p95_s * 1000.0 / lane.tpot_p95_ms
    target = lane.refused_share_target
    if target is not None:
        out["refused"] = _refused_ratio(m.refused_share, target)
    return out


def _refused_ratio(share: float, target: float) -> float:
    if target > 0:
        return share / target
    # maxRefusedShare 0: any refusal misses, by how much on the scale of a 0.1% budget.
    return 1.0 + share / 0.001 if share > 0 else 0.0


def _lane_weight(lane: LaneTarget) -> float:
    return 1.0 + lane.priority / 100.0


def objective(lanes: Sequence[LaneTarget], sample: MetricSample, settings: TunerSettings) -> Optional[Objective]:
    """Weighted SLO excess over lanes with enough data (None if no lane has any)."""
    if not sample.available:
        return None
    violation, level, counted = 0.0, 0.0, 0
    for lane in lanes:
        m = sample.lanes.get(lane.name)
        if not lane.has_slo or too_few_requests(m, settings.min_requests, sample.window_s):
            continue
        counted += 1
        # Refused and timed-out requests count through the lane's maxRefusedShare ratio.
        for ratio in _ratios(lane, m).values():
            violation += _lane_weight(lane) * max(0.0, ratio - 1.0)
            level += _lane_weight(lane) * ratio
    if counted == 0 and sample.throughput_tokens_s <= 0:
        return None
    return Objective(violation, sample.throughput_tokens_s, sample.request_rate, level)


def lane_slo(lane: LaneTarget, sample: MetricSample, settings: TunerSettings) -> LaneSLO:
    """The SLOMet condition for one lane from one window."""
    if not sample.available:
        return LaneSLO(None, "PrometheusUnavailable", f"cannot read metrics: {sample.error}")
    if not lane.has_slo:
        return LaneSLO(None, "NoSLO", "the lane declares no SLO")
    m = sample.lanes.get(lane.name)
    if too_few_requests(m, settings.min_requests, sample.window_s):
        seen = 0 if m is None else int(round(m.total_rate * sample.window_s))
        return LaneSLO(
            None,
            "InsufficientData",
            f"{seen} requests in the last {sample.window_s:.0f}s (need {settings.min_requests})",
        )
    parts, missed = [], []
    for key, target, observed in (
        ("ttft", lane.ttft_p95_ms, _ms(m.ttft_p95_s)),
        ("tpot", lane.tpot_p95_ms, _ms(m.tpot_p95_s)),
    ):
        if target is None or observed is None:
            continue
        ok = observed <= target
        parts.append(f"{key.upper()} p95 {observed:.0f}ms {'<=' if ok else '>'} {target:.0f}ms")
        if not ok:
            missed.append(key.capitalize())
    refused_target = lane.refused_share_target
    if refused_target is not None:
        ok = _refused_ratio(m.refused_share, refused_target) <= 1.0
        parts.append(f"refused {m.refused_share:.1%} {'<=' if ok else '>'} {refused_target:.1%}")
        if not ok:
            missed.append("RefusedShare")
    seen = int(round(m.total_rate * sample.window_s))
    message = "; ".join(parts) + f" ({seen} requests in {sample.window_s:.0f}s)"
    ttft, tpot = _ms(m.ttft_p95_s), _ms(m.tpot_p95_s)
    if not parts:
        return LaneSLO(None, "InsufficientData", "no latency observations in the window", ttft, tpot)
    if missed:
        return LaneSLO(False, "".join(missed) + "AboveTarget", message, ttft, tpot)
    return LaneSLO(True, "WithinTarget", message, ttft, tpot)


# --------------------------------------------------------------------------- history queries


def _last_change(history: Sequence[DecisionRecord]) -> Optional[DecisionRecord]:
    return next((r for r in reversed(history) if r.changes), None)


def pending_experiment(history: Sequence[DecisionRecord]) -> Optional[DecisionRecord]:
    """The adjust/probe change not judged yet, if any (the timer marks it inconclusive when a
    user's edit drops its override: its window no longer measures it)."""
    return _pending_experiment(history)


def _pending_experiment(history: Sequence[DecisionRecord]) -> Optional[DecisionRecord]:
    """The last adjust/probe change, if no later decision has judged it yet."""
    last = _last_change(history)
    if last is None or last.action not in (ADJUST, PROBE) or last.objective is None:
        return None
    if any(r.judged == last.at for r in history):
        return None
    return last


def _blocked(history: Sequence[DecisionRecord], scope: str, knob: str, direction: int, now: float,
             settings: TunerSettings) -> bool:
    """A move that was reverted recently stays blocked (the block doubles on each revert)."""
    reverts = [
        r
        for r in history
        if r.action == REVERT
        and any(c.scope == scope and c.knob == knob and -c.direction == direction for c in r.changes)
    ]
    if not reverts:
        return False
    block = settings.effective_cooldown_s * settings.tabu_cooldowns * 2 ** (len(reverts) - 1)
    return now - reverts[-1].at < block


# --------------------------------------------------------------------------- moves


class _Planner:
    """Collects at most one step per knob for one decision."""

    def __init__(self, lanes: Sequence[LaneTarget], settings: TunerSettings, budgets: EffectiveBudgets,
                 history: Sequence[DecisionRecord], now: float) -> None:
        self.lanes = {lane.name: lane for lane in lanes}
        self.settings = settings
        self.budgets = budgets
        self.history = history
        self.now = now
        self.changes: list[KnobChange] = []

    def bounds(self, scope: str, knob: str) -> Optional[Bounds]:
        """The declared bounds, narrowed by the runtime's cross-field rules."""
        if scope == GLOBAL:
            bounds = self.settings.global_bounds.get(knob)
            if bounds is not None and knob == "kvCacheHighWatermark":
                # The high watermark must stay below the reject watermark.
                hi = min(bounds.max, self.settings.reject_watermark - 0.01)
                return Bounds(min(bounds.min, hi), hi)
            return bounds
        lane = self.lanes[scope]
        bounds = lane.bounds.get(knob)
        if bounds is None:
            return None
        if knob == "maxBatchedTokens":
            # Never below the smallest prefill chunk the lane may have (prefill <= batched).
            chunk = lane.bounds.get("prefillChunkSize")
            floor = chunk.min if chunk is not None else self.budgets.get(scope, "prefillChunkSize")
            if floor is not None and floor > bounds.min:
                return Bounds(min(floor, bounds.max), bounds.max)
        if knob == "prefillChunkSize":
            batched = self.budgets.get(scope, "maxBatchedTokens")
            if batched is not None and batched < bounds.max:
                return Bounds(min(bounds.min, batched), batched)
        if knob == "kvCacheReserved":
            # A lane keeps no more than it may hold, and the reserves leave some pool shared.
            share = self.budgets.get(scope, "maxKvCacheShare")
            others = sum(self.budgets.get(name, "kvCacheReserved") or 0.0 for name in self.lanes if name != scope)
            hi = min(bounds.max, 1.0 if share is None else share, round(1.0 - others - STEP[knob], 4))
            if hi < bounds.max:
                return Bounds(min(bounds.min, hi), hi)
        if knob == "maxKvCacheShare":
            reserved = self.budgets.get(scope, "kvCacheReserved")
            if reserved is not None and reserved > bounds.min:
                return Bounds(min(reserved, bounds.max), bounds.max)
        return bounds

    def step(self, scope: str, knob: str, direction: int, why: str) -> bool:
        """Move one knob one step (AIMD) inside its bounds; False if it cannot move."""
        if any(c.scope == scope and c.knob == knob for c in self.changes):
            return False
        if not self.can_step(scope, knob, direction):
            return False
        bounds = self.bounds(scope, knob)
        current = self.budgets.get(scope, knob)
        assert bounds is not None and current is not None  # can_step checked both
        if knob == "kvCacheHighWatermark":
            target = current + direction * self.settings.watermark_step
        elif direction > 0:
            span = bounds.max - bounds.min
            target = current + max(STEP[knob], span * self.settings.increase_fraction)
        else:
            target = current * self.settings.decrease_factor
        if knob != "kvCacheHighWatermark":
            # AIMD, but never more than max_step_fraction of the current value per step.
            limit = max(STEP[knob], current * self.settings.max_step_fraction)
            target = min(current + limit, max(current - limit, target))
        new = bounds.clamp(_round(knob, target))
        new = bounds.clamp(new)  # rounding can step past a bound that is not on the grid
        if _knob(knob).type is int:
            new = int(new) if float(new).is_integer() else int(math.floor(new))
        if (new - current) * direction <= 0:
            return False
        self.changes.append(KnobChange(scope, knob, current, new, why))
        self.budgets = self.budgets.with_value(scope, knob, new)
        if knob == "maxBatchedTokens" and direction < 0:
            self._fit_prefill_chunk(scope, why)
        return True

    def _fit_prefill_chunk(self, scope: str, why: str) -> None:
        """A smaller token budget takes the lane's prefill chunk down with it (prefill <= batched)."""
        batched = self.budgets.get(scope, "maxBatchedTokens")
        chunk = self.budgets.get(scope, "prefillChunkSize")
        if chunk is None or batched is None or chunk <= batched:
            return
        for i, change in enumerate(self.changes):
            if change.scope == scope and change.knob == "prefillChunkSize":
                self.changes[i] = replace(change, new=batched)
                break
        else:
            self.changes.append(
                KnobChange(scope, "prefillChunkSize", chunk, batched, why + " (chunk <= batched tokens)"))
        self.budgets = self.budgets.with_value(scope, "prefillChunkSize", batched)

    def can_step(self, scope: str, knob: str, direction: int) -> bool:
        bounds = self.bounds(scope, knob)
        current = self.budgets.get(scope, knob)
        if bounds is None or current is None:
            return False
        if _blocked(self.history, scope, knob, direction, self.now, self.settings):
            return False
        return current < bounds.max if direction > 0 else current > bounds.min


def _donor_order(lanes: Iterable[LaneTarget]) -> list[LaneTarget]:
    """Who gives budget first: batch, then long-context, then by ascending priority."""
    rank = {"batch": 0, "long-context": 1, "interactive": 2}
    return sorted(lanes, key=lambda lane: (rank.get(lane.lane_class, 3), lane.priority, lane.name))
