"""The kopf side of replica autoscaling: a timer that feeds autoscaler.decide() from Prometheus.

Every `tick_s` the operator's timer calls `tick` for each ModelService. With
`spec.autoscaling.enabled`, once `spec.autoscaling.interval` has passed since its last run:

1. read one window of the fleet's metrics from Prometheus (`queries`, assembled into a
   `FleetSample` by the pure `fleet_sample`; any failure is an unavailable sample, so the
   decision holds);
2. `autoscaler.decide()` with the shared pool's Deployment replicas as the current count and
   the recommendations of earlier runs (kept in memory: a restarted operator needs a full
   scale-down window of data before it scales down, the safe direction);
3. write `status.autoscaling` when its counts or reason change (`autoscaling_status`: a
   decision that only holds with new numbers writes nothing);
4. when the desired count differs from the Deployment's, run the reconcile: the builders
   render the shared pool with `status.autoscaling.desiredReplicas`
   (builders.shared_replicas) and apply it like every other change.

The operator never writes the ModelService's spec: `spec.replicas` is left as the user wrote
it and is ignored while autoscaling is enabled (docs/fleet.md).
"""

from __future__ import annotations

import logging
import dataclasses
import math
import re
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Mapping, Optional

from tokenlane.operator.policy import autoscaler
from tokenlane.operator.desired import builders
from tokenlane.operator.clients import kube as k8s, reads
from tokenlane.operator.desired import status as status_mod
from tokenlane.operator.policy.autoscaler import AutoscalingPolicy, FleetSample, LaneSample, LaneScalingTarget, Recommendation
from tokenlane.operator.api.resources import ModelService, ServingLane, parse_model_service
from tokenlane.operator.api.spec import AutoscalingSpec
from tokenlane.operator.clients.prometheus import PrometheusClient, PrometheusError, Series

log = logging.getLogger("tokenlane.operator.controllers.scaling")

TICK_S = 5.0
PREFIX = "tokenlane_"
_LABEL_VALUE_RE = re.compile(r'^[^"\\\n]*$')

# status.autoscaling.reason
ScalingReason = autoscaler.ScalingReason
SCALED_UP, SCALED_DOWN, HOLDING, METRICS_UNAVAILABLE = (ScalingReason.SCALED_UP, ScalingReason.SCALED_DOWN,
                                                        ScalingReason.HOLDING, ScalingReason.METRICS_UNAVAILABLE)
SCALED_FROM_ZERO, SCALED_TO_ZERO = ScalingReason.SCALED_FROM_ZERO, ScalingReason.SCALED_TO_ZERO


# --------------------------------------------------------------------------- pure: spec -> policy


@dataclass(frozen=True)
class AutoscalingSettings:
    policy: AutoscalingPolicy
    prometheus_url: str
    interval_s: float
    window_s: float


def autoscaling_interval_s(raw: Mapping[str, Any]) -> float:
    """`spec.autoscaling.interval` of a camelCase `spec.autoscaling` (kopf's cached one) in
    seconds, the CRD's default when absent; ValueError if invalid."""
    return AutoscalingSpec.from_spec(raw).interval_s


def settings_from_spec(spec: "AutoscalingSpec | Mapping[str, Any]") -> Optional[AutoscalingSettings]:
    """The autoscaling settings of a ModelService's typed `spec.autoscaling`
    (`ModelService.settings.autoscaling`) or of a camelCase spec; None when autoscaling is off.
    Raises ValueError naming the field, for a spec the API server would refuse."""
    a = spec if isinstance(spec, AutoscalingSpec) else AutoscalingSpec.from_spec(spec.get("autoscaling"))
    if not a.enabled:
        return None
    if not a.prometheus_url:
        raise ValueError("spec.autoscaling: autoscaling.enabled needs autoscaling.prometheusUrl")
    if a.max_replicas is None:
        raise ValueError("spec.autoscaling: autoscaling.enabled needs autoscaling.maxReplicas")
    lanes = tuple(LaneScalingTarget(t.lane,
                                    None if t.queue_delay_p95_ms is None else t.queue_delay_p95_ms / 1000.0,
                                    None if t.slo_attainment_percent is None else t.slo_attainment_percent / 100.0)
                  for t in a.lanes)
    # Knobs the CRD leaves unset keep the policy's own defaults.
    unset_is_default = {name: float(value) for name, value in (("headroom_replicas", a.headroom_replicas),
                                                                ("target_utilization", a.target_utilization))
                        if value is not None}
    try:
        policy = AutoscalingPolicy(
            min_replicas=int(a.min_replicas),
            max_replicas=int(a.max_replicas),
            lanes=lanes,
            kv_usage_target=a.kv_usage_target,
            scale_up_stabilization_s=a.scale_up_stabilization_s,
            scale_down_stabilization_s=a.scale_down_stabilization_s,
            running_share_target=a.running_share_target,
            scale_to_zero_after_s=a.scale_to_zero_after_s,
            **unset_is_default,
        )
    except ValueError as exc:
        raise ValueError(f"spec.autoscaling: {exc}") from None
    return AutoscalingSettings(policy, a.prometheus_url, a.interval_s, a.window_s)


def ttft_targets(lanes: list[ServingLane]) -> dict[str, float]:
    """laneName -> the lane's slo.ttftP95Ms in seconds: what SLO attainment is measured against."""
    return {lane.lane_name: lane.settings.slo.ttft_p95_ms / 1000.0 for lane in lanes
            if not lane.deleting and lane.settings.slo.ttft_p95_ms}


# --------------------------------------------------------------------------- pure: Prometheus -> sample


def queries(model: str, window_s: float, namespace: Optional[str] = None,
            idle_s: Optional[float] = None) -> dict[str, str]:
    """The PromQL of one autoscaling sample, by name: series of `model` in the ModelService's
    namespace only (two ModelServices serving one model name must not mix). The rates cover
    the window; `waiting` and `running` are the load now, averaged over the last quarter of
    the window (autoscaler.LOAD_NOW_SHARE: one scrape alone is noisy, the whole window lags), which the
    decision's running and queue signals need (operator/policy/autoscaler.py). The router's
    held demand is always read; with `idle_s` (scaleToZeroAfter, minReplicas 0) also the
    router's arrivals over that span, which tell an idle fleet."""
    pairs = {"model": model, **({"namespace": namespace} if namespace else {})}
    for key, value in pairs.items():
        if not _LABEL_VALUE_RE.match(value):
            raise ValueError(f"label value for {key!r} may not contain quotes, backslashes or newlines")
    m = ",".join(f'{k}="{v}"' for k, v in sorted(pairs.items()))
    w = f"{max(1, int(round(window_s)))}s"
    recent = f"{max(1, int(round(window_s * autoscaler.LOAD_NOW_SHARE)))}s"
    return {
        "queue_delay_p95": (f"histogram_quantile(0.95, sum by (le, lane) "
                            f"(rate({PREFIX}queue_delay_seconds_bucket{{{m}}}[{w}])))"),
        "requests": f"sum by (lane) (rate({PREFIX}requests_total{{{m}}}[{w}]))",
        "ttft_buckets": f"sum by (lane, le) (rate({PREFIX}time_to_first_token_seconds_bucket{{{m}}}[{w}]))",
        "kv_usage": f"avg(avg_over_time({PREFIX}kv_cache_usage_ratio{{{m}}}[{w}]))",
        # Requests that ended admitted (any outcome but a refusal): what the replicas served.
        "served": f'sum by (lane) (rate({PREFIX}requests_total{{{m},outcome!~"rejected|invalid"}}[{w}]))',
        # Arrivals = requests that ended (served or refused) + the growth of those in the system.
        "ended": f'sum by (lane) (rate({PREFIX}requests_total{{{m},outcome!="invalid"}}[{w}]))',
        "waiting_growth": f"sum by (lane) (delta({PREFIX}requests_waiting{{{m}}}[{w}]))",
        "running_growth": f"sum by (lane) (delta({PREFIX}requests_running{{{m}}}[{w}]))",
        "waiting": f"sum by (lane) (avg_over_time({PREFIX}requests_waiting{{{m}}}[{recent}]))",
        "running": f"avg by (lane) (avg_over_time({PREFIX}requests_running{{{m}}}[{recent}]))",
        # The same, one series per replica (its target labels tell them apart), for the replicas
        # scraped now: the decision sums each replica's own load, so a replica that just joined
        # reads as the idle one it is, not as the mean.
        "running_by_replica": (f"avg_over_time({PREFIX}requests_running{{{m}}}[{recent}]) "
                               f"and {PREFIX}requests_running{{{m}}}"),
        "max_active": f'avg by (lane) ({PREFIX}lane_budget{{{m},budget="maxActiveSequences"}})',
        # The replicas exporting metrics, averaged over the window: what served the rates above.
        "serving_replicas": f"avg_over_time(count({PREFIX}kv_cache_usage_ratio{{{m}}})[{w}:])",
        # Scale from zero: what the router (runtime/fleet/router.py) holds, and what found no replica.
        "held": f"max_over_time(sum({PREFIX}router_held_requests{{{m}}})[{recent}:])",
        "without_replica": f"sum(increase({PREFIX}router_requests_without_replica_total{{{m}}}[{w}]))",
        **({"idle_window_requests": f"sum(increase({PREFIX}router_requests_total{{{m}}}"
                                    f"[{max(1, int(round(idle_s)))}s]))"} if idle_s is not None else {}),
    }


def _attainment(buckets: list[tuple[float, float]], total: float, target_s: float) -> Optional[float]:
    """Share of the `total` requests per second whose TTFT was within `target_s`, from the
    histogram's cumulative buckets (le, rate). The largest bucket bound at or below the target
    counts, so a target between two bounds is judged strictly. Requests that ended without a
    first token (refused, timed out) count as misses."""
    if total <= 0:
        return None
    within = [rate for le, rate in buckets if le <= target_s + 1e-12]
    met = max(within) if within else 0.0
    return max(0.0, min(1.0, met / total))


def fleet_sample(results: Mapping[str, list[Series]], at: float, window_s: float,
                 targets_s: Mapping[str, float]) -> FleetSample:
    """A FleetSample from the named query results (see `queries`)."""
    rates: dict[str, float] = {}
    for series in results.get("requests", []):
        lane = series.labels.get("lane", "")
        rates[lane] = rates.get(lane, 0.0) + (series.value or 0.0)
    delays = {s.labels.get("lane", ""): s.value for s in results.get("queue_delay_p95", [])}
    buckets: dict[str, list[tuple[float, float]]] = {}
    for series in results.get("ttft_buckets", []):
        try:
            le = float(series.labels.get("le", "nan"))
        except ValueError:
            continue
        if not math.isnan(le):
            buckets.setdefault(series.labels.get("lane", ""), []).append((le, series.value or 0.0))
    load = {name: _by_lane(results, name) for name in
            ("served", "ended", "waiting_growth", "running_growth", "waiting", "running", "max_active")}
    per_replica: dict[str, list[float]] = {}  # lane -> each replica's running sequences
    for series in results.get("running_by_replica", []):
        if series.value is not None:
            per_replica.setdefault(series.labels.get("lane", ""), []).append(series.value)
    lanes = {}
    for lane in sorted((set(rates) | set(delays)) - {""}):
        target = targets_s.get(lane)
        attainment = None if target is None else _attainment(buckets.get(lane, []), rates.get(lane, 0.0), target)
        waiting = load["waiting"].get(lane)
        arrivals = None
        if lane in load["ended"]:
            growth = load["waiting_growth"].get(lane, 0.0) + load["running_growth"].get(lane, 0.0)
            arrivals = max(0.0, load["ended"][lane] + growth / window_s)
        running, max_active = load["running"].get(lane), load["max_active"].get(lane)
        share = running / max_active if running is not None and max_active else None
        own = per_replica.get(lane)
        lanes[lane] = LaneSample(request_rate=rates.get(lane, 0.0), queue_delay_p95_s=delays.get(lane),
                                 slo_attainment=attainment, waiting=waiting, arrival_rate=arrivals,
                                 served_rate=load["served"].get(lane) if waiting is not None else None,
                                 running_share=share,
                                 replica_running_shares=(tuple(sorted(v / max_active for v in own))
                                                         if own and max_active else None))
    kv = results.get("kv_usage", [])
    serving = results.get("serving_replicas", [])
    # Requests queued or running on the replicas now (no series: no replica exports them).
    in_flight = (sum(load["waiting"].values()) + sum(load["running"].values())
                 if load["waiting"] or load["running"] else None)
    return FleetSample(at=at, window_s=window_s, lanes=lanes, kv_usage=kv[0].value if kv else None,
                       serving_replicas=serving[0].value if serving else None,
                       held_requests=_scalar(results, "held"),
                       arrivals_without_replica=_scalar(results, "without_replica"),
                       in_flight=in_flight, idle_window_requests=_scalar(results, "idle_window_requests"))


def _scalar(results: Mapping[str, list[Series]], name: str) -> Optional[float]:
    """The value of a one-series query; None when it returned nothing (no such series)."""
    values = [s.value for s in results.get(name, []) if s.value is not None]
    return values[0] if values else None


def _by_lane(results: Mapping[str, list[Series]], name: str) -> dict[str, float]:
    """lane -> value of one per-lane query (series without a value left out)."""
    return {s.labels.get("lane", ""): s.value for s in results.get(name, []) if s.value is not None}


async def read_prometheus(url: str, model: str, window_s: float, targets_s: Mapping[str, float], *,
                          namespace: Optional[str], at: float, idle_s: Optional[float] = None) -> FleetSample:
    """One sample from Prometheus; any failure is an unavailable sample (the decision holds)."""
    try:
        results = await PrometheusClient(url).query_all(queries(model, window_s, namespace, idle_s))
    except PrometheusError as exc:
        return FleetSample.unavailable(at, str(exc))
    return fleet_sample(results, at, window_s, targets_s)


# --------------------------------------------------------------------------- pure: decision -> status


def reason_of(decision: autoscaler.ScalingDecision, sample: Optional[FleetSample],
              current: Optional[int] = None) -> ScalingReason:
    if decision.desired == 0:
        return SCALED_TO_ZERO
    if current == 0 and decision.desired > 0:
        return SCALED_FROM_ZERO
    if decision.action == autoscaler.UP:
        return SCALED_UP
    if decision.action == autoscaler.DOWN:
        return SCALED_DOWN
    if sample is None or not sample.available:
        return METRICS_UNAVAILABLE
    return HOLDING


def autoscaling_status(previous: Optional[Mapping[str, Any]], current: int, decision: autoscaler.ScalingDecision,
                       reason: ScalingReason, now: str) -> dict:
    """status.autoscaling after a decision. Equal to `previous` unless the counts or the reason
    changed: the message keeps the numbers of the decision that changed them (live numbers are
    metrics, not status writes)."""
    previous = dict(previous or {})
    wanted = {"currentReplicas": current, "desiredReplicas": decision.desired, "reason": str(reason)}
    if all(previous.get(k) == v for k, v in wanted.items()) and "message" in previous:
        return previous
    out = {**wanted, "message": decision.reason[:4096]}
    if decision.desired != current:
        out["lastScaleTime"] = now
    elif previous.get("lastScaleTime"):
        out["lastScaleTime"] = previous["lastScaleTime"]
    return out


# --------------------------------------------------------------------------- the timer

# (prometheusUrl, model, window seconds, {lane: TTFT target s}, namespace=..., at=...[, idle_s=...]) -> one sample
SampleReader = Callable[..., Awaitable[FleetSample]]
Reconcile = Callable[[str, str], Awaitable[Any]]


@dataclass
class Autoscaling:
    """What the timer needs besides the Kubernetes client: a clock and a metrics reader (tests
    inject), and what it remembers between runs (in memory, not status)."""

    clock: Callable[[], float] = time.time
    read_sample: SampleReader = read_prometheus
    tick_s: float = TICK_S
    last_run: dict[tuple[str, str], float] = field(default_factory=dict)
    history: dict[tuple[str, str], tuple[Recommendation, ...]] = field(default_factory=dict)

    def due(self, namespace: str, name: str, interval_s: float, now: float) -> bool:
        last = self.last_run.get((namespace, name))
        return last is None or now - last >= interval_s

    def may_be_due(self, namespace: str, name: str, spec: Mapping[str, Any]) -> bool:
        """False when `spec.autoscaling.interval` (of kopf's cached spec) has not passed since the
        last run: a tick that is not due reads nothing. `tick` decides on a fresh read."""
        try:
            interval_s = autoscaling_interval_s(spec.get("autoscaling") or {})
        except (ValueError, TypeError):
            return True  # `tick` reads the object and leaves the invalid spec to the reconcile
        return self.due(namespace, name, interval_s, self.clock())

    def forget(self, namespace: str, name: str) -> None:
        self.last_run.pop((namespace, name), None)
        self.history.pop((namespace, name), None)


def _shared_workload(workloads: list[dict], msvc: ModelService) -> Optional[dict]:
    """The shared pool's Deployment, or its LeaderWorkerSet when spec.parallelism.pipeline > 1
    (whose replicas are groups: the autoscaler sizes groups)."""
    kind = "LeaderWorkerSet" if msvc.settings.parallelism.grouped else "Deployment"
    for obj in workloads:
        if obj.get("kind", kind) == kind and (obj.get("metadata") or {}).get("name") == msvc.name:
            return obj
    return None


def _shared_deployment_replicas(workloads: list[dict], msvc: ModelService) -> Optional[int]:
    obj = _shared_workload(workloads, msvc)
    return None if obj is None else int((obj.get("spec") or {}).get("replicas") or 0)


def with_ready_replicas(sample: FleetSample, workloads: list[dict], msvc: ModelService) -> FleetSample:
    """The sample plus the shared pool's ready replicas (status.readyReplicas: pods, or groups):
    only they served the window, and the decision must not add again the capacity that is still
    starting."""
    obj = _shared_workload(workloads, msvc)
    if obj is not None and sample.available:
        ready = int((obj.get("status") or {}).get("readyReplicas") or 0)
        return dataclasses.replace(sample, ready_replicas=ready)
    return sample


async def tick(a: Autoscaling, client: k8s.KubeClient, executor: k8s.Executor, lock: Any, namespace: str,
               name: str, spec: Mapping[str, Any], status: Optional[Mapping[str, Any]], reconcile: Reconcile
               ) -> Optional[autoscaler.ScalingDecision]:
    """One timer call for ModelService namespace/name (`spec`, `status`: as kopf last saw them,
    to skip the disabled and the not yet due ones without a request). Returns the decision when
    one was made."""
    if not (spec.get("autoscaling") or {}).get("enabled"):  # kopf's cached spec, before any parse
        a.forget(namespace, name)
        if (status or {}).get("autoscaling") is not None:  # turned off: its last decision no longer holds
            async with lock:
                await client.merge_patch(k8s.MODEL_SERVICES, namespace, name, {"status": {"autoscaling": None}},
                                         subresource="status")
        return None
    if not a.may_be_due(namespace, name, spec):
        return None
    body = await reads.model_service_body(client, namespace, name)
    if body is None or (body.get("metadata") or {}).get("deletionTimestamp"):
        a.forget(namespace, name)
        return None
    try:
        msvc = parse_model_service(body)
        settings = settings_from_spec(msvc.settings.autoscaling)
    except ValueError:
        return None  # the reconcile reports an invalid spec
    if settings is None:
        return None
    now = a.clock()
    if not a.due(namespace, name, settings.interval_s, now):
        return None
    a.last_run[(namespace, name)] = now
    deployments = await executor.observe(namespace, name, kinds=k8s.WORKLOADS)
    current = _shared_deployment_replicas(deployments, msvc)
    if current is None:
        return None  # not rendered yet: the reconcile creates it at the bounded spec.replicas
    lanes, _ = await reads.list_lanes(client, namespace, name)
    try:
        model = builders.runtime_config(msvc, [], builders.Overrides()).model.name
    except ValueError:
        return None
    # With minReplicas 0 the reader also measures idleness over scaleToZeroAfter.
    idle = {"idle_s": settings.policy.scale_to_zero_after_s} if settings.policy.min_replicas == 0 else {}
    sample = await a.read_sample(settings.prometheus_url, model, settings.window_s, ttft_targets(lanes),
                                 namespace=namespace, at=now, **idle)
    sample = with_ready_replicas(sample, deployments, msvc)
    decision = autoscaler.decide(settings.policy, current, sample, a.history.get((namespace, name), ()), now)
    a.history[(namespace, name)] = decision.history
    previous = (body.get("status") or {}).get("autoscaling")
    wanted = autoscaling_status(previous, current, decision, reason_of(decision, sample, current),
                                k8s.timestamp(now))
    async with lock:
        patch = status_mod.status_patch(body.get("status") or {}, {"autoscaling": wanted})
        if patch is not None:
            await client.merge_patch(k8s.MODEL_SERVICES, namespace, name, {"status": patch}, subresource="status")
    if decision.desired != current:
        log.info("autoscaling %s/%s: %s", namespace, name, decision.reason)
        await reconcile(namespace, name)
    return decision
