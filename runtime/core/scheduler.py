"""The token-budget scheduler: pure Python (no torch), one step at a time.

Every step re-selects the working set from scratch:

1. Requests whose queue timeout or deadline passed are finished (their blocks freed).
2. Running requests get their tokens, in rank order (higher lane priority, then older first),
   by one rule for decodes and prefill chunks alike (`_serve`; the plain decode, the common
   case, is spelled out inline): n = min(the tokens it has left to compute, its lane's
   prefillChunkSize, the step's and the lane's token budgets), capped by the step-time
   budget; its blocks come from one allocator call (kv_allocator.py), which checks and
   charges the lane's KV shares, forks of parallel-sampling groups included. Decode-first
   serves every running decode before any prefill chunk; `mixed` serves the running set in
   rank order whatever phase each request is in. A request that needs KV blocks and finds none preempts (by
   recompute) the lowest-ranked running request not yet scheduled in this step: lowest lane
   priority, then newest; if none is left, a decode gives way itself and a prefill chunk
   shrinks to the room there is. The highest-ranked request can always progress (admission
   refuses requests the whole pool cannot hold), so there is no livelock.
3. Waiting requests start, chunk by chunk (at most the lane's prefillChunkSize), while the
   step's token budget, maxActiveSequences, the lane's caps and the KV high watermark allow
   (none in a step that had to preempt: memory is short, and a just-evicted request must
   not bounce straight back). A lane's head that does not fit in the free blocks stops
   admission for the step (no skipping ahead of it). With LoRA adapters, at most
   engine.maxLoras distinct adapters run at once (`AdapterSlots`): a head whose adapter has
   no slot stops its lane (FIFO), and a drain guarantees it the next free slot.
   Lanes are served by priority, then by weighted fair share (the lane with the smallest
   `tokens served / weight` first); a lane that had startable work but got nothing for
   `starvation_steps` steps in a row goes first once, so no lane with work starves
   (`LaneOrder`, sched_policies.py).
   Inside a lane: weighted fair share among its tenants (the tenant with the fewest tokens
   served / weight first, runtime/core/lanes.py), then earliest deadline, request priority and
   arrival within a tenant.
   A starting request takes the longest cached prefix of its tokens from the prefix cache,
   except the positions whose logits it needs for prompt logprobs (it computes those). With
   a host tier (engine.kvOffload) the prefix continues with the blocks found there, copied
   back into fresh blocks (the plan's kv_restores) and counted as cached; cached blocks the
   step's allocations evict go to the host tier (kv_offloads).

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

The policies (lane order, the step-time budget, engine-wide and per-lane static batching,
parallel sampling's start rule) are small objects in sched_policies.py, each with its own
property test (tests/runtime/test_sched_policies.py); this module applies them.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
import time
from typing import Callable, Optional

from tokenlane.runtime.config import RuntimeConfig
from tokenlane.runtime.core.kv_allocator import LaneKVAllocator
from tokenlane.runtime.core.kv_cache import KVCacheManager
from tokenlane.runtime.core.kv_quotas import LaneKVQuotas
from tokenlane.runtime.core.lanes import Lane
from tokenlane.runtime.core.request import Request, RequestStatus
from tokenlane.runtime.core.sched_policies import (
    AdapterSlots,
    LaneBatches,
    LaneOrder,
    ParallelSampling,
    StaticBatch,
    StepTimePolicy,
)
from tokenlane.runtime.core.step_cost import StepCostModel
from tokenlane.runtime.core.step_plan import ExecutorOutput, ScheduledChunk, StepPlan

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
        num_host_kv_blocks: int = 0,
    ) -> None:
        self.clock = clock
        self.kv = KVCacheManager(
            num_kv_blocks, block_size, config.engine.enable_prefix_caching, num_host_blocks=num_host_kv_blocks
        )
        self.block_size = block_size
        self.max_model_len = max_model_len  # finish with LENGTH when prompt + output reach it
        self.static_batching = not config.engine.continuous_batching
        self.lane_order = LaneOrder(starvation_steps)
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
        # Static batching (engine-wide): the current batch and its members not yet started.
        self.batch = StaticBatch()
        self.lane_batches = LaneBatches()  # per-lane static batching
        self.parallel_sampling = ParallelSampling()
        self.adapter_slots = AdapterSlots(config.engine.lora_slots)  # engine.maxLoras (restart-only)
        # Requests finished since the last plan: the executor drops their state.
        self._finished_for_executor: list[Request] = []
        # Requests finished since the engine last drained them (engine emits final outputs).
        self.newly_finished: list[Request] = []
        self.num_preemptions_total = 0
        # Lane name -> requests started running in the last `schedule()` (for step stats).
        self.last_started: dict[str, int] = {}
        # Lanes' KV shares (maxKvCacheShare, kvCacheReserved); enforced by preemption at the
        # first step after a reload changed them. Every block a request takes or gives back
        # goes through the allocator, which keeps the shares' books with it.
        self.quotas = LaneKVQuotas(num_kv_blocks)
        self.allocator = LaneKVAllocator(self.kv, self.quotas)
        self._quotas_changed = False
        # stepTimeBudget: the cost model, fitted from measured steps, and the policy applying it.
        self.step_cost = StepCostModel()
        self.step_time = StepTimePolicy(self.step_cost)
        self.num_time_capped_steps = 0
        self.apply_config(config)

    @property
    def starvation_steps(self) -> int:
        """Rounds a lane with startable work may get nothing before it goes first once."""
        return self.lane_order.starvation_steps

    @starvation_steps.setter
    def starvation_steps(self, steps: int) -> None:
        self.lane_order.starvation_steps = steps

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
        self.lane_batches.keep_lanes({name for name, lane in lanes.items() if not lane.config.continuous_batching})
        default = lanes[config.default_lane.name]
        for gone in old.values():  # lanes removed by the reload
            for request in gone.waiting_requests():
                gone.remove(request)
                request.lane = default.name
                default.push(request)
        for request in self.requests.values():
            if request.lane not in self.lanes:
                request.lane = default.name
        self.batch.recount()
        self._rerank()
        shares = {name: (lane.budgets.max_kv_cache_share, lane.budgets.kv_cache_reserved) for name, lane in lanes.items()}
        self._quotas_changed = shares != getattr(self, "_kv_shares", None)
        self._kv_shares = shares
        # (re-books the block holders: running requests of a removed lane moved lanes)
        self.allocator.configure({name: lane.budgets for name, lane in lanes.items()}, self.running)

    # ------------------------------------------------------------------ queries

    # Queries below may run on the event-loop thread while a step runs in the worker thread:
    # they only read counters and replace-only dicts, never iterate a structure in flux.

    @property
    def num_waiting(self) -> int:
        return sum(lane.num_waiting for lane in self.lanes.values()) + len(self.batch.waiting)

    def num_waiting_in(self, lane_name: str) -> int:
        lane = self.lanes.get(lane_name)
        n = lane.num_waiting if lane is not None else 0
        return n + self.batch.waiting_per_lane.get(lane_name, 0)

    def time_capped_last_step(self, lane_name: str) -> bool:
        """Whether the step-time budget shortened or skipped the lane's work in the step
        planned last."""
        lane = self.lanes.get(lane_name)
        return lane is not None and lane.last_capped_step == self.step_time.step_index - 1

    def kv_blocks_held(self) -> dict[str, int]:
        """KV block-table entries held per lane (the allocator's books, exact at all times)."""
        return dict(self.quotas.held)

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
                self.lane_batches.arrived(request)
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
            self.batch.leave(request, was_waiting=False)
        elif not lane.remove(request):
            self.batch.leave(request, was_waiting=True)
        self.lane_batches.forget(request)
        self.allocator.free(request)
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
        self.kv.begin_step()
        self._expire(now)
        if self._running_dirty:
            self._compact_running()
        plan = StepPlan()
        if self._finished_for_executor:
            plan.finished = self._finished_for_executor
        if self._quotas_changed:
            self._enforce_kv_quotas(plan)
        quota_preemptions = len(plan.preempted)
        budget = self.step_time.begin_step(self.sched.step_time_budget == "auto", self.lanes.values())
        timed = budget.active
        if timed:
            budget.prefill_priority = self._prefill_priority([])
        sched = self.sched
        token_budget = sched.max_batched_tokens
        lanes = self.lanes
        for lane in lanes.values():
            lane.tokens_left = lane.budgets.max_batched_tokens
        scheduled: set[str] = set()
        # One list in batch order: `mixed` serves the running set in rank order; decode-first
        # serves its decodes in rank order, then its prefill chunks; starts come last.
        chunks: list[ScheduledChunk] = []

        # --- the running set, in rank order: one rule for decodes and prefill chunks
        decode_first = sched.policy != "mixed"
        prefills_after_decodes: list[tuple[int, Request]] = []
        # A plain decode (no step-time cap, no sequence group) is `_serve` with every policy
        # silent: n = 1 if both token budgets have a token left, and the allocator is called
        # only when its last block is full. Spelled out here, it costs no call per request;
        # one the allocator refuses goes on to `_serve`, which preempts for it.
        plain_decodes = not timed
        bs = self.block_size
        allocate = self.allocator.allocate
        chunks_append = chunks.append
        scheduled_add = scheduled.add
        for index, request in enumerate(self.running):
            if request.status is not RUNNING or request.awaits_fork:
                continue  # preempted earlier in this loop, or a follower not forked yet
            start = request.num_computed_tokens
            remaining = len(request.prompt_token_ids) + len(request.output_token_ids) - start
            if remaining == 1 and plain_decodes and request.group is None:
                lane = lanes[request.lane]
                if token_budget < 1 or lane.tokens_left < 1:
                    continue
                if start < len(request.block_ids) * bs or allocate(request, 1, request.lane) is not None:
                    chunks_append(ScheduledChunk(request, start, 1, True))
                    scheduled_add(request.request_id)
                    lane.tokens_left -= 1
                    token_budget -= 1
                    continue
            if decode_first and remaining > 1:
                prefills_after_decodes.append((index, request))
                continue
            token_budget -= self._serve(index, request, token_budget, scheduled, chunks, plan, now)
        if timed:
            budget.prefill_priority = max(budget.prefill_priority, self._prefill_priority(prefills_after_decodes))
        for index, request in prefills_after_decodes:
            if request.status is RUNNING:
                token_budget -= self._serve(index, request, token_budget, scheduled, chunks, plan, now)
        for lane in lanes.values():  # the running requests' share, for fair-share clocks
            served = lane.budgets.max_batched_tokens - lane.tokens_left
            if served:
                LaneOrder.charge(lane, served)

        # --- waiting requests start (not in a step that had to preempt: memory is short)
        LaneOrder.catch_up_idle(lanes.values())
        if len(plan.preempted) == quota_preemptions:
            token_budget = self._admit(token_budget, scheduled, chunks, plan, now)

        plan.chunks = chunks
        plan.kv_offloads, plan.kv_restores = self.kv.take_transfers()
        plan.num_batched_tokens = sched.max_batched_tokens - token_budget
        if plan.chunks:
            self._finished_for_executor = []
        if budget.capped:
            self.num_time_capped_steps += 1
        self.step_time.end_step()
        return plan

    def _serve(
        self,
        index: int,
        request: Request,
        token_budget: int,
        scheduled: set[str],
        chunks: list[ScheduledChunk],
        plan: StepPlan,
        now: float,
    ) -> int:
        """Schedule the next chunk of running request `running[index]`, a decode or a prefill
        chunk alike: n = min(its remaining tokens, its lane's chunk size, the step's and the
        lane's token budgets), capped by the step-time budget; its blocks come from one
        allocator call, after preempting lower-ranked requests if the lane lacks room.
        Returns n (0: nothing scheduled; a decode that cannot grow was preempted)."""
        lane = self.lanes[request.lane]
        start = request.num_computed_tokens
        remaining = len(request.prompt_token_ids) + len(request.output_token_ids) - start
        is_decode = remaining == 1
        if is_decode:  # (the same min, spelled out for the most common case)
            n = 1 if token_budget >= 1 and lane.tokens_left >= 1 else 0
        else:
            n = min(remaining, lane.budgets.prefill_chunk_size, token_budget, lane.tokens_left)
        if n <= 0:
            return 0
        step_time = self.step_time
        budget = step_time.budget
        if not is_decode:
            n = step_time.chunk(lane, start, n)
            if n <= 0:
                return 0
        elif budget.cap_s is not None:  # the step-time budget is on
            if step_time.may_skip_decode(request, lane, now):
                budget.capped = True
                step_time.note_capped(lane)
                return 0
            budget.add(start, 1)
        # Most steps of a request need no new block (a decode inside its last block): the
        # allocator is only called when the table grows, or a shared block must be copied.
        if start + n > len(request.block_ids) * self.block_size or request.group is not None:
            allocator = self.allocator
            # (a parallel-sampling sequence writing into a block its group shares gets its copy here)
            if allocator.allocate(request, n, lane.name, block_copies=plan.block_copies) is None:
                # The lane lacks room: preempt lower-ranked requests for it, then try again.
                need = allocator.blocks_needed(request, n)
                if not self._make_room(need, index, scheduled, plan, lane=lane.name):
                    if is_decode:
                        self._preempt(request, plan)  # nothing lower-ranked to evict: it gives way
                        return 0
                    # Take what fits rather than nothing (the chunk shrinks to the lane's room).
                    n = min(n, allocator.tokens_in_room(request, lane.name) - start)
                    if n <= 0:
                        return 0
                blocks = allocator.allocate(request, n, lane.name, block_copies=plan.block_copies)
                assert blocks is not None, (request.request_id, n)
        if not is_decode:
            budget.add(start, n)
        chunks.append(ScheduledChunk(request, start, n, start + n == request.num_tokens))
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
        allocator = self.allocator
        spare_reserves = lane is not None and self.quotas.active
        victim_index = len(running) - 1
        while not allocator.fits(num_blocks, lane):
            while victim_index > index:
                victim = running[victim_index]
                if (
                    victim.status is RUNNING
                    and victim.request_id not in scheduled
                    and not victim.awaits_fork
                    and not (spare_reserves and victim.lane != lane and allocator.within_reserve(victim.lane))
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
        self.allocator.free(request)
        request.status = PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        lane = self.lanes[request.lane]
        lane.num_running -= 1
        self.num_running -= 1
        self._running_dirty = True
        self.num_preemptions_total += 1
        plan.preempted.append(request)
        if request.request_id in self.batch:
            self.batch.requeue(request)
        else:
            lane.push(request)
            self.lane_batches.gave_back(lane)  # a member of a static lane's batch restarts within it
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
        sched = self.sched
        lane_order = self.lane_order
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
        slots = self.adapter_slots
        slots.begin(self.running)
        while candidates and token_budget > 0 and self.num_running < max_active:
            lane = lane_order.first(candidates)
            if self.num_running and self._above_watermark(lane.name, high):
                candidates.remove(lane)  # above its high watermark: none of its prefills start
                continue
            request = lane.peek()
            if not lane.config.continuous_batching and not self.lane_batches.joins(lane, request):
                candidates.remove(lane)  # static lane: its batch is full or still running
                continue
            if self.quotas.active and self.exceeds_lane_capacity(request):
                # Its lane's shares can never hold it (the shares changed since admission).
                self.finish_request(request, RequestStatus.FINISHED_REJECTED, "too_long")
                if not lane.num_waiting:
                    candidates.remove(lane)
                continue
            if not slots.may_start(request):
                candidates.remove(lane)  # its adapter waits for a slot (engine.maxLoras): FIFO in the lane
                continue
            n = self._start(request, lane, token_budget, prefills, now, from_lane=lane)
            if n is None:
                budget = self.step_time.budget
                if budget.active and budget.lane_out_of_time(lane.name):
                    candidates.remove(lane)  # it yields this step's time to higher priorities
                    time_denied.append(lane)
                    continue
                if self._lane_blocked_by_quota(lane.name, request):
                    candidates.remove(lane)  # its own shares stop it, not the pool: others go on
                    continue
                break  # not enough free blocks: stop starting (head-of-line, no skipping)
            scheduled.add(request.request_id)
            slots.started(request)
            started.add(lane.name)
            if not lane.config.continuous_batching:
                self.lane_batches.started(lane, request)
            token_budget -= n
            lane_order.charge(lane, n)
            lane_order.started(lane)
            if (
                not lane.num_waiting
                or lane.num_running >= lane.budgets.max_active_sequences
                or lane.tokens_left <= 0
            ):
                candidates.remove(lane)
        if started:
            for lane in candidates + time_denied:
                if lane.name not in started and lane.num_waiting and lane.tokens_left > 0:
                    lane_order.passed_over(lane)
        return token_budget

    # ---- KV shares of the lanes (kv_quotas.py)

    def _above_watermark(self, lane_name: str, high: float) -> bool:
        """The high watermark, applied to the lane against its own capacity (the pool's
        usage without quotas; never while the lane is inside its reserve)."""
        return self.allocator.usage_of(lane_name) >= high

    def lane_kv_usage(self, lane_name: str) -> float:
        """The lane's KV usage for the reject watermark (admission): against its own capacity
        with KV shares in force, else the pool's."""
        if not self.quotas.active:
            return self.kv.usage
        return self.allocator.usage_of(lane_name)

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

    def _prefill_priority(self, running_prefills: list[tuple[int, Request]]) -> int:
        """The highest priority among lanes with prefill work this step (running prefills,
        or waiting requests that may start)."""
        lanes = self.lanes
        return StepTimePolicy.prefill_priority(
            lanes.values(), (lanes[r.lane] for _, r in running_prefills), self.lane_batches.closed
        )

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
        restore = kv.find_host_prefix(request, len(cached), cache_limit)
        hit_tokens = (len(cached) + len(restore)) * self.block_size
        todo = request.num_tokens - hit_tokens
        n = min(todo, lane.budgets.prefill_chunk_size, token_budget, lane.tokens_left)
        starved = lane.starved_steps >= self.lane_order.starvation_steps
        n = self.step_time.chunk(lane, hit_tokens, n, starting=True, starved=starved)
        if n <= 0:
            return None
        group = request.group
        starts_group = group is not None and not group.forked and group.leader is request
        if starts_group and not self._group_fits(
            group, lane, self.allocator.blocks_needed(request, n, cached, len(restore))
        ):
            return None
        if self.allocator.allocate(request, n, lane.name, cached, restore) is None:
            return None
        if from_lane is not None:
            from_lane.pop()
        if first_time and cache_limit != 0:  # a lookup it may not use is not a query
            kv.record_prefix_query(request, cached, restore)
        self.step_time.budget.add(request.num_computed_tokens, n)
        self._insert_running(request, lane, now)
        started = self.last_started
        started[lane.name] = started.get(lane.name, 0) + 1
        start = request.num_computed_tokens
        prefills.append(ScheduledChunk(request, start, n, start + n == request.num_tokens))
        lane.tokens_left -= n
        if starts_group:
            self._start_unforked_followers(request, lane, now)
        return n

    def _insert_running(self, request: Request, lane: Lane, now: float) -> None:
        """Put a starting request (or an unforked follower) into the running set, after the
        running requests of its lane's priority (ranks: lane priority, then start order)."""
        if self._running_dirty:  # drop stale entries first: a request must not be in twice
            self._compact_running()
        request.status = RUNNING
        if request.first_scheduled_time is None:
            request.first_scheduled_time = now
        lane.num_running += 1
        self.num_running += 1
        key = (-lane.config.priority, next(self._rank_seq))
        pos = bisect.bisect(self._rank, key)
        self._rank.insert(pos, key)
        self.running.insert(pos, request)
        self._rank_of[request.request_id] = key

    def _admit_static(
        self, token_budget: int, scheduled: set[str], prefills: list[ScheduledChunk], now: float
    ) -> int:
        """Static batching: start the batch's waiting members (forming the next batch once the
        previous one has completely finished)."""
        batch = self.batch
        batch.form(self.lanes.values(), self.lane_order, self.sched.max_active_sequences)
        high = self.sched.kv_cache_high_watermark
        slots = self.adapter_slots
        slots.begin(self.running)
        while token_budget > 0 and (request := batch.next_waiting()) is not None:
            if self.quotas.active and self.exceeds_lane_capacity(request):
                self.finish_request(request, RequestStatus.FINISHED_REJECTED, "too_long")
                continue
            if self.num_running and self._above_watermark(request.lane, high):
                break
            if not slots.may_start(request):
                break  # its adapter waits for a slot (engine.maxLoras)
            lane = self.lanes[request.lane]
            n = self._start(request, lane, token_budget, prefills, now, from_lane=None)
            if n is None:
                break
            slots.started(request)
            batch.started(request)
            scheduled.add(request.request_id)
            LaneOrder.charge(lane, n)
            token_budget -= n
        return token_budget

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
                self._fork(group, plan)
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
        """Whether a leader may start now (sched_policies.ParallelSampling.group_fits)."""
        return self.parallel_sampling.group_fits(
            len(group.members),
            leader_blocks,
            num_running=self.num_running,
            max_active=self.sched.max_active_sequences,
            lane_running=lane.num_running,
            lane_max_active=lane.budgets.max_active_sequences,
            fits_blocks=lambda num_blocks: self.allocator.fits(num_blocks, lane.name),
            capacity=self.quotas.capacity(lane.name) if self.quotas.active else None,
        )

    def _start_unforked_followers(self, leader: Request, lane: Lane, now: float) -> None:
        in_batch = leader.request_id in self.batch
        for follower in leader.group.members[1:]:
            if follower.status is not WAITING:
                continue  # finished already (cancelled)
            self._insert_running(follower, lane, now)
            if in_batch:
                self.batch.join(follower)

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

    def _fork(self, group, plan: StepPlan) -> None:
        """The leader computed every prompt token but the last: each waiting follower takes
        its share of the leader's blocks and continues from there as a decode. A follower
        whose lane's KV cap cannot take its share (shared entries count per holder) gives way,
        as a decode that cannot grow does: it waits in its lane's queue and later computes
        its prompt itself."""
        leader = group.leader
        group.forked = True
        for follower in group.members[1:]:
            follower.awaits_fork = False
            if follower.is_finished:
                continue
            assert follower.status is RUNNING, (follower.request_id, follower.status)
            if self.allocator.fork(leader, follower, group.fork_tokens) is None:
                self._preempt(follower, plan)
                continue
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
        self.lane_batches.forget(request)
        self.allocator.free(request)
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
        running = [r for r in self.running if r.status is RUNNING]
        self.allocator.check_invariants(live, running)
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
        self.batch.check_invariants(self.lanes)
        assert self._rank == sorted(self._rank)
        assert len(self._rank) == len(self.running)
        for key, r in zip(self._rank, self.running):
            if r.status is RUNNING:
                assert self._rank_of[r.request_id] == key
