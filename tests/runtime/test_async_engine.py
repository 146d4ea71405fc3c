"""AsyncEngine: background loop, per-request streams, abort, draining, crash handling."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time

import pytest

from tokenlane.runtime.core.admission import AdmissionError
from tokenlane.runtime.engine.async_engine import AsyncEngine
from tokenlane.runtime.engine.llm_engine import LLMEngine
from tokenlane.runtime.core.request import FinishReason, Request, SamplingParams
from tokenlane.runtime.executor.fake import FakeExecutor, StepGate, make_config


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
    with StepGate(ex) as gate:
        # Hold the step that would give "a" its fourth token: abort() lands while it waits.
        gate.pause_when(lambda plan: any(c.request.request_id == "a" and c.request.num_output_tokens >= 3
                                         for c in plan.chunks))
        stream = engine.submit(req("a", max_tokens=400))
        other = engine.submit(req("b", n=5, max_tokens=30))
        await asyncio.to_thread(gate.wait_paused)
        steps_before = len(ex.plans)  # the held step is not recorded yet
        staged = []
        real_abort_request = engine.engine.abort_request
        engine.engine.abort_request = lambda *args: (staged.append(args), real_abort_request(*args))
        stream.abort("client_disconnect")
        assert len(staged) == 1  # one abort, carrying its reason
        gate.resume()
        outs = await asyncio.wait_for(collect(stream), 5)
    assert outs[-1].finished and outs[-1].finish_reason is FinishReason.CANCELLED
    assert outs[-1].finish_detail == "client_disconnect"  # the metrics' reason label
    # Only the step already scheduled when abort() was called still ran "a".
    assert sum(any(c.request.request_id == "a" for c in p.chunks) for p in ex.plans[steps_before:]) == 1
    assert sum(len(o.new_token_ids) for o in outs) <= 4
    others = await asyncio.wait_for(collect(other), 5)  # the other tenant is untouched
    assert others[-1].finish_reason is FinishReason.LENGTH
    assert sum(len(o.new_token_ids) for o in others) == 30
    assert engine.engine.scheduler.kv.num_free_blocks == 256
    await engine.shutdown(1.0)


class LoopReleased(FakeExecutor):
    """Each step waits in the step thread until a coroutine on the event loop releases it."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.entered = threading.Event()
        self.release = threading.Event()
        self.released_by_the_loop: list[bool] = []

    def execute(self, plan):
        self.entered.set()
        self.released_by_the_loop.append(self.release.wait(30))
        return super().execute(plan)


async def test_event_loop_stays_responsive_during_steps():
    # If a step blocked the event loop, no coroutine could release it: it would wait out its
    # 30 s and record False. Nothing here depends on how fast the machine is.
    config = make_config(max_model_len=512)
    ex = LoopReleased(64, config.engine.block_size, max_model_len=None)
    engine = AsyncEngine(LLMEngine(config, ex))
    await engine.start()
    stream = engine.submit(req("a", max_tokens=2))
    assert await asyncio.to_thread(ex.entered.wait, 30)
    for _ in range(5):  # the loop keeps turning while the step is in flight
        await asyncio.sleep(0)
    ex.release.set()
    outs = await asyncio.wait_for(collect(stream), 30)
    assert outs[-1].finish_reason is FinishReason.LENGTH
    assert ex.released_by_the_loop and all(ex.released_by_the_loop)
    await engine.shutdown(1.0)


async def test_shutdown_drains_then_aborts():
    engine, ex = make(sleep_s=0.001, num_blocks=256)
    await engine.start()
    shutdown_aborts = asyncio.Event()
    real_abort_request = engine.engine.abort_request

    def abort_request(request_id, status, detail):
        real_abort_request(request_id, status, detail)
        if detail == "shutdown":
            shutdown_aborts.set()

    engine.engine.abort_request = abort_request
    with StepGate(ex) as gate:
        gate.pause()  # both requests admitted, not started, when the drain begins
        short = engine.submit(req("short", max_tokens=2))
        long = engine.submit(req("long", max_tokens=300))
        await asyncio.to_thread(gate.wait_paused)
        drain = asyncio.create_task(engine.shutdown(2.0))
        await asyncio.sleep(0)
        assert engine.draining and not engine.ready
        with pytest.raises(AdmissionError) as e:
            engine.submit(req("late"))
        assert (e.value.status, e.value.reason) == (503, "draining")
        # "short" finishes within the grace period (2 steps); "long" is held past it.
        gate.pause_when(lambda plan: any(c.request.request_id == "long" and c.request.num_output_tokens >= 5
                                         for c in plan.chunks))
        gate.resume()
        short_outs = await asyncio.wait_for(collect(short), 30)
        await asyncio.wait_for(shutdown_aborts.wait(), 30)  # the grace period is over
        gate.resume()
        long_outs = await asyncio.wait_for(collect(long), 30)
        await asyncio.wait_for(drain, 30)
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
    for _ in range(3000):  # applied on an idle tick, no traffic needed (30 s bound)
        if engine.engine.config.scheduler.max_active_sequences == 4:
            break
        await asyncio.sleep(0.01)
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
