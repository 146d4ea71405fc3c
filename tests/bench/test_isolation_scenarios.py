"""Lane isolation on the simulated H200 (docs/benchmarks.md, "KV memory in the simulator"), on a
shortened `lanes-kv-flood`: without isolation the long-context flood pushes interactive TTFT up;
the production config, which isolates by default (a KV reserve for the interactive lane and the
step-time budget), holds the interactive SLO without starving the flood."""

from __future__ import annotations

from pathlib import Path

import yaml

from tokenlane.bench import report
from tokenlane.bench.scenarios import SCENARIOS, production_config, unprotected_config
from tokenlane.bench.sim import simulate

SAMPLES = Path(__file__).resolve().parents[2] / "manifests" / "samples"


def test_lanes_kv_flood_isolation_holds_the_interactive_slo():
    scenario = SCENARIOS["lanes-kv-flood"](duration_s=40.0)
    lanes = {}
    for phase in scenario.phases:
        lanes[phase.name] = report.summarize(simulate(phase.config, phase.traffic, phase.name, slos=phase.slos))["lanes"]
    default, unprotected = lanes["lanes-default"], lanes["lanes-unprotected"]
    assert default["interactive"]["slo_attainment"] >= 0.99
    assert default["interactive"]["ttft_s"]["p99"] <= 0.250
    assert unprotected["interactive"]["ttft_s"]["p99"] > 0.250  # without isolation the target is missed
    assert (default["long-context"]["output_tokens_per_s"]
            >= 0.9 * unprotected["long-context"]["output_tokens_per_s"])


def test_the_production_config_isolates_interactive_lanes_and_the_unprotected_one_does_not():
    protected, unprotected = production_config(), unprotected_config()
    assert protected.scheduler.step_time_budget == "auto"
    assert protected.lane("interactive").kv_cache_reserved == 0.05
    assert unprotected.scheduler.step_time_budget == "off"
    assert all(not lane.kv_cache_reserved for lane in unprotected.lanes)
    # Everything else is the same config.
    assert [lane.name for lane in protected.lanes] == [lane.name for lane in unprotected.lanes]
    assert protected.lane_budgets("long-context").max_batched_tokens == unprotected.lane_budgets(
        "long-context").max_batched_tokens


def test_the_samples_isolate_their_interactive_lanes():
    for path in sorted(SAMPLES.glob("*.yaml")):
        docs = [d for d in yaml.safe_load_all(path.read_text()) if isinstance(d, dict)]
        lanes = [d for d in docs if d.get("kind") == "ServingLane" and d["spec"].get("class") == "interactive"]
        services = [d for d in docs if d.get("kind") == "ModelService"]
        if not lanes or len([d for d in docs if d.get("kind") == "ServingLane"]) < 2:
            continue  # a single lane has nobody to be isolated from
        for lane in lanes:
            assert lane["spec"]["budgets"].get("kvCacheReserved", 0) > 0, (path.name, lane["metadata"]["name"])
        for svc in services:
            assert svc["spec"]["scheduler"].get("stepTimeBudget") == "auto", path.name
