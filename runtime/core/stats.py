"""What the engine reports after each step and each request: the input of metrics.

The engine calls every registered `EngineObserver`; the Prometheus exporter (metrics.py) and
the benchmarks implement it. Pure Python, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Protocol

from tokenlane.runtime.core.request import Request


@dataclass
class LaneStepStats:
    running: int = 0  # sequences of this lane in the running set after the step
    waiting: int = 0  # requests of this lane queued after the step
    scheduled_tokens: int = 0  # tokens this lane got in the step
    prefill_tokens: int = 0  # of those, prompt tokens (prefill chunks)
    decode_tokens: int = 0  # of those, decode tokens
    queued: int = 0  # requests admission control let into the lane queue since the last step
    started: int = 0  # waiting requests the scheduler started running in the step
    preempted: int = 0  # running requests of this lane preempted in the step
    kv_blocks_held: int = 0  # KV block-table entries of this lane's running requests
    time_capped: bool = False  # the step-time budget shortened or skipped this lane's work in the step


@dataclass
class StepStats:
    step_seconds: float = 0.0  # model execution (or simulated) time of the step
    schedule_seconds: float = 0.0  # CPU time of planning + applying results
    num_batched_tokens: int = 0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_preemptions: int = 0  # requests preempted in this step
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache this step
    prefix_cache_hits: int = 0  # of those, tokens found cached
    prefix_cache_host_hits: int = 0  # of those, tokens restored from the host tier (engine.kvOffload)
    # The host tier: blocks copied each way in the step, their bytes, the restores' seconds
    # (None: no restore), and its slots (0 total: no tier).
    kv_blocks_offloaded: int = 0
    kv_blocks_restored: int = 0
    kv_bytes_offloaded: int = 0
    kv_bytes_restored: int = 0
    kv_restore_seconds: Optional[float] = None
    kv_host_blocks_total: int = 0
    kv_host_blocks_used: int = 0
    kv_blocks_total: int = 0
    kv_blocks_free: int = 0
    kv_usage: float = 0.0  # used / total blocks, 0..1
    kv_blocks_cached_free: int = 0  # of the free blocks, those still holding a cached prefix
    kv_blocks_reserved: int = 0  # of the free blocks, those held back for lanes' unmet KV reserves
    # (lane, seconds) per request whose blocks went back to the pool in the step: from the
    # moment its end was known (cancel call, deadline, last token computed) to blocks free.
    kv_releases: list[tuple[str, float]] = field(default_factory=list)
    oom_events: int = 0  # executor steps that ran out of accelerator memory (their requests failed)
    lanes: dict[str, LaneStepStats] = field(default_factory=dict)
    # Multi-LoRA: engine.maxLoras, the KV block size, and per served adapter its (running,
    # waiting) requests (every served adapter is listed, idle ones at (0, 0)).
    max_loras: int = 0
    block_size: int = 0
    adapters: dict[str, tuple[int, int]] = field(default_factory=dict)


class EngineObserver(Protocol):
    def on_step(self, stats: StepStats) -> None:
        """After every step that scheduled work (and on idle ticks, with zero tokens).
        `stats` is a fresh object each step that observers must not change: the flight
        recorder keeps it as is."""

    def on_request_finished(self, request: Request) -> None:
        """Once per request when it reaches a final status: finished, cancelled, timed out,
        rejected (request.finish_detail holds the reason) or error."""

    def on_config_applied(self, config: object, ok: bool, message: str) -> None:
        """After a hot reload was applied (ok=True) or refused (ok=False)."""
