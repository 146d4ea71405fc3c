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

    @classmethod
    def from_spec(cls, raw: Any) -> "AutoscalingSpec":
        a = _defaulted(_MODEL_SERVICE_SPEC, "autoscaling", raw, "spec.autoscaling")
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
        )


@dataclass(frozen=True)
class ModelServiceSettings:
    """What the tuning and autoscaling timers read of a ModelService's spec."""

    tuning: TuningSpec
    rollout: RolloutSpec
    autoscaling: AutoscalingSpec
    reject_watermark: float  # spec.scheduler.kvCacheRejectWatermark (never tuned)
    tenant_key_digests: tuple[Optional[str], ...] = ()  # spec.tenants[*].apiKeySha256

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any]) -> "ModelServiceSettings":
        scheduler = _defaulted(_MODEL_SERVICE_SPEC, "scheduler", spec.get("scheduler"), "spec.scheduler")
        return cls(
            tuning=TuningSpec.from_spec(spec.get("tuning")),
            rollout=RolloutSpec.from_spec(spec.get("rollout")),
            autoscaling=AutoscalingSpec.from_spec(spec.get("autoscaling")),
            reject_watermark=float(scheduler["kvCacheRejectWatermark"]),
            tenant_key_digests=tuple(t.get("apiKeySha256") for t in spec.get("tenants") or ()),
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
