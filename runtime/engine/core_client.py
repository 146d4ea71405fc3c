"""`CoreProcessClient`: the EngineClient (runtime/engine/client.py) of an engine core that runs
in a process of its own (runtime/engine/core_process.py).

    API process                                      engine core (spawned child)
    CoreProcessClient                                run_engine_core
      submit ──── AddRequests(AddRequest...) ───>     command thread: engine.add_request,
             <─── Replies(Admitted | Refused) ───      the admitted lanes or the refusal
      abort ───── Abort(request_id, reason) ───>      engine.abort_request
      (a stop string found by the event loop: Abort(..., FINISHED_STOPPED))
      reload_config ─ Reload(config) ──────────>      engine.reload_config
      shutdown ── Stop() ──────────────────────>      step loop ends once nothing runs
      reader thread <─ StepOutputs(outputs, events, snapshot) ── step loop: engine.step()
                    <─ CoreDied(message) ─────      the step loop raised
                    <─ Stopped() ─────────────      clean end after Stop

Observers (metrics, flight recorder, request log) run in the API process: the core relays
their events (step stats, finished requests, applied or refused configs) with each step's
outputs, and a fresh occupancy snapshot (the /metrics gauges). Admission runs in the core,
against the scheduler's state; the API process awaits its answer (one round trip) before it
answers the client. The core returns token ids; the API process's event loop detokenizes them
and looks for stop strings as it dispatches them (the OutputProcessor the in-process front
runs too: runtime/engine/output.py); a stop string it finds ends the request in the core with
an Abort.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import threading
import time
from typing import Any, Callable, Optional

from tokenlane.runtime.config import ConfigError, RuntimeConfig
from tokenlane.runtime.core.admission import AdmissionError
from tokenlane.runtime.core.request import Request, RequestStatus
from tokenlane.runtime.core.stats import EngineObserver, StepStats
from tokenlane.runtime.engine import messages as wire
from tokenlane.runtime.engine.async_engine import RequestStream, StreamTable
from tokenlane.runtime.engine.core_process import STOP_TIMEOUT_S, dumps_for_core, run_engine_core
from tokenlane.runtime.engine.llm_engine import RestartRequired, restart_field_changes
from tokenlane.runtime.engine.output import OutputProcessor, RequestOutput

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- in a core process


class CoreView:
    """What the API process knows of the core's engine: the config in force, the tokenizer,
    the model's limits, the latest occupancy snapshot, and the observers, which get the
    events the core relays."""

    def __init__(self, config: RuntimeConfig, ready: wire.Ready, tokenizer: Any) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.vocab_size: Optional[int] = ready.vocab_size
        self.supports_logprobs: bool = ready.supports_logprobs
        self.max_model_len: int = ready.max_model_len
        self.startup_phases: tuple = ready.startup_phases
        self.clock = time.monotonic  # system-wide: the core's clock too
        self.observers: list[EngineObserver] = []
        self.snapshot: StepStats = ready.snapshot  # as of the core's last message
        self.adapters: tuple = ready.adapters  # ServedAdapter: as of the core's last word on them

    def record_rejection(self, request: Request, error: AdmissionError) -> None:
        """A refusal of the API process's own (draining, core down): counted like the core's."""
        request.finish(RequestStatus.FINISHED_REJECTED, error.reason, now=self.clock())
        self.notify("on_request_finished", request)

    def relay(self, event: wire.ObserverEvent) -> None:
        if isinstance(event, wire.StepObserved):
            self.notify("on_step", event.stats)
        elif isinstance(event, wire.RequestFinished):
            self.notify("on_request_finished", event.request)
        elif isinstance(event, wire.ConfigApplied):
            if event.ok:
                self.config, self.max_model_len = event.config, event.max_model_len
                self.adapters = event.adapters
            self.notify("on_config_applied", event.config, event.ok, event.message)
        else:
            log.error("engine core: unknown observer event %r", type(event).__name__)

    def notify(self, method: str, *args) -> None:
        for observer in self.observers:
            try:
                getattr(observer, method)(*args)
            except Exception:
                log.exception("observer %r failed", observer)


class CoreProcessClient:
    """The engine in a core process of its own. Admission is a round trip: `submit` awaits
    the core's Admitted or Refused."""

    def __init__(self, view: CoreView, process, commands, events) -> None:
        self._view = view
        self._table = StreamTable(view.record_rejection, OutputProcessor(view.tokenizer, self._end_in_core))
        self._process = process
        self._commands = commands  # the API process's write end
        self._events = events  # the API process's read end
        self._calls: dict[int, asyncio.Future] = {}  # admissions awaiting the core's answer
        self._admissions: list[wire.AddRequest] = []  # admissions not yet sent (see _queue_admission)
        self._call_ids = itertools.count()
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._reader: Optional[threading.Thread] = None
        self._stopped: Optional[asyncio.Event] = None
        self._send_lock = threading.Lock()

    @classmethod
    def from_config(cls, config: RuntimeConfig, on_start: Optional[Callable] = None,
                    log_level: Optional[int] = None) -> "CoreProcessClient":
        """Spawn the core and wait until its engine is loaded; ValueError with the core's own
        message if it could not load (WireVersionError if it speaks another wire version).
        `on_start` is the core's hook (core_process.run_engine_core)."""
        context = multiprocessing.get_context("spawn")  # a fork would copy torch's threads' state
        core_commands, commands = context.Pipe(duplex=False)
        events, core_events = context.Pipe(duplex=False)
        level = log_level if log_level is not None else logging.getLogger().getEffectiveLevel()
        process = context.Process(target=run_engine_core, name="tokenlane-engine-core", daemon=True,
                                  args=(config, core_commands, core_events, level, on_start))
        process.start()
        core_commands.close()  # the child holds these ends now: EOF follows its exit
        core_events.close()
        tokenizer = None
        if config.engine.executor != "simulated":
            # While the core imports and loads: on a host with a core to spare the two overlap.
            from tokenlane.runtime.engine.tokenizer import byte_level_table, load_tokenizer

            try:
                tokenizer = load_tokenizer(config.model.tokenizer or config.model.path)
                byte_level_table(tokenizer)  # while the core loads (the output processor's table)
            except Exception as exc:  # as the core's own load of it would have failed
                process.kill()
                process.join(5)
                raise ValueError(f"{type(exc).__name__}: {exc}") from exc
        try:
            first = wire.decode(events.recv_bytes())
        except (EOFError, OSError):
            process.join(5)
            raise ValueError(f"the engine core exited while loading (exit code {process.exitcode})") from None
        except wire.WireVersionError:
            process.kill()
            process.join(5)
            raise
        if not isinstance(first, wire.Ready):
            process.join(5)
            if isinstance(first, wire.LoadFailed) and first.config_error:
                raise ConfigError(first.message)
            message = first.message if isinstance(first, wire.LoadFailed) else f"unexpected {first!r}"
            raise ValueError(message)
        return cls(CoreView(config, first, tokenizer), process, commands, events)

    # ------------------------------------------------------------------ what is served

    @property
    def config(self) -> RuntimeConfig:
        return self._view.config

    @property
    def tokenizer(self) -> Any:
        return self._view.tokenizer

    @property
    def vocab_size(self) -> Optional[int]:
        return self._view.vocab_size

    @property
    def supports_logprobs(self) -> bool:
        return self._view.supports_logprobs

    @property
    def max_model_len(self) -> int:
        return self._view.max_model_len

    @property
    def startup_phases(self) -> tuple:
        return self._view.startup_phases

    def clock(self) -> float:
        return self._view.clock()

    def snapshot(self) -> StepStats:
        """The core's occupancy as of its last message (each step, or each idle tick that
        changed it)."""
        return self._view.snapshot

    def add_observer(self, observer: EngineObserver) -> None:
        self._view.observers.append(observer)

    @property
    def healthy(self) -> bool:
        return self._table.healthy

    @property
    def draining(self) -> bool:
        return self._table.draining

    @property
    def ready(self) -> bool:
        return self._table.ready

    @property
    def error(self) -> Optional[BaseException]:
        """Why the core stopped serving, if it did."""
        return self._table.error

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        if self._table.started:
            return
        self._loop = asyncio.get_running_loop()
        self._stopped = asyncio.Event()
        self._reader = threading.Thread(target=self._read_events, name="tokenlane-core-reader", daemon=True)
        self._reader.start()
        self._table.started = True

    async def shutdown(self, grace_s: float) -> None:
        """Drain as the in-process engine does, then stop the core and wait for its exit."""
        table = self._table
        table.draining = True
        if not table.started:
            self._end_process()
            return
        deadline = time.monotonic() + max(0.0, grace_s)
        while table.streams and table.healthy:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            await asyncio.sleep(min(0.02, left))
        for request_id in list(table.streams):
            self._send_abort(request_id, "shutdown")
        table.stopping = True
        self._send_quietly(wire.Stop())
        if table.healthy:
            try:
                await asyncio.wait_for(self._stopped.wait(), timeout=max(STOP_TIMEOUT_S, grace_s))
            except asyncio.TimeoutError:
                log.error("the engine core did not stop in time; killing it")
        table.fail_all("engine stopped")
        await asyncio.to_thread(self._end_process)

    def _end_process(self) -> None:
        self._process.join(STOP_TIMEOUT_S if self._stopped is not None and self._stopped.is_set() else 0.5)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(5)
        self._commands.close()

    # ------------------------------------------------------------------ requests

    async def submit(self, request: Request) -> RequestStream:
        return (await self._admit(False, request, [request]))[0]

    async def submit_group(self, requests: list[Request]) -> list[RequestStream]:
        return await self._admit(True, requests, requests)

    async def _admit(self, group: bool, payload, requests: list[Request]) -> list[RequestStream]:
        self._table.check_open(requests)
        # Registered before the core can answer: its outputs find their stream.
        streams = self._table.open(requests, self)
        call = next(self._call_ids)
        future = self._loop.create_future()
        self._calls[call] = future
        try:
            self._queue_admission(wire.AddRequest(call, group, dumps_for_core(payload)))
            reply = await future
        except BaseException:
            for request in requests:  # e.g. the client left: the core may have admitted it
                if self._table.streams.pop(request.request_id, None) is not None:
                    self._send_abort(request.request_id, "client_disconnect")
            raise
        finally:
            self._calls.pop(call, None)
        if isinstance(reply, wire.Refused):
            for request in requests:
                self._table.streams.pop(request.request_id, None)
                request.finish(RequestStatus.FINISHED_REJECTED, reply.reason, now=time.monotonic())
            raise reply.error()
        for request, lane in zip(requests, reply.lanes):
            request.lane = lane  # the core resolved "default" to the default lane
        return streams

    def abort(self, request_id: str, reason: str = "cancelled") -> None:
        if request_id in self._table.streams:
            self._send_abort(request_id, reason)

    def _send_abort(self, request_id: str, reason: str,
                    status: RequestStatus = RequestStatus.FINISHED_CANCELLED) -> None:
        self._send_admissions()  # an abort must reach the core after the request it cancels
        self._send_quietly(wire.Abort(request_id, reason, status))

    def _end_in_core(self, request_id: str, status: RequestStatus, detail: str) -> None:
        """The output processor ended a request (a stop string, a detokenizer error)."""
        self._send_abort(request_id, detail, status)

    def reload_config(self, new: RuntimeConfig) -> None:
        """Checked here as the engine would (RestartRequired at once), staged in the core."""
        if not isinstance(new, RuntimeConfig):
            raise ValueError(f"expected a RuntimeConfig, got {type(new).__name__}")
        changed = restart_field_changes(self._view.config, new)
        if changed:
            error = RestartRequired(changed)
            self._view.relay(wire.ConfigApplied(new, False, str(error), self._view.max_model_len))
            raise error
        try:
            self._send(wire.Reload(new))
        except AdmissionError as exc:  # the core is gone
            raise ValueError(exc.message) from None

    # ------------------------------------------------------------------ LoRA adapters

    def served_adapters(self) -> list:
        return list(self._view.adapters)

    async def load_adapter(self, name: str, path: str):
        reply = await self._adapter_call(wire.AdapterCommand(next(self._call_ids), name, path))
        if reply.status != 200:
            raise ValueError(reply.message)
        return next(a for a in self._view.adapters if a.name == name)

    async def unload_adapter(self, name: str) -> None:
        reply = await self._adapter_call(wire.AdapterCommand(next(self._call_ids), name, None))
        if reply.status == 404:
            raise KeyError(name)
        if reply.status != 200:
            raise ValueError(reply.message)

    async def _adapter_call(self, command: wire.AdapterCommand) -> wire.AdapterReply:
        """A round trip to the core; ValueError if the core is gone."""
        future = self._loop.create_future()
        self._calls[command.call] = future
        try:
            try:
                self._send(command)
            except AdmissionError as exc:
                raise ValueError(exc.message) from None
            reply = await future
        finally:
            self._calls.pop(command.call, None)
        if isinstance(reply, wire.Refused):  # the core went away meanwhile
            raise ValueError(reply.message)
        self._view.adapters = reply.adapters
        return reply

    # ------------------------------------------------------------------ the pipes

    def _send(self, message) -> None:
        """To the core; a core that is gone makes it a 503."""
        data = wire.encode(message)
        try:
            with self._send_lock:
                self._commands.send_bytes(data)
        except (OSError, ValueError) as exc:
            self._core_gone(f"the engine core is gone ({type(exc).__name__})")
            raise AdmissionError(503, "unavailable", f"the engine has stopped: {self._table.error}", 1.0) from None

    def _queue_admission(self, entry: wire.AddRequest) -> None:
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
            self._send(wire.AddRequests(tuple(batch)))
        except AdmissionError as exc:
            self._resolve([wire.Refused.of(entry.call, exc) for entry in batch])

    def _send_quietly(self, message) -> None:
        try:
            self._send(message)
        except AdmissionError:
            pass  # the core is gone: its requests are failed already

    def _read_events(self) -> None:
        """The reader thread: observers run here (as they run on the step thread in
        process); outputs (to be detokenized there) and replies go to the event loop."""
        view = self._view
        while True:
            try:
                message = wire.decode(self._events.recv_bytes())
            except (EOFError, OSError):
                break
            except wire.WireVersionError as exc:
                self._call_soon(self._core_gone, str(exc))
                return
            if isinstance(message, wire.StepOutputs):
                for event in message.events:
                    view.relay(event)
                if message.snapshot is not None:
                    view.snapshot = message.snapshot
                if message.outputs:
                    self._call_soon(self._dispatch_outputs, message.outputs)
            elif isinstance(message, wire.Replies):
                self._call_soon(self._resolve, message.replies)
            elif isinstance(message, wire.AdapterReply):
                self._call_soon(self._resolve, (message,))
            elif isinstance(message, wire.CoreDied):
                self._call_soon(self._core_gone, f"engine error: {message.message}")
                return
            elif isinstance(message, wire.Stopped):
                self._call_soon(self._stopped.set)
                return
            else:
                log.error("engine core: unexpected message %r", type(message).__name__)
        exit_code = self._process.exitcode
        self._call_soon(self._core_gone, f"the engine core exited (exit code {exit_code})")

    def _call_soon(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop is closed: nobody is left to serve
            pass

    def _dispatch_outputs(self, outputs: list[RequestOutput]) -> None:
        streams = self._table.streams
        for output in outputs:
            stream = streams.get(output.request_id)
            if stream is not None and stream.request.first_scheduled_time is None:
                stream.request.first_scheduled_time = output.scheduled_at
        self._table.dispatch(outputs)

    def _resolve(self, replies) -> None:
        for reply in replies:
            future = self._calls.get(reply.call)
            if future is not None and not future.done():
                future.set_result(reply)

    def _core_gone(self, message: str) -> None:
        """The core died (or its pipe broke): unhealthy for good; every stream and pending
        admission ends with the error."""
        if self._stopped is not None and self._stopped.is_set():
            return
        table = self._table
        if table.healthy:
            log.error("engine core: %s", message)
            table.healthy = False
            table.error = RuntimeError(message)
        for call, future in self._calls.items():
            if not future.done():
                future.set_result(wire.Refused(call, 503, "unavailable", f"the engine has stopped: {message}", 1.0))
        table.fail_all(message)
        if self._stopped is not None:
            self._stopped.set()
