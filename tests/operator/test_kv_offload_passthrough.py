"""`ModelService.spec.engine.kvOffload` reaches the runtime's config (a restart field) and the CRD."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import yaml

from tokenlane.operator.api.resources import parse_model_service, parse_serving_lane
from tokenlane.operator.api import schema
from tokenlane.operator.api.schema import model_service_spec
from tokenlane.operator.desired import builders
from tokenlane.operator.desired.builders import build
from tokenlane.runtime.config import KVOffloadConfig, loads_config

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).parent))
from test_crds import _validator, cel_failures  # noqa: E402


def _sample():
    docs = [d for d in yaml.safe_load_all((ROOT / "manifests" / "samples" / "llama3-8b.yaml").read_text())
            if d and d.get("kind") in ("ModelService", "ServingLane")]
    msvc = copy.deepcopy(docs[0])
    msvc["metadata"]["uid"] = "u-1"
    return msvc, [parse_serving_lane(d) for d in docs[1:]]


def _deployment_and_config(desired, name="llama3-8b"):
    dep = next(o for o in desired.objects if o["kind"] == "Deployment" and o["metadata"]["name"] == name)
    cm = next(o for o in desired.objects if o["kind"] == "ConfigMap" and o["metadata"]["name"] == f"{name}-config")
    return dep, loads_config(cm["data"]["runtime.yaml"])


def test_kv_offload_is_rendered_into_runtime_yaml_and_restarts_the_pods():
    doc, lanes = _sample()
    before_dep, before = _deployment_and_config(build(parse_model_service(doc), lanes))
    assert before.engine.kv_offload is None
    doc["spec"].setdefault("engine", {})["kvOffload"] = {"hostBytes": 8 << 30}
    after_dep, after = _deployment_and_config(build(parse_model_service(doc), lanes))
    assert after.engine.kv_offload == KVOffloadConfig(host_bytes=8 << 30)
    restart_hash = lambda dep: dep["spec"]["template"]["metadata"]["annotations"][builders.ANNOTATION_RESTART_HASH]
    assert restart_hash(before_dep) != restart_hash(after_dep)


def test_the_crd_declares_kv_offload():
    engine = model_service_spec()["properties"]["engine"]
    offload = engine["properties"]["kvOffload"]
    assert offload["required"] == ["hostBytes"]
    assert offload["properties"]["hostBytes"]["type"] == "integer"
    assert "kvOffload" not in engine["default"], "unset by default: older specs keep their restart hash"
    assert any("kvOffload" in rule["rule"] for rule in engine["x-kubernetes-validations"])


def test_the_crd_refuses_kv_offload_without_prefix_caching():
    doc, _ = _sample()
    doc["spec"].setdefault("engine", {})["kvOffload"] = {"hostBytes": 8 << 30}
    defaulted = schema.apply_defaults(schema.crd_schema("ModelService"), doc)
    assert not list(_validator("ModelService").iter_errors(defaulted))
    assert not cel_failures("ModelService", defaulted)
    doc["spec"]["engine"]["enablePrefixCaching"] = False
    defaulted = schema.apply_defaults(schema.crd_schema("ModelService"), doc)
    assert cel_failures("ModelService", defaulted) == [
        ".spec.engine: kvOffload keeps prefix-cache blocks, so it needs enablePrefixCaching: true"
    ]
    doc["spec"]["engine"]["kvOffload"] = {}
    assert any("hostBytes" in e.message for e in _validator("ModelService").iter_errors(doc))
