"""Lane isolation on the simulated H200 (docs/benchmarks.md, section 6), on a shortened
`lanes-kv-flood`: the example lanes let the long-context flood push interactive TTFT up; a KV
reserve and the step-time budget hold the interactive SLO without starving the flood."""

from __future__ import annotations

from tokenlane.bench import report
from tokenlane.bench.scenarios import SCENARIOS
from tokenlane.bench.sim import simulate


def test_lanes_kv_flood_isolation_holds_the_interactive_slo():
    scenario = SCENARIOS["lanes-kv-flood"](duration_s=40.0)
    lanes = {}
    for phase in scenario.phases:
        lanes[phase.name] = report.summarize(simulate(phase.config, phase.traffic, phase.name, slos=phase.slos))["lanes"]
    isolated, default, equal = lanes["lanes-isolated"], lanes["lanes-default"], lanes["equal-lanes"]
    assert isolated["interactive"]["slo_attainment"] >= 0.99
    assert isolated["interactive"]["ttft_s"]["p99"] <= 0.250
    assert default["interactive"]["ttft_s"]["p99"] > 0.250  # without isolation the target is missed
    assert isolated["long-context"]["output_tokens_per_s"] >= 0.9 * equal["long-context"]["output_tokens_per_s"]
