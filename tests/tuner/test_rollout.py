"""Unit tests of the pure rollout guard (operator/policy/rollout.py)."""

from __future__ import annotations

import pytest

from tokenlane.operator.policy import rollout
from tokenlane.operator.policy.rollout import (
    FallbackProfile,
    LaneBaseline,
    PodReadiness,
    RolloutPolicy,
    RolloutState,
    evaluate,
    revision_of,
)
from tokenlane.operator.api.durations import parse_duration
from tokenlane.operator.api.tuning_types import LaneMetrics, LaneTarget, MetricSample

LANES = [LaneTarget("interactive", "interactive", 100, ttft_p95_ms=500, tpot_p95_ms=60),
         LaneTarget("batch", "batch", 10)]
POLICY = RolloutPolicy(verification_window_s=120, progress_deadline_s=300,
                       fallback=FallbackProfile(continuous_batching=False, budget_scale=0.5),
                       fallback_after_s=120)
READY, NOT_READY = PodReadiness(2, 2, 2), PodReadiness(2, 1, 0)


def sample(ttft_ms=300.0, tpot_ms=40.0, rate=2.0, failed=0.0, available=True) -> MetricSample:
    if not available:
        return MetricSample.unavailable("connection refused", 120)
    return MetricSample(120, {"interactive": LaneMetrics(rate, ttft_ms / 1000, tpot_ms / 1000, 0.1, failed),
                              "batch": LaneMetrics(1.0, 3.0, 0.1, 1.0)})


def stable(lkg="r1", baseline_ttft=300.0) -> RolloutState:
    return RolloutState(rollout.STABLE, lkg, 0.0, ready_at=10.0, lkg=lkg,
                        baseline={"interactive": LaneBaseline(baseline_ttft, 40.0, 0.0)})


def test_first_revision_is_verified_then_promoted():
    d = evaluate(POLICY, None, "r1", 0.0, NOT_READY, sample(), LANES)
    assert d.action == rollout.START and d.state.phase == rollout.VERIFYING
    d = evaluate(POLICY, d.state, "r1", 60.0, READY, sample(), LANES)
    assert d.action == rollout.WAIT and d.state.ready_at == 60.0
    d = evaluate(POLICY, d.state, "r1", 120.0, READY, sample(), LANES)
    assert d.action == rollout.WAIT and "60/120s" in d.message
    d = evaluate(POLICY, d.state, "r1", 181.0, READY, sample(), LANES)
    assert d.action == rollout.PROMOTE and d.state.lkg == "r1"
    assert d.state.baseline["interactive"].ttft_p95_ms == pytest.approx(300.0)


@pytest.mark.parametrize(
    "ttft,tpot,failed,action,fragment",
    [
        (360.0, 40.0, 0.0, rollout.PROMOTE, "no regression in interactive"),  # +20% <= +25%
        (400.0, 40.0, 0.0, rollout.ROLLBACK, "interactive TTFT p95 400ms vs 300ms (+33% > +25%)"),
        (300.0, 80.0, 0.0, rollout.ROLLBACK, "interactive TPOT p95 80ms vs 40ms (+100% > +25%)"),
        (300.0, 40.0, 0.5, rollout.ROLLBACK, "interactive failed share 20.0% vs 0.0%"),
    ],
)
def test_new_revision_is_judged_against_the_last_known_good(ttft, tpot, failed, action, fragment):
    d = evaluate(POLICY, stable(), "r2", 1000.0, READY, sample(), LANES)
    assert d.action == rollout.START and d.state.lkg == "r1"
    d = evaluate(POLICY, d.state, "r2", 1060.0, READY, sample(), LANES)
    d = evaluate(POLICY, d.state, "r2", 1181.0, READY, sample(ttft, tpot, failed=failed), LANES)
    assert d.action == action, d.message
    assert fragment in d.message
    if action == rollout.ROLLBACK:
        assert d.reason == "SLORegression" and d.restore_revision == "r1"
        assert d.state.phase == rollout.ROLLED_BACK and d.state.rolled_back == "r2"


def test_pods_never_ready_roll_back_after_the_progress_deadline():
    d = evaluate(POLICY, stable(), "r2", 1000.0, NOT_READY, sample(), LANES)
    d = evaluate(POLICY, d.state, "r2", 1299.0, NOT_READY, sample(), LANES)
    assert d.action == rollout.WAIT and "0/2 pods ready" in d.message
    d = evaluate(POLICY, d.state, "r2", 1301.0, NOT_READY, sample(), LANES)
    assert d.action == rollout.ROLLBACK and d.reason == "ProgressDeadlineExceeded"
    assert "0/2 pods ready (1 updated) after 301s" in d.message


def test_rolled_back_revision_stays_rolled_back_until_the_spec_changes():
    d = evaluate(POLICY, stable(), "r2", 1000.0, NOT_READY, sample(), LANES)
    d = evaluate(POLICY, d.state, "r2", 1400.0, NOT_READY, sample(), LANES)
    assert d.action == rollout.ROLLBACK
    again = evaluate(POLICY, d.state, "r2", 1500.0, READY, sample(), LANES)
    assert again.action == rollout.HOLD_ROLLED_BACK and again.restore_revision == "r1"
    fixed = evaluate(POLICY, again.state, "r3", 1600.0, READY, sample(), LANES)
    assert fixed.action == rollout.START and fixed.state.rolled_back is None
    back = evaluate(POLICY, again.state, "r1", 1600.0, READY, sample(), LANES)
    assert back.action == rollout.PROMOTE and back.state.phase == rollout.STABLE


def test_no_last_known_good_means_failed_not_rolled_back():
    d = evaluate(POLICY, None, "r1", 0.0, NOT_READY, sample(), LANES)
    d = evaluate(POLICY, d.state, "r1", 301.0, NOT_READY, sample(), LANES)
    assert d.action == rollout.FAIL and "no last-known-good" in d.message


def test_fallback_when_the_lkg_misses_badly_for_long_enough():
    state = stable()
    d = evaluate(POLICY, state, "r1", 1000.0, READY, sample(ttft_ms=1200), LANES)  # > 2 x 500
    assert d.action == rollout.NONE and d.state.bad_since == 1000.0
    d = evaluate(POLICY, d.state, "r1", 1060.0, READY, sample(ttft_ms=1200), LANES)
    assert d.action == rollout.NONE
    d = evaluate(POLICY, d.state, "r1", 1121.0, READY, sample(ttft_ms=1200), LANES)
    assert d.action == rollout.FALLBACK_ACTION and d.state.phase == rollout.FALLBACK
    assert "continuousBatching: false, budgets x0.5" in d.message
    # A recovery in between resets the clock.
    d2 = evaluate(POLICY, state, "r1", 1000.0, READY, sample(ttft_ms=1200), LANES)
    d2 = evaluate(POLICY, d2.state, "r1", 1060.0, READY, sample(ttft_ms=400), LANES)
    assert d2.state.bad_since is None


def test_missing_metrics_wait_then_readiness_only():
    d = evaluate(POLICY, stable(), "r2", 1000.0, READY, sample(), LANES)
    d = evaluate(POLICY, d.state, "r2", 1010.0, READY, sample(), LANES)
    d = evaluate(POLICY, d.state, "r2", 1131.0, READY, sample(available=False), LANES)
    assert d.action == rollout.WAIT and d.reason == "MetricsUnavailable"
    d = evaluate(POLICY, d.state, "r2", 1251.0, READY, sample(available=False), LANES)
    assert d.action == rollout.PROMOTE and "SLOs not compared" in d.message
    no_prom = RolloutPolicy(verification_window_s=120, metrics=False)
    d = evaluate(no_prom, None, "r1", 0.0, READY, sample(available=False), LANES)
    d = evaluate(no_prom, d.state, "r1", 1.0, READY, sample(available=False), LANES)
    d = evaluate(no_prom, d.state, "r1", 122.0, READY, sample(available=False), LANES)
    assert d.action == rollout.PROMOTE and "no Prometheus configured" in d.message


def test_state_round_trips_through_status():
    d = evaluate(POLICY, stable(), "r2", 1000.0, NOT_READY, sample(), LANES)
    assert RolloutState.from_dict(d.state.to_dict()) == d.state
    assert RolloutState.from_dict(stable().to_dict()) == stable()


def test_revision_ignores_replicas_and_volatile_fields():
    dep = {"apiVersion": "apps/v1", "kind": "Deployment",
           "metadata": {"name": "m", "annotations": {"tokenlane.dev/applied-hash": "a"}, "resourceVersion": "5"},
           "spec": {"replicas": 2, "template": {"spec": {"containers": [{"image": "x:1"}]}}}}
    scaled = {**dep, "metadata": {**dep["metadata"], "annotations": {"tokenlane.dev/applied-hash": "b"}},
              "spec": {**dep["spec"], "replicas": 5}}
    new_image = {**dep, "spec": {**dep["spec"], "template": {"spec": {"containers": [{"image": "x:2"}]}}}}
    assert revision_of([dep]) == revision_of([scaled])
    assert revision_of([dep]) != revision_of([new_image])


def test_policy_from_the_crd_fields():
    p = RolloutPolicy.from_spec({"verificationWindow": "2m", "progressDeadline": "1h30m",
                                 "regression": {"ttftP95Percent": 10, "tpotP95Percent": 50, "errorRatePercent": 1},
                                 "fallback": {"policy": "Conservative", "budgetPercent": 40}})
    assert (p.verification_window_s, p.progress_deadline_s) == (120, 5400)
    assert (p.max_ttft_regression, p.max_tpot_regression, p.max_failed_share_increase) == (0.1, 0.5, 0.01)
    assert p.fallback == FallbackProfile(budget_scale=0.4)
    assert RolloutPolicy.from_spec({}).fallback is None  # LastKnownGood: restore only
    assert FallbackProfile(continuous_batching=False, budget_scale=0.5).overrides(
        {"maxActiveSequences": 128, "maxBatchedTokens": 8192, "prefillChunkSize": 2048, "policy": "mixed"}) == {
        "engine": {"continuousBatching": False},
        "scheduler": {"maxActiveSequences": 64, "maxBatchedTokens": 4096, "prefillChunkSize": 1024}}
    assert parse_duration("1h30m") == 5400
    with pytest.raises(ValueError, match="is not a duration"):
        parse_duration("5 minutes")
