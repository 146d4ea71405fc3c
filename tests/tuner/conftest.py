"""Fixtures of the tuner tests; `tuner_helpers` holds the plain builders they share."""

from __future__ import annotations

import sys
from pathlib import Path

# --import-mode=importlib does not put test folders on sys.path; the helpers module has a
# unique name so it cannot clash with another area's.
sys.path.insert(0, str(Path(__file__).parent))

sys.path.insert(0, str(Path(__file__).parents[1] / "operator"))  # the shared kmock harness

import operator_harness  # noqa: E402
import pytest  # noqa: E402


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

    async def __call__(self, url, model, window_s, lanes, *, namespace=None):
        from tokenlane.operator.api.tuning_types import MetricSample

        self.calls.append((url, model, window_s, tuple(lanes), namespace))
        if self.sample is None:
            return MetricSample.unavailable(f"cannot reach {url}: ConnectError", window_s)
        return self.sample


@pytest.fixture
async def guarded_cluster(kmock):
    """kopf (operator handlers + the tuning timer) against kmock, with a fake clock and metrics."""
    from tokenlane.operator.controllers import tuning

    clock, metrics = FakeClock(), FakeMetrics()

    def add_tuning(registry, op):
        return tuning.register(registry, op, tuning=tuning.Tuning(op, clock=clock, read_sample=metrics, tick_s=0.2))

    async with operator_harness.running_cluster(kmock, setup=add_tuning) as cluster:
        cluster.clock, cluster.metrics, cluster.tuning, cluster.harness = clock, metrics, cluster.extra, operator_harness
        yield cluster
        # The tuner and the rollout guard decide in status and owned objects, never in spec.
        assert operator_harness.spec_writes(kmock) == []
    # The tuner's calls (rollout ConfigMap, lane status, Events) need RBAC too: api_calls.json lists them.
    missing = operator_harness.unlisted_calls()
    assert not missing, (f"the tuner made calls missing from {operator_harness.API_CALLS_FILE.name}; regenerate with "
                         f"TOKENLANE_REGEN_API_CALLS=1 python -m pytest tests/operator tests/tuner -k kmock: {missing}")
