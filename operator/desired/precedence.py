"""Which value of a tuned knob is in force: the user's spec or the tuner's override.

The tuner writes its values to `status.overrides` (`lanes.<laneName>.<knob>`, `scheduler.<knob>`)
and, next to them, the spec value each was learned against (`status.overrides.learnedFrom`,
the same shape). A user's edit wins: when the spec now gives a knob another value than the one
its override was learned against, that override is dropped and the spec value is in force; the
tuner re-learns from there within its bounds. The spec is never written (GitOps).
Overrides without a `learnedFrom` entry are the rollout guard's fallback profile; they end with
the revision, not with an edit.

Pure functions: the reconcile (handlers.py) renders `in_force(...)`, the tuning timer
(tuning.py) writes it back to status and says which overrides it dropped.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Mapping

from tokenlane.operator.api.tuning_types import GLOBAL, GLOBAL_KNOBS, LANE_KNOBS, EffectiveBudgets

LEARNED_FROM = "learnedFrom"
SPEC, TUNER, FALLBACK = "spec", "tuner", "fallback"


@dataclass(frozen=True)
class DroppedOverride:
    scope: str  # lane name, or GLOBAL
    knob: str
    override: Any
    learned_from: Any
    spec_now: Any

    def __str__(self) -> str:
        where = "" if self.scope == GLOBAL else f"{self.scope}."
        return (f"{where}{self.knob}: spec changed {self.learned_from}->{self.spec_now}, "
                f"tuner override {self.override} dropped")


def budgets_of(desired: Any) -> EffectiveBudgets:
    """The budgets a builders.Desired puts in force over every pool (lanes) and the shared
    pool (global knobs)."""
    lanes: dict[str, dict] = {}
    for pool in desired.pools:
        part = EffectiveBudgets.from_config(pool.config)
        for name in pool.lanes:
            lanes[name] = dict(part.lanes[name])
    shared = EffectiveBudgets.from_config(desired.shared.config)
    return EffectiveBudgets(lanes, dict(shared.global_))


def stale_overrides(overrides: Mapping[str, Any], spec: EffectiveBudgets) -> list[DroppedOverride]:
    """The tuner overrides whose knob the user has edited since they were learned."""
    learned = (overrides or {}).get(LEARNED_FROM) or {}
    found = []
    for lane, knobs in sorted(((overrides or {}).get("lanes") or {}).items()):
        for knob, value in sorted(knobs.items()):
            was = ((learned.get("lanes") or {}).get(lane) or {}).get(knob)
            if was is not None and spec.get(lane, knob) != was:
                found.append(DroppedOverride(lane, knob, value, was, spec.get(lane, knob)))
    for knob, value in sorted(((overrides or {}).get("scheduler") or {}).items()):
        was = (learned.get("scheduler") or {}).get(knob)
        if was is not None and spec.get(GLOBAL, knob) != was:
            found.append(DroppedOverride(GLOBAL, knob, value, was, spec.get(GLOBAL, knob)))
    return found


def in_force(overrides: Mapping[str, Any], spec: EffectiveBudgets) -> dict[str, Any]:
    """`status.overrides` without the overrides of edited knobs (and their learnedFrom)."""
    return without(overrides, stale_overrides(overrides, spec))


def without(overrides: Mapping[str, Any], dropped: list[DroppedOverride]) -> dict[str, Any]:
    out = copy.deepcopy(dict(overrides or {}))
    for d in dropped:
        for section in (out, out.get(LEARNED_FROM) or {}):
            if d.scope == GLOBAL:
                (section.get("scheduler") or {}).pop(d.knob, None)
            else:
                (section.get("lanes") or {}).get(d.scope, {}).pop(d.knob, None)
    return _pruned(out)


def with_learned_from(overrides: Mapping[str, Any], spec: EffectiveBudgets) -> dict[str, Any]:
    """`overrides` with `learnedFrom` recording the spec value of every tuner knob in it; an
    entry already there is kept (the override was learned against that one)."""
    out = copy.deepcopy(dict(overrides or {}))
    old = out.get(LEARNED_FROM) or {}
    lanes: dict[str, dict] = {}
    for lane, knobs in (out.get("lanes") or {}).items():
        for knob in knobs:
            was = ((old.get("lanes") or {}).get(lane) or {}).get(knob, spec.get(lane, knob))
            if knob in LANE_KNOBS and was is not None:
                lanes.setdefault(lane, {})[knob] = was
    sched = {}
    for knob in (out.get("scheduler") or {}):
        was = (old.get("scheduler") or {}).get(knob, spec.get(GLOBAL, knob))
        if knob in GLOBAL_KNOBS and was is not None:
            sched[knob] = was
    out[LEARNED_FROM] = {"lanes": lanes, "scheduler": sched}
    return _pruned(out)


def lane_sources(overrides: Mapping[str, Any], lane: str, values: Mapping[str, Any]) -> dict[str, dict]:
    """`{knob: {value, source}}` of one lane's tuned knobs in force: `tuner` for the lane's
    override, `fallback` for a global key of the fallback profile, else `spec`."""
    tuned = ((overrides or {}).get("lanes") or {}).get(lane) or {}
    learned_global = ((overrides or {}).get(LEARNED_FROM) or {}).get("scheduler") or {}
    fallback = {k for k in ((overrides or {}).get("scheduler") or {}) if k not in learned_global}
    out = {}
    for knob in LANE_KNOBS:
        if knob not in values:
            continue
        source = TUNER if knob in tuned else FALLBACK if knob in fallback else SPEC
        out[knob] = {"value": values[knob], "source": source}
    return out


def _pruned(overrides: dict) -> dict:
    """Empty lanes and sections removed (an override set with nothing left is `{}`)."""
    for section in (overrides, overrides.get(LEARNED_FROM) or {}):
        if isinstance(section.get("lanes"), dict):
            section["lanes"] = {k: v for k, v in section["lanes"].items() if v}
        for key in ("lanes", "scheduler"):
            if key in section and not section[key]:
                section.pop(key)
    if LEARNED_FROM in overrides and not overrides[LEARNED_FROM]:
        overrides.pop(LEARNED_FROM)
    if set(overrides) == {LEARNED_FROM}:
        return {}
    return {k: v for k, v in overrides.items() if v}
