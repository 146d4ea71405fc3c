"""The engine core in a process of its own (`engine.coreProcess: true`): the child's side.

The API process keeps what talks to clients: HTTP, tokenization, the request streams and
their SSE framing, metrics and the flight recorder. A child process (the engine core) runs
the `LLMEngine` and its step loop, and returns token ids: detokenization and stop strings
are the API process's. On one GIL, the step thread's Python (scheduling, preparing inputs,
sampling) waits behind the event loop's burst of stream writes after every step; in a
process of its own it does not. vLLM v1 splits the same way.

The API process's side is runtime/engine/core_client.py's CoreProcessClient, which spawns
`run_engine_core`; the two speak runtime/engine/messages.py's typed messages over two
one-way pipes (the message flow is drawn in client.py). The core is also its engine's only
observer: it relays the events (step stats, finished requests, applied or refused configs)
with each step's outputs, and a fresh occupancy snapshot.

The core ignores SIGINT and SIGTERM (a terminal's Ctrl-C reaches the whole process group): the
API process drains it and tells it to stop. It exits on its own when the API process's end
of the command pipe closes, so a killed server leaves no engine behind.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import io
import logging
import pickle
import queue
import signal
import sys
import threading
from typing import Callable, Optional, Union

from tokenlane.runtime.config import ConfigError, RuntimeConfig
from tokenlane.runtime.core.admission import AdmissionError
from tokenlane.runtime.core.request import Request
from tokenlane.runtime.core.stats import StepStats
from tokenlane.runtime.engine import messages as wire
from tokenlane.runtime.engine.llm_engine import LLMEngine
from tokenlane.runtime.engine.output import RequestOutput
from tokenlane.runtime.observability.process_exit import exit_now

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
        self._events: list[wire.ObserverEvent] = []  # observer events not yet sent
        self._wakeup = threading.Event()
        self._stopping = False  # "stop": end once no request is left
        self._halt = False  # the API process is gone: end now
        self._last_snapshot: Optional[StepStats] = None
        engine.add_observer(self)

    # -- the engine's observer: buffer, sent with the next message

    def on_step(self, stats: StepStats) -> None:
        with self._events_lock:
            self._events.append(wire.StepObserved(stats))

    def on_request_finished(self, request: Request) -> None:
        with self._events_lock:
            self._events.append(wire.RequestFinished(finished_copy(request)))

    def on_config_applied(self, config: object, ok: bool, message: str) -> None:
        with self._events_lock:
            self._events.append(wire.ConfigApplied(config, ok, message, self.engine.max_model_len,
                                                   tuple(self.engine.served_adapters())))

    # -- sending

    def _send(self, message) -> None:
        self._outbox.put(wire.encode(message))

    def _write_out(self) -> None:
        conn, outbox = self._events_conn, self._outbox
        while (data := outbox.get()) is not None:
            try:
                conn.send_bytes(data)
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
        self._send(wire.StepOutputs(outputs, tuple(events), fresh))

    # -- the command thread

    def serve_commands(self, commands) -> None:
        while True:
            try:
                message = wire.decode(commands.recv_bytes())
            except (EOFError, OSError):  # the API process is gone
                self._halt = True
                self._wakeup.set()
                return
            except wire.WireVersionError as exc:
                log.error("engine core: command refused: %s", exc)
                continue
            try:
                self._command(message)
            except Exception:  # a bad command must not end the core's only way in
                log.exception("engine core: command %s failed", type(message).__name__)
            self._wakeup.set()
            if self._events and not self._stopping:
                self._send_step([], snapshot=False)  # e.g. a refusal's metrics, without waiting for a step

    def _command(self, message) -> None:
        engine = self.engine
        if isinstance(message, wire.AddRequests):
            self._send(wire.Replies(tuple(self._admit(entry) for entry in message.entries)))
        elif isinstance(message, wire.Abort):
            engine.abort_request(message.request_id, message.status, message.reason)
        elif isinstance(message, wire.Reload):
            try:
                engine.reload_config(message.config)
            except ValueError as exc:  # observers were told (on_config_applied, ok=False)
                log.warning("config reload refused: %s", exc)
        elif isinstance(message, wire.AdapterCommand):
            self._send(self._adapter_command(message))
        elif isinstance(message, wire.Stop):
            self._stopping = True
        else:
            log.error("engine core: unknown command %r", type(message).__name__)

    def _adapter_command(self, command: wire.AdapterCommand) -> wire.AdapterReply:
        """Load or unload a LoRA adapter (on this thread: a load reads its files here while
        the step thread goes on serving)."""
        engine = self.engine
        try:
            if command.path is None:
                engine.unload_adapter(command.name)
            else:
                engine.load_adapter(command.name, command.path)
        except KeyError:
            return wire.AdapterReply(command.call, 404, f"the LoRA adapter '{command.name}' cannot be found",
                                     tuple(engine.served_adapters()))
        except ValueError as exc:
            return wire.AdapterReply(command.call, 400, str(exc), tuple(engine.served_adapters()))
        return wire.AdapterReply(command.call, 200, "", tuple(engine.served_adapters()))

    def _admit(self, entry: wire.AddRequest) -> Union[wire.Admitted, wire.Refused]:
        """The admitted lanes, or the refusal. `entry.payload` is the request (or the
        group's list of requests) as `dumps_for_core` pickled it."""
        try:
            payload = pickle.loads(entry.payload)
            if entry.group:
                self.engine.add_group(payload)
                return wire.Admitted(entry.call, tuple(request.lane for request in payload))
            self.engine.add_request(payload)
            return wire.Admitted(entry.call, (payload.lane,))
        except AdmissionError as exc:
            return wire.Refused.of(entry.call, exc)
        except Exception as exc:  # a bug in admission: refuse this one, keep serving
            log.exception("admission failed")
            return wire.Refused(entry.call, 500, "internal_error", f"admission failed: {type(exc).__name__}", None)

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
                self._send(wire.Stopped())
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
    """The engine core process's main: load the engine, say Ready (or LoadFailed with why),
    then run the step loop until told to stop. `on_start` (picklable: a top-level function
    or a partial of one) may instrument the core and its engine before it serves, and return
    a callable run when the loop ends (the step profiler writes its records there)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s [core]: %(message)s")
    try:
        engine = LLMEngine.from_config(config)  # token ids only: the API process detokenizes
    except ConfigError as exc:
        events.send_bytes(wire.encode(wire.LoadFailed(str(exc), config_error=True)))
        _end_core(1)
    except Exception as exc:
        events.send_bytes(wire.encode(wire.LoadFailed(f"{type(exc).__name__}: {exc}")))
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
    core._send(wire.Ready(vocab_size=engine.vocab_size, supports_logprobs=engine.supports_logprobs,
                          max_model_len=engine.max_model_len, snapshot=engine.snapshot(),
                          startup_phases=tuple(engine.startup_phases),
                          adapters=tuple(engine.served_adapters())))
    threading.Thread(target=core.serve_commands, args=(commands,), name="tokenlane-core-commands",
                     daemon=True).start()
    code = 0
    try:
        core.run()
    except BaseException as exc:
        code = 1
        log.exception("engine core step loop crashed")
        core._send(wire.CoreDied(f"{type(exc).__name__}: {exc}"))
    core.close()
    if at_end is not None:
        at_end()
    _end_core(code)


def _end_core(code: int) -> None:
    """Exit now, as `tokenlane serve` does (runtime/observability/process_exit.py). The exit
    functions still run: a multi-rank executor stops its worker ranks there."""
    exit_now(code)
