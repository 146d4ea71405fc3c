"""The token-budget scheduler: pure Python (no torch), one step at a time.

Every step re-selects the working set from scratch:

1. Requests whose queue timeout or deadline passed are finished (their blocks freed).
2. Running requests get their tokens, in rank order (higher lane priority, then older first):
   decode-first serves every running decode before any prefill chunk; `mixed` serves the
   running set in rank order whatever phase each request is in. A request that needs a new
   KV block and finds none preempts (by recompute) the lowest-ranked running request not yet
   scheduled in this step: lowest lane priority, then newest. The highest-ranked request can
   always progress (admission refuses requests the whole pool cannot hold), so there is no
   livelock.
3. Waiting requests start, chunk by chunk (at most the lane's prefillChunkSize), while the
   step's token budget, maxActiveSequences, the lane's caps and the KV high watermark allow
   (none in a step that had to preempt: memory is short, and a just-evicted request must
   not bounce straight back). A lane's head that does not fit in the free blocks stops
   admission for the step (no skipping ahead of it).
   Lanes are served by priority, then by weighted fair share (the lane with the smallest
   `tokens served / weight` first); a lane that had startable work but got nothing for
   `starvation_steps` steps in a row goes first once, so no lane with work starves.
   Inside a lane: weighted fair share among its tenants (the tenant with the fewest tokens
   served / weight first, runtime/core/lanes.py), then earliest deadline, request priority and
   arrival within a tenant.
   A starting request takes the longest cached prefix of its tokens from the prefix cache,
   except the positions whose logits it needs for prompt logprobs (it computes those).

The result is a `StepPlan`; the executor's `ExecutorOutput` comes back through
`update_from_output`, which appends sampled tokens (and their logprobs, and the prompt
logprobs a chunk scored), applies stop conditions and registers newly full blocks in the
prefix cache.

Lane isolation (docs/tuning.md, "Lane isolation"): with KV shares (maxKvCacheShare,
kvCacheReserved; kv_quotas.py) a lane allocates only within its room, the high watermark is
applied per lane against its own capacity (not at all inside its reserve), and a lane stopped
by its own share does not stop the others' admission. With `stepTimeBudget: auto`
(step_cost.py) each step is capped at a share of the tightest TPOT target of the running lanes:
looser lanes' prefill chunks shrink, lower-priority prefills yield to higher-priority ones, and
looser lanes' decodes may skip a step within their own target.

`continuousBatching: false` (static batching): a batch of up to maxActiveSequences waiting
requests is picked when the previous batch has completely finished, and no other request
starts until every member of the batch has finished. On a lane (lane key
`continuousBatching: false`) the same holds per lane: when the lane's running set has drained,
the requests then waiting (up to the lane's maxActiveSequences) form its next batch, and its
later arrivals wait for the batch after; the other lanes keep continuous batching.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
import time
from collections import deque
from typing import Callable, Optional

from tokenlane.runtime.config import RuntimeConfig
from tokenlane.runtime.core.kv_cache import KVCacheManager
from tokenlane.runtime.core.kv_quotas import LaneKVQuotas
from tokenlane.runtime.core.lanes import Lane
from tokenlane.runtime.core.step_plan import ExecutorOutput, ScheduledChunk, StepPlan
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

RUNNING = RequestStatus.RUNNING
WAITING = RequestStatus.WAITING
PREEMPTED = RequestStatus.PREEMPTED


class Scheduler:
    def __init__(
        self,
        config: RuntimeConfig,
        num_kv_blocks: int,
        block_size: int,
        *,
        max_model_len: Optional[int] = None,
        clock: Callable[[], float] = time.monotonic,
        starvation_steps: int = 32,
    ) -> None:
        self.clock = clock
        self.kv = KVCacheManager(num_kv_blocks, block_size, config.engine.enable_prefix_caching)
        self.block_size = block_size
        self.max_model_len = max_model_len  # finish with LENGTH when prompt + output reach it
        self.static_batching = not config.engine.continuous_batching
        self.starvation_steps = starvation_steps
        self.config = config
        self.lanes: dict[str, Lane] = {}
        self.requests: dict[str, Request] = {}  # every unfinished request, by id
        # Running set in rank order; `_rank` holds the parallel sort keys.
        self.running: list[Request] = []
        self._rank: list[tuple] = []
        self._running_dirty = False  # some entries of `running` left the RUNNING state
        self._rank_of: dict[str, tuple] = {}  # request_id -> its key in `_rank`
        self.num_running = 0
        self._rank_seq = itertools.count()
        self._deadlines: list[tuple] = []  # (deadline, seq, request), lazily cleaned
        # Static batching: the current batch's ids, and its members not yet started.
        self._batch: set[str] = set()
        self._batch_waiting: deque[Request] = deque()
        # Per-lane count of `_batch_waiting`, readable from other threads without iterating.
        self._batch_waiting_per_lane: dict[str, int] = {}
        # Per-lane static batching: lane -> [arrival seq the batch opened at, starts left],
        # and the arrival seq of each queued request of such a lane (unknown = older).
        self._lane_batches: dict[str, list[int]] = {}
        self._static_lane_arrivals: dict[str, int] = {}
        self._arrival_seq = itertools.count()
        # Requests finished since the last plan: the executor drops their state.
        self._finished_for_executor: list[Request] = []
        # Requests finished since the engine last drained them (engine emits final outputs).
        self.newly_finished: list[Request] = []
        self.num_preemptions_total = 0
        # Lane name -> requests started running in the last `schedule()` (for step stats).
        self.last_started: dict[str, int] = {}
        # Lanes' KV shares (maxKvCacheShare, kvCacheReserved); enforced by preemption at the
        # first step after a reload changed them.
        self.quotas = LaneKVQuotas(num_kv_blocks)
        self._quotas_changed = False
        # stepTimeBudget: the cost model, fitted from measured steps, and this step's budget.
        self.step_cost = StepCostModel()
        self._step_budget = StepTimeBudget(self.step_cost, None)
        self.num_time_capped_steps = 0
        self._step_index = 0
        self.apply_config(config)

    # ------------------------------------------------------------------ config

    def apply_config(self, config: RuntimeConfig) -> None:
        """Take new budgets and lanes (hot reload, between steps). Requests of a lane that
        disappeared move to the new default lane; nothing is dropped."""
        self.config = config
        self.sched = config.scheduler
        old = dict(self.lanes)
        lanes: dict[str, Lane] = {}
        for lane_config in config.lanes:
            budgets = config.lane_budgets(lane_config.name)
            lane = old.pop(lane_config.name, None)
            if lane is None:
                lane = Lane(lane_config, budgets)
                clocks = [ln.vtime for ln in self.lanes.values()]
                lane.vtime = min(clocks) if clocks else 0.0
            else:
                lane.reconfigure(lane_config, budgets)
            lanes[lane.name] = lane
        self.lanes = lanes  # one assignment: readers on other threads see old or new, whole
        self._lane_batches = {
            name: batch
            for name, batch in self._lane_batches.items()
            if name in lanes and not lanes[name].config.continuous_batching
        }
        default = lanes[config.default_lane.name]
        for gone in old.values():  # lanes removed by the reload
            for request in gone.waiting_requests():
                gone.remove(request)
                request.lane = default.name
                default.push(request)
        for request in self.requests.values():
            if request.lane not in self.lanes:
                request.lane = default.name
        counts: dict[str, int] = {}
        for request in self._batch_waiting:
            counts[request.lane] = counts.get(request.lane, 0) + 1
        self._batch_waiting_per_lane = counts
        self._rerank()
        quotas = self.quotas
        shares = {name: (lane.budgets.max_kv_cache_share, lane.budgets.kv_cache_reserved) for name, lane in lanes.items()}
        self._quotas_changed = shares != getattr(self, "_kv_shares", None)
        self._kv_shares = shares
        quotas.configure({name: lane.budgets for name, lane in lanes.items()})
        quotas.recount(self.running)  # running requests of a removed lane moved lanes

    # ------------------------------------------------------------------ queries

    # Queries below may run on the event-loop thread while a step runs in the worker thread:
    # they only read counters and replace-only dicts, never iterate a structure in flux.

    @property
    def num_waiting(self) -> int:
        return sum(lane.num_waiting for lane in self.lanes.values()) + len(self._batch_waiting)

    def num_waiting_in(self, lane_name: str) -> int:
        lane = self.lanes.get(lane_name)
        n = lane.num_waiting if lane is not None else 0
        return n + self._batch_waiting_per_lane.get(lane_name, 0)

    def time_capped_last_step(self, lane_name: str) -> bool:
        """Whether the step-time budget shortened or skipped the lane's work in the step
        planned last."""
        lane = self.lanes.get(lane_name)
        return lane is not None and lane.last_capped_step == self._step_index - 1

    def kv_blocks_held(self) -> dict[str, int]:
        """KV block-table entries held per lane (engine thread: a recount without KV shares,
        whose books are only kept exact while shares are in force)."""
        if self.quotas.active:
            return dict(self.quotas.held)
        held = dict.fromkeys(self.lanes, 0)
        for request in self.running:
            if request.status is RUNNING:
                held[request.lane] = held.get(request.lane, 0) + len(request.block_ids)
        return held

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ------------------------------------------------------------------ requests in

    def add_request(self, request: Request) -> None:
        """Queue an admitted request (admission checks happen before, in admission.py)."""
        assert request.request_id not in self.requests, f"duplicate id {request.request_id}"
        assert request.lane in self.lanes, f"unknown lane {request.lane}"
        request.status = WAITING
        self.requests[request.request_id] = request
        if not request.awaits_fork:  # a follower starts with its leader (_start_unforked_followers)
            lane = self.lanes[request.lane]
            lane.push(request)
            if not lane.config.continuous_batching:
                self._static_lane_arrivals[request.request_id] = next(self._arrival_seq)
        if request.deadline is not None:
            deadlines = self._deadlines
            heapq.heappush(deadlines, (request.deadline, next(self._rank_seq), request))
            if len(deadlines) > 2 * len(self.requests) + 64:
                # Entries of finished requests would stay until their deadline passes (up to
                # a day), holding the requests' memory: drop them (amortized O(1)).
                self._deadlines = [e for e in deadlines if not e[2].is_finished]
                heapq.heapify(self._deadlines)

    def finish_request(self, request: Request, status: RequestStatus, detail: str = "") -> None:
        """End a request in any state (cancel, timeout, error, stop): its blocks are freed now."""
        if request.is_finished or request.request_id not in self.requests:
            return
        lane = self.lanes[request.lane]
        if request.status == RUNNING:
            lane.num_running -= 1
            self.num_running -= 1
            self._remove_running(request)
            self.quotas.release(request.lane, len(request.block_ids))
        elif not lane.remove(request) and request.request_id in self._batch:
            try:
                self._batch_waiting.remove(request)
                self._count_batch_waiting(request.lane, -1)
            except ValueError:
                pass
        self._batch.discard(request.request_id)
        self._static_lane_arrivals.pop(request.request_id, None)
        self.kv.free(request)
        request.finish(status, detail, now=self.clock())
        del self.requests[request.request_id]
        if request.first_scheduled_time is not None:
            self._finished_for_executor.append(request)
        self.newly_finished.append(request)
        if request.group is not None and not request.group.forked:
            self._finish_unforked_followers(request, status, detail)

    def drain_finished(self) -> list[Request]:
        out, self.newly_finished = self.newly_finished, []
        return out

    # ------------------------------------------------------------------ planning

    def schedule(self) -> StepPlan:
        now = self.clock()
        self.last_started = {}
        self._expire(now)
        if self._running_dirty:
            self._compact_running()
        plan = StepPlan()
        if self._finished_for_executor:
            plan.finished = self._finished_for_executor
        if self.quotas.active:
            self.quotas.recount(self.running)
        if self._quotas_changed:
            self._enforce_kv_quotas(plan)
        quota_preemptions = len(plan.preempted)
        budget = self._step_budget = StepTimeBudget(self.step_cost, self._step_cap_s())
        timed = budget.active
        if timed:
            budget.prefill_priority = self._prefill_priority([])
        sched = self.sched
        kv = self.kv
        bs = self.block_size
        token_budget = sched.max_batched_tokens
        lanes = self.lanes
        for lane in lanes.values():
            lane.tokens_left = lane.budgets.max_batched_tokens
        scheduled: set[str] = set()
        scheduled_add = scheduled.add
        mixed = sched.policy == "mixed"
        decodes: list[ScheduledChunk] = []
        decodes_append = decodes.append
        # `mixed` keeps one list in rank order; decode-first appends prefills after decodes.
        prefills: list[ScheduledChunk] = decodes if mixed else []

        # --- running requests: decodes (and, for `mixed`, prefills) in rank order
        later_prefills: list[tuple[int, Request]] = []
        running = self.running
        for index, request in enumerate(running):
            if request.status is not RUNNING or request.awaits_fork:
                continue  # preempted earlier in this loop, or a follower not forked yet
            computed = request.num_computed_tokens
            remaining = len(request.prompt_token_ids) + len(request.output_token_ids) - computed
            if remaining == 1:  # a decode
                lane = lanes[request.lane]
                if lane.tokens_left < 1 or token_budget < 1:
                    continue
                if timed:
                    if not budget.fits(computed, 1) and self._may_skip_decode(request, lane, now, budget):
                        budget.capped = True
                        lane.time_capped_steps += lane.last_capped_step != self._step_index
                        lane.last_capped_step = self._step_index
                        continue
                    budget.add(computed, 1)
                if computed >= len(request.block_ids) * bs:  # needs one more block
                    if not self._fits(1, request.lane) and not self._make_room(
                        1, index, scheduled, plan, lane=request.lane
                    ):
                        self._preempt(request, plan)
                        continue
                    kv.append_block(request)
                    self.quotas.charge(request.lane, 1)
                elif request.group is not None and kv.is_shared(request.block_ids[computed // bs]):
                    # Parallel sampling: its block is shared with its group: copy on write.
                    if not self._fits(1, request.lane) and not self._make_room(
                        1, index, scheduled, plan, lane=request.lane
                    ):
                        self._preempt(request, plan)
                        continue
                    if kv.is_shared(request.block_ids[computed // bs]):  # room made by evicting a sibling?
                        plan.block_copies.append(kv.copy_on_write(request, computed // bs))
                decodes_append(ScheduledChunk(request, computed, 1, True))
                scheduled_add(request.request_id)
                lane.tokens_left -= 1
                token_budget -= 1
            elif mixed:
                token_budget -= self._schedule_prefill(
                    index, request, lanes[request.lane], token_budget, scheduled, prefills, plan
                )
            else:
                later_prefills.append((index, request))
        if timed:
            budget.prefill_priority = max(budget.prefill_priority, self._prefill_priority(later_prefills))
        for index, request in later_prefills:
            if request.status is not RUNNING:
                continue
            token_budget -= self._schedule_prefill(
                index, request, lanes[request.lane], token_budget, scheduled, prefills, plan
            )
        for lane in lanes.values():  # the running requests' share, for fair-share clocks
            served = lane.budgets.max_batched_tokens - lane.tokens_left
            if served:
                lane.vtime += served / lane.config.weight
                lane.served_tokens += served

        # --- waiting requests start (not in a step that had to preempt: memory is short)
        self._catch_up_idle_lanes()
        if len(plan.preempted) == quota_preemptions:
            token_budget = self._admit(token_budget, scheduled, prefills, plan, now)

        if not mixed:
            decodes.extend(prefills)  # batch order: decodes, then prefill chunks
        plan.chunks = decodes
        plan.num_batched_tokens = sched.max_batched_tokens - token_budget
        if plan.chunks:
            self._finished_for_executor = []
        if budget.capped:
            self.num_time_capped_steps += 1
        self._step_index += 1
        return plan

    def _schedule_prefill(
        self,
        index: int,
        request: Request,
        lane: Lane,
        token_budget: int,
        scheduled: set[str],
        prefills: list[ScheduledChunk],
        plan: StepPlan,
    ) -> int:
        """Next prefill chunk of a running request; returns the tokens it took."""
        remaining = request.num_tokens - request.num_computed_tokens
        n = min(remaining, lane.budgets.prefill_chunk_size, token_budget, lane.tokens_left)
        n = self._chunk_in_time(lane, request.num_computed_tokens, n)
        if n <= 0:
            return 0
        kv = self.kv
        need = kv.num_blocks_to_allocate(request, n)
        if not self._fits(need, request.lane) and not self._make_room(
            need, index, scheduled, plan, lane=request.lane
        ):
            # Take what fits rather than nothing (the chunk shrinks to the lane's room).
            room = (len(request.block_ids) + self._room(request.lane)) * self.block_size
            n = min(n, room - request.num_computed_tokens)
            if n <= 0:
                return 0
        held = len(request.block_ids)
        kv.allocate(request, n)
        self.quotas.charge(request.lane, len(request.block_ids) - held)
        self._step_budget.add(request.num_computed_tokens, n)
        start = request.num_computed_tokens
        prefills.append(ScheduledChunk(request, start, n, start + n == request.num_tokens))
        scheduled.add(request.request_id)
        lane.tokens_left -= n
        return n

    def _make_room(
        self, num_blocks: int, index: int, scheduled: set[str], plan: StepPlan, lane: Optional[str] = None
    ) -> bool:
        """Preempt lowest-ranked running requests after `index` not yet scheduled this step
        until `num_blocks` blocks are free (and, for `lane`, within its KV shares). False if
        that is not possible. With KV shares, a victim of another lane inside its reserve
        frees nothing `lane` may take, so it is spared."""
        running = self.running
        quotas = self.quotas
        spare_reserves = lane is not None and quotas.active
        victim_index = len(running) - 1
        while not self._fits(num_blocks, lane):
            while victim_index > index:
                victim = running[victim_index]
                if (
                    victim.status is RUNNING
                    and victim.request_id not in scheduled
                    and not victim.awaits_fork
                    and not (
                        spare_reserves
                        and victim.lane != lane
                        and quotas.held.get(victim.lane, 0) <= quotas.reserve.get(victim.lane, 0)
                    )
                ):
                    break
                victim_index -= 1
            else:
                return False
            self._preempt(running[victim_index], plan)
            victim_index -= 1
        return True

    def _preempt(self, request: Request, plan: StepPlan) -> None:
        """Evict by recompute: free the blocks, back to the head of the lane's queue."""
        self.quotas.release(request.lane, len(request.block_ids))
        self.kv.free(request)
        request.status = PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        lane = self.lanes[request.lane]
        lane.num_running -= 1
        self.num_running -= 1
        self._running_dirty = True
        self.num_preemptions_total += 1
        plan.preempted.append(request)
        if request.request_id in self._batch:
            self._batch_waiting.appendleft(request)
            self._count_batch_waiting(request.lane, 1)
        else:
            lane.push(request)
            batch = self._lane_batches.get(lane.name)
            if batch is not None:  # a member of the lane's batch: it restarts within the batch
                batch[1] += 1
        if request.group is not None and not request.group.forked:
            self._stop_unforked_followers(request)

    def _admit(
        self,
        token_budget: int,
        scheduled: set[str],
        prefills: list[ScheduledChunk],
        plan: StepPlan,
        now: float,
    ) -> int:
        """Start waiting requests (new, or preempted ones) while budgets allow."""
        if self.static_batching:
            return self._admit_static(token_budget, scheduled, prefills, now)
        sched, kv = self.sched, self.kv
        max_active = sched.max_active_sequences
        high = sched.kv_cache_high_watermark
        candidates = [
            lane
            for lane in self.lanes.values()
            if lane.num_waiting
            and lane.num_running < lane.budgets.max_active_sequences
            and lane.tokens_left > 0
        ]
        if not candidates:
            return token_budget
        started: set[str] = set()
        time_denied: list[Lane] = []
        while candidates and token_budget > 0 and self.num_running < max_active:
            lane = min(candidates, key=self._lane_order)
            if self.num_running and self._above_watermark(lane.name, high):
                candidates.remove(lane)  # above its high watermark: none of its prefills start
                continue
            request = lane.peek()
            if not lane.config.continuous_batching and not self._joins_lane_batch(lane, request):
                candidates.remove(lane)  # static lane: its batch is full or still running
                continue
            if self.quotas.active and self.exceeds_lane_capacity(request):
                # Its lane's shares can never hold it (the shares changed since admission).
                self.finish_request(request, RequestStatus.FINISHED_REJECTED, "too_long")
                if not lane.num_waiting:
                    candidates.remove(lane)
                continue
            n = self._start(request, lane, token_budget, prefills, now, from_lane=lane)
            if n is None:
                if self._step_budget.active and self._step_budget.lane_out_of_time(lane.name):
                    candidates.remove(lane)  # it yields this step's time to higher priorities
                    time_denied.append(lane)
                    continue
                if self._lane_blocked_by_quota(lane.name, request):
                    candidates.remove(lane)  # its own shares stop it, not the pool: others go on
                    continue
                break  # not enough free blocks: stop starting (head-of-line, no skipping)
            scheduled.add(request.request_id)
            started.add(lane.name)
            if not lane.config.continuous_batching:
                self._lane_batches[lane.name][1] -= 1
                self._static_lane_arrivals.pop(request.request_id, None)
            token_budget -= n
            lane.vtime += n / lane.config.weight
            lane.served_tokens += n
            lane.starved_steps = 0
            if (
                not lane.num_waiting
                or lane.num_running >= lane.budgets.max_active_sequences
                or lane.tokens_left <= 0
            ):
                candidates.remove(lane)
        if started:
            for lane in candidates + time_denied:
                if lane.name not in started and lane.num_waiting and lane.tokens_left > 0:
                    lane.starved_steps += 1
        return token_budget

    # ---- per-lane static batching (lane key continuousBatching: false)

    def _joins_lane_batch(self, lane: Lane, request: Request) -> bool:
        """Whether the head of a static lane may start now: it joins the lane's open batch
        (queued before the batch opened, with starts left). A batch opens once the lane's
        running set has drained; its starts are the requests then waiting, up to the lane's
        maxActiveSequences (a preempted member gives its start back)."""
        batch = self._lane_batches.get(lane.name)
        arrival = self._static_lane_arrivals.get(request.request_id, -1)
        if lane.num_running == 0 and (batch is None or batch[1] <= 0 or arrival >= batch[0]):
            batch = [next(self._arrival_seq), min(lane.num_waiting, lane.budgets.max_active_sequences)]
            self._lane_batches[lane.name] = batch
        return batch is not None and batch[1] > 0 and arrival < batch[0]

    def _lane_batch_closed(self, lane: Lane) -> bool:
        """A static lane whose running batch takes no more requests (its queue waits)."""
        if lane.config.continuous_batching or not lane.num_running:
            return False
        batch = self._lane_batches.get(lane.name)
        return batch is None or batch[1] <= 0

    # ---- KV shares of the lanes (kv_quotas.py)

    def _room(self, lane_name: str) -> int:
        """Blocks the lane may allocate now (the free blocks without quotas)."""
        return self.quotas.room(lane_name, self.kv.num_free_blocks)

    def _fits(self, num_blocks: int, lane_name: Optional[str], table_growth: Optional[int] = None) -> bool:
        """Whether `num_blocks` free blocks may be taken for the lane; `table_growth`: the
        block-table entries it adds, when more (prefix hits on blocks in use count against
        the lane's cap but take no free block)."""
        if lane_name is None or not self.quotas.active:
            return self.kv.can_allocate(num_blocks)
        quotas = self.quotas
        if table_growth is not None and table_growth > num_blocks:
            cap = quotas.cap.get(lane_name, quotas.num_blocks)
            if cap < quotas.num_blocks and quotas.held.get(lane_name, 0) + table_growth > cap:
                return False
        return num_blocks <= self._room(lane_name)

    def _above_watermark(self, lane_name: str, high: float) -> bool:
        """The high watermark, applied to the lane against its own capacity (the pool's
        usage without quotas; never while the lane is inside its reserve)."""
        return self.quotas.usage_of(lane_name, self.kv.num_free_blocks) >= high

    def lane_kv_usage(self, lane_name: str) -> float:
        """The lane's KV usage for the reject watermark (admission): against its own capacity
        with KV shares in force, else the pool's."""
        if not self.quotas.active:
            return self.kv.usage
        return self.quotas.usage_of(lane_name, self.kv.num_free_blocks)

    def lane_kv_capacity(self, lane_name: str) -> int:
        """The most KV blocks one request of the lane can ever get (admission's size check)."""
        return self.quotas.capacity(lane_name)

    def exceeds_lane_capacity(self, request: Request) -> bool:
        total = request.num_prompt_tokens + request.sampling_params.max_tokens
        if self.max_model_len:
            total = min(total, self.max_model_len)
        return self.kv.blocks_for_tokens(total) > self.quotas.capacity(request.lane)

    def _lane_blocked_by_quota(self, lane_name: str, request: Request) -> bool:
        """Whether the request's first chunk would fit in the free blocks but not in the
        lane's room (so the lane, not the pool, is full)."""
        if not self.quotas.active:
            return False
        chunk = min(request.num_tokens, self.lanes[lane_name].budgets.prefill_chunk_size)
        return self.kv.blocks_for_tokens(chunk) <= self.kv.num_free_blocks

    def _enforce_kv_quotas(self, plan: StepPlan) -> None:
        """After a reload changed the lanes' KV shares: preempt (recompute), lowest-ranked
        first, requests of lanes above their new cap, and requests of lanes above their own
        reserve while another lane's reserve is not free."""
        self._quotas_changed = False
        quotas, kv = self.quotas, self.kv
        if not quotas.active:
            return
        for request in reversed(list(self.running)):
            if request.status is not RUNNING or request.awaits_fork:
                continue
            lane = request.lane
            held = quotas.held.get(lane, 0)
            over_cap = held > quotas.cap.get(lane, quotas.num_blocks)
            reserves_short = kv.num_free_blocks < sum(quotas.unmet(name) for name in quotas.reserve)
            if over_cap or (reserves_short and held > quotas.reserve.get(lane, 0)):
                self._preempt(request, plan)

    # ---- step-time budget (step_cost.py)

    def _step_cap_s(self) -> Optional[float]:
        """This step's time cap: a share of the tightest TPOT target among the lanes with
        running requests; None when off or no running lane has a TPOT target."""
        if self.sched.step_time_budget != "auto":
            return None
        targets = [
            lane.config.slo.tpot_p95_ms
            for lane in self.lanes.values()
            if lane.num_running and lane.config.slo.tpot_p95_ms
        ]
        return min(targets) / 1000.0 * STEP_BUDGET_SHARE if targets else None

    def _prefill_priority(self, running_prefills: list[tuple[int, Request]]) -> int:
        """The highest priority among lanes with prefill work this step (running prefills,
        or waiting requests that may start)."""
        lanes = self.lanes
        top = max((lanes[r.lane].config.priority for _, r in running_prefills), default=-1)
        for lane in lanes.values():
            if (
                lane.num_waiting
                and lane.config.priority > top
                and lane.num_running < lane.budgets.max_active_sequences
                and not self._lane_batch_closed(lane)
            ):
                top = lane.config.priority
        return top

    def _may_skip_decode(self, request: Request, lane: Lane, now: float, budget: StepTimeBudget) -> bool:
        """A decode of a lane with a looser TPOT target than the step's cap may sit out this
        step if its next token still comes within its own target (one more step later)."""
        target = lane.config.slo.tpot_p95_ms
        allowed = UNTARGETED_DECODE_WAIT_S if not target else target / 1000.0 * STEP_BUDGET_SHARE
        cap = budget.cap_s
        if allowed <= cap or not request.token_times:
            return False
        return now - request.token_times[-1] + 2 * cap <= allowed

    def _chunk_in_time(self, lane: Lane, start: int, n: int, starting: bool = False) -> int:
        """`n`, shortened so the step stays within its time cap (the step's first prefill
        keeps CAPPED_PREFILL_FLOOR tokens). Chunks of the lanes whose TPOT target sets the
        cap are never shortened: their time to first token is theirs to keep too. A lane
        yielding to a higher-priority lane's prefills gets the floor for one running prefill
        per step, and starts nothing unless the starvation guard lets it go first."""
        budget = self._step_budget
        if not budget.active or n <= 0:
            return n
        budget.prefill_priority = max(budget.prefill_priority, lane.config.priority)
        target = lane.config.slo.tpot_p95_ms
        if target and target / 1000.0 * STEP_BUDGET_SHARE <= budget.cap_s * (1 + 1e-9):
            budget.add_pending_prefill()
            return n
        yielding = lane.config.priority < budget.prefill_priority
        if yielding:
            floored = lane.name in budget.floored_lanes or (starting and lane.starved_steps < self.starvation_steps)
            floor = 0 if floored else CAPPED_PREFILL_FLOOR
        else:
            floor = 0 if budget.has_prefill else CAPPED_PREFILL_FLOOR
        share = YIELDING_PREFILL_SHARE if yielding else 1.0
        fitted = budget.largest_chunk(start, n, floor, share)
        if yielding and fitted:
            budget.floored_lanes.add(lane.name)
        budget.denied_lane = None if fitted else lane.name
        if fitted < n:
            lane.time_capped_steps += lane.last_capped_step != self._step_index
            lane.last_capped_step = self._step_index
        return fitted

    def _catch_up_idle_lanes(self) -> None:
        """An idle lane must not bank credit: when it gets work again it starts level with
        the busiest-served active lane's clock, not far behind it (standard WFQ)."""
        lanes = self.lanes.values()
        active = [lane.vtime for lane in lanes if lane.num_waiting or lane.num_running]
        if active:
            floor = min(active)
            for lane in lanes:
                if not (lane.num_waiting or lane.num_running) and lane.vtime < floor:
                    lane.vtime = floor

    def _lane_order(self, lane: Lane) -> tuple:
        return (lane.starved_steps < self.starvation_steps, -lane.config.priority, lane.vtime)

    def _start(
        self,
        request: Request,
        lane: Lane,
        token_budget: int,
        prefills: list[ScheduledChunk],
        now: float,
        from_lane: Optional[Lane],
    ) -> Optional[int]:
        """Allocate and schedule the first chunk of a waiting request; None if blocks lack."""
        kv = self.kv
        first_time = request.first_scheduled_time is None
        # A request that still needs prompt logprobs computes those positions itself.
        cache_limit = request.max_cached_prefix_tokens
        cached = kv.find_cached_prefix(request, cache_limit)
        todo = request.num_tokens - len(cached) * self.block_size
        n = min(todo, lane.budgets.prefill_chunk_size, token_budget, lane.tokens_left)
        n = self._chunk_in_time(lane, len(cached) * self.block_size, n, starting=True)
        if n <= 0:
            return None
        need = kv.num_blocks_to_allocate(request, n, cached)
        group = request.group
        starts_group = group is not None and not group.forked and group.leader is request
        if starts_group and not self._group_fits(group, lane, need):
            return None
        if not self._fits(need, lane.name, kv.blocks_for_tokens(len(cached) * self.block_size + n)):
            return None
        if from_lane is not None:
            from_lane.pop()
        if first_time and cache_limit != 0:  # a lookup it may not use is not a query
            kv.record_prefix_query(request, cached)
        kv.allocate(request, n, cached)
        self.quotas.charge(lane.name, len(request.block_ids))
        self._step_budget.add(request.num_computed_tokens, n)
        request.status = RUNNING
        if first_time:
            request.first_scheduled_time = now
        lane.num_running += 1
        self.num_running += 1
        started = self.last_started
        started[lane.name] = started.get(lane.name, 0) + 1
        key = (-lane.config.priority, next(self._rank_seq))
        pos = bisect.bisect(self._rank, key)
        self._rank.insert(pos, key)
        self.running.insert(pos, request)
        self._rank_of[request.request_id] = key
        start = request.num_computed_tokens
        prefills.append(ScheduledChunk(request, start, n, start + n == request.num_tokens))
        lane.tokens_left -= n
        if starts_group:
            self._start_unforked_followers(request, lane, now)
        return n

    def _admit_static(
        self, token_budget: int, scheduled: set[str], prefills: list[ScheduledChunk], now: float
    ) -> int:
        if not self._batch:
            self._form_batch()
        high = self.sched.kv_cache_high_watermark
        while self._batch_waiting and token_budget > 0:
            request = self._batch_waiting[0]
            if self.quotas.active and self.exceeds_lane_capacity(request):
                self.finish_request(request, RequestStatus.FINISHED_REJECTED, "too_long")
                continue
            if self.num_running and self._above_watermark(request.lane, high):
                break
            lane = self.lanes[request.lane]
            n = self._start(request, lane, token_budget, prefills, now, from_lane=None)
            if n is None:
                break
            self._batch_waiting.popleft()
            self._count_batch_waiting(request.lane, -1)
            scheduled.add(request.request_id)
            lane.vtime += n / lane.config.weight
            lane.served_tokens += n
            token_budget -= n
        return token_budget

    def _form_batch(self) -> None:
        """Static batching: take up to maxActiveSequences waiting requests as the next batch."""
        cap = self.sched.max_active_sequences
        taken: dict[str, int] = {}
        candidates = [lane for lane in self.lanes.values() if lane.num_waiting]
        while candidates and len(self._batch) < cap:
            lane = min(candidates, key=self._lane_order)
            # A parallel-sampling group joins whole: its followers count as batch members.
            group = lane.peek().group
            followers = [f for f in group.members[1:] if not f.is_finished] if group and not group.forked else []
            if followers and self._batch and len(self._batch) + 1 + len(followers) > cap:
                break
            request = lane.pop()
            self._batch.add(request.request_id)
            self._batch.update(f.request_id for f in followers)
            self._batch_waiting.append(request)
            self._count_batch_waiting(request.lane, 1)
            taken[lane.name] = taken.get(lane.name, 0) + 1 + len(followers)
            lane.vtime += request.num_tokens / lane.config.weight
            lane.starved_steps = 0
            if not lane.num_waiting or taken[lane.name] >= lane.budgets.max_active_sequences:
                candidates.remove(lane)
        for lane in self.lanes.values():  # left out of this batch while others got in
            if lane.num_waiting and lane.name not in taken and taken:
                lane.starved_steps += 1

    def _count_batch_waiting(self, lane_name: str, delta: int) -> None:
        counts = self._batch_waiting_per_lane
        counts[lane_name] = counts.get(lane_name, 0) + delta

    # ------------------------------------------------------------------ results

    def update_from_output(self, plan: StepPlan, output: ExecutorOutput) -> list[Request]:
        """Apply one step's results; returns the requests that got a new token."""
        now = self.clock()
        if self.sched.step_time_budget == "auto" and plan.chunks:
            self.step_cost.observe(((c.start, c.num_tokens) for c in plan.chunks), output.step_seconds)
        sampled, errors = output.sampled, output.errors
        kv = self.kv
        bs = self.block_size
        caching = kv.enable_prefix_caching
        max_model_len = self.max_model_len or math.inf
        got_token: list[Request] = []
        got_token_append = got_token.append
        for chunk in plan.chunks:
            request = chunk.request
            if request.status is not RUNNING:
                continue  # finished or preempted after planning (not possible within a step)
            rid = request.request_id
            if errors and rid in errors:
                self.finish_request(request, RequestStatus.FINISHED_ERROR, errors[rid])
                continue
            before = request.num_computed_tokens
            request.num_computed_tokens = after = before + chunk.num_tokens
            if caching and after // bs != before // bs:  # a block became full: cache it
                kv.cache_computed_blocks(request)
            params = request.sampling_params
            if params.prompt_logprobs is not None and before < request.num_prompt_tokens:
                if not self._record_prompt_logprobs(request, chunk, output):
                    continue
            group = request.group
            if group is not None and not group.forked and after >= group.fork_tokens:
                self._fork(group)
            if not chunk.sample:
                continue
            if params.max_tokens == 0:  # prompt logprobs only: the sampled token is not wanted
                self.finish_request(request, RequestStatus.FINISHED_LENGTH, "max_tokens")
                continue
            token = sampled.get(rid)
            if token is None:
                self.finish_request(request, RequestStatus.FINISHED_ERROR, "executor sampled no token")
                continue
            if params.logprobs is not None:
                entry = output.logprobs.get(rid)
                if entry is None:
                    self.finish_request(request, RequestStatus.FINISHED_ERROR, "executor returned no logprobs")
                    continue
                request.output_logprobs.append(entry)
            out = request.output_token_ids
            out.append(token)
            request.token_times.append(now)
            if request.first_token_time is None:
                request.first_token_time = now
            got_token_append(request)
            if token == request.eos_token_id and not params.ignore_eos:
                self.finish_request(request, RequestStatus.FINISHED_STOPPED, "eos")
            elif params.stop_token_ids and token in params.stop_token_ids:
                self.finish_request(request, RequestStatus.FINISHED_STOPPED, "stop_token")
            elif len(out) >= params.max_tokens:
                self.finish_request(request, RequestStatus.FINISHED_LENGTH, "max_tokens")
            elif len(out) + len(request.prompt_token_ids) >= max_model_len:
                self.finish_request(request, RequestStatus.FINISHED_LENGTH, "max_model_len")
        return got_token

    def _record_prompt_logprobs(self, request: Request, chunk: ScheduledChunk, output: ExecutorOutput) -> bool:
        """Append the prompt logprobs this chunk scored (each prompt token once, in order;
        a recomputation after a preemption scores known tokens again and is skipped).
        False if the executor left a gap (the request then ends as an error)."""
        known = request.prompt_logprobs
        if not known and chunk.start == 0:
            known.append(None)  # the first prompt token has no context
        end = min(chunk.start + chunk.num_tokens, request.num_prompt_tokens - 1)
        if end < len(known):  # tokens up to `end` all scored already (a recomputation)
            return True
        first, entries = output.prompt_logprobs.get(request.request_id, (chunk.start + 1, []))
        if first + len(entries) < end + 1 or first > len(known):
            self.finish_request(request, RequestStatus.FINISHED_ERROR, "executor returned no prompt logprobs")
            return False
        skip = len(known) - first
        if skip < len(entries):
            known.extend(entries[max(0, skip):])
        return True

    # ------------------------------------------------------------------ parallel sampling
    # A group's followers are counted as running from the moment their leader starts (so
    # maxActiveSequences and the lanes' caps count every sequence) but get no chunk and hold
    # no block until the fork; see SequenceGroup in request.py.

    def _group_fits(self, group, lane: Lane, leader_blocks: int) -> bool:
        """Whether a leader may start now: room for all its sequences (unless nothing else
        runs, so a group larger than a cap still progresses) and, past its own first chunk,
        one free block per follower (each one's copy of the shared partial block)."""
        size = len(group.members)
        if self.num_running and self.num_running + size > self.sched.max_active_sequences:
            return False
        if lane.num_running and lane.num_running + size > lane.budgets.max_active_sequences:
            return False
        return self._fits(leader_blocks + size - 1, lane.name)

    def _start_unforked_followers(self, leader: Request, lane: Lane, now: float) -> None:
        if self._running_dirty:  # drop stale entries first: a follower must not be in twice
            self._compact_running()
        in_batch = leader.request_id in self._batch
        for follower in leader.group.members[1:]:
            if follower.status is not WAITING:
                continue  # finished already (cancelled)
            follower.status = RUNNING
            if follower.first_scheduled_time is None:
                follower.first_scheduled_time = now
            lane.num_running += 1
            self.num_running += 1
            key = (-lane.config.priority, next(self._rank_seq))
            pos = bisect.bisect(self._rank, key)
            self._rank.insert(pos, key)
            self.running.insert(pos, follower)
            self._rank_of[follower.request_id] = key
            if in_batch:
                self._batch.add(follower.request_id)

    def _stop_unforked_followers(self, leader: Request) -> None:
        """The leader left the running set before the fork: its followers wait again (their
        running-set entries go at the next compaction, as a preempted request's do)."""
        for follower in leader.group.members[1:]:
            if follower.status is RUNNING:
                follower.status = WAITING
                self.lanes[follower.lane].num_running -= 1
                self.num_running -= 1
                self._running_dirty = True

    def _finish_unforked_followers(self, leader: Request, status: RequestStatus, detail: str) -> None:
        """A leader that ends before the fork ends its followers the same way (they have no
        prompt to fork from)."""
        if leader is not leader.group.leader:
            return
        for follower in leader.group.members[1:]:
            if not follower.is_finished:
                self.finish_request(follower, status, detail)

    def _fork(self, group) -> None:
        """The leader computed every prompt token but the last: each waiting follower takes
        its share of the leader's blocks and continues from there as a decode."""
        leader = group.leader
        group.forked = True
        for follower in group.members[1:]:
            follower.awaits_fork = False
            if follower.is_finished:
                continue
            assert follower.status is RUNNING, (follower.request_id, follower.status)
            self.kv.fork(leader, follower, group.fork_tokens)
            self.quotas.charge(follower.lane, len(follower.block_ids))  # shared entries count per holder
            follower.num_cached_tokens = leader.num_cached_tokens
            if follower.sampling_params.prompt_logprobs is not None:
                follower.prompt_logprobs = list(leader.prompt_logprobs)

    # ------------------------------------------------------------------ housekeeping

    def _expire(self, now: float) -> None:
        """Finish queued requests past their lane's queue timeout and any past its deadline."""
        for lane in self.lanes.values():
            if lane.num_waiting:
                for request in lane.pop_expired(now):
                    self._finish_removed(request, RequestStatus.FINISHED_TIMEOUT, "queue_timeout")
        deadlines = self._deadlines
        while deadlines and deadlines[0][0] <= now:
            _, _, request = heapq.heappop(deadlines)
            if not request.is_finished:
                self.finish_request(request, RequestStatus.FINISHED_TIMEOUT, "deadline")

    def _finish_removed(self, request: Request, status: RequestStatus, detail: str) -> None:
        """Finish a request already taken out of its lane's queue."""
        self._static_lane_arrivals.pop(request.request_id, None)
        self.kv.free(request)
        request.finish(status, detail, now=self.clock())
        del self.requests[request.request_id]
        self.newly_finished.append(request)
        if request.group is not None and not request.group.forked:
            self._finish_unforked_followers(request, status, detail)

    def _remove_running(self, request: Request) -> None:
        """Take a request out of the running set: O(log n) search + one memmove."""
        key = self._rank_of.pop(request.request_id, None)
        if key is None:
            return
        i = bisect.bisect_left(self._rank, key)
        if i < len(self._rank) and self._rank[i] == key and self.running[i] is request:
            del self._rank[i]
            del self.running[i]
        else:  # not where it should be (e.g. a stale entry): fall back to a rebuild
            self._running_dirty = True

    def _compact_running(self) -> None:
        """Drop entries that left the RUNNING state (preempted during a step's loop)."""
        keep = [i for i, r in enumerate(self.running) if r.status is RUNNING]
        self.running = [self.running[i] for i in keep]
        self._rank = [self._rank[i] for i in keep]
        live = {r.request_id for r in self.running}
        self._rank_of = {rid: key for rid, key in self._rank_of.items() if rid in live}
        self._running_dirty = False

    def _rerank(self) -> None:
        """Re-sort the running set after lane priorities changed (reload)."""
        self._compact_running()
        pairs = sorted(
            ((-self.lanes[r.lane].config.priority, key[1]), r)
            for key, r in zip(self._rank, self.running)
        )
        self._rank = [k for k, _ in pairs]
        self.running = [r for _, r in pairs]
        self._rank_of = {r.request_id: k for k, r in pairs}
        for lane in self.lanes.values():
            lane.num_running = 0
        for r in self.running:
            self.lanes[r.lane].num_running += 1

    # ------------------------------------------------------------------ checks

    def check_invariants(self) -> None:
        """Raise AssertionError if scheduler and pool books disagree (tests call it each step)."""
        live = list(self.requests.values())
        self.kv.check_invariants(live)
        running = [r for r in self.running if r.status is RUNNING]
        self.quotas.check_invariants(running, self.kv.num_free_blocks)
        assert len(running) == self.num_running, (len(running), self.num_running)
        assert len({r.request_id for r in running}) == len(running), "request running twice"
        for lane in self.lanes.values():
            assert lane.num_running == sum(1 for r in running if r.lane == lane.name), lane.name
        for r in live:
            assert not r.is_finished
            if r.status is RUNNING:
                assert r in running
                assert len(r.block_ids) * self.block_size >= r.num_computed_tokens
            else:
                assert not r.block_ids and r.num_computed_tokens == 0, r.request_id
        waiting = self.num_waiting
        held = sum(1 for r in live if r.awaits_fork and r.status is WAITING)  # off-queue followers
        assert waiting + held + self.num_running == len(live), (waiting, held, self.num_running, len(live))
        for r in live:
            if r.awaits_fork:
                assert not r.block_ids and r.num_computed_tokens == 0, r.request_id
                assert r.status is RUNNING or r.group.leader.status is not RUNNING, r.request_id
        for name in self.lanes:
            n = sum(1 for r in self._batch_waiting if r.lane == name)
            assert self._batch_waiting_per_lane.get(name, 0) == n, name
        assert self._rank == sorted(self._rank)
        assert len(self._rank) == len(self.running)
        for key, r in zip(self._rank, self.running):
            if r.status is RUNNING:
                assert self._rank_of[r.request_id] == key
