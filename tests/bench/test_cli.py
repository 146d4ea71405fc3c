"""`tokenlane bench simulate` through the CLI entry point."""

from __future__ import annotations

import json

import pytest

from tokenlane.bench.cli import main
from tokenlane.bench.serve_proc import parse_override, set_path


def test_simulate_phases_from_a_config_file(tmp_path, capsys):
    cfg = tmp_path / "runtime.yaml"
    cfg.write_text(
        "model: {path: sim, maxModelLen: 8192}\n"
        "engine: {simulatorProfile: h100-llama3-8b, enablePrefixCaching: false}\n"
        "lanes: [{name: chat, default: true, slo: {ttftP95Ms: 500}}]\n"
    )
    code = main(["simulate", "--config", str(cfg), "--source", "trace", "--time-scale", "2", "--duration", "10",
                 "--phase", "continuous", "--phase", "static:engine.continuousBatching=false",
                 "--out", str(tmp_path), "--stem", "s", "--no-progress"])
    assert code == 0
    doc = json.loads((tmp_path / "s.json").read_text())
    assert [p["name"] for p in doc["phases"]] == ["continuous", "static"]
    assert doc["phases"][1]["extra"]["continuous_batching"] is False
    assert "H100" in doc["phases"][0]["extra"]["profile"]
    assert doc["comparison"]["baseline"] == "static"
    out = capsys.readouterr().out
    assert "ratios vs 'static'" in out and "time x2" in out


def test_bad_input_is_a_clear_error(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: {path: sim}\n")
    assert main(["simulate", "--config", str(cfg), "--lane", "x:1:giant", "--out", str(tmp_path)]) == 2
    assert "prompt class" in capsys.readouterr().err
    assert main(["simulate", "--config", str(cfg), "--phase", "bad:engine.blockSize=3", "--out", str(tmp_path)]) == 2
    assert "blockSize" in capsys.readouterr().err


def test_set_overrides_every_phase_of_a_scenario(tmp_path, capsys):
    code = main(["simulate", "--scenario", "kv-fp8", "--duration", "5", "--set", "engine.kvCacheDtype=fp8_e5m2",
                 "--set", "engine.simulatorProfile=h100-llama3-8b", "--out", str(tmp_path), "--stem", "s",
                 "--no-progress"])
    assert code == 0
    doc = json.loads((tmp_path / "s.json").read_text())
    extras = {p["name"]: p["extra"] for p in doc["phases"]}
    assert {e["kv_cache_dtype"] for e in extras.values()} == {"fp8_e5m2"}
    assert all("H100" in e["profile"] for e in extras.values())
    assert "fp8 vs bf16" in capsys.readouterr().out
    assert main(["simulate", "--scenario", "kv-fp8", "--duration", "5", "--set", "engine.kvCacheDtype=fp4",
                 "--out", str(tmp_path), "--no-progress"]) == 2
    assert "kvCacheDtype" in capsys.readouterr().err


def test_kv_fp8_scenario_doubles_the_pool_on_the_same_traffic():
    from tokenlane.bench.scenarios import SCENARIOS
    from tokenlane.bench.sim import simulate

    scenario = SCENARIOS["kv-fp8"](duration_s=5.0)
    bf16, fp8 = scenario.phases
    assert bf16.traffic is fp8.traffic and bf16.slos == fp8.slos
    runs = {ph.name: simulate(ph.config, ph.traffic, ph.name, slos=ph.slos) for ph in scenario.phases}
    assert runs["fp8"].extra["kv_blocks_total"] in (2 * runs["bf16"].extra["kv_blocks_total"],
                                                     2 * runs["bf16"].extra["kv_blocks_total"] + 1)


def test_overrides():
    data = {"engine": {}, "lanes": [{"name": "a"}, {"name": "b"}]}
    set_path(data, *parse_override("engine.continuousBatching=false"))
    set_path(data, *parse_override("lanes.b.prefillChunkSize=256"))
    assert data["engine"]["continuousBatching"] is False
    assert data["lanes"][1]["prefillChunkSize"] == 256


@pytest.mark.slow
def test_compare_restarts_the_server_per_phase(tmp_path, tiny_model_dir):
    cfg = tmp_path / "runtime.yaml"
    cfg.write_text(
        f"model: {{path: {tiny_model_dir}, maxModelLen: 1024}}\n"
        "engine: {kvCacheBlocks: 256, device: cpu}\n"
        "lanes: [{name: chat, default: true, slo: {ttftP95Ms: 2000}}]\n"
    )
    code = main(["compare", "--config", str(cfg), "--duration", "3", "--rate", "2", "--max-output-tokens", "8",
                 "--lane", "chat:1:short:short", "--out", str(tmp_path), "--no-progress"])
    assert code == 0
    doc = json.loads((tmp_path / "bench-compare.json").read_text())
    assert [p["name"] for p in doc["phases"]] == ["continuous", "static"]
    assert (tmp_path / "static.runtime.yaml").read_text().count("continuousBatching: false") == 1
