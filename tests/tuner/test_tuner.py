"""Table-driven tests of the tuner's decision function (operator/policy/tuner.py)."""

from __future__ import annotations

import pytest
from tuner_helpers import SETTINGS, budgets, lanes, sample

from tokenlane.operator.policy.tuner import decide
from tokenlane.operator.api.tuning_types import (
    ADJUST,
    HOLD,
    PROBE,
    REVERT,
    DecisionRecord,
    EffectiveBudgets,
    LaneMetrics,
    MetricSample,
)

NOW = 10_000.0


def changes_of(decision) -> dict[str, tuple]:
    return {f"{c.scope}.{c.knob}": (c.old, c.new) for c in decision.changes}


# (id, sample, budgets, expected action, expected changes (subset), reason fragment)
CASES = [
    (
        "ttft-miss-queueing-takes-from-batch",
        sample(ttft_ms=900, queue_ms=600),
        budgets(),
        ADJUST,
        {
            # additive: + 1/8 of the range, at most +25% of the value per step
            "interactive.maxBatchedTokens": (2048, 2560),
            "interactive.maxActiveSequences": (32, 40),
            "batch.maxBatchedTokens": (8192, 6144),  # multiplicative: x 0.75
            "batch.maxActiveSequences": (64, 48),
        },
        "queueing",
    ),
    (
        "ttft-miss-prefill-bound-grows-chunk",
        sample(ttft_ms=900, queue_ms=100),
        budgets(),
        ADJUST,
        {"interactive.prefillChunkSize": (512, 640), "batch.prefillChunkSize": (2048, 1536)},
        "prefill",
    ),
    (
        "tpot-miss-shrinks-the-batch-lanes-step-share",
        sample(ttft_ms=300, tpot_ms=90, kv=0.3),
        budgets(),
        ADJUST,
        {"batch.maxBatchedTokens": (8192, 6144), "batch.prefillChunkSize": (2048, 1536)},
        "stall decodes",
    ),
    (
        "tpot-miss-with-busy-kv-also-shrinks-batch-running-set",
        sample(ttft_ms=300, tpot_ms=90, kv=0.6),
        budgets(batch__prefillChunkSize=256),
        ADJUST,
        {"batch.maxBatchedTokens": (8192, 6144), "batch.maxActiveSequences": (64, 48)},
        "stall decodes",
    ),
    (
        "kv-pressure-with-preemptions-cuts-batch-sequences",
        sample(kv=0.93, preemptions=0.5),
        budgets(),
        ADJUST,
        {"batch.maxActiveSequences": (64, 48)},
        "KV usage 0.93",
    ),
    (
        "kv-pressure-all-sequences-at-min-lowers-watermark",
        sample(kv=0.93, preemptions=0.5),
        budgets(batch__maxActiveSequences=4, interactive__maxActiveSequences=8),
        ADJUST,
        {"global.kvCacheHighWatermark": (0.88, 0.86)},
        "lower high watermark",
    ),
    (
        "kv-high-without-preemptions-is-fine",
        sample(kv=0.93, preemptions=0.0),
        budgets(),
        HOLD,
        {},
        "",
    ),
    (
        "inside-hysteresis-band-holds",
        sample(ttft_ms=450, tpot_ms=50),  # 0.9 x target: neither miss nor slack
        budgets(),
        HOLD,
        {},
        "hysteresis",
    ),
    (
        "headroom-and-backlog-probes-batch-up",
        sample(ttft_ms=200, tpot_ms=20, batch_waiting=30),
        budgets(batch__maxBatchedTokens=4096),
        PROBE,
        {"batch.maxBatchedTokens": (4096, 5056)},
        "probing",
    ),
    (
        "headroom-without-backlog-holds",
        sample(ttft_ms=200, tpot_ms=20, batch_waiting=0),
        budgets(batch__maxBatchedTokens=4096),
        HOLD,
        {},
        "no queued work",
    ),
    (
        "miss-with-everything-at-bounds-holds-and-says-so",
        sample(ttft_ms=900, queue_ms=600),
        budgets(interactive__maxBatchedTokens=8192, interactive__maxActiveSequences=128,
                batch__maxBatchedTokens=512, batch__maxActiveSequences=4, batch__prefillChunkSize=256),
        HOLD,
        {},
        "no knob can move",
    ),
    (
        "thin-data-holds",
        sample(ttft_ms=5000, rate=0.1),
        budgets(),
        HOLD,
        {},
        "too few requests",
    ),
    (
        "prometheus-unavailable-holds",
        MetricSample.unavailable("cannot reach http://prom:9090: ConnectError", 60),
        budgets(),
        HOLD,
        {},
        "Prometheus unavailable",
    ),
]


@pytest.mark.parametrize("name,sample_,budgets_,action,expected,fragment", CASES, ids=[c[0] for c in CASES])
def test_decision_table(name, sample_, budgets_, action, expected, fragment):
    decision = decide(lanes(), SETTINGS, budgets_, sample_, [], NOW)
    assert decision.action == action, decision.reason
    got = changes_of(decision)
    for key, value in expected.items():
        assert got.get(key) == value, (key, got)
    if action == HOLD:
        assert not decision.changes and decision.budgets == budgets_
    assert fragment in decision.reason
    # The new budgets are exactly the old ones with the listed changes applied.
    for change in decision.changes:
        assert decision.budgets.get(change.scope, change.knob) == change.new


def test_slo_conditions_per_lane():
    decision = decide(lanes(), SETTINGS, budgets(), sample(ttft_ms=900, queue_ms=600), [], NOW)
    assert decision.slo["interactive"].met is False
    assert decision.slo["interactive"].reason == "TtftAboveTarget"
    assert "TTFT p95 900ms > 500ms" in decision.slo["interactive"].message
    assert decision.slo["batch"].met is None and decision.slo["batch"].reason == "NoSLO"
    ok = decide(lanes(), SETTINGS, budgets(), sample(ttft_ms=300), [], NOW)
    assert ok.slo["interactive"].met is True
    thin = decide(lanes(), SETTINGS, budgets(), sample(rate=0.1), [], NOW)
    assert thin.slo["interactive"].met is None and thin.slo["interactive"].reason == "InsufficientData"
    down = decide(lanes(), SETTINGS, budgets(), MetricSample.unavailable("timed out", 60), [], NOW)
    assert down.slo["interactive"].reason == "PrometheusUnavailable"


def test_donor_inside_its_band_is_not_used():
    """A lane with an SLO that is met but without slack does not give budget away."""
    long_ok_no_slack = LaneMetrics(2.0, 7.0, 0.100, 3.0)  # 0.875 x its TTFT target
    decision = decide(
        lanes(with_long=True), SETTINGS, budgets(),
        sample(ttft_ms=300, tpot_ms=90, long=long_ok_no_slack), [], NOW,
    )
    assert decision.action == ADJUST
    assert "long-context.prefillChunkSize" not in changes_of(decision)
    assert "batch.prefillChunkSize" in changes_of(decision)


def test_cooldown_holds_after_a_change():
    first = decide(lanes(), SETTINGS, budgets(), sample(ttft_ms=900, queue_ms=600), [], NOW)
    history = [first.record()]
    # Still within the window after the change: the change is being evaluated.
    again = decide(lanes(), SETTINGS, first.budgets, sample(ttft_ms=900, queue_ms=600), history, NOW + 30)
    assert again.action == HOLD and "evaluating" in again.reason
    assert again.budgets == first.budgets


def test_change_that_helped_is_kept_and_next_step_follows():
    first = decide(lanes(), SETTINGS, budgets(), sample(ttft_ms=900, queue_ms=600), [], NOW)
    second = decide(lanes(), SETTINGS, first.budgets, sample(ttft_ms=700, queue_ms=400), [first.record()], NOW + 60)
    assert second.judged == first.at and second.verdict == "kept"
    assert second.action == ADJUST and "kept" in second.reason
    # Additive increase again, on top of the first step.
    assert changes_of(second)["interactive.maxBatchedTokens"] == (2560, 3200)


def test_change_that_made_things_worse_is_reverted_and_blocked():
    first = decide(lanes(), SETTINGS, budgets(), sample(ttft_ms=900, queue_ms=600), [], NOW)
    worse = sample(ttft_ms=1500, queue_ms=1200)
    revert = decide(lanes(), SETTINGS, first.budgets, worse, [first.record()], NOW + 60)
    assert revert.action == REVERT and revert.verdict == "reverted"
    assert revert.budgets == budgets()  # exactly the values before the change
    assert "SLO violation rose" in revert.reason
    history = [first.record(), revert.record()]
    # After the cooldown the same move (more for interactive, less for batch) stays blocked.
    later = decide(lanes(), SETTINGS, revert.budgets, worse, history, NOW + 200)
    moved = changes_of(later)
    assert "interactive.maxBatchedTokens" not in moved and "batch.maxBatchedTokens" not in moved
    # Long after, the block expires (4 cooldowns) and the tuner may try again.
    much_later = decide(lanes(), SETTINGS, revert.budgets, worse, history, NOW + 60 + 4 * 60 + 1)
    assert "interactive.maxBatchedTokens" in changes_of(much_later)


def test_probe_that_costs_throughput_is_reverted():
    base = sample(ttft_ms=200, tpot_ms=20, batch_waiting=30, throughput=1000)
    probe = decide(lanes(), SETTINGS, budgets(batch__maxBatchedTokens=4096), base, [], NOW)
    assert probe.action == PROBE
    after = sample(ttft_ms=200, tpot_ms=20, batch_waiting=30, throughput=800)
    verdict = decide(lanes(), SETTINGS, probe.budgets, after, [probe.record()], NOW + 60)
    assert verdict.action == REVERT and "throughput fell" in verdict.reason
    assert verdict.budgets.get("batch", "maxBatchedTokens") == 4096


def test_load_change_makes_the_comparison_inconclusive():
    first = decide(lanes(), SETTINGS, budgets(), sample(ttft_ms=900, queue_ms=600), [], NOW)
    doubled_load = sample(ttft_ms=2000, queue_ms=1500, rate=12.0, batch_rate=5.0)
    second = decide(lanes(), SETTINGS, first.budgets, doubled_load, [first.record()], NOW + 60)
    assert second.verdict == "inconclusive" and second.action != REVERT


def test_records_round_trip_through_status_json():
    import json

    first = decide(lanes(), SETTINGS, budgets(), sample(ttft_ms=900, queue_ms=600), [], NOW)
    record = first.record()
    again = DecisionRecord.from_dict(json.loads(json.dumps(record.to_dict())))
    assert again == record
    assert EffectiveBudgets.from_dict(json.loads(json.dumps(first.budgets.to_dict()))) == first.budgets


def test_knob_without_bounds_is_never_touched():
    from dataclasses import replace

    no_bounds = [replace(lane, bounds={}) for lane in lanes()]
    decision = decide(no_bounds, SETTINGS, budgets(), sample(ttft_ms=900, queue_ms=600), [], NOW)
    assert decision.action == HOLD and not decision.changes


def test_shrinking_batched_tokens_takes_the_prefill_chunk_along():
    # The batch lane's chunk (4096) must stay <= its batched tokens after a decrease.
    b = budgets(batch__prefillChunkSize=4096, batch__maxBatchedTokens=4096)
    decision = decide(lanes(), SETTINGS, b, sample(ttft_ms=900, queue_ms=600), [], NOW)
    got = changes_of(decision)
    assert got["batch.maxBatchedTokens"] == (4096, 3072)
    assert got["batch.prefillChunkSize"] == (4096, 3072)
