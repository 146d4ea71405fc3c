"""CRDs: generated files up to date, structural, samples valid, CEL rules exercised (cel-python)."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import celpy
import jsonschema
import pytest
import yaml

from crd_cases import (  # tests/operator, put on sys.path by conftest
    LANE_INVALID,
    MSVC_INVALID,
    OUT_OF_RANGE,
    invalid_lane,
    invalid_model_service,
    sample_docs,
    set_field,
)
from tokenlane.operator.api import schema
from tokenlane.operator.api.resources import parse_model_service, parse_serving_lane
from tokenlane.runtime.config import EngineConfig, SchedulerConfig

ROOT = Path(__file__).resolve().parents[2]


def _docs() -> list[dict]:
    return sample_docs()


def _sample(kind: str, name: str) -> dict:
    return copy.deepcopy(next(d for d in _docs() if d["kind"] == kind and d["metadata"]["name"] == name))


def test_crd_files_are_generated_from_schema():
    for name, text in schema.render_crd_files().items():
        assert (ROOT / "crds" / name).read_text() == text, f"crds/{name} is stale: python -m tokenlane.operator.api.schema crds/"


@pytest.mark.parametrize("kind", ["ModelService", "ServingLane"])
def test_schema_is_structural(kind):
    """Every node has a type (or int-or-string / preserve-unknown), descriptions on properties."""
    def walk(node, path):
        assert "type" in node or node.get("x-kubernetes-int-or-string"), f"{path}: no type"
        if node.get("type") == "object":
            for key, sub in node.get("properties", {}).items():
                if path != "" or key not in ("apiVersion", "kind", "metadata"):
                    assert sub.get("description"), f"{path}.{key}: no description (kubectl explain)"
                walk(sub, f"{path}.{key}")
            if isinstance(node.get("additionalProperties"), dict):
                walk(node["additionalProperties"], f"{path}.*")
        if node.get("type") == "array":
            walk(node["items"], f"{path}[]")
    walk(schema.crd_schema(kind), "")


def test_crd_metadata():
    ms = yaml.safe_load((ROOT / "crds" / "modelservices.tokenlane.dev.yaml").read_text())
    version = ms["spec"]["versions"][0]
    assert ms["spec"]["names"]["shortNames"] == ["msvc"]
    assert version["subresources"]["scale"] == {"specReplicasPath": ".spec.replicas",
                                                "statusReplicasPath": ".status.replicas",
                                                "labelSelectorPath": ".status.selector"}
    assert "status" in version["subresources"]
    assert [c["name"] for c in version["additionalPrinterColumns"]][:4] == ["Replicas", "Ready", "Lanes", "SLO Met"]
    lane = yaml.safe_load((ROOT / "crds" / "servinglanes.tokenlane.dev.yaml").read_text())
    assert lane["spec"]["names"]["shortNames"] == ["lane"]
    # `kubectl get lane` shows whether tuner (or fallback) overrides are in force for a lane.
    overrides = next(c for c in lane["spec"]["versions"][0]["additionalPrinterColumns"] if c["name"] == "Overrides")
    assert overrides["jsonPath"] == ".status.overriddenKnobs" and overrides["type"] == "integer"


def test_scheduler_defaults_are_the_runtimes():
    """The CRD's defaults (the documented starting budgets) equal the runtime's SchedulerConfig defaults."""
    defaults = SchedulerConfig()
    for key, value in schema.SCHEDULER_DEFAULTS.items():
        attr = "".join("_" + c.lower() if c.isupper() else c for c in key)
        assert getattr(defaults, attr) == value, key
    spec = schema.crd_schema("ModelService")["properties"]["spec"]
    engine = spec["properties"]["engine"]["properties"]
    for f in dataclasses.fields(EngineConfig):
        key = f.name.split("_")[0] + "".join(p.title() for p in f.name.split("_")[1:])
        if key in schema.ENGINE_KEYS_ELSEWHERE:  # e.g. spec.parallelism.tensor
            section, field = schema.ENGINE_KEYS_ELSEWHERE[key].split(".")
            assert field in spec["properties"][section]["properties"], schema.ENGINE_KEYS_ELSEWHERE[key]
            continue
        assert key in engine, f"engine.{key} missing from the CRD"
        if "default" in engine[key] and f.default is not None:
            assert engine[key]["default"] == f.default, key


# --------------------------------------------------------------------------- jsonschema


def _validator(kind):
    return jsonschema.Draft4Validator(schema.to_jsonschema(schema.crd_schema(kind)))


@pytest.mark.parametrize("doc", _docs(), ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_samples_validate_against_crd_schema(doc):
    errors = list(_validator(doc["kind"]).iter_errors(doc))
    assert not errors, [e.message for e in errors]
    defaulted = schema.apply_defaults(schema.crd_schema(doc["kind"]), doc)
    assert not list(_validator(doc["kind"]).iter_errors(defaulted))
    assert not cel_failures(doc["kind"], defaulted)


# --------------------------------------------------------------------------- CEL


def _typed(node_schema, value):
    """JSON -> CEL values as the API server types them (a `number` field holding 1 is a double)."""
    if isinstance(value, dict):
        props = node_schema.get("properties", {})
        extra = node_schema.get("additionalProperties") if isinstance(node_schema.get("additionalProperties"), dict) else {}
        return {k: _typed(props.get(k, extra), v) for k, v in value.items()}
    if isinstance(value, list):
        return [_typed(node_schema.get("items", {}), v) for v in value]
    if node_schema.get("type") == "number" and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


def _nodes(value, path):
    """Values at a cel_rules path like .spec.budgets or .spec.tenants[*]."""
    parts = [p for p in path.replace("[*]", ".[*]").split(".") if p]
    current = [value]
    for part in parts:
        nxt = []
        for v in current:
            if part == "[*]":
                nxt += list(v) if isinstance(v, list) else []
            elif isinstance(v, dict) and part in v:
                nxt.append(v[part])
        current = nxt
    return current


_ENV = celpy.Environment()


def cel_failures(kind: str, obj: dict) -> list[str]:
    root_schema = schema.crd_schema(kind)
    typed = _typed(root_schema, obj)
    failures = []
    for path, rule, message in schema.cel_rules(root_schema):
        program = _ENV.program(_ENV.compile(rule))
        for node in _nodes(typed, path if path != "." else ""):
            result = program.evaluate({"self": celpy.json_to_cel(node)})
            if isinstance(result, Exception) or not bool(result):
                failures.append(f"{path}: {message}")
    return failures


def _defaulted_nodes(node: dict, path: str = ""):
    """(path, node) of every schema node that carries a `default`."""
    if "default" in node:
        yield path, node
    for key, sub in node.get("properties", {}).items():
        yield from _defaulted_nodes(sub, f"{path}.{key}")
    if "items" in node:
        yield from _defaulted_nodes(node["items"], f"{path}[*]")


@pytest.mark.parametrize("kind", ["ModelService", "ServingLane"])
def test_every_default_passes_its_own_rules(kind):
    """The API server checks each `default` against the schema and CEL rules of its node as
    written (nested defaults are not filled first): kube-apiserver refused the CRD whose
    `scheduler: {default: {}}` had rules reading keys."""
    for path, node in _defaulted_nodes(schema.crd_schema(kind)):
        default = node["default"]
        assert not list(jsonschema.Draft4Validator(schema.to_jsonschema(node)).iter_errors(default)), path
        for rule_path, rule, message in schema.cel_rules(node):
            program = _ENV.program(_ENV.compile(rule))
            for value in _nodes(_typed(node, default), rule_path if rule_path != "." else ""):
                result = program.evaluate({"self": celpy.json_to_cel(value)})
                assert not isinstance(result, Exception) and bool(result), f"{path}{rule_path}: {message} ({result})"


def test_every_cel_rule_compiles():
    for kind in ("ModelService", "ServingLane"):
        for path, rule, _ in schema.cel_rules(schema.crd_schema(kind)):
            _ENV.compile(rule)


def test_cel_root_rules_on_names():
    doc = _sample("ModelService", "tiny")
    doc["metadata"]["name"] = "m" * 51
    doc = schema.apply_defaults(schema.crd_schema("ModelService"), doc)
    assert any("at most 50" in f for f in cel_failures("ModelService", doc))
    lane = _sample("ServingLane", "tiny-batch")
    del lane["spec"]["laneName"]
    lane["metadata"]["name"] = "team.batch"
    defaulted = schema.apply_defaults(schema.crd_schema("ServingLane"), lane)
    assert any("set spec.laneName" in f for f in cel_failures("ServingLane", defaulted))
    with pytest.raises(ValueError, match="laneName"):
        parse_serving_lane(lane)


@pytest.mark.parametrize("field,value,message", MSVC_INVALID, ids=[c[0] + "=" + str(c[1]) for c in MSVC_INVALID])
def test_cel_refuses_invalid_model_service(field, value, message):
    doc = invalid_model_service(field, value)
    failures = cel_failures("ModelService", schema.apply_defaults(schema.crd_schema("ModelService"), doc))
    assert any(message in f for f in failures), failures
    # The operator refuses the same object with a message naming the field (no API server needed).
    with pytest.raises(ValueError):
        parse_model_service(doc)


@pytest.mark.parametrize("field,value,message", LANE_INVALID, ids=[c[0] for c in LANE_INVALID])
def test_cel_refuses_invalid_lane(field, value, message):
    doc = invalid_lane(field, value)
    failures = cel_failures("ServingLane", schema.apply_defaults(schema.crd_schema("ServingLane"), doc))
    assert any(message in f for f in failures), failures
    with pytest.raises(ValueError):
        parse_serving_lane(doc)


@pytest.mark.parametrize("field,value", OUT_OF_RANGE)
def test_schema_refuses_out_of_range(field, value):
    doc = _sample("ModelService", "tiny")
    set_field(doc, field, value)
    assert list(_validator("ModelService").iter_errors(doc))
    with pytest.raises(ValueError, match=field.split(".")[-1]):
        parse_model_service(doc)


def test_defaults_fill_a_minimal_model_service():
    ms = parse_model_service({"apiVersion": "tokenlane.dev/v1alpha1", "kind": "ModelService",
                              "metadata": {"name": "m", "namespace": "ns"}, "spec": {"model": {"path": "/m"}}})
    assert ms.spec["scheduler"] == {**schema.SCHEDULER_DEFAULTS}
    assert ms.spec["replicas"] == 1 and ms.spec["gpus"] == {"count": 1, "resourceName": "nvidia.com/gpu"}
    assert ms.spec["tuning"]["enabled"] is False and ms.spec["rollout"]["fallback"]["policy"] == "LastKnownGood"
