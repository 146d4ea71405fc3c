"""Property tests: random arrivals, lengths, cancellations, budgets, lanes and tiny KV pools.

Every run drives the real engine (admission + scheduler + block pool) with the strict fake
executor, which checks each chunk's block table and the pretend KV contents. After every
step: budgets hold, the pool's books balance (no block leaked or double-freed). At the end:
every request finished or was rejected with a reason, all blocks are free, no successful
request finished after its deadline, and no lane with work went unserved for longer than the
starvation bound while other lanes were being served. Lanes may have KV shares
(maxKvCacheShare, kvCacheReserved) and TPOT targets under the step-time budget: after every
step no lane holds more than its cap, every unused reserve is free, and the per-lane block
counts equal a recount; a lane held back by its own shares or watermark is not "starved".
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenlane.runtime.core.admission import AdmissionError
from tokenlane.runtime.engine.llm_engine import LLMEngine
from tokenlane.runtime.core.request import Request, RequestStatus, SamplingParams
from tokenlane.runtime.executor.fake import FakeExecutor, fake_logprob, make_config

DT = 0.01  # simulated seconds per step
STARVATION_STEPS = 8


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@st.composite
def scenarios(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    num_blocks = draw(st.integers(3, 40))
    mbt = draw(st.integers(4, 48))
    n_lanes = draw(st.integers(1, 3))
    lanes = []
    for i in range(n_lanes):
        lane = {
            "name": f"lane{i}",
            "priority": draw(st.sampled_from([10, 50, 100])),
            "weight": draw(st.sampled_from([1, 2, 4])),
            "default": i == 0,
        }
        if draw(st.booleans()):
            lane["maxActiveSequences"] = draw(st.integers(1, 6))
        if draw(st.booleans()):
            cap = draw(st.integers(2, mbt))
            lane["maxBatchedTokens"] = cap
            lane["prefillChunkSize"] = draw(st.integers(1, cap))
        if draw(st.booleans()):
            lane["maxWaitingRequests"] = draw(st.integers(1, 10))
        if draw(st.booleans()):
            lane["queueTimeoutMs"] = draw(st.integers(20, 400))
        # KV shares (the three lanes' reserves add up to at most 0.9 < 1).
        share = draw(st.sampled_from([None, 0.3, 0.5, 0.8]))
        if share is not None:
            lane["maxKvCacheShare"] = share
        if draw(st.booleans()):
            lane["kvCacheReserved"] = draw(st.sampled_from([0.1, 0.2, 0.3]))
        # TPOT targets for the step-time budget: 5 ms is below the fake step (always capped).
        tpot = draw(st.sampled_from([None, 5, 50]))
        if tpot is not None:
            lane["slo"] = {"tpotP95Ms": tpot}
        lanes.append(lane)
    high = draw(st.sampled_from([0.5, 0.8, 0.95]))
    config = make_config(
        lanes=lanes,
        block_size=block_size,
        continuous_batching=draw(st.booleans()),
        prefix_caching=draw(st.booleans()),
        max_model_len=draw(st.sampled_from([32, 64, 4096])),
        max_batched_tokens=mbt,
        prefill_chunk_size=draw(st.integers(1, mbt)),
        max_active_sequences=draw(st.integers(1, min(8, mbt))),
        max_waiting_requests=draw(st.integers(1, 30)),
        policy=draw(st.sampled_from(["decode-first", "mixed"])),
        kv_cache_high_watermark=high,
        kv_cache_reject_watermark=draw(st.sampled_from([high + 0.04, 1.0])),
        queue_timeout_ms=draw(st.integers(50, 5000)),
        step_time_budget=draw(st.sampled_from(["off", "auto"])),
    )
    prefixes = [[7, 7, 7, 7, 7, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9]]
    events = []  # per step: (arrivals, cancellations)
    for _ in range(draw(st.integers(1, 30))):
        arrivals = []
        for _ in range(draw(st.integers(0, 3))):
            shared = draw(st.sampled_from([None, 0, 1]))
            tail = draw(st.lists(st.integers(10, 999), min_size=0 if shared is not None else 1,
                                 max_size=24))
            prompt_logprobs = draw(st.sampled_from([None, None, 0, 3]))
            arrivals.append({
                "prompt": (prefixes[shared] if shared is not None else []) + tail,
                "max_tokens": draw(st.integers(0 if prompt_logprobs is not None else 1, 12)),
                "logprobs": draw(st.sampled_from([None, None, 0, 2])),
                "prompt_logprobs": prompt_logprobs,
                "lane": draw(st.integers(0, n_lanes - 1)),
                "priority": draw(st.integers(0, 2)),
                "deadline": draw(st.one_of(st.none(), st.floats(0.0, 0.6))),
                "stop_at": draw(st.one_of(st.none(), st.integers(0, 999))),
            })
        cancels = draw(st.lists(st.integers(0, 10_000), max_size=2))
        events.append((arrivals, cancels))
    return config, num_blocks, events


def _held_back_by_its_shares(sched, name) -> bool:
    """Whether the lane's head cannot start for its own KV shares or watermark."""
    quotas = sched.quotas
    if not quotas.active:
        return False
    lane = sched.lanes[name]
    head = lane.peek()
    if head is None:
        return False
    if sched.num_running and sched._above_watermark(name, sched.sched.kv_cache_high_watermark):
        return True
    chunk = min(head.num_tokens, lane.budgets.prefill_chunk_size)
    return sched.kv.blocks_for_tokens(chunk) > quotas.room(name, sched.kv.num_free_blocks)


def _check_kv_shares(sched) -> None:
    """Quotas never exceeded, reserves never taken, block accounting exact (a recount)."""
    quotas = sched.quotas
    if not quotas.active:
        return
    held = {name: 0 for name in sched.lanes}
    for r in sched.requests.values():
        if r.status is RequestStatus.RUNNING:
            held[r.lane] += len(r.block_ids)
    assert held == {name: quotas.held.get(name, 0) for name in sched.lanes}
    for name, n in held.items():  # an uncapped lane's shared prefix blocks may count past the pool
        cap = quotas.cap[name]
        assert cap >= quotas.num_blocks or n <= cap, f"lane {name} holds {n} blocks, over its cap {cap}"
    unmet = sum(max(0, quotas.reserve[name] - held[name]) for name in held)
    assert sched.kv.num_free_blocks >= unmet, "another lane took a reserve"


def run_scenario(config, num_blocks, events):
    clock = Clock()
    ex = FakeExecutor(num_blocks, config.engine.block_size, vocab_size=1000, max_model_len=None,
                      step_seconds=DT)
    engine = LLMEngine(config, ex, clock=clock)
    engine.scheduler.starvation_steps = STARVATION_STEPS
    sched = engine.scheduler
    requests: list[Request] = []
    rejected: dict[str, str] = {}
    starved = {lane.name: 0 for lane in config.lanes}
    next_id = 0

    def one_step():
        # Who could start before the step (for the starvation bound).
        waiting_before = {
            name: {r.request_id for r in lane.waiting_requests()} for name, lane in sched.lanes.items()
        }
        running_before = {name: lane.num_running for name, lane in sched.lanes.items()}
        # A lane its own KV shares or watermark hold back is not starved by the others.
        quota_blocked = {name: _held_back_by_its_shares(sched, name) for name in sched.lanes}
        outputs = engine.step()
        plan = ex.plans[-1] if ex.plans and engine.last_step_tokens else None
        sched.check_invariants()  # with KV shares: held == recount, caps and reserves kept
        _check_kv_shares(sched)
        # Budgets.
        assert sched.num_running <= config.scheduler.max_active_sequences
        per_lane_tokens = {name: 0 for name in sched.lanes}
        if plan is not None:
            assert plan.num_batched_tokens == sum(c.num_tokens for c in plan.chunks)
            assert plan.num_batched_tokens <= config.scheduler.max_batched_tokens
            for c in plan.chunks:
                budgets = config.lane_budgets(c.request.lane)
                assert c.num_tokens <= budgets.prefill_chunk_size or c.num_tokens == 1
                per_lane_tokens[c.request.lane] += c.num_tokens
        for name, lane in sched.lanes.items():
            budgets = config.lane_budgets(name)
            assert per_lane_tokens[name] <= budgets.max_batched_tokens
            assert lane.num_running <= budgets.max_active_sequences
        # Starvation: a lane that could start something, while another lane did, and didn't.
        if plan is not None and config.engine.continuous_batching:
            started = {
                name: any(c.request.request_id in waiting_before[name] for c in plan.chunks)
                for name in sched.lanes
            }
            for name in sched.lanes:
                budgets = config.lane_budgets(name)
                eligible = (
                    waiting_before[name]
                    and running_before[name] < budgets.max_active_sequences
                    and per_lane_tokens[name] < budgets.max_batched_tokens
                    and not quota_blocked[name]
                )
                others = any(v for k, v in started.items() if k != name)
                if started[name] or not waiting_before[name]:
                    starved[name] = 0
                elif eligible and others:
                    starved[name] += 1
                    assert starved[name] <= STARVATION_STEPS + 1, f"lane {name} starves"
        clock.now += DT
        return outputs

    for arrivals, cancels in events:
        for spec in arrivals:
            next_id += 1
            deadline = None if spec["deadline"] is None else clock.now + spec["deadline"]
            stop = [] if spec["stop_at"] is None else [spec["stop_at"]]
            r = Request(
                f"r{next_id}",
                list(spec["prompt"]),
                SamplingParams(max_tokens=spec["max_tokens"], stop_token_ids=stop, logprobs=spec["logprobs"],
                               prompt_logprobs=spec["prompt_logprobs"]),
                lane=f"lane{spec['lane']}",
                priority=spec["priority"],
                deadline=deadline,
                arrival_time=clock.now,
            )
            requests.append(r)
            try:
                engine.add_request(r)
            except AdmissionError as exc:
                assert exc.reason in ("queue_full", "kv_watermark", "deadline", "too_long", "invalid")
                assert exc.status in (400, 429, 503)
                rejected[r.request_id] = exc.reason
                assert r.status is RequestStatus.FINISHED_REJECTED and r.finish_detail == exc.reason
        for c in cancels:
            if requests:
                engine.abort_request(requests[c % len(requests)].request_id)
        one_step()
    for _ in range(5000):
        if not engine.has_unfinished_requests():
            break
        one_step()
    assert not engine.has_unfinished_requests(), "requests never finished (livelock or starvation)"
    # Every request finished, or was rejected with a reason.
    for r in requests:
        assert r.is_finished, r.request_id
        assert r.finish_reason is not None and r.finish_detail
        # The strict executor's checks fail a request (the engine isolates executor errors),
        # and nothing else can here: an error is a broken invariant.
        assert r.status is not RequestStatus.FINISHED_ERROR, (r.request_id, r.finish_detail)
        if r.request_id in rejected:
            assert r.status is RequestStatus.FINISHED_REJECTED
        assert r.block_ids == []
        if r.deadline is not None and r.status in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH,
        ):
            assert r.finish_time <= r.deadline, "finished successfully after its deadline"
        if r.status is RequestStatus.FINISHED_LENGTH:
            assert r.num_output_tokens == r.sampling_params.max_tokens or r.num_tokens >= engine.max_model_len
        # Outputs are what the model gives, preemptions and prefix hits notwithstanding.
        for i, token in enumerate(r.output_token_ids):
            assert token == ex.token_fn(r.request_id, r.num_prompt_tokens + i)
        # Logprobs: one per output token and, once its prompt is computed, one per prompt
        # token, each once, whatever preemptions and prefix hits happened.
        if r.sampling_params.logprobs is not None:
            assert r.output_logprobs == [
                fake_logprob(r.num_prompt_tokens + i, t) for i, t in enumerate(r.output_token_ids)
            ]
        if r.sampling_params.prompt_logprobs is not None and r.status in (
            RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH
        ):
            prompt = r.prompt_token_ids
            assert r.prompt_logprobs == [None] + [fake_logprob(p, prompt[p + 1]) for p in range(len(prompt) - 1)]
    assert sched.kv.num_free_blocks == sched.kv.num_blocks, "KV blocks leaked"
    sched.kv.check_invariants([])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_scheduler_properties(scenario):
    run_scenario(*scenario)


@pytest.mark.slow
@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_scheduler_properties_many(scenario):
    run_scenario(*scenario)
