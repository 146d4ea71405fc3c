"""The tuner's values: its inputs (lanes, settings, metrics, budgets) and its outputs (decisions).

Plain frozen dataclasses with no Kubernetes and no HTTP, shared by the policy (tuner.py), the
rollout guard (rollout.py) and the kopf timer (tuning.py). The knobs the tuner may move, their
scope and their step come from the runtime's knob table (`tokenlane.runtime.config.KNOBS`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Mapping, Optional

from tokenlane.operator.api.enums import StrEnum
from tokenlane.runtime.config import TUNED_KNOBS, RuntimeConfig, SLOConfig

GLOBAL = "global"  # scope of the global knobs in KnobChange.scope
# Knobs the tuner may move, by their runtime.yaml / CRD key: a lane's cap for knobs lanes
# have, else the global value.
LANE_KNOBS = tuple(k.key for k in TUNED_KNOBS if k.in_lane)
GLOBAL_KNOBS = tuple(k.key for k in TUNED_KNOBS if not k.in_lane)
STEP = {k.key: k.tuner_step for k in TUNED_KNOBS}  # smallest meaningful step (values are rounded to it)



class TunerAction(StrEnum):
    """What one tuning decision did (status.tuning.history[*].action)."""

    HOLD = "hold"
    ADJUST = "adjust"
    PROBE = "probe"
    REVERT = "revert"


HOLD, ADJUST, PROBE, REVERT = TunerAction.HOLD, TunerAction.ADJUST, TunerAction.PROBE, TunerAction.REVERT


class Verdict(StrEnum):
    """How a decision judged the change in flight (status.tuning.history[*].verdict)."""

    KEPT = "kept"
    REVERTED = "reverted"
    INCONCLUSIVE = "inconclusive"  # the window could not tell (load changed, no data, something else changed)


class HoldReason(StrEnum):
    """Why the tuner holds without acting on data: the reason of the Tuning=False condition
    (status.tuning.held). A hold for a reason of policy (cooldown, bounds) is none of these."""

    VERIFYING_REVISION = "VerifyingRevision"
    ROLLING_BACK = "RollingBack"
    SETTLING_WINDOW = "SettlingWindow"  # the window spans a change of the config in force
    PROMETHEUS_UNAVAILABLE = "PrometheusUnavailable"
    INSUFFICIENT_DATA = "InsufficientData"


# --------------------------------------------------------------------------- inputs

@dataclass(frozen=True)
class Bounds:
    """The declared range of one knob (inclusive)."""

    min: float
    max: float

    def __post_init__(self) -> None:
        if not self.min <= self.max:
            raise ValueError(f"tuning bounds: min ({self.min}) must be <= max ({self.max})")

    def clamp(self, value: float) -> float:
        return min(self.max, max(self.min, value))

    def capped_at(self, global_value: float) -> "Bounds":
        """These bounds with the top at the global budget: a lane value above it is not in force
        (lanes cap the global budgets), so the tuner would chase a change that never shows."""
        hi = min(self.max, global_value)
        return Bounds(min(self.min, hi), hi)


@dataclass(frozen=True)
class LaneTarget:
    """A lane as the tuner sees it: SLO targets, priority, and the knobs it may move."""

    name: str
    lane_class: str = "interactive"  # interactive | long-context | batch
    priority: int = 50
    ttft_p95_ms: Optional[float] = None
    tpot_p95_ms: Optional[float] = None
    bounds: Mapping[str, Bounds] = field(default_factory=dict)  # LANE_KNOBS key -> bounds
    # slo.maxRefusedShare; unset: the runtime's default for a lane with a latency target
    max_refused_share: Optional[float] = None

    @property
    def refused_share_target(self) -> Optional[float]:
        """The share of refused (429/503) and queue-timed-out (504) requests the lane tolerates."""
        return SLOConfig(self.ttft_p95_ms, self.tpot_p95_ms, None, self.max_refused_share).refused_share_target

    @property
    def has_slo(self) -> bool:
        return self.ttft_p95_ms is not None or self.tpot_p95_ms is not None or self.refused_share_target is not None


@dataclass(frozen=True)
class TunerSettings:
    cooldown_s: float = 60.0  # no change sooner than this after the previous one
    window_s: float = 60.0  # metric window; a change is judged on a full window after it
    min_requests: int = 20  # finished requests per lane per window for its p95 to count
    comfort_ratio: float = 0.7  # p95 below ratio x target = slack (hysteresis band above)
    queueing_share: float = 0.5  # queue delay >= this share of TTFT = the miss is queueing
    increase_fraction: float = 0.125  # additive step, as a fraction of the bounds' range
    decrease_factor: float = 0.75  # multiplicative decrease
    max_step_fraction: float = 0.25  # no step changes a knob by more than this share of its value
    watermark_step: float = 0.02  # step of kvCacheHighWatermark (both directions)
    kv_pressure_margin: float = 0.05  # KV usage within this of the reject watermark = pressure
    reject_watermark: float = 0.95  # the runtime's kvCacheRejectWatermark (not tuned)
    kv_busy: float = 0.5  # KV usage above which decode steps are dominated by KV reads
    # A change is reverted when the violation rises by more than this share of the lanes'
    # p95 level (sum of weight x p95/target): noise in a window's p95 does not trigger it.
    revert_tolerance: float = 0.15
    revert_abs_tolerance: float = 0.02  # ... and by more than this (violation is in targets)
    throughput_tolerance: float = 0.10  # a probe that loses this share of throughput reverts
    load_change_limit: float = 1.5  # offered load changed more than this factor: inconclusive
    tabu_cooldowns: float = 4.0  # a reverted move is blocked for this many cooldowns (doubling)
    global_bounds: Mapping[str, Bounds] = field(default_factory=dict)  # GLOBAL_KNOBS -> bounds
    probe: bool = True  # probe upward for throughput when every lane has headroom

    def __post_init__(self) -> None:
        if not 0 < self.comfort_ratio < 1:
            raise ValueError(f"comfortRatio must be in (0, 1), got {self.comfort_ratio}")
        if not 0 < self.decrease_factor < 1:
            raise ValueError(f"decreaseFactor must be in (0, 1), got {self.decrease_factor}")
        if self.cooldown_s <= 0 or self.window_s <= 0:
            raise ValueError("cooldown and window must be > 0")

    @property
    def effective_cooldown_s(self) -> float:
        # A change must be judged on a window that starts after it.
        return max(self.cooldown_s, self.window_s)


@dataclass(frozen=True)
class LaneMetrics:
    """One lane over one window. Latencies in seconds; None = no observation."""

    request_rate: float = 0.0  # finished requests per second (thin-data check)
    ttft_p95_s: Optional[float] = None
    tpot_p95_s: Optional[float] = None
    queue_delay_p95_s: Optional[float] = None
    rejection_rate: float = 0.0  # refused (429/503) or queue-timed-out (504) requests per second
    waiting: float = 0.0  # requests queued (average or last)
    throughput_tokens_s: float = 0.0  # generated tokens per second
    queue_full_rate: float = 0.0  # of rejection_rate: 429 queue_full (a lane cap or the global queue)

    @property
    def total_rate(self) -> float:
        """All requests of the lane per second, answered or refused."""
        return self.request_rate + self.rejection_rate

    @property
    def refused_share(self) -> float:
        total = self.total_rate
        return self.rejection_rate / total if total > 0 else 0.0


@dataclass(frozen=True)
class MetricSample:
    """All lanes over one window ending at `at`."""

    window_s: float
    lanes: Mapping[str, LaneMetrics] = field(default_factory=dict)
    kv_usage: Optional[float] = None  # highest KV usage ratio in the window
    preemption_rate: float = 0.0  # preemptions per second
    available: bool = True  # False: Prometheus could not be read
    error: str = ""  # why not available
    at: Optional[float] = None

    @property
    def throughput_tokens_s(self) -> float:
        return sum(m.throughput_tokens_s for m in self.lanes.values())

    @property
    def request_rate(self) -> float:
        return sum(m.total_rate for m in self.lanes.values())

    @classmethod
    def unavailable(cls, error: str, window_s: float = 0.0) -> "MetricSample":
        return cls(window_s=window_s, available=False, error=error)


@dataclass(frozen=True)
class EffectiveBudgets:
    """The tuned values in force: per lane knob values, and the global knobs."""

    lanes: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    global_: Mapping[str, float] = field(default_factory=dict)

    def get(self, scope: str, knob: str) -> Optional[float]:
        table = self.global_ if scope == GLOBAL else self.lanes.get(scope, {})
        return table.get(knob)

    def with_value(self, scope: str, knob: str, value: float) -> "EffectiveBudgets":
        if scope == GLOBAL:
            return replace(self, global_={**self.global_, knob: value})
        lanes = {name: dict(values) for name, values in self.lanes.items()}
        lanes.setdefault(scope, {})[knob] = value
        return replace(self, lanes=lanes)

    def consistent(self) -> "EffectiveBudgets":
        """Keep the runtime's own rule: a lane's prefill chunk fits in its batched tokens."""
        out = self
        for name, values in self.lanes.items():
            chunk, batched = values.get("prefillChunkSize"), values.get("maxBatchedTokens")
            if chunk is not None and batched is not None and chunk > batched:
                out = out.with_value(name, "prefillChunkSize", batched)
        return out

    def to_dict(self) -> dict:
        out: dict = {"lanes": {n: dict(v) for n, v in sorted(self.lanes.items())}}
        if self.global_:
            out["global"] = dict(self.global_)
        return out

    @classmethod
    def from_dict(cls, data: Mapping) -> "EffectiveBudgets":
        lanes = {str(n): {str(k): v for k, v in (vals or {}).items()} for n, vals in (data.get("lanes") or {}).items()}
        return cls(lanes=lanes, global_=dict(data.get("global") or {}))

    @classmethod
    def from_config(cls, config: RuntimeConfig) -> "EffectiveBudgets":
        """The tuned knobs' values a RuntimeConfig puts in force (each lane's caps applied)."""
        lanes = {}
        for lane in config.lanes:
            in_force = config.lane_budgets(lane.name)
            lanes[lane.name] = {k.key: getattr(in_force, k.attr) for k in TUNED_KNOBS if k.in_lane}
        return cls(lanes, {k.key: getattr(config.scheduler, k.attr) for k in TUNED_KNOBS if not k.in_lane})


# --------------------------------------------------------------------------- outputs


@dataclass(frozen=True)
class KnobChange:
    scope: str  # lane name, or GLOBAL
    knob: str
    old: float
    new: float
    why: str

    @property
    def direction(self) -> int:
        return 1 if self.new > self.old else -1

    def inverse(self, why: str) -> "KnobChange":
        return KnobChange(self.scope, self.knob, self.new, self.old, why)

    def to_dict(self) -> dict:
        return {"scope": self.scope, "knob": self.knob, "old": self.old, "new": self.new, "why": self.why}

    @classmethod
    def from_dict(cls, data: Mapping) -> "KnobChange":
        return cls(str(data["scope"]), str(data["knob"]), data["old"], data["new"], str(data.get("why", "")))

    def __str__(self) -> str:
        where = "" if self.scope == GLOBAL else f"{self.scope}."
        return f"{where}{self.knob} {_fmt(self.old)}->{_fmt(self.new)}"


@dataclass(frozen=True)
class Objective:
    """What a change is judged by: SLO violation first (lower is better), then throughput."""

    violation: float  # sum over lanes with data of weight x relative excess over target
    throughput_tokens_s: float
    request_rate: float  # offered load, to tell a real regression from a load change
    level: float = 0.0  # sum over the same lanes of weight x p95/target (the noise scale)

    def to_dict(self) -> dict:
        return {
            "violation": round(self.violation, 4),
            "throughputTokensPerSecond": round(self.throughput_tokens_s, 3),
            "requestRate": round(self.request_rate, 4),
            "level": round(self.level, 4),
        }

    @classmethod
    def from_dict(cls, data: Optional[Mapping]) -> Optional["Objective"]:
        if not data:
            return None
        return cls(
            float(data["violation"]),
            float(data.get("throughputTokensPerSecond", 0.0)),
            float(data.get("requestRate", 0.0)),
            float(data.get("level", 0.0)),
        )


@dataclass(frozen=True)
class LaneSLO:
    """The SLOMet condition of one lane: met True/False, or None when unknown."""

    met: Optional[bool]
    reason: str  # CamelCase condition reason
    message: str
    ttft_p95_ms: Optional[float] = None
    tpot_p95_ms: Optional[float] = None


@dataclass(frozen=True)
class DecisionRecord:
    """What history keeps of a decision (status.lastDecisions)."""

    at: float
    action: TunerAction
    reason: str
    changes: tuple[KnobChange, ...] = ()
    objective: Optional[Objective] = None  # the objective measured when the decision was made
    judged: Optional[float] = None  # `at` of the change this decision judged (kept or reverted)
    verdict: Optional[Verdict] = None

    def to_dict(self) -> dict:
        # Plain strings in status: the enums' values, byte for byte.
        out: dict = {"at": self.at, "action": str(self.action), "reason": self.reason}
        if self.changes:
            out["changes"] = [c.to_dict() for c in self.changes]
        if self.objective is not None:
            out["objective"] = self.objective.to_dict()
        if self.judged is not None:
            out["judged"] = self.judged
            out["verdict"] = "" if self.verdict is None else str(self.verdict)
        return out

    @classmethod
    def from_dict(cls, data: Mapping) -> "DecisionRecord":
        return cls(
            at=float(data["at"]),
            action=TunerAction(data["action"]),
            reason=str(data.get("reason", "")),
            changes=tuple(KnobChange.from_dict(c) for c in data.get("changes") or ()),
            objective=Objective.from_dict(data.get("objective")),
            judged=data.get("judged"),
            verdict=Verdict(data["verdict"]) if data.get("verdict") else None,
        )


@dataclass(frozen=True)
class Decision:
    at: float
    action: TunerAction
    budgets: EffectiveBudgets
    reason: str
    changes: tuple[KnobChange, ...] = ()
    slo: Mapping[str, LaneSLO] = field(default_factory=dict)
    objective: Optional[Objective] = None
    judged: Optional[float] = None
    verdict: Optional[Verdict] = None
    held: Optional[HoldReason] = None  # a hold for want of data (not kept in history)

    @property
    def changed(self) -> bool:
        return bool(self.changes)

    def record(self) -> DecisionRecord:
        return DecisionRecord(
            self.at, self.action, self.reason, self.changes, self.objective, self.judged, self.verdict
        )



def too_few_requests(metrics: Optional[LaneMetrics], min_requests: int, window_s: float) -> bool:
    """Too few requests in the window for the lane's numbers to mean anything. Refused ones
    count: a lane whose requests are mostly refused is failing, not idle."""
    return metrics is None or metrics.total_rate * window_s < min_requests


def _fmt(value: float) -> str:
    return f"{value:.2f}" if isinstance(value, float) and not float(value).is_integer() else str(int(value))
