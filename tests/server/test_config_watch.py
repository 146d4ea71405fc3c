"""The config watcher on real files, including a Kubernetes-style ConfigMap symlink swap."""

from __future__ import annotations

import os

from prometheus_client.parser import text_string_to_metric_families

from tokenlane.runtime.config import load_config
from tokenlane.runtime.engine.config_watch import ConfigWatcher
from tokenlane.runtime.engine.llm_engine import LLMEngine
from tokenlane.runtime.observability.metrics import PrometheusMetrics
from tokenlane.runtime.executor.fake import FakeExecutor

BASE = """
model: {path: /models/tiny}
scheduler: {maxBatchedTokens: 256, prefillChunkSize: 64, maxActiveSequences: 8}
lanes:
  - {name: interactive, default: true, maxBatchedTokens: 128}
  - {name: batch, class: batch}
"""


def real_engine(config, metrics=None) -> LLMEngine:
    """A real engine (fake executor): its reload_config decides what needs a restart, and its
    next step applies a staged config and tells its observers (the metrics)."""
    engine = LLMEngine(config, FakeExecutor())
    if metrics is not None:
        engine.add_observer(metrics)
    return engine


def sample(metrics: PrometheusMetrics, name: str, **labels) -> float:
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    raise KeyError((name, labels))


def settle(watcher):
    """Two polls (a change is judged once the file looked the same on two ticks), then an
    engine step (a staged config is applied at the step boundary)."""
    first = watcher.check()
    result = first if first is not None else watcher.check()
    watcher.target.step()
    return result


def make(tmp_path, path):
    cfg = load_config(path)
    metrics = CountingMetrics(cfg.model.name)
    metrics.set_config(cfg)
    engine = real_engine(cfg, metrics)
    return engine, metrics, ConfigWatcher(path, cfg, engine, recorder=metrics, interval_s=0.01)


class CountingMetrics(PrometheusMetrics):
    """Counts set_config calls: a reload must export its config exactly once."""

    def __init__(self, model: str) -> None:
        super().__init__(model)
        self.set_config_calls = 0

    def set_config(self, config) -> None:
        self.set_config_calls += 1
        super().set_config(config)


def test_valid_invalid_and_restart_changes(tmp_path, caplog):
    path = tmp_path / "runtime.yaml"
    path.write_text(BASE)
    engine, metrics, watcher = make(tmp_path, path)
    assert settle(watcher) is None  # unchanged

    path.write_text(BASE.replace("maxBatchedTokens: 128", "maxBatchedTokens: 96"))
    assert settle(watcher) == "success"
    assert engine.config.lane_budgets("interactive").max_batched_tokens == 96
    assert sample(metrics, "tokenlane_lane_budget", lane="interactive", budget="maxBatchedTokens") == 96
    assert sample(metrics, "tokenlane_config_reloads_total", result="success") == 1
    assert metrics.set_config_calls == 2  # at start, then once for the reload

    caplog.clear()
    path.write_text(BASE.replace("maxBatchedTokens: 128", "maxBatchedTokens: -1"))
    assert settle(watcher) == "invalid"
    assert "maxBatchedTokens" in caplog.text and "keeping the last good config" in caplog.text
    path.write_text("lanes: [unclosed")
    assert settle(watcher) == "invalid"
    assert settle(watcher) is None  # the same bad content is judged once
    assert engine.config.lane_budgets("interactive").max_batched_tokens == 96
    assert sample(metrics, "tokenlane_config_reloads_total", result="invalid") == 2

    path.write_text(BASE.replace("/models/tiny", "/models/other"))
    assert settle(watcher) == "restart_required"
    assert "need a restart" in watcher.last_message and "model.path" in watcher.last_message
    assert sample(metrics, "tokenlane_config_reloads_total", result="restart_required") == 1
    assert engine.config.model.path == "/models/tiny"
    assert metrics.set_config_calls == 2  # refused reloads export nothing

    # Back to a valid reloadable change: applied again.
    path.write_text(BASE.replace("maxBatchedTokens: 128", "maxBatchedTokens: 64"))
    assert settle(watcher) == "success"
    assert sample(metrics, "tokenlane_lane_budget", lane="interactive", budget="maxBatchedTokens") == 64


def test_configmap_symlink_swap(tmp_path):
    """kubelet's layout: runtime.yaml -> ..data/runtime.yaml, ..data -> ..<timestamp>/;
    an update writes a new timestamped folder and renames a new ..data link over the old."""
    mount = tmp_path / "config"
    mount.mkdir()

    def publish(version: str, text: str) -> None:
        folder = mount / f"..{version}"
        folder.mkdir()
        (folder / "runtime.yaml").write_text(text)
        tmp_link = mount / "..data_tmp"
        os.symlink(folder.name, tmp_link)
        os.replace(tmp_link, mount / "..data")

    publish("2026_01_01", BASE)
    os.symlink("..data/runtime.yaml", mount / "runtime.yaml")
    engine, metrics, watcher = make(tmp_path, mount / "runtime.yaml")
    publish("2026_01_02", BASE.replace("maxBatchedTokens: 128", "maxBatchedTokens: 32"))
    assert settle(watcher) == "success"
    assert engine.config.lane_budgets("interactive").max_batched_tokens == 32


def test_overrides_are_reapplied_to_new_versions(tmp_path):
    """A --kv-cache-blocks override must not make every reload look like an engine change."""
    import dataclasses

    path = tmp_path / "runtime.yaml"
    path.write_text(BASE)

    def override(cfg):
        return dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, kv_cache_blocks=64))

    cfg = override(load_config(path))
    engine = real_engine(cfg)
    watcher = ConfigWatcher(path, cfg, engine, transform=override)
    path.write_text(BASE.replace("maxBatchedTokens: 128", "maxBatchedTokens: 100"))
    assert settle(watcher) == "success"
    assert engine.config.engine.kv_cache_blocks == 64


def test_a_half_written_file_is_not_judged(tmp_path):
    path = tmp_path / "runtime.yaml"
    path.write_text(BASE)
    engine, metrics, watcher = make(tmp_path, path)
    new = BASE.replace("maxBatchedTokens: 128", "maxBatchedTokens: 100")
    path.write_text(new[: len(new) // 2])  # caught mid-write
    assert watcher.check() is None
    path.write_text(new)  # the writer finished before the next tick
    assert watcher.check() is None  # changed again: wait one more tick
    assert watcher.check() == "success"
    assert sample(metrics, "tokenlane_config_reloads_total", result="invalid") == 0
    assert watcher.config.lane_budgets("interactive").max_batched_tokens == 100
