"""Autoscaling and the router on the operator side, pure parts: spec.autoscaling -> policy,
Prometheus results -> FleetSample, the quiet status.autoscaling, the shared pool's replicas,
and the router's Deployment and Service (golden). The timer against a real API server:
tests/cluster/test_fleet_on_api_server.py."""

from __future__ import annotations

import copy
import dataclasses
import math
import os
from pathlib import Path

import pytest
import yaml

from tokenlane.operator.policy import autoscaler
from tokenlane.operator.desired import builders
from tokenlane.operator.tools import render
from tokenlane.operator.controllers import scaling
from tokenlane.operator.api.resources import parse_model_service, parse_serving_lane
from tokenlane.operator.clients.prometheus import Series

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).resolve().parent / "golden" / "router.yaml"

AUTOSCALING = {"enabled": True, "prometheusUrl": "http://prometheus:9090", "minReplicas": 2, "maxReplicas": 6,
               "scaleDown": {"stabilizationWindow": "10m"},
               "lanes": [{"lane": "interactive", "queueDelayP95Ms": 500, "sloAttainmentPercent": 95}]}


def tiny_docs() -> list[dict]:
    return [d for d in yaml.safe_load_all((ROOT / "manifests" / "samples" / "tiny-cpu.yaml").read_text())
            if d and d.get("kind") in ("ModelService", "ServingLane")]


def model_service(spec_changes: dict, status: dict | None = None) -> "builders.ModelService":
    doc = copy.deepcopy(tiny_docs()[0])
    doc["spec"].update(spec_changes)
    if status is not None:
        doc["status"] = status
    return parse_model_service(doc)


# spec.autoscaling values the CRD refuses, and the message (also applied to the real API server
# in tests/cluster/test_fleet_on_api_server.py).
AUTOSCALING_INVALID = [
    ({**AUTOSCALING, "minReplicas": 7}, "minReplicas must be <= maxReplicas"),
    ({k: v for k, v in AUTOSCALING.items() if k != "maxReplicas"}, "autoscaling.enabled needs autoscaling.maxReplicas"),
    ({k: v for k, v in AUTOSCALING.items() if k != "prometheusUrl"},
     "autoscaling.enabled needs autoscaling.prometheusUrl"),
    ({**AUTOSCALING, "lanes": [{"lane": "interactive"}]}, "a lane target needs queueDelayP95Ms or sloAttainmentPercent"),
    ({**AUTOSCALING, "lanes": [{"lane": "interactive", "sloAttainmentPercent": 100}]},
     "sloAttainmentPercent must be < 100"),
    ({**AUTOSCALING, "minReplicas": 0}, "autoscaling.minReplicas 0 needs router.enabled"),  # no spec.router
]


@pytest.mark.parametrize("autoscaling, message", AUTOSCALING_INVALID)
def test_cel_refuses_invalid_autoscaling(autoscaling, message):
    from test_crds import cel_failures  # the offline CEL evaluation of tests/operator/test_crds.py

    from tokenlane.operator.api import schema

    doc = copy.deepcopy(tiny_docs()[0])
    doc["spec"]["autoscaling"] = autoscaling
    failures = cel_failures("ModelService", schema.apply_defaults(schema.crd_schema("ModelService"), doc))
    assert any(message in f for f in failures), failures
    valid = copy.deepcopy(tiny_docs()[0])
    valid["spec"].update(autoscaling=AUTOSCALING, router={"enabled": True})
    assert not cel_failures("ModelService", schema.apply_defaults(schema.crd_schema("ModelService"), valid))


# --------------------------------------------------------------------------- spec -> policy


def test_settings_follow_the_spec():
    settings = scaling.settings_from_spec(model_service({"autoscaling": AUTOSCALING}).spec)
    policy = settings.policy
    assert (policy.min_replicas, policy.max_replicas) == (2, 6)
    assert (policy.scale_up_stabilization_s, policy.scale_down_stabilization_s) == (0.0, 600.0)
    assert policy.lanes == (autoscaler.LaneScalingTarget("interactive", 0.5, 0.95),)
    assert policy.kv_usage_target == 0.75
    assert (settings.interval_s, settings.window_s, settings.prometheus_url) == (30.0, 120.0, "http://prometheus:9090")


def test_settings_carry_the_load_now_knobs():
    defaults = scaling.settings_from_spec(model_service({"autoscaling": AUTOSCALING}).spec).policy
    assert (defaults.running_share_target, defaults.headroom_replicas, defaults.target_utilization) == (None, 0.0, 0.8)
    knobs = {**AUTOSCALING, "runningShareTarget": 0.4, "headroomReplicas": 0.5, "targetUtilization": 0.7}
    policy = scaling.settings_from_spec(model_service({"autoscaling": knobs}).spec).policy
    assert (policy.running_share_target, policy.headroom_replicas, policy.target_utilization) == (0.4, 0.5, 0.7)
    with pytest.raises(ValueError, match="spec.autoscaling: targetUtilization"):
        scaling.settings_from_spec({"autoscaling": {**knobs, "targetUtilization": 1.5}})


def test_settings_off_when_disabled_or_absent():
    assert scaling.settings_from_spec(model_service({}).spec) is None
    assert scaling.settings_from_spec(model_service({"autoscaling": {**AUTOSCALING, "enabled": False}}).spec) is None


@pytest.mark.parametrize("change, message", [
    ({"prometheusUrl": None}, "autoscaling.enabled needs autoscaling.prometheusUrl"),
    ({"maxReplicas": None}, "autoscaling.enabled needs autoscaling.maxReplicas"),
    ({"minReplicas": 7}, "maxReplicas (6) must be >= minReplicas (7)"),
])
def test_settings_refuse_what_the_api_server_refuses(change, message):
    raw = {k: v for k, v in {**AUTOSCALING, **change}.items() if v is not None}
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        scaling.settings_from_spec({"autoscaling": raw})


def test_ttft_targets_come_from_the_lanes_slo():
    lanes = [parse_serving_lane(d) for d in tiny_docs()[1:]]
    targets = scaling.ttft_targets(lanes)
    expected = {lane.lane_name: lane.spec["slo"]["ttftP95Ms"] / 1000 for lane in lanes
                if (lane.spec.get("slo") or {}).get("ttftP95Ms")}
    assert targets == expected and targets  # the sample declares at least one


# --------------------------------------------------------------------------- Prometheus -> sample


def test_queries_select_the_model_in_its_namespace_only():
    promql = scaling.queries("tiny", 120, "team-a")
    assert all('model="tiny"' in q and 'namespace="team-a"' in q for q in promql.values())
    load_now = {"waiting", "running", "running_by_replica"}  # averaged over the last quarter of the window only
    assert all("[120s" in q for name, q in promql.items() if name not in load_now | {"max_active", "held"})
    assert all("[30s]" in promql[name] for name in load_now)
    assert "[30s:]" in promql["held"]  # the router's held requests: the most over the last quarter
    assert "idle_window_requests" not in promql  # only with minReplicas 0
    assert "[900s]" in scaling.queries("tiny", 120, "team-a", idle_s=900)["idle_window_requests"]
    with pytest.raises(ValueError, match="quotes"):
        scaling.queries('x"}', 60)


def test_fleet_sample_from_results():
    results = {
        "requests": [Series({"lane": "interactive"}, 1.0), Series({"lane": "batch"}, 0.5)],
        "queue_delay_p95": [Series({"lane": "interactive"}, 0.8), Series({"lane": "batch"}, None)],
        # cumulative TTFT buckets of the interactive lane: 0.6/s within 0.25 s, 0.9/s within 0.5 s
        "ttft_buckets": [Series({"lane": "interactive", "le": "0.25"}, 0.6),
                         Series({"lane": "interactive", "le": "0.5"}, 0.9),
                         Series({"lane": "interactive", "le": "+Inf"}, 0.95)],
        "kv_usage": [Series({}, 0.4)],
    }
    sample = scaling.fleet_sample(results, at=100.0, window_s=60.0, targets_s={"interactive": 0.5})
    assert sample.available and sample.kv_usage == 0.4 and (sample.at, sample.window_s) == (100.0, 60.0)
    interactive, batch = sample.lanes["interactive"], sample.lanes["batch"]
    # 0.9 of the 1.0 requests/s met 0.5 s; the 0.05/s without a first token count as misses.
    assert interactive == autoscaler.LaneSample(1.0, 0.8, pytest.approx(0.9))
    assert batch == autoscaler.LaneSample(0.5, None, None)  # no target, no attainment


def test_fleet_sample_carries_the_load_now():
    results = {
        "requests": [Series({"lane": "interactive"}, 10.0), Series({"lane": "batch"}, 1.0)],
        "served": [Series({"lane": "interactive"}, 9.0)],
        "ended": [Series({"lane": "interactive"}, 9.5)],
        # 120 more waiting and 60 more running than a 60 s window ago: 3 more arrivals per second
        "waiting_growth": [Series({"lane": "interactive"}, 120.0)],
        "running_growth": [Series({"lane": "interactive"}, 60.0)],
        "waiting": [Series({"lane": "interactive"}, 130.0)],
        "running": [Series({"lane": "interactive"}, 48.0)],
        "max_active": [Series({"lane": "interactive"}, 96.0)],
        "serving_replicas": [Series({}, 1.5)],  # one replica joined halfway through the window
    }
    sample = scaling.fleet_sample(results, at=100.0, window_s=60.0, targets_s={})
    assert sample.serving_replicas == 1.5
    interactive, batch = sample.lanes["interactive"], sample.lanes["batch"]
    assert (interactive.waiting, interactive.served_rate, interactive.running_share) == (130.0, 9.0, 0.5)
    assert interactive.arrival_rate == pytest.approx(9.5 + 3.0)
    assert (batch.waiting, batch.arrival_rate, batch.running_share) == (None, None, None)  # no series
    assert interactive.replica_running_shares is None and batch.replica_running_shares is None
    # 130 waiting at 9 served/s is ~14 s of queue: saturated, sized by arrivals / served.
    policy = autoscaler.AutoscalingPolicy(1, 10, (autoscaler.LaneScalingTarget("interactive", 0.5),))
    decision = autoscaler.decide(policy, 2, dataclasses.replace(sample, ready_replicas=2), (), 100.0)
    assert decision.desired == math.ceil(1.5 * 12.5 / (9.0 * policy.target_utilization))
    assert "waiting" in decision.reason


def test_fleet_sample_carries_each_replicas_running_share():
    """A replica that just joined reads as idle next to the saturated one it relieves: summed
    per replica the load is 1.53 + 0.22 replicas, where the mean (48% on 2) reads 2 x 1.10."""
    results = {
        "requests": [Series({"lane": "interactive"}, 10.0)],
        "served": [Series({"lane": "interactive"}, 10.0)],
        "ended": [Series({"lane": "interactive"}, 10.0)],
        "waiting": [Series({"lane": "interactive"}, 0.0)],
        "running": [Series({"lane": "interactive"}, 48.0)],
        "running_by_replica": [Series({"lane": "interactive", "instance": "10.0.0.7:8000"}, 94.0),
                               Series({"lane": "interactive", "instance": "10.0.0.9:8000"}, 2.0),
                               Series({"lane": "interactive", "instance": "10.0.0.8:8000"}, None)],
        "max_active": [Series({"lane": "interactive"}, 100.0)],
    }
    sample = dataclasses.replace(scaling.fleet_sample(results, at=100.0, window_s=60.0, targets_s={}),
                                 ready_replicas=2)
    assert sample.lanes["interactive"].replica_running_shares == (0.02, 0.94)  # a series without a value left out
    policy = autoscaler.AutoscalingPolicy(1, 10, (autoscaler.LaneScalingTarget("interactive", 0.5),),
                                          running_share_target=0.4, headroom_replicas=0.4)
    decision = autoscaler.decide(policy, 2, sample, (), 100.0)
    assert (decision.desired, decision.action) == (2, autoscaler.HOLD), decision.reason
    mean_only = dataclasses.replace(sample, lanes={"interactive": dataclasses.replace(
        sample.lanes["interactive"], replica_running_shares=None)})
    assert autoscaler.decide(policy, 2, mean_only, (), 100.0).desired == 3  # 2 x sqrt(0.48 / 0.4) + 0.4 = 2.59


def test_a_target_between_bucket_bounds_is_judged_by_the_lower_bound():
    results = {"requests": [Series({"lane": "a"}, 2.0)],
               "ttft_buckets": [Series({"lane": "a", "le": "0.25"}, 1.0), Series({"lane": "a", "le": "0.5"}, 2.0)]}
    sample = scaling.fleet_sample(results, 0.0, 60.0, {"a": 0.4})
    assert sample.lanes["a"].slo_attainment == pytest.approx(0.5)


def test_no_series_is_a_sample_the_decision_holds_on():
    sample = scaling.fleet_sample({}, 0.0, 60.0, {})
    policy = autoscaler.AutoscalingPolicy(1, 4, (autoscaler.LaneScalingTarget("a", 0.5),))
    decision = autoscaler.decide(policy, 2, sample, (), 0.0)
    assert (decision.desired, decision.action) == (2, autoscaler.HOLD)


def test_the_sample_carries_the_shared_deployments_ready_replicas():
    msvc = model_service({"replicas": 4, "autoscaling": AUTOSCALING})
    shared = {"metadata": {"name": msvc.name}, "spec": {"replicas": 4}, "status": {"replicas": 4, "readyReplicas": 1}}
    other = {"metadata": {"name": msvc.name + "-batch"}, "spec": {"replicas": 2}, "status": {"readyReplicas": 2}}
    sample = scaling.fleet_sample({}, 0.0, 60.0, {})
    assert scaling.with_ready_replicas(sample, [other, shared], msvc).ready_replicas == 1
    fresh = {**shared, "status": {}}  # no pod ready yet: the field is absent
    assert scaling.with_ready_replicas(sample, [fresh], msvc).ready_replicas == 0
    assert scaling.with_ready_replicas(sample, [other], msvc).ready_replicas is None
    unavailable = autoscaler.FleetSample.unavailable(0.0, "prometheus down")
    assert scaling.with_ready_replicas(unavailable, [shared], msvc) == unavailable
    # 1 of 4 ready and the lane x2 over its target: the 3 starting replicas cover it.
    policy = autoscaler.AutoscalingPolicy(1, 6, (autoscaler.LaneScalingTarget("interactive", 0.5),))
    loaded = autoscaler.FleetSample(at=0.0, window_s=60.0, lanes={
        "interactive": autoscaler.LaneSample(request_rate=1.0, queue_delay_p95_s=1.0)})
    decision = autoscaler.decide(policy, 4, scaling.with_ready_replicas(loaded, [shared], msvc), (), 0.0)
    assert (decision.desired, decision.action) == (4, autoscaler.HOLD)
    assert autoscaler.decide(policy, 4, loaded, (), 0.0).desired == 6  # unknown readiness: all 4 count


async def test_prometheus_unreachable_is_an_unavailable_sample():
    sample = await scaling.read_prometheus("http://127.0.0.1:1", "tiny", 60, {}, namespace="ns", at=5.0)
    assert not sample.available and "cannot reach" in sample.error and sample.at == 5.0


# --------------------------------------------------------------------------- the quiet status


def decision(desired: int, action: str, reason: str) -> autoscaler.ScalingDecision:
    return autoscaler.ScalingDecision(desired, action, reason, desired, ())


def test_status_is_written_when_counts_or_reason_change_only():
    up = scaling.autoscaling_status(None, 2, decision(3, autoscaler.UP, "scale up 2 -> 3: KV usage 95%"),
                                    scaling.SCALED_UP, "2026-01-01T00:00:00Z")
    assert up == {"currentReplicas": 2, "desiredReplicas": 3, "reason": "ScaledUp",
                  "message": "scale up 2 -> 3: KV usage 95%", "lastScaleTime": "2026-01-01T00:00:00Z"}
    held = scaling.autoscaling_status(up, 3, decision(3, autoscaler.HOLD, "holding at 3: KV usage 70%"),
                                      scaling.HOLDING, "2026-01-01T00:00:30Z")
    assert held["reason"] == "Holding" and held["lastScaleTime"] == "2026-01-01T00:00:00Z"
    # The same verdict with new numbers: status unchanged (no write).
    again = scaling.autoscaling_status(held, 3, decision(3, autoscaler.HOLD, "holding at 3: KV usage 71%"),
                                       scaling.HOLDING, "2026-01-01T00:01:00Z")
    assert again == held


def test_reason_says_when_metrics_are_missing():
    hold = decision(2, autoscaler.HOLD, "holding at 2: metrics unavailable")
    assert scaling.reason_of(hold, autoscaler.FleetSample.unavailable(0.0, "down")) == scaling.METRICS_UNAVAILABLE
    assert scaling.reason_of(hold, None) == scaling.METRICS_UNAVAILABLE
    assert scaling.reason_of(hold, autoscaler.FleetSample(0.0, 60.0)) == scaling.HOLDING


# --------------------------------------------------------------------------- the shared pool's replicas


@pytest.mark.parametrize("spec_replicas, autoscaling, status, expected", [
    (3, None, None, 3),  # off: spec.replicas, as the scale subresource sets it
    (3, {**AUTOSCALING, "enabled": False}, {"autoscaling": {"desiredReplicas": 5}}, 3),
    (3, AUTOSCALING, None, 3),  # on, no decision yet: spec.replicas within the bounds
    (1, AUTOSCALING, None, 2),
    (9, AUTOSCALING, None, 6),
    (3, AUTOSCALING, {"autoscaling": {"desiredReplicas": 5}}, 5),  # the decision, not spec.replicas
    (3, AUTOSCALING, {"autoscaling": {"desiredReplicas": 50}}, 6),  # bounds edited below a decision
])
def test_shared_replicas(spec_replicas, autoscaling, status, expected):
    spec = {"replicas": spec_replicas, **({"autoscaling": autoscaling} if autoscaling else {})}
    msvc = model_service(spec, status)
    assert builders.shared_replicas(msvc) == expected
    deployment = next(o for o in builders.build(msvc, []).objects
                      if o["kind"] == "Deployment" and o["metadata"]["name"] == msvc.name)
    assert deployment["spec"]["replicas"] == expected


@pytest.mark.parametrize("change, message", [
    ({"maxReplicas": None}, "needs autoscaling.maxReplicas"),
    ({"prometheusUrl": None}, "needs autoscaling.prometheusUrl"),
    ({"minReplicas": 7}, r"minReplicas \(7\) must be <= maxReplicas \(6\)"),
])
def test_rendering_refuses_what_the_crd_refuses(change, message):
    """Where no API server checked the spec (kmock, `tokenlane render`), the render refuses it."""
    spec = {"autoscaling": {k: v for k, v in {**AUTOSCALING, **change}.items() if v is not None}}
    msvc = builders.ModelService(ref=model_service({}).ref, spec={**model_service({}).spec, **spec})
    with pytest.raises(ValueError, match=message):
        builders.build(msvc, [])


# --------------------------------------------------------------------------- the router


def router_objects(docs: list[dict]) -> list[dict]:
    objects, problems = render.render_documents(docs, namespace="tokenlane")
    assert not problems
    return [o for o in objects if o["metadata"]["name"].endswith("-router")]


def test_router_golden():
    docs = tiny_docs()
    docs[0]["spec"]["router"] = {"enabled": True, "replicas": 2, "resources": {"requests": {"cpu": "500m"}}}
    out = render.dump_objects(router_objects(docs))
    if os.environ.get("TOKENLANE_REGEN_GOLDEN"):
        GOLDEN.write_text(out)
    assert out == GOLDEN.read_text(), "router render changed; TOKENLANE_REGEN_GOLDEN=1 to accept"


def test_router_fronts_the_shared_pool_only():
    docs = tiny_docs()
    name = docs[0]["metadata"]["name"]
    assert router_objects(docs) == []  # off by default
    docs[0]["spec"]["router"] = {"enabled": True}
    deployment, service = router_objects(docs)
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[:5] == ["router", "--endpointslice-service", name, "--namespace", "tokenlane"]
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    # The runtime Service must not select router pods, and the router Service no runtime pods.
    runtime_service = next(o for o in render.render_documents(docs, namespace="tokenlane")[0]
                           if o["kind"] == "Service" and o["metadata"]["name"] == name)
    assert not all(pod_labels.get(k) == v for k, v in runtime_service["spec"]["selector"].items())
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    assert service["spec"]["selector"]["app.kubernetes.io/component"] == "router"
    assert deployment["spec"]["template"]["spec"]["serviceAccountName"] == "tokenlane-router"


def test_router_name_clash_with_a_dedicated_lane_is_refused():
    docs = tiny_docs()
    docs[0]["spec"]["router"] = {"enabled": True}
    lane = copy.deepcopy(docs[1])
    lane["metadata"]["name"] = "router"
    lane["spec"].update({"laneName": "router", "isolation": "dedicated", "default": False})
    lane["spec"].pop("match", None)
    msvc = parse_model_service(docs[0])
    with pytest.raises(ValueError, match="router's objects are named"):
        builders.build(msvc, [parse_serving_lane(lane)])


# --------------------------------------------------------------------------- scale to zero

ZERO = {**AUTOSCALING, "minReplicas": 0, "scaleToZeroAfter": "20m"}


def test_min_zero_with_the_router_is_valid_and_reaches_the_policy():
    from test_crds import cel_failures

    from tokenlane.operator.api import schema

    doc = copy.deepcopy(tiny_docs()[0])
    doc["spec"].update(autoscaling=ZERO, router={"enabled": True})
    assert not cel_failures("ModelService", schema.apply_defaults(schema.crd_schema("ModelService"), doc))
    msvc = parse_model_service(doc)
    settings = scaling.settings_from_spec(msvc.settings.autoscaling)
    assert (settings.policy.min_replicas, settings.policy.scale_to_zero_after_s) == (0, 1200.0)
    default = scaling.settings_from_spec(model_service({"autoscaling": {k: v for k, v in ZERO.items() if k != "scaleToZeroAfter"},
                                                        "router": {"enabled": True}}).settings.autoscaling)
    assert default.policy.scale_to_zero_after_s == 900.0  # the CRD's 15m


def test_min_zero_without_the_router_is_an_invalid_spec_naming_both_fields():
    # What the CEL rule refuses is refused again when typing the spec (an invalid-spec status).
    with pytest.raises(ValueError, match=r"spec\.autoscaling\.minReplicas.*spec\.router\.enabled"):
        model_service({"autoscaling": ZERO, "router": {"enabled": False}})


def test_fleet_sample_reads_the_routers_held_demand_and_idleness():
    results = {"held": [Series({}, 2.0)], "without_replica": [Series({}, 5.0)],
               "idle_window_requests": [Series({}, 0.0)],
               "waiting": [Series({"lane": "interactive"}, 0.0)], "running": [Series({"lane": "interactive"}, 0.0)]}
    sample = scaling.fleet_sample(results, at=100.0, window_s=60.0, targets_s={})
    assert (sample.held_requests, sample.arrivals_without_replica, sample.in_flight, sample.idle_window_requests) \
        == (2.0, 5.0, 0.0, 0.0)
    empty = scaling.fleet_sample({}, at=100.0, window_s=60.0, targets_s={})  # nothing exported: unknown
    assert (empty.held_requests, empty.in_flight, empty.idle_window_requests) == (None, None, None)


def test_reasons_and_ready_condition_at_zero():
    from tokenlane.operator.desired import status

    policy = autoscaler.AutoscalingPolicy(0, 3)
    woken = autoscaler.decide(policy, 0, autoscaler.FleetSample(at=1.0, window_s=60.0, held_requests=1.0), (), 1.0)
    assert scaling.reason_of(woken, None, 0) == "ScaledFromZero"
    idle = autoscaler.FleetSample(at=1.0, window_s=60.0, held_requests=0.0, in_flight=0.0, idle_window_requests=0.0)
    asleep = autoscaler.decide(policy, 2, idle, (), 1.0)
    assert asleep.desired == 0 and scaling.reason_of(asleep, idle, 2) == "ScaledToZero"

    msvc = model_service({"autoscaling": ZERO, "router": {"enabled": True}},
                         status={"autoscaling": {"desiredReplicas": 0, "currentReplicas": 2, "reason": "ScaledToZero"}})
    lanes = [parse_serving_lane(d) for d in tiny_docs() if d["kind"] == "ServingLane"]
    desired = builders.build(msvc, lanes)
    assert desired.shared.replicas == 0 and builders.shared_replicas(msvc) == 0
    deployments = {desired.shared.object_name: {"status": {"replicas": 0, "readyReplicas": 0}}}
    conditions = {c["type"]: c for c in status.model_service_status(msvc, desired, deployments, "t")["conditions"]}
    assert (conditions["Ready"]["status"], conditions["Ready"]["reason"]) == ("True", "ScaledToZero")
    assert conditions["Degraded"]["status"] == "False"
    shared_lane = next(lane for lane in lanes if not lane.dedicated)
    lane_ready = next(c for c in status.lane_status(shared_lane, msvc, desired, deployments, "t")["conditions"]
                      if c["type"] == "Ready")
    assert (lane_ready["status"], lane_ready["reason"]) == ("True", "ScaledToZero")
