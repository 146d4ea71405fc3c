"""AsyncEngine's step thread runs step after step without waiting for the event loop: a
request finishes while the loop is blocked, and its outputs reach the stream in order once
the loop runs again."""

from __future__ import annotations

import asyncio
import threading

from tokenlane.runtime.engine.async_engine import AsyncEngine
from tokenlane.runtime.engine.llm_engine import LLMEngine
from tokenlane.runtime.core.request import Request, SamplingParams
from tokenlane.runtime.executor.fake import FakeExecutor, make_config


class FinishWatcher:
    """An engine observer that sets `done` when the watched request reaches a final status."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.done = threading.Event()
        self.steps = 0

    def on_step(self, stats) -> None:
        self.steps += 1

    def on_request_finished(self, request) -> None:
        if request.request_id == self.request_id:
            self.done.set()

    def on_config_applied(self, config, ok, message) -> None:
        pass


async def test_steps_go_on_while_the_event_loop_is_blocked():
    config = make_config(max_model_len=512)
    engine = AsyncEngine(LLMEngine(config, FakeExecutor(64, config.engine.block_size, max_model_len=None)))
    watcher = FinishWatcher("r0")
    engine.engine.add_observer(watcher)
    await engine.start()
    await asyncio.sleep(0)  # the loop task starts the step thread
    stream = engine.submit(Request("r0", [1, 2, 3], SamplingParams(max_tokens=8)))
    # Block the event loop itself: a step loop that needed the loop between steps would be
    # stuck after at most one step, and the wait would run out (it is only a guard).
    finished = watcher.done.wait(timeout=60)
    assert finished, f"the request did not finish while the loop was blocked ({watcher.steps} steps)"
    assert watcher.steps >= 8  # a prefill step, then a decode step per token
    outputs = [out async for out in stream]
    assert [t for out in outputs for t in out.new_token_ids] == stream.request.output_token_ids
    assert len(stream.request.output_token_ids) == 8 and outputs[-1].finished
    assert not any(out.finished for out in outputs[:-1])
    await engine.shutdown(1.0)
    assert engine.healthy


async def test_an_executor_error_ends_the_stream_after_the_tokens_before_it():
    config = make_config(max_model_len=512)

    class BreaksAfterThreeSteps(FakeExecutor):
        calls = 0

        def execute(self, plan):
            self.calls += 1
            if self.calls > 3:
                raise RuntimeError("device lost")
            return super().execute(plan)

    executor = BreaksAfterThreeSteps(64, config.engine.block_size, max_model_len=None)
    engine = AsyncEngine(LLMEngine(config, executor))
    await engine.start()
    stream = engine.submit(Request("r0", [1, 2, 3], SamplingParams(max_tokens=50)))
    outputs = await asyncio.wait_for(_collect(stream), 60)
    tokens = [t for out in outputs for t in out.new_token_ids]
    assert len(tokens) == 3 and tokens == stream.request.output_token_ids  # one per good step, in order
    assert outputs[-1].finished and outputs[-1].finish_detail == "executor error: device lost"
    await engine.shutdown(0.5)


async def _collect(stream):
    return [out async for out in stream]
