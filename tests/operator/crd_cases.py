"""Invalid ModelServices and ServingLanes, and the message that refuses each: one table for the
offline checks (tests/operator/test_crds.py: cel-python, jsonschema, the operator's parser) and
the real API server (tests/cluster/test_crds_on_api_server.py)."""

from __future__ import annotations

import copy
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = sorted((ROOT / "manifests" / "samples").glob("*.yaml"))


def sample_docs() -> list[dict]:
    return [d for p in SAMPLES for d in yaml.safe_load_all(p.read_text())
            if d and d.get("kind") in ("ModelService", "ServingLane")]


def sample(kind: str, name: str) -> dict:
    return copy.deepcopy(next(d for d in sample_docs() if d["kind"] == kind and d["metadata"]["name"] == name))


def set_field(obj: dict, dotted: str, value) -> None:
    *head, last = dotted.split(".")
    for part in head:
        obj = obj.setdefault(part, {})
    obj[last] = value


# (field, value, message) on the llama3-8b sample; value None = remove tuning.prometheusUrl.
MSVC_INVALID = [
    ("spec.scheduler.kvCacheHighWatermark", 0.96, "kvCacheHighWatermark must be < kvCacheRejectWatermark"),
    ("spec.scheduler.kvCacheRejectWatermark", 0.80, "kvCacheHighWatermark must be < kvCacheRejectWatermark"),
    ("spec.scheduler.prefillChunkSize", 16384, "prefillChunkSize must be <= maxBatchedTokens"),
    ("spec.scheduler.maxActiveSequences", 9000, "maxActiveSequences must be <= maxBatchedTokens"),
    ("spec.tuning.bounds.maxActiveSequences", {"min": 300, "max": 100}, "min must be <= max"),
    ("spec.tuning.bounds.kvCacheHighWatermark", {"min": 0.9, "max": 0.8}, "min must be <= max"),
    ("spec.engine.blockSize", 24, "blockSize must be a power of two"),
    ("spec.model.source.hostPath", {"path": "/data"}, "set at most one of pvc, hostPath, tinyModel"),
    ("spec.model.path", "/opt/model", "with a source, path must lie under /models/"),
    ("spec.model.source.s3", {"uri": "s3://weights/llama3-8b"}, "set at most one of pvc, hostPath, tinyModel"),
    ("spec.model.source.huggingFace", {"repo": "meta-llama/Meta-Llama-3-8B"},
     "set at most one of pvc, hostPath, tinyModel, huggingFace, s3"),
    ("spec.model.cache", {"pvc": {"claimName": "model-cache"}}, "cache needs a huggingFace or s3 source"),
    ("spec.model.cache", {"pvc": {"claimName": "model-cache"}, "nodeLocal": {"path": "/var/cache/models"}},
     "set at most one of pvc, nodeLocal"),
    ("spec.tuning.prometheusUrl", None, "tuning.enabled needs tuning.prometheusUrl"),
    ("spec.adapters", [{"name": "sql", "source": {}}], "set exactly one of pvc, hostPath, huggingFace, s3"),
    ("spec.adapters", [{"name": "sql", "source": {"s3": {"uri": "s3://loras/sql"},
                                                  "hostPath": {"path": "/loras/sql"}}}],
     "set exactly one of pvc, hostPath, huggingFace, s3"),
    ("spec.adapters", [{"name": "llama3-8b", "source": {"s3": {"uri": "s3://loras/sql"}}}],
     "must differ from the served model name"),
    ("spec.adapters", [{"name": "sql", "source": {"pvc": {"claimName": "loras", "path": "sql/../../etc"}}}],
     "path must stay inside the volume"),
    ("spec.gateway", {"inferencePool": {"enabled": True}}, "inferencePool.enabled needs inferencePool.endpointPicker"),
    ("spec.parallelism", {"tensor": 4, "pipeline": 2}, "gpus.count must equal parallelism.tensor"),
]

# (field, value, message) on the llama3-8b-interactive sample.
LANE_INVALID = [
    ("spec.budgets", {"prefillChunkSize": 4096, "maxBatchedTokens": 1024}, "prefillChunkSize must be <= maxBatchedTokens"),
    ("spec.match", {"minPromptTokens": 100, "maxPromptTokens": 10}, "minPromptTokens must be <= maxPromptTokens"),
    ("spec.dedicated", {"replicas": 2}, "dedicated needs isolation: dedicated"),
    ("spec.tuning.bounds.prefillChunkSize", {"min": 2048, "max": 256}, "min must be <= max"),
]

# (field, value) on the tiny sample: schema bounds, enums, patterns, unknown fields.
OUT_OF_RANGE = [
    ("spec.replicas", -1), ("spec.scheduler.policy", "fifo"), ("spec.gpus.count", 17),
    ("spec.scheduler.kvCacheHighWatermark", 0), ("spec.model.dtype", "int4"), ("spec.bogus", 1),
    ("spec.tenants", [{"name": "a", "apiKeySha256": "not-hex"}]),
    ("spec.model.source", {"s3": {"uri": "https://weights.example.com/llama"}}),
    ("spec.model.source", {"huggingFace": {"repo": "no-organisation"}}),
    ("spec.model.source", {"huggingFace": {"repo": "org/name", "endpoint": "mirror.local"}}),
    ("spec.model.source", {"huggingFace": {"repo": "org/name", "tokenSecretRef": {"name": "Not_A_Name"}}}),
    ("spec.adapters", [{"name": "Not_A_Name", "source": {"s3": {"uri": "s3://loras/sql"}}}]),
    ("spec.adapters", [{"name": "sql", "source": {"huggingFace": {"repo": "no-organisation"}}}]),
    ("spec.engine.maxLoraRank", 4096),
    ("spec.gateway.inferencePool.endpointPicker.failureMode", "Sometimes"),
    ("spec.parallelism.tensor", 0), ("spec.parallelism.tensor", 17), ("spec.parallelism.pipeline", 65),
]


def invalid_model_service(field: str, value) -> dict:
    doc = sample("ModelService", "llama3-8b")
    if value is None:
        doc["spec"]["tuning"].pop("prometheusUrl")
    else:
        set_field(doc, field, value)
    return doc


def invalid_lane(field: str, value) -> dict:
    doc = sample("ServingLane", "llama3-8b-interactive")
    set_field(doc, field, value)
    return doc
