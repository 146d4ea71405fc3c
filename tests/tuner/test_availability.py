"""Availability in the SLO: the refused share (429/503 refusals and 504 queue timeouts) against
a lane's slo.maxRefusedShare, read from Prometheus, in SLOMet and the tuner's objective, and the
per-lane waiting caps the tuner lowers against shared-queue starvation."""

from __future__ import annotations

import pytest
from tuner_helpers import SETTINGS, budgets, lanes

from tokenlane.operator.clients.prometheus import Series, refused, sample_from_results
from tokenlane.operator.policy.tuner import decide, lane_slo, objective
from tokenlane.operator.api.tuning_types import ADJUST, HOLD, Bounds, LaneMetrics, LaneTarget, MetricSample
from tokenlane.runtime.config import DEFAULT_MAX_REFUSED_SHARE, ConfigError, SLOConfig, loads_config

NOW = 10_000.0


# --------------------------------------------------------------------------- what counts as refused


@pytest.mark.parametrize("outcome,reason,counts", [
    ("rejected", "queue_full", True),  # 429
    ("rejected", "deadline", True),  # 429
    ("rejected", "kv_watermark", True),  # 503
    ("rejected", "draining", True),  # 503
    ("timeout", "queue_timeout", True),  # 504
    ("timeout", "deadline", True),  # 504
    ("invalid", "invalid_parameter", False),  # 400: the caller's fault
    ("invalid", "context_length_exceeded", False),
    ("rejected", "too_long", False),  # 400 from the engine
    ("rejected", "invalid", False),
    ("finished", "eos", False),
    ("cancelled", "client_disconnect", False),
    ("error", "other", False),
])
def test_refused_outcomes(outcome, reason, counts):
    assert refused(outcome, reason) is counts


def test_sample_counts_refusals_per_lane_and_queue_full_on_its_own():
    def series(lane, outcome, reason, rate):
        return Series({"lane": lane, "outcome": outcome, "reason": reason}, rate)

    results = {"requests": [
        series("interactive", "finished", "eos", 8.0),
        series("interactive", "rejected", "queue_full", 1.0),
        series("interactive", "timeout", "queue_timeout", 0.5),
        series("interactive", "invalid", "invalid_parameter", 0.5),
        series("batch", "finished", "max_tokens", 2.0),
        series("batch", "rejected", "kv_watermark", 2.0),
    ]}
    s = sample_from_results(results, 60.0, lanes=["interactive", "batch"])
    i, b = s.lanes["interactive"], s.lanes["batch"]
    assert (i.request_rate, i.rejection_rate, i.queue_full_rate) == (8.5, 1.5, 1.0)
    assert i.refused_share == pytest.approx(0.15)  # (1 + 0.5) / (8 + 1 + 0.5 + 0.5): invalid counts as a request
    assert (b.rejection_rate, b.queue_full_rate, b.refused_share) == (2.0, 0.0, 0.5)


# --------------------------------------------------------------------------- the SLO


def test_max_refused_share_in_the_runtime_config():
    assert SLOConfig(ttft_p95_ms=500).refused_share_target == DEFAULT_MAX_REFUSED_SHARE == 0.01
    assert SLOConfig(tpot_p95_ms=60, max_refused_share=0.05).refused_share_target == 0.05
    assert SLOConfig().refused_share_target is None  # a best-effort lane: refused by design when flooded
    assert SLOConfig(e2e_p95_ms=9000).refused_share_target is None
    assert SLOConfig(max_refused_share=0.0).refused_share_target == 0.0
    config = loads_config("""
model: {path: /models/m}
lanes:
  - {name: interactive, default: true, slo: {ttftP95Ms: 500, maxRefusedShare: 0.02}}
""")
    assert config.lanes[0].slo.max_refused_share == 0.02
    for bad in (-0.1, 1.5):
        with pytest.raises(ConfigError, match="maxRefusedShare: must be a fraction in \\[0, 1\\]"):
            SLOConfig(max_refused_share=bad)


def _lane(refused_share_target=None, **kw) -> LaneTarget:
    return LaneTarget("interactive", "interactive", 100, ttft_p95_ms=500, tpot_p95_ms=60,
                      max_refused_share=refused_share_target, **kw)


def _window(answered=9.0, refused_=1.0, queue_full=None, ttft_ms=100.0, waiting=0.0) -> MetricSample:
    m = LaneMetrics(answered, ttft_ms / 1000, 0.02, 0.01, refused_, waiting, 100.0,
                    refused_ if queue_full is None else queue_full)
    return MetricSample(60.0, {"interactive": m})


# (id, lane target, window, met, reason, message fragment)
SLO_CASES = [
    ("within-default-1pct", None, _window(answered=999, refused_=1), True, "WithinTarget", "refused 0.1% <= 1.0%"),
    ("over-default-1pct", None, _window(answered=9, refused_=1), False, "RefusedShareAboveTarget",
     "refused 10.0% > 1.0%"),
    ("over-declared", 0.05, _window(answered=9, refused_=1), False, "RefusedShareAboveTarget", "> 5.0%"),
    ("within-declared", 0.2, _window(answered=9, refused_=1), True, "WithinTarget", "refused 10.0% <= 20.0%"),
    ("both-missed", None, _window(answered=9, refused_=1, ttft_ms=900), False, "TtftRefusedShareAboveTarget",
     "TTFT p95 900ms > 500ms; TPOT p95 20ms <= 60ms; refused 10.0% > 1.0%"),
    ("zero-budget-any-refusal-misses", 0.0, _window(answered=9999, refused_=1), False,
     "RefusedShareAboveTarget", "> 0.0%"),
    # Mostly refused is failing, not idle: refused requests count for the thin-data check.
    ("mostly-refused-is-judged", None, _window(answered=0.1, refused_=2.0, ttft_ms=100), False,
     "RefusedShareAboveTarget", "(126 requests in 60s)"),
]


@pytest.mark.parametrize("name,target,window,met,reason,fragment", SLO_CASES, ids=[c[0] for c in SLO_CASES])
def test_slo_met_counts_refusals(name, target, window, met, reason, fragment):
    slo = lane_slo(_lane(target), window, SETTINGS)
    assert (slo.met, slo.reason) == (met, reason), slo
    assert fragment in slo.message


def test_a_lane_without_an_slo_has_no_availability_target():
    batch = LaneTarget("batch", "batch", 10)
    assert batch.refused_share_target is None and not batch.has_slo
    assert lane_slo(batch, MetricSample(60.0, {"batch": LaneMetrics(1, None, None, None, 9.0)}), SETTINGS).reason \
        == "NoSLO"
    only_availability = LaneTarget("batch", "batch", 10, max_refused_share=0.5)
    assert only_availability.has_slo
    assert lane_slo(only_availability, MetricSample(60.0, {"batch": LaneMetrics(1, None, None, None, 9.0)}),
                    SETTINGS).reason == "RefusedShareAboveTarget"


def test_objective_counts_refusals_against_the_budget():
    clean = objective([_lane()], _window(answered=10, refused_=0), SETTINGS)
    within = objective([_lane()], _window(answered=999, refused_=1), SETTINGS)
    over = objective([_lane()], _window(answered=9, refused_=1), SETTINGS)
    assert clean.violation == 0.0 and within.violation == 0.0
    # 10% refused against a 1% budget: 9 budgets over, weighted by priority (1 + 100/100).
    assert over.violation == pytest.approx(2.0 * 9.0)


# --------------------------------------------------------------------------- the tuner's moves

WAITING_BOUNDS = {"maxWaitingRequests": Bounds(8, 64)}


def _lanes(batch_waiting_bounds=True):
    interactive, batch = lanes()
    bounds = {**batch.bounds, **WAITING_BOUNDS} if batch_waiting_bounds else batch.bounds
    return [interactive, LaneTarget(batch.name, batch.lane_class, batch.priority, bounds=bounds)]


def _starved(interactive_waiting=1.0, batch_waiting=60.0, queue_full=1.0, refused_=1.0, ttft_ms=100.0):
    """Interactive within its latency SLO but refused; batch holding the shared queue."""
    return MetricSample(60.0, {
        "interactive": LaneMetrics(5.0, ttft_ms / 1000, 0.02, 0.01, refused_, interactive_waiting, 250.0, queue_full),
        "batch": LaneMetrics(2.0, 5.0, 0.05, 4.0, 3.0, batch_waiting, 750.0, 3.0),
    }, kv_usage=0.5)


def _budgets(interactive_waiting=64, batch_waiting=64):
    b = budgets()
    b = b.with_value("interactive", "maxWaitingRequests", interactive_waiting)
    return b.with_value("batch", "maxWaitingRequests", batch_waiting)


def _changes(decision) -> dict:
    return {f"{c.scope}.{c.knob}": (c.old, c.new) for c in decision.changes}


# (id, lanes, sample, budgets, action, expected changes (exact), reason fragment)
TUNER_CASES = [
    ("starved-by-batch-lowers-its-waiting-cap", _lanes(), _starved(), _budgets(), ADJUST,
     {"batch.maxWaitingRequests": (64, 48)}, "queue_full: batch holds 60 of the shared waiting queue"),
    ("at-the-bound-uses-the-queueing-move", _lanes(), _starved(), _budgets(batch_waiting=8), ADJUST,
     {"interactive.maxBatchedTokens": (2048, 2560), "interactive.maxActiveSequences": (32, 40),
      "batch.maxBatchedTokens": (8192, 6144), "batch.maxActiveSequences": (64, 48)}, "refused 16.7%"),
    ("no-waiting-bounds-uses-the-queueing-move", _lanes(batch_waiting_bounds=False), _starved(), _budgets(),
     ADJUST, {"interactive.maxBatchedTokens": (2048, 2560), "interactive.maxActiveSequences": (32, 40),
              "batch.maxBatchedTokens": (8192, 6144), "batch.maxActiveSequences": (64, 48)}, "more"),
    # Its own queue is at its own cap: the lane floods itself, batch is not the cause.
    ("own-cap-full-is-not-starvation", _lanes(), _starved(interactive_waiting=40, batch_waiting=60),
     _budgets(interactive_waiting=48), ADJUST,
     {"interactive.maxBatchedTokens": (2048, 2560), "interactive.maxActiveSequences": (32, 40),
      "batch.maxBatchedTokens": (8192, 6144), "batch.maxActiveSequences": (64, 48)}, "refused"),
    # Refused by timeouts, not queue_full: the queue drains too slowly.
    ("timeouts-use-the-queueing-move", _lanes(), _starved(queue_full=0.0), _budgets(), ADJUST,
     {"interactive.maxBatchedTokens": (2048, 2560), "interactive.maxActiveSequences": (32, 40),
      "batch.maxBatchedTokens": (8192, 6144), "batch.maxActiveSequences": (64, 48)}, "refused"),
    ("batch-holding-less-than-interactive-is-not-the-cause", _lanes(),
     _starved(interactive_waiting=10, batch_waiting=5), _budgets(), ADJUST,
     {"interactive.maxBatchedTokens": (2048, 2560), "interactive.maxActiveSequences": (32, 40),
      "batch.maxBatchedTokens": (8192, 6144), "batch.maxActiveSequences": (64, 48)}, "refused"),
    # Refused under its budget but above 0.7 of it: no headroom, so the backlog does not make
    # the tuner probe batch upward (the hysteresis band).
    ("refused-near-the-budget-blocks-probing", _lanes(), _starved(refused_=0.04, queue_full=0.04), _budgets(),
     HOLD, {}, "hysteresis"),
]


@pytest.mark.parametrize("name,lanes_,sample_,budgets_,action,expected,fragment", TUNER_CASES,
                         ids=[c[0] for c in TUNER_CASES])
def test_tuner_fixes_refusals(name, lanes_, sample_, budgets_, action, expected, fragment):
    decision = decide(lanes_, SETTINGS, budgets_, sample_, [], NOW)
    assert decision.action == action, decision.reason
    assert _changes(decision) == expected, decision.reason
    assert fragment in decision.reason, decision.reason
    if action == ADJUST:
        assert decision.slo["interactive"].met is False
        assert decision.slo["interactive"].reason == "RefusedShareAboveTarget"


def test_waiting_cap_never_goes_below_its_bound_and_is_never_probed_up():
    b = _budgets()
    seen = []
    for step in range(12):
        decision = decide(_lanes(), SETTINGS, b, _starved(), [], NOW + step * 1000)
        b = decision.budgets
        seen.append(b.get("batch", "maxWaitingRequests"))
    assert seen[:6] == [48, 36, 27, 20, 15, 11] and min(seen) == 8
    assert all(later <= earlier for earlier, later in zip(seen, seen[1:]))
    # Everyone has headroom and batch queues: probes go to token and sequence budgets only.
    calm = MetricSample(60.0, {"interactive": LaneMetrics(5.0, 0.1, 0.02, 0.01, 0.0, 0.0, 250.0),
                               "batch": LaneMetrics(2.0, 5.0, 0.05, 4.0, 0.0, 30.0, 750.0)}, kv_usage=0.5)
    probe = decide(_lanes(), SETTINGS, b.with_value("batch", "maxBatchedTokens", 4096), calm, [], NOW + 20_000)
    assert probe.action == "probe" and "batch.maxWaitingRequests" not in _changes(probe)
