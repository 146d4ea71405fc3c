"""One queue per lane, and the lane's share-keeping state for the scheduler.

Inside a lane, waiting requests are served earliest-deadline-first, then by request priority,
then by arrival; requests preempted by recompute go back to the head (they were admitted
once and may already have streamed tokens). Between lanes, the scheduler serves higher lane
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
from tokenlane.runtime.request import Request

_seq = itertools.count()


class Lane:
    """A lane's waiting queue plus what the scheduler tracks per lane."""

    def __init__(self, config: LaneConfig, budgets: LaneBudgets) -> None:
        self.config = config
        self.budgets = budgets
        # (resumed first, deadline, -priority, arrival, seq, request)
        self._queue: list[tuple] = []
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
        heapq.heappush(
            self._queue, (not resumed, deadline, -request.priority, request.arrival_time, seq, request)
        )
        if not resumed:
            heapq.heappush(self._arrivals, (request.arrival_time, seq, request))

    def peek(self) -> Optional[Request]:
        """The request the lane would start next (None if empty)."""
        queue, live = self._queue, self._live
        while queue:
            entry = queue[0]
            if live.get(entry[5].request_id) == entry[4]:
                return entry[5]
            heapq.heappop(queue)
        return None

    def pop(self) -> Request:
        request = self.peek()
        assert request is not None
        heapq.heappop(self._queue)
        del self._live[request.request_id]
        return request

    def remove(self, request: Request) -> bool:
        """Forget a waiting request (cancelled, timed out); True if it was queued here."""
        if self._live.pop(request.request_id, None) is None:
            return False
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
            expired.append(request)
        if expired:
            self._maybe_compact()
        return expired

    def waiting_requests(self) -> list[Request]:
        """Queued requests in service order (O(n log n): for tests, reloads and shutdown)."""
        return [e[5] for e in sorted(self._queue) if self._live.get(e[5].request_id) == e[4]]

    def _maybe_compact(self) -> None:
        # Lazy deletion leaves stale entries; rebuild when they outnumber the live ones.
        if len(self._queue) > 2 * len(self._live) + 64:
            self._queue = [e for e in self._queue if self._live.get(e[5].request_id) == e[4]]
            heapq.heapify(self._queue)
        if len(self._arrivals) > 2 * len(self._live) + 64:
            self._arrivals = [e for e in self._arrivals if self._live.get(e[2].request_id) == e[1]]
            heapq.heapify(self._arrivals)
