"""The in-process asyncio front of the engine (the server holds it through
runtime/engine/client.py's InProcessClient).

The step loop runs in one dedicated thread, step after step, so the event loop stays
responsive while the model computes; it hands each step's outputs to the event loop
(`call_soon_threadsafe`) and goes straight on to the next step, never waiting for the loop
(a hand-off per step left the step thread idle for a loop wake-up each time:
`python -m tokenlane.bench.step_profile --http`, "loop gap"). The outputs carry token ids:
the event loop detokenizes them and looks for stop strings (the `OutputProcessor` of the
stream table, which both engine fronts share) as it dispatches them, so text work never
delays a step; a stop string ends the request in the engine at its next step boundary. Each
request gets a `RequestStream` (an async iterator over its `RequestOutput`s).
`submit` runs admission synchronously (so the server can answer 429/503 at once); `abort`
takes effect at the next step boundary, where the request's KV blocks are freed.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import threading
import time
from typing import Callable, Optional

from tokenlane.runtime.core.admission import AdmissionError
from tokenlane.runtime.config import RuntimeConfig
from tokenlane.runtime.engine.llm_engine import LLMEngine
from tokenlane.runtime.engine.output import OutputProcessor, RequestOutput
from tokenlane.runtime.core.request import FinishReason, Request, RequestStatus

log = logging.getLogger(__name__)


class RequestStream:
    """Async iterator of one request's outputs; the last one has finished=True."""

    def __init__(self, request: Request, owner: "AsyncEngine") -> None:
        self.request_id = request.request_id
        self.request = request
        self._owner = owner
        # Outputs not yet consumed, and the consumer's future while it waits for one. A deque
        # and a future instead of an asyncio.Queue: 0.5 against 2.4 us of the event loop's time
        # per token (put, then the consumer's wake-up, under uvloop).
        self._outputs: collections.deque[RequestOutput] = collections.deque()
        self._waiter: Optional[asyncio.Future] = None
        # The consumer's event loop, looked up once: asyncio.get_running_loop() makes a
        # getpid() system call on every call (Python 3.11).
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._done = False  # the final output was handed to the consumer
        # Set by a consumer that can take a non-final output at once, in the dispatch, instead
        # of being woken for it (runtime/entrypoints/sse.py, DirectChunks): called only while
        # the consumer waits with nothing queued; False leaves the output to the queue.
        self.direct: Optional[Callable[[RequestOutput], bool]] = None

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        while not self._outputs:
            loop = self._loop
            if loop is None:
                loop = self._loop = asyncio.get_running_loop()
            self._waiter = loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        output = self._outputs.popleft()
        if output.finished:
            self._done = True
        return output

    def abort(self, reason: str = "cancelled") -> None:
        """Cancel the request (see AsyncEngine.abort); its final output still arrives."""
        if not self._done:
            self._owner.abort(self.request_id, reason)

    @property
    def finished(self) -> bool:
        return self._done

    def _put(self, output: RequestOutput) -> None:
        waiter = self._waiter
        waiting = waiter is not None and not waiter.done()
        direct = self.direct
        if direct is not None and waiting and not output.finished and not self._outputs:
            try:
                if direct(output):
                    return
            except Exception:  # this stream's writes alone: it goes back to being woken
                log.exception("writing an output of %s directly failed", self.request_id)
                self.direct = None
        self._outputs.append(output)
        if waiting:
            waiter.set_result(None)


class StreamTable:
    """The open request streams of one engine front, whether it takes new work, and the
    front's output processing (text and stop strings, on the event loop). Both fronts hold
    one (the in-process AsyncEngine and the core-process client, runtime/engine/client.py):
    composition, not a shared base class."""

    def __init__(self, record_rejection: Callable[[Request, AdmissionError], None],
                 processor: OutputProcessor) -> None:
        self.streams: dict[str, RequestStream] = {}
        self.processor = processor
        self._record_rejection = record_rejection  # refusals of the front's own are counted too
        self.started = False
        self.draining = False
        self.stopping = False
        self.healthy = True
        self.error: Optional[BaseException] = None  # why the engine stopped, if it did

    @property
    def ready(self) -> bool:
        return self.started and not self.draining and self.healthy

    def check_open(self, requests: list[Request]) -> None:
        """Refuse new work while draining, after the engine died, or under an id in use."""
        refusal = None
        if self.draining or self.stopping:
            refusal = AdmissionError(503, "draining", "the server is shutting down", retry_after_s=1.0)
        elif not self.healthy:
            refusal = AdmissionError(503, "unavailable", f"the engine has stopped: {self.error}", 1.0)
        else:
            taken = [r.request_id for r in requests if r.request_id in self.streams]
            if taken:
                refusal = AdmissionError(400, "invalid", f"request id {taken[0]!r} is in use")
        if refusal is not None:
            for request in requests:
                self._record_rejection(request, refusal)  # counted like the engine's own
            raise refusal

    def open(self, requests: list[Request], owner) -> list[RequestStream]:
        """A stream per request, registered; `owner.abort` cancels them."""
        streams = [RequestStream(request, owner) for request in requests]
        for stream in streams:
            self.streams[stream.request_id] = stream
        return streams

    def dispatch(self, outputs: list[RequestOutput]) -> None:
        """A step's outputs, in order: their text filled in, then each to its stream."""
        streams = self.streams
        outputs = self.processor.process(outputs, self._request_of)
        for output in outputs:
            stream = streams.get(output.request_id)
            if stream is None:
                continue
            stream._put(output)
            if output.finished:
                del streams[output.request_id]

    def _request_of(self, request_id: str) -> Optional[Request]:
        stream = self.streams.get(request_id)
        return stream.request if stream is not None else None

    def fail_all(self, message: str) -> None:
        """End every open stream with an error output (the engine stopped or died)."""
        for request_id, stream in list(self.streams.items()):
            request = stream.request
            stream._put(
                RequestOutput(
                    request_id=request_id,
                    lane=request.lane,
                    new_token_ids=[],
                    new_text="",
                    finished=True,
                    finish_reason=FinishReason.ERROR,
                    finish_detail=message,
                    num_prompt_tokens=request.num_prompt_tokens,
                    num_output_tokens=request.num_output_tokens,
                    num_cached_tokens=request.num_cached_tokens,
                )
            )
        self.streams.clear()
        self.processor.clear()


class AsyncEngine:
    """The in-process front: an LLMEngine stepped by one thread of this process. The server
    reaches it through runtime/engine/client.py's InProcessClient."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._table = StreamTable(engine.record_rejection, OutputProcessor(engine.tokenizer, self._end_request))
        self._wakeup = threading.Event()  # set on new work for the step thread
        self._halt = False  # the step thread stops after its current step (shutdown timed out)
        self._task: Optional[asyncio.Task] = None
        self._worker: Optional[concurrent.futures.ThreadPoolExecutor] = None
        # While idle the loop still ticks this often, so queue timeouts fire without traffic.
        self.idle_tick_s = 0.05

    @classmethod
    def from_config(cls, config: RuntimeConfig) -> "AsyncEngine":
        return cls(LLMEngine.from_config(config))

    @property
    def vocab_size(self) -> Optional[int]:
        return self.engine.vocab_size

    @property
    def started(self) -> bool:
        return self._table.started

    @property
    def draining(self) -> bool:
        return self._table.draining

    @property
    def healthy(self) -> bool:
        return self._table.healthy

    @property
    def error(self) -> Optional[BaseException]:
        """Why the step loop died, if it did."""
        return self._table.error

    @property
    def ready(self) -> bool:
        return self._table.ready

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        if self._task is not None:
            return
        self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tokenlane-step")
        self._task = asyncio.create_task(self._run(), name="tokenlane-engine-loop")
        self._table.started = True

    async def shutdown(self, grace_s: float) -> None:
        """Drain: refuse new work (503 "draining"), let in-flight requests finish for up to
        `grace_s`, abort the rest, then stop the loop."""
        self._table.draining = True
        if self._task is None:
            return
        deadline = time.monotonic() + max(0.0, grace_s)
        while self.engine.has_unfinished_requests() and self.healthy and not self._task.done():
            left = deadline - time.monotonic()
            if left <= 0:
                break
            await asyncio.sleep(min(0.02, left))
        for request_id in list(self._table.streams):
            self.engine.abort_request(request_id, RequestStatus.FINISHED_CANCELLED, "shutdown")
        self._table.stopping = True
        self._wake()
        try:
            await asyncio.wait_for(asyncio.shield(self._task), timeout=max(5.0, grace_s))
        except asyncio.TimeoutError:
            self._task.cancel()
        self._table.fail_all("engine stopped")  # anything the loop could not finish
        if self._worker is not None:
            self._worker.shutdown(wait=False)

    # ------------------------------------------------------------------ requests

    def submit(self, request: Request) -> RequestStream:
        """Admit the request (raises AdmissionError at once) and return its output stream."""
        self._table.check_open([request])
        self.engine.add_request(request)  # raises AdmissionError
        (stream,) = self._table.open([request], self)
        self._wake()
        return stream

    def submit_group(self, requests: list[Request]) -> list[RequestStream]:
        """Admit the sequences of one prompt sampled in parallel (a SequenceGroup, leader
        first), all or none (raises AdmissionError at once); one stream per sequence."""
        self._table.check_open(requests)
        self.engine.add_group(requests)  # raises AdmissionError
        streams = self._table.open(requests, self)
        self._wake()
        return streams

    def abort(self, request_id: str, reason: str = "cancelled") -> None:
        """Cancel a request of ours: one abort staged for the next step boundary, where its KV
        blocks are freed; `reason` becomes its finish detail (the metrics' reason label)."""
        if request_id in self._table.streams:
            self.engine.abort_request(request_id, RequestStatus.FINISHED_CANCELLED, reason)
            self._wake()

    def _end_request(self, request_id: str, status: RequestStatus, detail: str) -> None:
        """The output processor ended a request (a stop string, a detokenizer error): end it
        in the engine too, freeing its KV blocks at the next step boundary."""
        self.engine.abort_request(request_id, status, detail)
        self._wake()

    def reload_config(self, new: RuntimeConfig) -> None:
        self.engine.reload_config(new)
        self._wake()

    # ------------------------------------------------------------------ the loop

    def wake(self) -> None:
        """Have the step thread look for work now (new requests, a staged change)."""
        self._wakeup.set()

    _wake = wake

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(self._worker, self._step_loop, loop)
        except asyncio.CancelledError:
            self._halt = True  # shutdown gave up waiting: no step after the current one
            raise
        except Exception as exc:  # the executor is broken: fail loudly, stay down
            log.exception("engine loop crashed")
            self._table.healthy = False
            self._table.error = exc
            self._table.fail_all(f"engine error: {exc}")

    def _step_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        """The step thread: steps while there is work, each step's outputs handed to the event
        loop in order; sleeps on `_wakeup` (or the idle tick, for queue timeouts) otherwise."""
        engine, wakeup = self.engine, self._wakeup
        engine.pin_step_thread()
        while not self._halt:
            if self._table.stopping and not engine.has_unfinished_requests():
                return
            if not engine.has_pending_work():
                wakeup.clear()
                if not engine.has_pending_work():  # re-check: a submit may have raced
                    wakeup.wait(self.idle_tick_s)
                continue
            outputs = engine.step()
            if outputs:
                try:
                    loop.call_soon_threadsafe(self._dispatch, outputs)
                except RuntimeError:  # the event loop is closed: nobody is left to serve
                    return
            if engine.last_step_tokens == 0 and engine.has_unfinished_requests():
                # Work exists but none could run (e.g. waiting on memory): don't spin.
                wakeup.clear()
                wakeup.wait(self.idle_tick_s / 10)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        """On the event loop: text and stop strings, then each output to its stream."""
        self._table.dispatch(outputs)
