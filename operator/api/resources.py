"""Parse and validate ModelService / ServingLane objects (raw dicts) into small dataclasses.

The spec keeps the CRD's camelCase shape (a defaulted, validated dict) so builders read it the
way users write it; `settings` holds the parts the timers read as typed values (spec.py).
Validation is what the API server would do (structural schema via jsonschema, the CEL rules
re-stated in Python) so the operator behaves the same on a server that validates nothing (the
kmock emulator) and in `tokenlane render`. Mistakes raise `ValueError` naming the field
(`spec.scheduler.kvCacheHighWatermark: ...`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Mapping, Optional

import jsonschema

from tokenlane.operator.api import schema as crd_schema
from tokenlane.operator.api.spec import LaneSettings, ModelServiceSettings

API_VERSION = crd_schema.API_VERSION
MODEL_SERVICE = "ModelService"
SERVING_LANE = "ServingLane"

@dataclass(frozen=True)
class ObjectRef:
    name: str
    namespace: str
    uid: Optional[str] = None
    generation: int = 0


@dataclass(frozen=True)
class ModelService:
    ref: ObjectRef
    spec: dict[str, Any]  # defaulted + validated, camelCase as in the CRD
    labels: dict[str, str] = field(default_factory=dict)
    status: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.ref.name

    @property
    def namespace(self) -> str:
        return self.ref.namespace

    @cached_property
    def settings(self) -> ModelServiceSettings:
        """The spec parts the timers read, typed, with the CRD's defaults (built once)."""
        return ModelServiceSettings.from_spec(self.spec)


@dataclass(frozen=True)
class ServingLane:
    ref: ObjectRef
    spec: dict[str, Any]
    created: str = ""  # metadata.creationTimestamp: older lanes win name clashes
    deleting: bool = False
    status: dict[str, Any] = field(default_factory=dict)

    @property
    def lane_name(self) -> str:
        return self.spec.get("laneName") or self.ref.name

    @property
    def parent(self) -> str:
        return self.spec["modelServiceRef"]["name"]

    @property
    def dedicated(self) -> bool:
        return self.spec.get("isolation") == "dedicated"

    @cached_property
    def settings(self) -> LaneSettings:
        """The spec parts the timers read, typed, with the CRD's defaults (built once)."""
        return LaneSettings.from_spec(self.spec)


def _format_error(err: jsonschema.ValidationError) -> str:
    where = "spec" + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in list(err.absolute_path)[1:])
    if err.validator == "additionalProperties":
        return f"{where}: {err.message} (unknown field)"
    return f"{where}: {err.message}"


_VALIDATORS: dict[str, jsonschema.Validator] = {}


def _validator(kind: str) -> jsonschema.Validator:
    if kind not in _VALIDATORS:
        root = crd_schema.to_jsonschema(crd_schema.crd_schema(kind))
        spec_only = {"type": "object", "properties": {"spec": root["properties"]["spec"]}, "required": ["spec"]}
        _VALIDATORS[kind] = jsonschema.Draft4Validator(spec_only)
    return _VALIDATORS[kind]


def _validate(kind: str, spec: Any) -> None:
    if not isinstance(spec, dict):
        raise ValueError(f"spec: expected a mapping, got {type(spec).__name__}")
    errors = sorted(_validator(kind).iter_errors({"spec": spec}), key=lambda e: list(e.absolute_path))
    if errors:
        raise ValueError("; ".join(_format_error(e) for e in errors[:5]))


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


def _check_bounds(bounds: Mapping[str, Any], where: str) -> None:
    for knob, mm in (bounds or {}).items():
        if "min" in mm and "max" in mm:
            _check(mm["min"] <= mm["max"], f"{where}.{knob}: min ({mm['min']}) must be <= max ({mm['max']})")


def _check_model_service_rules(spec: dict) -> None:
    """The CEL rules of the ModelService CRD, in Python (the runtime config checks the budgets too)."""
    model = spec["model"]
    source = model.get("source") or {}
    _check(sum(k in source for k in ("pvc", "hostPath", "tinyModel", "huggingFace", "s3")) <= 1,
           "spec.model.source: set at most one of pvc, hostPath, tinyModel, huggingFace, s3")
    _check(not source or model["path"].startswith("/models/"),
           "spec.model.path: with a source, path must lie under /models/ (where the source is mounted)")
    cache = model.get("cache") or {}
    _check(not ("pvc" in cache and "nodeLocal" in cache), "spec.model.cache: set at most one of pvc, nodeLocal")
    _check("cache" not in model or "huggingFace" in source or "s3" in source,
           "spec.model.cache: cache needs a huggingFace or s3 source (the other sources download nothing)")
    sched = spec["scheduler"]
    _check(sched["kvCacheHighWatermark"] < sched["kvCacheRejectWatermark"] <= 1.0,
           "spec.scheduler: kvCacheHighWatermark must be < kvCacheRejectWatermark <= 1")
    _check(sched["prefillChunkSize"] <= sched["maxBatchedTokens"],
           "spec.scheduler: prefillChunkSize must be <= maxBatchedTokens")
    _check(sched["maxActiveSequences"] <= sched["maxBatchedTokens"],
           "spec.scheduler: maxActiveSequences must be <= maxBatchedTokens")
    bs = spec["engine"]["blockSize"]
    _check(bs & (bs - 1) == 0, "spec.engine.blockSize: must be a power of two")
    parallelism = spec.get("parallelism") or {}
    gpus = spec["gpus"]["count"]
    _check(gpus == 0 or gpus == parallelism.get("tensor", gpus),
           f"spec.parallelism.tensor: {crd_schema.PARALLELISM_GPUS_MESSAGE} "
           f"(gpus.count {gpus}, parallelism.tensor {parallelism.get('tensor')})")
    tuning = spec["tuning"]
    _check(not tuning["enabled"] or bool(tuning.get("prometheusUrl")),
           "spec.tuning: tuning.enabled needs tuning.prometheusUrl")
    _check_bounds(tuning.get("bounds", {}), "spec.tuning.bounds")


def _check_lane_rules(spec: dict) -> None:
    budgets = spec.get("budgets") or {}
    if "prefillChunkSize" in budgets and "maxBatchedTokens" in budgets:
        _check(budgets["prefillChunkSize"] <= budgets["maxBatchedTokens"],
               "spec.budgets: prefillChunkSize must be <= maxBatchedTokens")
    match = spec.get("match") or {}
    if "minPromptTokens" in match and "maxPromptTokens" in match:
        _check(match["minPromptTokens"] <= match["maxPromptTokens"],
               "spec.match: minPromptTokens must be <= maxPromptTokens")
    _check("dedicated" not in spec or spec["isolation"] == "dedicated",
           "spec.dedicated: dedicated needs isolation: dedicated")
    _check_bounds((spec.get("tuning") or {}).get("bounds", {}), "spec.tuning.bounds")


def _ref(body: Mapping[str, Any], kind: str) -> ObjectRef:
    meta = body.get("metadata") or {}
    name = meta.get("name")
    if not name:
        raise ValueError(f"{kind}: metadata.name is missing")
    return ObjectRef(name=name, namespace=meta.get("namespace") or "default", uid=meta.get("uid"),
                     generation=int(meta.get("generation") or 0))


def _defaulted_spec(kind: str, body: Mapping[str, Any]) -> dict:
    """The spec validated against the CRD schema, with its defaults applied (as stored by the
    API server), validated again (defaults must satisfy the schema too)."""
    spec = body.get("spec")
    _validate(kind, spec)
    spec = crd_schema.apply_defaults(crd_schema.crd_schema(kind)["properties"]["spec"], spec)
    _validate(kind, spec)
    return spec


def parse_model_service(body: Mapping[str, Any]) -> ModelService:
    """A validated ModelService from an object (as stored by the API server or read from a file)."""
    ref = _ref(body, MODEL_SERVICE)
    spec = _defaulted_spec(MODEL_SERVICE, body)
    _check_model_service_rules(spec)
    # Object names prefix owned objects; a Service name is a DNS-1035 label (<= 63 chars).
    _check(len(ref.name) <= 50, f"metadata.name: {ref.name!r} is longer than 50 characters "
                                "(names of owned objects derive from it)")
    meta = body.get("metadata") or {}
    msvc = ModelService(ref=ref, spec=spec, labels=dict(meta.get("labels") or {}),
                        status=dict(body.get("status") or {}))
    msvc.settings  # typed once, here: a spec it cannot type is refused with the rest
    return msvc


def parse_serving_lane(body: Mapping[str, Any]) -> ServingLane:
    ref = _ref(body, SERVING_LANE)
    spec = _defaulted_spec(SERVING_LANE, body)
    _check_lane_rules(spec)
    meta = body.get("metadata") or {}
    lane = ServingLane(ref=ref, spec=spec, created=str(meta.get("creationTimestamp") or ""),
                       deleting=bool(meta.get("deletionTimestamp")), status=dict(body.get("status") or {}))
    _check(bool(re.fullmatch(crd_schema.DNS_LABEL_PATTERN, lane.lane_name)) and len(lane.lane_name) <= 63,
           f"spec.laneName: {lane.lane_name!r} is not a DNS-1123 label (set spec.laneName)")
    lane.settings  # typed once, here
    return lane


def lane_sort_key(lane: ServingLane) -> tuple:
    """Older lanes first (they win name clashes), then by name: a stable lane order."""
    return (lane.created or "~", lane.ref.name)
