"""spec.gateway.inferencePool: the InferencePool the builders render, checked against the upstream
CRD's schema and CEL rules (../shared/k8s/thirdparty-crds), beside the router (pure)."""

from __future__ import annotations

import os
from pathlib import Path

import celpy
import jsonschema
import pytest
import yaml

from tokenlane.operator.api import schema
from tokenlane.operator.api.resources import parse_model_service
from tokenlane.operator.desired import builders, planner

# As tests/cluster/cluster_harness.py finds ../shared/k8s.
SHARED_K8S = Path(os.environ.get("TOKENLANE_SHARED_K8S", Path(__file__).resolve().parents[2].parent / "shared" / "k8s"))
UPSTREAM_CRD = SHARED_K8S / "thirdparty-crds" / "inference.networking.k8s.io_inferencepools.yaml"


def msvc(gateway=None, router=False, port=8000, lanes_dedicated=False):
    spec = {"model": {"path": "/models/base"}, "port": port, "router": {"enabled": router}}
    if gateway is not None:
        spec["gateway"] = gateway
    return parse_model_service({"apiVersion": "tokenlane.dev/v1alpha1", "kind": "ModelService",
                                "metadata": {"name": "m", "namespace": "ns", "uid": "u-1"}, "spec": spec})


def pools(desired):
    return [o for o in desired.objects if o["kind"] == "InferencePool"]


@pytest.fixture(scope="module")
def upstream_schema():
    if not UPSTREAM_CRD.exists():
        pytest.skip(f"the upstream InferencePool CRD is not at {UPSTREAM_CRD}")
    crd = yaml.safe_load(UPSTREAM_CRD.read_text())
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    return version["schema"]["openAPIV3Schema"]


def _nodes(obj, path):
    parts = [p for p in path.split(".") if p]
    nodes = [obj]
    for part in parts:
        nxt = []
        for node in nodes:
            if part.endswith("[*]"):
                nxt += list((node or {}).get(part[:-3]) or [])
            elif isinstance(node, dict) and part in node:
                nxt.append(node[part])
        nodes = nxt
    return nodes


def upstream_failures(upstream_schema, obj) -> list[str]:
    """What the API server would refuse in `obj`: structural errors, then the CRD's CEL rules."""
    validator = jsonschema.Draft4Validator(schema.to_jsonschema(upstream_schema))
    failures = [e.message for e in validator.iter_errors(obj)]
    defaulted = schema.apply_defaults(upstream_schema, obj)
    env = celpy.Environment()
    for path, rule, message in schema.cel_rules(upstream_schema):
        program = env.program(env.compile(rule))
        for node in _nodes(defaulted, "" if path == "." else path):
            result = program.evaluate({"self": celpy.json_to_cel(node)})
            if isinstance(result, Exception) or not bool(result):
                failures.append(f"{path}: {message}")
    return failures


PICKER = {"service": "epp", "port": 9002}
CASES = [
    ("defaults", {"inferencePool": {"enabled": True, "endpointPicker": {"service": "epp"}}},
     {"name": "epp", "port": 9002, "failureMode": "FailClose"}),
    ("fail open", {"inferencePool": {"enabled": True, "endpointPicker": {**PICKER, "failureMode": "FailOpen"}}},
     {"name": "epp", "port": 9002, "failureMode": "FailOpen"}),
    ("other port", {"inferencePool": {"enabled": True, "endpointPicker": {"service": "picker", "port": 9102}}},
     {"name": "picker", "port": 9102, "failureMode": "FailClose"}),
]


@pytest.mark.parametrize("what,gateway,picker", CASES, ids=[c[0] for c in CASES])
def test_inference_pool_selects_the_shared_pool_and_names_the_picker(what, gateway, picker, upstream_schema):
    desired = builders.build(msvc(gateway, port=8080), [])
    [pool] = pools(desired)
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1" and pool["metadata"]["name"] == "m"
    ref = pool["spec"]["endpointPickerRef"]
    assert (ref["name"], ref["port"]["number"], ref["failureMode"], ref["kind"]) == \
        (picker["name"], picker["port"], picker["failureMode"], "Service")
    # It selects exactly the shared pool's pods, on the port their container serves the API on.
    deployment = next(o for o in desired.objects if o["kind"] == "Deployment" and o["metadata"]["name"] == "m")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert pool["spec"]["selector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]
    container_ports = [p["containerPort"] for p in deployment["spec"]["template"]["spec"]["containers"][0]["ports"]]
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == container_ports == [8080]
    # Owned by the ModelService: deleting it garbage-collects the pool.
    assert pool["metadata"]["ownerReferences"][0]["uid"] == "u-1"
    assert pool["metadata"]["ownerReferences"][0]["controller"] is True
    assert not upstream_failures(upstream_schema, pool)


@pytest.mark.parametrize("gateway", [None, {}, {"inferencePool": {}},
                                     {"inferencePool": {"enabled": False, "endpointPicker": PICKER}}])
def test_no_pool_unless_enabled(gateway):
    assert not pools(builders.build(msvc(gateway), []))


def test_no_pool_where_the_server_lacks_the_crd():
    gateway = {"inferencePool": {"enabled": True, "endpointPicker": PICKER}}
    desired = builders.build(msvc(gateway), [], inference_pool_available=False)
    assert not pools(desired) and any(o["kind"] == "Deployment" for o in desired.objects)


def test_router_and_pool_side_by_side():
    gateway = {"inferencePool": {"enabled": True, "endpointPicker": PICKER}}
    desired = builders.build(msvc(gateway, router=True), [])
    names = {(o["kind"], o["metadata"]["name"]) for o in desired.objects}
    assert {("InferencePool", "m"), ("Deployment", "m-router"), ("Service", "m-router"), ("Service", "m")} <= names
    # The pool selects runtime pods only, never the router's.
    [pool] = pools(desired)
    router = next(o for o in desired.objects if o["kind"] == "Deployment" and o["metadata"]["name"] == "m-router")
    router_labels = router["spec"]["template"]["metadata"]["labels"]
    assert not pool["spec"]["selector"]["matchLabels"].items() <= router_labels.items()


def test_enabled_without_a_picker_is_refused():
    with pytest.raises(ValueError, match="inferencePool.enabled needs inferencePool.endpointPicker"):
        msvc({"inferencePool": {"enabled": True}})


def test_disabling_the_pool_deletes_it_and_a_steady_pool_plans_nothing():
    gateway = {"inferencePool": {"enabled": True, "endpointPicker": PICKER}}
    with_pool = builders.build(msvc(gateway), []).objects
    assert planner.plan(with_pool, with_pool, "m") == []
    without = builders.build(msvc({"inferencePool": {"enabled": False}}), []).objects
    actions = planner.plan(without, with_pool, "m")
    assert [(a.verb, a.key[1]) for a in actions] == [("delete", "InferencePool")]
