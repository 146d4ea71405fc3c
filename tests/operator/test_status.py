"""Status helpers: condition transitions and only-changed patches."""

from __future__ import annotations

from tokenlane.operator.desired.status import condition, merge_conditions, status_patch


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


def test_quiet_conditions_keep_their_transition_message_while_status_and_reason_hold():
    """SLOMet's message carries live p95s: re-written every window it would be a status write
    per run. Kept while status and reason hold; a new reason or status brings the new message."""
    first = merge_conditions([], [condition("SLOMet", False, "TtftAboveTarget", "p95 2000ms")], 1, "t1")
    same = merge_conditions(first, [condition("SLOMet", False, "TtftAboveTarget", "p95 2100ms")], 1, "t2",
                            keep_message_of={"SLOMet"})
    assert same == first
    other_reason = merge_conditions(same, [condition("SLOMet", False, "TpotAboveTarget", "tpot 90ms")], 1, "t3",
                                    keep_message_of={"SLOMet"})
    assert other_reason[0]["message"] == "tpot 90ms" and other_reason[0]["lastTransitionTime"] == "t1"
    flipped = merge_conditions(other_reason, [condition("SLOMet", True, "WithinSLO", "p95 300ms")], 1, "t4",
                               keep_message_of={"SLOMet"})
    assert flipped[0]["message"] == "p95 300ms" and flipped[0]["lastTransitionTime"] == "t4"
    # Types not named keep the old behaviour: the message follows the update.
    ready = merge_conditions([], [condition("Ready", False, "PodsNotReady", "0/1")], 1, "t1")
    assert merge_conditions(ready, [condition("Ready", False, "PodsNotReady", "0/2")], 1, "t2",
                            keep_message_of={"SLOMet"})[0]["message"] == "0/2"
