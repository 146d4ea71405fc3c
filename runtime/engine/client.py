"""The one boundary between the server and its engine: `EngineClient`.

The entrypoints (runtime/entrypoints) hold an EngineClient and nothing else of the engine.
Two implementations, each built by composition around what runs the steps:

    InProcessClient     an AsyncEngine: the LLMEngine stepped by a thread of this process
    CoreProcessClient   an engine core process (runtime/engine/core_process.py), spoken to
                        with typed messages (runtime/engine/messages.py) over two pipes;
                        runtime/engine/core_client.py

`open_client` picks one as `engine.coreProcess` says.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable, Optional, Protocol, Sequence, Union, runtime_checkable

from tokenlane.runtime.config import RuntimeConfig
from tokenlane.runtime.core.request import Request
from tokenlane.runtime.core.startup import StartupPhase
from tokenlane.runtime.core.stats import EngineObserver, StepStats
from tokenlane.runtime.engine.adapters import ServedAdapter
from tokenlane.runtime.engine.async_engine import AsyncEngine, RequestStream
from tokenlane.runtime.engine.core_client import CoreProcessClient
from tokenlane.runtime.engine.llm_engine import LLMEngine

log = logging.getLogger(__name__)


@runtime_checkable
class EngineClient(Protocol):
    """What the server uses of its engine."""

    # -- what is served: the config in force (hot reloads land here), the model's limits

    @property
    def config(self) -> RuntimeConfig: ...

    @property
    def tokenizer(self) -> Any: ...  # None for the simulated executor

    @property
    def vocab_size(self) -> Optional[int]: ...

    @property
    def supports_logprobs(self) -> bool: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def startup_phases(self) -> Sequence[StartupPhase]:
        """What the engine's start-up took, phase by phase (tokenizer, load, kv, warmup)."""

    def clock(self) -> float:
        """The engine's clock (request arrival times and deadlines are on it)."""

    def snapshot(self) -> StepStats:
        """The engine's occupancy (the /metrics gauges)."""

    def add_observer(self, observer: EngineObserver) -> None:
        """`observer` gets every step's stats, finished request and config change."""

    # -- state

    @property
    def healthy(self) -> bool:
        """False for good once the engine died (/health answers 503)."""

    @property
    def draining(self) -> bool: ...

    @property
    def ready(self) -> bool:
        """Started, not draining, healthy."""

    # -- lifecycle

    async def start(self) -> None: ...

    async def shutdown(self, grace_s: float) -> None:
        """Refuse new work (503 "draining"), let in-flight requests finish for up to
        `grace_s`, abort the rest, stop the engine."""

    # -- requests

    async def submit(self, request: Request) -> RequestStream:
        """Admit the request and return its output stream; AdmissionError (429/503/400...)
        as soon as the engine refuses it."""

    async def submit_group(self, requests: list[Request]) -> list[RequestStream]:
        """Admit the sequences of one prompt sampled in parallel (leader first), all or
        none; one stream per sequence."""

    def abort(self, request_id: str, reason: str = "cancelled") -> None:
        """Cancel a request: its KV blocks are freed at the engine's next step boundary; its
        stream still gets a final output."""

    def reload_config(self, new: RuntimeConfig) -> None:
        """Stage a new config for the next step boundary; RestartRequired (a ValueError) at
        once if a field that needs a restart changed."""

    # -- LoRA adapters (runtime/engine/adapters.py)

    def served_adapters(self) -> list[ServedAdapter]:
        """The adapters served now, in load order."""

    async def load_adapter(self, name: str, path: str) -> ServedAdapter:
        """Load and serve an adapter; ValueError naming it if it cannot be (nothing changes)."""

    async def unload_adapter(self, name: str) -> None:
        """Stop serving an adapter (KeyError if not served); in-flight requests finish with it."""


# --------------------------------------------------------------------------- in this process


class InProcessClient:
    """The engine stepped by a thread of this process (AsyncEngine). Admission runs in the
    caller's turn of the event loop, so a refusal is answered at once."""

    def __init__(self, async_engine: AsyncEngine) -> None:
        self.async_engine = async_engine

    @classmethod
    def from_config(cls, config: RuntimeConfig) -> "InProcessClient":
        return cls(AsyncEngine.from_config(config))

    @property
    def llm_engine(self) -> LLMEngine:
        """The engine itself (tests and the step profiler reach into it)."""
        return self.async_engine.engine

    @property
    def config(self) -> RuntimeConfig:
        return self.llm_engine.config

    @property
    def tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    @property
    def vocab_size(self) -> Optional[int]:
        return self.llm_engine.vocab_size

    @property
    def supports_logprobs(self) -> bool:
        return self.llm_engine.supports_logprobs

    @property
    def max_model_len(self) -> int:
        return self.llm_engine.max_model_len

    @property
    def startup_phases(self) -> Sequence[StartupPhase]:
        return self.llm_engine.startup_phases

    def clock(self) -> float:
        return self.llm_engine.clock()

    def snapshot(self) -> StepStats:
        return self.llm_engine.snapshot()

    def add_observer(self, observer: EngineObserver) -> None:
        self.llm_engine.add_observer(observer)

    @property
    def healthy(self) -> bool:
        return self.async_engine.healthy

    @property
    def draining(self) -> bool:
        return self.async_engine.draining

    @property
    def ready(self) -> bool:
        return self.async_engine.ready

    async def start(self) -> None:
        await self.async_engine.start()

    async def shutdown(self, grace_s: float) -> None:
        await self.async_engine.shutdown(grace_s)

    async def submit(self, request: Request) -> RequestStream:
        return self.async_engine.submit(request)

    async def submit_group(self, requests: list[Request]) -> list[RequestStream]:
        return self.async_engine.submit_group(requests)

    def abort(self, request_id: str, reason: str = "cancelled") -> None:
        self.async_engine.abort(request_id, reason)

    def reload_config(self, new: RuntimeConfig) -> None:
        self.async_engine.reload_config(new)

    def served_adapters(self) -> list[ServedAdapter]:
        return self.llm_engine.served_adapters()

    async def load_adapter(self, name: str, path: str) -> ServedAdapter:
        # Off the event loop: it reads (or downloads) the adapter, then waits for a step boundary.
        return await asyncio.to_thread(self.llm_engine.load_adapter, name, path)

    async def unload_adapter(self, name: str) -> None:
        self.llm_engine.unload_adapter(name)
        self.async_engine.wake()  # its weights go at a step boundary once its requests finish


# --------------------------------------------------------------------------- choosing one


def open_client(config: RuntimeConfig, on_core_start: Optional[Callable] = None,
                own_process: Optional[bool] = None) -> Union[InProcessClient, CoreProcessClient]:
    """The engine `tokenlane serve` serves: a CoreProcessClient when the engine core gets a
    process of its own (its core spawned and loaded; `on_core_start` is the core's
    `on_start` hook), else an InProcessClient. `own_process` None decides as
    `engine.coreProcess` says (unset: by the host, `cpu_placement.plan_core_process`).
    ValueError or OSError if the model cannot be loaded."""
    if own_process is None:
        from tokenlane.runtime.executor.cpu_placement import core_process_for
        from tokenlane.runtime.executor.model_executor import select_device

        device_type = "cpu" if config.engine.executor != "model" else select_device(config.engine.device).type
        own_process, why = core_process_for(config.engine, device_type)
        log.info("step loop: %s", why)
    if own_process:
        return CoreProcessClient.from_config(config, on_start=on_core_start)
    return InProcessClient.from_config(config)
