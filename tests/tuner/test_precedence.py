"""A user's edit of a knob wins over the tuner's override of it (operator/desired/precedence.py)."""

from __future__ import annotations

import pytest

from tokenlane.operator.desired import precedence
from tokenlane.operator.api.tuning_types import EffectiveBudgets

# The tuner learned interactive.maxActiveSequences 12 and batch.maxBatchedTokens 384 against a
# spec of 8 and 512, and kvCacheHighWatermark 0.86 against 0.9; the fallback's key has no learnedFrom.
OVERRIDES = {
    "lanes": {"interactive": {"maxActiveSequences": 12}, "batch": {"maxBatchedTokens": 384}},
    "scheduler": {"kvCacheHighWatermark": 0.86, "maxBatchedTokens": 256},
    "engine": {"continuousBatching": False},
    "learnedFrom": {"lanes": {"interactive": {"maxActiveSequences": 8}, "batch": {"maxBatchedTokens": 512}},
                    "scheduler": {"kvCacheHighWatermark": 0.9}},
}


def spec(interactive_seqs=8, batch_tokens=512, batch_seqs=4, watermark=0.9, global_tokens=512) -> EffectiveBudgets:
    return EffectiveBudgets(
        {"interactive": {"maxActiveSequences": interactive_seqs, "maxBatchedTokens": 512},
         "batch": {"maxActiveSequences": batch_seqs, "maxBatchedTokens": batch_tokens}},
        {"kvCacheHighWatermark": watermark, "maxBatchedTokens": global_tokens})


@pytest.mark.parametrize("edited, dropped", [
    ({}, []),  # spec unchanged: every override kept
    ({"interactive_seqs": 1}, [("interactive", "maxActiveSequences")]),  # that knob's override goes
    ({"batch_seqs": 2}, []),  # a knob without an override: the others stay
    ({"batch_tokens": 1024}, [("batch", "maxBatchedTokens")]),
    ({"watermark": 0.8}, [("global", "kvCacheHighWatermark")]),
    ({"global_tokens": 1024}, []),  # the fallback's key is not the tuner's: it ends with the revision
    ({"interactive_seqs": 1, "batch_tokens": 1024},
     [("batch", "maxBatchedTokens"), ("interactive", "maxActiveSequences")]),
])
def test_an_edited_knob_drops_its_override_only(edited, dropped):
    found = precedence.stale_overrides(OVERRIDES, spec(**edited))
    assert [(d.scope, d.knob) for d in found] == dropped
    kept = precedence.in_force(OVERRIDES, spec(**edited))
    for scope, knob in dropped:
        section = kept.get("scheduler", {}) if scope == "global" else kept.get("lanes", {}).get(scope, {})
        assert knob not in section
    remaining = [(lane, k) for lane, knobs in kept.get("lanes", {}).items() for k in knobs]
    expected = [(lane, k) for lane, knobs in OVERRIDES["lanes"].items() for k in knobs if (lane, k) not in dropped]
    assert sorted(remaining) == sorted(expected)
    assert kept["engine"] == {"continuousBatching": False}


def test_dropped_override_says_what_changed():
    [found] = precedence.stale_overrides(OVERRIDES, spec(interactive_seqs=1))
    assert str(found) == "interactive.maxActiveSequences: spec changed 8->1, tuner override 12 dropped"


def test_learned_from_keeps_the_value_an_override_was_learned_against():
    current = precedence.with_learned_from({"lanes": {"batch": {"maxBatchedTokens": 384}}}, spec())
    assert current["learnedFrom"] == {"lanes": {"batch": {"maxBatchedTokens": 512}}}
    # A later step of the same knob was learned against the same spec value, not its own last one.
    later = precedence.with_learned_from({**current, "lanes": {"batch": {"maxBatchedTokens": 256}}}, spec())
    assert later["learnedFrom"] == {"lanes": {"batch": {"maxBatchedTokens": 512}}}
    # The last override gone: nothing left, learnedFrom included.
    assert precedence.in_force(current, spec(batch_tokens=1024)) == {}


def test_sources_per_knob():
    values = {"maxActiveSequences": 12, "maxBatchedTokens": 256}
    assert precedence.lane_sources(OVERRIDES, "interactive", values) == {
        "maxActiveSequences": {"value": 12, "source": "tuner"},
        "maxBatchedTokens": {"value": 256, "source": "fallback"},
    }
    assert precedence.lane_sources({}, "interactive", values)["maxActiveSequences"]["source"] == "spec"
