"""The pure helpers of operator/controllers/tuning.py: bounds from the CRDs, overrides, merge patches."""

from __future__ import annotations

import copy
from pathlib import Path

import yaml

from tokenlane.operator.desired import builders
from tokenlane.operator.policy import rollout
from tokenlane.operator.controllers import tuning
from tokenlane.operator.api.resources import parse_model_service, parse_serving_lane
from tokenlane.operator.api.tuning_types import Bounds, EffectiveBudgets

SAMPLES = Path(__file__).parents[2] / "manifests" / "samples" / "tiny-cpu.yaml"


def _parsed(tuning_spec: dict, lane_tuning: dict | None = None):
    msvc, interactive, batch = [d for d in yaml.safe_load_all(SAMPLES.read_text()) if d]
    for doc in (msvc, interactive, batch):  # the samples leave the namespace to `kubectl -n`
        doc["metadata"]["namespace"] = "tokenlane-demo"
    msvc = copy.deepcopy(msvc)
    msvc["spec"]["tuning"] = tuning_spec
    if lane_tuning is not None:
        batch["spec"]["tuning"] = lane_tuning
    lanes = [parse_serving_lane(interactive), parse_serving_lane(batch)]
    return parse_model_service(msvc), lanes


def test_lane_bounds_come_from_the_model_service_and_the_lane():
    msvc, lanes = _parsed(
        {"enabled": True, "prometheusUrl": "http://p:9090",
         "bounds": {"maxBatchedTokens": {"min": 128, "max": 4096}, "maxActiveSequences": {"min": 2},
                    "kvCacheHighWatermark": {"min": 0.7, "max": 0.9}}},
        {"bounds": {"maxBatchedTokens": {"min": 256, "max": 384}}},
    )
    desired = builders.build(msvc, lanes)
    budgets = tuning.budgets_of(desired)
    targets = {t.name: t for t in tuning.lane_targets(msvc, desired, budgets)}
    # The global default, capped at the global maxBatchedTokens (512): a lane cap above it does nothing.
    assert targets["interactive"].bounds["maxBatchedTokens"] == Bounds(128, 512)
    # One-sided bound: the other side stays at the current value (interactive has 8 sequences).
    assert targets["interactive"].bounds["maxActiveSequences"] == Bounds(2, 8)
    assert targets["batch"].bounds["maxBatchedTokens"] == Bounds(256, 384)  # the lane's own bounds win
    assert targets["interactive"].ttft_p95_ms == 1000 and targets["batch"].ttft_p95_ms is None
    settings = tuning.settings_from_spec(msvc.spec)
    assert settings.global_bounds["kvCacheHighWatermark"] == Bounds(0.7, 0.9)
    assert settings.max_step_fraction == 0.25 and settings.window_s == 300


def test_a_lane_can_opt_out_of_tuning():
    msvc, lanes = _parsed({"enabled": True, "prometheusUrl": "http://p:9090",
                           "bounds": {"maxBatchedTokens": {"min": 128, "max": 512}}}, {"enabled": False})
    desired = builders.build(msvc, lanes)
    targets = {t.name: t for t in tuning.lane_targets(msvc, desired, tuning.budgets_of(desired))}
    assert targets["batch"].bounds == {} and targets["interactive"].bounds


def test_overrides_hold_only_values_that_differ_from_the_spec():
    spec = EffectiveBudgets({"a": {"maxBatchedTokens": 512, "maxActiveSequences": 8}}, {"kvCacheHighWatermark": 0.88})
    tuned = EffectiveBudgets({"a": {"maxBatchedTokens": 384, "maxActiveSequences": 8}}, {"kvCacheHighWatermark": 0.86})
    current = {"engine": {"continuousBatching": False}, "lanes": {"a": {"maxActiveSequences": 6}}}
    out = tuning.tuned_overrides(current, spec, tuned)
    assert out == {"engine": {"continuousBatching": False}, "lanes": {"a": {"maxBatchedTokens": 384}},
                   "scheduler": {"kvCacheHighWatermark": 0.86},
                   # the spec values they were learned against: a user's edit of one drops it
                   "learnedFrom": {"lanes": {"a": {"maxBatchedTokens": 512}}, "scheduler": {"kvCacheHighWatermark": 0.88}}}
    back = tuning.tuned_overrides(out, spec, spec)
    assert back == {"engine": {"continuousBatching": False}}


def test_diff_patch_deletes_with_none():
    old = {"lanes": {"a": {"x": 1, "y": 2}}, "scheduler": {"z": 3}}
    new = {"lanes": {"a": {"x": 1}}}
    assert tuning.diff_patch(old, new) == {"lanes": {"a": {"y": None}}, "scheduler": None}


def test_spec_revision_ignores_status_overrides_and_replicas():
    msvc, lanes = _parsed({"enabled": False})
    rev, _ = rollout.spec_revision(msvc, lanes)
    scaled = parse_model_service({"metadata": {"name": "tiny", "namespace": "tokenlane-demo"},
                                  "spec": {**msvc.spec, "replicas": 3},
                                  "status": {"overrides": {"lanes": {"batch": {"maxBatchedTokens": 128}}}}})
    assert rollout.spec_revision(scaled, lanes)[0] == rev
    changed = parse_model_service({"metadata": {"name": "tiny", "namespace": "tokenlane-demo"},
                                   "spec": {**msvc.spec,
                                            "scheduler": {**msvc.spec["scheduler"], "prefillChunkSize": 64}}})
    assert rollout.spec_revision(changed, lanes)[0] != rev


async def test_read_prometheus_selects_the_namespace(monkeypatch):
    """Two ModelServices serving the same model name in different namespaces must not mix: every
    PromQL query of the tuner matches the ModelService's namespace as well as the model."""
    from tokenlane.operator.clients.prometheus import PrometheusClient

    asked: list[str] = []

    async def query(self, promql, at=None):
        asked.append(promql)
        return []

    monkeypatch.setattr(PrometheusClient, "query", query)
    await tuning.read_prometheus("http://prometheus:9090", "tiny", 300, ["interactive"], namespace="team-a")
    assert asked and all('model="tiny"' in q and 'namespace="team-a"' in q for q in asked), asked
    asked.clear()
    await tuning.read_prometheus("http://prometheus:9090", "tiny", 300, ["interactive"])
    assert asked and not any("namespace=" in q for q in asked)


def test_runtime_config_lane_bounds_stop_at_the_global_budget():
    """A lane cap above the global budget is not in force: the runtime.yaml adapter (used by the
    real-Prometheus test and the closed-loop simulation) narrows bounds as the operator does, or
    the tuner would raise a lane's prefillChunkSize 128 -> 160 that never shows in /metrics."""
    from tuner_helpers import lane_targets
    from tokenlane.runtime.config import loads_config

    config = loads_config("""
model: {path: /m, servedName: tiny}
scheduler: {maxActiveSequences: 16, maxBatchedTokens: 256, prefillChunkSize: 128}
lanes:
  - {name: interactive, default: true, maxBatchedTokens: 128}
""")
    (target,) = lane_targets(config, {"interactive": {
        "prefillChunkSize": Bounds(32, 256), "maxActiveSequences": Bounds(4, 64), "maxBatchedTokens": Bounds(300, 512)}})
    assert target.bounds["prefillChunkSize"] == Bounds(32, 128)
    assert target.bounds["maxActiveSequences"] == Bounds(4, 16)
    assert target.bounds["maxBatchedTokens"] == Bounds(256, 256)  # a floor above the cap collapses to it


def test_a_new_revision_after_the_fallback_drops_the_fallback_overrides_only():
    """The fallback scaled the global budgets and turned static batching on; a new spec revision
    ends it, leaving the tuner's own values (lane caps, the high watermark) in place."""
    overrides = {"engine": {"continuousBatching": False},
                 "scheduler": {"maxBatchedTokens": 256, "maxActiveSequences": 4, "prefillChunkSize": 64,
                               "kvCacheHighWatermark": 0.86},
                 "lanes": {"batch": {"maxBatchedTokens": 384}}}
    assert tuning._without_fallback(overrides) == {"scheduler": {"kvCacheHighWatermark": 0.86},
                                                   "lanes": {"batch": {"maxBatchedTokens": 384}}}
    assert tuning._without_fallback({"engine": {"continuousBatching": False},
                                     "scheduler": {"maxBatchedTokens": 256}}) == {}
