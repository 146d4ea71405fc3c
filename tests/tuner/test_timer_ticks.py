"""`tokenlane operator --tuning-tick-seconds / --autoscaling-tick-seconds`: how often the timers
check whether a ModelService's interval has passed (operator/main.py). The cluster tier runs its
operator with short ticks (tests/cluster/cluster_harness.py)."""

from __future__ import annotations

from types import SimpleNamespace

import kopf
import pytest

from tokenlane.operator import main
from tokenlane.operator.controllers import scaling, tuning


def timer_intervals(registry) -> dict[str, tuple[float, float]]:
    """{handler name: (interval, initial_delay)} of the registry's kopf timers (kopf keeps them
    in its spawning registry; there is no public accessor)."""
    return {h.id.rsplit(".", 1)[-1]: (h.interval, h.initial_delay) for h in registry._spawning.get_all_handlers()}


def test_the_ticks_default_to_the_modules_constants():
    args = main.parse_args(["-n", "team"])
    assert (args.tuning_tick_seconds, args.autoscaling_tick_seconds) == (tuning.TICK_S, scaling.TICK_S) == (10.0, 5.0)
    registry, op, t = main.operator_registry(args)
    assert timer_intervals(registry)["tuning_timer"] == (10.0, 10.0)
    assert timer_intervals(registry)["autoscaling_timer"] == (5.0, 5.0)


def test_the_ticks_given_reach_the_timers():
    args = main.parse_args(["-n", "team", "--tuning-tick-seconds", "1.5", "--autoscaling-tick-seconds", "0.5"])
    registry, op, t = main.operator_registry(args)
    assert t.tick_s == 1.5 and op.autoscaling.tick_s == 0.5
    intervals = timer_intervals(registry)
    assert intervals["tuning_timer"] == (1.5, 1.5)
    assert intervals["autoscaling_timer"] == (0.5, 0.5)
    assert intervals["model_service_timer"] == (60.0, 60.0)  # the periodic reconcile is not a tick


@pytest.mark.parametrize("flag", ["--tuning-tick-seconds", "--autoscaling-tick-seconds"])
@pytest.mark.parametrize("value, message", [("0", "above 0"), ("-1", "above 0"), ("inf", "above 0"),
                                            ("nan", "above 0"), ("10s", "is not a number of seconds")])
def test_a_tick_that_is_not_a_positive_number_of_seconds_is_refused(flag, value, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main.parse_args(["-n", "team", f"{flag}={value}"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}:" in err and message in err, err


class RecordingClient:
    """A Kubernetes client that records the reads and finds nothing (the object is gone)."""

    def __init__(self) -> None:
        self.reads: list[tuple] = []

    async def get(self, resource, namespace, name, **_):
        self.reads.append((resource.plural, namespace, name))
        return None


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def tuning_timer_of(registry):
    (handler,) = [h for h in registry._spawning.get_all_handlers() if h.id.endswith(".tuning_timer")]
    return handler.fn


async def test_a_tuning_tick_before_the_interval_reads_nothing():
    client, clock = RecordingClient(), Clock(1000.0)
    op = SimpleNamespace(client=client)
    registry = kopf.OperatorRegistry()
    t = tuning.register(registry, op, tuning=tuning.Tuning(op, clock=clock, tick_s=1.0))
    timer = tuning_timer_of(registry)
    spec = {"tuning": {"interval": "60s"}}
    t.last_run[("team", "chat")] = 1000.0 - 59
    await timer(namespace="team", name="chat", spec=spec)
    assert client.reads == []
    clock.now += 1  # the interval has passed: the run reads the ModelService (gone here: it stops)
    await timer(namespace="team", name="chat", spec=spec)
    assert client.reads == [("modelservices", "team", "chat")]
    assert t.may_be_due("team", "never-ran", spec)
    assert t.may_be_due("team", "chat", {"tuning": {"interval": "not a duration"}})  # the run reports it


async def test_an_autoscaling_tick_before_the_interval_reads_nothing():
    client, clock = RecordingClient(), Clock(1000.0)
    a = scaling.Autoscaling(clock=clock, tick_s=1.0)
    spec = {"autoscaling": {"enabled": True, "interval": "30s"}}
    a.last_run[("team", "chat")] = 1000.0 - 29

    async def tick() -> None:
        await scaling.tick(a, client, None, None, "team", "chat", spec, None, reconcile=None)

    await tick()
    assert client.reads == []
    clock.now += 1
    await tick()
    assert client.reads == [("modelservices", "team", "chat")]
