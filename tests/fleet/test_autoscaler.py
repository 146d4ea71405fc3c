"""The autoscaler's decision function: table-driven cases and hypothesis properties
(bounds, hold on missing data, no flapping, monotone in load)."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenlane.operator.policy.autoscaler import (
    DOWN,
    HOLD,
    LINEAR_BELOW,
    UP,
    AutoscalingPolicy,
    FleetSample,
    LaneSample,
    LaneScalingTarget,
    Recommendation,
    decide,
    replica_load,
    scale_down_limit,
    scale_up_limit,
)

POLICY = AutoscalingPolicy(
    min_replicas=2,
    max_replicas=20,
    lanes=(LaneScalingTarget("interactive", queue_delay_p95_s=0.5, slo_attainment=0.95),
           LaneScalingTarget("batch", queue_delay_p95_s=30.0)),
    kv_usage_target=0.75,
    scale_up_stabilization_s=0.0,
    scale_down_stabilization_s=300.0,
)
NOW = 10_000.0


def sample(queue_delay=0.1, attainment=0.99, kv=0.5, rate=10.0, at=NOW, batch_delay=1.0) -> FleetSample:
    return FleetSample(at=at, window_s=60.0, kv_usage=kv, lanes={
        "interactive": LaneSample(request_rate=rate, queue_delay_p95_s=queue_delay, slo_attainment=attainment),
        "batch": LaneSample(request_rate=rate, queue_delay_p95_s=batch_delay),
    })


def ready(the_sample: FleetSample, replicas: int) -> FleetSample:
    return dataclasses.replace(the_sample, ready_replicas=replicas)


def covered(replicas: int, policy: AutoscalingPolicy = POLICY) -> tuple[Recommendation, ...]:
    """A history whose every recommendation over the scale-down window (and before) is `replicas`."""
    step = 15.0
    n = int(policy.scale_down_stabilization_s / step) + 2
    return tuple(Recommendation(NOW - step * i, replicas) for i in range(n, 0, -1))


# --------------------------------------------------------------------------- table


@pytest.mark.parametrize("name, current, the_sample, history, desired, action, says", [
    ("metrics unavailable: hold", 5, FleetSample.unavailable(NOW, "prometheus down"), (), 5, HOLD, "unavailable"),
    ("no sample yet: hold", 5, None, (), 5, HOLD, "no metrics"),
    ("stale sample: hold", 5, sample(queue_delay=9.0, at=NOW - 600), (), 5, HOLD, "stale"),
    ("thin lanes and no KV: hold", 5,
     FleetSample(at=NOW, window_s=60, lanes={"interactive": LaneSample(0.1, 9.0, 0.1)}), (), 5, HOLD, "too few"),
    ("on target: hold", 5, sample(queue_delay=0.4, kv=0.7), (), 5, HOLD, "tolerance"),
    ("queue delay x2: scale up in proportion", 3, sample(queue_delay=1.0), (), 6, UP, "queue delay"),
    ("queue delay x100: one step at most", 3, sample(queue_delay=50.0), (), scale_up_limit(3), UP, "limited"),
    ("SLO attainment 80% vs 95%: scale up", 4, sample(attainment=0.80), (), 8, UP, "attainment"),
    ("KV 90% vs 75%: scale up by one", 5, sample(kv=0.9), (), 6, UP, "KV usage"),
    ("overload at max: stays at max", 20, sample(queue_delay=5.0), (), 20, HOLD, "queue delay"),
    ("low load, no window yet: hold", 10, sample(kv=0.15, queue_delay=0.01), (), 10, HOLD, "waits"),
    ("low load for the whole window: scale down", 8, sample(kv=0.3, queue_delay=0.01), covered(4), 4, DOWN,
     "scale down"),
    ("low load but one high recommendation in the window: hold", 10, sample(kv=0.3, queue_delay=0.01),
     covered(4)[:-3] + (Recommendation(NOW - 20, 12),) + covered(4)[-2:], 10, HOLD, "recommendation of 12"),
    ("idle fleet: down to min after the window", 3, sample(kv=0.0, queue_delay=0.0, rate=0.0), covered(2), 2,
     DOWN, "scale down"),
    ("scale-down halves at most", 16, sample(kv=0.05, queue_delay=0.0), covered(2), 8, DOWN, "scale down"),
    ("latency not comfortable: no scale-down", 10, sample(kv=0.1, queue_delay=0.4), covered(2), 10, HOLD,
     "tolerance"),
    ("current above max: clamped", 30, sample(), (), 20, DOWN, "outside"),
    ("current below min with missing data: clamped", 1, None, (), 2, UP, "outside"),
    # Replicas still starting (ready < current): the ratio scales the ready ones only,
    # capacity already starting is not added again, and only KV usage may add more meanwhile.
    ("queue delay x2 on 2 ready of 4: the starting ones cover it", 4, ready(sample(queue_delay=1.0), 2), (), 4,
     HOLD, "awaiting 2 starting"),
    ("queue delay x3 on 2 ready of 4: latency waits for the starting ones", 4, ready(sample(queue_delay=1.5), 2),
     (), 4, HOLD, "awaiting 2 starting"),
    ("KV 100% on 4 ready of 5: KV adds what is missing", 5, ready(sample(kv=1.0), 4), (), 6, UP, "KV usage"),
    ("overload on 1 ready of 5: no re-adding", 5, ready(sample(attainment=0.85), 1), (), 5, HOLD,
     "awaiting 4 starting"),
    ("overload with none ready yet: counted as one", 3, ready(sample(queue_delay=1.0), 0), (), 3, HOLD,
     "awaiting 3 starting"),
    ("all ready: as without the field", 3, ready(sample(queue_delay=1.0), 3), (), 6, UP, "queue delay"),
    ("more ready than current (a pod terminating): current counts", 3, ready(sample(queue_delay=1.0), 5), (), 6,
     UP, "queue delay"),
])
def test_decisions(name, current, the_sample, history, desired, action, says):
    decision = decide(POLICY, current, the_sample, history, NOW)
    assert (decision.desired, decision.action) == (desired, action), decision.reason
    assert says in decision.reason, decision.reason
    assert decision.history[-1] == Recommendation(NOW, decision.recommendation)


def test_scale_up_stabilization_needs_a_sustained_violation():
    policy = AutoscalingPolicy(min_replicas=1, max_replicas=10, lanes=POLICY.lanes, scale_up_stabilization_s=60)
    quiet = tuple(Recommendation(NOW - t, 3) for t in (90, 75, 60, 45, 30, 15))
    burst = decide(policy, 3, sample(queue_delay=2.0), quiet, NOW)
    assert burst.desired == 3 and "sustained" in burst.reason
    loud = tuple(Recommendation(NOW - t, 9) for t in (45, 30, 15))
    sustained = decide(policy, 3, sample(queue_delay=2.0), quiet[:3] + loud, NOW)
    assert sustained.desired == scale_up_limit(3)


def test_history_round_trips_and_is_pruned_to_the_window():
    history = covered(4) + tuple(Recommendation(NOW - 5000 - i, 9) for i in range(50))
    decision = decide(POLICY, 10, sample(kv=0.3, queue_delay=0.01), history, NOW)
    assert len([r for r in decision.history if r.at <= NOW - 300]) == 1  # the coverage witness only
    assert tuple(Recommendation.from_dict(r.to_dict()) for r in decision.history) == decision.history


@pytest.mark.parametrize("kwargs, message", [
    ({"min_replicas": -1, "max_replicas": 3}, "minReplicas must be >= 0"),
    ({"min_replicas": 0, "max_replicas": 3, "scale_to_zero_after_s": 0}, "scaleToZeroAfter"),
    ({"min_replicas": 4, "max_replicas": 3}, "maxReplicas"),
    ({"min_replicas": 1, "max_replicas": 3, "kv_usage_target": 1.5}, "kvUsage"),
    ({"min_replicas": 1, "max_replicas": 3, "lanes": (LaneScalingTarget("a"), LaneScalingTarget("a"))}, "duplicate"),
])
def test_policy_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        AutoscalingPolicy(**kwargs)


def test_lane_target_validation():
    with pytest.raises(ValueError, match="sloAttainment"):
        LaneScalingTarget("a", slo_attainment=1.0)
    with pytest.raises(ValueError, match="queueDelayP95"):
        LaneScalingTarget("a", queue_delay_p95_s=0)


# --------------------------------------------------------------------------- properties

policies = st.builds(
    lambda lo, span, up, down: AutoscalingPolicy(min_replicas=lo, max_replicas=lo + span, lanes=POLICY.lanes,
                                                 scale_up_stabilization_s=up, scale_down_stabilization_s=down),
    st.integers(1, 5), st.integers(0, 30), st.sampled_from([0.0, 30.0, 60.0]), st.sampled_from([0.0, 120.0, 300.0]),
)
lane_samples = st.builds(LaneSample, request_rate=st.floats(0, 50),
                         queue_delay_p95_s=st.one_of(st.none(), st.floats(0, 100)),
                         slo_attainment=st.one_of(st.none(), st.floats(0, 1)))
fleet_samples = st.one_of(
    st.none(),
    st.builds(FleetSample.unavailable, st.just(NOW), st.just("down")),
    st.builds(FleetSample, at=st.floats(NOW - 300, NOW), window_s=st.just(60.0),
              lanes=st.fixed_dictionaries({"interactive": lane_samples, "batch": lane_samples}),
              kv_usage=st.one_of(st.none(), st.floats(0, 1))),
)
histories = st.lists(st.builds(Recommendation, at=st.floats(NOW - 1000, NOW), replicas=st.integers(0, 60)),
                     max_size=40).map(lambda h: tuple(sorted(h, key=lambda r: r.at)))


@settings(max_examples=300, deadline=None)
@given(policy=policies, current=st.integers(0, 60), the_sample=fleet_samples, history=histories)
def test_always_within_bounds_and_steps(policy, current, the_sample, history):
    decision = decide(policy, current, the_sample, history, NOW)
    assert policy.min_replicas <= decision.desired <= policy.max_replicas
    if policy.min_replicas <= current <= policy.max_replicas:
        assert decision.desired <= max(current, scale_up_limit(current))
        assert decision.desired >= min(current, scale_down_limit(current))


@settings(max_examples=200, deadline=None)
@given(policy=policies, current=st.integers(1, 40), history=histories,
       the_sample=st.one_of(st.none(), st.builds(FleetSample.unavailable, st.just(NOW), st.text(max_size=5)),
                            st.builds(FleetSample, at=st.floats(NOW - 5000, NOW - 121), window_s=st.just(60.0),
                                      kv_usage=st.floats(0, 1))))
def test_holds_on_missing_or_stale_data(policy, current, history, the_sample):
    decision = decide(policy, current, the_sample, history, NOW)
    assert decision.desired == policy.clamp(current)
    assert decision.history[-1] == Recommendation(NOW, policy.clamp(current))  # blocks a scale-down for a window


@settings(max_examples=100, deadline=None)
@given(policy=policies, start=st.integers(2, 20), period=st.integers(2, 6), high_kv=st.floats(0.9, 1.0),
       low_kv=st.floats(0.0, 0.3))
def test_no_flapping_under_oscillating_load(policy, start, period, high_kv, low_kv):
    """Load alternating between overload and idle, every `period` decisions (15 s apart) -- a
    cycle shorter than the scale-down window: once scaled up, never scaled down."""
    policy = AutoscalingPolicy(min_replicas=policy.min_replicas, max_replicas=policy.max_replicas,
                               lanes=policy.lanes, scale_down_stabilization_s=300.0)
    current, history, directions = policy.clamp(start), (), []
    for i in range(80):
        t = NOW + 15.0 * i
        busy = (i // period) % 2 == 0
        s = sample(queue_delay=2.0 if busy else 0.0, kv=high_kv if busy else low_kv, at=t)
        decision = decide(policy, current, s, history, t)
        if decision.desired != current:
            directions.append(decision.action)
        current, history = decision.desired, decision.history
    assert DOWN not in directions, directions


@settings(max_examples=300, deadline=None)
@given(policy=policies, current=st.integers(1, 40), ready_share=st.floats(0, 1), history=histories,
       level=st.tuples(st.floats(0, 100), st.floats(0, 1), st.one_of(st.none(), st.floats(0, 1))))
def test_latency_never_adds_to_replicas_still_starting(policy, current, ready_share, history, level):
    """With replicas starting, a latency overload of any size holds the count; only KV usage,
    scaled on the ready replicas, may add (no overshoot while capacity is on its way)."""
    current = policy.clamp(current)
    ready_now = min(current - 1, int(current * ready_share))  # current >= minReplicas >= 1
    delay, misses, kv = level
    the_sample = dataclasses.replace(sample(queue_delay=delay, attainment=1 - misses, kv=kv),
                                     ready_replicas=ready_now)
    decision = decide(policy, current, the_sample, history, NOW)
    kv_wants = 0 if kv is None else math.ceil(max(ready_now, 1) * kv / POLICY.kv_usage_target)
    assert decision.desired <= max(current, min(kv_wants, scale_up_limit(current), policy.max_replicas))


load_levels = st.tuples(st.floats(0, 10), st.floats(0, 1), st.floats(0, 1))  # queue delay, 1 - attainment, kv


@settings(max_examples=300, deadline=None)
@given(policy=policies, current=st.integers(1, 30), history=histories, a=load_levels, b=load_levels)
def test_monotone_in_load(policy, current, history, a, b):
    """More load on every signal never gives fewer replicas (same history, same time)."""
    low = tuple(min(x, y) for x, y in zip(a, b))
    high = tuple(max(x, y) for x, y in zip(a, b))

    def desired(level) -> int:
        delay, misses, kv = level
        return decide(policy, current, sample(queue_delay=delay, attainment=1 - misses, kv=kv), history, NOW).desired

    assert desired(low) <= desired(high)


def test_proportional_scale_up_rounds_up():
    # queue delay 1.25 x target on 8 replicas -> ceil(10) = 10
    decision = decide(POLICY, 8, sample(queue_delay=0.625), (), NOW)
    assert decision.desired == math.ceil(8 * 1.25)


# --------------------------------------------------------------------------- the load now

# The sample carries the load now (waiting requests, arrivals against throughput, running
# share): the running and queue signals judge the lane, and its ended requests' latencies only
# block a scale-down.
NOW_POLICY = AutoscalingPolicy(
    min_replicas=1,
    max_replicas=20,
    lanes=(LaneScalingTarget("interactive", queue_delay_p95_s=0.25, slo_attainment=0.97),),
    kv_usage_target=0.75,
    scale_down_stabilization_s=300.0,
    running_share_target=0.4,
    headroom_replicas=0.5,
)


def now_sample(share=0.1, waiting=0.0, arrivals=10.0, served=10.0, attainment=0.99, ready_replicas=None,
               at=NOW) -> FleetSample:
    return FleetSample(at=at, window_s=60.0, kv_usage=None, ready_replicas=ready_replicas, lanes={
        "interactive": LaneSample(request_rate=served, queue_delay_p95_s=9.0, slo_attainment=attainment,
                                  waiting=waiting, arrival_rate=arrivals, served_rate=served, running_share=share)})


@pytest.mark.parametrize("name, current, the_sample, history, desired, action, says", [
    # 1 x sqrt(0.6 / 0.4) + 0.5 = 1.72 replicas
    ("running share x1.5 of target: up, with the headroom", 1, now_sample(share=0.6), (), 2, UP, "running share"),
    # 1 x sqrt(0.22 / 0.4) + 0.5 = 1.24: one replica at 74% of its target has too little spare
    ("one replica at 74% of target: the headroom adds one", 1, now_sample(share=0.22), (), 2, UP, "headroom"),
    # 2 x 0.74 + 0.5 = 1.98: two replicas at the same load keep enough spare between them
    ("two replicas at 74% of target: hold", 2, now_sample(share=0.22), covered(1, NOW_POLICY), 2, HOLD,
     "running share"),
    # the share is capped at 1 when saturated; the square root keeps the step from overshooting,
    # and a need within the tolerance (0.1) of a whole replica rounds down
    ("one saturated replica: sqrt(1 / 0.4) + 0.5 = 2.08", 1, now_sample(share=1.0), (), 2, UP, "running share"),
    ("queue saturating 2 replicas: arrivals / (served x 0.8)", 2,
     now_sample(share=0.3, waiting=100, arrivals=30.0, served=20.0), (), 4, UP, "100 waiting"),
    ("a queue the ready replicas drain: hold", 3, now_sample(share=0.2, waiting=100, arrivals=20.0, served=40.0),
     (), 3, HOLD, "drain"),
    ("a queue while replicas start: they cover it", 3,
     now_sample(share=0.3, waiting=100, arrivals=30.0, served=20.0, ready_replicas=1), (), 3, HOLD,
     "awaiting 2 starting"),
    ("waiting but nothing served: one more than ready", 2, now_sample(share=1.0, waiting=50, served=0.0,
                                                                      arrivals=5.0), (), 4, UP, "running share"),
    ("the old queue delay p95 is ignored when the queue is measured", 2, now_sample(share=0.05), (), 2, HOLD,
     "holding"),
    ("low SLO attainment blocks a scale-down", 4, now_sample(share=0.01, attainment=0.9), covered(1, NOW_POLICY), 4,
     HOLD, "tolerance band"),
    # 3 x (2 x 0.02 / 0.4) + 0.5 = 0.8 -> 1, one step goes no lower than 2
    ("quiet for the whole window: down to the running projection", 3, now_sample(share=0.02),
     covered(1, NOW_POLICY), 2, DOWN, "limited to 2"),
])
def test_load_now_decisions(name, current, the_sample, history, desired, action, says):
    decision = decide(NOW_POLICY, current, the_sample, history, NOW)
    assert (decision.desired, decision.action) == (desired, action), decision.reason
    assert says in decision.reason, decision.reason


@pytest.mark.parametrize("kwargs, message", [
    ({"running_share_target": 0.0}, "runningShareTarget"),
    ({"running_share_target": 1.5}, "runningShareTarget"),
    ({"headroom_replicas": -1.0}, "headroomReplicas"),
    ({"target_utilization": 0.0}, "targetUtilization"),
])
def test_load_now_policy_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        AutoscalingPolicy(min_replicas=1, max_replicas=3, **kwargs)


now_policies = st.builds(
    lambda lo, span, down, share, headroom: AutoscalingPolicy(
        min_replicas=lo, max_replicas=lo + span, lanes=NOW_POLICY.lanes, scale_down_stabilization_s=down,
        running_share_target=share, headroom_replicas=headroom),
    st.integers(1, 5), st.integers(0, 30), st.sampled_from([0.0, 120.0, 300.0]), st.floats(0.05, 1.0),
    st.floats(0.0, 3.0),
)
now_lane_samples = st.builds(LaneSample, request_rate=st.floats(0, 50), slo_attainment=st.floats(0, 1),
                             waiting=st.floats(0, 1000), arrival_rate=st.one_of(st.none(), st.floats(0, 100)),
                             served_rate=st.one_of(st.none(), st.floats(0, 100)),
                             running_share=st.one_of(st.none(), st.floats(0, 1)),
                             replica_running_shares=st.one_of(st.none(), st.lists(st.floats(0, 1), max_size=40)
                                                              .map(tuple)))


@settings(max_examples=150, deadline=None)
@given(policy=now_policies, current=st.integers(0, 60), history=histories, lane=now_lane_samples,
       ready_now=st.one_of(st.none(), st.integers(0, 60)), kv=st.one_of(st.none(), st.floats(0, 1)))
def test_load_now_within_bounds_and_steps(policy, current, history, lane, ready_now, kv):
    the_sample = FleetSample(at=NOW, window_s=60.0, lanes={"interactive": lane}, kv_usage=kv,
                             ready_replicas=ready_now)
    decision = decide(policy, current, the_sample, history, NOW)
    assert policy.min_replicas <= decision.desired <= policy.max_replicas
    if policy.min_replicas <= current <= policy.max_replicas:
        assert decision.desired <= max(current, scale_up_limit(current))
        assert decision.desired >= min(current, scale_down_limit(current))


now_levels = st.tuples(st.floats(0, 1), st.floats(0, 500), st.floats(0, 60), st.floats(0, 1))


@settings(max_examples=150, deadline=None)
@given(policy=now_policies, current=st.integers(1, 30), history=histories, a=now_levels, b=now_levels,
       served=st.floats(0.5, 60))
def test_load_now_monotone_in_load(policy, current, history, a, b, served):
    """More running share, waiting, arrivals or SLO misses never give fewer replicas (the
    same throughput, history and time)."""
    low = tuple(min(x, y) for x, y in zip(a, b))
    high = tuple(max(x, y) for x, y in zip(a, b))

    def desired(level) -> int:
        share, waiting, arrivals, misses = level
        the_sample = now_sample(share=share, waiting=waiting, arrivals=arrivals, served=served,
                                attainment=1 - misses)
        return decide(policy, current, the_sample, history, NOW).desired

    assert desired(low) <= desired(high)


@settings(max_examples=100, deadline=None)
@given(policy=now_policies, current=st.integers(1, 30), history=histories,
       pairs=st.lists(st.tuples(st.floats(0, 1), st.floats(0, 1)), min_size=1, max_size=12))
def test_each_replicas_share_is_monotone(policy, current, history, pairs):
    """More running share on any replica never gives fewer replicas."""
    low = tuple(min(a, b) for a, b in pairs)
    high = tuple(max(a, b) for a, b in pairs)
    assert (decide(policy, current, replica_sample(low), history, NOW).desired
            <= decide(policy, current, replica_sample(high), history, NOW).desired)


def share_at(load: float, target: float) -> float:
    """The running share at which one replica reads `load` (the inverse of replica_load)."""
    knee = LINEAR_BELOW * target
    if load >= math.sqrt(knee / target):
        return target * load ** 2
    return load * math.sqrt(knee * target)


@pytest.mark.parametrize("share, load", [(0.4, 1.0), (0.1, 0.5), (0.05, 0.25), (0.0, 0.0), (0.9, 1.5)])
def test_replica_load_is_linear_below_a_quarter_of_the_target(share, load):
    """At a target of 0.4: the square law from 0.1 up, the chord below it (continuous at 0.1)."""
    assert replica_load(share, 0.4) == pytest.approx(load)
    assert share_at(load, 0.4) == pytest.approx(share)


@pytest.mark.parametrize("name, shares, desired, action", [
    # 1.50 + 0 + 0.5 = 2.0 summed; as the mean (45%), 2 x sqrt(0.45 / 0.4) + 0.5 = 2.62
    ("a replica that just joined next to a saturated one: summed, no third", (0.9, 0.0), 2, HOLD),
    ("the same fleet read from the mean share only: a third", None, 3, UP),
    # a light load spread over two reads what it reads on one: 2 x 0.3 + 0.5 = 1.1
    ("a light load on two replicas: back to one", (0.06, 0.06), 1, DOWN),
])
def test_running_signal_sums_each_replicas_load(name, shares, desired, action):
    the_sample = now_sample(share=0.45)
    if shares is not None:
        the_sample = dataclasses.replace(the_sample, lanes={"interactive": dataclasses.replace(
            the_sample.lanes["interactive"], replica_running_shares=shares, running_share=sum(shares) / 2)})
    history = covered(1, NOW_POLICY) if action == DOWN else ()
    decision = decide(NOW_POLICY, 2, the_sample, history, NOW)
    assert (decision.desired, decision.action) == (desired, action), decision.reason


def test_a_scale_down_limited_to_half_takes_the_rest_at_the_next_decision():
    """The step limit applies after stabilization: the history keeps the projection of one, so
    the next decision does not wait another window for a second step."""
    quiet = now_sample(share=0.01)
    first = decide(NOW_POLICY, 4, quiet, covered(1, NOW_POLICY), NOW)
    assert (first.desired, first.recommendation) == (2, 1) and "limited to 2" in first.reason, first.reason
    second = decide(NOW_POLICY, 2, dataclasses.replace(quiet, at=NOW + 15), first.history, NOW + 15)
    assert (second.desired, second.action) == (1, DOWN), second.reason


@settings(max_examples=150, deadline=None)
@given(policy=now_policies, current=st.integers(1, 30), share=st.floats(0, 1),
       spread=st.lists(st.floats(0, 1), min_size=1, max_size=12))
def test_running_signal_never_reverses_itself(policy, current, share, spread):
    """Scaled to what the running signal asked for, the same load (spread evenly over the new
    size, at the share the load model projects there) never asks to go back: the signal's own
    hysteresis. Read from the mean share, and from each replica's own (uneven) share."""
    policy = dataclasses.replace(policy, scale_down_stabilization_s=0.0)
    current = policy.clamp(current)
    target = policy.running_share_target
    own = tuple(spread[i % len(spread)] for i in range(current))
    for first_sample, load in ((now_sample(share=share), current * replica_load(share, target)),
                               (replica_sample(own), sum(replica_load(s, target) for s in own))):
        first = decide(policy, current, first_sample, (), NOW)
        moved = first.desired
        projected = share_at(load / moved, target)
        if projected > 1.0:
            continue  # past saturation the share is capped: the model no longer holds
        second = decide(policy, moved, replica_sample((projected,) * moved, at=NOW + 15), first.history, NOW + 15)
        if first.action == UP:
            assert second.action != DOWN, (first.reason, second.reason)
        if first.action == DOWN:
            assert second.action != UP, (first.reason, second.reason)


def replica_sample(shares: tuple[float, ...], at: float = NOW) -> FleetSample:
    the_sample = now_sample(share=sum(shares) / len(shares), at=at)
    return dataclasses.replace(the_sample, lanes={"interactive": dataclasses.replace(
        the_sample.lanes["interactive"], replica_running_shares=shares)})


# --------------------------------------------------------------------------- scale to zero

ZERO_POLICY = dataclasses.replace(POLICY, min_replicas=0, scale_to_zero_after_s=900.0)


def zero_sample(held=0.0, unserved=0.0, in_flight=0.0, recent=0.0, kv=0.1, rate=0.0, at=NOW) -> FleetSample:
    """A sample with the router's held demand and the idleness measures."""
    return dataclasses.replace(sample(kv=kv, rate=rate, at=at), held_requests=held, arrivals_without_replica=unserved,
                               in_flight=in_flight, idle_window_requests=recent)


@pytest.mark.parametrize("name, current, the_sample, history, desired, action, says", [
    ("held demand wakes the pool at once", 0, zero_sample(held=3), (), 1, UP, "scale from zero 0 -> 1"),
    ("arrivals that found no replica wake it too", 0, zero_sample(unserved=2), (), 1, UP, "2 arrived"),
    ("no demand at zero: stay at zero", 0, zero_sample(), (), 0, HOLD, "at zero replicas"),
    ("metrics unavailable at zero: stay at zero", 0, FleetSample.unavailable(NOW, "down"), (), 0, HOLD,
     "no demand can be seen"),
    ("router metrics missing at zero: stay at zero, and say so", 0,
     dataclasses.replace(zero_sample(), held_requests=None, arrivals_without_replica=None), (), 0, HOLD,
     "is the router scraped?"),
    ("stale metrics at zero: stay at zero", 0, zero_sample(held=5, at=NOW - 1000), (), 0, HOLD, "stale"),
    ("idle for scaleToZeroAfter: to zero at once", 4, zero_sample(), covered(4, ZERO_POLICY), 0, DOWN,
     "scale to zero 4 -> 0"),
    ("idle without any history: to zero (the window is scaleToZeroAfter)", 1, zero_sample(), (), 0, DOWN,
     "no request held, in flight or arriving in the last 900s"),
    ("a request in flight keeps the pool", 1, zero_sample(in_flight=1), covered(1, ZERO_POLICY), 1, HOLD, "holding"),
    ("a held request keeps the pool", 1, zero_sample(held=1), covered(1, ZERO_POLICY), 1, HOLD, "holding"),
    ("a recent arrival keeps the pool", 1, zero_sample(recent=1), covered(1, ZERO_POLICY), 1, HOLD, "holding"),
    ("idleness not measured keeps the pool", 1, dataclasses.replace(zero_sample(), idle_window_requests=None),
     covered(1, ZERO_POLICY), 1, HOLD, "holding"),
    ("the other signals never reach zero on their own", 3,
     zero_sample(kv=0.01, rate=10.0, in_flight=2, recent=50), covered(0, ZERO_POLICY), 2, DOWN, "scale down 3 -> 2"),
])
def test_scale_to_zero_decisions(name, current, the_sample, history, desired, action, says):
    decision = decide(ZERO_POLICY, current, the_sample, history, NOW)
    assert (decision.desired, decision.action) == (desired, action), decision.reason
    assert says in decision.reason, decision.reason
    assert decision.history[-1] == Recommendation(NOW, decision.recommendation)


def test_without_min_zero_the_idle_pool_keeps_its_floor():
    policy = dataclasses.replace(ZERO_POLICY, min_replicas=1)
    decision = decide(policy, 1, zero_sample(), covered(1, policy), NOW)
    assert decision.desired == 1


@given(current=st.integers(0, 20), held=st.sampled_from([0.0, 2.0]), in_flight=st.sampled_from([0.0, 3.0, None]),
       recent=st.sampled_from([0.0, 7.0, None]), kv=st.floats(0.0, 1.0))
@settings(max_examples=200, deadline=None)
def test_zero_only_when_idle_and_never_stuck_at_zero_with_demand(current, held, in_flight, recent, kv):
    the_sample = dataclasses.replace(zero_sample(held=held, kv=kv, rate=10.0), in_flight=in_flight,
                                     idle_window_requests=recent)
    decision = decide(ZERO_POLICY, current, the_sample, covered(current, ZERO_POLICY), NOW)
    assert 0 <= decision.desired <= ZERO_POLICY.max_replicas
    if decision.desired == 0 and current > 0:
        assert held == 0 and in_flight == 0 and recent == 0
    if current == 0 and held > 0:
        assert decision.desired == 1
