"""Fleet mode of the simulator: N replicas behind the router's pick policy, with the
autoscaler's decision in the loop, on one shared virtual clock.

Each replica is the real engine on the simulated executor, as in `sim.py`; each has its own
`VirtualClock`, and one event loop keeps them in step. It always handles the earliest event
next: an arrival, a router scrape, an autoscaler decision, a replica becoming ready, or the
end of a replica's model step. A replica whose step ends at t is stepped again at t, so each
replica's clock runs ahead of the loop by at most one step. That is the replica being busy on
its GPU.

- **Routing.** `policy="router"` calls `fleet_pick.pick` unchanged. Its view of each replica
  comes from `engine.snapshot()` (per-lane waiting and running, KV usage), taken at every
  scrape (every 250 ms of virtual time, as the router scrapes `/metrics`). Between scrapes it
  counts what it has sent to each replica, as the router does. The affinity key is the shared
  system prompt when a request has one, else the request itself. A refusal by a replica's
  admission is retried on another replica, as the router retries before the first byte.
  `policy="round-robin"` is a plain Kubernetes Service: the next ready replica in turn, and
  a refusal goes back to the client.
- **Shared system prompts.** `SystemPrompts` prepends one of K system prompts to a share of
  the requests, with Zipf popularity. Prefix caching is then real: it happens in each
  engine's own prefix cache, and the hit rate counts the prompt tokens found there.
- **Autoscaling.** Every `interval_s`, a `FleetSample` is built as the operator builds it
  from Prometheus (operator/controllers/scaling.py): the requests that arrived and ended in the last
  `window_s`, each lane's waiting requests and each ready replica's running share averaged
  over the scrapes of the window's last quarter, the ready replicas' KV usage, how many
  replicas are ready (the rest are starting; the decision does not add their capacity
  again) and how many served the window on average. Then `operator/policy/autoscaler.py:decide()`
  is called. A new replica becomes routable `startup_delay_s` after it was added. A
  removed replica drains: it takes no new request and finishes the ones it holds. Replicas
  cost from the moment they are added until they have drained.
- **Scale from zero.** With `policy="router"` a request that finds no ready replica is held,
  as the router holds it (at most `hold_queue_size`, each for at most `hold_timeout_s`, then
  refused `hold_queue_full` / `hold_timeout`), and released at the first scrape that sees a
  replica ready. The sample carries the router's held requests, the arrivals that found no
  replica, the requests in flight and those that arrived over `scaleToZeroAfter`, so a
  `minReplicas: 0` policy wakes the fleet and puts it back to sleep as the operator does.
  `scale_to_zero_experiment` compares it with `minReplicas: 1` over a day with idle hours.

See docs/fleet.md ("Fleet mode in the simulator") and docs/benchmarks.md ("Fleet").
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from tokenlane.operator.policy.autoscaler import (
    LOAD_NOW_SHARE,
    AutoscalingPolicy,
    FleetSample,
    LaneSample,
    LaneScalingTarget,
    Recommendation,
    decide,
)
from tokenlane.runtime.fleet import pick as fleet_pick
from tokenlane.runtime.fleet.pick import DEFAULT_HOLD_QUEUE_SIZE, DEFAULT_HOLD_TIMEOUT_S
from tokenlane.bench.report import REJECTED, LaneSLO, RequestRecord, RunResult, TokenBins, slos_from_config
from tokenlane.bench.sim import IDLE_TICK_S, MAX_IDLE_TICKS, _BASE_PROMPT, _Collector, _route, record_of
from tokenlane.runtime.executor.simulated import SimulatedExecutor, VirtualClock
from tokenlane.bench.trace import PlannedRequest, Traffic
from tokenlane.runtime.config import RuntimeConfig
from tokenlane.runtime.core.request import Request, RequestStatus, SamplingParams

ROUND_ROBIN = "round-robin"
ROUTER = "router"
POLICIES = (ROUND_ROBIN, ROUTER)

SCRAPE_INTERVAL_S = 0.25  # the router's default --scrape-interval-ms
DEFAULT_STARTUP_DELAY_S = 60.0  # pod scheduled -> weights loaded -> /ready, for an 8B model

STARTING, READY, DRAINING, GONE = "starting", "ready", "draining", "gone"

# System prompt tokens live in their own id range, so they never match a request's own tokens.
_SYSTEM_TOKEN_BASE = 20_000
_SYSTEM_TOKEN_SPAN = 100_000


@dataclass(frozen=True)
class SystemPrompts:
    """Shared system prompts: `count` prompts of `tokens` tokens each. A `share` of the
    requests starts with one of them, drawn with Zipf popularity (`zipf` = 0: uniform). The
    request's own prompt (its trace length) follows the system prompt."""

    count: int = 0
    tokens: int = 1024
    share: float = 1.0
    zipf: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.count < 0:
            raise ValueError(f"system prompt count must be >= 0, got {self.count}")
        if self.count and self.tokens < 1:
            raise ValueError(f"system prompt tokens must be >= 1, got {self.tokens}")
        if not 0.0 <= self.share <= 1.0:
            raise ValueError(f"system prompt share must be in [0, 1], got {self.share}")
        if self.zipf < 0:
            raise ValueError(f"system prompt zipf exponent must be >= 0, got {self.zipf}")

    def assign(self, n: int) -> list[Optional[int]]:
        """Which system prompt each of n requests carries (None: none). Deterministic."""
        if not self.count or n == 0:
            return [None] * n
        rng = np.random.default_rng(self.seed + 7_777)
        weights = 1.0 / np.arange(1, self.count + 1, dtype=float) ** self.zipf
        which = rng.choice(self.count, size=n, p=weights / weights.sum())
        carries = rng.random(n) < self.share
        return [int(k) if c else None for k, c in zip(which, carries)]

    def prompt(self, k: int) -> list[int]:
        return [_SYSTEM_TOKEN_BASE + (k * 7919 + j * 104_729) % _SYSTEM_TOKEN_SPAN for j in range(self.tokens)]


def _own_prompt(index: int, n: int) -> list[int]:
    """A request's own tokens: two leading tokens unique to the request (so nothing after a
    system prompt is shared), then a common pattern (slicing shares the int objects)."""
    head = [1000 + index % 10_000, 11_000 + index // 10_000]
    return head[:n] + _BASE_PROMPT[: max(0, n - 2)]


@dataclass(frozen=True)
class AutoscaleSettings:
    policy: AutoscalingPolicy
    interval_s: float = 15.0  # how often decide() runs
    window_s: float = 60.0  # the sample's window: requests that ended in it
    startup_delay_s: float = DEFAULT_STARTUP_DELAY_S
    # A replica counts as ready for the decision once it has been ready this long (as HPA's
    # initialization period, or a Deployment's minReadySeconds and availableReplicas): until
    # then the window's latencies are those of the smaller fleet before it. 0: at once.
    settle_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.settle_s >= 0:
            raise ValueError(f"autoscale settle time must be >= 0 s, got {self.settle_s!r}")
        for name in ("interval_s", "window_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"autoscale {name} must be > 0, got {getattr(self, name)!r}")
        if not self.startup_delay_s >= 0:
            raise ValueError(f"startup delay must be >= 0 s, got {self.startup_delay_s!r}")


# The running signal's settings for the production config on the simulated H200 (measured
# with one replica on the conversation trace: 96 interactive sequences at most; about 0.4 of
# them run at 18 req/s, where the lane still meets its SLO for 96% of its requests, and the
# share roughly quadruples when the rate doubles near there). 0.4 replica of headroom covers
# a rise of about 7 req/s during a 60 s start-up. A scale-up needs two decisions in a row (a
# 30 s window at 15 s decisions), so that the rush at a step's onset, which the replicas
# absorb, does not add a replica (benchmarks.md, section 5).
SIM_RUNNING_SHARE_TARGET = 0.4
SIM_HEADROOM_REPLICAS = 0.4
SIM_SCALE_UP_STABILIZATION_S = 30.0
SIM_TARGET_UTILIZATION = AutoscalingPolicy.target_utilization  # the CRD's default


def default_scaling_policy(config: RuntimeConfig, min_replicas: int, max_replicas: int,
                           slo_attainment: float = 0.97,
                           running_share_target: Optional[float] = SIM_RUNNING_SHARE_TARGET,
                           headroom_replicas: float = SIM_HEADROOM_REPLICAS,
                           scale_up_stabilization_s: float = SIM_SCALE_UP_STABILIZATION_S,
                           target_utilization: float = SIM_TARGET_UTILIZATION) -> AutoscalingPolicy:
    """Targets from the config: each lane with a TTFT SLO gets a queue delay p95 target of
    half its TTFT target and an SLO attainment target; the running signal and the scale-up
    window as measured for the simulated H200 (the SIM_* constants above)."""
    targets = tuple(
        LaneScalingTarget(lane.name, queue_delay_p95_s=lane.slo.ttft_p95_ms / 2e3, slo_attainment=slo_attainment)
        for lane in config.lanes if lane.slo.ttft_p95_ms
    )
    return AutoscalingPolicy(min_replicas=min_replicas, max_replicas=max_replicas, lanes=targets,
                             running_share_target=running_share_target, headroom_replicas=headroom_replicas,
                             scale_up_stabilization_s=scale_up_stabilization_s,
                             target_utilization=target_utilization)


class SimReplica:
    """One replica: the real engine on the simulated executor, on its own clock."""

    def __init__(self, name: str, config: RuntimeConfig, created_at: float, ready_at: float) -> None:
        from tokenlane.runtime.engine.llm_engine import LLMEngine

        self.name = name
        self.clock = VirtualClock(created_at)
        self.executor = SimulatedExecutor(config, clock=self.clock)
        self.engine = LLMEngine(config, self.executor, clock=self.clock)
        self.collector = _Collector()
        self.engine.add_observer(self.collector)
        self.created_at = created_at
        self.ready_at = ready_at
        self.state = STARTING if ready_at > created_at else READY
        self.removed_at: Optional[float] = None  # when it was gone (drained or never started)
        self.live: dict[str, tuple[PlannedRequest, Request]] = {}
        self.idle_ticks = 0
        self.served = 0
        self.first_request_at: Optional[float] = None

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "created_at": self.created_at, "ready_at": self.ready_at,
                "removed_at": self.removed_at, "first_request_at": self.first_request_at, "served": self.served}

    @property
    def busy(self) -> bool:
        return bool(self.live)

    def view(self, config: RuntimeConfig) -> fleet_pick.ReplicaView:
        """What the router reads from this replica's /metrics and /ready."""
        snap = self.engine.snapshot()
        lanes = {}
        for name, stats in snap.lanes.items():
            budgets = config.lane_budgets(name)
            lanes[name] = fleet_pick.LaneLoad(waiting=stats.waiting, running=stats.running,
                                              max_waiting=budgets.max_waiting_requests,
                                              max_running=budgets.max_active_sequences)
        return fleet_pick.ReplicaView(url=self.name, healthy=self.state == READY, lanes=lanes,
                                      kv_usage=snap.kv_usage,
                                      kv_reject_watermark=config.scheduler.kv_cache_reject_watermark)


@dataclass
class FleetResult:
    """One fleet run: the requests as one RunResult, plus the fleet's own numbers."""

    run: RunResult
    replica_seconds: float
    replica_timeline: list[tuple[float, int]]  # (time, replicas that cost) after each change
    decisions: list[dict[str, Any]] = field(default_factory=list)
    prefix_queries: int = 0
    prefix_hits: int = 0
    picks: dict[str, int] = field(default_factory=dict)

    @property
    def replica_hours(self) -> float:
        return self.replica_seconds / 3600.0

    @property
    def prefix_hit_rate(self) -> Optional[float]:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else None


class _Router:
    """The router's state between scrapes, and the round-robin baseline."""

    def __init__(self, policy: str, config: RuntimeConfig, affinity: fleet_pick.PickPolicy) -> None:
        self.policy = policy
        self.config = config
        self.affinity = affinity
        self.views: dict[str, fleet_pick.ReplicaView] = {}
        self.dispatched: dict[str, dict[Optional[str], int]] = {}
        self.turn = 0
        self.picks: dict[str, int] = {}

    def scrape(self, replicas: list[SimReplica]) -> None:
        self.views = {r.name: r.view(self.config) for r in replicas if r.state != GONE}
        self.dispatched = {name: {} for name in self.views}

    def choose(self, replicas: list[SimReplica], lane: str, key: bytes,
               exclude: frozenset[str]) -> "fleet_pick.Pick | fleet_pick.Refusal":
        if self.policy == ROUND_ROBIN:
            ready = [r for r in replicas if r.state == READY and r.name not in exclude]
            if not ready:
                return fleet_pick.Refusal(503, "no_healthy_replica", "no ready replica",
                                          fleet_pick.NO_HEALTHY_RETRY_AFTER_S)
            chosen = ready[self.turn % len(ready)]
            self.turn += 1
            return fleet_pick.Pick(chosen.name, "round_robin")
        # Health as the router sees it: a replica that is no longer ready (draining, gone)
        # fails its next request at once, and is marked down then.
        states = {r.name: r.state for r in replicas}
        views = []
        for name, view in self.views.items():
            healthy = view.healthy and states.get(name) == READY
            views.append(dataclasses.replace(view, healthy=healthy, dispatched=self.dispatched.get(name, {})))
        return fleet_pick.pick(views, lane, key, self.affinity, exclude)

    def sent(self, name: str, lane: str, reason: str) -> None:
        counts = self.dispatched.setdefault(name, {})
        counts[lane] = counts.get(lane, 0) + 1
        self.picks[reason] = self.picks.get(reason, 0) + 1


def simulate_fleet(
    config: RuntimeConfig,
    traffic: Traffic,
    *,
    name: str = "fleet",
    replicas: int = 4,
    policy: str = ROUTER,
    system_prompts: SystemPrompts = SystemPrompts(),
    autoscale: Optional[AutoscaleSettings] = None,
    affinity: fleet_pick.PickPolicy = fleet_pick.PickPolicy(),
    scrape_interval_s: float = SCRAPE_INTERVAL_S,
    slos: Optional[dict[str, LaneSLO]] = None,
    hold_queue_size: int = DEFAULT_HOLD_QUEUE_SIZE,
    hold_timeout_s: float = DEFAULT_HOLD_TIMEOUT_S,
) -> FleetResult:
    """Replay `traffic` through a fleet of simulated replicas (see the module docstring).
    With `autoscale`, `replicas` is the starting size (clamped to the policy's bounds) and
    the starting replicas are ready at time 0."""
    if policy not in POLICIES:
        raise ValueError(f"fleet policy must be one of {list(POLICIES)}, got {policy!r}")
    if replicas < 1:
        raise ValueError(f"a fleet needs at least one replica, got {replicas}")
    if hold_queue_size < 0 or not hold_timeout_s > 0:
        raise ValueError(f"hold queue size must be >= 0 and hold timeout > 0 s, got {hold_queue_size!r}, "
                         f"{hold_timeout_s!r}")
    if not scrape_interval_s > 0:
        raise ValueError(f"scrape interval must be > 0 s, got {scrape_interval_s!r}")
    if config.engine.executor != "simulated":
        config = dataclasses.replace(config, engine=dataclasses.replace(config.engine, executor="simulated"))
    if autoscale is not None:
        replicas = autoscale.policy.clamp(replicas)
    slos = slos if slos is not None else slos_from_config(config)
    lane_names = {lane.name for lane in config.lanes}
    label_lanes = any(p.lane and p.lane not in lane_names for p in traffic.requests)
    prefix_of = system_prompts.assign(len(traffic.requests))
    system_cache: dict[int, list[int]] = {}

    fleet: list[SimReplica] = []
    timeline: list[tuple[float, int]] = []
    counter = 0

    def add_replica(now: float, delay: float) -> SimReplica:
        nonlocal counter
        replica = SimReplica(f"replica-{counter}", config, now, now + delay)
        counter += 1
        fleet.append(replica)
        return replica

    def costing() -> int:
        return sum(1 for r in fleet if r.state != GONE)

    for _ in range(replicas):
        add_replica(0.0, 0.0)
    timeline.append((0.0, costing()))
    peak_active = replicas  # starting + ready replicas, the most at any time
    router = _Router(policy, config, affinity)
    router.scrape(fleet)

    records: list[RequestRecord] = []
    finished_at: list[tuple[float, RequestRecord]] = []  # for the autoscaler's window
    arrived_at: list[tuple[float, str]] = []  # (time, lane) of every request, admitted or refused
    # (time, {lane: (waiting on all replicas, {ready replica: its running share})}) at every
    # scrape: the load now, which the autoscaler averages as the operator's PromQL does
    load_log: deque[tuple[float, dict[str, tuple[int, dict[str, float]]]]] = deque()
    bins = TokenBins()
    decisions: list[dict[str, Any]] = []
    history: tuple[Recommendation, ...] = ()
    pending = deque(traffic.requests)
    # Scale from zero: requests the router holds while no replica is ready (planned, arrived at),
    # and the arrival times of the requests that found no ready replica.
    held: deque[tuple[PlannedRequest, float]] = deque()
    held_peak = 0
    without_replica: list[float] = []
    next_scrape = scrape_interval_s
    next_decision = autoscale.interval_s if autoscale else math.inf

    def finish(replica: SimReplica, req: Request) -> None:
        entry = replica.live.pop(req.request_id, None)
        if entry is None:
            return
        planned, _ = entry
        record = record_of(req, planned, 0.0, label_lanes)
        held_for = req.arrival_time - planned.arrival_s
        if held_for > 0:  # held by the router: the client waited that long before the replica saw it
            record = dataclasses.replace(
                record, arrival_s=planned.arrival_s,
                ttft_s=None if record.ttft_s is None else record.ttft_s + held_for,
                e2e_s=None if record.e2e_s is None else record.e2e_s + held_for)
        records.append(record)
        finished_at.append((replica.clock.now, record))
        bins.add_many(req.token_times)

    def refuse(planned: PlannedRequest, lane: str, code: str, now: float) -> None:
        record = RequestRecord(index=planned.index, lane=(planned.lane or lane) if label_lanes else lane,
                               tenant=planned.tenant, arrival_s=planned.arrival_s,
                               prompt_tokens=planned.prompt_tokens, max_tokens=planned.max_tokens,
                               outcome=REJECTED, reason=code, stream=planned.stream,
                               deadline_ms=planned.deadline_ms)
        records.append(record)
        finished_at.append((now, record))

    def build(planned: PlannedRequest, lane: str, arrival: float) -> tuple[Request, bytes]:
        """The request as the replica receives it at `arrival` (later than the client sent it
        when the router held it; the client's deadline still counts from its own arrival)."""
        k = prefix_of[planned.index] if planned.index < len(prefix_of) else None
        own = _own_prompt(planned.index, planned.prompt_tokens)
        if k is None:
            ids, key = own, b"own:%d" % planned.index
        else:
            if k not in system_cache:
                system_cache[k] = system_prompts.prompt(k)
            ids, key = system_cache[k] + own, b"system:%d" % k
        req = Request(
            request_id=planned.request_id,
            prompt_token_ids=ids,
            sampling_params=SamplingParams(max_tokens=planned.max_tokens, temperature=0.0, ignore_eos=True),
            lane=lane, tenant=planned.tenant, priority=planned.priority, arrival_time=arrival,
            deadline=None if planned.deadline_ms is None else planned.arrival_s + planned.deadline_ms / 1e3,
        )
        return req, key

    def dispatch(planned: PlannedRequest, now: float, was_held: bool = False) -> None:
        from tokenlane.runtime.core.admission import AdmissionError

        nonlocal held_peak
        lane = _route(config, planned)
        if not was_held:
            arrived_at.append((now, lane))
            if policy == ROUTER and not any(r.state == READY for r in fleet):
                # The router holds it until a scrape finds a replica ready (router.py: _hold).
                without_replica.append(now)
                if len(held) < hold_queue_size:
                    held.append((planned, now))
                    held_peak = max(held_peak, len(held))
                    return
                refuse(planned, lane, "hold_queue_full" if hold_queue_size else "no_healthy_replica", now)
                return
        by_name = {r.name: r for r in fleet}
        tried: set[str] = set()
        last_reason = ""
        req, key = build(planned, lane, now)
        while True:
            choice = router.choose(fleet, lane, key, frozenset(tried))
            if isinstance(choice, fleet_pick.Refusal):
                # Nothing tried yet: the router's own refusal; else the last replica's.
                refuse(planned, lane, choice.code if not tried else last_reason, now)
                return
            replica = by_name[choice.url]
            router.sent(replica.name, lane, choice.reason if not tried else "retry")
            if not replica.busy:
                replica.clock.advance_to(now)  # an idle GPU starts on arrival
            try:
                replica.engine.add_request(req)
            except AdmissionError as exc:
                tried.add(replica.name)
                last_reason = exc.reason
                if policy == ROUND_ROBIN:  # a Service does not retry: the client gets the refusal
                    refuse(planned, lane, last_reason, now)
                    return
                req, key = build(planned, lane, now)  # a fresh request object for the next try
                continue
            replica.live[req.request_id] = (planned, req)
            replica.served += 1
            if replica.first_request_at is None:
                replica.first_request_at = now
            return

    def step(replica: SimReplica) -> None:
        before = replica.clock.now
        outputs = replica.engine.step()
        for out in outputs:
            entry = replica.live.get(out.request_id)
            if entry is None:
                continue
            planned, _ = entry
            if (not out.finished and planned.cancel_after_tokens is not None
                    and out.num_output_tokens >= planned.cancel_after_tokens):
                replica.engine.abort_request(out.request_id, RequestStatus.FINISHED_CANCELLED, "client_cancel")
        for req in replica.collector.finished:
            finish(replica, req)
        replica.collector.finished.clear()
        for rid in [rid for rid, (_, r) in replica.live.items() if r.is_finished]:
            finish(replica, replica.live[rid][1])
        if replica.clock.now == before:
            replica.idle_ticks += 1
            if replica.idle_ticks > MAX_IDLE_TICKS:
                raise RuntimeError(f"{replica.name} made no progress for {MAX_IDLE_TICKS} idle ticks")
            replica.clock.advance(IDLE_TICK_S)
        else:
            replica.idle_ticks = 0

    def retire(now: float) -> bool:
        """Drained replicas leave the fleet. True when the set of costing replicas changed."""
        changed = False
        for r in fleet:
            if r.state == DRAINING and not r.busy:
                r.state, r.removed_at = GONE, max(now, r.clock.now)
                changed = True
        return changed

    def load_now() -> dict[str, tuple[int, dict[str, float]]]:
        snapshots = [(r, r.engine.snapshot()) for r in fleet if r.state in (READY, DRAINING)]
        load = {}
        for lane in lane_names:
            waiting = sum(snap.lanes[lane].waiting for _, snap in snapshots if lane in snap.lanes)
            max_active = config.lane_budgets(lane).max_active_sequences
            shares = {r.name: snap.lanes[lane].running / max_active for r, snap in snapshots
                      if r.state == READY and lane in snap.lanes and max_active}
            load[lane] = (waiting, shares)
        return load

    def sample(now: float) -> FleetSample:
        """What the operator reads from Prometheus (operator/controllers/scaling.py): over the window, the
        requests that ended and arrived; at `now`, each lane's waiting requests (all replicas)
        and running share (each replica ready now: its own average over the scrapes in which
        it was ready, as Prometheus averages a pod's series over the time it was scraped; and
        the mean of those)."""
        window = autoscale.window_s
        lanes: dict[str, list[RequestRecord]] = {}
        for t, rec in finished_at:
            if t > now - window:
                lanes.setdefault(rec.lane, []).append(rec)
        arrivals: dict[str, int] = {}
        for t, lane in arrived_at:
            if t > now - window:
                arrivals[lane] = arrivals.get(lane, 0) + 1
        ready = [r for r in fleet if r.state == READY]
        idle_span = autoscale.policy.scale_to_zero_after_s
        zero = dict(held_requests=float(len(held)),
                    arrivals_without_replica=float(sum(1 for t in without_replica if t > now - window)),
                    in_flight=float(sum(len(r.live) for r in fleet if r.state != GONE)),
                    idle_window_requests=float(sum(1 for t, _ in arrived_at if t > now - idle_span)))
        recent = [load for t, load in load_log if t > now - window * LOAD_NOW_SHARE] or [load_now()]
        lane_samples = {}
        for lane in sorted(set(lanes) | set(arrivals)):
            recs = lanes.get(lane, [])
            waiting = sum(load[lane][0] for load in recent if lane in load) / len(recent)
            own: dict[str, list[float]] = {}
            for load in recent:
                for replica, share in (load[lane][1] if lane in load else {}).items():
                    own.setdefault(replica, []).append(share)
            shares = tuple(sum(own[r.name]) / len(own[r.name]) for r in ready if r.name in own)
            delays = [r.queue_delay_s for r in recs if r.queue_delay_s is not None]
            # A request refused or timed out in the queue waited at least until it ended.
            delays += [r.e2e_s or 0.0 for r in recs if r.queue_delay_s is None]
            slo = slos.get(lane)
            judged = [r for r in recs if r.outcome != "cancelled"]
            met = sum(1 for r in judged if slo is None or slo.met(r))
            lane_samples[lane] = LaneSample(
                request_rate=len(recs) / window,
                queue_delay_p95_s=float(np.percentile(delays, 95)) if delays else None,
                slo_attainment=met / len(judged) if judged else None,
                waiting=float(waiting),
                arrival_rate=arrivals.get(lane, 0) / window,
                served_rate=sum(1 for r in recs if r.outcome != REJECTED) / window,
                running_share=sum(shares) / len(shares) if shares else None,
                replica_running_shares=shares or None,
            )
        kv = sum(r.engine.scheduler.kv.usage for r in ready) / len(ready) if ready else None
        settled = sum(1 for r in ready if r.ready_at <= now - autoscale.settle_s)
        # Replica-seconds of readiness in the window / the window (Prometheus: the average
        # count of replicas exporting metrics over it).
        serving = sum(max(0.0, min(now, r.removed_at if r.removed_at is not None else now)
                          - max(now - window, r.ready_at)) for r in fleet if r.state != STARTING) / window
        return FleetSample(at=now, window_s=window, lanes=lane_samples, kv_usage=kv, ready_replicas=settled,
                           serving_replicas=serving, **zero)

    def scale(now: float) -> None:
        nonlocal history, peak_active
        active = [r for r in fleet if r.state in (STARTING, READY)]
        sampled = sample(now)
        decision = decide(autoscale.policy, len(active), sampled, history, now)
        history = decision.history
        decisions.append({"at": now, "current": len(active), "ready": sampled.ready_replicas,
                          "desired": decision.desired, "action": decision.action, "reason": decision.reason})
        if decision.desired > len(active):
            for _ in range(decision.desired - len(active)):
                add_replica(now, autoscale.startup_delay_s)
        elif decision.desired < len(active):
            # As a ReplicaSet does: replicas not yet ready go first, then the least busy.
            victims = sorted(active, key=lambda r: (r.state == READY, len(r.live), -r.created_at))
            for r in victims[: len(active) - decision.desired]:
                if r.state == STARTING:
                    r.state, r.removed_at = GONE, now
                else:
                    r.state = DRAINING
        retire(now)
        timeline.append((now, costing()))
        peak_active = max(peak_active, sum(1 for r in fleet if r.state in (STARTING, READY)))

    now = 0.0
    while pending or held or any(r.busy for r in fleet):
        busy = [r for r in fleet if r.busy]
        t_step = min((r.clock.now for r in busy), default=math.inf)
        t_arrival = pending[0].arrival_s if pending else math.inf
        t_ready = min((r.ready_at for r in fleet if r.state == STARTING), default=math.inf)
        t_hold_expiry = held[0][1] + hold_timeout_s if held else math.inf
        now = min(t_step, t_arrival, t_ready, next_scrape, next_decision, t_hold_expiry)
        # At equal times: fleet changes and the router's view first, then arrivals, then steps.
        if t_hold_expiry == now:
            planned, _ = held.popleft()
            refuse(planned, _route(config, planned), "hold_timeout", now)
        elif t_ready == now:
            for r in fleet:
                if r.state == STARTING and r.ready_at <= now:
                    r.state = READY
                    r.clock.advance_to(now)
        elif next_decision == now:
            scale(now)
            next_decision = now + autoscale.interval_s
        elif next_scrape == now:
            router.scrape(fleet)
            next_scrape = now + scrape_interval_s
            if held and any(r.state == READY for r in fleet):  # this scrape sees a replica ready
                while held:
                    dispatch(held.popleft()[0], now, was_held=True)
            if autoscale is not None:
                load_log.append((now, load_now()))
                while load_log and load_log[0][0] <= now - autoscale.window_s * LOAD_NOW_SHARE:
                    load_log.popleft()
        elif t_arrival == now:
            dispatch(pending.popleft(), now)
        else:
            replica = min(busy, key=lambda r: (r.clock.now, r.name))
            step(replica)
            if replica.state == DRAINING and not replica.busy and retire(replica.clock.now):
                timeline.append((replica.clock.now, costing()))

    end = max([now] + [r.clock.now for r in fleet if r.state != GONE])
    for r in fleet:
        if r.state == DRAINING:  # drained with its last request
            r.state, r.removed_at = GONE, r.clock.now
    replica_seconds = sum((r.removed_at if r.removed_at is not None else end) - r.created_at for r in fleet)
    records.sort(key=lambda r: r.index)
    first = min((r.arrival_s for r in records), default=0.0)
    prefix_queries = sum(r.engine.scheduler.kv.prefix_queries for r in fleet)
    prefix_hits = sum(r.engine.scheduler.kv.prefix_hits for r in fleet)
    extra: dict[str, Any] = {
        "policy": policy,
        "replicas_start": replicas,
        "replicas_peak": max(n for _, n in timeline),
        "replicas_added": counter,
        "replicas_active_peak": peak_active,
        "replicas": [r.describe() for r in fleet],
        "replica_hours": replica_seconds / 3600.0,
        "prefix_cache_hit_rate": prefix_hits / prefix_queries if prefix_queries else None,
        "prefix_cache_hit_tokens": prefix_hits,
        "prefix_cache_query_tokens": prefix_queries,
        "served_per_replica": {r.name: r.served for r in fleet},
        "picks": dict(router.picks),
        "virtual_seconds": end,
        "gpu_busy_share": sum(r.executor.busy_seconds for r in fleet) / max(replica_seconds, 1e-9),
        "preemptions": sum(r.collector.preemptions for r in fleet),
        "kv_blocks_leaked": sum(r.executor.num_kv_blocks - r.engine.snapshot().kv_blocks_free for r in fleet),
        "held_peak": held_peak,
        "arrived_without_replica": len(without_replica),
    }
    run = RunResult(name=name, records=records, duration_s=max(end - first, 1e-9), slos=slos,
                    token_bins=dict(bins.bins), extra=extra, description=traffic.description)
    return FleetResult(run=run, replica_seconds=replica_seconds, replica_timeline=timeline,
                       decisions=decisions, prefix_queries=prefix_queries, prefix_hits=prefix_hits,
                       picks=dict(router.picks))


# --------------------------------------------------------------------------- the experiments


def fleet_config(prefix_caching: bool = True) -> RuntimeConfig:
    """The production example config (scenarios.PRODUCTION_CONFIG) with prefix caching on,
    since the fleet traffic carries shared system prompts."""
    from tokenlane.bench.scenarios import production_config

    return production_config(engine={"enablePrefixCaching": prefix_caching})


@dataclass(frozen=True)
class FleetExperiment:
    """A named fleet run (`tokenlane bench fleet --scenario NAME`): its traffic and the
    settings the CLI uses unless flags override them."""

    name: str
    title: str
    traffic: Traffic
    system_prompts: SystemPrompts
    replicas: int
    policies: tuple[str, ...]
    autoscale: bool = False
    min_replicas: int = 1
    max_replicas: int = 6
    fixed_sizes: tuple[int, ...] = ()
    # HPA's default scale-down window (300 s) is sized for fleets that live for hours; a
    # scenario scales it to its own length (SCALE_DOWN_SHARE of the run), so that the
    # replicas a burst added can leave before the run ends, as they would in production.
    scale_down_stabilization_s: float = 300.0


def routing_experiment(time_scale: float = 12.0, duration_s: float = 60.0, seed: int = 0,
                       system_prompts: int = 512, system_prompt_tokens: int = 2048) -> FleetExperiment:
    """The Azure conversation trace sped up for 4 replicas, each request behind one of
    `system_prompts` shared system prompts: round-robin against the router's policy."""
    from tokenlane.bench.scenarios import conversation_traffic

    traffic = conversation_traffic(time_scale, duration_s, seed)
    prompts = SystemPrompts(count=system_prompts, tokens=system_prompt_tokens, seed=seed)
    return FleetExperiment(
        name="routing",
        title=(f"4 simulated H200 replicas: Azure conversation trace x{time_scale:g}, "
               f"{system_prompts} system prompts of {system_prompt_tokens} tokens"),
        traffic=traffic, system_prompts=prompts, replicas=4, policies=POLICIES)


def burst_traffic(time_scale: float, duration_s: float, burst_start_s: float, burst_duration_s: float,
                  factor: float = 5.0, seed: int = 0) -> Traffic:
    """The conversation trace at `time_scale` for `duration_s`, and during the burst window
    another stretch of the trace (from its second half) at (factor - 1) x that speed on top,
    so the arrival rate is `factor` x the base rate during the burst."""
    from tokenlane.bench.scenarios import conversation_traffic
    from tokenlane.bench.trace import merge

    if not factor > 1:
        raise ValueError(f"burst factor must be > 1, got {factor!r}")
    if not 0 <= burst_start_s < duration_s:
        raise ValueError(f"burst start must be in [0, {duration_s:g}) s, got {burst_start_s!r}")
    base = conversation_traffic(time_scale, duration_s, seed)
    burst_duration_s = min(burst_duration_s, duration_s - burst_start_s)
    # Match the base's rate over the burst window: the extra traffic's mean rate is
    # (factor - 1) x the base's mean rate.
    base_rate = len(base.requests) / duration_s
    extra = build_requests_at_rate(base_rate * (factor - 1), burst_duration_s, seed)
    shifted = dataclasses.replace(extra, requests=[dataclasses.replace(r, arrival_s=r.arrival_s + burst_start_s)
                                                   for r in extra.requests])
    merged = merge(base, shifted)
    merged.description = (f"{factor:g}x burst at [{burst_start_s:g}, {burst_start_s + burst_duration_s:g}) s: "
                          + merged.description)
    return merged


def build_requests_at_rate(rate_rps: float, duration_s: float, seed: int) -> Traffic:
    """A stretch of the trace's second half, sped up to `rate_rps` on average."""
    from tokenlane.bench.trace import LaneMix, TrafficSpec, build_requests

    return build_requests(TrafficSpec(source="trace", seed=seed + 1, duration_s=duration_s,
                                      target_rate_rps=rate_rps, trace_start_s=1800.0,
                                      lanes=[LaneMix(lane=None)], tenants=["default"]))


SCALE_DOWN_SHARE = 1 / 6  # a scenario's scale-down window: 300 s for a 30-minute run


def burst_experiment(time_scale: float = 1.25, duration_s: float = 300.0, seed: int = 0) -> FleetExperiment:
    """The conversation trace at `time_scale` with a 5x step burst over its middle half: the
    autoscaler against every fixed fleet size. The step comes faster than a start-up: the
    fleet carries it for one start-up delay with what it has, so the autoscaler keeps
    `minReplicas: 2` standing (one replica carries the base rate, not the step; benchmarks.md,
    section 5)."""
    start, length = duration_s / 4, duration_s / 2
    traffic = burst_traffic(time_scale, duration_s, start, length, 5.0, seed)
    return FleetExperiment(
        name="burst",
        title=f"Azure conversation trace x{time_scale:g} with a 5x burst at [{start:g}, {start + length:g}) s",
        traffic=traffic, system_prompts=SystemPrompts(), replicas=2, policies=(ROUTER,),
        autoscale=True, min_replicas=2, max_replicas=6, fixed_sizes=(1, 2, 3, 4),
        scale_down_stabilization_s=duration_s * SCALE_DOWN_SHARE)


def ramp_traffic(time_scale: float, duration_s: float, burst_start_s: float, ramp_s: float, hold_s: float,
                 factor: float = 5.0, seed: int = 0, step_s: float = 30.0) -> Traffic:
    """The conversation trace at `time_scale` for `duration_s`, plus extra traffic that ramps
    the rate linearly from 1x to `factor` x over `ramp_s` (in `step_s` steps), holds it for
    `hold_s` and ramps back down over `ramp_s`: a daily peak compressed, not a step."""
    from tokenlane.bench.scenarios import conversation_traffic
    from tokenlane.bench.trace import merge

    if not factor > 1:
        raise ValueError(f"burst factor must be > 1, got {factor!r}")
    if not (ramp_s > 0 and hold_s >= 0 and step_s > 0):
        raise ValueError(f"ramp must be > 0 s, hold >= 0 s and step > 0 s, got {ramp_s!r}, {hold_s!r}, {step_s!r}")
    end = burst_start_s + 2 * ramp_s + hold_s
    if not (0 <= burst_start_s and end <= duration_s):
        raise ValueError(f"the burst [{burst_start_s:g}, {end:g}) s must fit in the run's {duration_s:g} s")
    base = conversation_traffic(time_scale, duration_s, seed)
    base_rate = len(base.requests) / duration_s
    pieces = [base]
    t = burst_start_s
    i = 0
    while t < end - 1e-9:
        length = min(step_s, end - t)
        mid = t + length / 2 - burst_start_s
        share = min(1.0, mid / ramp_s, (2 * ramp_s + hold_s - mid) / ramp_s)  # 0 -> 1 -> 0
        extra = build_requests_at_rate(base_rate * (factor - 1) * share, length, seed + 100 * i)
        pieces.append(dataclasses.replace(extra, requests=[dataclasses.replace(r, arrival_s=r.arrival_s + t)
                                                           for r in extra.requests]))
        t += length
        i += 1
    merged = merge(*pieces)
    merged.description = (f"{factor:g}x burst ramping up over [{burst_start_s:g}, {burst_start_s + ramp_s:g}) s, "
                          f"held to {end - ramp_s:g} s, down by {end:g} s: {base.description}")
    return merged


def ramp_experiment(time_scale: float = 1.25, duration_s: float = 1200.0, seed: int = 0) -> FleetExperiment:
    """A burst long against the start-up: over a 20-minute run (at the default duration),
    the rate ramps to 5x over 2 minutes from 5m20s, holds for 6m40s and ramps back down
    over 2 minutes (the shape scales with `duration_s`). The autoscaler against every
    fixed fleet size."""
    scale = duration_s / 1200.0
    start, ramp, hold = 320.0 * scale, 120.0 * scale, 400.0 * scale
    traffic = ramp_traffic(time_scale, duration_s, start, ramp, hold, 5.0, seed)
    return FleetExperiment(
        name="ramp",
        title=(f"Azure conversation trace x{time_scale:g}, 5x burst: ramp {ramp:g} s from {start:g} s, "
               f"hold {hold:g} s, ramp down {ramp:g} s"),
        traffic=traffic, system_prompts=SystemPrompts(), replicas=1, policies=(ROUTER,),
        autoscale=True, min_replicas=1, max_replicas=6, fixed_sizes=(1, 2, 3),
        scale_down_stabilization_s=duration_s * SCALE_DOWN_SHARE)


FLEET_EXPERIMENTS = {"routing": routing_experiment, "burst": burst_experiment, "ramp": ramp_experiment}


# --------------------------------------------------------------------------- scale to zero

HOURS_PER_DAY = 24
DEFAULT_COLD_START_S = DEFAULT_STARTUP_DELAY_S  # an 8B model: pod scheduled -> weights loaded -> /ready


def idle_day_traffic(hour_s: float, idle_hours: int, rate_rps: float, seed: int = 0) -> tuple[Traffic, float, float]:
    """A day of `HOURS_PER_DAY` hours of `hour_s` virtual seconds each: traffic at `rate_rps`
    (a stretch of the conversation trace) except for `idle_hours` in the middle, which have no
    request at all. Returns the traffic and the idle span [start, end) in seconds."""
    from tokenlane.bench.trace import merge

    if not 0 < idle_hours < HOURS_PER_DAY:
        raise ValueError(f"idle hours must be in (0, {HOURS_PER_DAY}), got {idle_hours!r}")
    if not (hour_s > 0 and rate_rps > 0):
        raise ValueError(f"hour_s and rate_rps must be > 0, got {hour_s!r}, {rate_rps!r}")
    busy_before = (HOURS_PER_DAY - idle_hours) // 2
    idle_start, idle_end = busy_before * hour_s, (busy_before + idle_hours) * hour_s
    pieces = []
    for i, (start, end) in enumerate(((0.0, idle_start), (idle_end, HOURS_PER_DAY * hour_s))):
        part = build_requests_at_rate(rate_rps, end - start, seed + 50 * i)
        pieces.append(dataclasses.replace(part, requests=[dataclasses.replace(r, arrival_s=r.arrival_s + start)
                                                          for r in part.requests if r.arrival_s < end - start]))
    merged = merge(*pieces)
    merged.description = (f"{HOURS_PER_DAY} h of {hour_s:g} s, idle h {busy_before}-{busy_before + idle_hours}, "
                          f"{rate_rps:g} req/s otherwise")
    return merged, idle_start, idle_end


@dataclass(frozen=True)
class ScaleToZeroRun:
    """One fleet over the idle day: its replica-hours (in the day's hours) and the first
    request after the idle hours."""

    name: str
    min_replicas: int
    result: FleetResult
    replica_day_hours: float
    first_after_idle_ttft_s: Optional[float]
    first_after_idle_outcome: str
    refused: int

    def row(self) -> dict[str, Any]:
        return {"fleet": self.name, "minReplicas": self.min_replicas, "replica_hours": self.replica_day_hours,
                "first_after_idle_ttft_s": self.first_after_idle_ttft_s,
                "first_after_idle_outcome": self.first_after_idle_outcome, "refused": self.refused,
                "requests": len(self.result.run.records),
                "scale_events": sum(1 for d in self.result.decisions if d["desired"] != d["current"])}


def scale_to_zero_experiment(hour_s: float = 120.0, idle_hours: int = 8, rate_rps: float = 1.0,
                             cold_start_s: float = DEFAULT_COLD_START_S,
                             scale_to_zero_after_h: float = 0.25, max_replicas: int = 3, seed: int = 0,
                             config: Optional[RuntimeConfig] = None) -> list[ScaleToZeroRun]:
    """`minReplicas: 1` against `minReplicas: 0` with `scaleToZeroAfter` (in the day's hours:
    15 min by default) over `idle_day_traffic`, both autoscaled by the same policy otherwise.
    A new replica is ready `cold_start_s` after it was added (virtual seconds, not scaled with
    the hour: what the first request after idle waits for)."""
    config = config or fleet_config()
    traffic, idle_start, idle_end = idle_day_traffic(hour_s, idle_hours, rate_rps, seed)
    runs = []
    for name, low in (("minReplicas 1", 1), ("minReplicas 0", 0)):
        policy = dataclasses.replace(default_scaling_policy(config, low, max_replicas),
                                     scale_to_zero_after_s=scale_to_zero_after_h * hour_s)
        settings = AutoscaleSettings(policy, startup_delay_s=cold_start_s)
        result = simulate_fleet(config, traffic, name=name, replicas=1, policy=ROUTER, autoscale=settings)
        after = [r for r in result.run.records if r.arrival_s >= idle_end]
        first = min(after, key=lambda r: r.arrival_s) if after else None
        runs.append(ScaleToZeroRun(
            name=name, min_replicas=low, result=result, replica_day_hours=result.replica_seconds / hour_s,
            first_after_idle_ttft_s=None if first is None else (first.ttft_s if first.ttft_s is not None
                                                                else first.e2e_s),
            first_after_idle_outcome="none" if first is None else first.outcome,
            refused=sum(1 for r in result.run.records if r.outcome == REJECTED)))
    return runs


def format_scale_to_zero(runs: list[ScaleToZeroRun]) -> str:
    lines = [f"{'fleet':<14} {'replica-hours':>13} {'first TTFT after idle':>22} {'refused':>8} {'requests':>9}"]
    for run in runs:
        ttft = "-" if run.first_after_idle_ttft_s is None else f"{run.first_after_idle_ttft_s:.2f} s"
        lines.append(f"{run.name:<14} {run.replica_day_hours:>13.2f} {ttft:>22} {run.refused:>8} "
                     f"{len(run.result.run.records):>9}")
    base, zero = runs[0], runs[1]
    lines.append(f"scale to zero / minReplicas 1: replica-hours x{zero.replica_day_hours / base.replica_day_hours:.3f}")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    """`python -m tokenlane.bench.fleet_sim`: the scale-to-zero comparison; prints the table
    and writes JSON (docs/benchmarks.md, "Scale from zero")."""
    import argparse
    import json
    import time
    from pathlib import Path

    p = argparse.ArgumentParser(prog="python -m tokenlane.bench.fleet_sim",
                                description="Scale to zero against minReplicas 1 over a day with idle hours.")
    p.add_argument("--hour-s", type=float, default=120.0, help="virtual seconds per hour of the day (default 120)")
    p.add_argument("--idle-hours", type=int, default=8, help="hours without any request (default 8)")
    p.add_argument("--rate", type=float, default=1.0, help="requests per second in the busy hours (default 1)")
    p.add_argument("--cold-start-s", type=float, default=DEFAULT_COLD_START_S,
                   help=f"added replica -> ready, seconds (default {DEFAULT_COLD_START_S:g})")
    p.add_argument("--scale-to-zero-after-h", type=float, default=0.25,
                   help="scaleToZeroAfter in hours of the day (default 0.25 = 15 min)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="out/fleet-scale-to-zero.json", help="JSON output path")
    args = p.parse_args(argv)
    started = time.perf_counter()
    runs = scale_to_zero_experiment(args.hour_s, args.idle_hours, args.rate, args.cold_start_s,
                                    args.scale_to_zero_after_h, seed=args.seed)
    wall = time.perf_counter() - started
    print(format_scale_to_zero(runs))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "wall_seconds": wall, "runs": [r.row() for r in runs],
                               "replica_hours_ratio": runs[1].replica_day_hours / runs[0].replica_day_hours},
                              indent=2))
    print(f"wrote {out} ({wall:.1f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
