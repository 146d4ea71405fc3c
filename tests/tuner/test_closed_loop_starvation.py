"""Shared-queue starvation in a closed loop: the real engine on the simulated executor
(virtual clock), the tuner every 15 s.

The global waiting queue holds 64 requests. From t=30 s a batch flood (10 req/s; the batch
lane runs at most 4 sequences) fills it, and every interactive request that arrives while it
is full gets 429 queue_full: the interactive lane's latency stays fine, its availability does
not. The tuner lowers the batch lane's maxWaitingRequests (bounds 8..64) and the interactive
lane's refused share goes back under its maxRefusedShare (1%).
"""

from __future__ import annotations

import pytest
from sim_loop import flood_traffic, refused_share, run

from tokenlane.operator.api.tuning_types import Bounds, TunerSettings
from tokenlane.bench.tuned_sim import lane_targets
from tokenlane.runtime.config import DEFAULT_MAX_REFUSED_SHARE, loads_config

CONFIG = """
model: {path: /models/sim, servedName: sim, maxModelLen: 32768}
engine: {executor: simulated}
scheduler: {maxActiveSequences: 256, maxBatchedTokens: 8192, prefillChunkSize: 4096,
            maxWaitingRequests: 64, queueTimeoutMs: 600000}
lanes:
  - {name: interactive, class: interactive, priority: 100, weight: 4, default: true,
     slo: {ttftP95Ms: 500, tpotP95Ms: 60}}
  - {name: batch, class: batch, priority: 10, weight: 1, maxActiveSequences: 4}
"""
BOUNDS = {"batch": {"maxWaitingRequests": Bounds(8, 64)}}
SETTINGS = TunerSettings(cooldown_s=15, window_s=15, min_requests=20)
END_S = 150.0
LAST = (0.6 * END_S, END_S)  # the last 40% of the run


@pytest.fixture(scope="module")
def runs():
    config = loads_config(CONFIG)
    lanes = lane_targets(config, BOUNDS)
    traffic = flood_traffic(seconds=END_S, interactive_rps=4, flood_start_s=30, flood_rps=10,
                            flood_prompt_tokens=2000)
    untuned = run(config, traffic, lanes, SETTINGS, tune=False, interval_s=15, end_s=END_S)
    tuned = run(config, traffic, lanes, SETTINGS, tune=True, interval_s=15, end_s=END_S)
    return untuned, tuned


def test_batch_flood_starves_interactive_of_queue_slots_without_tuning(runs):
    untuned, _ = runs
    assert refused_share(untuned, "interactive", 0, 30) == 0.0  # before the flood
    refused = [r for r in untuned.finished if r.lane == "interactive" and r.finish_time >= LAST[0]
               and r.finish_detail == "queue_full"]
    assert refused_share(untuned, "interactive", *LAST) > 0.05 and refused
    # Its latency is fine: only the refused share shows the starvation.
    assert untuned.lane_p95_ms("interactive", *LAST) < 500


def test_tuner_lowers_the_batch_waiting_cap_and_interactive_is_served_again(runs):
    untuned, tuned = runs
    before, after = refused_share(untuned, "interactive", *LAST), refused_share(tuned, "interactive", *LAST)
    print(f"\ninteractive refused share over the last 40%: untuned {before:.1%}, tuned {after:.1%}")
    assert after <= DEFAULT_MAX_REFUSED_SHARE
    moves = [(c.knob, c.scope, c.old, c.new) for iv in tuned.intervals if iv.decision for c in iv.decision.changes]
    assert moves and all(knob == "maxWaitingRequests" and scope == "batch" and new < old
                         for knob, scope, old, new in moves), moves
    final = tuned.intervals[-1].budgets.get("batch", "maxWaitingRequests")
    assert 8 <= final < 64
    first = next(iv.decision for iv in tuned.intervals if iv.decision and iv.decision.changes)
    assert "queue_full: batch holds" in first.reason and first.slo["interactive"].reason == "RefusedShareAboveTarget"
