"""The messages between the API process and its engine core process (engine.coreProcess).

Each message is a frozen dataclass; `encode` frames it as a fixed header (a magic tag and
the wire version) followed by its pickle, and `decode` checks the header before it
unpickles anything, so a server and a core from different tokenlane versions fail with a
clear WireVersionError instead of a garbled object.

Pickle, not msgpack: the messages carry the runtime's own objects (Request with its
sampling parameters, RequestOutput with logprobs, StepStats, RuntimeConfig), which pickle
as they are; msgpack would need a schema and a converter for each of them, and it is not
installed with the runtime. Both ends are the same checkout's code, spawned by the server,
so pickle's trust model holds.

    API process -> core                         core -> API process
    AddRequests(AddRequest...)  admissions      Ready / LoadFailed   once, after loading
    Abort(request_id, reason, status)           Replies(Admitted | Refused ...)
    Reload(config)                              StepOutputs(outputs, events, snapshot)
    AdapterCommand(call, name, path)            AdapterReply(call, status, message, adapters)
    Stop()                                      CoreDied(message) / Stopped()
"""

from __future__ import annotations

import dataclasses
import pickle
import struct
from typing import Any, Optional, Union

from tokenlane.runtime.core.admission import AdmissionError
from tokenlane.runtime.core.request import RequestStatus

# Bump on any change to a message's fields or meaning.
WIRE_VERSION = 2
_MAGIC = b"TLWM"
_HEADER = struct.Struct("<4sH")


class WireVersionError(ValueError):
    """A message from a peer that speaks another wire version (or is not one of ours)."""


# --------------------------------------------------------------------------- API process -> core


@dataclasses.dataclass(frozen=True, slots=True)
class AddRequest:
    """One admission: `payload` is the Request (or a sequence group's list of Requests,
    `group`) as `core_process.dumps_for_core` pickled it, so that one request whose grammar
    cannot be loaded is refused alone. `call` pairs the core's answer with the caller."""

    call: int
    group: bool
    payload: bytes


@dataclasses.dataclass(frozen=True, slots=True)
class AddRequests:
    """The admissions asked for in one turn of the API process's event loop."""

    entries: tuple[AddRequest, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class Abort:
    """End a request at the core's next step boundary: a cancel (`reason`: the metrics'
    label), or a stop string or detokenizer error found by the API process (`status`)."""

    request_id: str
    reason: str
    status: RequestStatus = RequestStatus.FINISHED_CANCELLED


@dataclasses.dataclass(frozen=True, slots=True)
class Reload:
    config: Any  # RuntimeConfig


@dataclasses.dataclass(frozen=True, slots=True)
class AdapterCommand:
    """Load LoRA adapter `name` from `path` (POST /v1/load_lora_adapter), or unload it
    (`path` None). `call` pairs the core's AdapterReply with the caller."""

    call: int
    name: str
    path: Optional[str] = None


@dataclasses.dataclass(frozen=True, slots=True)
class Stop:
    """End the step loop once no request is left."""


# --------------------------------------------------------------------------- core -> API process


@dataclasses.dataclass(frozen=True, slots=True)
class Ready:
    vocab_size: Optional[int]
    supports_logprobs: bool
    max_model_len: int
    snapshot: Any  # StepStats
    startup_phases: tuple = ()  # StartupPhase: the core's tokenizer, load, kv and warmup
    adapters: tuple = ()  # ServedAdapter: the LoRA adapters served after loading


@dataclasses.dataclass(frozen=True, slots=True)
class LoadFailed:
    message: str
    config_error: bool = False  # a ConfigError (e.g. a model.adapters entry): exit 2, not 1


@dataclasses.dataclass(frozen=True, slots=True)
class AdapterReply:
    """The answer to an AdapterCommand: status 200 (done), 400 (refused: `message` says
    why) or 404 (unload of an adapter not served); `adapters` the ones served after it."""

    call: int
    status: int
    message: str
    adapters: tuple = ()


@dataclasses.dataclass(frozen=True, slots=True)
class Admitted:
    call: int
    lanes: tuple[str, ...]  # per request: the lane the core resolved ("default" made concrete)


@dataclasses.dataclass(frozen=True, slots=True)
class Refused:
    call: int
    status: int
    reason: str
    message: str
    retry_after_s: Optional[float] = None

    @classmethod
    def of(cls, call: int, error: AdmissionError) -> "Refused":
        return cls(call, error.status, error.reason, error.message, error.retry_after_s)

    def error(self) -> AdmissionError:
        return AdmissionError(self.status, self.reason, self.message, self.retry_after_s)


@dataclasses.dataclass(frozen=True, slots=True)
class Replies:
    replies: tuple[Union[Admitted, Refused], ...]


@dataclasses.dataclass(frozen=True, slots=True)
class StepObserved:
    """An observer event: a step's stats."""

    stats: Any  # StepStats


@dataclasses.dataclass(frozen=True, slots=True)
class RequestFinished:
    """An observer event: a request ended (a light copy: core_process.finished_copy)."""

    request: Any  # Request


@dataclasses.dataclass(frozen=True, slots=True)
class ConfigApplied:
    """An observer event: a config was applied (ok) or refused, and the model length after."""

    config: Any  # RuntimeConfig
    ok: bool
    message: str
    max_model_len: int
    adapters: tuple = ()  # ServedAdapter: the LoRA adapters served after it


ObserverEvent = Union[StepObserved, RequestFinished, ConfigApplied]


@dataclasses.dataclass(frozen=True, slots=True)
class StepOutputs:
    """A step's outputs (possibly none), the observer events since the last message, and a
    fresh occupancy snapshot (None: unchanged). The outputs carry token ids, no text: the
    API process detokenizes and looks for stop strings."""

    outputs: list  # list[RequestOutput]
    events: tuple[ObserverEvent, ...] = ()
    snapshot: Any = None  # Optional[StepStats]


@dataclasses.dataclass(frozen=True, slots=True)
class CoreDied:
    message: str


@dataclasses.dataclass(frozen=True, slots=True)
class Stopped:
    """The clean end after Stop."""


# --------------------------------------------------------------------------- framing


def encode(message: Any) -> bytes:
    """The message framed for the wire: the header, then its pickle."""
    return _HEADER.pack(_MAGIC, WIRE_VERSION) + pickle.dumps(message, pickle.HIGHEST_PROTOCOL)


def decode(data: bytes) -> Any:
    """The message `encode` framed; WireVersionError if it is not one of ours or speaks
    another wire version."""
    if len(data) < _HEADER.size:
        raise WireVersionError(f"not an engine core message ({len(data)} bytes, shorter than its header)")
    magic, version = _HEADER.unpack_from(data)
    if magic != _MAGIC:
        raise WireVersionError(f"not an engine core message (tag {magic!r})")
    if version != WIRE_VERSION:
        raise WireVersionError(
            f"engine core message of wire version {version}, this process speaks version {WIRE_VERSION}: "
            "the server and its engine core come from different tokenlane versions")
    return pickle.loads(memoryview(data)[_HEADER.size:])
