"""The lane-aware KV allocator (runtime/core/kv_allocator.py): one `allocate` call per request
and step charges the lane's KV share, `free` releases it, so the quota books equal a recount
after every operation without the scheduler keeping any; and every unmet reserve stays free
whatever the lanes share through the prefix cache."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenlane.runtime.config import LaneBudgets
from tokenlane.runtime.core.kv_allocator import LaneKVAllocator
from tokenlane.runtime.core.kv_cache import KVCacheManager
from tokenlane.runtime.core.kv_quotas import LaneKVQuotas
from tokenlane.runtime.core.request import Request, RequestStatus, SamplingParams, SequenceGroup

from property_examples import examples

LANES = ("a", "b", "c")


def budgets(share: float, reserved: float) -> LaneBudgets:
    return LaneBudgets(
        max_active_sequences=8, max_batched_tokens=64, prefill_chunk_size=64, max_waiting_requests=8,
        queue_timeout_ms=1000, max_kv_cache_share=share, kv_cache_reserved=reserved,
    )


def make(num_blocks: int, block_size: int, shares: dict[str, tuple[float, float]]) -> LaneKVAllocator:
    quotas = LaneKVQuotas(num_blocks)
    allocator = LaneKVAllocator(KVCacheManager(num_blocks, block_size), quotas)
    allocator.configure({name: budgets(*shares[name]) for name in LANES}, [])
    return allocator


def request(rid: str, lane: str, n_prompt: int) -> Request:
    return Request(rid, [7] * n_prompt, SamplingParams(max_tokens=4), lane=lane)


def test_allocate_charges_the_lane_and_free_releases_it():
    allocator = make(10, 4, {"a": (0.5, 0.0), "b": (1.0, 0.2), "c": (1.0, 0.0)})
    r = request("r", "a", 9)
    assert allocator.allocate(r, 9, "a") == r.block_ids and len(r.block_ids) == 3
    assert allocator.quotas.held["a"] == 3
    assert allocator.allocate(r, 3, "a") == []  # the table already covers 12 tokens
    r.num_computed_tokens = 12
    # Its cap is 5 blocks: 8 more tokens (2 blocks) fit, 12 (3 blocks) do not, and nothing changes.
    assert allocator.allocate(r, 12, "a") is None
    assert len(r.block_ids) == 3 and allocator.quotas.held["a"] == 3
    assert len(allocator.allocate(r, 8, "a")) == 2
    allocator.free(r)
    allocator.free(r)  # idempotent
    assert allocator.quotas.held["a"] == 0 and allocator.kv.num_free_blocks == 10


def test_a_lane_cannot_take_another_lanes_unmet_reserve():
    allocator = make(10, 1, {"a": (1.0, 0.0), "b": (1.0, 0.3), "c": (1.0, 0.0)})
    r = request("r", "a", 10)
    assert allocator.allocate(r, 10, "a") is None  # 3 of the 10 blocks are b's
    assert allocator.allocate(r, 7, "a") is not None
    other = request("o", "b", 3)
    assert allocator.allocate(other, 3, "b") is not None  # its reserve was kept free


def test_a_reserve_is_kept_free_although_its_lane_shares_another_lanes_prefix():
    """Blocks a lane shares with another lane do not count for its reserve: when it lets go of
    them they stay taken, so they could not stand in for the free blocks the reserve keeps."""
    allocator = make(10, 1, {"a": (1.0, 0.0), "b": (1.0, 0.3), "c": (1.0, 0.0)})
    kv, quotas = allocator.kv, allocator.quotas
    a = request("a", "a", 5)
    assert allocator.allocate(a, 5, "a") is not None
    a.num_computed_tokens = 5
    kv.cache_computed_blocks(a)
    b = request("b", "b", 4)
    hits = kv.find_cached_prefix(b)
    assert len(hits) == 3
    assert allocator.allocate(b, 1, "b", hits) is not None  # 3 shared blocks, 1 of its own
    assert quotas.held["b"] == 4 and quotas.owned["b"] == 1 and quotas.unmet("b") == 2
    assert allocator.allocate(a, 4, "a") is None  # would leave b's reserve short once b finishes
    assert allocator.allocate(a, 2, "a") is not None
    allocator.free(b)
    assert kv.num_free_blocks == 3 >= quotas.unmet("b") == 3


def test_a_forked_sequence_copies_its_shared_block_within_its_allocate_call():
    allocator = make(6, 4, {"a": (1.0, 0.0), "b": (1.0, 0.0), "c": (1.0, 0.0)})
    leader, follower = request("l", "a", 7), request("f", "a", 7)
    SequenceGroup.of([leader, follower])
    assert allocator.allocate(leader, 6, "a") is not None  # all prompt tokens but the last
    leader.num_computed_tokens = 6
    allocator.fork(leader, follower, 6)
    assert allocator.quotas.held["a"] == 4  # shared entries count per holder
    assert allocator.blocks_needed(follower, 1) == 1  # its copy of the shared second block
    copies: list[tuple[int, int]] = []
    assert allocator.allocate(follower, 1, "a", block_copies=copies) == []
    (src, dst), = copies
    assert src == leader.block_ids[1] and follower.block_ids == [leader.block_ids[0], dst]
    assert allocator.quotas.held["a"] == 4 and allocator.kv.num_free_blocks == 3
    assert allocator.allocate(leader, 1, "a", block_copies=copies) == [] and len(copies) == 1  # no longer shared
    for r in (leader, follower):
        allocator.free(r)
    assert allocator.kv.num_free_blocks == 6 and allocator.quotas.held["a"] == 0


@st.composite
def scenarios(draw):
    shares = {
        name: (draw(st.sampled_from([0.3, 0.5, 1.0])), draw(st.sampled_from([0.0, 0.1, 0.2])))
        for name in LANES
    }
    ops = draw(st.lists(
        st.tuples(st.sampled_from(["new", "hit", "grow", "free", "fork"]), st.integers(0, 50), st.integers(1, 12)),
        min_size=1, max_size=60,
    ))
    return draw(st.integers(4, 40)), draw(st.sampled_from([1, 2, 4])), shares, ops


@settings(max_examples=examples(80, thorough_run=800), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_the_quota_books_always_equal_a_recount(scenario):
    num_blocks, block_size, shares, ops = scenario
    allocator = make(num_blocks, block_size, shares)
    kv, quotas = allocator.kv, allocator.quotas
    live: list[Request] = []
    for i, (op, pick, tokens) in enumerate(ops):
        if op in ("new", "hit"):
            # All prompts are 7s: a "hit" takes the longest cached prefix, whoever holds it.
            r = request(f"r{i}", LANES[pick % 3], tokens)
            hits = kv.find_cached_prefix(r) if op == "hit" else []
            before = (kv.num_free_blocks, dict(quotas.held))
            got = allocator.allocate(r, tokens - len(hits) * block_size, r.lane, hits)
            if got is None:
                assert (kv.num_free_blocks, dict(quotas.held)) == before and not r.block_ids
            else:
                r.status = RequestStatus.RUNNING
                live.append(r)
        elif live and op == "grow":
            r = live[pick % len(live)]
            r.num_computed_tokens = len(r.block_ids) * block_size  # its blocks are full
            kv.cache_computed_blocks(r)
            held = len(r.block_ids)
            got = allocator.allocate(r, tokens, r.lane)
            assert got is None or r.block_ids[held:] == got
        elif live and op == "free":
            allocator.free(live.pop(pick % len(live)))
        elif live and op == "fork":
            parent = live[pick % len(live)]
            shared = kv.blocks_for_tokens(parent.num_computed_tokens)
            # The scheduler starts a group only with room for it (ParallelSampling.group_fits).
            if parent.num_computed_tokens and quotas.held[parent.lane] + shared <= quotas.cap[parent.lane]:
                child = request(f"c{i}", parent.lane, parent.num_prompt_tokens)
                allocator.fork(parent, child, parent.num_computed_tokens)
                child.status = RequestStatus.RUNNING
                live.append(child)
        held = dict.fromkeys(LANES, 0)
        for r in live:
            held[r.lane] += len(r.block_ids)
        assert held == {name: quotas.held.get(name, 0) for name in LANES}
        allocator.check_invariants(live, live)  # pool books, caps, reserves kept free
        # Free enough for every reserve even if each lane's blocks held by others stay held.
        unmet = sum(max(0, quotas.reserve[name] - held[name]) for name in LANES)
        assert kv.num_free_blocks >= unmet
    for r in live:
        allocator.free(r)
    assert kv.num_free_blocks == num_blocks and not any(quotas.held.values())


def test_shares_brought_in_and_out_by_reload_rebook_the_holders():
    """Without KV shares only the per-lane counts are kept; a reload that brings shares in
    rebuilds the per-block books from the holders (the reserve sees what its lane owns), and
    one that takes them out drops them again, the counts exact throughout."""
    allocator = make(12, 2, {"a": (1.0, 0.0), "b": (1.0, 0.0), "c": (1.0, 0.0)})
    quotas = allocator.quotas
    assert not quotas.active
    ra, rb = request("ra", "a", 6), request("rb", "b", 4)
    allocator.allocate(ra, 6, "a")
    allocator.allocate(rb, 4, "b")
    assert quotas.held == {"a": 3, "b": 2, "c": 0} and not quotas.owned.get("a")
    allocator.check_invariants([ra, rb], [ra, rb])
    allocator.configure({"a": budgets(1.0, 0.0), "b": budgets(1.0, 0.5), "c": budgets(1.0, 0.0)}, [ra, rb])
    assert quotas.active and quotas.owned == {"a": 3, "b": 2, "c": 0} and quotas.unmet("b") == 4
    allocator.check_invariants([ra, rb], [ra, rb])
    ra.num_computed_tokens = 6
    assert allocator.allocate(ra, 8, "a") is None  # 4 more blocks: 7 free, 4 of them b's unmet reserve
    assert len(allocator.allocate(ra, 6, "a")) == 3
    allocator.free(rb)
    allocator.configure({name: budgets(1.0, 0.0) for name in LANES}, [ra])
    assert not quotas.active and quotas.held == {"a": 6, "b": 0, "c": 0}
    allocator.check_invariants([ra], [ra])
    allocator.free(ra)
    assert quotas.held == {"a": 0, "b": 0, "c": 0} and allocator.kv.num_free_blocks == 12
