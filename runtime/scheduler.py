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
   Inside a lane: earliest deadline, then request priority, then arrival.
   A starting request takes the longest cached prefix of its tokens from the prefix cache,
   except the positions whose logits it needs for prompt logprobs (it computes those).

The result is a `StepPlan`; the executor's `ExecutorOutput` comes back through
`update_from_output`, which appends sampled tokens (and their logprobs, and the prompt
logprobs a chunk scored), applies stop conditions and registers newly full blocks in the
prefix cache.

`continuousBatching: false` (static batching): a batch of up to maxActiveSequences waiting
requests is picked when the previous batch has completely finished, and no other request
starts until every member of the batch has finished.
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
from tokenlane.runtime.kv_cache import KVCacheManager
from tokenlane.runtime.lanes import Lane
from tokenlane.runtime.plan import ExecutorOutput, ScheduledChunk, StepPlan
from tokenlane.runtime.request import Request, RequestStatus

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
        # Requests finished since the last plan: the executor drops their state.
        self._finished_for_executor: list[Request] = []
        # Requests finished since the engine last drained them (engine emits final outputs).
        self.newly_finished: list[Request] = []
        self.num_preemptions_total = 0
        # Lane name -> requests started running in the last `schedule()` (for step stats).
        self.last_started: dict[str, int] = {}
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

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ------------------------------------------------------------------ requests in

    def add_request(self, request: Request) -> None:
        """Queue an admitted request (admission checks happen before, in admission.py)."""
        assert request.request_id not in self.requests, f"duplicate id {request.request_id}"
        assert request.lane in self.lanes, f"unknown lane {request.lane}"
        request.status = WAITING
        self.requests[request.request_id] = request
        self.lanes[request.lane].push(request)
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
        elif not lane.remove(request) and request.request_id in self._batch:
            try:
                self._batch_waiting.remove(request)
                self._count_batch_waiting(request.lane, -1)
            except ValueError:
                pass
        self._batch.discard(request.request_id)
        self.kv.free(request)
        request.finish(status, detail, now=self.clock())
        del self.requests[request.request_id]
        if request.first_scheduled_time is not None:
            self._finished_for_executor.append(request)
        self.newly_finished.append(request)

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
            if request.status is not RUNNING:
                continue  # preempted earlier in this loop
            computed = request.num_computed_tokens
            remaining = len(request.prompt_token_ids) + len(request.output_token_ids) - computed
            if remaining == 1:  # a decode
                lane = lanes[request.lane]
                if lane.tokens_left < 1 or token_budget < 1:
                    continue
                if computed >= len(request.block_ids) * bs:  # needs one more block
                    if not self._make_room(1, index, scheduled, plan):
                        self._preempt(request, plan)
                        continue
                    kv.append_block(request)
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
        if not plan.preempted:
            token_budget = self._admit(token_budget, scheduled, prefills, plan, now)

        if not mixed:
            decodes.extend(prefills)  # batch order: decodes, then prefill chunks
        plan.chunks = decodes
        plan.num_batched_tokens = sched.max_batched_tokens - token_budget
        if plan.chunks:
            self._finished_for_executor = []
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
        if n <= 0:
            return 0
        kv = self.kv
        need = kv.num_blocks_to_allocate(request, n)
        if not kv.can_allocate(need) and not self._make_room(need, index, scheduled, plan):
            # Take what fits rather than nothing (the chunk shrinks to the free blocks).
            room = (len(request.block_ids) + kv.num_free_blocks) * self.block_size
            n = min(n, room - request.num_computed_tokens)
            if n <= 0:
                return 0
        kv.allocate(request, n)
        start = request.num_computed_tokens
        prefills.append(ScheduledChunk(request, start, n, start + n == request.num_tokens))
        scheduled.add(request.request_id)
        lane.tokens_left -= n
        return n

    def _make_room(self, num_blocks: int, index: int, scheduled: set[str], plan: StepPlan) -> bool:
        """Preempt lowest-ranked running requests after `index` not yet scheduled this step
        until `num_blocks` blocks are free. False if that is not possible."""
        kv = self.kv
        running = self.running
        victim_index = len(running) - 1
        while not kv.can_allocate(num_blocks):
            while victim_index > index:
                victim = running[victim_index]
                if victim.status is RUNNING and victim.request_id not in scheduled:
                    break
                victim_index -= 1
            else:
                return False
            self._preempt(running[victim_index], plan)
            victim_index -= 1
        return True

    def _preempt(self, request: Request, plan: StepPlan) -> None:
        """Evict by recompute: free the blocks, back to the head of the lane's queue."""
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
        while candidates and token_budget > 0 and self.num_running < max_active:
            if kv.usage >= high and self.num_running:
                break  # above the high watermark: no new prefills start
            lane = min(candidates, key=self._lane_order)
            request = lane.peek()
            n = self._start(request, lane, token_budget, prefills, now, from_lane=lane)
            if n is None:
                break  # not enough free blocks: stop starting (head-of-line, no skipping)
            scheduled.add(request.request_id)
            started.add(lane.name)
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
            for lane in candidates:
                if lane.name not in started and lane.num_waiting and lane.tokens_left > 0:
                    lane.starved_steps += 1
        return token_budget

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
        if n <= 0:
            return None
        if not kv.can_allocate(kv.num_blocks_to_allocate(request, n, cached)):
            return None
        if from_lane is not None:
            from_lane.pop()
        if first_time and cache_limit != 0:  # a lookup it may not use is not a query
            kv.record_prefix_query(request, cached)
        kv.allocate(request, n, cached)
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
        return n

    def _admit_static(
        self, token_budget: int, scheduled: set[str], prefills: list[ScheduledChunk], now: float
    ) -> int:
        if not self._batch:
            self._form_batch()
        high = self.sched.kv_cache_high_watermark
        while self._batch_waiting and token_budget > 0:
            request = self._batch_waiting[0]
            if self.kv.usage >= high and self.num_running:
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
            request = lane.pop()
            self._batch.add(request.request_id)
            self._batch_waiting.append(request)
            self._count_batch_waiting(request.lane, 1)
            taken[lane.name] = taken.get(lane.name, 0) + 1
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
        self.kv.free(request)
        request.finish(status, detail, now=self.clock())
        del self.requests[request.request_id]
        self.newly_finished.append(request)

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
        assert waiting + self.num_running == len(live), (waiting, self.num_running, len(live))
        for name in self.lanes:
            n = sum(1 for r in self._batch_waiting if r.lane == name)
            assert self._batch_waiting_per_lane.get(name, 0) == n, name
        assert self._rank == sorted(self._rank)
        assert len(self._rank) == len(self.running)
        for key, r in zip(self._rank, self.running):
            if r.status is RUNNING:
                assert self._rank_of[r.request_id] == key
