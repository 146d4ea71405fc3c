"""Fixtures of the tuner tests; `tuner_helpers` holds the plain builders they share."""

from __future__ import annotations

import sys
from pathlib import Path

# --import-mode=importlib does not put test folders on sys.path; the helpers module has a
# unique name so it cannot clash with another area's.
sys.path.insert(0, str(Path(__file__).parent))

import asyncio  # noqa: E402
import importlib.util  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402

_OPERATOR_CONFTEST = Path(__file__).parents[1] / "operator" / "conftest.py"


def _operator_fixtures():
    """The operator helper's kmock harness (Cluster, resources), loaded by path."""
    spec = importlib.util.spec_from_file_location("tokenlane_operator_test_harness", _OPERATOR_CONFTEST)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class FakeClock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class FakeMetrics:
    """What 'Prometheus' answers: a MetricSample the test sets, or None for unreachable."""

    def __init__(self) -> None:
        self.sample = None
        self.calls: list[tuple] = []

    async def __call__(self, url, model, window_s, lanes):
        from tokenlane.operator.tuner import MetricSample

        self.calls.append((url, model, window_s, tuple(lanes)))
        if self.sample is None:
            return MetricSample.unavailable(f"cannot reach {url}: ConnectError", window_s)
        return self.sample


@pytest.fixture
async def guarded_cluster(kmock):
    """kopf (operator handlers + the tuning timer) against kmock, with a fake clock and metrics."""
    if not _OPERATOR_CONFTEST.exists():
        pytest.skip("the operator's kmock harness (tests/operator/conftest.py) is missing")
    import kopf

    from tokenlane.operator import tuning
    from tokenlane.operator.handlers import Operator, register

    harness = _operator_fixtures()
    for key, (kind, namespaced, subresources) in harness.RESOURCES.items():
        kmock.resources[key] = kmock.ResourceInfo(kind=kind, namespaced=namespaced, verbs=harness.VERBS,
                                                  subresources=set(subresources))
    from tokenlane.operator import schema

    for make in (schema.model_service_crd, schema.serving_lane_crd):
        crd = make()
        kmock.objects["apiextensions.k8s.io/v1/customresourcedefinitions", None, crd["metadata"]["name"]] = crd
    kmock.objects["v1/namespaces", None, harness.NS] = {"metadata": {"name": harness.NS}}

    op = Operator(timer_interval_s=3600)
    registry = register(kopf.OperatorRegistry(), op,
                        login=lambda **_: kopf.ConnectionInfo(server=str(kmock.url), insecure=True))
    clock, metrics = FakeClock(), FakeMetrics()
    t = tuning.register(registry, op, tuning=tuning.Tuning(op, clock=clock, read_sample=metrics, tick_s=0.2))

    @kopf.on.startup(registry=registry)
    def fast(settings: kopf.OperatorSettings, **_: Any) -> None:
        settings.watching.reconnect_backoff = 0.1
        settings.posting.enabled = True
        settings.persistence.consistency_timeout = 0.5

    stop = asyncio.Event()
    task = asyncio.create_task(kopf.operator(registry=registry, clusterwide=True, standalone=True, stop_flag=stop))
    cluster = harness.Cluster(kmock, op)
    cluster.clock, cluster.metrics, cluster.tuning, cluster.harness = clock, metrics, t, harness
    try:
        yield cluster
    finally:
        stop.set()
        try:
            await asyncio.wait_for(task, timeout=10)
        except (asyncio.TimeoutError, asyncio.CancelledError):
            task.cancel()
        await cluster.client.close()
