"""Planner: desired vs observed -> actions, table-driven."""

from __future__ import annotations

import copy

import pytest

from tokenlane.operator.desired.builders import ANNOTATION_APPLIED_HASH, LABEL_INSTANCE, LABEL_MANAGED_BY, MANAGED_BY
from tokenlane.operator.desired.planner import first_difference, plan


def obj(kind="ConfigMap", name="m-config", data=None, applied="h1", owner="m", **extra):
    o = {"apiVersion": "v1", "kind": kind,
         "metadata": {"name": name, "namespace": "ns", "labels": {LABEL_MANAGED_BY: MANAGED_BY, LABEL_INSTANCE: owner},
                      "annotations": {ANNOTATION_APPLIED_HASH: applied}},
         "data": data or {"a": "1"}}
    o.update(extra)
    return o


def server_copy(o, **changes):
    """What the API server returns: our fields plus defaults and bookkeeping."""
    c = copy.deepcopy(o)
    c["metadata"].update({"uid": "x", "resourceVersion": "7", "managedFields": []})
    c["metadata"].update(changes.pop("metadata", {}))
    c.update(changes)
    return c


CASES = [
    ("missing -> create", [obj()], [], [("create", "m-config", "missing")]),
    ("equal -> nothing", [obj()], [server_copy(obj())], []),
    ("server defaults are not drift", [obj(spec={"ports": [{"port": 80}]})],
     [server_copy(obj(spec={"ports": [{"port": 80, "protocol": "TCP"}]}))], []),
    ("builder output changed -> apply", [obj(data={"a": "2"}, applied="h2")], [server_copy(obj())],
     [("apply", "m-config", "changed")]),
    ("edited by someone -> apply (drift)", [obj()], [server_copy(obj(), data={"a": "9"})],
     [("apply", "m-config", "drifted: data.a")]),
    ("list length differs -> drift", [obj(spec={"x": [1, 2]})], [server_copy(obj(spec={"x": [1]}))],
     [("apply", "m-config", "drifted: spec.x")]),
    ("int-or-string equal", [obj(spec={"maxUnavailable": 1})], [server_copy(obj(spec={"maxUnavailable": "1"}))], []),
    ("ours, not desired -> delete", [], [server_copy(obj(name="old"))], [("delete", "old", "not desired")]),
    ("not ours -> left alone", [], [server_copy(obj(name="theirs", owner="other"))], []),
    ("being deleted -> create again", [obj()], [server_copy(obj(), metadata={"deletionTimestamp": "t"})],
     [("create", "m-config", "missing")]),
    ("order: create/apply before delete", [obj(name="new")], [server_copy(obj(name="old"))],
     [("create", "new", "missing"), ("delete", "old", "not desired")]),
]


@pytest.mark.parametrize("desired,observed,expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_plan(desired, observed, expected):
    actions = plan(desired, observed, "m")
    assert [(a.verb, a.key[3], a.reason) for a in actions] == expected
    for a in actions:
        assert (a.obj is None) == (a.verb == "delete")


def test_first_difference_paths():
    assert first_difference({"a": {"b": [1, {"c": 2}]}}, {"a": {"b": [1, {"c": 3}]}}) == ".a.b[1].c"
    assert first_difference({"a": 1}, {"a": 1, "extra": 2}) is None
    assert first_difference({"a": {"b": 1}}, {"a": None}) == ".a"


# --------------------------------------------------------------------------- managed fields (a real API server)


def with_fields(o, fields, manager="tokenlane-operator", operation="Apply", **data_changes):
    """What a real API server returns: the stored object (normalized) and its managed fields."""
    c = server_copy(o)
    c.update(data_changes)
    c["metadata"]["managedFields"] = [
        {"manager": manager, "operation": operation, "apiVersion": "v1", "fieldsType": "FieldsV1", "fieldsV1": fields},
        {"manager": "kube-controller-manager", "operation": "Update", "subresource": "status",
         "fieldsV1": {"f:status": {"f:replicas": {}}}},
    ]
    return c


OURS = {"f:metadata": {"f:labels": {f"f:{LABEL_MANAGED_BY}": {}, f"f:{LABEL_INSTANCE}": {}},
                       "f:annotations": {f"f:{ANNOTATION_APPLIED_HASH}": {}}},
        "f:data": {"f:a": {}}}
DEPLOY = {"spec": {"template": {"spec": {"containers": [{
    "name": "runtime", "args": ["--x"],
    "ports": [{"containerPort": 8000, "name": "http"}],
    "volumeMounts": [{"name": "models", "mountPath": "/models", "readOnly": False}]}]}}}}
DEPLOY_FIELDS = {**OURS, "f:spec": {"f:template": {"f:spec": {"f:containers": {'k:{"name":"runtime"}': {
    ".": {}, "f:name": {}, "f:args": {},
    "f:ports": {'k:{"containerPort":8000,"protocol":"TCP"}': {".": {}, "f:containerPort": {}, "f:name": {}}},
    "f:volumeMounts": {'k:{"mountPath":"/models"}': {".": {}, "f:name": {}, "f:mountPath": {}, "f:readOnly": {}}},
}}}}}}

MANAGED_CASES = [
    # The server dropped `readOnly: false` and defaulted the port's protocol: still ours, no drift.
    ("normalized by the server -> nothing", [obj(**DEPLOY)],
     [with_fields(obj(**DEPLOY), DEPLOY_FIELDS, spec={"template": {"spec": {"containers": [{
         "name": "runtime", "args": ["--x"], "ports": [{"containerPort": 8000, "name": "http", "protocol": "TCP"}],
         "volumeMounts": [{"name": "models", "mountPath": "/models"}]}]}}})], []),
    ("all fields ours -> nothing", [obj()], [with_fields(obj(), OURS)], []),
    ("someone took data.a over -> apply", [obj()],
     [with_fields(obj(), {**OURS, "f:data": {"f:b": {}}})], [("apply", "m-config", "drifted: data.a")]),
    ("a list item we render is gone -> apply", [obj(**DEPLOY)],
     [with_fields(obj(**DEPLOY), {**DEPLOY_FIELDS, "f:spec": {"f:template": {"f:spec": {"f:containers": {
         'k:{"name":"sidecar"}': {".": {}, "f:name": {}}}}}}})],
     [("apply", "m-config", "drifted: spec.template.spec.containers[0]")]),
    ("only an Update entry (never applied) -> value comparison", [obj()],
     [with_fields(obj(), OURS, operation="Update", data={"a": "9"})], [("apply", "m-config", "drifted: data.a")]),
    ("builder output changed wins over fields -> apply", [obj(applied="h2")], [with_fields(obj(), OURS)],
     [("apply", "m-config", "changed")]),
]


@pytest.mark.parametrize("desired,observed,expected", [c[1:] for c in MANAGED_CASES], ids=[c[0] for c in MANAGED_CASES])
def test_plan_with_managed_fields(desired, observed, expected):
    assert [(a.verb, a.key[3], a.reason) for a in plan(desired, observed, "m")] == expected


def test_first_unowned_sets_and_atomic_lists():
    from tokenlane.operator.desired.planner import first_unowned

    assert first_unowned({"finalizers": ["a", "b"]}, {"f:finalizers": {'v:"a"': {}, 'v:"b"': {}}}) is None
    assert first_unowned({"finalizers": ["a", "c"]}, {"f:finalizers": {'v:"a"': {}}}) == ".finalizers[1]"
    assert first_unowned({"args": ["--a", "--b"]}, {"f:args": {}}) is None  # atomic: owned whole
    assert first_unowned({"selector": {"matchLabels": {"x": "y"}}}, {"f:selector": {}}) is None
