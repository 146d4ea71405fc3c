"""The user docs stay true to the code: every metric, every config key with its default,
and every relative link. (Cheap: no torch, no server.)"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
from prometheus_client.metrics import MetricWrapperBase

from tokenlane.runtime import config as cfg
from tokenlane.runtime.observability.metrics import PrometheusMetrics

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def _registry_metrics() -> dict[str, tuple[str, tuple[str, ...]]]:
    metrics = PrometheusMetrics("tiny")
    out = {}
    for obj in vars(metrics).values():
        if isinstance(obj, MetricWrapperBase):
            name = obj._name + ("_total" if obj._type == "counter" else "")
            out[name] = (obj._type, tuple(obj._labelnames))
    return out


def _doc_table_rows(text: str) -> dict[str, tuple[str, tuple[str, ...]]]:
    rows = {}
    for line in text.splitlines():
        m = re.match(r"^\| `(tokenlane_[a-z0-9_]+)` \| (\w+) \| ([^|]*) \|", line)
        if m and not m.group(1).startswith("tokenlane_operator_"):
            labels = tuple(re.findall(r"`([a-z_]+)`", m.group(3)))
            rows[m.group(1)] = (m.group(2), labels)
    return rows


def test_metrics_doc_matches_registry():
    documented = _doc_table_rows((DOCS / "metrics.md").read_text())
    real = _registry_metrics()
    assert set(documented) == set(real), (
        f"missing from docs/metrics.md: {sorted(set(real) - set(documented))}; "
        f"documented but not in the registry: {sorted(set(documented) - set(real))}"
    )
    for name, (kind, labels) in real.items():
        assert documented[name][0] == kind, name
        assert set(documented[name][1]) == set(labels), name


SECTIONS = {
    "model": cfg.ModelConfig,
    "engine": cfg.EngineConfig,
    "scheduler": cfg.SchedulerConfig,
    "lanes": cfg.LaneConfig,
    "tenants": cfg.TenantConfig,
}
NESTED = {"slo": cfg.SLOConfig, "match": cfg.LaneMatch}


def _section_text(text: str, section: str) -> str:
    start = text.index(f"## `{section}:`")
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def _doc_default(value) -> str | None:
    if value is None:
        return None
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


@pytest.mark.parametrize("section", list(SECTIONS))
def test_configuration_doc_lists_every_key_with_its_default(section):
    text = _section_text((DOCS / "configuration.md").read_text(), section)
    cls = SECTIONS[section]
    for f in dataclasses.fields(cls):
        key = cfg._camel(f.name)
        if key in NESTED:
            for sub in dataclasses.fields(NESTED[key]):
                assert f"| `{key}.{cfg._camel(sub.name)}` |" in text, f"{section}.{key}.{sub.name}"
            continue
        row = next((line for line in text.splitlines() if line.startswith(f"| `{key}` |")), None)
        assert row is not None, f"docs/configuration.md has no row for {section}.{key}"
        if f.default is not dataclasses.MISSING and _doc_default(f.default) is not None:
            default_cell = row.split("|")[2]
            assert f"`{_doc_default(f.default)}`" in default_cell, (section, key, row)


def test_relative_links_resolve():
    for page in [ROOT / "README.md", *DOCS.glob("*.md")]:
        text = re.sub(r"`[^`\n]*`", "", page.read_text())  # inline code is not a link
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text):
            assert (page.parent / target).exists(), f"{page.name}: broken link {target}"
