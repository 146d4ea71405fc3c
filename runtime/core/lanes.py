"""One queue per lane, and the lane's share-keeping state for the scheduler.

Inside a lane, requests preempted by recompute go back to the head (they were admitted once
and may already have streamed tokens). New requests are shared among tenants by weighted fair
share: the tenant furthest behind (smallest `tokens served / weight`, its virtual token
counter) starts next, and inside a tenant earliest deadline first, then request priority,
then arrival. A tenant is charged its prompt tokens when its request starts and its output
tokens as they are produced (`charge_tenant`, called by the engine); a tenant that comes back
after an idle spell starts from the smallest counter of the tenants still waiting, so idle
time banks no credit. With one tenant the order is exactly deadline, priority, arrival.
Between lanes, the scheduler serves higher lane
priority first and, among equal priorities, the lane furthest behind its weighted fair share
(`vtime` = tokens served / weight, the classic virtual-time of weighted fair queueing).

Heaps with lazy deletion keep every operation O(log n): cancelling or timing out a waiting
request only forgets its entry; stale entries are skipped when they reach the top.
"""

from __future__ import annotations

import heapq
import itertools
import math
from typing import Optional

from tokenlane.runtime.config import LaneBudgets, LaneConfig
from tokenlane.runtime.core.request import Request

_seq = itertools.count()


class Lane:
    """A lane's waiting queue plus what the scheduler tracks per lane."""

    def __init__(self, config: LaneConfig, budgets: LaneBudgets) -> None:
        self.config = config
        self.budgets = budgets
        # Preempted requests, served before any new one: (deadline, -priority, arrival, seq, request)
        self._resumed: list[tuple] = []
        # tenant -> its new requests: (deadline, -priority, arrival, seq, request)
        self._tenant_queues: dict[str, list[tuple]] = {}
        self._tenant_waiting: dict[str, int] = {}  # tenant -> live entries in its queue
        self.tenant_vtime: dict[str, float] = {}  # tenant -> tokens charged / weight
        self.tenant_weights: dict[str, float] = {}  # configured weights; others weigh 1
        # (arrival, seq, request) of requests never scheduled: queue-timeout order.
        self._arrivals: list[tuple] = []
        self._live: dict[str, int] = {}  # request_id -> seq of its live queue entry
        self.num_running = 0  # this lane's requests in the running set
        self.vtime = 0.0  # tokens served / weight (fair-share clock)
        self.starved_steps = 0  # consecutive steps with waiting work but nothing started
        self.served_tokens = 0  # lifetime tokens scheduled for this lane
        self.tokens_left = budgets.max_batched_tokens  # per-step budget left (scheduler)
        self.time_capped_steps = 0  # steps that shortened or skipped its work for the step-time budget
        self.last_capped_step = -1  # the scheduler's step index it was last capped in

    # ---- config

    @property
    def name(self) -> str:
        return self.config.name

    def reconfigure(self, config: LaneConfig, budgets: LaneBudgets) -> None:
        self.config = config
        self.budgets = budgets

    # ---- queue

    def __len__(self) -> int:
        return len(self._live)

    @property
    def num_waiting(self) -> int:
        return len(self._live)

    def __contains__(self, request: Request) -> bool:
        return request.request_id in self._live

    def push(self, request: Request) -> None:
        """Queue a new request, or put a preempted one back at the head."""
        assert request.request_id not in self._live, f"{request.request_id} queued twice"
        seq = next(_seq)
        resumed = request.first_scheduled_time is not None
        deadline = math.inf if request.deadline is None else request.deadline
        self._live[request.request_id] = seq
        entry = (deadline, -request.priority, request.arrival_time, seq, request)
        if resumed:
            heapq.heappush(self._resumed, entry)
            return
        tenant = request.tenant
        if not self._tenant_waiting.get(tenant):
            self._lift_returning_tenant(tenant)
        self._tenant_waiting[tenant] = self._tenant_waiting.get(tenant, 0) + 1
        heapq.heappush(self._tenant_queues.setdefault(tenant, []), entry)
        heapq.heappush(self._arrivals, (request.arrival_time, seq, request))

    def peek(self) -> Optional[Request]:
        """The request the lane would start next (None if empty)."""
        entry = self._head_entry()
        return None if entry is None else entry[4]

    def pop(self) -> Request:
        entry = self._head_entry()
        assert entry is not None
        request = entry[4]
        if self._resumed and self._resumed[0] is entry:
            heapq.heappop(self._resumed)
        else:
            heapq.heappop(self._tenant_queues[request.tenant])
            self._tenant_waiting[request.tenant] -= 1
            self.charge_tenant(request.tenant, request.num_prompt_tokens)
        del self._live[request.request_id]
        return request

    # ---- tenant fair share

    def set_tenant_weights(self, weights: dict[str, float]) -> None:
        """Take the tenants' weights (hot reload): counters keep their values."""
        self.tenant_weights = dict(weights)

    def charge_tenant(self, tenant: str, tokens: int) -> None:
        """Count tokens served to the tenant in this lane (prompt at start, output as produced)."""
        weight = self.tenant_weights.get(tenant, 1.0)
        self.tenant_vtime[tenant] = self.tenant_vtime.get(tenant, 0.0) + tokens / weight

    def _lift_returning_tenant(self, tenant: str) -> None:
        # A tenant that was not waiting may not use its idle time to jump the tenants that were.
        waiting = [self.tenant_vtime.get(t, 0.0) for t, n in self._tenant_waiting.items() if n and t != tenant]
        if waiting:
            self.tenant_vtime[tenant] = max(self.tenant_vtime.get(tenant, 0.0), min(waiting))

    def _head_entry(self) -> Optional[tuple]:
        """The entry served next: a resumed request, else the head of the tenant furthest
        behind its fair share (ties: the head's deadline, priority, arrival)."""
        live = self._live
        resumed = self._resumed
        while resumed:
            entry = resumed[0]
            if live.get(entry[4].request_id) == entry[3]:
                return entry
            heapq.heappop(resumed)
        best, best_key = None, None
        for tenant, queue in self._tenant_queues.items():
            if not self._tenant_waiting.get(tenant):
                continue
            while live.get(queue[0][4].request_id) != queue[0][3]:  # stale entries
                heapq.heappop(queue)
            key = (self.tenant_vtime.get(tenant, 0.0), queue[0])
            if best_key is None or key < best_key:
                best, best_key = queue[0], key
        return best

    def remove(self, request: Request) -> bool:
        """Forget a waiting request (cancelled, timed out); True if it was queued here."""
        seq = self._live.pop(request.request_id, None)
        if seq is None:
            return False
        self._forget_waiting(request)
        self._maybe_compact()
        return True

    def pop_expired(self, now: float) -> list[Request]:
        """Never-scheduled requests that waited longer than the lane's queue timeout."""
        timeout_s = self.budgets.queue_timeout_ms / 1000.0
        arrivals, live = self._arrivals, self._live
        expired = []
        while arrivals:
            arrival, seq, request = arrivals[0]
            if live.get(request.request_id) != seq:  # started or removed since
                heapq.heappop(arrivals)
                continue
            if arrival + timeout_s > now:
                break
            heapq.heappop(arrivals)
            del live[request.request_id]
            self._tenant_waiting[request.tenant] -= 1  # only new requests are in `arrivals`
            expired.append(request)
        if expired:
            self._maybe_compact()
        return expired

    def waiting_requests(self) -> list[Request]:
        """Queued requests: resumed ones first, then new ones by deadline, priority and
        arrival (the fair-share pick may interleave tenants otherwise). O(n log n): for
        tests, reloads and shutdown."""
        live = self._live
        fresh = [e for queue in self._tenant_queues.values() for e in queue]
        return [e[4] for part in (self._resumed, fresh) for e in sorted(part, key=lambda e: e[:4])
                if live.get(e[4].request_id) == e[3]]

    def _forget_waiting(self, request: Request) -> None:
        # A new request's entry sits in its tenant's queue (and `arrivals`); a resumed one's not.
        if request.first_scheduled_time is None:
            self._tenant_waiting[request.tenant] -= 1

    def _maybe_compact(self) -> None:
        # Lazy deletion leaves stale entries; rebuild when they outnumber the live ones.
        live = self._live
        stale = len(self._resumed) + sum(len(q) for q in self._tenant_queues.values())
        if stale > 2 * len(live) + 64:
            self._resumed = [e for e in self._resumed if live.get(e[4].request_id) == e[3]]
            heapq.heapify(self._resumed)
            for tenant, queue in list(self._tenant_queues.items()):
                kept = [e for e in queue if live.get(e[4].request_id) == e[3]]
                heapq.heapify(kept)
                self._tenant_queues[tenant] = kept
        if len(self._arrivals) > 2 * len(live) + 64:
            self._arrivals = [e for e in self._arrivals if live.get(e[2].request_id) == e[1]]
            heapq.heapify(self._arrivals)
