"""The simulator's LoRA cost (runtime/executor/simulated.py `lora_cost`) and the bench's adapter
traffic (bench/lora_cost.py): invariants of the cost model, pure, and one short simulated run."""

from __future__ import annotations

import json

import pytest

from tokenlane.bench import lora_cost as lora
from tokenlane.bench.scenarios import production_config
from tokenlane.bench.sim import simulate
from tokenlane.bench.trace import LaneMix, TrafficSpec, build_requests
from tokenlane.runtime.config import LORA_TARGET_MODULES
from tokenlane.runtime.executor.simulated import ChunkShape, LoraShape, SimulatedExecutor, get_profile, lora_cost
from tokenlane.runtime.executor.simulated import lora_width, step_cost

H200 = get_profile("h200-llama3-8b")
ALL = tuple(LORA_TARGET_MODULES)


def decode(n, adapters=(), context=1000):
    """n decode rows, the i-th on adapters[i % len(adapters)] (base when none)."""
    return [ChunkShape(context, 1, True, adapters[i % len(adapters)] if adapters else None) for i in range(n)]


SHAPES = {f"a{i}": LoraShape(16, ALL) for i in range(8)} | {"r64": LoraShape(64, ALL), "qv": LoraShape(16, ("q", "v"))}


def test_base_steps_cost_what_they_did():
    for chunks in (decode(64), [ChunkShape(0, 2048, True)], decode(8, context=30000)):
        assert step_cost(H200, chunks) == step_cost(H200, chunks, SHAPES)


def test_lora_flops_are_shrink_plus_expand_per_token():
    m = H200.model
    dims = m.lora_module_dims()
    width = m.num_layers * sum(a + b for a, b in dims.values())
    assert lora_width(m, SHAPES["a0"]) == width
    assert dims["gate"] == (4096, 14336) and dims["k"] == (4096, 1024) and dims["o"] == (4096, 4096)
    cost = lora_cost(H200, decode(64, ("a0",)), SHAPES)
    assert cost.flops == 2 * 16 * width * 64 and cost.distinct_adapters == 1
    base = step_cost(H200, decode(64))
    assert step_cost(H200, decode(64, ("a0",)), SHAPES).flops == base.flops + cost.flops


def test_weights_read_once_per_adapter_per_step():
    """The same rows over more adapters: the same FLOPs, one more set of A and B per adapter."""
    one = lora_cost(H200, decode(64, ("a0",)), SHAPES)
    four = lora_cost(H200, decode(64, ("a0", "a1", "a2", "a3")), SHAPES)
    assert four.flops == one.flops and four.distinct_adapters == 4
    per_adapter = 16 * lora_width(H200.model, SHAPES["a0"]) * H200.model.dtype_bytes
    assert four.bytes - one.bytes == pytest.approx(3 * per_adapter)


@pytest.mark.parametrize("smaller,larger", [
    (decode(64, ("a0",)), decode(64, ("r64",))),  # rank
    (decode(64, ("qv",)), decode(64, ("a0",))),  # target modules
    (decode(16, ("a0",)), decode(64, ("a0",))),  # rows
    (decode(64, ("a0", "a1")), decode(64, ("a0", "a1", "a2", "a3", "a4", "a5", "a6", "a7"))),  # adapters
])
def test_lora_cost_grows_with_rank_modules_rows_and_adapters(smaller, larger):
    a, b = lora_cost(H200, smaller, SHAPES), lora_cost(H200, larger, SHAPES)
    assert a.bytes < b.bytes and a.flops <= b.flops
    assert step_cost(H200, smaller, SHAPES).seconds <= step_cost(H200, larger, SHAPES).seconds


def test_base_rows_beside_adapters_pay_nothing_for_them():
    mixed = decode(32) + decode(32, ("a0",))
    assert lora_cost(H200, mixed, SHAPES) == lora_cost(H200, decode(32, ("a0",)), SHAPES)


def test_decode_over_four_adapters_stays_within_the_issue_target():
    """64 decoding sequences over 4 rank-16 adapters on every projection: well under 1.3x the
    base step (memory-bound: the adapters' weights are small against the base's)."""
    base = step_cost(H200, decode(64)).seconds
    four = step_cost(H200, decode(64, ("a0", "a1", "a2", "a3")), SHAPES).seconds
    assert 1.0 < four / base < 1.3


def test_unknown_adapter_and_module_are_refused():
    with pytest.raises(ValueError, match="not loaded"):
        lora_cost(H200, decode(1, ("nope",)), SHAPES)
    with pytest.raises(ValueError, match="lm_head"):
        lora_width(H200.model, LoraShape(8, ("lm_head",)))


def test_shape_only_adapter_is_a_peft_folder_the_executor_loads(tmp_path):
    folder = lora.write_shape_only_adapter(tmp_path / "sql", 32, ("q", "v", "down"))
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["r"] == 32 and config["target_modules"] == ["q_proj", "v_proj", "down_proj"]
    executor = SimulatedExecutor(production_config())
    info = executor.add_adapter("sql", str(folder))
    assert (info.rank, info.target_modules) == (32, ("q", "v", "down"))
    assert executor.adapters["sql"] == LoraShape(32, ("q", "v", "down"))
    with pytest.raises(ValueError, match="maxLoraRank"):
        executor.add_adapter("big", str(lora.write_shape_only_adapter(tmp_path / "big", 4096)))


def test_spread_is_uniform_and_deterministic():
    traffic = build_requests(TrafficSpec(source="synthetic", seed=3, duration_s=60, rate_rps=20,
                                         lanes=[LaneMix(lane=None)], tenants=["default"]))
    names = lora.adapter_names(4)
    a, b = lora.spread_over_adapters(traffic, names, seed=1), lora.spread_over_adapters(traffic, names, seed=1)
    assert [r.adapter for r in a.requests] == [r.adapter for r in b.requests]
    counts = {n: sum(r.adapter == n for r in a.requests) for n in names}
    assert min(counts.values()) > 0.6 * len(a.requests) / 4
    half = lora.spread_over_adapters(traffic, names, seed=1, base_share=0.5)
    assert 0.35 < sum(r.adapter is None for r in half.requests) / len(half.requests) < 0.65


def test_simulated_run_with_adapters_costs_more_busy_time(tmp_path):
    """The same short run on the base and over 4 adapters: every request finishes in both, and
    the adapters' run spent more simulated GPU time (the engine really scheduled them)."""
    traffic = build_requests(TrafficSpec(source="synthetic", seed=0, duration_s=10, rate_rps=8,
                                         lanes=[LaneMix(lane=None, output="short")], tenants=["default"]))
    names = lora.adapter_names(4)
    base = simulate(production_config(), traffic, "base")
    config = lora.with_adapters(production_config(), names, 64, tmp_path)
    spread = lora.spread_over_adapters(traffic, names)
    with_lora = simulate(config, spread, "lora")
    assert all(r.outcome == "ok" for r in base.records) and all(r.outcome == "ok" for r in with_lora.records)
    assert len(with_lora.records) == len(base.records) == len(traffic.requests)
    assert with_lora.extra["busy_seconds"] > base.extra["busy_seconds"]


def test_step_table_prints_and_writes_json(tmp_path, capsys):
    out = tmp_path / "lora-step.json"
    assert lora.main(["--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 9 and all(r["ratio"] > 1.0 for r in rows)
    # More adapters or a higher rank never costs less.
    by = {(r["adapters"], r["rank"]): r["ratio"] for r in rows}
    assert by[(1, 16)] < by[(4, 16)] < by[(8, 16)] and by[(4, 8)] < by[(4, 16)] < by[(4, 64)]
    assert "ratio" in capsys.readouterr().out


def test_lora_scenario_spreads_the_same_arrivals_over_the_adapters():
    from tokenlane.bench.scenarios import SCENARIOS

    scenario = SCENARIOS["lora"](duration_s=10)
    base, r16, r64 = scenario.phases
    assert base.config.model.adapters is None and {r.adapter for r in base.traffic.requests} == {None}
    assert [a.name for a in r16.config.model.adapters] == lora.adapter_names(4)
    assert r64.config.engine.lora_max_rank == 64
    assert [r.arrival_s for r in r16.traffic.requests] == [r.arrival_s for r in base.traffic.requests]
    assert {r.adapter for r in r16.traffic.requests} == set(lora.adapter_names(4))
    assert scenario.ratio_pairs == [("lora-4-r16", "base"), ("lora-4-r64", "base")]
