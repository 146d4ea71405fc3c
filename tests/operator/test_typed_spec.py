"""The typed spec (operator/api/spec.py), the one duration grammar (operator/api/durations.py)
and the enums of the timers' hold reasons and verdicts."""

from __future__ import annotations

import json
import re

import pytest
import yaml

from tokenlane.operator.api import schema
from tokenlane.operator.api.durations import parse_duration
from tokenlane.operator.api.resources import parse_model_service, parse_serving_lane
from tokenlane.operator.api.spec import (
    AutoscalingSpec,
    FallbackPolicy,
    KnobBounds,
    LaneSettings,
    ModelServiceSettings,
    RolloutSpec,
    TuningSpec,
)
from tokenlane.operator.api.tuning_types import (
    HOLD,
    DecisionRecord,
    EffectiveBudgets,
    HoldReason,
    LaneMetrics,
    LaneTarget,
    MetricSample,
    TunerAction,
    TunerSettings,
    Verdict,
)
from tokenlane.operator.controllers import scaling, tuning
from tokenlane.operator.policy import autoscaler, rollout, tuner

# --------------------------------------------------------------------------- durations


@pytest.mark.parametrize("text, seconds", [
    ("30s", 30.0),
    ("5m", 300.0),
    ("1h", 3600.0),
    ("1h30m", 5400.0),
    ("1m30s", 90.0),
    ("1.5h", 5400.0),
    ("250ms", 0.25),
    ("1s500ms", 1.5),
    ("0s", 0.0),
    ("2h0m0s", 7200.0),
])
def test_durations_in_the_crd_grammar(text, seconds):
    assert re.fullmatch(schema.DURATION_PATTERN, text)  # what the API server accepts ...
    assert parse_duration(text) == pytest.approx(seconds)  # ... is what the operator reads


@pytest.mark.parametrize("value, message", [
    ("", "'' is not a duration"),
    ("5", "'5' is not a duration"),  # a bare number: the CRD wants a unit
    ("5 minutes", "'5 minutes' is not a duration"),
    ("1d", "'1d' is not a duration"),
    ("-5s", "'-5s' is not a duration"),
    ("s", "'s' is not a duration"),
    ("1h 30m", "'1h 30m' is not a duration"),
    (" 5s", "' 5s' is not a duration"),
    ("5S", "'5S' is not a duration"),
    (".5s", "'.5s' is not a duration"),
    (None, "expected a duration string like 30s, 5m or 1h30m, got NoneType None"),
    (30, "expected a duration string like 30s, 5m or 1h30m, got int 30"),
    (True, "got bool True"),
])
def test_bad_durations_are_refused_with_the_grammar(value, message):
    if isinstance(value, str):
        assert not re.fullmatch(schema.DURATION_PATTERN, value)
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_duration(value)


def test_a_bad_duration_names_its_field():
    with pytest.raises(ValueError, match=re.escape("spec.tuning.window: '5 minutes' is not a duration like 30s")):
        parse_duration("5 minutes", "spec.tuning.window")
    with pytest.raises(ValueError, match=re.escape("spec.tuning.cooldown: '1d' is not a duration")):
        TuningSpec.from_spec({"cooldown": "1d"})


# --------------------------------------------------------------------------- the typed spec


def _schema_default(*path: str):
    node = schema.model_service_spec()
    for key in path:
        node = node["properties"][key]
    return node["default"]


def test_defaults_are_the_crds():
    settings = ModelServiceSettings.from_spec({})
    t, r, a = settings.tuning, settings.rollout, settings.autoscaling
    assert t.enabled is _schema_default("tuning", "enabled") is False
    assert t.interval_s == parse_duration(_schema_default("tuning", "interval"))
    assert t.cooldown_s == parse_duration(_schema_default("tuning", "cooldown"))
    assert t.window_s == parse_duration(_schema_default("tuning", "window"))
    assert t.max_step_percent == _schema_default("tuning", "maxStepPercent")
    assert r.verification_window_s == parse_duration(_schema_default("rollout", "verificationWindow"))
    assert r.progress_deadline_s == parse_duration(_schema_default("rollout", "progressDeadline"))
    assert r.regression.ttft_p95_percent == _schema_default("rollout", "regression", "ttftP95Percent")
    assert r.regression.error_rate_percent == _schema_default("rollout", "regression", "errorRatePercent")
    assert r.fallback.policy == _schema_default("rollout", "fallback", "policy") == FallbackPolicy.LAST_KNOWN_GOOD
    assert r.fallback.after_s == parse_duration(_schema_default("rollout", "fallback", "after"))
    assert a.interval_s == parse_duration(_schema_default("autoscaling", "interval"))
    assert a.window_s == parse_duration(_schema_default("autoscaling", "window"))
    assert a.scale_down_stabilization_s == parse_duration(
        _schema_default("autoscaling", "scaleDown", "stabilizationWindow"))
    assert (a.min_replicas, a.max_replicas, a.kv_usage_target) == (
        _schema_default("autoscaling", "minReplicas"), None, _schema_default("autoscaling", "kvUsageTarget"))
    assert settings.reject_watermark == schema.SCHEDULER_DEFAULTS["kvCacheRejectWatermark"]


def test_a_partial_section_is_defaulted_and_a_null_counts_as_absent():
    r = RolloutSpec.from_spec({"regression": {"ttftP95Percent": 10}, "fallback": {"policy": "Conservative"}})
    assert (r.regression.ttft_p95_percent, r.regression.tpot_p95_percent) == (10, 25)
    assert (r.fallback.policy, r.fallback.budget_percent) == (FallbackPolicy.CONSERVATIVE, 50)
    assert TuningSpec.from_spec({"interval": None, "window": "1m"}).interval_s == 60.0
    a = AutoscalingSpec.from_spec({"enabled": True, "maxReplicas": 4, "scaleUp": {"stabilizationWindow": "30s"},
                                   "lanes": [{"lane": "chat", "queueDelayP95Ms": 500}]})
    assert (a.scale_up_stabilization_s, a.scale_down_stabilization_s) == (30.0, 300.0)
    assert a.lanes[0].queue_delay_p95_ms == 500 and a.lanes[0].slo_attainment_percent is None
    assert a.headroom_replicas is None  # no CRD default: the policy's own applies


def test_unknown_fallback_policy_is_a_value_error():
    with pytest.raises(ValueError, match="spec.rollout.fallback.policy: unknown policy 'Panic'"):
        RolloutSpec.from_spec({"fallback": {"policy": "Panic"}})
    with pytest.raises(ValueError, match=r"spec\.tuning: expected a mapping, got str"):
        TuningSpec.from_spec("fast")


def test_the_parsed_objects_carry_their_typed_spec_built_once():
    msvc = parse_model_service({"metadata": {"name": "m"}, "spec": {
        "model": {"path": "/m"},
        "tuning": {"enabled": True, "prometheusUrl": "http://p:9090", "window": "2m",
                   "bounds": {"maxBatchedTokens": {"min": 128}}},
        "tenants": [{"name": "a", "apiKeySha256": "0" * 64}]}})
    assert msvc.settings is msvc.settings
    assert msvc.settings.tuning.window_s == 120.0 and msvc.settings.tuning.prometheus_url == "http://p:9090"
    assert msvc.settings.tuning.bounds == {"maxBatchedTokens": KnobBounds(min=128)}
    assert msvc.settings.tenant_key_digests == ("0" * 64,)
    lane = parse_serving_lane({"metadata": {"name": "chat"}, "spec": {
        "modelServiceRef": {"name": "m"}, "slo": {"ttftP95Ms": 500},
        "tuning": {"enabled": False}}})
    assert lane.settings is lane.settings
    assert lane.settings == LaneSettings("interactive", 50, False, {}, lane.settings.slo)
    assert (lane.settings.slo.ttft_p95_ms, lane.settings.slo.tpot_p95_ms) == (500, None)


def test_timers_read_the_typed_spec():
    msvc = parse_model_service({"metadata": {"name": "m"}, "spec": {
        "model": {"path": "/m"},
        "tuning": {"cooldown": "90s", "maxStepPercent": 10},
        "rollout": {"fallback": {"policy": "StaticBatching", "budgetPercent": 40}},
        "autoscaling": {"enabled": True, "prometheusUrl": "http://p:9090", "maxReplicas": 3,
                        "targetUtilization": 0.6}}})
    settings = tuning.tuner_settings(msvc.settings)
    assert (settings.cooldown_s, settings.max_step_fraction) == (90.0, 0.1)
    assert tuning.settings_from_spec(msvc.spec) == settings  # the camelCase entry point reads the same
    policy = rollout.RolloutPolicy.from_spec(msvc.settings.rollout)
    assert policy == rollout.RolloutPolicy.from_spec(msvc.spec["rollout"])
    assert policy.fallback == rollout.FallbackProfile(continuous_batching=False, budget_scale=0.4)
    scaled = scaling.settings_from_spec(msvc.settings.autoscaling)
    assert scaled == scaling.settings_from_spec(msvc.spec)
    assert (scaled.policy.max_replicas, scaled.policy.target_utilization, scaled.policy.headroom_replicas) == (
        3, 0.6, autoscaler.AutoscalingPolicy(1, 1).headroom_replicas)


# --------------------------------------------------------------------------- enums


def test_enum_values_are_the_status_strings():
    assert [a.value for a in TunerAction] == ["hold", "adjust", "probe", "revert"]
    assert [v.value for v in Verdict] == ["kept", "reverted", "inconclusive"]
    assert [h.value for h in HoldReason] == ["VerifyingRevision", "RollingBack", "SettlingWindow",
                                             "PrometheusUnavailable", "InsufficientData"]
    assert [a.value for a in rollout.GuardAction] == ["none", "wait", "start", "promote", "rollback",
                                                      "hold_rolled_back", "fallback", "fail"]
    assert [p.value for p in rollout.Phase] == ["Verifying", "Stable", "RolledBack", "Fallback", "Failed"]
    assert [r.value for r in autoscaler.ScalingReason] == ["ScaledUp", "ScaledDown", "Holding", "MetricsUnavailable",
                                                              "ScaledFromZero", "ScaledToZero"]
    assert f"{HoldReason.SETTLING_WINDOW}" == "SettlingWindow" and rollout.ROLLBACK == "rollback"


def test_status_written_from_enums_holds_plain_strings():
    record = DecisionRecord(1.0, HOLD, "cooldown", judged=0.5, verdict=Verdict.KEPT)
    out = record.to_dict()
    assert json.dumps(out) == ('{"at": 1.0, "action": "hold", "reason": "cooldown", "judged": 0.5, '
                               '"verdict": "kept"}')
    assert type(out["action"]) is str and type(out["verdict"]) is str
    assert DecisionRecord.from_dict(out) == record
    state = rollout.RolloutState(rollout.ROLLED_BACK, "abc", 1.0, lkg="def")
    assert type(state.to_dict()["phase"]) is str
    assert rollout.RolloutState.from_dict(state.to_dict()) == state
    decision = autoscaler.ScalingDecision(3, autoscaler.UP, "busy", 3, ())
    status = scaling.autoscaling_status(None, 2, decision, scaling.reason_of(decision, None), "now")
    assert type(status["reason"]) is str
    yaml.safe_dump([out, state.to_dict(), status])  # a str subclass would not dump


def test_the_tuner_says_why_it_holds_for_want_of_data():
    lanes = [LaneTarget("chat", ttft_p95_ms=500)]
    settings = TunerSettings()
    down = tuner.decide(lanes, settings, EffectiveBudgets(), MetricSample.unavailable("refused", 60), [], 0.0)
    assert down.action == HOLD and down.held == HoldReason.PROMETHEUS_UNAVAILABLE
    thin = MetricSample(window_s=60.0, lanes={"chat": LaneMetrics(request_rate=0.01)})
    decision = tuner.decide(lanes, settings, EffectiveBudgets(), thin, [], 0.0)
    assert decision.held == HoldReason.INSUFFICIENT_DATA
    assert tuning._hold_category(decision, thin, verifying=False) == HoldReason.INSUFFICIENT_DATA
    # The category comes from the decision, not from words in its reason.
    worded = tuner.Decision(0.0, HOLD, EffectiveBudgets(), "all lanes fine; too few requests to probe")
    assert tuning._hold_category(worded, thin, verifying=False) is None


def test_a_window_that_may_not_be_used_says_which_hold():
    hold = tuning.no_decision_hold(rollout.ROLLBACK, rollout.STABLE, None, 100.0, 60.0, "abc")
    assert hold is not None and hold[0] == HoldReason.ROLLING_BACK
    assert tuning.no_decision_reason(rollout.ROLLBACK, rollout.STABLE, None, 100.0, 60.0, "abc") == hold[1]
    assert tuning.no_decision_hold(rollout.NONE, rollout.VERIFYING, None, 100.0, 60.0, "abc")[0] == \
        HoldReason.VERIFYING_REVISION
    assert tuning.no_decision_hold(rollout.NONE, rollout.STABLE, 90.0, 100.0, 60.0, "abc")[0] == \
        HoldReason.SETTLING_WINDOW
    assert tuning.no_decision_hold(rollout.NONE, rollout.STABLE, 30.0, 100.0, 60.0, "abc") is None
