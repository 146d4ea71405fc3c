"""The budget knob table (`runtime/config.py`, KNOBS) is the one place a knob is declared.

Everything else derives from it: the dataclass fields it must match, `lane_budgets`, the
metrics' `budget` label, the operator's builders, tuner and fallback, the CRD schemas and the
docs' knob tables. Each test below fails when a knob is added (or changed) in one place but
not in another, naming what is missing. (No torch, no server, no cluster.)
"""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path

import pytest

from tokenlane.runtime import config as cfg
from tokenlane.runtime.config import (
    BOTH,
    CAP_MIN,
    CAP_REPLACE,
    KNOBS,
    LANE,
    LANE_KNOBS,
    SCHEDULER_KNOBS,
    TUNED_KNOBS,
    LaneBudgets,
    LaneConfig,
    RuntimeConfig,
    SchedulerConfig,
)

DOCS = Path(__file__).resolve().parents[2] / "docs"

# Fields of the sections that are not budget knobs: a new field must be one or the other.
SCHEDULER_NON_KNOBS = {"policy", "step_time_budget"}
LANE_NON_KNOBS = {"name", "lane_class", "priority", "weight", "default", "slo", "match", "continuous_batching"}


def _fields(cls: type) -> dict[str, typing.Any]:
    return typing.get_type_hints(cls)


def test_every_knob_is_a_field_of_its_sections_and_every_budget_field_is_a_knob():
    scheduler = _fields(SchedulerConfig)
    assert set(scheduler) - SCHEDULER_NON_KNOBS == {k.attr for k in SCHEDULER_KNOBS}, (
        "SchedulerConfig fields and the scheduler-scoped rows of KNOBS differ")
    lane = _fields(LaneConfig)
    assert set(lane) - LANE_NON_KNOBS == {k.attr for k in LANE_KNOBS}, (
        "LaneConfig fields and the lane-scoped rows of KNOBS differ")
    assert list(_fields(LaneBudgets)) == [f.name for f in dataclasses.fields(LaneConfig) if f.name in
                                          {k.attr for k in LANE_KNOBS}], "LaneBudgets has a field per lane knob"
    for k in KNOBS:
        if k.in_scheduler:
            assert scheduler[k.attr] in (k.type, typing.Optional[k.type]), k.key
        if k.in_lane:
            assert lane[k.attr] == typing.Optional[k.type], f"a lane's {k.key} is optional (unset: global)"
            field = next(f for f in dataclasses.fields(LaneConfig) if f.name == k.attr)
            assert field.default is None, k.key
        assert cfg._camel(k.attr) == k.key


def _config_with(lane_values: dict, global_values: dict) -> RuntimeConfig:
    return RuntimeConfig.from_dict({
        "model": {"path": "/m"},
        "scheduler": global_values,
        "lanes": [{"name": "a", **lane_values}, {"name": "unset"}],
    })


@pytest.mark.parametrize("lane_value", [500, 2000], ids=["below-global", "above-global"])
def test_lane_budgets_follow_each_knobs_cap_rule(lane_value):
    ints = [k for k in LANE_KNOBS if k.type is int]
    floats = [k for k in LANE_KNOBS if k.type is float]
    assert all(k.scope == LANE for k in floats), "a float knob in both sections needs its own values here"
    shares = {k.key: 0.25 for k in floats}  # valid for every lane share (a reserve <= the cap)
    config = _config_with({**{k.key: lane_value for k in ints}, **shares},
                          {k.key: 1000 for k in ints if k.in_scheduler})
    budgets, unset = config.lane_budgets("a"), config.lane_budgets("unset")
    for k in floats:
        assert getattr(budgets, k.attr) == 0.25, k.key
        assert getattr(unset, k.attr) == k.lane_default, f"an unset lane {k.key} is its lane default"
    for k in ints:
        expected = {CAP_MIN: min(lane_value, 1000), CAP_REPLACE: lane_value}.get(k.cap, lane_value)
        assert getattr(budgets, k.attr) == expected, (k.key, k.cap)
        if k.scope == BOTH:
            assert getattr(unset, k.attr) == 1000, f"an unset lane {k.key} is the global one"


def test_metrics_export_every_lane_knob():
    from tokenlane.runtime.observability.metrics import BUDGET_KEYS, PrometheusMetrics

    assert BUDGET_KEYS == {k.key: k.attr for k in LANE_KNOBS}
    metrics = PrometheusMetrics("m")
    metrics.set_config(_config_with({}, {}))
    exported = {s.labels["budget"] for fam in metrics.registry.collect() if fam.name == "tokenlane_lane_budget"
                for s in fam.samples if s.labels["lane"] == "a"}
    assert exported == {k.key for k in LANE_KNOBS}


def _props(schema: dict, *path: str) -> dict:
    for key in path:
        schema = schema["properties"][key]
    return schema["properties"]


def _check_fragment(fragment: dict, k: cfg.Knob, description: str) -> None:
    assert fragment["type"] == ("integer" if k.type is int else "number"), k.key
    assert fragment["minimum"] == k.minimum and fragment.get("maximum") == k.maximum, k.key
    assert bool(fragment.get("exclusiveMinimum")) == k.exclusive_minimum, k.key
    assert fragment["description"] == description, k.key


def test_crd_schemas_hold_exactly_the_knobs():
    from tokenlane.operator.api import schema

    msvc, lane = schema.crd_schema("ModelService"), schema.crd_schema("ServingLane")
    scheduler = _props(msvc, "spec", "scheduler")
    assert set(scheduler) == {k.key for k in SCHEDULER_KNOBS} | {cfg._camel(n) for n in SCHEDULER_NON_KNOBS}
    for k in SCHEDULER_KNOBS:
        _check_fragment(scheduler[k.key], k, k.doc)
    defaults = {cfg._camel(f.name): f.default for f in dataclasses.fields(SchedulerConfig) if f.default is not None}
    assert {key: s["default"] for key, s in scheduler.items() if "default" in s} == defaults
    budgets = _props(lane, "spec", "budgets")
    assert set(budgets) == {k.key for k in LANE_KNOBS}
    for k in LANE_KNOBS:
        _check_fragment(budgets[k.key], k, k.lane_doc)
    for bounds in (_props(msvc, "spec", "tuning", "bounds"), _props(lane, "spec", "tuning", "bounds")):
        assert set(bounds) == {k.key for k in TUNED_KNOBS}, "tuning bounds are declared for the tuned knobs only"


def test_the_operator_derives_its_knob_lists():
    from tokenlane.operator.desired import builders
    from tokenlane.operator.policy import rollout
    from tokenlane.operator.api import tuning_types as tuner_types
    from tokenlane.operator.api.tuning_types import EffectiveBudgets

    assert set(builders.LANE_BUDGET_KEYS) == {k.key for k in LANE_KNOBS}
    assert set(tuner_types.LANE_KNOBS) | set(tuner_types.GLOBAL_KNOBS) == {k.key for k in TUNED_KNOBS}
    assert set(tuner_types.LANE_KNOBS) == {k.key for k in TUNED_KNOBS if k.in_lane}
    assert tuner_types.STEP == {k.key: k.tuner_step for k in TUNED_KNOBS}
    budgets = EffectiveBudgets.from_config(_config_with({}, {}))
    assert set(budgets.lanes["a"]) == set(tuner_types.LANE_KNOBS)
    assert set(budgets.global_) == set(tuner_types.GLOBAL_KNOBS)
    scaled = rollout.FallbackProfile(budget_scale=0.5).overrides({k.key: 1000 for k in SCHEDULER_KNOBS})
    assert set(scaled["scheduler"]) == {k.key for k in KNOBS if k.fallback_scaled}


def _section(text: str, heading: str) -> str:
    start = text.index(heading)
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def _rows(text: str) -> dict[str, list[str]]:
    """First-column `key` -> the row's cells, for every Markdown table row in `text`."""
    out = {}
    for line in text.splitlines():
        m = re.match(r"^\| `([A-Za-z.]+)` \|(.*)\|$", line)
        if m:
            out[m.group(1)] = [c.strip() for c in m.group(2).split("|")]
    return out


def test_configuration_doc_lists_every_knob_with_its_cap_rule():
    text = (DOCS / "configuration.md").read_text()
    scheduler = _rows(_section(text, "## `scheduler:`"))
    assert {k.key for k in SCHEDULER_KNOBS} <= set(scheduler)
    lanes = _rows(_section(text, "## `lanes:`"))
    for k in LANE_KNOBS:
        assert k.key in lanes, f"docs/configuration.md: no lanes row for {k.key}"
        meaning = lanes[k.key][1]
        if k.cap == CAP_MIN:
            assert meaning.startswith("Cap"), (k.key, meaning)
        elif k.cap == CAP_REPLACE:
            assert meaning.startswith("Replaces"), (k.key, meaning)
        else:
            assert k.scope == LANE


def test_tuning_doc_lists_the_knobs_the_tuner_moves():
    rows = _rows(_section((DOCS / "tuning.md").read_text(), "## What the tuner moves"))
    assert {key: cells[:2] for key, cells in rows.items()} == {
        k.key: ["per lane" if k.in_lane else "global", f"{k.tuner_step:g}"] for k in TUNED_KNOBS}


def test_metrics_doc_lists_every_budget_label():
    line = next(line for line in (DOCS / "metrics.md").read_text().splitlines()
                if line.startswith("| `budget` (`lane_budget`) |"))
    assert set(re.findall(r"`([a-zA-Z]+)`", line.split("|")[2])) == {k.key for k in LANE_KNOBS}
