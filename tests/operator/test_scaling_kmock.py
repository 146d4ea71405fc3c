"""The autoscaling timer and the router render, with kopf against the kmock emulator: the timer
scales the shared pool's Deployment within the bounds, never writes spec, holds when metrics
go away, and gives the replicas back to spec.replicas when turned off. (The same on a real API
server, with the scale subresource and managed fields: tests/cluster/test_fleet_on_api_server.py.)
The fleet's metrics come from a reader the test sets: the fleet KV usage it returns drives
the decisions. A ModelService deleted while a run waits on that reader is gone soon after the
run returns (tests/cluster/test_deletion_on_api_server.py: the same on a real API server)."""

from __future__ import annotations

import asyncio
import copy
import logging

import operator_harness
import pytest
from operator_harness import NS, running_cluster, spec_writes  # tests/operator, put on sys.path by conftest

from tokenlane.operator.clients import kube as k8s
from tokenlane.operator.controllers import scaling
from tokenlane.operator.policy.autoscaler import FleetSample
from tokenlane.operator.controllers.handlers import Operator

AUTOSCALING = {"enabled": True, "prometheusUrl": "http://prometheus.invalid:9090", "minReplicas": 1,
               "maxReplicas": 3, "interval": "1s", "scaleDown": {"stabilizationWindow": "1h"}}


class FleetMetrics:
    """The metrics reader of the autoscaling timer: KV usage as the test sets it, or none; with
    `hold` set, each read waits for that event (a Prometheus slow to answer)."""

    def __init__(self) -> None:
        self.kv_usage: float | None = 0.95  # x1.27 of the 0.75 target: one replica more per decision
        self.reads: list[str] = []
        self.hold: asyncio.Event | None = None
        self.holding = asyncio.Event()
        # Scale to zero: the router's held requests now, and the requests seen over scaleToZeroAfter.
        self.held = 0.0
        self.recent = 0.0
        self.idle_windows: list[float] = []

    async def __call__(self, url, model, window_s, targets_s, *, namespace, at, idle_s=None) -> FleetSample:
        self.reads.append(model)
        if idle_s is not None:
            self.idle_windows.append(idle_s)
        if self.hold is not None:
            self.holding.set()
            await self.hold.wait()
        if self.kv_usage is None:
            return FleetSample.unavailable(at, "Prometheus is down (test)")
        return FleetSample(at=at, window_s=window_s, kv_usage=self.kv_usage, held_requests=self.held,
                           in_flight=self.recent, idle_window_requests=self.recent)


# The timer's tick (`tokenlane operator --autoscaling-tick-seconds`): a run comes at most one
# tick after spec.autoscaling.interval (1 s) has passed; with the default 5 s tick each decision
# waited up to 5 s.
TICK_S = 0.2


@pytest.fixture
async def scaled(kmock, monkeypatch):
    metrics = FleetMetrics()
    # The harness builds the Operator, and its timers take their ticks at registration.
    monkeypatch.setattr(operator_harness, "Operator",
                        lambda **kwargs: Operator(autoscaling=scaling.Autoscaling(tick_s=TICK_S), **kwargs))

    def use_test_metrics(registry, op):
        op.autoscaling.read_sample = metrics

    async with running_cluster(kmock, setup=use_test_metrics) as cluster:
        cluster.metrics = metrics
        yield cluster


def replicas(cluster, name="tiny") -> int:
    return (cluster.obj("deployments", name) or {}).get("spec", {}).get("replicas")


async def mark_ready(cluster, ready: int, name: str = "tiny") -> None:
    await cluster.client.merge_patch(k8s.DEPLOYMENTS, NS, name,
                                     {"status": {"replicas": ready, "readyReplicas": ready}}, subresource="status")


async def test_timer_scales_the_deployment_and_never_the_spec(scaled, tiny_samples, kmock):
    msvc = copy.deepcopy(tiny_samples[0])
    msvc["spec"].update(replicas=1, autoscaling=AUTOSCALING, router={"enabled": True})
    await scaled.create(msvc)
    await scaled.wait_for(lambda: scaled.obj("deployments", "tiny-router"), what="the router Deployment")
    service = await scaled.wait_for(lambda: scaled.obj("services", "tiny-router"), what="the router Service")
    assert service["spec"]["selector"]["app.kubernetes.io/component"] == "router"
    # kmock runs no pods: no replica gets ready, and the decision waits for them.
    await scaled.wait_for(lambda: "awaiting 2 starting replica" in
                          scaled.obj("modelservices", "tiny")["status"]["autoscaling"]["message"],
                          timeout=90, what="a hold for the replica still starting")
    assert replicas(scaled) == 2
    await mark_ready(scaled, 2)  # the kubelet's part: both pods pass their readiness probe
    await scaled.wait_for(lambda: replicas(scaled) == 3, timeout=90, what="scaled up to maxReplicas")
    status = scaled.obj("modelservices", "tiny")["status"]["autoscaling"]
    assert status["desiredReplicas"] == 3 and status["lastScaleTime"]
    assert scaled.metrics.reads and set(scaled.metrics.reads) == {"tiny"}
    assert scaled.obj("modelservices", "tiny")["spec"]["replicas"] == 1
    assert spec_writes(kmock) == []

    scaled.metrics.kv_usage = None  # metrics gone: the decision holds, and says why
    await scaled.wait_for(lambda: scaled.obj("modelservices", "tiny")["status"]["autoscaling"]["reason"]
                          == "MetricsUnavailable", timeout=30, what="a hold on missing metrics")
    assert replicas(scaled) == 3

    await scaled.patch_spec("modelservices", "tiny", {"autoscaling": {"enabled": False}, "router": {"enabled": False}})
    await scaled.wait_for(lambda: replicas(scaled) == 1, what="spec.replicas back in force")
    await scaled.wait_for(lambda: "autoscaling" not in scaled.obj("modelservices", "tiny")["status"], timeout=30,
                          what="status.autoscaling dropped")
    await scaled.wait_for(lambda: scaled.obj("deployments", "tiny-router") is None, what="the router removed")
    assert spec_writes(kmock) == []


async def test_deleted_mid_run_the_finalizer_goes_once_the_run_returns(scaled, tiny_samples, caplog):
    """kopf keeps a ModelService's finalizer while one of its timers is running and looks again
    only `settings.background.cancellation_polling` later (60 s by default): a `kubectl delete`
    during a timer's run that then wrote nothing (metrics down: a quiet hold) hung a minute.
    The run is held here, so that path is certain; the bound is about the hang, not speed
    (normally well under a second)."""
    caplog.set_level(logging.INFO, logger="tokenlane.operator")
    msvc = copy.deepcopy(tiny_samples[0])
    msvc["spec"].update(replicas=1, autoscaling=AUTOSCALING)
    scaled.metrics.kv_usage = None  # metrics down: the first run writes the hold, later ones nothing
    await scaled.create(msvc)
    await scaled.wait_for(lambda: scaled.obj("modelservices", "tiny")["status"]["autoscaling"]["reason"]
                          == "MetricsUnavailable", timeout=30, what="a hold on missing metrics")
    scaled.metrics.hold = asyncio.Event()
    await scaled.wait_for(scaled.metrics.holding.is_set, what="a run waiting on its metrics")
    await scaled.delete("modelservices", "tiny")
    await scaled.wait_for(lambda: any(f"ModelService {NS}/tiny deleted" in r.getMessage() for r in caplog.records),
                          what="the delete handler done")
    assert scaled.obj("modelservices", "tiny") is not None  # the finalizer waits for the run

    scaled.metrics.hold.set()
    await scaled.wait_for(lambda: scaled.obj("modelservices", "tiny") is None, timeout=20,
                          what="the finalizer released once the run returned")


def ready_condition(cluster, name="tiny") -> tuple:
    conds = (cluster.obj("modelservices", name).get("status") or {}).get("conditions") or []
    ready = next((c for c in conds if c["type"] == "Ready"), {})
    return ready.get("status"), ready.get("reason")


async def test_idle_pool_scales_to_zero_and_held_demand_wakes_it(scaled, tiny_samples, kmock):
    msvc = copy.deepcopy(tiny_samples[0])
    msvc["spec"].update(replicas=1, router={"enabled": True},
                        autoscaling={**AUTOSCALING, "minReplicas": 0, "maxReplicas": 2, "scaleToZeroAfter": "10m"})
    scaled.metrics.kv_usage = 0.1
    scaled.metrics.recent = 3.0  # requests in the last scaleToZeroAfter: the pool stays
    await scaled.create(msvc)
    await scaled.wait_for(lambda: replicas(scaled) == 1, what="the pool at spec.replicas")
    await mark_ready(scaled, 1)
    await scaled.wait_for(lambda: scaled.metrics.idle_windows, what="a read with the idle window")
    assert set(scaled.metrics.idle_windows) == {600.0}
    assert replicas(scaled) == 1

    scaled.metrics.recent = 0.0  # idle for scaleToZeroAfter
    await scaled.wait_for(lambda: replicas(scaled) == 0, timeout=30, what="scaled to zero")
    await mark_ready(scaled, 0)
    await scaled.wait_for(lambda: ready_condition(scaled) == ("True", "ScaledToZero"), timeout=30,
                          what="Ready with reason ScaledToZero")
    status = scaled.obj("modelservices", "tiny")["status"]
    assert status["autoscaling"]["reason"] == "ScaledToZero" and status["autoscaling"]["desiredReplicas"] == 0
    assert not any(c["type"] == "Degraded" and c["status"] == "True" for c in status["conditions"])
    assert scaled.obj("deployments", "tiny-router")["spec"]["replicas"] == 1  # the router stays up

    scaled.metrics.held = 2.0  # the router holds requests: 0 -> 1 at once
    await scaled.wait_for(lambda: replicas(scaled) == 1, timeout=30, what="woken from zero")
    assert scaled.obj("modelservices", "tiny")["status"]["autoscaling"]["reason"] == "ScaledFromZero"
    assert scaled.obj("modelservices", "tiny")["spec"]["replicas"] == 1
    assert spec_writes(kmock) == []
