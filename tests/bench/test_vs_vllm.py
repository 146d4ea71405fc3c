"""The vs-vLLM benchmark script, with a second `tokenlane serve` standing in for vLLM."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from tokenlane.bench import vs_vllm
from tokenlane.bench.host import ISA_CAPS

PEER_COMMAND = (f"{sys.executable} -m tokenlane.cli serve --model {{model}} --dtype {{dtype}} "
                "--host 127.0.0.1 --port {port} --log-level warning --shutdown-grace-seconds 1")


def test_end_to_end_with_tokenlane_as_the_peer(tiny_model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "vs.json"
    code = vs_vllm.main([
        "--peer-command", PEER_COMMAND, "--peer-name", "other", "--model", str(tiny_model_dir),
        "--workdir", str(tmp_path / "work"), "--dtype", "float32", "--concurrency", "1,2", "--pairs", "1",
        "--num-requests", "3", "--prompt-tokens", "8:24", "--max-tokens", "3:6", "--greedy-requests", "2",
        "--request-timeout", "60", "--json", str(out),
    ])
    assert code == 0
    doc = json.loads(out.read_text())
    assert doc["peer"] == "other"
    assert doc["workload"]["num_requests"] == 3
    # The host class heads the report and is kept with the runs.
    assert doc["host"]["isa_class"] and "loadavg_1m_at_end" in doc["host"]
    # One start per server: both concurrencies ran against it, so their start-up times are equal.
    first, cell = doc["cells"]
    assert [(c["dtype"], c["concurrency"]) for c in doc["cells"]] == [("float32", 1), ("float32", 2)]
    for name in ("tokenlane", "other"):
        assert {r["startup_s"] for c in doc["cells"] for r in c["runs"] if r["server"] == name} == {
            next(r["startup_s"] for r in first["runs"] if r["server"] == name)}
    assert [(r["server"], r["pair"]) for r in cell["runs"]] == [("tokenlane", 1), ("other", 1)]
    assert all(r["greedy"] is None for r in cell["runs"])  # the probes ride on the first run only
    for run in cell["runs"]:
        assert run["failed_requests"] == 0
        assert [q["index"] for q in run["requests"]] == [1, 2, 3]
        assert all(q["output_tokens"] == q["max_tokens"] for q in run["requests"])
        assert run["output_tokens"] == doc["workload"]["output_token_total"]
        assert run["metrics"]["output_tokens_per_s"] == pytest.approx(run["output_tokens"] / run["wall_s"])
        assert set(run["metrics"]) == set(vs_vllm.METRICS) and None not in run["metrics"].values()
    by_server = {r["server"]: r["metrics"] for r in cell["runs"]}
    for key in vs_vllm.METRICS:
        assert cell["medians"]["tokenlane"][key] == by_server["tokenlane"][key]
        assert cell["ratios"][key] == pytest.approx(by_server["tokenlane"][key] / by_server["other"][key])
    greedy = doc["greedy_checks"]["model"]  # --model: one checkpoint, no generated shape
    assert (greedy["requests"], greedy["mismatched"]) == (2, 0)
    assert doc["models"] == [{"shape": None, "path": str(tiny_model_dir), "generated_shape": None}]
    assert all(r["greedy"] and r["greedy"][0]["text"] for r in first["runs"])
    printed = capsys.readouterr().out
    assert printed.startswith(f"host: {doc['host']['cpus']} CPUs of {doc['host']['cpu']}, {doc['host']['isa_class']}")
    assert "float32, concurrency 2 (1 pair; medians)" in printed and "greedy float32 outputs" in printed


def test_interleaved_runs_alternate_two_servers_started_once_per_shape(tmp_path, monkeypatch, capsys):
    """--interleave: both servers start once per model and dtype; every pair runs each
    concurrency against both, the order flipped every pair; the greedy probes ride on each
    server's first run. --shape llama,qwen2 does all of it on one checkpoint, then the other."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    # The two shapes as the script generates them, made small so that they train and serve quickly.
    small = dict(intermediate_size=128, num_layers=1, vocab_size=1024)
    monkeypatch.setitem(vs_vllm.MODEL_SHAPES, "llama", {**vs_vllm.MODEL_SHAPES["llama"], **small, "hidden_size": 128})
    monkeypatch.setitem(vs_vllm.MODEL_SHAPES, "qwen2", {**vs_vllm.MODEL_SHAPES["qwen2"], **small})
    out = tmp_path / "vs.json"
    work = tmp_path / "work"
    code = vs_vllm.main([
        "--peer-command", PEER_COMMAND, "--peer-name", "other", "--shape", "llama,qwen2",
        "--workdir", str(work), "--dtype", "float32", "--concurrency", "1,2", "--pairs", "2",
        "--interleave", "--num-requests", "2", "--prompt-tokens", "8:16", "--max-tokens", "2:4",
        "--greedy-requests", "1", "--request-timeout", "60", "--json", str(out),
    ])
    assert code == 0
    doc = json.loads(out.read_text())
    assert "flipped every pair" in doc["order"]
    assert [(c["shape"], c["concurrency"]) for c in doc["cells"]] == [
        ("llama", 1), ("llama", 2), ("qwen2", 1), ("qwen2", 2)]
    assert [(m["shape"], m["path"]) for m in doc["models"]] == [("llama", str(work / "model")),
                                                               ("qwen2", str(work / "model-qwen2"))]
    assert json.loads((work / "model-qwen2" / "config.json").read_text())["model_type"] == "qwen2"
    for shape in ("llama", "qwen2"):
        runs = [r for c in doc["cells"] if c["shape"] == shape for r in c["runs"]]
        for cell in (c for c in doc["cells"] if c["shape"] == shape):
            assert [(r["server"], r["pair"]) for r in cell["runs"]] == [
                ("tokenlane", 1), ("other", 1), ("other", 2), ("tokenlane", 2)]
            assert all(r["concurrency"] == cell["concurrency"] and r["failed_requests"] == 0 for r in cell["runs"])
        for name in ("tokenlane", "other"):
            assert len({r["startup_s"] for r in runs if r["server"] == name}) == 1  # one start each
            assert sum(r["greedy"] is not None for r in runs if r["server"] == name) == 1
            # Each shape's servers have their own logs, and tokenlane's config names its checkpoint.
            assert {r["server_log"] for r in runs if r["server"] == name} == {
                str(work / f"{shape}-float32-{name}.server.log")}
        config = (work / f"{shape}-float32-tokenlane.runtime.yaml").read_text()
        assert str(work / ("model" if shape == "llama" else "model-qwen2")) + "\n" in config
        checked = doc["greedy_checks"][shape]
        assert (checked["requests"], checked["mismatched"]) == (1, 0)
    printed = capsys.readouterr().out
    assert "qwen2, float32, concurrency 2 (2 pairs; medians)" in printed
    assert "qwen2, greedy float32 outputs (1 requests, by token_ids): identical" in printed
    # The verdict covers all four cells, whatever it says of two servers that are the same.
    assert doc["verdict"]["ranges"]["output_tokens_per_s"] is not None
    assert "tokenlane / other over the cells: out tok/s " in printed


def _run(server: str, pair: int, tok_s: float, tpot: float) -> vs_vllm.Run:
    metrics = {"output_tokens_per_s": tok_s, "tpot_p50_s": tpot, "ttft_p50_s": 0.1, "ttft_p99_s": None}
    return vs_vllm.Run(server=server, pair=pair, concurrency=16, startup_s=1.0, wall_s=1.0, output_tokens=10,
                       metrics=metrics, failed_requests=0, requests=[])


def test_cell_medians_and_ratios_come_from_each_servers_runs():
    cell = vs_vllm.Cell("bfloat16", 16)
    for pair, (ours, theirs) in enumerate([(100.0, 300.0), (300.0, 200.0), (200.0, 100.0)], start=1):
        cell.runs += [_run("tokenlane", pair, ours, 1 / ours), _run("vllm", pair, theirs, 1 / theirs)]
    assert cell.medians("tokenlane")["output_tokens_per_s"] == 200.0
    assert cell.medians("vllm")["output_tokens_per_s"] == 200.0
    ratios = cell.ratios("vllm")
    assert ratios["output_tokens_per_s"] == 1.0
    assert ratios["tpot_p50_s"] == pytest.approx(1.0)
    assert ratios["ttft_p99_s"] is None  # no run measured it: no ratio rather than a made-up one
    # Each pair's own ratio, in pair order: the spread the medians hide.
    per_pair = cell.pair_ratios("vllm")
    assert per_pair["output_tokens_per_s"] == pytest.approx([1 / 3, 1.5, 2.0])
    assert per_pair["tpot_p50_s"] == pytest.approx([3.0, 2 / 3, 0.5])
    assert per_pair["ttft_p99_s"] == [None, None, None]
    table = vs_vllm.format_cell(cell, "vllm")
    assert "bfloat16, concurrency 16 (3 pairs; medians)" in table
    tok_row = next(line for line in table.splitlines() if line.strip().startswith("out tok/s"))
    assert tok_row.rstrip().endswith("1.00  0.33, 1.50, 2.00")
    run_rows = [line.split() for line in table.splitlines() if line.split()[:1] in (["1"], ["2"], ["3"])]
    assert [row[:2] for row in run_rows] == [[str(p), s] for p in (1, 2, 3) for s in ("tokenlane", "vllm")]


@pytest.mark.parametrize("tok_s, tpot, ttft, misses", [
    ((140.0, 100.0), (0.08, 0.1), (0.1, 0.1), []),  # 1.4x, 0.8x, 1.0x: met (the bounds are inclusive)
    ((130.0, 100.0), (0.09, 0.1), (0.1, 0.1), []),  # exactly on every bound
    ((120.0, 100.0), (0.08, 0.1), (0.1, 0.1), ["output_tokens_per_s"]),
    ((140.0, 100.0), (0.095, 0.1), (0.12, 0.1), ["tpot_p50_s", "ttft_p50_s"]),
    ((140.0, 100.0), (None, 0.1), (0.1, 0.1), ["tpot_p50_s"]),  # not measured is not met
])
def test_target_verdict_flags_each_cell_and_metric_that_misses(tok_s, tpot, ttft, misses):
    def run(server, i):
        metrics = {"output_tokens_per_s": tok_s[i], "tpot_p50_s": tpot[i], "ttft_p50_s": ttft[i], "ttft_p99_s": None}
        return vs_vllm.Run(server=server, pair=1, concurrency=16, startup_s=1.0, wall_s=1.0, output_tokens=10,
                           metrics=metrics, failed_requests=0, requests=[])

    passing = vs_vllm.Cell("float32", 64, runs=[_run("tokenlane", 1, 200.0, 0.05), _run("vllm", 1, 100.0, 0.1)],
                           shape="llama")
    probed = vs_vllm.Cell("float32", 16, runs=[run("tokenlane", 0), run("vllm", 1)], shape="qwen2")
    verdict = vs_vllm.target_verdict([passing, probed], "vllm")
    assert [m["metric"] for m in verdict["misses"]] == misses
    assert all(m["cell"] == "qwen2, float32, concurrency 16" for m in verdict["misses"])
    assert verdict["met"] is (not misses)
    # The ranges span both cells: the passing one is 2.0x tokens/s and 0.5x TPOT.
    assert verdict["ranges"]["output_tokens_per_s"] == pytest.approx([tok_s[0] / tok_s[1], 2.0])
    text = vs_vllm.format_verdict(verdict, "vllm")
    assert text.splitlines()[0].startswith(f"tokenlane / vllm over the cells: out tok/s {tok_s[0] / tok_s[1]:.2f}-2.00x")
    assert ("every cell meets the targets" in text) is (not misses)
    assert text.count("misses: qwen2, float32, concurrency 16") == len(misses)


def test_greedy_mismatches_are_listed():
    ours = [{"index": 1, "status": 200, "text": "a b", "token_ids": None},
            {"index": 2, "status": 200, "text": "c", "token_ids": None}]
    theirs = [{"index": 1, "status": 200, "text": "a b", "token_ids": [5, 6]},
              {"index": 2, "status": 200, "text": "d", "token_ids": [7]}]
    result = vs_vllm.compare_greedy(ours, theirs)
    assert (result["compared_by"], result["mismatched"]) == ("text", 1)
    assert result["mismatches"][0]["index"] == 2


def test_padded_tokenizer_decodes_every_model_id_and_encodes_as_before(tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    before = AutoTokenizer.from_pretrained(str(model))
    size = len(before) + 40
    assert vs_vllm.pad_tokenizer_vocab(model, size) == 40
    after = AutoTokenizer.from_pretrained(str(model))
    assert len(after) == size
    text = "def main():\n    return 0"
    assert after.encode(text) == before.encode(text)
    tail = [after.decode([i]) for i in range(size - 40, size)]
    assert len(set(tail)) == 40 and all(len(t) == 3 and t.isprintable() for t in tail)


def test_vllm_wrapper_reports_the_version_only_for_vllm(tmp_path):
    (tmp_path / "vllm_cli.py").write_text(vs_vllm.VLLM_WRAPPER)
    probe = ("import sys; sys.path.insert(0, sys.argv[1]); import vllm_cli, importlib.metadata as m; "
             "print(m.version('vllm'), m.version('pyyaml'))")
    out = subprocess.run([sys.executable, "-c", probe, str(tmp_path)], capture_output=True, text=True, check=True)
    import yaml

    assert out.stdout.split() == [vs_vllm.VLLM_VERSION, yaml.__version__]


def test_isa_cap_holds_both_servers_and_vllms_own_kernels_to_avx2(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/from/the/caller")
    tokenlane_env, peer_env = vs_vllm.isa_cap_envs("avx2", tmp_path, True,
                                                   {"HF_HUB_OFFLINE": "1", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"})
    assert tokenlane_env == ISA_CAPS["avx2"] and tokenlane_env["TOKENLANE_NATIVE_MAX_LEVEL"] == "x86-64-v3"
    assert peer_env["ONEDNN_MAX_CPU_ISA"] == "AVX2" and peer_env["ATEN_CPU_CAPABILITY"] == "avx2"
    assert peer_env["MKL_ENABLE_INSTRUCTIONS"] == "SSE4_2" and peer_env["HF_HUB_OFFLINE"] == "1"  # --peer-env wins
    folder, rest = peer_env["PYTHONPATH"].split(os.pathsep)
    assert rest == "/from/the/caller"  # the caller's path stays, after the cap's folder
    # vLLM picks _C_AVX2 from these probes: with the folder on its path, a fresh python answers no.
    probe = ("import torch.cpu as c; print(c._is_avx512_supported(), c._is_avx512_bf16_supported(), "
             "c._is_amx_tile_supported())")
    out = subprocess.run([sys.executable, "-c", probe], env={**os.environ, "PYTHONPATH": folder},
                         capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False", "False"]
    # Another peer gets the variables, no sitecustomize; no cap adds nothing.
    _, other = vs_vllm.isa_cap_envs("avx2", tmp_path / "other", False, {})
    assert other == ISA_CAPS["avx2"] and not (tmp_path / "other").exists()
    assert vs_vllm.isa_cap_envs(None, tmp_path, True, {"A": "1"}) == ({}, {"A": "1"})


def test_needs_exactly_one_peer(capsys):
    with pytest.raises(SystemExit) as exc:
        vs_vllm.main(["--pairs", "1"])
    assert exc.value.code == 2
    assert "exactly one of --vllm-python and --peer-command" in capsys.readouterr().err


def test_model_and_shape_are_refused_together(tiny_model_dir, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        vs_vllm.main(["--peer-command", PEER_COMMAND, "--model", str(tiny_model_dir), "--shape", "qwen2",
                      "--workdir", str(tmp_path)])
    assert exc.value.code == 2
    assert "give --model or --shape, not both" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        vs_vllm.main(["--peer-command", PEER_COMMAND, "--shape", "llama,mistral"])
    assert "expected shapes from llama, qwen2" in capsys.readouterr().err


def test_qwen2_shape_writes_qkv_bias_tied_embeddings_and_head_dim_32(tmp_path, monkeypatch):
    from safetensors import safe_open

    # The shape as the script uses it, with a small vocabulary so the tokenizer trains quickly.
    monkeypatch.setitem(vs_vllm.MODEL_SHAPES, "qwen2", {**vs_vllm.MODEL_SHAPES["qwen2"], "vocab_size": 1024})
    model = vs_vllm.make_bench_model(tmp_path / "model-qwen2", "qwen2")
    config = json.loads((model / "config.json").read_text())
    assert config["model_type"] == "qwen2" and config["tie_word_embeddings"] is True
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (6, 2)
    assert config["hidden_size"] // config["num_attention_heads"] == 32
    with safe_open(str(model / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert {f"model.layers.0.self_attn.{p}_proj.bias" for p in "qkv"} <= names
    assert not any(name.startswith("lm_head") for name in names)
    with pytest.raises(ValueError, match="shape must be one of"):
        vs_vllm.make_bench_model(tmp_path / "other", "mistral")
