"""The engine core in a process of its own (`engine.coreProcess: true`).

The API process keeps what talks to clients: HTTP, tokenization, the request streams and
their SSE framing, metrics and the flight recorder. A child process (the engine core) runs
the `LLMEngine` and its step loop. On one GIL, the step thread's Python (scheduling,
preparing inputs, sampling, detokenizing) waits behind the event loop's burst of stream
writes after every step; in a process of its own it does not. vLLM v1 splits the same way.

    API process                                      engine core (spawned child)
    ProcessEngine (AsyncEngine's interface)          run_engine_core
      submit_async ── ("admit", [(call, ...)]) ─>      command thread: engine.add_request,
                   <── ("replies", [(call, result)]) ─   the admitted lane or the refusal
      abort        ── ("abort", id, reason) ────>      engine.abort_request
      reload_config ─ ("reload", config) ───────>      engine.reload_config
      shutdown     ── ("stop",) ────────────────>      step loop ends once nothing runs
      reader thread <─ ("step", outputs, events, snapshot) ── step loop: engine.step()
                    <─ ("dead", message) ─────────     the step loop raised
                    <─ ("stopped",) ─────────────      clean end after "stop"

Two one-way pipes carry pickled tuples. Observers (metrics, flight recorder, request log)
run in the API process: the core relays their events (step stats, finished requests,
applied or refused configs) with each step's outputs, and a fresh occupancy snapshot (the
/metrics gauges). Admission runs in the core, against the scheduler's state, as before; the
API process awaits its answer (one round trip) before it answers the client.

The core ignores SIGINT and SIGTERM (a terminal's Ctrl-C reaches the whole process group): the
API process drains it and tells it to stop. It exits on its own when the API process's end
of the command pipe closes, so a killed server leaves no engine behind.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import gc
import io
import itertools
import logging
import multiprocessing
import os
import pickle
import queue
import signal
import sys
import threading
import time
from typing import Any, Callable, Optional

from tokenlane.runtime.core.admission import AdmissionError
from tokenlane.runtime.engine.async_engine import AsyncEngine, RequestStream
from tokenlane.runtime.config import RuntimeConfig
from tokenlane.runtime.engine.llm_engine import LLMEngine, RequestOutput, RestartRequired, restart_field_changes
from tokenlane.runtime.core.request import Request, RequestStatus
from tokenlane.runtime.core.stats import EngineObserver, StepStats

log = logging.getLogger(__name__)

# How long the core's idle loop sleeps between checks (queue timeouts fire on these ticks).
IDLE_TICK_S = 0.05
# The core's GIL switch interval (Python's default is 5 ms; see run_engine_core).
CORE_SWITCH_INTERVAL_S = 0.0005
# How long shutdown waits for the core to exit after "stop" before it kills it.
STOP_TIMEOUT_S = 10.0


# --------------------------------------------------------------------------- requests on the wire


class _RequestPickler(pickle.Pickler):
    """Pickles requests for the core. A compiled grammar (structured output: xgrammar's,
    not picklable) travels as its serialized form and is loaded in the core against the
    core's own copy of the tokenizer."""

    def reducer_override(self, obj):
        xgrammar = sys.modules.get("xgrammar")
        if xgrammar is not None and isinstance(obj, xgrammar.CompiledGrammar):
            return (_grammar_in_core, (obj.serialize_json(),))
        return NotImplemented


def dumps_for_core(obj) -> bytes:
    buffer = io.BytesIO()
    _RequestPickler(buffer, pickle.HIGHEST_PROTOCOL).dump(obj)
    return buffer.getvalue()


_core_engine: Optional[LLMEngine] = None  # the core process's engine (run_engine_core)


def _grammar_in_core(serialized: str):
    from tokenlane.runtime.executor.structured_output import GrammarCompiler

    engine = _core_engine
    if engine is None or engine.tokenizer is None:
        raise ValueError("a structured-output request reached an engine without a tokenizer")
    return GrammarCompiler.of(engine.tokenizer, engine.vocab_size).load(serialized)


def finished_copy(request: Request) -> Request:
    """What the observers in the API process get of a finished request: its lane, tenant,
    counts, times and finish, without the parts that are large or not picklable (grammar,
    logprobs, block table, sequence group)."""
    light = copy.copy(request)
    light.group = None
    light.block_ids = []
    light.output_logprobs = []
    light.prompt_logprobs = []
    if request.sampling_params.grammar is not None:
        light.sampling_params = dataclasses.replace(request.sampling_params, grammar=None)
    return light


# --------------------------------------------------------------------------- the core (child)


class EngineCore:
    """The child's side: the step loop (main thread) and the command thread around one
    LLMEngine. It is also the engine's only observer, buffering the events it relays."""

    def __init__(self, engine: LLMEngine, events) -> None:
        self.engine = engine
        self._events_conn = events
        # Messages pickled by the thread that sends them, written to the pipe by the writer
        # thread: a write wakes the API process's reader, and the step thread does not wait
        # for that wake-up (0.2-0.7 ms a step, measured, when it wrote itself).
        self._outbox: "queue.SimpleQueue[Optional[bytes]]" = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write_out, name="tokenlane-core-writer", daemon=True)
        self._writer.start()
        self._events_lock = threading.Lock()
        self._events: list[tuple] = []  # observer events not yet sent
        self._wakeup = threading.Event()
        self._stopping = False  # "stop": end once no request is left
        self._halt = False  # the API process is gone: end now
        self._last_snapshot: Optional[StepStats] = None
        engine.add_observer(self)

    # -- the engine's observer: buffer, sent with the next message

    def on_step(self, stats: StepStats) -> None:
        with self._events_lock:
            self._events.append(("step", stats))

    def on_request_finished(self, request: Request) -> None:
        with self._events_lock:
            self._events.append(("finished", finished_copy(request)))

    def on_config_applied(self, config: object, ok: bool, message: str) -> None:
        with self._events_lock:
            self._events.append(("config", config, ok, message, self.engine.max_model_len))

    # -- sending

    def _send(self, message: tuple) -> None:
        self._outbox.put(pickle.dumps(message, pickle.HIGHEST_PROTOCOL))

    def _write_out(self) -> None:
        conn, outbox = self._events_conn, self._outbox
        while (data := outbox.get()) is not None:
            try:
                conn.send_bytes(data)  # what Connection.recv() on the other end unpickles
            except OSError:  # the API process is gone
                self._halt = True
                self._wakeup.set()
                return

    def close(self) -> None:
        """Write what is queued, then let the writer go."""
        self._outbox.put(None)
        self._writer.join(5.0)

    def _send_step(self, outputs: list[RequestOutput], snapshot: bool = True) -> None:
        """The step's outputs with the observer events so far and, from the step thread, a
        fresh occupancy snapshot (the command thread sends none: it would read the
        scheduler while a step changes it)."""
        with self._events_lock:
            events, self._events = self._events, []
        fresh = None
        if snapshot:
            fresh = self._last_snapshot = self.engine.snapshot()
        self._send(("step", outputs, events, fresh))

    # -- the command thread

    def serve_commands(self, commands) -> None:
        while True:
            try:
                message = commands.recv()
            except (EOFError, OSError):  # the API process is gone
                self._halt = True
                self._wakeup.set()
                return
            try:
                self._command(message)
            except Exception:  # a bad command must not end the core's only way in
                log.exception("engine core: command %r failed", message[0])
            self._wakeup.set()
            if self._events and not self._stopping:
                self._send_step([], snapshot=False)  # e.g. a refusal's metrics, without waiting for a step

    def _command(self, message: tuple) -> None:
        engine, kind = self.engine, message[0]
        if kind == "admit":
            self._send(("replies", [(call, self._admit(group, payload)) for call, group, payload in message[1]]))
        elif kind == "abort":
            _, request_id, reason = message
            engine.abort_request(request_id, RequestStatus.FINISHED_CANCELLED, reason)
        elif kind == "reload":
            try:
                engine.reload_config(message[1])
            except ValueError as exc:  # observers were told (on_config_applied, ok=False)
                log.warning("config reload refused: %s", exc)
        elif kind == "stop":
            self._stopping = True
        else:
            log.error("engine core: unknown command %r", kind)

    def _admit(self, group: bool, payload: bytes) -> tuple:
        """("ok", the admitted lanes) or ("refused", AdmissionError's fields). `payload` is
        the request (or the group's list of requests) as `dumps_for_core` pickled it."""
        try:
            payload = pickle.loads(payload)
            if group:
                self.engine.add_group(payload)
                return ("ok", [request.lane for request in payload])
            self.engine.add_request(payload)
            return ("ok", [payload.lane])
        except AdmissionError as exc:
            return ("refused", (exc.status, exc.reason, exc.message, exc.retry_after_s))
        except Exception as exc:  # a bug in admission: refuse this one, keep serving
            log.exception("admission failed")
            return ("refused", (500, "internal_error", f"admission failed: {type(exc).__name__}", None))

    # -- the step loop

    def run(self, idle_tick_s: float = IDLE_TICK_S) -> None:
        """Step while there is work, each step's outputs sent at once; sleep on the wake-up
        event otherwise. Returns after "stop" once no request is left, or when the API
        process is gone."""
        engine, wakeup = self.engine, self._wakeup
        engine.pin_step_thread()
        while not self._halt:
            if self._stopping and not engine.has_unfinished_requests():
                self._send_step([])
                self._send(("stopped",))
                return
            if not engine.has_pending_work():
                wakeup.clear()
                if not engine.has_pending_work():
                    wakeup.wait(idle_tick_s)
                if self._events or engine.snapshot() != self._last_snapshot:
                    self._send_step([])  # the gauges follow admissions while idle
                continue
            outputs = engine.step()
            self._send_step(outputs)
            if engine.last_step_tokens == 0 and engine.has_unfinished_requests():
                wakeup.clear()  # work exists but none could run (e.g. waiting on memory)
                wakeup.wait(idle_tick_s / 10)


def run_engine_core(config: RuntimeConfig, commands, events, log_level: int = logging.INFO,
                    on_start: Optional[Callable[["EngineCore"], Optional[Callable[[], None]]]] = None) -> None:
    """The engine core process's main: load the engine, say "ready" (or "failed" with why),
    then run the step loop until told to stop. `on_start` (picklable: a top-level function
    or a partial of one) may instrument the core and its engine before it serves, and return
    a callable run when the loop ends (the step profiler writes its records there)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s [core]: %(message)s")
    try:
        engine = LLMEngine.from_config(config)
    except Exception as exc:
        events.send(("failed", f"{type(exc).__name__}: {exc}"))
        _end_core(1)
    global _core_engine
    _core_engine = engine
    core = EngineCore(engine, events)
    # The command thread answers admissions while the step thread runs; at the default 5 ms
    # switch interval each answer could wait that long for the GIL behind the step's Python.
    sys.setswitchinterval(CORE_SWITCH_INTERVAL_S)
    at_end = on_start(core) if on_start is not None else None
    gc.collect()
    gc.freeze()  # as the API process does: full collections must not stall the step loop
    core._send(("ready", {
        "vocab_size": engine.vocab_size,
        "supports_logprobs": engine.supports_logprobs,
        "max_model_len": engine.max_model_len,
        "snapshot": engine.snapshot(),
    }))
    threading.Thread(target=core.serve_commands, args=(commands,), name="tokenlane-core-commands",
                     daemon=True).start()
    code = 0
    try:
        core.run()
    except BaseException as exc:
        code = 1
        log.exception("engine core step loop crashed")
        core._send(("dead", f"{type(exc).__name__}: {exc}"))
    core.close()
    if at_end is not None:
        at_end()
    _end_core(code)


def _end_core(code: int) -> None:
    """Exit now, as `tokenlane serve` does: the interpreter's teardown of torch and triton
    costs seconds of CPU (and nanobind prints a leak report)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


# --------------------------------------------------------------------------- the API process side


def open_engine(config: RuntimeConfig, on_core_start: Optional[Callable] = None,
                own_process: Optional[bool] = None) -> AsyncEngine:
    """The asyncio front `tokenlane serve` serves: a ProcessEngine when the engine core gets a
    process of its own (its core spawned and loaded; `on_core_start` is the core's `on_start`
    hook), else the in-process AsyncEngine. `own_process` None decides as `engine.coreProcess`
    says (unset: by the host, `cpu_placement.plan_core_process`). ValueError or OSError if the
    model cannot be loaded."""
    if own_process is None:
        from tokenlane.runtime.executor.cpu_placement import core_process_for
        from tokenlane.runtime.executor.model_executor import select_device

        device_type = "cpu" if config.engine.executor != "model" else select_device(config.engine.device).type
        own_process, why = core_process_for(config.engine, device_type)
        log.info("step loop: %s", why)
    if own_process:
        return ProcessEngine.from_config(config, on_start=on_core_start)
    return AsyncEngine.from_config(config)


class CoreView:
    """What the API process reads of the engine (AsyncEngine.engine's place): the config in
    force, the tokenizer, the model's limits, the latest occupancy snapshot, and the
    observers, which get the events the core relays."""

    def __init__(self, config: RuntimeConfig, info: dict, tokenizer: Any) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.vocab_size: Optional[int] = info["vocab_size"]
        self.supports_logprobs: bool = info["supports_logprobs"]
        self.max_model_len: int = info["max_model_len"]
        self.clock = time.monotonic  # system-wide: the core's clock too
        self.observers: list[EngineObserver] = []
        self._snapshot: StepStats = info["snapshot"]

    def add_observer(self, observer: EngineObserver) -> None:
        self.observers.append(observer)

    def snapshot(self) -> StepStats:
        """The core's occupancy as of its last message (each step, or each idle tick that
        changed it)."""
        return self._snapshot

    def record_rejection(self, request: Request, error: AdmissionError) -> None:
        """A refusal of the API process's own (draining, core down): counted like the core's."""
        request.finish(RequestStatus.FINISHED_REJECTED, error.reason, now=self.clock())
        self._notify("on_request_finished", request)

    def relay(self, event: tuple) -> None:
        kind = event[0]
        if kind == "step":
            self._notify("on_step", event[1])
        elif kind == "finished":
            self._notify("on_request_finished", event[1])
        elif kind == "config":
            _, config, ok, message, max_model_len = event
            if ok:
                self.config, self.max_model_len = config, max_model_len
            self._notify("on_config_applied", config, ok, message)

    def _notify(self, method: str, *args) -> None:
        for observer in self.observers:
            try:
                getattr(observer, method)(*args)
            except Exception:
                log.exception("observer %r failed", observer)


class ProcessEngine(AsyncEngine):
    """AsyncEngine's interface over an engine core process. Admission is a round trip, so
    requests come in through `submit_async` / `submit_group_async`."""

    def __init__(self, view: CoreView, process, commands, events) -> None:
        super().__init__(view)  # self.engine: the view
        self._process = process
        self._commands = commands  # the API process's write end
        self._events = events  # the API process's read end
        self._calls: dict[int, asyncio.Future] = {}  # admissions awaiting the core's answer
        self._admissions: list[tuple] = []  # admissions not yet sent (see _queue_admission)
        self._call_ids = itertools.count()
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._reader: Optional[threading.Thread] = None
        self._stopped: Optional[asyncio.Event] = None
        self._send_lock = threading.Lock()

    @classmethod
    def from_config(cls, config: RuntimeConfig, on_start: Optional[Callable] = None,
                    log_level: Optional[int] = None) -> "ProcessEngine":
        """Spawn the core and wait until its engine is loaded; ValueError with the core's own
        message if it could not load."""
        context = multiprocessing.get_context("spawn")  # a fork would copy torch's threads' state
        core_commands, commands = context.Pipe(duplex=False)
        events, core_events = context.Pipe(duplex=False)
        level = log_level if log_level is not None else logging.getLogger().getEffectiveLevel()
        process = context.Process(target=run_engine_core, name="tokenlane-engine-core", daemon=True,
                                  args=(config, core_commands, core_events, level, on_start))
        process.start()
        core_commands.close()  # the child holds these ends now: EOF follows its exit
        core_events.close()
        try:
            first = events.recv()
        except (EOFError, OSError):
            process.join(5)
            raise ValueError(f"the engine core exited while loading (exit code {process.exitcode})") from None
        if first[0] != "ready":
            process.join(5)
            raise ValueError(first[1])
        tokenizer = None
        if config.engine.executor != "simulated":
            from tokenlane.runtime.engine.tokenizer import load_tokenizer

            tokenizer = load_tokenizer(config.model.tokenizer or config.model.path)
        return cls(CoreView(config, first[1], tokenizer), process, commands, events)

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        if self.started:
            return
        self._loop = asyncio.get_running_loop()
        self._stopped = asyncio.Event()
        self._reader = threading.Thread(target=self._read_events, name="tokenlane-core-reader", daemon=True)
        self._reader.start()
        self.started = True

    async def shutdown(self, grace_s: float) -> None:
        """Drain as AsyncEngine does, then stop the core and wait for its exit."""
        self.draining = True
        if not self.started:
            self._end_process()
            return
        deadline = time.monotonic() + max(0.0, grace_s)
        while self._streams and self.healthy:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            await asyncio.sleep(min(0.02, left))
        for request_id in list(self._streams):
            self._send_abort(request_id, "shutdown")
        self._stopping = True
        self._send_quietly(("stop",))
        if self.healthy:
            try:
                await asyncio.wait_for(self._stopped.wait(), timeout=max(STOP_TIMEOUT_S, grace_s))
            except asyncio.TimeoutError:
                log.error("the engine core did not stop in time; killing it")
        self._fail_streams("engine stopped")
        await asyncio.to_thread(self._end_process)

    def _end_process(self) -> None:
        self._process.join(STOP_TIMEOUT_S if self._stopped is not None and self._stopped.is_set() else 0.5)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(5)
        self._commands.close()

    # ------------------------------------------------------------------ requests

    def submit(self, request: Request) -> RequestStream:
        raise TypeError("the engine core runs in its own process: use `await submit_async(request)`")

    def submit_group(self, requests: list[Request]) -> list[RequestStream]:
        raise TypeError("the engine core runs in its own process: use `await submit_group_async(requests)`")

    async def submit_async(self, request: Request) -> RequestStream:
        return (await self._admit(False, request, [request]))[0]

    async def submit_group_async(self, requests: list[Request]) -> list[RequestStream]:
        return await self._admit(True, requests, requests)

    async def _admit(self, group: bool, payload, requests: list[Request]) -> list[RequestStream]:
        self._check_open(requests)
        streams = [RequestStream(request, self) for request in requests]
        for stream in streams:  # before the core can answer: its outputs find their stream
            self._streams[stream.request_id] = stream
        call = next(self._call_ids)
        future = self._loop.create_future()
        self._calls[call] = future
        try:
            self._queue_admission((call, group, dumps_for_core(payload)))
            status, detail = await future
        except BaseException:
            for request in requests:  # e.g. the client left: the core may have admitted it
                if self._streams.pop(request.request_id, None) is not None:
                    self._send_abort(request.request_id, "client_disconnect")
            raise
        finally:
            self._calls.pop(call, None)
        if status != "ok":
            for request in requests:
                self._streams.pop(request.request_id, None)
                request.finish(RequestStatus.FINISHED_REJECTED, detail[1], now=time.monotonic())
            raise AdmissionError(*detail)
        for request, lane in zip(requests, detail):
            request.lane = lane  # the core resolved "default" to the default lane
        return streams

    def abort(self, request_id: str, reason: str = "cancelled") -> None:
        if request_id in self._streams:
            self._send_abort(request_id, reason)

    def _send_abort(self, request_id: str, reason: str) -> None:
        self._send_admissions()  # an abort must reach the core after the request it cancels
        self._send_quietly(("abort", request_id, reason))

    def reload_config(self, new: RuntimeConfig) -> None:
        """Checked here as the engine would (RestartRequired at once), staged in the core."""
        if not isinstance(new, RuntimeConfig):
            raise ValueError(f"expected a RuntimeConfig, got {type(new).__name__}")
        changed = restart_field_changes(self.engine.config, new)
        if changed:
            error = RestartRequired(changed)
            self.engine.relay(("config", new, False, str(error), self.engine.max_model_len))
            raise error
        try:
            self._send(("reload", new))
        except AdmissionError as exc:  # the core is gone
            raise ValueError(exc.message) from None

    # ------------------------------------------------------------------ the pipes

    def _send(self, message: tuple) -> None:
        """To the core; a core that is gone makes it a 503."""
        try:
            with self._send_lock:
                self._commands.send(message)
        except (OSError, ValueError) as exc:
            self._core_gone(f"the engine core is gone ({type(exc).__name__})")
            raise AdmissionError(503, "unavailable", f"the engine has stopped: {self.error}", 1.0) from None

    def _queue_admission(self, entry: tuple) -> None:
        """Admissions asked for in one turn of the event loop go to the core in one message
        (a burst of arrivals costs one pipe write and one wake-up of the core's command thread,
        not one each)."""
        self._admissions.append(entry)
        if len(self._admissions) == 1:
            self._loop.call_soon(self._send_admissions)

    def _send_admissions(self) -> None:
        batch, self._admissions = self._admissions, []
        if not batch:
            return
        try:
            self._send(("admit", batch))
        except AdmissionError as exc:
            for call, _, _ in batch:
                self._resolve([(call, ("refused", (exc.status, exc.reason, exc.message, exc.retry_after_s)))])

    def _send_quietly(self, message: tuple) -> None:
        try:
            self._send(message)
        except AdmissionError:
            pass  # the core is gone: its requests are failed already

    def _read_events(self) -> None:
        """The reader thread: observers run here (as they ran on the step thread before);
        outputs and replies go to the event loop."""
        view = self.engine
        while True:
            try:
                message = self._events.recv()
            except (EOFError, OSError):
                break
            kind = message[0]
            if kind == "step":
                _, outputs, events, snapshot = message
                for event in events:
                    view.relay(event)
                if snapshot is not None:
                    view._snapshot = snapshot
                if outputs:
                    self._call_soon(self._dispatch_outputs, outputs)
            elif kind == "replies":
                self._call_soon(self._resolve, message[1])
            elif kind == "dead":
                self._call_soon(self._core_gone, f"engine error: {message[1]}")
                return
            elif kind == "stopped":
                self._call_soon(self._stopped.set)
                return
        exit_code = self._process.exitcode
        self._call_soon(self._core_gone, f"the engine core exited (exit code {exit_code})")

    def _call_soon(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop is closed: nobody is left to serve
            pass

    def _dispatch_outputs(self, outputs: list[RequestOutput]) -> None:
        streams = self._streams
        for output in outputs:
            stream = streams.get(output.request_id)
            if stream is not None and stream.request.first_scheduled_time is None:
                stream.request.first_scheduled_time = output.scheduled_at
        self._dispatch(outputs)

    def _resolve(self, replies: list) -> None:
        for call, result in replies:
            future = self._calls.get(call)
            if future is not None and not future.done():
                future.set_result(result)

    def _core_gone(self, message: str) -> None:
        """The core died (or its pipe broke): unhealthy for good; every stream and pending
        admission ends with the error."""
        if self._stopped is not None and self._stopped.is_set():
            return
        if self.healthy:
            log.error("engine core: %s", message)
            self.healthy = False
            self.error = RuntimeError(message)
        for future in self._calls.values():
            if not future.done():
                future.set_result(("refused", (503, "unavailable", f"the engine has stopped: {message}", 1.0)))
        self._fail_streams(message)
        if self._stopped is not None:
            self._stopped.set()
