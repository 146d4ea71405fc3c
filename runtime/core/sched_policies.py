"""The scheduler's policies, each a small object with one rule (scheduler.py applies them in
its one loop; tests/runtime/test_sched_policies.py holds a property test for each):

- `LaneOrder`: which lane starts next (priority, then weighted fair share, with the
  starvation guard) and the lanes' fair-share clocks;
- `StepTimePolicy`: `stepTimeBudget: auto`, the per-step time cap (step_cost.py) and how it
  shortens prefill chunks and lets loose decodes sit out a step;
- `StaticBatch`: static batching (`continuousBatching: false`): the batch of waiting
  requests picked when the previous one has completely finished;
- `LaneBatches`: per-lane static batching (lane key `continuousBatching: false`): which
  waiting requests join a lane's batch;
- `ParallelSampling`: whether a sequence group (n > 1) may start: room for all its sequences
  (as much of it as its lane can ever hold);
- `AdapterSlots`: multi-LoRA's `engine.maxLoras`: at most that many distinct adapters among
  the running requests (so in any one step), and no waiting adapter starves (its property
  test is in tests/runtime/test_lora_engine.py).

Pure Python: they read and update `Lane` objects (lanes.py) and plain numbers.
"""

from __future__ import annotations

import itertools
from collections import deque
from typing import Callable, Iterable, Optional

from tokenlane.runtime.core.lanes import Lane
from tokenlane.runtime.core.request import Request, RequestStatus
from tokenlane.runtime.core.step_cost import StepCostModel, StepTimeBudget

# stepTimeBudget: the step's cap is this share of the tightest TPOT target of the running
# lanes (headroom for the cost model's error); a prefill chunk the cap shortens keeps at least
# CAPPED_PREFILL_FLOOR tokens when it is the step's first, so prefills always progress.
STEP_BUDGET_SHARE = 0.85
CAPPED_PREFILL_FLOOR = 32
# A lane without a TPOT target lets its decodes wait at most this long for the cap.
UNTARGETED_DECODE_WAIT_S = 1.0
# While a higher-priority lane has prefill work, a lower-priority lane's prefill chunk adds at
# most this share of the cap to the step (the higher-priority prompts' steps stay short), but
# keeps CAPPED_PREFILL_FLOOR tokens (so it never starves).
YIELDING_PREFILL_SHARE = 0.0


class LaneOrder:
    """Lanes start work by priority, then by weighted fair share (the lane with the smallest
    `tokens served / weight`, its `vtime`, first); a lane that had startable work but got
    nothing for `starvation_steps` rounds in a row goes first once, so no lane starves."""

    def __init__(self, starvation_steps: int) -> None:
        self.starvation_steps = starvation_steps

    def key(self, lane: Lane) -> tuple:
        return (lane.starved_steps < self.starvation_steps, -lane.config.priority, lane.vtime)

    def first(self, lanes: Iterable[Lane]) -> Lane:
        """The lane served next among `lanes` (not empty)."""
        return min(lanes, key=self.key)

    @staticmethod
    def charge(lane: Lane, tokens: int) -> None:
        """Count tokens served to the lane (its fair-share clock and its lifetime total)."""
        lane.vtime += tokens / lane.config.weight
        lane.served_tokens += tokens

    @staticmethod
    def started(lane: Lane) -> None:
        lane.starved_steps = 0

    @staticmethod
    def passed_over(lane: Lane) -> None:
        """The lane had startable work but others started and it did not."""
        lane.starved_steps += 1

    @staticmethod
    def catch_up_idle(lanes: Iterable[Lane]) -> None:
        """An idle lane must not bank credit: when it gets work again it starts level with
        the least-served active lane's clock, not far behind it (standard WFQ)."""
        lanes = list(lanes)
        active = [lane.vtime for lane in lanes if lane.num_waiting or lane.num_running]
        if active:
            floor = min(active)
            for lane in lanes:
                if not (lane.num_waiting or lane.num_running) and lane.vtime < floor:
                    lane.vtime = floor


class StepTimePolicy:
    """`stepTimeBudget: auto` (docs/tuning.md, "Lane isolation"): each step is capped at a
    share of the tightest TPOT target of the lanes with running requests. Looser lanes'
    prefill chunks shrink to fit (the step's first prefill keeps a floor), lower-priority
    prefills yield to higher-priority ones, and looser lanes' decodes may skip a step within
    their own target. `begin_step` starts each step's `StepTimeBudget` (step_cost.py)."""

    def __init__(self, model: StepCostModel) -> None:
        self.model = model
        self.budget = StepTimeBudget(model, None)
        self.step_index = 0  # steps begun so far, less one (the current step's index)

    def cap_s(self, lanes: Iterable[Lane]) -> Optional[float]:
        """A share of the tightest TPOT target among the lanes with running requests; None
        when none of them has a target."""
        targets = [lane.config.slo.tpot_p95_ms for lane in lanes if lane.num_running and lane.config.slo.tpot_p95_ms]
        return min(targets) / 1000.0 * STEP_BUDGET_SHARE if targets else None

    def begin_step(self, enabled: bool, lanes: Iterable[Lane]) -> StepTimeBudget:
        self.budget = StepTimeBudget(self.model, self.cap_s(lanes) if enabled else None)
        return self.budget

    def end_step(self) -> None:
        self.step_index += 1

    def note_capped(self, lane: Lane) -> None:
        """The cap shortened or skipped the lane's work in this step (counted once a step)."""
        lane.time_capped_steps += lane.last_capped_step != self.step_index
        lane.last_capped_step = self.step_index

    def may_skip_decode(self, request: Request, lane: Lane, now: float) -> bool:
        """Whether the request's decode may sit out this step: only a decode that does not fit
        the cap, of a lane with a looser TPOT target than the cap, whose next token still comes
        within its own target one more step later."""
        budget = self.budget
        cap = budget.cap_s
        if cap is None or budget.fits(request.num_computed_tokens, 1):
            return False
        target = lane.config.slo.tpot_p95_ms
        allowed = UNTARGETED_DECODE_WAIT_S if not target else target / 1000.0 * STEP_BUDGET_SHARE
        if allowed <= cap or not request.token_times:
            return False
        return now - request.token_times[-1] + 2 * cap <= allowed

    def chunk(self, lane: Lane, start: int, n: int, *, starting: bool = False, starved: bool = False) -> int:
        """`n`, shortened so the step stays within its time cap (the step's first prefill
        keeps CAPPED_PREFILL_FLOOR tokens). Chunks of the lanes whose TPOT target sets the
        cap are never shortened: their time to first token is theirs to keep too. A lane
        yielding to a higher-priority lane's prefills gets the floor for one running prefill
        per step, and starts nothing unless it is `starved` (the lane order's guard lets it go
        first)."""
        budget = self.budget
        if not budget.active or n <= 0:
            return n
        budget.prefill_priority = max(budget.prefill_priority, lane.config.priority)
        target = lane.config.slo.tpot_p95_ms
        if target and target / 1000.0 * STEP_BUDGET_SHARE <= budget.cap_s * (1 + 1e-9):
            budget.add_pending_prefill()
            return n
        yielding = lane.config.priority < budget.prefill_priority
        if yielding:
            floored = lane.name in budget.floored_lanes or (starting and not starved)
            floor = 0 if floored else CAPPED_PREFILL_FLOOR
        else:
            floor = 0 if budget.has_prefill else CAPPED_PREFILL_FLOOR
        share = YIELDING_PREFILL_SHARE if yielding else 1.0
        fitted = budget.largest_chunk(start, n, floor, share)
        if yielding and fitted:
            budget.floored_lanes.add(lane.name)
        budget.denied_lane = None if fitted else lane.name
        if fitted < n:
            self.note_capped(lane)
        return fitted

    @staticmethod
    def prefill_priority(
        lanes: Iterable[Lane], running_prefill_lanes: Iterable[Lane], batch_closed: Callable[[Lane], bool]
    ) -> int:
        """The highest priority among lanes with prefill work this step: running prefills,
        or waiting requests that may start (-1: none)."""
        top = max((lane.config.priority for lane in running_prefill_lanes), default=-1)
        for lane in lanes:
            if (
                lane.num_waiting
                and lane.config.priority > top
                and lane.num_running < lane.budgets.max_active_sequences
                and not batch_closed(lane)
            ):
                top = lane.config.priority
        return top


class StaticBatch:
    """`continuousBatching: false`: a batch of up to maxActiveSequences waiting requests is
    picked (lanes in `LaneOrder`, each lane up to its own maxActiveSequences) when the previous
    batch has completely finished, and no other request starts until every member of the batch
    has finished. A parallel-sampling group joins whole (its followers are members too)."""

    def __init__(self) -> None:
        self.members: set[str] = set()  # request ids of the current batch
        self.waiting: deque[Request] = deque()  # members not started yet (preempted ones first)
        # Per-lane count of `waiting`, readable from other threads without iterating.
        self.waiting_per_lane: dict[str, int] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.members

    def form(self, lanes: Iterable[Lane], order: LaneOrder, max_active: int) -> None:
        """Take the next batch from the lanes' queues (none while a batch has members)."""
        if self.members:
            return
        lanes = list(lanes)
        taken: dict[str, int] = {}
        candidates = [lane for lane in lanes if lane.num_waiting]
        while candidates and len(self.members) < max_active:
            lane = order.first(candidates)
            group = lane.peek().group
            followers = [f for f in group.members[1:] if not f.is_finished] if group and not group.forked else []
            if followers and self.members and len(self.members) + 1 + len(followers) > max_active:
                break
            request = lane.pop()
            self.members.add(request.request_id)
            self.members.update(f.request_id for f in followers)
            self.waiting.append(request)
            self._count(request.lane, 1)
            taken[lane.name] = taken.get(lane.name, 0) + 1 + len(followers)
            lane.vtime += request.num_tokens / lane.config.weight
            order.started(lane)
            if not lane.num_waiting or taken[lane.name] >= lane.budgets.max_active_sequences:
                candidates.remove(lane)
        for lane in lanes:  # left out of this batch while others got in
            if lane.num_waiting and lane.name not in taken and taken:
                order.passed_over(lane)

    def next_waiting(self) -> Optional[Request]:
        return self.waiting[0] if self.waiting else None

    def started(self, request: Request) -> None:
        """The head of `waiting` started running."""
        assert self.waiting[0] is request
        self.waiting.popleft()
        self._count(request.lane, -1)

    def requeue(self, request: Request) -> None:
        """A preempted member restarts first."""
        self.waiting.appendleft(request)
        self._count(request.lane, 1)

    def join(self, request: Request) -> None:
        """A member's unforked follower starts with it."""
        self.members.add(request.request_id)

    def leave(self, request: Request, *, was_waiting: bool) -> None:
        """A request finished; a member leaves the batch (and `waiting`, if it had not started)."""
        if request.request_id not in self.members:
            return
        self.members.discard(request.request_id)
        if was_waiting:
            try:
                self.waiting.remove(request)
                self._count(request.lane, -1)
            except ValueError:
                pass  # a follower, never queued on its own

    def recount(self) -> None:
        """After a reload moved requests between lanes."""
        counts: dict[str, int] = {}
        for request in self.waiting:
            counts[request.lane] = counts.get(request.lane, 0) + 1
        self.waiting_per_lane = counts

    def _count(self, lane_name: str, delta: int) -> None:
        counts = self.waiting_per_lane
        counts[lane_name] = counts.get(lane_name, 0) + delta

    def check_invariants(self, lane_names: Iterable[str]) -> None:
        for name in lane_names:
            n = sum(1 for r in self.waiting if r.lane == name)
            assert self.waiting_per_lane.get(name, 0) == n, name
        assert all(r.request_id in self.members for r in self.waiting)


class LaneBatches:
    """Per-lane static batching (lane key `continuousBatching: false`): when a static lane's
    running set has drained, the requests then waiting (up to the lane's maxActiveSequences)
    form its next batch; its later arrivals wait for the batch after. A preempted member gives
    its start back (it restarts within the batch)."""

    def __init__(self) -> None:
        # lane -> [arrival number the batch opened at, starts left]
        self._open: dict[str, list[int]] = {}
        self._arrival: dict[str, int] = {}  # request_id -> its arrival number (static lanes)
        self._numbers = itertools.count()

    def arrived(self, request: Request) -> None:
        self._arrival[request.request_id] = next(self._numbers)

    def forget(self, request: Request) -> None:
        """The request started, finished or left the lane's queue for good."""
        self._arrival.pop(request.request_id, None)

    def keep_lanes(self, static_lanes: set[str]) -> None:
        """After a reload: drop the batches of lanes no longer static (or gone)."""
        self._open = {name: batch for name, batch in self._open.items() if name in static_lanes}

    def joins(self, lane: Lane, request: Request) -> bool:
        """Whether the head of a static lane may start now: it joins the lane's open batch
        (queued before the batch opened, with starts left). A batch opens once the lane's
        running set has drained."""
        batch = self._open.get(lane.name)
        arrival = self._arrival.get(request.request_id, -1)  # unknown: older than any batch
        if lane.num_running == 0 and (batch is None or batch[1] <= 0 or arrival >= batch[0]):
            batch = [next(self._numbers), min(lane.num_waiting, lane.budgets.max_active_sequences)]
            self._open[lane.name] = batch
        return batch is not None and batch[1] > 0 and arrival < batch[0]

    def started(self, lane: Lane, request: Request) -> None:
        self._open[lane.name][1] -= 1
        self.forget(request)

    def gave_back(self, lane: Lane) -> None:
        """A member of the lane's batch was preempted: its start is owed again."""
        batch = self._open.get(lane.name)
        if batch is not None:
            batch[1] += 1

    def closed(self, lane: Lane) -> bool:
        """A static lane whose running batch takes no more requests (its queue waits)."""
        if lane.config.continuous_batching or not lane.num_running:
            return False
        batch = self._open.get(lane.name)
        return batch is None or batch[1] <= 0


class ParallelSampling:
    """A sequence group (n > 1) starts with its leader; its followers count as running from
    then on (so maxActiveSequences and the lanes' caps count every sequence) but hold no block
    until the fork (SequenceGroup in request.py)."""

    @staticmethod
    def sequences_fit(group_size: int, num_running: int, max_active: int) -> bool:
        """Room for all the group's sequences under a cap on running sequences, unless nothing
        runs (so a group larger than the cap still progresses)."""
        return not num_running or num_running + group_size <= max_active

    @staticmethod
    def blocks_to_start(leader_blocks: int, group_size: int, capacity: Optional[int] = None) -> int:
        """Free blocks a leader needs to start: its own first chunk's, and one per follower
        (each one's copy of the shared partial block at the fork); at most the lane's
        `capacity` (the most it can ever hold), else the group would never start: a group
        larger than its lane starts once the lane has room for all it can hold, and the
        followers its cap cannot take at the fork give way (they compute their prompts later)."""
        need = leader_blocks + group_size - 1
        return need if capacity is None else min(need, max(leader_blocks, capacity))

    def group_fits(
        self,
        group_size: int,
        leader_blocks: int,
        *,
        num_running: int,
        max_active: int,
        lane_running: int,
        lane_max_active: int,
        fits_blocks: Callable[[int], bool],
        capacity: Optional[int] = None,
    ) -> bool:
        """Whether a leader may start now: its sequences fit the step-wide and the lane's caps
        on running sequences, and its blocks fit (`fits_blocks`, the lane's room; `capacity`,
        the most blocks the lane can ever hold)."""
        return (
            self.sequences_fit(group_size, num_running, max_active)
            and self.sequences_fit(group_size, lane_running, lane_max_active)
            and fits_blocks(self.blocks_to_start(leader_blocks, group_size, capacity))
        )


class AdapterSlots:
    """At most `max_loras` distinct LoRA adapters among the running requests, hence in any one
    step (the base model, adapter None, takes no slot). A waiting request whose adapter is
    already running may start; one whose adapter is new starts while a slot is free.

    No starvation: when a request finds every slot taken, it becomes the slot's claimant and
    the running adapter with the fewest running requests drains (none of its requests start
    until the claimant has); the slot it frees goes to the claimant, which no other new
    adapter takes meanwhile. Inside a lane the queue stays FIFO (the scheduler stops the lane
    at a head that may not start, as for memory)."""

    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self.claimant: Optional[Request] = None  # waits for the next free slot
        self.draining: Optional[str] = None  # adapter that starts nothing until the claimant has
        self._running: Iterable[Request] = ()
        self._active: Optional[dict[str, int]] = None  # adapter -> running requests, counted on demand

    def begin(self, running: Iterable[Request]) -> None:
        """A new admission round over `running`. The adapters are counted only once a request
        with an adapter asks or a drain is under way: a round of base-model requests pays nothing."""
        self._running, self._active = running, None
        claimant = self.claimant
        if claimant is not None and claimant.status is not RequestStatus.WAITING \
                and claimant.status is not RequestStatus.PREEMPTED:
            self._release()  # it started, or ended while waiting
        if self.draining is not None and self.draining not in self.active:
            self.draining = None  # drained: its slot is free for the claimant

    @property
    def active(self) -> dict[str, int]:
        """Running requests per adapter: those running at `begin`, plus the starts since."""
        if self._active is None:
            active: dict[str, int] = {}
            for request in self._running:
                adapter = request.adapter
                if adapter is not None and request.status is RequestStatus.RUNNING:
                    active[adapter] = active.get(adapter, 0) + 1
            self._active = active
        return self._active

    def may_start(self, request: Request) -> bool:
        adapter = request.adapter
        if adapter is None:
            return True
        active = self.active
        if adapter in active:
            return adapter != self.draining
        free = self.max_loras - len(active)
        claimant = self.claimant
        if claimant is None or claimant is request:
            if free > 0:
                return True
            if claimant is None:
                self.claimant = request
                self.draining = min(active, key=lambda name: (active[name], name))
            return False
        return free > 1  # the next free slot is the claimant's

    def started(self, request: Request) -> None:
        adapter = request.adapter
        if adapter is None:
            return
        self.active[adapter] = self.active.get(adapter, 0) + 1
        if request is self.claimant:
            self._release()

    def _release(self) -> None:
        self.claimant = None
        self.draining = None
