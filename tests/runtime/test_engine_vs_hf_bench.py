"""The engine-vs-transformers benchmark script: its workload and FLOP accounting, and (slow)
a two-request end-to-end run of every system."""

from __future__ import annotations

import json

import pytest

from tokenlane.bench import engine_vs_hf as bench


def test_workload_is_the_documented_workload():
    work = bench.make_workload()
    assert len(work) == 64
    assert work == bench.make_workload()  # random.Random(0): reproducible
    assert all(16 <= len(p) <= 512 and 8 <= n <= 128 for p, n in work)
    assert all(3 <= t < 32000 for p, _ in work for t in p)


def test_flops_accounting():
    work = [([5] * 10, 3)]
    f = bench.workload_flops(work)
    h, i, layers = 512, 1376, 4
    per_token = 2 * layers * (h * (8 + 2 * 4) * 64 + 8 * 64 * h + 3 * h * i)
    assert f["linear"] == 12 * per_token  # 10 prompt tokens + 2 fed-back outputs
    assert f["lm_head"] == 3 * 2 * h * 32000
    assert f["attention"] == layers * 4 * 8 * 64 * sum(range(1, 13))


def test_kv_read_accounting():
    """A request with a 10-token prompt and 3 new tokens runs 2 decodes, over 11 and 12 cached
    tokens; each cached token is K and V of 4 KV heads x 64 in 4 layers, float32."""
    per_token = 4 * 2 * 4 * 64 * 4
    assert bench.workload_kv_read_bytes([([5] * 10, 3)]) == (11 + 12) * per_token
    assert bench.workload_kv_read_bytes([([5] * 10, 1)]) == 0  # the prefill samples the only token


@pytest.mark.slow
def test_two_request_run_writes_json(tmp_path):
    out = tmp_path / "r.json"
    assert bench.main(["--num-requests", "2", "--matmul-seconds", "0.2", "--json", str(out),
                       "--systems", "tokenlane,tokenlane-kv-bf16,hf-continuous,hf-static-8"]) == 0
    doc = json.loads(out.read_text())
    names = [s["name"] for s in doc["systems"]]
    assert names == ["tokenlane", "tokenlane-kv-bf16", "hf-continuous", "hf-static-8"]
    assert "kvCacheDtype=bfloat16" in doc["systems"][1]["notes"]
    for s in doc["systems"]:
        assert s["output_tokens"] == doc["workload"]["output_tokens"]
        assert s["output_tokens_per_s"] > 0
    assert doc["matmul_bound_output_tokens_per_s"] > doc["serial_bound_output_tokens_per_s"] > 0


@pytest.mark.slow
def test_rounds_report_each_systems_median_run_and_each_rounds_ratio(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert bench.main(["--num-requests", "2", "--matmul-seconds", "0.2", "--json", str(out),
                       "--systems", "tokenlane,hf-static-8", "--rounds", "3"]) == 0
    doc = json.loads(out.read_text())
    assert [sorted(r) for r in doc["rounds"]] == [["hf-static-8", "tokenlane"]] * 3
    for s in doc["systems"]:
        assert s["output_tokens_per_s"] == sorted(r[s["name"]] for r in doc["rounds"])[1]
    assert doc["per_round_speedup_vs_best_hf"] == [r["tokenlane"] / r["hf-static-8"] for r in doc["rounds"]]
    assert "3 rounds" in capsys.readouterr().out
