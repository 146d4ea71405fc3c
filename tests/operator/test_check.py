"""`tokenlane check`: each rule fires on a config that breaks it and stays quiet at its boundary,
the project's own samples give the findings we expect, and the command's exit statuses."""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import pytest
import yaml

from tokenlane.cli import main as tokenlane
from tokenlane.operator.tools import check, checklist
from tokenlane.runtime.config import RuntimeConfig

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = ROOT / "manifests" / "samples"
PROMETHEUS_RULE = ROOT / "manifests" / "monitoring" / "prometheusrule.yaml"
RULES_FILE = ROOT / "manifests" / "monitoring" / "prometheus" / "tokenlane-rules.yaml"
ALL_ALERTS = checklist.AlertRules(set(checklist.RUNTIME_ALERTS) | set(checklist.OPERATOR_ALERTS), "test")

KEY_A, KEY_B = "a" * 64, "b" * 64

# A runtime.yaml that passes every rule: the KV pool is explicit so the KV rules run too.
# Pool: 4096 blocks x 16 = 65536 tokens, 57671 below the 0.88 high watermark.
CLEAN: dict[str, Any] = {
    "model": {"path": "/models/m", "maxModelLen": 4096},
    "engine": {"blockSize": 16, "kvCacheBlocks": 4096},
    "scheduler": {"maxActiveSequences": 8, "maxWaitingRequests": 512, "maxBatchedTokens": 4096,
                  "prefillChunkSize": 1024, "queueTimeoutMs": 30000, "streamIdleTimeoutMs": 10000,
                  "stepTimeBudget": "auto"},
    "lanes": [
        {"name": "interactive", "class": "interactive", "priority": 100, "default": True, "queueTimeoutMs": 2000,
         "kvCacheReserved": 0.05, "slo": {"ttftP95Ms": 500, "tpotP95Ms": 60}},
        {"name": "long-context", "class": "long-context", "priority": 50, "maxActiveSequences": 4,
         "match": {"minPromptTokens": 2048}, "slo": {"ttftP95Ms": 8000}},
        {"name": "batch", "class": "batch", "priority": 10, "queueTimeoutMs": 600000, "maxWaitingRequests": 256,
         "slo": {"e2eP95Ms": 600000}},
    ],
    "tenants": [{"name": "team-a", "apiKeySha256": KEY_A}, {"name": "team-b", "apiKeySha256": KEY_B}],
}


def lane(data: dict, name: str) -> dict:
    return next(item for item in data["lanes"] if item["name"] == name)


def edit(**changes: Any) -> Callable[[dict], None]:
    """A mutation of CLEAN: keys are 'section.key' or 'lanes.NAME.key[.sub]'; None deletes."""

    def apply(data: dict) -> None:
        for dotted, value in changes.items():
            parts = dotted.split(".")
            if parts[0] == "lanes":
                node, parts = lane(data, parts[1]), parts[2:]
            else:
                node = data
            for part in parts[:-1]:
                node = node.setdefault(part, {})
            if value is None:
                node.pop(parts[-1], None)
            else:
                node[parts[-1]] = value

    return apply


def drop_lane(name: str) -> Callable[[dict], None]:
    return lambda data: data.__setitem__("lanes", [item for item in data["lanes"] if item["name"] != name])


def run_rules(data: dict, checkpoint: checklist.Checkpoint | None = None, on_cpu: bool | None = None,
              alerts: checklist.AlertRules | None = ALL_ALERTS) -> list[checklist.Finding]:
    config = RuntimeConfig.from_dict(data)
    subject = check.subject_from_runtime_yaml("runtime.yaml", config, checkpoint)
    if on_cpu is not None:
        subject.on_cpu = on_cpu
    return checklist.check_subject(subject) + checklist.check_alerts(alerts, operator=False)


def rules_of(findings: list[checklist.Finding]) -> set[str]:
    return {f.rule for f in findings}


def test_the_clean_config_passes_every_rule():
    assert run_rules(copy.deepcopy(CLEAN)) == []


# (rule, mutation that breaks it, the key it names, a mutation at the rule's boundary that does not)
CASES = [
    ("max-model-len-unset", edit(**{"model.maxModelLen": None}), "model.maxModelLen",
     edit(**{"model.maxModelLen": None, "scheduler.maxModelLen": 4096})),
    ("max-model-len-cap-no-effect", edit(**{"scheduler.maxModelLen": 8192}), "scheduler.maxModelLen",
     edit(**{"scheduler.maxModelLen": 4096})),
    ("watermark-gap", edit(**{"scheduler.kvCacheHighWatermark": 0.92, "scheduler.kvCacheRejectWatermark": 0.95}),
     "scheduler.kvCacheRejectWatermark",
     edit(**{"scheduler.kvCacheHighWatermark": 0.90, "scheduler.kvCacheRejectWatermark": 0.95})),
    ("watermark-high-too-low", edit(**{"scheduler.kvCacheHighWatermark": 0.4}), "scheduler.kvCacheHighWatermark",
     edit(**{"scheduler.kvCacheHighWatermark": 0.5})),
    ("watermark-too-high", edit(**{"scheduler.kvCacheHighWatermark": 0.9, "scheduler.kvCacheRejectWatermark": 1.0}),
     "scheduler.kvCacheRejectWatermark",
     edit(**{"scheduler.kvCacheHighWatermark": 0.9, "scheduler.kvCacheRejectWatermark": 0.98})),
    ("continuous-batching-off", edit(**{"engine.continuousBatching": False}), "engine.continuousBatching",
     edit(**{"engine.continuousBatching": True})),
    ("prefill-not-chunked", edit(**{"scheduler.prefillChunkSize": 4096}), "scheduler.prefillChunkSize",
     edit(**{"scheduler.prefillChunkSize": 4095})),
    ("prefill-chunk-above-max-model-len", edit(**{"model.maxModelLen": 1024}), "scheduler.prefillChunkSize",
     edit(**{"model.maxModelLen": 1025})),
    ("lane-class-missing", drop_lane("long-context"), "lanes", edit()),
    ("default-lane-unset", edit(**{"lanes.interactive.default": False}), "lanes",
     edit(**{"lanes.batch.default": True, "lanes.interactive.default": False})),
    ("lane-priority-order", edit(**{"lanes.batch.priority": 100}), "lanes[batch].priority",
     edit(**{"lanes.batch.priority": 99})),
    ("lane-cap-above-global", edit(**{"lanes.batch.maxWaitingRequests": 4096}), "lanes[batch].maxWaitingRequests",
     edit(**{"lanes.batch.maxWaitingRequests": 512})),
    ("lane-match-unreachable", edit(**{"lanes.long-context.match": {"minPromptTokens": 4096}}),
     "lanes[long-context].match.minPromptTokens", edit(**{"lanes.long-context.match": {"minPromptTokens": 4095}})),
    ("slo-missing", edit(**{"lanes.interactive.slo": {"ttftP95Ms": 500}}), "lanes[interactive].slo.tpotP95Ms",
     edit(**{"lanes.interactive.slo": {"ttftP95Ms": 500, "tpotP95Ms": 60}})),
    ("slo-missing", edit(**{"lanes.long-context.slo": {"tpotP95Ms": 100}}), "lanes[long-context].slo.ttftP95Ms",
     edit(**{"lanes.long-context.slo": {"ttftP95Ms": 9000}})),
    ("slo-batch-none", edit(**{"lanes.batch.slo": None}), "lanes[batch].slo",
     edit(**{"lanes.batch.slo": {"tpotP95Ms": 1000}})),
    ("slo-e2e-below-ttft", edit(**{"lanes.interactive.slo.e2eP95Ms": 400}), "lanes[interactive].slo.e2eP95Ms",
     edit(**{"lanes.interactive.slo.e2eP95Ms": 2000})),
    ("queue-timeout-below-ttft", edit(**{"lanes.interactive.queueTimeoutMs": 499}), "lanes[interactive].queueTimeoutMs",
     edit(**{"lanes.interactive.queueTimeoutMs": 500})),
    # Without its own timeout a lane inherits the global one; the finding names the global key.
    ("queue-timeout-below-ttft", edit(**{"lanes.long-context.slo.ttftP95Ms": 40000}), "scheduler.queueTimeoutMs",
     edit(**{"lanes.long-context.slo.ttftP95Ms": 30000})),
    ("queue-timeout-above-e2e", edit(**{"lanes.interactive.slo.e2eP95Ms": 1500}), "lanes[interactive].queueTimeoutMs",
     edit(**{"lanes.interactive.slo.e2eP95Ms": 2000})),
    ("interactive-queue-timeout-long", edit(**{"lanes.interactive.queueTimeoutMs": 5001}),
     "lanes[interactive].queueTimeoutMs", edit(**{"lanes.interactive.queueTimeoutMs": 5000})),
    ("batch-queue-timeout-short", edit(**{"lanes.batch.queueTimeoutMs": 2000}), "lanes[batch].queueTimeoutMs",
     edit(**{"lanes.batch.queueTimeoutMs": 2001})),
    ("stream-idle-timeout-short", edit(**{"scheduler.streamIdleTimeoutMs": 999}), "scheduler.streamIdleTimeoutMs",
     edit(**{"scheduler.streamIdleTimeoutMs": 1000})),
    ("kv-pool-unknown", edit(**{"engine.kvCacheBlocks": None}), "engine.kvCacheBlocks", edit()),
    ("kv-pool-below-max-model-len", edit(**{"engine.kvCacheBlocks": 255}), "model.maxModelLen",
     edit(**{"engine.kvCacheBlocks": 256, "scheduler.maxActiveSequences": 1, "scheduler.maxBatchedTokens": 1024,
             "lanes.long-context.maxActiveSequences": None, "lanes.long-context.slo.ttftP95Ms": 8000})),
    ("kv-pool-below-running-set", edit(**{"scheduler.maxActiveSequences": 3605}), "scheduler.maxActiveSequences",
     edit(**{"scheduler.maxActiveSequences": 3604, "scheduler.maxBatchedTokens": 8192})),
    ("kv-batched-tokens-above-pool", edit(**{"engine.kvCacheBlocks": 290, "scheduler.maxActiveSequences": 1,
                                            "lanes.long-context.maxActiveSequences": 1}),
     "scheduler.maxBatchedTokens",
     edit(**{"engine.kvCacheBlocks": 291, "scheduler.maxActiveSequences": 1,
             "lanes.long-context.maxActiveSequences": 1})),
    ("kv-long-context-overcommit",
     edit(**{"scheduler.maxActiveSequences": 16, "lanes.long-context.maxActiveSequences": 15}),
     "lanes[long-context].maxActiveSequences",
     edit(**{"scheduler.maxActiveSequences": 16, "lanes.long-context.maxActiveSequences": 14})),
    ("kv-overcommit", edit(**{"scheduler.maxActiveSequences": 15}), "scheduler.maxActiveSequences",
     edit(**{"scheduler.maxActiveSequences": 14})),
    ("lane-isolation-off", edit(**{"scheduler.stepTimeBudget": "off"}), "scheduler.stepTimeBudget",
     edit(**{"scheduler.stepTimeBudget": "off", "lanes.interactive.slo": {"e2eP95Ms": 2000}})),
    ("lane-isolation-off", edit(**{"lanes.interactive.kvCacheReserved": None}), "lanes[interactive].kvCacheReserved",
     edit(**{"lanes.interactive.kvCacheReserved": 0.01})),
    # Nobody below it to be isolated from.
    ("lane-isolation-off", edit(**{"lanes.interactive.kvCacheReserved": 0.0}), "lanes[interactive].kvCacheReserved",
     edit(**{"lanes.interactive.kvCacheReserved": None, "scheduler.stepTimeBudget": "off",
             "lanes.long-context.priority": 100, "lanes.batch.priority": 100, "lanes.batch.queueTimeoutMs": 600000})),
    ("tenant-keys-missing", edit(**{"tenants": [{"name": "team-a"}, {"name": "team-b"}]}), "tenants",
     edit(**{"tenants": [{"name": "team-a"}]})),
    ("tenant-without-key", edit(**{"tenants": [{"name": "team-a", "apiKeySha256": KEY_A}, {"name": "team-b"}]}),
     "tenants[team-b].apiKeySha256", edit()),
    ("tenant-key-duplicate", edit(**{"tenants": [{"name": "team-a", "apiKeySha256": KEY_A},
                                                 {"name": "team-b", "apiKeySha256": KEY_A}]}),
     "tenants[team-b].apiKeySha256", edit()),
    ("parallel-tensor-above-node", edit(**{"engine.tensorParallelSize": 9}), "engine.tensorParallelSize",
     edit(**{"engine.tensorParallelSize": 8, "engine.pipelineParallelSize": 4})),
]


@pytest.mark.parametrize("rule,breaks,key,boundary", CASES, ids=[f"{c[0]}-{c[2]}" for c in CASES])
def test_rule_fires_and_stays_quiet_at_its_boundary(rule, breaks, key, boundary):
    broken = copy.deepcopy(CLEAN)
    breaks(broken)
    findings = [f for f in run_rules(broken) if f.rule == rule]
    assert [f.key for f in findings] == [key], run_rules(broken)
    finding = findings[0]
    assert finding.severity == checklist.RULES[rule].severity
    assert finding.object == "runtime.yaml" and finding.message and finding.fix
    fine = copy.deepcopy(CLEAN)
    boundary(fine)
    assert rule not in rules_of(run_rules(fine)), [f for f in run_rules(fine) if f.rule == rule]


def test_every_rule_has_a_case_or_a_test_of_its_own():
    covered = {case[0] for case in CASES} | {
        "kv-long-context-fits-fp8", "config-invalid", "max-model-len-above-checkpoint", "tenant-lane-unknown", "replicas-single",
        "tuning-without-slo", "rollout-without-prometheus", "alerts-not-found", "alerts-missing",
        "model-source-without-cache", "parallel-tensor-heads", "parallel-pipeline-above-layers"}
    assert covered == set(checklist.RULES)


def test_lane_findings_name_their_lane():
    broken = copy.deepcopy(CLEAN)
    edit(**{"lanes.batch.priority": 100})(broken)
    (finding,) = [f for f in run_rules(broken) if f.rule == "lane-priority-order"]
    assert finding.lane == "batch" and "interactive" in finding.message


def test_a_config_without_lanes_is_one_interactive_lane_missing_the_rest():
    data = copy.deepcopy(CLEAN)
    del data["lanes"], data["tenants"]
    findings = run_rules(data)
    assert {(f.rule, f.key) for f in findings if f.rule in ("lane-class-missing", "slo-missing")} == {
        ("lane-class-missing", "lanes"), ("slo-missing", "lanes[default].slo.ttftP95Ms")}
    assert sum(f.rule == "lane-class-missing" for f in findings) == 2  # long-context and batch


# --------------------------------------------------------------------------- the KV pool on CPU


def write_checkpoint(folder: Path, **overrides: Any) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    raw = {"model_type": "llama", "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
           "hidden_size": 128, "max_position_embeddings": 2048, **overrides}
    (folder / "config.json").write_text(json.dumps(raw))
    return folder


def test_cpu_pool_size_comes_from_the_checkpoint_like_the_runtime(tmp_path):
    torch = pytest.importorskip("torch")
    from tokenlane.runtime.executor.llama import kv_cache_bytes_per_block

    ckpt = check.read_checkpoint(write_checkpoint(tmp_path / "m"))
    assert (ckpt.num_layers, ckpt.num_kv_heads, ckpt.head_dim) == (4, 2, 32)
    args = SimpleNamespace(num_layers=4, num_kv_heads=2, head_dim=32)
    for dtype, size in ((torch.float32, 4), (torch.bfloat16, 2)):
        assert ckpt.kv_bytes_per_block(16, size) == kv_cache_bytes_per_block(args, 16, dtype)


def test_kv_rules_run_on_cpu_when_the_checkpoint_is_readable(tmp_path):
    folder = write_checkpoint(tmp_path / "m")
    # 4 layers x 2 heads x 32 dims x 2 (K, V) x 4 bytes = 2 KiB per token: 1/1024 GiB holds 512 tokens.
    data = copy.deepcopy(CLEAN)
    edit(**{"model.path": str(folder), "model.maxModelLen": None, "engine.kvCacheBlocks": None,
            "engine.device": "cpu", "engine.cpuKvCacheGib": 1 / 1024})(data)
    findings = run_rules(data)
    (too_small,) = [f for f in findings if f.rule == "kv-pool-below-max-model-len"]
    assert "32 blocks x 16 = 512 tokens" in too_small.message and "2048" in too_small.message
    (unset,) = [f for f in findings if f.rule == "max-model-len-unset"]
    assert "(2048)" in unset.message
    # The same file with the device left to auto: the pool is only known at start.
    edit(**{"engine.device": "auto"})(data)
    assert "kv-pool-unknown" in rules_of(run_rules(data))
    assert "kv-pool-below-max-model-len" not in rules_of(run_rules(data))


def test_fp8_advice_where_a_long_context_lane_fits_only_an_fp8_cache(tmp_path):
    folder = write_checkpoint(tmp_path / "m")
    # float32 on the CPU: 2 KiB per token, 1/64 GiB = 8192 tokens, 7208 below the 0.88 watermark;
    # fp8 (1 byte) holds 4x: 28835. Two long-context requests of 4096 tokens need 8192.
    data = copy.deepcopy(CLEAN)
    edit(**{"model.path": str(folder), "model.maxModelLen": 4096, "engine.kvCacheBlocks": None,
            "engine.device": "cpu", "engine.cpuKvCacheGib": 1 / 64, "scheduler.maxActiveSequences": 2,
            "lanes.long-context.maxActiveSequences": 2, "scheduler.maxBatchedTokens": 2048,
            "scheduler.prefillChunkSize": 1024})(data)
    findings = run_rules(data)
    (advice,) = [f for f in findings if f.rule == "kv-long-context-fits-fp8"]
    assert advice.key == "engine.kvCacheDtype" and advice.lane == "long-context" and advice.severity == "warning"
    assert "need 8192 tokens" in advice.message and "holds 7208" in advice.message and "28835" in advice.message
    assert "fp8_e4m3" in advice.fix
    # Quiet where fp8 is already on, where fp8 would not be enough either, and where it already fits.
    for change in ({"engine.kvCacheDtype": "fp8_e5m2"},
                   {"lanes.long-context.maxActiveSequences": 8, "scheduler.maxActiveSequences": 8},
                   {"lanes.long-context.maxActiveSequences": 1}):
        quiet = copy.deepcopy(data)
        edit(**change)(quiet)
        assert "kv-long-context-fits-fp8" not in rules_of(run_rules(quiet)), change
    # An explicit block count does not grow with a narrower dtype: no advice.
    explicit = copy.deepcopy(data)
    edit(**{"engine.kvCacheBlocks": 450})(explicit)
    assert "kv-long-context-fits-fp8" not in rules_of(run_rules(explicit))


def test_max_model_len_above_the_checkpoint(tmp_path):
    ckpt = check.read_checkpoint(write_checkpoint(tmp_path / "m", max_position_embeddings=2048))
    data = copy.deepcopy(CLEAN)
    assert "max-model-len-above-checkpoint" in rules_of(run_rules(data, checkpoint=ckpt))
    edit(**{"model.maxModelLen": 2048, "lanes.long-context.match": {"minPromptTokens": 1024}})(data)
    assert rules_of(run_rules(data, checkpoint=ckpt)) == set()


# --------------------------------------------------------------------------- alerts


def test_the_needed_alerts_exist_in_both_shipped_rule_files():
    for path in (PROMETHEUS_RULE, RULES_FILE):
        names = checklist.alert_names(yaml.safe_load_all(path.read_text()))
        assert set(checklist.RUNTIME_ALERTS) | set(checklist.OPERATOR_ALERTS) <= names, path


def test_alert_rules_missing_or_incomplete():
    (absent,) = checklist.check_alerts(None, operator=False)
    assert absent.rule == "alerts-not-found" and absent.severity == "warning"
    (missing,) = checklist.check_alerts(checklist.AlertRules(set(checklist.RUNTIME_ALERTS) - {"TokenlaneHighErrorRate"}, "r.yaml"),
                                    operator=False)
    assert missing.rule == "alerts-missing" and missing.object == "r.yaml"
    assert missing.message == "missing alert(s): TokenlaneHighErrorRate"
    # The operator's alerts are needed only where the operator serves the config.
    assert checklist.check_alerts(checklist.AlertRules(set(checklist.RUNTIME_ALERTS), "r.yaml"), operator=False) == []
    (op,) = checklist.check_alerts(checklist.AlertRules(set(checklist.RUNTIME_ALERTS), "r.yaml"), operator=True)
    assert "TokenlaneRolledBack" in op.message


# --------------------------------------------------------------------------- manifests and the samples


def run_manifests(*paths: Path, alerts: Path | None = PROMETHEUS_RULE) -> check.Report:
    args = check.build_parser().parse_args(
        [arg for p in paths for arg in ("-f", str(p))] + (["--alerts", str(alerts)] if alerts else []))
    return check.run_check(args)


def test_llama_sample_has_no_error_and_no_warning(capsys):
    report = run_manifests(SAMPLES / "llama3-8b.yaml")
    assert report.checked == ["ModelService default/llama3-8b"]
    assert {(f.severity, f.rule, f.object, f.key) for f in report.findings} == {
        # The GPU pool is sized at start.
        ("info", "kv-pool-unknown", "ModelService default/llama3-8b", "spec.engine.kvCacheBlocks"),
        ("info", "slo-batch-none", "ServingLane default/llama3-8b-batch", "spec.slo"),
    }
    # Every lane's waiting cap is below the global one (a batch flood cannot fill the shared
    # queue): no warning, so even --strict passes.
    assert report.exit_status(strict=False) == 0 and report.exit_status(strict=True) == 0


def test_tiny_sample_is_a_demo_not_a_go_live_config():
    report = run_manifests(SAMPLES / "tiny-cpu.yaml")
    assert {(f.severity, f.rule, f.object) for f in report.findings} == {
        ("warning", "lane-class-missing", "ModelService default/tiny"),  # two lanes, no long-context
        ("info", "kv-pool-unknown", "ModelService default/tiny"),  # the tiny model is generated in the pod
        ("info", "replicas-single", "ModelService default/tiny"),
        ("info", "rollout-without-prometheus", "ModelService default/tiny"),
        ("info", "slo-batch-none", "ServingLane default/tiny-batch"),
    }
    assert report.exit_status(strict=False) == 0


def test_demo_config_findings(tmp_path):
    from tokenlane.bench.demo import demo_config

    path = tmp_path / "runtime.yaml"
    path.write_text(yaml.safe_dump(demo_config(tmp_path / "model", True)))
    args = check.build_parser().parse_args([str(path), "--alerts", str(RULES_FILE)])
    report = check.run_check(args)
    # The demo is sized to show queueing on 2 CPU cores, not for production: both warnings hold.
    assert {(f.rule, f.key) for f in report.findings} == {
        ("interactive-queue-timeout-long", "lanes[interactive].queueTimeoutMs"),  # 10 s vs a 500 ms TTFT
        ("kv-long-context-overcommit", "lanes[long-context].maxActiveSequences"),  # 16 x 2048 > 1024 blocks
        ("kv-overcommit", "scheduler.maxActiveSequences"),
        # It shows the lanes without isolation (docs/tuning.md, "Lane isolation").
        ("lane-isolation-off", "scheduler.stepTimeBudget"),
        ("lane-isolation-off", "lanes[interactive].kvCacheReserved"),
    }
    assert report.exit_status(strict=False) == 0


MSVC = """
apiVersion: tokenlane.dev/v1alpha1
kind: ModelService
metadata: {name: m, namespace: team}
spec:
  replicas: 2
  model: {path: /models/m, maxModelLen: 4096}
  engine: {kvCacheBlocks: 4096}
  scheduler: {maxActiveSequences: 16, maxBatchedTokens: 4096, prefillChunkSize: 1024}
  tenants:
    - {name: web, apiKeySha256: %s, lanes: [interactive, chat]}
  tuning: {enabled: true, prometheusUrl: "http://prometheus:9090"}
""" % KEY_A


def lane_doc(name: str, cls: str, priority: int, **spec: Any) -> dict:
    return {"apiVersion": "tokenlane.dev/v1alpha1", "kind": "ServingLane", "metadata": {"name": f"m-{name}", "namespace": "team"},
            "spec": {"modelServiceRef": {"name": "m"}, "laneName": name, "class": cls, "priority": priority, **spec}}


def test_manifest_findings_point_at_the_field_to_edit(tmp_path):
    docs = [yaml.safe_load(MSVC),
            lane_doc("interactive", "interactive", 100, default=True, budgets={"queueTimeoutMs": 300},
                     slo={"ttftP95Ms": 500, "tpotP95Ms": 60}),
            lane_doc("long-context", "long-context", 50, isolation="dedicated", dedicated={"replicas": 1},
                     budgets={"maxActiveSequences": 64}, slo={"ttftP95Ms": 8000}),
            lane_doc("batch", "batch", 10, budgets={"queueTimeoutMs": 600000}, slo={"e2eP95Ms": 600000}),
            # Refused by the operator: a second default lane.
            lane_doc("other", "interactive", 90, default=True, slo={"ttftP95Ms": 500, "tpotP95Ms": 60})]
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    report = run_manifests(path)
    found = {(f.rule, f.object, f.key) for f in report.findings}
    assert found == {
        ("queue-timeout-below-ttft", "ServingLane team/m-interactive", "spec.budgets.queueTimeoutMs"),
        # The dedicated pool's lane, found through its own rendered runtime.yaml.
        ("kv-long-context-overcommit", "ServingLane team/m-long-context", "spec.budgets.maxActiveSequences"),
        ("lane-cap-above-global", "ServingLane team/m-long-context", "spec.budgets.maxActiveSequences"),
        ("kv-overcommit", "ModelService team/m", "spec.scheduler.maxActiveSequences"),  # info: 16 x 4096 tokens
        ("tenant-lane-unknown", "ModelService team/m", "spec.tenants[web].lanes"),
        ("config-invalid", "ServingLane team/m-other", "spec"),
        # The interactive lane shares the shared pool with the batch lane, unprotected.
        ("lane-isolation-off", "ModelService team/m", "spec.scheduler.stepTimeBudget"),
        ("lane-isolation-off", "ServingLane team/m-interactive", "spec.budgets.kvCacheReserved"),
    }
    (refused,) = [f for f in report.findings if f.rule == "config-invalid"]
    assert "default lane" in refused.message
    (tenant,) = [f for f in report.findings if f.rule == "tenant-lane-unknown"]
    assert "['chat']" in tenant.message
    assert report.exit_status(strict=False) == 1


def test_model_service_rules(tmp_path):
    msvc = yaml.safe_load(MSVC)
    msvc["spec"]["replicas"] = 1
    msvc["spec"].pop("tenants")
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump(msvc))  # no lanes: one implicit lane without an SLO
    found = {(f.rule, f.key) for f in run_manifests(path).findings}
    assert {("replicas-single", "spec.replicas"), ("tuning-without-slo", "spec.tuning.enabled")} <= found
    msvc["spec"]["replicas"] = 2
    msvc["spec"]["tuning"]["enabled"] = False
    path.write_text(yaml.safe_dump(msvc))
    found = {f.rule for f in run_manifests(path).findings}
    assert not found & {"replicas-single", "tuning-without-slo", "rollout-without-prometheus"}
    del msvc["spec"]["tuning"]["prometheusUrl"]
    path.write_text(yaml.safe_dump(msvc))
    found = {(f.rule, f.key) for f in run_manifests(path).findings}
    assert ("rollout-without-prometheus", "spec.tuning.prometheusUrl") in found


def test_fetched_model_source_without_cache(tmp_path):
    msvc = yaml.safe_load(MSVC)
    msvc["spec"]["replicas"] = 3
    msvc["spec"]["model"]["path"] = "/models/m"
    msvc["spec"]["model"]["source"] = {"huggingFace": {"repo": "acme/m"}}
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump(msvc))
    (finding,) = [f for f in run_manifests(path).findings if f.rule == "model-source-without-cache"]
    assert finding.key == "spec.model.cache" and finding.severity == "warning" and "3 pods" in finding.message
    msvc["spec"]["model"]["cache"] = {"pvc": {"claimName": "model-cache"}}
    path.write_text(yaml.safe_dump(msvc))
    assert not [f for f in run_manifests(path).findings if f.rule == "model-source-without-cache"]
    msvc["spec"]["model"].pop("cache")
    msvc["spec"]["replicas"] = 1  # one pod downloads once: nothing to share
    path.write_text(yaml.safe_dump(msvc))
    assert not [f for f in run_manifests(path).findings if f.rule == "model-source-without-cache"]


def test_invalid_model_service_is_one_error_finding(tmp_path):
    msvc = yaml.safe_load(MSVC)
    msvc["spec"]["scheduler"]["kvCacheHighWatermark"] = 0.99
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump(msvc))
    report = run_manifests(path)
    (finding,) = [f for f in report.findings if f.severity == "error"]
    assert (finding.rule, finding.object) == ("config-invalid", "ModelService team/m")
    assert "kvCacheHighWatermark" in finding.message


def test_alerts_found_next_to_the_input(tmp_path):
    data = copy.deepcopy(CLEAN)
    (tmp_path / "runtime.yaml").write_text(yaml.safe_dump(data))
    args = check.build_parser().parse_args([str(tmp_path / "runtime.yaml")])
    assert rules_of(check.run_check(args).findings) == {"alerts-not-found"}
    shutil.copy(RULES_FILE, tmp_path / "tokenlane-rules.yaml")
    assert check.run_check(args).findings == []


# --------------------------------------------------------------------------- the command


def write(tmp_path: Path, data: Any, name: str = "runtime.yaml") -> str:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return str(path)


def test_cli_exit_statuses(tmp_path, capsys):
    alerts = ["--alerts", str(RULES_FILE)]
    clean = write(tmp_path, CLEAN)
    assert tokenlane(["check", clean, *alerts]) == 0
    assert "0 error(s), 0 warning(s), 0 info" in capsys.readouterr().out

    warned = copy.deepcopy(CLEAN)
    edit(**{"scheduler.streamIdleTimeoutMs": 500})(warned)
    path = write(tmp_path, warned, "warned.yaml")
    assert tokenlane(["check", path, *alerts]) == 0
    assert tokenlane(["check", path, *alerts, "--strict"]) == 1
    assert tokenlane(["check", path, *alerts, "--strict", "--skip", "stream-idle-timeout-short"]) == 0
    capsys.readouterr()

    broken = copy.deepcopy(CLEAN)
    edit(**{"lanes.interactive.queueTimeoutMs": 100})(broken)
    assert tokenlane(["check", write(tmp_path, broken, "broken.yaml"), *alerts]) == 1
    out = capsys.readouterr().out
    assert "queue-timeout-below-ttft" in out and "fix: set the lane's queueTimeoutMs" in out


def test_cli_invalid_config_is_an_error_finding_not_a_crash(tmp_path, capsys):
    bad = copy.deepcopy(CLEAN)
    bad["scheduler"]["maxBatchedTokns"] = 1
    assert tokenlane(["check", write(tmp_path, bad), "-o", "json"]) == 1
    out = json.loads(capsys.readouterr().out)
    (finding,) = [f for f in out["findings"] if f["severity"] == "error"]
    assert finding["rule"] == "config-invalid" and "maxBatchedTokns" in finding["message"]
    assert tokenlane(["check", write(tmp_path, "model: [unclosed", "junk.yaml")]) == 1
    assert "not valid YAML" in capsys.readouterr().out


def test_cli_json_output(tmp_path, capsys):
    broken = copy.deepcopy(CLEAN)
    edit(**{"lanes.batch.priority": 100})(broken)
    assert tokenlane(["check", write(tmp_path, broken), "-o", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["summary"] == {"error": 0, "warning": 2, "info": 0}
    assert {f["rule"] for f in out["findings"]} == {"lane-priority-order", "alerts-not-found"}
    assert set(out["findings"][0]) == {"rule", "severity", "object", "key", "message", "fix", "lane"}


@pytest.mark.parametrize("argv,message", [
    ([], "give either files"),
    (["/nonexistent/runtime.yaml"], "no such file or directory"),
    (["-n", "ns", "-f", "x.yaml"], "give either files"),
    (["x.yaml", "--context", "c"], "--context goes with -n"),
    (["x.yaml", "--skip", "no-such-rule"], "unknown rule"),
    (["-f", str(SAMPLES / "kustomization.yaml")], "nothing to check"),
    (["x.yaml", "--checkpoint", "/nonexistent"], "cannot read the checkpoint"),
])
def test_cli_usage_errors_exit_2_with_a_message(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "x.yaml").write_text(yaml.safe_dump(CLEAN))
    assert tokenlane(["check", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_cli_unreachable_cluster_exits_2(tmp_path, monkeypatch, capsys):
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "dead",
        "clusters": [{"name": "dead", "cluster": {"server": "https://127.0.0.1:9"}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "dead", "context": {"cluster": "dead", "user": "u"}}]}))
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    assert tokenlane(["check", "-n", "team"]) == 2
    assert "cannot reach the Kubernetes API server" in capsys.readouterr().err
    assert tokenlane(["check", "-n", "team", "--context", "missing"]) == 2
    assert "context 'missing'" in capsys.readouterr().err


def test_cli_help_has_examples(capsys):
    with pytest.raises(SystemExit) as exit_:
        tokenlane(["check", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "tokenlane check -n tokenlane" in out and "exit status" in out
    assert tokenlane(["--help"]) == 0
    assert "check" in capsys.readouterr().out


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not on PATH")
def test_cli_kustomize_folder(capsys):
    # The samples kustomization puts both ModelServices in namespace tokenlane.
    assert tokenlane(["check", "-k", str(SAMPLES), "--alerts", str(PROMETHEUS_RULE)]) == 0
    out = capsys.readouterr().out
    assert "ModelService tokenlane/llama3-8b" in out and "ModelService tokenlane/tiny" in out


def test_docs_explain_every_rule():
    text = (ROOT / "docs" / "check.md").read_text()
    undocumented = [rule for rule in checklist.RULES if f"`{rule}`" not in text]
    assert not undocumented, f"docs/check.md does not explain {undocumented}"


def test_check_runs_without_torch():
    """The operator image has no torch: the whole command, not only its imports, must run there."""
    code = (
        "import sys\n"
        "for blocked in ('torch', 'triton', 'transformers'):\n"
        "    sys.modules[blocked] = None\n"
        "from tokenlane.cli import main\n"
        f"sys.exit(main(['check', '-f', {str(SAMPLES)!r}, '--alerts', {str(PROMETHEUS_RULE)!r}, '-o', 'json']))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd="/")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["summary"]["error"] == 0


def test_parallelism_against_the_checkpoint(tmp_path):
    """The checkpoint mismatches the runtime refuses at start, seen before it (a checkpoint with
    4 layers and 4 attention heads); a ModelService's finding names spec.parallelism."""
    checkpoint = checklist.Checkpoint(num_layers=4, num_kv_heads=2, head_dim=32, max_position_embeddings=None,
                                      num_attention_heads=4)
    for tensor, pipeline, rules in ((2, 4, set()), (3, 1, {"parallel-tensor-heads"}),
                                    (4, 5, {"parallel-pipeline-above-layers"})):
        data = copy.deepcopy(CLEAN)
        edit(**{"engine.tensorParallelSize": tensor, "engine.pipelineParallelSize": pipeline})(data)
        found = {f.rule for f in run_rules(data, checkpoint=checkpoint) if f.rule.startswith("parallel-")}
        assert found == rules, (tensor, pipeline)
    (tmp_path / "m.yaml").write_text(yaml.safe_dump({
        "apiVersion": "tokenlane.dev/v1alpha1", "kind": "ModelService", "metadata": {"name": "m"},
        "spec": {"model": {"path": "/models/m"}, "gpus": {"count": 3}, "parallelism": {"tensor": 3, "pipeline": 5}}}))
    subjects, _ = check.subjects_from_manifests(check.render.read_documents([str(tmp_path / "m.yaml")]), checkpoint)
    found = {(f.rule, f.key) for f in checklist.check_subject(subjects[0]) if f.rule.startswith("parallel-")}
    assert found == {("parallel-tensor-heads", "spec.parallelism.tensor"),
                     ("parallel-pipeline-above-layers", "spec.parallelism.pipeline")}
