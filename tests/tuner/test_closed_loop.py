"""The tuner driving the real engine (simulated H200 + Llama-3-8B executor, virtual clock).

Traffic: steady interactive chat (4 req/s, 200-1200 token prompts), light batch traffic, and
from t=60 s a flood of 8k-16k token prompts in the batch lane. The batch lane starts with the
whole step to itself (no caps); the interactive lane misses its TTFT and TPOT SLO during the
flood. With the tuner running every 15 s (virtual), the interactive lane is back inside its
SLO over the last 40% of the run, and the batch lane still finishes as much work.
"""

from __future__ import annotations

import pytest
from sim_loop import OK_STATUSES, flood_traffic, run
from tuner_helpers import lane_targets

from tokenlane.operator.api.tuning_types import Bounds, TunerSettings
from tokenlane.runtime.config import loads_config

CONFIG = """
model: {path: /models/sim, servedName: sim, maxModelLen: 32768}
engine: {executor: simulated}
scheduler: {maxActiveSequences: 256, maxBatchedTokens: 8192, prefillChunkSize: 4096,
            maxWaitingRequests: 4096, queueTimeoutMs: 600000}
lanes:
  - {name: interactive, class: interactive, priority: 100, weight: 4, default: true,
     slo: {ttftP95Ms: 500, tpotP95Ms: 60}}
  - {name: batch, class: batch, priority: 10, weight: 1}
"""
BOUNDS = {
    "interactive": {"maxBatchedTokens": Bounds(1024, 8192), "maxActiveSequences": Bounds(16, 256),
                    "prefillChunkSize": Bounds(256, 4096)},
    "batch": {"maxBatchedTokens": Bounds(512, 8192), "maxActiveSequences": Bounds(4, 256),
              "prefillChunkSize": Bounds(256, 4096)},
}
SETTINGS = TunerSettings(cooldown_s=15, window_s=15, min_requests=20,
                         global_bounds={"kvCacheHighWatermark": Bounds(0.7, 0.9)})
END_S = 600.0


@pytest.fixture(scope="module")
def runs():
    config = loads_config(CONFIG)
    lanes = lane_targets(config, BOUNDS)
    traffic = flood_traffic(seconds=END_S, interactive_rps=4, flood_start_s=60, flood_rps=2,
                            flood_prompt_tokens=16000)
    untuned = run(config, traffic, lanes, SETTINGS, tune=False, interval_s=15, end_s=END_S)
    tuned = run(config, traffic, lanes, SETTINGS, tune=True, interval_s=15, end_s=END_S)
    return untuned, tuned


def test_flood_breaks_the_interactive_slo_without_tuning(runs):
    untuned, _ = runs
    assert untuned.lane_p95_ms("interactive", 0, 60) < 100  # before the flood: fine
    assert untuned.lane_p95_ms("interactive", 0.6 * END_S, END_S) > 500
    assert untuned.lane_p95_ms("interactive", 0.6 * END_S, END_S, "tpot") > 60


def test_tuner_brings_the_interactive_lane_back_inside_its_slo(runs):
    untuned, tuned = runs
    window = (0.6 * END_S, END_S)
    before = (untuned.lane_p95_ms("interactive", *window), untuned.lane_p95_ms("interactive", *window, "tpot"))
    after = (tuned.lane_p95_ms("interactive", *window), tuned.lane_p95_ms("interactive", *window, "tpot"))
    print(f"\ninteractive p95 over the last 40% (TTFT ms, TPOT ms): untuned {before[0]:.0f}, {before[1]:.1f}; "
          f"tuned {after[0]:.0f}, {after[1]:.1f}; {tuned.reloads} hot reloads")
    assert after[0] <= 500, after
    assert after[1] <= 60, after
    # Budget went from batch to interactive, inside the bounds; the batch lane kept working.
    final = tuned.intervals[-1].budgets
    assert final.lanes["batch"]["maxBatchedTokens"] < 8192
    for lane, knobs in BOUNDS.items():
        for knob, b in knobs.items():
            assert b.min <= final.lanes[lane][knob] <= b.max
    done = lambda r: sum(1 for q in r.finished if q.lane == "batch" and q.status in OK_STATUSES)  # noqa: E731
    assert done(tuned) >= 0.95 * done(untuned)


def test_every_change_was_a_single_step_per_knob_and_explained(runs):
    _, tuned = runs
    last_change = {}
    for interval in tuned.intervals:
        d = interval.decision
        assert d is not None and d.reason
        for change in d.changes:
            key = (change.scope, change.knob)
            # One step per interval per knob, and never two changes within the cooldown.
            assert interval.end_s - last_change.get(key, -1e9) >= SETTINGS.cooldown_s
            last_change[key] = interval.end_s
            assert abs(change.new - change.old) <= max(16, 0.25 * change.old) + 1e-9 or d.action == "revert"
