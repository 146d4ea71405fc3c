"""AsyncEngine: background loop, per-request streams, abort, draining, crash handling."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

from tokenlane.runtime.admission import AdmissionError
from tokenlane.runtime.async_engine import AsyncEngine
from tokenlane.runtime.engine import LLMEngine
from tokenlane.runtime.request import FinishReason, Request, SamplingParams
from tokenlane.runtime.testing import FakeExecutor, make_config


class SlowFake(FakeExecutor):
    """Takes real time per step, like a model would (runs in the worker thread)."""

    def __init__(self, *args, sleep_s=0.005, **kw):
        super().__init__(*args, **kw)
        self.sleep_s = sleep_s

    def execute(self, plan):
        time.sleep(self.sleep_s)
        return super().execute(plan)


def make(sleep_s=0.005, num_blocks=64, **kw):
    config = make_config(max_model_len=512, **kw)
    ex = SlowFake(num_blocks, config.engine.block_size, sleep_s=sleep_s, max_model_len=None)
    return AsyncEngine(LLMEngine(config, ex)), ex


def req(rid, n=6, max_tokens=4, **kw):
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens), **kw)


async def collect(stream):
    return [out async for out in stream]


async def test_streams_deliver_tokens_then_a_final_output():
    engine, ex = make()
    await engine.start()
    assert engine.ready and engine.healthy
    streams = [engine.submit(req(f"r{i}", n=3 + i, max_tokens=2 + i)) for i in range(5)]
    results = await asyncio.wait_for(asyncio.gather(*(collect(s) for s in streams)), 10)
    for i, outs in enumerate(results):
        assert sum(len(o.new_token_ids) for o in outs) == 2 + i
        assert outs[-1].finished and outs[-1].finish_reason is FinishReason.LENGTH
        assert not any(o.finished for o in outs[:-1])
    assert engine.engine.scheduler.kv.num_free_blocks == 64
    await engine.shutdown(1.0)


async def test_submit_rejects_synchronously():
    engine, ex = make()
    await engine.start()
    with pytest.raises(AdmissionError) as e:
        engine.submit(req("long", n=500, max_tokens=100))
    assert (e.value.status, e.value.reason) == (400, "too_long")
    await engine.shutdown(1.0)


async def test_abort_takes_effect_within_one_step():
    engine, ex = make(sleep_s=0.01, num_blocks=256)
    await engine.start()
    stream = engine.submit(req("a", max_tokens=400))
    other = engine.submit(req("b", n=5, max_tokens=30))
    outs = [await stream.__anext__() for _ in range(3)]
    steps_before = len(ex.plans)
    staged = []
    real_abort_request = engine.engine.abort_request
    engine.engine.abort_request = lambda *args: (staged.append(args), real_abort_request(*args))
    stream.abort("client_disconnect")
    assert len(staged) == 1  # one abort, carrying its reason
    rest = await asyncio.wait_for(collect(stream), 5)
    assert rest[-1].finished and rest[-1].finish_reason is FinishReason.CANCELLED
    assert rest[-1].finish_detail == "client_disconnect"  # the metrics' reason label
    # At most the step already running when abort() was called, plus the one that applies it.
    assert len(ex.plans) - steps_before <= 2
    assert sum(len(o.new_token_ids) for o in outs + rest) < 10
    others = await asyncio.wait_for(collect(other), 5)  # the other tenant is untouched
    assert others[-1].finish_reason is FinishReason.LENGTH
    assert engine.engine.scheduler.kv.num_free_blocks == 256
    await engine.shutdown(1.0)


async def test_event_loop_stays_responsive_during_steps():
    engine, ex = make(sleep_s=0.2)
    await engine.start()
    stream = engine.submit(req("a", max_tokens=2))
    ticks = 0
    t0 = time.monotonic()
    while time.monotonic() - t0 < 0.3:
        await asyncio.sleep(0.01)
        ticks += 1
    assert ticks >= 10, "the event loop was blocked by the model step"
    await asyncio.wait_for(collect(stream), 5)
    await engine.shutdown(1.0)


async def test_shutdown_drains_then_aborts():
    engine, ex = make(sleep_s=0.01, num_blocks=256)
    await engine.start()
    short = engine.submit(req("short", max_tokens=2))
    long = engine.submit(req("long", max_tokens=300))
    drain = asyncio.create_task(engine.shutdown(0.3))
    await asyncio.sleep(0)
    assert engine.draining and not engine.ready
    with pytest.raises(AdmissionError) as e:
        engine.submit(req("late"))
    assert (e.value.status, e.value.reason) == (503, "draining")
    short_outs = await asyncio.wait_for(collect(short), 5)
    long_outs = await asyncio.wait_for(collect(long), 5)
    await asyncio.wait_for(drain, 10)
    assert short_outs[-1].finish_reason is FinishReason.LENGTH
    assert long_outs[-1].finish_reason is FinishReason.CANCELLED
    assert long_outs[-1].finish_detail == "shutdown"
    assert engine.engine.scheduler.kv.num_free_blocks == 256


async def test_refusals_of_the_async_front_reach_the_observers():
    """A 503 while draining is a rejection like any other: metrics must count it."""
    engine, ex = make()
    finished = []

    class Observer:
        def on_step(self, stats): pass
        def on_config_applied(self, config, ok, message): pass
        def on_request_finished(self, request): finished.append((request.request_id, request.finish_detail))

    engine.engine.add_observer(Observer())
    await engine.start()
    await engine.shutdown(0.1)
    late = req("late")
    with pytest.raises(AdmissionError):
        engine.submit(late)
    assert finished == [("late", "draining")] and late.finish_reason is FinishReason.REJECTED


async def test_reload_through_async_front():
    engine, ex = make(max_active_sequences=1)
    await engine.start()
    cfg = engine.engine.config
    engine.reload_config(dataclasses.replace(
        cfg, scheduler=dataclasses.replace(cfg.scheduler, max_active_sequences=4)))
    await asyncio.sleep(0.2)  # applied on an idle tick, no traffic needed
    assert engine.engine.config.scheduler.max_active_sequences == 4
    with pytest.raises(ValueError):
        engine.reload_config(dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, seed=9)))
    await engine.shutdown(1.0)


async def test_queue_timeout_reaches_the_stream():
    lanes = [{"name": "x", "default": True, "queueTimeoutMs": 50}]
    engine, ex = make(sleep_s=0.02, lanes=lanes, max_active_sequences=1)
    await engine.start()
    busy = engine.submit(req("busy", max_tokens=30))
    queued = engine.submit(req("queued", max_tokens=2))
    outs = await asyncio.wait_for(collect(queued), 5)
    assert outs == outs[-1:] and outs[-1].finish_reason is FinishReason.TIMEOUT
    assert outs[-1].finish_detail == "queue_timeout"
    busy.abort()
    await asyncio.wait_for(collect(busy), 5)
    await engine.shutdown(1.0)


async def test_crashed_executor_fails_streams_and_marks_unhealthy():
    engine, ex = make()
    await engine.start()

    def broken(plan):
        raise RuntimeError("CUDA error: device lost")

    ex.execute = broken
    streams = [engine.submit(req(f"r{i}", max_tokens=50)) for i in range(2)]
    results = await asyncio.wait_for(asyncio.gather(*(collect(s) for s in streams)), 10)
    for outs in results:
        assert outs[-1].finished and outs[-1].finish_reason is FinishReason.ERROR
    # Three failing steps in a row: the loop stops and reports unhealthy.
    for _ in range(100):
        if not engine.healthy:
            break
        try:
            s = engine.submit(req(f"x{_}"))
        except AdmissionError:
            break
        await asyncio.wait_for(collect(s), 5)
    assert not engine.healthy and not engine.ready
    with pytest.raises(AdmissionError) as e:
        engine.submit(req("after"))
    assert e.value.status == 503
    await engine.shutdown(0.1)


async def test_a_consumer_cancelled_while_waiting_loses_no_output():
    engine, _ = make()
    stream = engine.submit(req("r0"))
    waiting = asyncio.ensure_future(stream.__anext__())
    await asyncio.sleep(0)  # now awaiting its first output
    waiting.cancel()
    await asyncio.sleep(0)
    assert waiting.cancelled()
    await engine.start()
    outs = await asyncio.wait_for(collect(stream), 10)  # every output, the first included
    assert sum(len(o.new_token_ids) for o in outs) == 4 and outs[-1].finished
    await engine.shutdown(1.0)
