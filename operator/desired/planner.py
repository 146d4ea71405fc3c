"""Pure planner: desired objects vs observed objects -> the actions that make them equal.

- create: desired, not observed;
- apply:  observed, but a field we manage differs (someone edited it) or the builders'
          output changed (the `tokenlane.dev/applied-hash` annotation differs: this also
          catches fields we stopped setting, which a subset comparison cannot see);
- delete: observed with our labels for this ModelService but no longer desired (a lane turned
          shared, a dedicated lane removed, the ServiceMonitor disabled).
Nothing when everything matches: a steady state makes no writes.

Drift = a field we render is no longer ours. On a real API server that question is answered
by managed fields: every server-side apply records the fields the applier owns, and anyone who
changes one of them (kubectl edit, a client-side apply, a controller) takes it over, so a
desired field missing from our Apply entry is drift. Comparing values instead never settles:
the server normalizes what it stores (omits `readOnly: false`, rewrites quantities, adds
defaults). Servers without managed fields (the kmock emulator) fall back to comparing the
desired object as a subset of the observed one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Iterable, Literal, Optional

from tokenlane.operator.desired.builders import (
    ANNOTATION_APPLIED_HASH,
    FIELD_MANAGER,
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


def applied_fields(observed: dict, manager: str = FIELD_MANAGER) -> Optional[dict]:
    """The FieldsV1 set `manager` owns through server-side apply of the object itself, or None
    when the server keeps no managed fields (or `manager` never applied it)."""
    for entry in (observed.get("metadata") or {}).get("managedFields") or []:
        if entry.get("manager") == manager and entry.get("operation") == "Apply" and not entry.get("subresource"):
            return entry.get("fieldsV1") or {}
    return None


def _list_entry(item: Any, fields: dict) -> Optional[dict]:
    """The FieldsV1 entry of one list element: `k:{...}` for map lists (keys the element holds,
    or lacks because the server defaults them, like a port's protocol), `v:...` for sets."""
    if not isinstance(item, dict):
        return fields.get("v:" + json.dumps(item, separators=(",", ":")))
    for name, sub in fields.items():
        if name.startswith("k:"):
            keys = json.loads(name[2:])
            if all(k not in item or item[k] == v or str(item[k]) == str(v) for k, v in keys.items()):
                return sub
    return None


def first_unowned(desired: Any, fields: dict, path: str = "") -> Optional[str]:
    """Path of the first desired field that `fields` (a FieldsV1 set) does not own, else None.
    An empty set below a present key owns everything under it (atomic lists and structs)."""
    if not fields or set(fields) == {"."}:
        return None
    if isinstance(desired, dict):
        for k, v in desired.items():
            if v is None:
                continue
            sub = fields.get(f"f:{k}")
            if sub is None:
                return f"{path}.{k}"
            diff = first_unowned(v, sub, f"{path}.{k}")
            if diff:
                return diff
        return None
    if isinstance(desired, list):
        for i, item in enumerate(desired):
            sub = _list_entry(item, fields)
            if sub is None:
                return f"{path}[{i}]"
            diff = first_unowned(item, sub, f"{path}[{i}]")
            if diff:
                return diff
    return None


def drift(desired: dict, observed: dict) -> Optional[str]:
    """Path of the first rendered field someone else changed, else None."""
    fields = applied_fields(observed)
    if fields is None:
        return first_difference(desired, observed)
    # Identity (apiVersion, kind, name, namespace) is not a field anyone owns.
    rendered = {k: v for k, v in desired.items() if k not in ("apiVersion", "kind")}
    rendered["metadata"] = {k: v for k, v in desired["metadata"].items() if k not in ("name", "namespace")}
    return first_unowned(rendered, fields)


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
        diff = drift(obj, current)
        if diff:
            actions.append(Action("apply", key, obj, f"drifted: {diff.lstrip('.')}"))
    for key, current in observed_by_key.items():
        if key not in desired_keys and is_ours(current, owner_name):
            if not (current.get("metadata") or {}).get("deletionTimestamp"):
                actions.append(Action("delete", key, None, "not desired"))
    return actions
