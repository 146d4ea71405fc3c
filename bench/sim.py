"""Replay traffic through the real engine on a virtual clock with the simulated executor.

`simulate(config, traffic)` builds `LLMEngine(config, SimulatedExecutor, clock=virtual)`: the
engine's own scheduler, KV pool, lanes and admission run; each arrival is injected when the
virtual clock reaches it; each step advances the clock by the cost model's seconds for that
step. Thousands of requests at real trace rates run in seconds on a CPU, deterministically.

Besides latencies it measures KV-cache waste: over sampled steps, the slots allocated to
running requests that hold no token (allocated - computed) / allocated; and the prefix cache's
hit rate and the host tier's block copies (engine.kvOffload). Requests of one conversation
(`PlannedRequest.conversation`) get prompts that extend each other, so prefix caching and the
host tier see the reuse of multi-turn chat.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from typing import Any, Optional

from tokenlane.bench.report import (
    CANCELLED,
    ERROR,
    OK,
    REJECTED,
    TIMEOUT,
    RequestRecord,
    RunResult,
    TokenBins,
    slos_from_config,
)
from tokenlane.runtime.executor.simulated import SimulatedExecutor, VirtualClock
from tokenlane.bench.trace import PlannedRequest, Traffic
from tokenlane.runtime.config import RuntimeConfig
from tokenlane.runtime.core.request import Request, RequestStatus, SamplingParams

# Sample KV occupancy every this many steps (iterating all live requests every step costs more
# than the step itself at thousands of requests).
KV_SAMPLE_EVERY = 4
# A step that schedules nothing while work is queued advances the clock by this much (the
# engine waits, e.g. for KV blocks or a static batch to drain); a long run of them is a bug.
IDLE_TICK_S = 0.001
MAX_IDLE_TICKS = 10_000_000

_BASE_PROMPT = [1000 + (i * 7919) % 100_000 for i in range(140_000)]


def prompt_ids(index: int, n: int) -> list[int]:
    """Synthetic prompt: a unique first token (so prefix caching finds nothing shared between
    requests, as in the trace) followed by a shared pattern (slicing shares the int objects)."""
    return [500 + index % 500] + _BASE_PROMPT[: n - 1] if n > 1 else [500 + index % 500]


def conversation_prompt_ids(conversation: int, n: int) -> list[int]:
    """A conversation's history cut at `n` tokens: three tokens naming the conversation (so
    prefix caching shares blocks within it and never across conversations), then the pattern."""
    head = [500 + conversation % 500, 500 + conversation // 500 % 500, 500 + conversation // 250_000 % 500]
    return (head + _BASE_PROMPT[: max(0, n - len(head))])[:n]


class _Collector:
    """EngineObserver: finished requests and step counters."""

    def __init__(self) -> None:
        self.finished: list[Request] = []
        self.steps = 0
        self.preemptions = 0
        self.max_kv_usage = 0.0
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of them, found cached

    def on_step(self, stats) -> None:
        if stats.num_batched_tokens:
            self.steps += 1
        self.prefix_queries += stats.prefix_cache_queries
        self.prefix_hits += stats.prefix_cache_hits
        self.preemptions += stats.num_preemptions
        self.max_kv_usage = max(self.max_kv_usage, stats.kv_usage)

    def on_request_finished(self, request: Request) -> None:
        self.finished.append(request)

    def on_config_applied(self, config, ok, message) -> None:  # pragma: no cover - unused
        pass


def _outcome(req: Request) -> tuple[str, str]:
    status = req.status
    if status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH):
        return OK, req.finish_detail
    if status == RequestStatus.FINISHED_CANCELLED:
        return CANCELLED, req.finish_detail or "client"
    if status == RequestStatus.FINISHED_TIMEOUT:
        return TIMEOUT, req.finish_detail or "queue_timeout"
    if status == RequestStatus.FINISHED_REJECTED:
        return REJECTED, req.finish_detail or "rejected"
    return ERROR, req.finish_detail or status.name.lower()


def record_of(req: Request, planned: PlannedRequest, t0: float, label_lanes: bool = False) -> RequestRecord:
    """`label_lanes`: report the requested lane (the traffic class) instead of the serving
    lane, so runs against a config without those lanes compare per class."""
    outcome, reason = _outcome(req)
    n_out = req.num_output_tokens
    ttft = None if req.first_token_time is None else req.first_token_time - req.arrival_time
    last = req.token_times[-1] if req.token_times else req.first_token_time
    tpot = None
    if n_out > 1 and req.first_token_time is not None and last is not None:
        tpot = (last - req.first_token_time) / (n_out - 1)
    end = req.finish_time if req.finish_time is not None else last
    return RequestRecord(
        index=planned.index,
        lane=(planned.lane or req.lane) if label_lanes else req.lane,
        tenant=req.tenant,
        arrival_s=req.arrival_time - t0,
        prompt_tokens=req.num_prompt_tokens,
        max_tokens=planned.max_tokens,
        output_tokens=n_out,
        outcome=outcome,
        reason=reason,
        stream=planned.stream,
        ttft_s=ttft,
        tpot_s=tpot,
        e2e_s=None if end is None else end - req.arrival_time,
        queue_delay_s=None if req.first_scheduled_time is None else req.first_scheduled_time - req.arrival_time,
        finish_reason=req.finish_reason.value if req.finish_reason else None,
        deadline_ms=planned.deadline_ms,
    )


def _route(config: RuntimeConfig, planned: PlannedRequest) -> str:
    """The lane the server's router would choose (X-Lane, tenant default, match rules).
    A requested lane the config does not have is dropped (the router then decides): that is
    how one traffic mix runs against a config without lanes."""
    from tokenlane.runtime.entrypoints.routing import authenticate, choose_lane

    headers = {"x-tenant": planned.tenant}
    if planned.lane and any(lane.name == planned.lane for lane in config.lanes):
        headers["x-lane"] = planned.lane
    caller = authenticate(config, headers)
    return choose_lane(config, caller, headers, planned.prompt_tokens)


def request_of(planned: PlannedRequest, config: RuntimeConfig) -> Request:
    """The engine request for a planned one, timed on the virtual clock."""
    return Request(
        request_id=planned.request_id,
        prompt_token_ids=(prompt_ids(planned.index, planned.prompt_tokens) if planned.conversation is None
                          else conversation_prompt_ids(planned.conversation, planned.prompt_tokens)),
        sampling_params=SamplingParams(max_tokens=planned.max_tokens, temperature=0.0, ignore_eos=True),
        lane=_route(config, planned),
        tenant=planned.tenant,
        adapter=planned.adapter,
        priority=planned.priority,
        arrival_time=planned.arrival_s,  # the true arrival, even if the GPU was busy
        deadline=None if planned.deadline_ms is None else planned.arrival_s + planned.deadline_ms / 1e3,
    )


def simulate(
    config: RuntimeConfig,
    traffic: Traffic,
    name: str = "sim",
    *,
    progress: bool = False,
    max_virtual_s: Optional[float] = None,
    slos: Optional[dict] = None,
) -> RunResult:
    """Run `traffic` to completion (or until `max_virtual_s`) and return its RunResult.
    `slos` (lane -> LaneSLO) overrides the config's, e.g. for traffic classes the config
    has no lane for."""
    from tokenlane.runtime.core.admission import AdmissionError
    from tokenlane.runtime.engine.llm_engine import LLMEngine

    if config.engine.executor != "simulated":
        config = dataclasses.replace(config, engine=dataclasses.replace(config.engine, executor="simulated"))
    clock = VirtualClock()
    executor = SimulatedExecutor(config, clock=clock)
    engine = LLMEngine(config, executor, clock=clock)
    collector = _Collector()
    engine.add_observer(collector)
    bins = TokenBins()

    pending = deque(traffic.requests)
    live: dict[str, tuple[PlannedRequest, Request]] = {}
    records: list[RequestRecord] = []
    kv_alloc_slots = 0
    kv_used_slots = 0
    idle_ticks = 0
    step_index = 0
    bar = _progress(len(traffic.requests), name) if progress else None
    lane_names = {lane.name for lane in config.lanes}
    label_lanes = any(p.lane and p.lane not in lane_names for p in traffic.requests)

    def finish(req: Request) -> None:
        entry = live.pop(req.request_id, None)
        if entry is None:
            return
        planned, _ = entry
        records.append(record_of(req, planned, 0.0, label_lanes))
        bins.add_many(req.token_times)
        if bar is not None:
            bar.update(1)

    while pending or live:
        while pending and pending[0].arrival_s <= clock.now:
            planned = pending.popleft()
            req = request_of(planned, config)
            live[req.request_id] = (planned, req)
            try:
                engine.add_request(req)
            except AdmissionError as exc:
                if not req.is_finished:
                    req.finish(RequestStatus.FINISHED_REJECTED, exc.reason, now=clock.now)
                finish(req)
        for req in collector.finished:
            finish(req)
        collector.finished.clear()
        if not live:
            if pending:
                clock.advance_to(pending[0].arrival_s)
            continue
        if max_virtual_s is not None and clock.now > max_virtual_s:
            break

        before = clock.now
        outputs = engine.step()
        step_index += 1
        for out in outputs:
            entry = live.get(out.request_id)
            if entry is None:
                continue
            planned, req = entry
            if (
                not out.finished
                and planned.cancel_after_tokens is not None
                and out.num_output_tokens >= planned.cancel_after_tokens
            ):
                engine.abort_request(out.request_id, RequestStatus.FINISHED_CANCELLED, "client_cancel")
        if step_index % KV_SAMPLE_EVERY == 0:
            for _, req in live.values():
                if req.status == RequestStatus.RUNNING and req.block_ids:
                    kv_alloc_slots += len(req.block_ids) * executor.block_size
                    kv_used_slots += req.num_computed_tokens
        for req in collector.finished:
            finish(req)
        collector.finished.clear()
        # Requests the engine finished without telling the observer (defensive: the contract
        # says it always does) are collected here so the loop ends.
        for rid in [rid for rid, (_, r) in live.items() if r.is_finished]:
            finish(live[rid][1])
        if clock.now == before:
            idle_ticks += 1
            if idle_ticks > MAX_IDLE_TICKS:
                raise RuntimeError(f"simulation made no progress for {MAX_IDLE_TICKS} idle ticks")
            nxt = pending[0].arrival_s if pending else before + IDLE_TICK_S
            clock.advance_to(min(max(nxt, before + 1e-6), before + IDLE_TICK_S))
    if bar is not None:
        bar.close()

    records.sort(key=lambda r: r.index)
    first = min((r.arrival_s for r in records), default=0.0)
    duration = max(clock.now - first, 1e-9)
    end_state = engine.snapshot()
    waste = (kv_alloc_slots - kv_used_slots) / kv_alloc_slots if kv_alloc_slots else None
    extra: dict[str, Any] = {
        "virtual_seconds": clock.now,
        "steps": executor.num_steps,
        "busy_seconds": executor.busy_seconds,
        "gpu_busy_share": executor.busy_seconds / max(clock.now, 1e-9),
        "kv_blocks_total": executor.num_kv_blocks,
        "kv_blocks_free_at_end": end_state.kv_blocks_free,
        "kv_block_size": executor.block_size,
        "kv_waste": waste,
        "kv_alloc_slots_sampled": kv_alloc_slots,
        "kv_max_usage": collector.max_kv_usage,
        "preemptions": collector.preemptions,
        "prefix_cache_hit_rate": collector.prefix_hits / collector.prefix_queries if collector.prefix_queries else None,
        "kv_cache_dtype": config.engine.kv_cache_dtype,
        "kv_blocks_offloaded": executor.num_blocks_offloaded,
        "kv_blocks_restored": executor.num_blocks_restored,
        "host_link_seconds": executor.host_link_seconds,
        "profile": executor.profile.name,
        "continuous_batching": config.engine.continuous_batching,
        "unfinished": len(live),
    }
    return RunResult(
        name=name,
        records=records,
        duration_s=duration,
        slos=slos if slos is not None else slos_from_config(config),
        token_bins=dict(bins.bins),
        extra=extra,
        description=traffic.description,
    )


def _progress(total: int, name: str):
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is in the bench extra
        return None
    return tqdm(total=total, desc=f"simulate {name}", unit="req", leave=False)

