"""ModelService spec.tenants[].weight and tokensPerMinute: the CRD schema bounds them and the
builders pass them through to the runtime.yaml (pure, no cluster)."""

from __future__ import annotations

import copy

import jsonschema
import pytest

from crd_cases import sample  # tests/operator, put on sys.path by conftest
from tokenlane.operator.api import schema
from tokenlane.operator.desired.builders import build
from tokenlane.operator.api.resources import parse_model_service
from tokenlane.runtime.config import loads_config


def _with_tenants(tenants):
    doc = sample("ModelService", "llama3-8b")
    doc["spec"]["tenants"] = tenants
    return doc


def _errors(doc):
    validator = jsonschema.Draft4Validator(schema.to_jsonschema(schema.crd_schema("ModelService")))
    return [e.message for e in validator.iter_errors(doc)]


def test_weight_and_rate_reach_the_runtime_config():
    doc = _with_tenants([{"name": "team-a", "weight": 3, "tokensPerMinute": 12000}, {"name": "team-b"}])
    assert not _errors(doc)
    doc = copy.deepcopy(doc)
    doc["metadata"]["uid"] = "u-1"
    desired = build(parse_model_service(doc), [])
    config_map = next(o for o in desired.objects if o["kind"] == "ConfigMap")
    config = loads_config(config_map["data"]["runtime.yaml"])
    a, b = config.tenants
    assert (a.weight, a.tokens_per_minute) == (3, 12000)
    assert (b.fair_share_weight, b.tokens_per_minute) == (1.0, None)  # unset: the runtime's defaults


@pytest.mark.parametrize("tenant", [
    {"name": "a", "weight": 0},
    {"name": "a", "weight": 1001},
    {"name": "a", "tokensPerMinute": 0},
    {"name": "a", "tokensPerMinute": 1.5},
])
def test_schema_refuses_out_of_range_values(tenant):
    assert _errors(_with_tenants([tenant]))
