"""The operator's tuner in a closed loop with the real engine on the simulated executor.

The engine runs its real scheduler, KV pool, lanes and admission with the benchmark's cost
model (simulator.py) on a virtual clock; every `interval_s` of virtual time the loop computes
each lane's window numbers from the requests that finished in the window (what Prometheus
would report from the runtime's histograms, see operator/clients/prometheus.py), asks the tuner
(`operator.tuner.decide`), and hot-reloads the new budgets into the engine exactly as the
runtime does after a ConfigMap change (`engine.reload_config`). See docs/architecture.md,
"The budget path".

`tokenlane plan` uses it to learn lane budgets from a user's trace; the tuner's closed-loop
tests use it on a synthetic flood.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

from tokenlane.operator.policy.tuner import decide
from tokenlane.operator.api.tuning_types import (
    Bounds,
    Decision,
    EffectiveBudgets,
    LaneMetrics,
    LaneTarget,
    MetricSample,
    TunerSettings,
)
from tokenlane.runtime.core.admission import AdmissionError
from tokenlane.bench.sim import request_of
from tokenlane.runtime.executor.simulated import SimulatedExecutor, VirtualClock
from tokenlane.bench.trace import PlannedRequest
from tokenlane.runtime.config import CAP_MIN, RuntimeConfig, knob
from tokenlane.runtime.engine.llm_engine import LLMEngine
from tokenlane.runtime.core.request import Request, RequestStatus

OK_STATUSES = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)
_OUTCOME = {RequestStatus.FINISHED_REJECTED: "rejected", RequestStatus.FINISHED_TIMEOUT: "timeout"}
HISTORY = 50  # decisions the tuner sees (the operator keeps a similar tail in status.tuning)


def is_refused(request: Request) -> bool:
    """Counted against slo.maxRefusedShare, by the rule the operator reads Prometheus with."""
    from tokenlane.operator.clients.prometheus import refused

    return refused(_OUTCOME.get(request.status, "finished"), request.finish_detail or "")


def p95(values: list[float]) -> Optional[float]:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]


# --------------------------------------------------------------------------- runtime.yaml adapters


def lane_targets(config: RuntimeConfig, bounds: Mapping[str, Mapping[str, Bounds]]) -> list[LaneTarget]:
    """LaneTargets from a RuntimeConfig's lanes (SLOs, class, priority) and declared bounds,
    capped at the global budget as the operator caps them (operator/controllers/tuning.py)."""

    def lane_bounds(name: str) -> dict:
        return {key: b.capped_at(getattr(config.scheduler, knob(key).attr)) if knob(key).cap == CAP_MIN else b
                for key, b in bounds.get(name, {}).items()}

    return [
        LaneTarget(lane.name, lane.lane_class, lane.priority, lane.slo.ttft_p95_ms, lane.slo.tpot_p95_ms,
                   lane_bounds(lane.name), lane.slo.max_refused_share)
        for lane in config.lanes
    ]


def apply_budgets(config: RuntimeConfig, budgets: EffectiveBudgets) -> RuntimeConfig:
    """A RuntimeConfig with the budgets written as lane caps and global knobs."""
    lanes = []
    for lane in config.lanes:
        changes = {knob(key).attr: int(v) for key, v in budgets.lanes.get(lane.name, {}).items()}
        lanes.append(dataclasses.replace(lane, **changes) if changes else lane)
    changes = {knob(key).attr: float(v) for key, v in budgets.global_.items()}
    sched = dataclasses.replace(config.scheduler, **changes) if changes else config.scheduler
    return dataclasses.replace(config, lanes=lanes, scheduler=sched)


# --------------------------------------------------------------------------- the loop


class _Observer:
    def __init__(self, clock: VirtualClock) -> None:
        self.finished: list[tuple[float, Request]] = []  # (finish time, request)
        self.preemptions = 0
        self.max_kv = 0.0
        self.clock = clock

    def on_step(self, stats) -> None:
        self.preemptions += stats.num_preemptions
        self.max_kv = max(self.max_kv, stats.kv_usage)

    def on_request_finished(self, request: Request) -> None:
        self.finished.append((request.finish_time if request.finish_time is not None else self.clock(), request))

    def on_config_applied(self, config, ok, message) -> None:
        pass


@dataclass
class Interval:
    """One control interval: what the tuner saw and did."""

    end_s: float
    sample: MetricSample
    decision: Optional[Decision]
    budgets: EffectiveBudgets


@dataclass
class LoopResult:
    intervals: list[Interval] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)
    reloads: int = 0

    @property
    def final_budgets(self) -> Optional[EffectiveBudgets]:
        return self.intervals[-1].budgets if self.intervals else None

    def lane_p95_ms(self, lane: str, start_s: float, end_s: float, what: str = "ttft") -> Optional[float]:
        """p95 over requests of `lane` that finished in [start_s, end_s)."""
        values = []
        for req in self.finished:
            if req.lane != lane or req.status not in OK_STATUSES or not start_s <= req.finish_time < end_s:
                continue
            if what == "ttft" and req.first_token_time is not None:
                values.append(req.first_token_time - req.arrival_time)
            elif what == "tpot" and req.num_output_tokens > 1 and req.token_times:
                values.append((req.token_times[-1] - req.first_token_time) / (req.num_output_tokens - 1))
        v = p95(values)
        return None if v is None else v * 1000.0


def window_sample(obs: _Observer, engine: LLMEngine, lanes: Sequence[str], start: float, end: float,
                  preemptions: int, max_kv: float) -> MetricSample:
    """What the PromQL queries of operator/clients/prometheus.py compute, from the finished requests."""
    window = end - start
    snapshot = engine.snapshot()
    out = {}
    for name in lanes:
        done = [r for t, r in obs.finished if start <= t < end and r.lane == name]
        ok = [r for r in done if r.status in OK_STATUSES]
        refusals = [r for r in done if is_refused(r)]
        ttft = [r.first_token_time - r.arrival_time for r in ok if r.first_token_time is not None]
        tpot = [(r.token_times[-1] - r.first_token_time) / (r.num_output_tokens - 1)
                for r in ok if r.num_output_tokens > 1 and r.token_times]
        queue = [r.first_scheduled_time - r.arrival_time for r in ok if r.first_scheduled_time is not None]
        lane_stats = snapshot.lanes.get(name)
        out[name] = LaneMetrics(
            request_rate=len(ok) / window,
            ttft_p95_s=p95(ttft),
            tpot_p95_s=p95(tpot),
            queue_delay_p95_s=p95(queue),
            rejection_rate=len(refusals) / window,
            queue_full_rate=sum(1 for r in refusals if r.finish_detail == "queue_full") / window,
            waiting=float(lane_stats.waiting) if lane_stats else 0.0,
            throughput_tokens_s=sum(r.num_output_tokens for r in ok) / window,
        )
    return MetricSample(window, out, kv_usage=max_kv, preemption_rate=preemptions / window, at=end)


def run(
    config: RuntimeConfig,
    requests: list[PlannedRequest],
    lanes: Sequence[LaneTarget],
    settings: TunerSettings,
    *,
    tune: bool,
    interval_s: float,
    end_s: float,
) -> LoopResult:
    """Replay `requests` until `end_s` of virtual time, tuning every `interval_s` if `tune`."""
    if interval_s <= 0:
        raise ValueError(f"the tuner's interval must be > 0 s, got {interval_s}")
    clock = VirtualClock()
    engine = LLMEngine(config, SimulatedExecutor(config, clock=clock), clock=clock)
    obs = _Observer(clock)
    engine.add_observer(obs)
    pending = deque(sorted(requests, key=lambda p: p.arrival_s))
    result = LoopResult()
    budgets = EffectiveBudgets.from_config(config)
    history: list = []
    lane_names = [lane.name for lane in lanes]
    next_tick, last_preempt = interval_s, 0

    while clock.now < end_s:
        while pending and pending[0].arrival_s <= clock.now:
            planned = pending.popleft()
            req = request_of(planned, engine.config)
            try:
                engine.add_request(req)
            except AdmissionError:
                pass  # the observer saw it as rejected
        if clock.now >= next_tick:
            preempts = obs.preemptions - last_preempt
            sample = window_sample(obs, engine, lane_names, next_tick - interval_s, clock.now, preempts, obs.max_kv)
            last_preempt, obs.max_kv = obs.preemptions, 0.0
            decision = None
            if tune:
                decision = decide(lanes, settings, budgets, sample, history, clock.now)
                history = (history + [decision.record()])[-HISTORY:]
                if decision.changed:
                    budgets = decision.budgets
                    engine.reload_config(apply_budgets(engine.config, budgets))
                    result.reloads += 1
            result.intervals.append(Interval(clock.now, sample, decision, budgets))
            next_tick += interval_s
        if engine.has_unfinished_requests():
            before = clock.now
            engine.step()
            if clock.now == before:  # nothing could run (e.g. waiting for blocks): let time pass
                clock.advance(0.001)
        else:
            clock.advance_to(min(pending[0].arrival_s if pending else end_s, next_tick))
    result.finished = [r for _, r in obs.finished]
    return result
