"""Status helpers: condition transitions and only-changed patches."""

from __future__ import annotations

from tokenlane.operator.status import condition, merge_conditions, status_patch


def test_transition_time_changes_only_with_status():
    first = merge_conditions([], [condition("Ready", False, "PodsNotReady", "0/1")], 1, "t1")
    same = merge_conditions(first, [condition("Ready", False, "PodsNotReady", "0/2")], 2, "t2")
    assert same[0]["lastTransitionTime"] == "t1" and same[0]["message"] == "0/2" and same[0]["observedGeneration"] == 2
    flipped = merge_conditions(same, [condition("Ready", True, "Ready", "ok")], 2, "t3")
    assert flipped[0]["lastTransitionTime"] == "t3"


def test_other_writers_conditions_are_kept():
    current = [{"type": "SLOMet", "status": "True", "reason": "WithinTargets", "lastTransitionTime": "t0"}]
    merged = merge_conditions(current, [condition("Ready", True, "Ready", "ok")], 1, "t1")
    assert [c["type"] for c in merged] == ["Ready", "SLOMet"] and merged[1]["lastTransitionTime"] == "t0"


def test_status_patch():
    assert status_patch({"a": 1, "b": 2}, {"a": 1}) is None
    assert status_patch({"a": 1}, {"a": 2}) == {"a": 2}
    assert status_patch({"a": 1, "endpoint": "x"}, {"a": 1}, clear=("endpoint", "other")) == {"endpoint": None}
