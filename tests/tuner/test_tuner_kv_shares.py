"""Table-driven tests of the tuner moving the lanes' KV shares (kvCacheReserved,
maxKvCacheShare; docs/tuning.md, "Lane isolation")."""

from __future__ import annotations

from dataclasses import replace

import pytest
from tuner_helpers import BATCH_BOUNDS, INTERACTIVE_BOUNDS, SETTINGS, budgets, lanes, sample

from tokenlane.operator.policy.tuner import decide
from tokenlane.operator.api.tuning_types import ADJUST, HOLD, PROBE, Bounds, EffectiveBudgets

NOW = 10_000.0


def kv_lanes(reserved=Bounds(0.0, 0.3), share=Bounds(0.3, 1.0)):
    """The tuner's two lanes with bounds declared for the KV shares (None: not declared)."""
    inter, batch = lanes()
    inter_bounds = {**INTERACTIVE_BOUNDS, **({"kvCacheReserved": reserved} if reserved else {})}
    batch_bounds = {**BATCH_BOUNDS, **({"maxKvCacheShare": share} if share else {})}
    return [replace(inter, bounds=inter_bounds), replace(batch, bounds=batch_bounds)]


def kv_budgets(inter_reserved=0.0, batch_share=1.0, **overrides) -> EffectiveBudgets:
    base = budgets(**overrides)
    lanes_ = {name: dict(values) for name, values in base.lanes.items()}
    for values in lanes_.values():
        values.setdefault("kvCacheReserved", 0.0)
        values.setdefault("maxKvCacheShare", 1.0)
    lanes_["interactive"]["kvCacheReserved"] = inter_reserved
    lanes_["batch"]["maxKvCacheShare"] = batch_share
    return EffectiveBudgets(lanes_, dict(base.global_))


def changes_of(decision) -> dict[str, tuple]:
    return {f"{c.scope}.{c.knob}": (c.old, c.new) for c in decision.changes}


# (id, lanes, sample, budgets, action, exact changes, reason fragment)
CASES = [
    (
        "ttft-miss-above-high-watermark-moves-the-kv-shares",
        kv_lanes(), sample(ttft_ms=900, queue_ms=600, kv=0.9), kv_budgets(),
        ADJUST,
        {"interactive.kvCacheReserved": (0.0, 0.01), "batch.maxKvCacheShare": (1.0, 0.75)},
        "above the high watermark",
    ),
    (
        "a-reserve-grows-additively-a-share-multiplicatively",
        kv_lanes(), sample(ttft_ms=900, queue_ms=600, kv=0.9), kv_budgets(inter_reserved=0.2, batch_share=0.5),
        ADJUST,
        # + 1/8 of the bounds range (0.0375, on the 0.01 grid), x 0.75 on the 0.01 grid
        {"interactive.kvCacheReserved": (0.2, 0.24), "batch.maxKvCacheShare": (0.5, 0.38)},
        "more kvCacheReserved for interactive",
    ),
    (
        "shares-at-their-bounds-fall-back-to-the-token-budgets",
        kv_lanes(), sample(ttft_ms=900, queue_ms=600, kv=0.9), kv_budgets(inter_reserved=0.3, batch_share=0.3),
        ADJUST,
        {"interactive.maxBatchedTokens": (2048, 2560), "interactive.maxActiveSequences": (32, 40),
         "batch.maxBatchedTokens": (8192, 6144), "batch.maxActiveSequences": (64, 48)},
        "queueing",
    ),
    (
        "a-donors-share-never-goes-below-its-own-reserve",
        kv_lanes(share=Bounds(0.1, 1.0)), sample(ttft_ms=900, queue_ms=600, kv=0.9),
        kv_budgets(inter_reserved=0.3, batch_share=0.4, batch__kvCacheReserved=0.4),
        ADJUST,
        {"interactive.maxBatchedTokens": (2048, 2560), "interactive.maxActiveSequences": (32, 40),
         "batch.maxBatchedTokens": (8192, 6144), "batch.maxActiveSequences": (64, 48)},
        "queueing",
    ),
    (
        "a-reserve-stays-within-the-lanes-own-share",
        kv_lanes(reserved=Bounds(0.0, 0.5), share=None), sample(ttft_ms=900, queue_ms=600, kv=0.9),
        kv_budgets(inter_reserved=0.2, interactive__maxKvCacheShare=0.2),
        ADJUST,
        {"interactive.maxBatchedTokens": (2048, 2560), "interactive.maxActiveSequences": (32, 40),
         "batch.maxBatchedTokens": (8192, 6144), "batch.maxActiveSequences": (64, 48)},
        "queueing",
    ),
    (
        "ttft-miss-below-the-high-watermark-leaves-the-shares",
        kv_lanes(), sample(ttft_ms=900, queue_ms=600, kv=0.6), kv_budgets(),
        ADJUST,
        {"interactive.maxBatchedTokens": (2048, 2560), "interactive.maxActiveSequences": (32, 40),
         "batch.maxBatchedTokens": (8192, 6144), "batch.maxActiveSequences": (64, 48)},
        "queueing",
    ),
    (
        "undeclared-bounds-never-move-the-shares",
        kv_lanes(reserved=None, share=None), sample(ttft_ms=900, queue_ms=600, kv=0.9), kv_budgets(),
        ADJUST,
        {"interactive.maxBatchedTokens": (2048, 2560), "interactive.maxActiveSequences": (32, 40),
         "batch.maxBatchedTokens": (8192, 6144), "batch.maxActiveSequences": (64, 48)},
        "queueing",
    ),
    (
        "healthy-and-below-the-watermark-relaxes-the-reserve",
        kv_lanes(), sample(ttft_ms=200, tpot_ms=20, kv=0.5), kv_budgets(inter_reserved=0.2, batch_share=0.5),
        PROBE,
        {"interactive.kvCacheReserved": (0.2, 0.15)},
        "relaxing KV shares",
    ),
    (
        "healthy-with-batch-backlog-gives-its-share-back",
        kv_lanes(), sample(ttft_ms=200, tpot_ms=20, kv=0.5, batch_waiting=5),
        kv_budgets(batch_share=0.5, batch__maxBatchedTokens=8192, batch__maxActiveSequences=128),
        PROBE,
        {"batch.maxKvCacheShare": (0.5, 0.59)},
        "maxKvCacheShare",
    ),
    (
        "healthy-above-the-watermark-keeps-the-reserve",
        kv_lanes(), sample(ttft_ms=200, tpot_ms=20, kv=0.9), kv_budgets(inter_reserved=0.2),
        HOLD,
        {},
        "no queued work",
    ),
]


@pytest.mark.parametrize("lanes_, sample_, budgets_, action, changes, reason", [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_kv_share_decisions(lanes_, sample_, budgets_, action, changes, reason):
    decision = decide(lanes_, SETTINGS, budgets_, sample_, [], NOW)
    assert decision.action == action, decision.reason
    assert changes_of(decision) == changes, decision.reason
    assert reason in decision.reason
    for name, values in decision.budgets.lanes.items():  # the runtime's cross-field rules hold
        assert values["kvCacheReserved"] <= values["maxKvCacheShare"], name
    assert sum(v["kvCacheReserved"] for v in decision.budgets.lanes.values()) < 1.0
