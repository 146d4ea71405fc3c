"""`tokenlane plan`: traffic inputs, the trace's name in the description, and the plan itself
on the packaged Azure trace against the sample ModelService (simulated H200 + Llama-3-8B)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tokenlane.cli import main as tokenlane
from tokenlane.operator.api.tuning_types import LANE_KNOBS, EffectiveBudgets
from tokenlane.bench import plan, report
from tokenlane.bench.trace import TRACE_NAME, TrafficSpec, build_requests

REPO = Path(__file__).resolve().parents[2]
SAMPLE = REPO / "manifests" / "samples" / "llama3-8b.yaml"
AZURE_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"


def _azure_csv(path: Path, rows: int = 6) -> Path:
    lines = [f"2023-11-16 18:15:{10 + i:02d}.5,{100 + i},{10 + i}" for i in range(rows)]
    path.write_text(AZURE_HEADER + "\n".join(lines) + "\n")
    return path


def test_a_trace_given_by_path_is_described_by_its_own_name(tmp_path):
    mine = _azure_csv(tmp_path / "checkout-service.csv")
    traffic = build_requests(TrafficSpec(source="trace", trace_path=str(mine), duration_s=60))
    assert traffic.describe().startswith("trace checkout-service: 6 of 6 requests")
    assert TRACE_NAME not in traffic.describe()
    packaged = build_requests(TrafficSpec(source="trace", duration_s=10))
    assert packaged.describe().startswith(f"trace {TRACE_NAME}:")


def test_plan_reads_a_csv_trace_by_its_own_name_too(tmp_path):
    traffic = plan.read_traffic(str(_azure_csv(tmp_path / "checkout-service.csv")), time_scale=2)
    assert traffic.describe().startswith("trace checkout-service: 6 of 6 requests")
    assert [r.arrival_s for r in traffic.requests] == pytest.approx([0, 0.5, 1, 1.5, 2, 2.5])


def test_jsonl_traffic_keeps_lanes_tenants_and_lengths(tmp_path):
    path = tmp_path / "traffic.jsonl"
    path.write_text(
        '{"arrival_s": 1.0, "prompt_tokens": 900, "output_tokens": 40, "lane": "batch", "tenant": "search"}\n'
        '\n'
        '{"arrival_s": 0.25, "prompt_tokens": 12, "output_tokens": 3}\n'
    )
    traffic = plan.read_traffic(str(path), start_s=0.25)
    first, second = traffic.requests
    assert (first.index, first.arrival_s, first.lane, first.tenant, first.prompt_tokens, first.max_tokens) == (
        0, 0.0, None, "default", 12, 3)
    assert (second.arrival_s, second.lane, second.tenant, second.prompt_tokens, second.max_tokens) == (
        0.75, "batch", "search", 900, 40)
    assert traffic.describe().startswith("trace traffic: 2 of 2 requests")


def test_unreadable_traffic_names_the_line(tmp_path):
    path = tmp_path / "traffic.jsonl"
    path.write_text('{"arrival_s": 0, "prompt_tokens": 5, "output_tokens": 1}\n{"arrival_s": 1}\n')
    with pytest.raises(plan.PlanInputError, match="line 2"):
        plan.read_traffic(str(path))
    with pytest.raises(plan.PlanInputError, match="no such traffic file"):
        plan.read_traffic(str(tmp_path / "nope.jsonl"))
    with pytest.raises(plan.PlanInputError, match="holds no request"):
        plan.read_traffic(str(_azure_csv(tmp_path / "t.csv")), start_s=100, duration_s=5)


def test_a_bench_result_replays_what_was_asked(tmp_path):
    records = [
        report.RequestRecord(index=0, lane="interactive", tenant="a", arrival_s=0.5, prompt_tokens=100, max_tokens=64,
                             output_tokens=64),
        # Refused: still offered load, at its requested length.
        report.RequestRecord(index=1, lane="batch", tenant="b", arrival_s=1.5, prompt_tokens=300, max_tokens=128,
                             output_tokens=0, outcome=report.REJECTED, stream=False),
    ]
    path = tmp_path / "bench-run.json"
    report.write_json(path, [report.RunResult("run", records, duration_s=2.0)])
    traffic = plan.read_traffic(str(path))
    assert [(r.arrival_s, r.lane, r.tenant, r.max_tokens, r.stream) for r in traffic.requests] == [
        (0.5, "interactive", "a", 64, True), (1.5, "batch", "b", 128, False)]
    with pytest.raises(plan.PlanInputError, match="no phase 'other'"):
        plan.read_traffic(str(path), phase="other")


def test_replica_share_is_an_even_split():
    traffic = plan.read_traffic(TRACE_NAME, duration_s=20)
    share = plan.replica_share(traffic.requests, 3, rate=2.0)
    assert len(share) == len(traffic.requests[::3])
    assert [r.arrival_s for r in share] == pytest.approx([r.arrival_s / 2 for r in traffic.requests[::3]])
    assert [r.index for r in share] == list(range(len(share)))


@pytest.fixture(scope="module")
def sample_plan(tmp_path_factory):
    """The packaged trace, shortened to its first minute and sped up 8x (25 req/s), on one
    replica of the sample ModelService: the interactive lane misses its TTFT target."""
    out = tmp_path_factory.mktemp("plan")
    status = tokenlane(["plan", "--traffic", TRACE_NAME, "--duration", "60", "--time-scale", "8",
                        "-f", str(SAMPLE), "--replicas", "1", "--passes", "3", "--interval", "2.5",
                        "--max-replicas", "3", "--out", str(out)])
    assert status == 0
    return out, json.loads((out / "plan.json").read_text())


def test_plan_improves_lane_goodput_over_the_input_config(sample_plan):
    _, doc = sample_plan
    (shared,) = doc["pools"]  # the long-context lane's dedicated pool gets no request in this minute
    assert shared["pool"] == "shared"
    gain = shared["goodput_rps"]["gain"]
    print(f"\nplan on {TRACE_NAME} [0, 60) s x8, one replica: SLO goodput "
          f"{shared['goodput_rps']['before']:.2f} -> {shared['goodput_rps']['after']:.2f} req/s ({gain:+.1%})")
    assert shared["accepted"]
    assert gain > 0
    before, after = shared["before"]["lanes"]["interactive"], shared["after"]["lanes"]["interactive"]
    assert after["goodput_rps"] > before["goodput_rps"]
    assert after["slo_attainment"] > before["slo_attainment"]
    # One replica misses the interactive SLO at this rate; the sweep finds how many meet it.
    needed = shared["replicas_needed"]
    assert set(needed) == {"x1", "x2"}
    assert 1 < needed["x1"]["interactive"] <= needed["x2"]["interactive"] <= 3


def test_the_patch_holds_only_the_knobs_the_tuner_moved(sample_plan):
    out, doc = sample_plan
    docs = [d for d in yaml.safe_load_all((out / "patch.yaml").read_text()) if d]
    assert docs == doc["patch"] and docs
    sample = {d["metadata"]["name"]: d for d in yaml.safe_load_all(SAMPLE.read_text()) if d}
    changed = {(c["lane"], c["knob"]): c["to"] for c in doc["pools"][0]["changes"]}
    lane_of = {name: d["spec"]["laneName"] for name, d in sample.items() if d["kind"] == "ServingLane"}
    for patch in docs:
        assert set(patch) == {"apiVersion", "kind", "metadata", "spec"}
        assert patch["metadata"] == {"name": patch["metadata"]["name"]}  # no namespace: the sample has none
        assert patch["metadata"]["name"] in sample
        if patch["kind"] == "ServingLane":
            assert set(patch["spec"]) == {"budgets"}
            assert set(patch["spec"]["budgets"]) <= set(LANE_KNOBS)
            lane = lane_of[patch["metadata"]["name"]]
            for key, value in patch["spec"]["budgets"].items():
                assert changed[(lane, key)] == value
        else:
            assert patch["kind"] == "ModelService" and set(patch["spec"]) <= {"scheduler", "engine"}
            recommended = {k: v for option in doc["pools"][0]["engine_options"] if option["recommended"]
                           for k, v in option["engine"].items()}
            assert patch["spec"].get("engine", {}) == recommended
    assert len(changed) == sum(len(p["spec"].get("budgets", p["spec"].get("scheduler", {}))) for p in docs)
    assert (out / "plan.png").stat().st_size > 10_000


def test_the_plan_tries_fp8_and_the_host_tier_on_top_of_the_budgets(sample_plan):
    out, doc = sample_plan
    (shared,) = doc["pools"]
    options = {o["option"]: o for o in shared["engine_options"]}
    # The sample runs a bf16 cache with prefix caching on: both options are tried.
    assert set(options) == {"fp8-kv-cache", "host-tier"}
    assert options["fp8-kv-cache"]["engine"] == {"kvCacheDtype": "fp8_e4m3"}
    assert options["host-tier"]["engine"]["kvOffload"]["hostBytes"] > 0
    after = shared["goodput_rps"]["after"]
    for option in options.values():
        print(f"\n{option['option']}: SLO goodput {option['goodput_rps']:.2f} vs {after:.2f} req/s "
              f"({option['gain']:+.1%}), recommended: {option['recommended']}")
        assert option["recommended"] == (option["goodput_rps"] > after * (1 + plan.MIN_ENGINE_OPTION_GAIN))
    if any(o["recommended"] for o in options.values()):
        assert "engine keys restart the pods" in (out / "patch.yaml").read_text()


def test_engine_options_only_where_the_config_lacks_them():
    base = plan.for_simulator(plan.loads_config(RUNTIME_YAML), "h200-llama3-8b")
    assert [name for name, _, _ in plan.engine_option_candidates(base)] == ["fp8-kv-cache", "host-tier"]
    (name, keys, config), _ = plan.engine_option_candidates(base)
    assert config.engine.kv_cache_dtype == "fp8_e4m3"
    _, (name, keys, config) = plan.engine_option_candidates(base)
    # The tier tried holds 4x the device pool's bytes.
    assert keys["kvOffload"]["hostBytes"] == config.engine.kv_offload.host_bytes == int(
        plan.HOST_TIER_POOL_MULTIPLE * plan.kv_pool_bytes(base))
    no_prefix = plan.loads_config(RUNTIME_YAML.replace("{executor: simulated}",
                                                       "{executor: simulated, enablePrefixCaching: false, "
                                                       "kvCacheDtype: fp8_e5m2}"))
    assert plan.engine_option_candidates(no_prefix) == []


def test_bad_arguments_exit_2_with_a_message(tmp_path, capsys):
    assert tokenlane(["plan", "--traffic", str(tmp_path / "none.jsonl"), "-f", str(SAMPLE)]) == 2
    assert "no such traffic file" in capsys.readouterr().err
    assert tokenlane(["plan", "--traffic", TRACE_NAME, "-f", str(SAMPLE), "--profile", "a100-gpt"]) == 2
    assert "unknown simulator profile" in capsys.readouterr().err
    runtime = tmp_path / "runtime.yaml"
    runtime.write_text("model: {path: /m}\nlanes: [{name: interactive, default: true}]\n")
    path = tmp_path / "t.jsonl"
    path.write_text('{"arrival_s": 0, "prompt_tokens": 5, "output_tokens": 1, "lane": "gold"}\n')
    assert tokenlane(["plan", "--traffic", str(path), "-f", str(runtime)]) == 2
    assert "lane 'gold', which the config does not have" in capsys.readouterr().err


RUNTIME_YAML = """
model: {path: simulated/llama3-8b, servedName: llama3-8b, maxModelLen: 32768}
engine: {executor: simulated}
scheduler: {maxActiveSequences: 128, maxBatchedTokens: 8192, prefillChunkSize: 2048}
lanes:
  - {name: interactive, default: true, maxActiveSequences: 48, maxBatchedTokens: 2048, slo: {ttftP95Ms: 500}}
  - {name: batch, class: batch, priority: 10}
"""


def test_a_runtime_yaml_gets_bounds_around_its_values_and_a_lanes_patch(tmp_path):
    path = tmp_path / "runtime.yaml"
    path.write_text(RUNTIME_YAML)
    config = plan.read_config([str(path)], None)
    (pool,) = config.pools
    assert (config.kind, pool.replicas, pool.config.engine.simulator_profile) == ("runtime", 1, "h200-llama3-8b")
    bounds = {t.name: t.bounds for t in pool.targets}
    assert (bounds["interactive"]["maxBatchedTokens"].min, bounds["interactive"]["maxBatchedTokens"].max) == (512, 4096)
    # A lane cap never goes above the global budget (it would not be in force).
    assert bounds["batch"]["maxActiveSequences"].max == 128
    recommended = EffectiveBudgets.from_config(pool.config)
    recommended.lanes["interactive"]["maxBatchedTokens"] = 4096
    recommended.global_["kvCacheHighWatermark"] = 0.9
    done = plan.PoolPlan(pool, before=None, after=None, tuning=None, recommended=recommended, accepted=True,
                         replicas_needed={}, sweep=[])
    assert plan.patch_documents(config, [done]) == [
        {"scheduler": {"kvCacheHighWatermark": 0.9}, "lanes": [{"name": "interactive", "maxBatchedTokens": 4096}]}]
    kept = plan.PoolPlan(pool, None, None, None, EffectiveBudgets.from_config(pool.config), False, {}, [])
    assert plan.patch_text(config, [kept]).startswith("# no change")
    # A recommended engine option goes into the same patch; a rejected one does not.
    fp8 = plan.EngineOption("fp8-kv-cache", {"kvCacheDtype": "fp8_e4m3"}, None, 0.3, True)
    tier = plan.EngineOption("host-tier", {"kvOffload": {"hostBytes": 1 << 30}}, None, 0.0, False)
    with_fp8 = plan.PoolPlan(pool, None, None, None, EffectiveBudgets.from_config(pool.config), False, {}, [],
                             [fp8, tier])
    assert plan.patch_documents(config, [with_fp8]) == [{"engine": {"kvCacheDtype": "fp8_e4m3"}}]
    assert "restart the pods" in plan.patch_text(config, [with_fp8])
