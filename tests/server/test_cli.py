"""`tokenlane serve` argument handling: flags override the file; bad input exits with a
clear message instead of a traceback."""

from __future__ import annotations

import shutil
import subprocess

import httpx
import pytest

from tokenlane.runtime.config import ConfigError, loads_config
from tokenlane.runtime.entrypoints.server import apply_overrides, build_parser, main

FILE = """
model: {path: /models/a, servedName: a, maxModelLen: 1024}
engine: {kvCacheBlocks: 100, continuousBatching: true}
scheduler: {maxBatchedTokens: 512, prefillChunkSize: 256}
"""


def test_flags_override_the_file():
    args = build_parser().parse_args(["--config", "x.yaml", "--model", "/models/b", "--kv-cache-blocks", "64",
                                      "--no-continuous-batching", "--max-model-len", "256", "--port", "9000"])
    config = apply_overrides(loads_config(FILE), args)
    assert config.model.path == "/models/b" and config.model.max_model_len == 256
    assert config.engine.kv_cache_blocks == 64 and config.engine.continuous_batching is False
    assert config.model.served_name == "a" and config.scheduler.max_batched_tokens == 512  # untouched
    assert args.port == 9000 and args.host == "0.0.0.0"
    with pytest.raises(ConfigError, match="blockSize"):
        apply_overrides(loads_config(FILE), build_parser().parse_args(["--block-size", "3"]))


def test_bad_input_exits_with_a_message(tmp_path, capsys):
    assert main([]) == 2
    assert "--config" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text(FILE.replace("maxBatchedTokens: 512", "maxBatchedTokens: many"))
    assert main(["--config", str(bad)]) == 2
    assert "maxBatchedTokens" in capsys.readouterr().err
    assert main(["--config", str(tmp_path / "missing.yaml")]) == 2
    assert "cannot read" in capsys.readouterr().err
    good = tmp_path / "good.yaml"
    good.write_text(FILE.replace("/models/a", str(tmp_path / "no-such-model")))
    assert main(["--config", str(good), "--port", "0"]) == 1
    assert "cannot load" in capsys.readouterr().err


@pytest.mark.prometheus
@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Debian's prometheus) not installed")
def test_metrics_pass_promtool(shared_server):
    httpx.post(shared_server.url + "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 3}, timeout=30)
    text = shared_server.metrics_text()
    check = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
    problems = [line for line in (check.stdout + check.stderr).splitlines() if line.strip()]
    # The metrics contract (docs/metrics.md) names the KV pool size gauge `kv_blocks_total`;
    # promtool's lint would reserve `_total` for counters. That one name is the contract; nothing else may fail.
    assert all(p.startswith('tokenlane_kv_blocks_total non-counter') for p in problems), problems
    assert shared_server.metric("tokenlane_requests_total", model="tiny", lane="interactive", tenant="default",
                                outcome="finished") >= 1
