"""Pure planner: desired objects vs observed objects -> the actions that make them equal.

- create: desired, not observed;
- apply:  observed, but a field we manage differs (someone edited it) or the builders'
          output changed (the `tokenlane.dev/applied-hash` annotation differs: this also
          catches fields we stopped setting, which a subset comparison cannot see);
- delete: observed with our labels for this ModelService but no longer desired (a lane turned
          shared, a dedicated lane removed, the ServiceMonitor disabled).
Nothing when everything matches: a steady state makes no writes.

"Fields we manage" = the desired object's fields; the API server adds defaults (protocol,
terminationMessagePath, ...) and status, which are ignored by comparing desired as a subset.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Literal, Optional

from tokenlane.operator.builders import (
    ANNOTATION_APPLIED_HASH,
    LABEL_INSTANCE,
    LABEL_MANAGED_BY,
    MANAGED_BY,
)

Key = tuple[str, str, str, str]  # apiVersion, kind, namespace, name


@dataclass(frozen=True)
class Action:
    verb: Literal["create", "apply", "delete"]
    key: Key
    obj: Optional[dict]  # the desired object (create/apply); None for delete
    reason: str  # why: "missing", "changed", "drifted: spec.replicas", "not desired"


def key_of(obj: dict) -> Key:
    meta = obj.get("metadata") or {}
    return (obj["apiVersion"], obj["kind"], meta.get("namespace") or "", meta["name"])


def first_difference(desired: Any, observed: Any, path: str = "") -> Optional[str]:
    """Path of the first desired field the observed object lacks or holds differently, else None."""
    if isinstance(desired, dict):
        if not isinstance(observed, dict):
            return path or "."
        for k, v in desired.items():
            diff = first_difference(v, observed.get(k), f"{path}.{k}")
            if diff:
                return diff
        return None
    if isinstance(desired, list):
        if not isinstance(observed, list) or len(desired) != len(observed):
            return path
        for i, (d, o) in enumerate(zip(desired, observed)):
            diff = first_difference(d, o, f"{path}[{i}]")
            if diff:
                return diff
        return None
    if desired != observed and str(desired) != str(observed):  # "8000" vs 8000 in int-or-string fields
        return path
    return None


def is_ours(obj: dict, owner_name: str) -> bool:
    labels = (obj.get("metadata") or {}).get("labels") or {}
    return labels.get(LABEL_MANAGED_BY) == MANAGED_BY and labels.get(LABEL_INSTANCE) == owner_name


def plan(desired: Iterable[dict], observed: Iterable[dict], owner_name: str) -> list[Action]:
    """Actions in order: creates/applies in desired order, then deletes (new before old)."""
    observed_by_key = {key_of(o): o for o in observed}
    actions: list[Action] = []
    desired_keys = set()
    for obj in desired:
        key = key_of(obj)
        desired_keys.add(key)
        current = observed_by_key.get(key)
        if current is None or (current.get("metadata") or {}).get("deletionTimestamp"):
            actions.append(Action("create", key, obj, "missing"))
            continue
        want_hash = obj["metadata"].get("annotations", {}).get(ANNOTATION_APPLIED_HASH)
        have_hash = ((current.get("metadata") or {}).get("annotations") or {}).get(ANNOTATION_APPLIED_HASH)
        if want_hash != have_hash:
            actions.append(Action("apply", key, obj, "changed"))
            continue
        diff = first_difference(obj, current)
        if diff:
            actions.append(Action("apply", key, obj, f"drifted: {diff.lstrip('.')}"))
    for key, current in observed_by_key.items():
        if key not in desired_keys and is_ours(current, owner_name):
            if not (current.get("metadata") or {}).get("deletionTimestamp"):
                actions.append(Action("delete", key, None, "not desired"))
    return actions
