"""runtime.yaml parsing and validation (runtime/config.py): the operator/runtime contract."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tokenlane.runtime.config import (
    ConfigError,
    RuntimeConfig,
    dumps_config,
    hash_api_key,
    load_config,
    loads_config,
)

CONFIGURATION_DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"

EXAMPLE = """
model: {path: /models/llama-3.1-8b-instruct, servedName: llama3-8b, dtype: bfloat16, maxModelLen: 32768}
engine: {blockSize: 16, gpuMemoryUtilization: 0.90, continuousBatching: true}
scheduler:
  maxActiveSequences: 128
  maxWaitingRequests: 512
  maxBatchedTokens: 8192
  prefillChunkSize: 2048
  policy: decode-first
  queueTimeoutMs: 30000
  streamIdleTimeoutMs: 10000
  kvCacheHighWatermark: 0.88
  kvCacheRejectWatermark: 0.95
lanes:
  - {name: interactive, class: interactive, priority: 100, weight: 4, default: true,
     maxActiveSequences: 96, maxBatchedTokens: 4096, prefillChunkSize: 512, maxWaitingRequests: 256,
     queueTimeoutMs: 2000, slo: {ttftP95Ms: 500, tpotP95Ms: 60}}
  - {name: long-context, class: long-context, priority: 50, weight: 2, match: {minPromptTokens: 8192},
     prefillChunkSize: 2048, maxWaitingRequests: 64, slo: {ttftP95Ms: 8000, tpotP95Ms: 120}}
  - {name: batch, class: batch, priority: 10, weight: 1, maxWaitingRequests: 4096, queueTimeoutMs: 600000}
tenants:
  - {name: search-team, apiKeySha256: "%s", defaultLane: interactive, lanes: [interactive, long-context]}
""" % hash_api_key("secret")


def test_full_example_parses_and_round_trips():
    config = loads_config(EXAMPLE)
    assert config.model.name == "llama3-8b"
    assert [lane.name for lane in config.lanes] == ["interactive", "long-context", "batch"]
    assert config.default_lane.name == "interactive"
    assert config.lane("long-context").match.min_prompt_tokens == 8192
    assert config.auth_enabled
    assert RuntimeConfig.from_dict(config.to_dict()) == config
    assert loads_config(dumps_config(config)) == config


def test_the_documented_complete_example_is_valid():
    """docs/configuration.md's "A complete example" block is a config the runtime accepts."""
    text = CONFIGURATION_DOC.read_text()
    section = text.split("## A complete example", 1)[1]
    block = re.search(r"```yaml\n(.*?)```", section, re.S).group(1)
    config = loads_config(block)
    assert [lane.name for lane in config.lanes] == ["interactive", "long-context", "batch"]
    assert config.default_lane.name == "interactive"
    assert config.lane("long-context").match.min_prompt_tokens == 200
    assert [tenant.name for tenant in config.tenants] == ["team-a"]


def test_lane_budgets_cap_the_global_ones():
    config = loads_config(EXAMPLE)
    interactive = config.lane_budgets("interactive")
    assert (interactive.max_active_sequences, interactive.max_batched_tokens) == (96, 4096)
    assert interactive.prefill_chunk_size == 512
    assert interactive.queue_timeout_ms == 2000
    batch = config.lane_budgets("batch")
    # A lane asking for more than the global budget is capped by it.
    assert batch.max_waiting_requests == 512
    assert batch.max_batched_tokens == 8192
    assert batch.queue_timeout_ms == 600000


def test_no_lanes_means_one_implicit_default_lane():
    config = loads_config("model: {path: /m}")
    assert [lane.name for lane in config.lanes] == ["default"]
    assert config.default_lane.name == "default"
    assert not config.auth_enabled


def test_restart_hash_covers_only_model_and_engine():
    base = loads_config(EXAMPLE)
    budgets_changed = loads_config(EXAMPLE.replace("maxBatchedTokens: 8192", "maxBatchedTokens: 4096"))
    engine_changed = loads_config(EXAMPLE.replace("blockSize: 16", "blockSize: 32"))
    assert base.restart_hash() == budgets_changed.restart_hash()
    assert base.reloadable_changes_only(budgets_changed)
    assert base.restart_hash() != engine_changed.restart_hash()
    assert not base.reloadable_changes_only(engine_changed)


@pytest.mark.parametrize(
    "change, message",
    [
        (("kvCacheHighWatermark: 0.88", "kvCacheHighWatermark: 0.97"), "kvCacheRejectWatermark"),
        (("kvCacheRejectWatermark: 0.95", "kvCacheRejectWatermark: 1.5"), "<= 1"),
        (("prefillChunkSize: 2048\n  policy", "prefillChunkSize: 9000\n  policy"), "prefillChunkSize"),
        (("policy: decode-first", "policy: fifo"), "policy"),
        (("weight: 4", "weigth: 4"), "unknown key"),
        (("class: batch", "class: bulk"), "class"),
        (("blockSize: 16", "blockSize: 12"), "power of two"),
        (("maxActiveSequences: 128", "maxActiveSequences: -1"), "maxActiveSequences"),
        (("maxActiveSequences: 128", "maxActiveSequences: many"), "expected an integer"),
        (("defaultLane: interactive", "defaultLane: batch"), "not among the tenant's lanes"),
        (("lanes: [interactive, long-context]", "lanes: [interactive, gpu]"), "unknown lane"),
        (("name: batch", "name: interactive"), "duplicate lane"),
        (("name: batch", "name: Batch_Lane"), "DNS-1123"),
        (("gpuMemoryUtilization: 0.90", "gpuMemoryUtilization: 0"), "gpuMemoryUtilization"),
    ],
)
def test_invalid_configs_name_the_key(change, message):
    old, new = change
    assert old in EXAMPLE
    with pytest.raises(ConfigError, match=re.escape(message)):
        loads_config(EXAMPLE.replace(old, new, 1))


def test_two_default_lanes_are_refused():
    text = EXAMPLE.replace("weight: 1,", "weight: 1, default: true,")
    with pytest.raises(ConfigError, match="more than one default lane"):
        loads_config(text)


def test_not_yaml_and_missing_file():
    with pytest.raises(ConfigError, match="not valid YAML"):
        loads_config("model: [unclosed")
    with pytest.raises(ConfigError, match="missing required key"):
        loads_config("engine: {}")
    with pytest.raises(ConfigError, match="cannot read"):
        load_config("/nonexistent/runtime.yaml")


def test_api_key_digest_must_be_hex():
    with pytest.raises(ConfigError, match="apiKeySha256"):
        loads_config("model: {path: /m}\ntenants: [{name: a, apiKeySha256: plaintext}]")
