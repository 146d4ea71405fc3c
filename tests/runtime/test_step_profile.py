"""The step profiler (bench/step_profile.py): its phases account for the whole step,
on a real engine with the tiny model; the table and JSON come out of a short offline run."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import time

import pytest

from tokenlane.bench import step_profile
from tokenlane.bench.host import ISA_CAPS
from tokenlane.bench.step_profile import (
    ENGINE_PHASES,
    FORWARD_PHASES,
    format_table,
    instrument,
    phase_breakdown,
    steady,
    summarize,
)
from tokenlane.runtime.config import EngineConfig, ModelConfig, RuntimeConfig, SchedulerConfig
from tokenlane.runtime.engine.llm_engine import LLMEngine
from tokenlane.runtime.executor.model_executor import ModelExecutor
from tokenlane.runtime.core.request import Request, SamplingParams
from tokenlane.runtime.engine.tokenizer import load_tokenizer


def make_engine(model_dir) -> LLMEngine:
    config = RuntimeConfig(
        model=ModelConfig(path=str(model_dir)),
        engine=EngineConfig(device="cpu", kv_cache_blocks=64),
        scheduler=SchedulerConfig(max_active_sequences=4, max_batched_tokens=64, prefill_chunk_size=16),
    )
    return LLMEngine(config, ModelExecutor(config), tokenizer=load_tokenizer(model_dir), clock=time.perf_counter)


def test_phases_add_up_to_each_step_and_split_the_forward_pass(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    recorder = instrument(engine)
    for i, length in enumerate([40, 7, 23]):
        engine.add_request(Request(f"r{i}", list(range(5, 5 + length)),
                                   SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)))
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        if steps == 3:
            time.sleep(0.05)  # an idle gap made by construction, after the third step
    records = recorder.records
    assert len(records) >= 8
    for record in records:
        parts = phase_breakdown(record)
        assert all(value >= 0 for value in parts.values())
        # Every phase but the dispatch (inside the loop gap) and the batch building (inside
        # prepare inputs) adds up to the step's cycle.
        total = sum(value for name, value in parts.items() if name not in ("stream", "build_batch", "build_batch_cpu"))
        assert 0 < parts["build_batch"] <= parts["prepare_inputs"]
        assert 0 < parts["build_batch_cpu"] <= parts["build_batch"] + 1e-3  # thread clocks tick coarser
        assert total == pytest.approx(record["cycle"], rel=1e-6, abs=1e-9)
        assert record["forward"] > 0 and record["self_attn"] > 0 and record["linear"] > 0
        assert record["lm_head"] > 0  # every step here samples a token
        assert record["outputs"] > 0 and record["schedule"] > 0
    # The idle time between two steps is the earlier step's loop gap (not part of any step).
    assert phase_breakdown(records[2])["loop_gap"] >= 0.05
    assert records[2]["step"] < records[2]["cycle"] - 0.05 + 1e-9
    # Chunked prefill (16-token chunks) next to decodes, then decodes only.
    assert steady(records, running=3, mixed=True)
    decodes = steady(records, running=3, mixed=False)
    assert decodes and all(r["prefill_tokens"] == 0 and r["decode_tokens"] == 3 for r in decodes)
    summary = summarize(decodes)
    assert set(ENGINE_PHASES) <= set(summary["phase_ms"])
    assert 0 < summary["host_overhead_share"] < 1
    # Offline, the host CPU is the step thread's outside the forward pass: below its whole CPU.
    assert all(0 < r["forward_cpu"] <= r["step_cpu"] for r in decodes)
    assert 0 < summary["host_cpu_ms_per_step"] < 1000 * max(r["step_cpu"] for r in decodes)
    assert sum(summary["phase_ms"][name] for name in FORWARD_PHASES) > 0
    table = format_table([{"mode": "offline", "dtype": "float32", "running": 3, "decode": summary}])
    assert "offline fp32 N=3 decode" in table and "host overhead share" in table
    assert "loop gap" not in table  # offline: no HTTP rows


@pytest.mark.slow  # prefills 512-token prompts twice over: ~10 s on two cores
def test_offline_run_writes_table_and_json(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "profile.json"
    code = step_profile.main(["--model", str(tiny_model_dir), "--running", "3", "--steps", "3",
                              "--json", str(out)])
    assert code == 0
    (result,) = json.loads(out.read_text())
    assert result["mode"] == "offline" and result["running"] == 3
    assert result["host"]["isa_class"] and result["host"]["cpus"] >= 1
    for case in ("decode", "mixed"):
        assert result[case]["steps"] == 3, case
    table = format_table([result])
    assert "offline fp32 N=3 decode" in table and "host overhead share" in table
    assert table in capsys.readouterr().out


def test_isa_cap_profiles_in_a_process_started_with_the_caps(tiny_model_dir, tmp_path, monkeypatch):
    """--isa-cap avx2: the run happens in a fresh process with the four variables set, so that
    torch and the native library load capped, and its host line says so."""
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("an x86-64 cap")
    for name in ISA_CAPS["avx2"]:
        monkeypatch.delenv(name, raising=False)
    out = tmp_path / "profile.json"
    done = subprocess.run([sys.executable, "-m", "tokenlane.bench.step_profile", "--model", str(tiny_model_dir),
                           "--running", "2", "--steps", "2", "--isa-cap", "avx2", "--json", str(out)],
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    (result,) = json.loads(out.read_text())
    assert result["host"]["isa_caps"] == ISA_CAPS["avx2"]
    assert "CAPPED" in done.stdout
    native = result["host"]["native_kernels"]
    assert "x86-64-v4" not in native, native  # no AVX-512 library under the cap


def test_a_model_folder_without_config_is_refused(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        step_profile.ensure_model(str(tmp_path))


@pytest.mark.slow  # a real `tokenlane serve` and 3 streaming clients: ~20 s on two busy cores
def test_http_mode_profiles_a_real_server(tiny_model_dir, tmp_path):
    result = step_profile.http_profile(tiny_model_dir, "float32", running=3, max_tokens=12, cpu_threads=1,
                                       workdir=tmp_path)
    decode = result["decode"]
    assert decode["steps"] >= 5
    assert decode["phase_ms"]["loop_gap"] > 0 and decode["loop_cpu_ms_per_step"] > 0
    assert decode["host_cpu_ms_per_step"] > decode["loop_cpu_ms_per_step"] / 2  # the loop's and the step thread's
    assert result["itl_p50_ms"] > 0


@pytest.mark.slow  # a real `tokenlane serve` with its engine core process: ~20 s on two busy cores
def test_http_mode_profiles_the_engine_core_process(tiny_model_dir, tmp_path):
    result = step_profile.http_profile(tiny_model_dir, "float32", running=3, max_tokens=12, cpu_threads=1,
                                       workdir=tmp_path, step_loop="process")
    decode = result["decode"]
    assert result["step_loop"] == "process" and decode["steps"] >= 5
    # Recorded in the core: its hand-off of each step's outputs, no event loop of its own.
    assert 0 < decode["phase_ms"]["stream"] <= decode["phase_ms"]["loop_gap"]
    assert "loop_cpu_ms_per_step" not in decode and "host_cpu_ms_per_step" not in decode
