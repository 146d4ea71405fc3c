"""The typed spec: the parts of a ModelService / ServingLane spec the operator's timers read.

Frozen dataclasses built once per parsed object (`ModelService.settings`,
`ServingLane.settings`) from its camelCase spec. Every default comes from the CRD schema
(operator/api/schema.py) through `schema.apply_defaults`, never restated here, so a spec
read from a file or a server that does not default (the kmock emulator) reads the same as
one the API server stored. Durations are parsed once, with the CRD's grammar
(operator/api/durations.py). A null value counts as absent, as in a merge patch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any, Mapping, Optional

from tokenlane.operator.api import schema as crd_schema
from tokenlane.operator.api.durations import parse_duration
from tokenlane.operator.api.enums import StrEnum

_MODEL_SERVICE_SPEC = crd_schema.model_service_spec()["properties"]
_SERVING_LANE_SPEC = crd_schema.serving_lane_spec()["properties"]


def _without_nulls(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    return value


def _defaulted(properties: Mapping[str, Any], section: str, raw: Any, where: str) -> dict:
    """`raw` (a spec section, possibly absent) with the schema's defaults applied."""
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ValueError(f"{where}: expected a mapping, got {type(raw).__name__}")
    return crd_schema.apply_defaults(properties[section], _without_nulls(raw))


@dataclass(frozen=True)
class KnobBounds:
    """The declared bounds of one tuned knob (`tuning.bounds.<knob>`); either side may be unset."""

    min: Optional[float] = None
    max: Optional[float] = None

    @property
    def declared(self) -> bool:
        return self.min is not None or self.max is not None

    @property
    def complete(self) -> bool:
        return self.min is not None and self.max is not None


def _bounds(raw: Mapping[str, Any]) -> dict[str, KnobBounds]:
    return {knob: KnobBounds(b.get("min"), b.get("max")) for knob, b in (raw or {}).items()}


# --------------------------------------------------------------------------- ModelService


@dataclass(frozen=True)
class TuningSpec:
    """spec.tuning."""

    enabled: bool
    prometheus_url: Optional[str]
    interval_s: float
    cooldown_s: float
    window_s: float
    max_step_percent: float
    bounds: Mapping[str, KnobBounds] = field(default_factory=dict)

    @classmethod
    def from_spec(cls, raw: Any) -> "TuningSpec":
        t = _defaulted(_MODEL_SERVICE_SPEC, "tuning", raw, "spec.tuning")
        return cls(
            enabled=bool(t["enabled"]),
            prometheus_url=t.get("prometheusUrl") or None,
            interval_s=parse_duration(t["interval"], "spec.tuning.interval"),
            cooldown_s=parse_duration(t["cooldown"], "spec.tuning.cooldown"),
            window_s=parse_duration(t["window"], "spec.tuning.window"),
            max_step_percent=t["maxStepPercent"],
            bounds=_bounds(t.get("bounds") or {}),
        )


class FallbackPolicy(StrEnum):
    """spec.rollout.fallback.policy."""

    LAST_KNOWN_GOOD = "LastKnownGood"  # restore only
    CONSERVATIVE = "Conservative"  # also lower the budgets
    STATIC_BATCHING = "StaticBatching"  # also turn continuous batching off


@dataclass(frozen=True)
class RegressionSpec:
    """spec.rollout.regression: allowed rises against the last-known-good, in percent (points)."""

    ttft_p95_percent: float
    tpot_p95_percent: float
    error_rate_percent: float


@dataclass(frozen=True)
class FallbackSpec:
    """spec.rollout.fallback."""

    policy: FallbackPolicy
    budget_percent: float
    miss_factor: float
    after_s: float


@dataclass(frozen=True)
class RolloutSpec:
    """spec.rollout."""

    verification_window_s: float
    progress_deadline_s: float
    regression: RegressionSpec
    fallback: FallbackSpec

    @classmethod
    def from_spec(cls, raw: Any) -> "RolloutSpec":
        r = _defaulted(_MODEL_SERVICE_SPEC, "rollout", raw, "spec.rollout")
        reg, fb = r["regression"], r["fallback"]
        try:
            policy = FallbackPolicy(fb["policy"])
        except ValueError:
            raise ValueError(f"spec.rollout.fallback.policy: unknown policy {fb['policy']!r} "
                             f"(one of {', '.join(p.value for p in FallbackPolicy)})") from None
        return cls(
            verification_window_s=parse_duration(r["verificationWindow"], "spec.rollout.verificationWindow"),
            progress_deadline_s=parse_duration(r["progressDeadline"], "spec.rollout.progressDeadline"),
            regression=RegressionSpec(reg["ttftP95Percent"], reg["tpotP95Percent"], reg["errorRatePercent"]),
            fallback=FallbackSpec(policy, fb["budgetPercent"], fb["missFactor"],
                                  parse_duration(fb["after"], "spec.rollout.fallback.after")),
        )


@dataclass(frozen=True)
class AutoscalingLaneSpec:
    """One entry of spec.autoscaling.lanes."""

    lane: str
    queue_delay_p95_ms: Optional[float] = None
    slo_attainment_percent: Optional[float] = None


@dataclass(frozen=True)
class AutoscalingSpec:
    """spec.autoscaling. Fields the CRD gives no default stay None (the policy's own apply)."""

    enabled: bool
    prometheus_url: Optional[str]
    min_replicas: int
    max_replicas: Optional[int]
    interval_s: float
    window_s: float
    scale_up_stabilization_s: float
    scale_down_stabilization_s: float
    kv_usage_target: float
    running_share_target: Optional[float] = None
    headroom_replicas: Optional[float] = None
    target_utilization: Optional[float] = None
    lanes: tuple[AutoscalingLaneSpec, ...] = ()
    scale_to_zero_after_s: float = 900.0  # used only with min_replicas 0

    @classmethod
    def from_spec(cls, raw: Any, router: Any = None) -> "AutoscalingSpec":
        """`router`: spec.router, when known; minReplicas 0 needs it enabled (the CRD's CEL rule,
        checked again here for API servers and offline paths that skip CEL)."""
        a = _defaulted(_MODEL_SERVICE_SPEC, "autoscaling", raw, "spec.autoscaling")
        if (router is not None and a["enabled"] and a["minReplicas"] == 0
                and not (router or {}).get("enabled")):
            raise ValueError("spec.autoscaling.minReplicas: 0 (scale to zero) needs spec.router.enabled: true, "
                             "the router holds the requests that arrive while no pod runs")
        return cls(
            enabled=bool(a["enabled"]),
            prometheus_url=a.get("prometheusUrl") or None,
            min_replicas=a["minReplicas"],
            max_replicas=a.get("maxReplicas"),
            interval_s=parse_duration(a["interval"], "spec.autoscaling.interval"),
            window_s=parse_duration(a["window"], "spec.autoscaling.window"),
            scale_up_stabilization_s=parse_duration(a["scaleUp"]["stabilizationWindow"],
                                                    "spec.autoscaling.scaleUp.stabilizationWindow"),
            scale_down_stabilization_s=parse_duration(a["scaleDown"]["stabilizationWindow"],
                                                      "spec.autoscaling.scaleDown.stabilizationWindow"),
            kv_usage_target=a["kvUsageTarget"],
            running_share_target=a.get("runningShareTarget"),
            headroom_replicas=a.get("headroomReplicas"),
            target_utilization=a.get("targetUtilization"),
            lanes=tuple(AutoscalingLaneSpec(t["lane"], t.get("queueDelayP95Ms"), t.get("sloAttainmentPercent"))
                        for t in a.get("lanes") or ()),
            scale_to_zero_after_s=parse_duration(a["scaleToZeroAfter"], "spec.autoscaling.scaleToZeroAfter"),
        )


@dataclass(frozen=True)
class SecretKeyRef:
    """A key of a Secret in the object's namespace (only referenced, never read)."""

    name: str
    key: str


@dataclass(frozen=True)
class HuggingFaceSource:
    """spec.model.source.huggingFace."""

    repo: str
    revision: str
    token: Optional[SecretKeyRef] = None
    allow_patterns: tuple[str, ...] = ()
    endpoint: Optional[str] = None

    @property
    def uri(self) -> str:
        """The SOURCE argument of `tokenlane fetch-model`."""
        return f"hf://{self.repo}"


@dataclass(frozen=True)
class S3Source:
    """spec.model.source.s3."""

    uri: str
    endpoint: Optional[str] = None
    region: Optional[str] = None
    credentials_secret: Optional[str] = None  # Secret name with the AWS_* keys


class ModelCacheKind(StrEnum):
    PVC = "pvc"
    NODE_LOCAL = "nodeLocal"


@dataclass(frozen=True)
class ModelCacheSpec:
    """spec.model.cache: `claim_name` for pvc, `path` (a node folder) for nodeLocal."""

    kind: ModelCacheKind
    claim_name: Optional[str] = None
    path: Optional[str] = None


@dataclass(frozen=True)
class ModelSourceSpec:
    """spec.model.source and spec.model.cache: where the weights come from. `fetched` is the
    source an init container downloads (huggingFace or s3), None for the others."""

    kind: Optional[str]  # pvc, hostPath, tinyModel, huggingFace, s3; None = in the image
    fetched: Optional[Any] = None  # HuggingFaceSource | S3Source
    cache: Optional[ModelCacheSpec] = None

    @property
    def description(self) -> str:
        """What `tokenlane fetch-model` is asked for, as users read it (hf://org/name@rev, s3://...)."""
        if isinstance(self.fetched, HuggingFaceSource):
            return f"{self.fetched.uri}@{self.fetched.revision}"
        if isinstance(self.fetched, S3Source):
            return self.fetched.uri
        return ""

    @classmethod
    def from_spec(cls, raw_model: Any) -> "ModelSourceSpec":
        model = _defaulted(_MODEL_SERVICE_SPEC, "model", raw_model, "spec.model")
        source, cache_raw = model.get("source") or {}, model.get("cache")
        kinds = [k for k in ("pvc", "hostPath", "tinyModel", "huggingFace", "s3") if k in source]
        if len(kinds) > 1:
            raise ValueError(f"spec.model.source: set at most one of pvc, hostPath, tinyModel, huggingFace, s3 "
                             f"(got {', '.join(kinds)})")
        kind = kinds[0] if kinds else None
        fetched: Any = None
        if kind == "huggingFace":
            hf = source["huggingFace"]
            token = hf.get("tokenSecretRef")
            fetched = HuggingFaceSource(
                repo=hf["repo"], revision=hf["revision"],
                token=SecretKeyRef(token["name"], token["key"]) if token else None,
                allow_patterns=tuple(hf.get("allowPatterns") or ()), endpoint=hf.get("endpoint"))
        elif kind == "s3":
            s3 = source["s3"]
            fetched = S3Source(uri=s3["uri"], endpoint=s3.get("endpoint"), region=s3.get("region"),
                               credentials_secret=(s3.get("credentialsSecretRef") or {}).get("name"))
        cache = None
        if cache_raw is not None:
            if fetched is None:
                raise ValueError("spec.model.cache: cache needs a huggingFace or s3 source "
                                 "(the other sources download nothing)")
            if ("pvc" in cache_raw) == ("nodeLocal" in cache_raw):
                raise ValueError("spec.model.cache: set exactly one of pvc, nodeLocal")
            if "pvc" in cache_raw:
                cache = ModelCacheSpec(ModelCacheKind.PVC, claim_name=cache_raw["pvc"]["claimName"])
            else:
                cache = ModelCacheSpec(ModelCacheKind.NODE_LOCAL, path=cache_raw["nodeLocal"]["path"])
        return cls(kind=kind, fetched=fetched, cache=cache)


class AdapterSourceKind(StrEnum):
    """The source kinds of spec.adapters[].source."""

    PVC = "pvc"
    HOST_PATH = "hostPath"
    HUGGING_FACE = "huggingFace"
    S3 = "s3"


@dataclass(frozen=True)
class AdapterSpec:
    """One entry of spec.adapters: a LoRA adapter and where its PEFT folder comes from.

    pvc: `claim_name` and `path` (the folder inside the volume, "" = its root); hostPath: `path`
    (the node folder); huggingFace: `repo` and `revision`; s3: `uri`."""

    name: str
    kind: AdapterSourceKind
    path: str = ""
    claim_name: Optional[str] = None
    repo: Optional[str] = None
    revision: Optional[str] = None
    uri: Optional[str] = None

    @property
    def fetched(self) -> bool:
        """Downloaded by the runtime when it loads the adapter (not mounted)."""
        return self.kind in (AdapterSourceKind.HUGGING_FACE, AdapterSourceKind.S3)

    @property
    def source_uri(self) -> str:
        """What the runtime fetches (`model.adapters[].path`): hf://ORG/NAME@REV or s3://BUCKET/PREFIX."""
        if self.kind == AdapterSourceKind.HUGGING_FACE:
            return f"hf://{self.repo}@{self.revision}"
        if self.kind == AdapterSourceKind.S3:
            return str(self.uri)
        raise ValueError(f"adapter {self.name}: a {self.kind} source is mounted, not fetched")

    @classmethod
    def from_spec(cls, raw: Mapping[str, Any], where: str) -> "AdapterSpec":
        source = raw.get("source") or {}
        kinds = [k for k in AdapterSourceKind if k.value in source]
        if len(kinds) != 1:
            raise ValueError(f"{where}.source: set exactly one of {', '.join(k.value for k in AdapterSourceKind)}"
                             + (f" (got {', '.join(k.value for k in kinds)})" if kinds else ""))
        kind, body = kinds[0], source[kinds[0].value]
        if kind == AdapterSourceKind.PVC:
            path = (body.get("path") or "").strip("/")
            if ".." in path.split("/"):
                raise ValueError(f"{where}.source.pvc.path: {body['path']!r} must stay inside the volume (no '..')")
            return cls(raw["name"], kind, path=path, claim_name=body["claimName"])
        if kind == AdapterSourceKind.HOST_PATH:
            return cls(raw["name"], kind, path=body["path"])
        if kind == AdapterSourceKind.HUGGING_FACE:
            return cls(raw["name"], kind, repo=body["repo"], revision=body.get("revision") or "main")
        return cls(raw["name"], kind, uri=body["uri"])


def _adapters(spec: Mapping[str, Any]) -> tuple[AdapterSpec, ...]:
    """spec.adapters, with the CRD's rules re-checked (unique names, not the served model's name)
    for servers and files that skip them. A tenant's `adapters` may name adapters the spec does
    not list, as in runtime.yaml: an adapter loaded through the API may be allowed too."""
    adapters = tuple(AdapterSpec.from_spec(a, f"spec.adapters[{i}]")
                     for i, a in enumerate(_without_nulls(spec.get("adapters") or [])))
    names = [a.name for a in adapters]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"spec.adapters: duplicate name(s) {', '.join(duplicates)}")
    model = spec.get("model") or {}
    served = model.get("servedName") or PurePosixPath(str(model.get("path") or "").rstrip("/")).name
    if served in names:
        raise ValueError(f"spec.adapters: adapter name {served!r} is the served model's name "
                         "(model.servedName, default the folder's name); rename the adapter")
    return adapters


class FailureMode(StrEnum):
    """spec.gateway.inferencePool.endpointPicker.failureMode (the InferencePool's)."""

    FAIL_OPEN = "FailOpen"
    FAIL_CLOSE = "FailClose"


@dataclass(frozen=True)
class InferencePoolSpec:
    """spec.gateway.inferencePool: an InferencePool selecting the shared pool, and its endpoint picker."""

    enabled: bool = False
    picker_service: Optional[str] = None
    picker_port: int = 9002
    failure_mode: FailureMode = FailureMode.FAIL_CLOSE

    @classmethod
    def from_spec(cls, raw_gateway: Any) -> "InferencePoolSpec":
        gateway = _defaulted(_MODEL_SERVICE_SPEC, "gateway", raw_gateway, "spec.gateway")
        pool = crd_schema.apply_defaults(_MODEL_SERVICE_SPEC["gateway"]["properties"]["inferencePool"],
                                         gateway.get("inferencePool") or {})
        picker = pool.get("endpointPicker")
        if not pool["enabled"]:
            return cls()
        if not picker:
            raise ValueError("spec.gateway.inferencePool: inferencePool.enabled needs inferencePool.endpointPicker")
        return cls(enabled=True, picker_service=picker["service"], picker_port=int(picker["port"]),
                   failure_mode=FailureMode(picker["failureMode"]))


@dataclass(frozen=True)
class ParallelismSpec:
    """spec.parallelism: tensor-parallel ranks per pod (one per GPU) and pipeline stages (one pod
    each). `grouped`: every replica is a LeaderWorkerSet group of `pipeline` pods."""

    tensor: int = 1
    pipeline: int = 1

    @property
    def grouped(self) -> bool:
        return self.pipeline > 1

    @classmethod
    def from_spec(cls, raw: Any) -> "ParallelismSpec":
        p = _defaulted(_MODEL_SERVICE_SPEC, "parallelism", raw, "spec.parallelism")
        return cls(tensor=int(p["tensor"]), pipeline=int(p["pipeline"]))


@dataclass(frozen=True)
class ModelServiceSettings:
    """What the timers and the model-source builders read of a ModelService's spec."""

    tuning: TuningSpec
    rollout: RolloutSpec
    autoscaling: AutoscalingSpec
    reject_watermark: float  # spec.scheduler.kvCacheRejectWatermark (never tuned)
    tenant_key_digests: tuple[Optional[str], ...] = ()  # spec.tenants[*].apiKeySha256
    model_source: ModelSourceSpec = ModelSourceSpec(kind=None)  # spec.model.source and spec.model.cache
    adapters: tuple[AdapterSpec, ...] = ()  # spec.adapters
    inference_pool: InferencePoolSpec = InferencePoolSpec()  # spec.gateway.inferencePool
    parallelism: ParallelismSpec = ParallelismSpec()  # spec.parallelism

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any]) -> "ModelServiceSettings":
        scheduler = _defaulted(_MODEL_SERVICE_SPEC, "scheduler", spec.get("scheduler"), "spec.scheduler")
        return cls(
            tuning=TuningSpec.from_spec(spec.get("tuning")),
            rollout=RolloutSpec.from_spec(spec.get("rollout")),
            autoscaling=AutoscalingSpec.from_spec(spec.get("autoscaling"), router=spec.get("router") or {}),
            reject_watermark=float(scheduler["kvCacheRejectWatermark"]),
            tenant_key_digests=tuple(t.get("apiKeySha256") for t in spec.get("tenants") or ()),
            model_source=ModelSourceSpec.from_spec(spec.get("model")),
            adapters=_adapters(spec),
            inference_pool=InferencePoolSpec.from_spec(spec.get("gateway")),
            parallelism=ParallelismSpec.from_spec(spec.get("parallelism")),
        )


# --------------------------------------------------------------------------- ServingLane


@dataclass(frozen=True)
class LaneSLOSpec:
    """spec.slo of a ServingLane (milliseconds; the refused share 0..1). Unset: None."""

    ttft_p95_ms: Optional[float] = None
    tpot_p95_ms: Optional[float] = None
    e2e_p95_ms: Optional[float] = None
    max_refused_share: Optional[float] = None


@dataclass(frozen=True)
class LaneSettings:
    """What the timers read of a ServingLane's spec."""

    lane_class: str
    priority: int
    tuning_enabled: bool
    bounds: Mapping[str, KnobBounds] = field(default_factory=dict)
    slo: LaneSLOSpec = LaneSLOSpec()

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any]) -> "LaneSettings":
        lane = crd_schema.apply_defaults({"type": "object", "properties": _SERVING_LANE_SPEC},
                                         _without_nulls(spec))
        tuning, slo = lane["tuning"], lane.get("slo") or {}
        return cls(
            lane_class=lane["class"],
            priority=lane["priority"],
            tuning_enabled=bool(tuning["enabled"]),
            bounds=_bounds(tuning.get("bounds") or {}),
            slo=LaneSLOSpec(slo.get("ttftP95Ms"), slo.get("tpotP95Ms"), slo.get("e2eP95Ms"),
                            slo.get("maxRefusedShare")),
        )
