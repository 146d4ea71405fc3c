"""The router's pick policy: table-driven cases and hypothesis properties (never a down
replica, affinity stable while the set is unchanged, about 1/N of the keys move when one
replica leaves), plus the request facts it hashes and estimates."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from property_examples import examples

from tokenlane.runtime.fleet.pick import (
    AFFINITY,
    LEAST_LOADED,
    LaneLoad,
    Pick,
    PickPolicy,
    Refusal,
    ReplicaView,
    affine_replica,
    affinity_key,
    estimate_prompt_tokens,
    pick,
    saturation,
)

A, B, C = "http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.3:8000"


def replica(url: str, waiting: float = 0, running: float = 0, *, lane: str = "interactive", healthy: bool = True,
            kv: float = 0.1, cap: float = 8, reject: float = 0.95, other_lanes=None, dispatched=None) -> ReplicaView:
    lanes = {lane: LaneLoad(waiting=waiting, running=running, max_waiting=cap, max_running=16)}
    lanes.update(other_lanes or {})
    return ReplicaView(url, healthy, lanes, kv_usage=kv, kv_reject_watermark=reject, dispatched=dispatched or {})


def key_for(url: str, urls: list[str], lane_hint: str = "") -> bytes:
    """A prompt key whose affine replica among `urls` is `url`."""
    for i in range(10_000):
        key = f"{lane_hint}system prompt {i}".encode()
        if affine_replica(urls, key) == url:
            return key
    raise AssertionError("no key found")


KEY_A = key_for(A, [A, B, C])


@pytest.mark.parametrize("name, replicas, exclude, expected", [
    ("affine replica when loads are close", [replica(A, 2), replica(B, 0), replica(C, 1)], (), Pick(A, AFFINITY)),
    ("affine replica at exactly the slack", [replica(A, 4), replica(B, 0), replica(C, 0)], (), Pick(A, AFFINITY)),
    ("affine replica much more loaded: least loaded wins",
     [replica(A, 6), replica(B, 1), replica(C, 3)], (), Pick(B, LEAST_LOADED)),
    ("requests sent since the last scrape count as queued",
     [replica(A, 0, dispatched={"interactive": 6}), replica(B, 1), replica(C, 1, running=16)], (), Pick(B, LEAST_LOADED)),
    ("occupancy breaks ties among equal queues",
     [replica(A, 9, cap=16), replica(B, 0, running=15, kv=0.2), replica(C, 0, running=2, kv=0.3)], (),
     Pick(C, LEAST_LOADED)),
    ("affine replica down: rehash among the others", [replica(A, healthy=False), replica(B), replica(C)], (),
     Pick(affine_replica([B, C], KEY_A), AFFINITY)),
    ("affine replica already tried: never again", [replica(A), replica(B), replica(C)], (A,),
     Pick(affine_replica([B, C], KEY_A), AFFINITY)),
    ("affine replica's lane queue full: skipped", [replica(A, 8), replica(B, 7), replica(C, 8)], (),
     Pick(B, AFFINITY if affine_replica([B], KEY_A) == B else LEAST_LOADED)),
    ("another lane's queue does not count against this lane",
     [replica(A, 0, other_lanes={"batch": LaneLoad(waiting=5, max_waiting=64)}), replica(B), replica(C)], (),
     Pick(A, AFFINITY)),
    ("every lane queue full: 429", [replica(A, 8), replica(B, 8), replica(C, 9)], (),
     Refusal(429, "queue_full", "every replica's queue for lane 'interactive' is full", 1.0)),
    ("global queue full (sum of lanes): 429",
     [replica(u, 1, cap=8, other_lanes={"batch": LaneLoad(waiting=7, max_waiting=8)}) for u in (A, B, C)], (),
     Refusal(429, "queue_full", "every replica's queue for lane 'interactive' is full", 1.0)),
    ("every KV cache over the reject watermark: 503", [replica(u, kv=0.96) for u in (A, B, C)], (),
     Refusal(503, "kv_watermark", "every replica's KV cache is at its reject watermark for lane 'interactive'", 1.0)),
    ("nothing healthy: 503", [replica(u, healthy=False) for u in (A, B, C)], (),
     Refusal(503, "no_healthy_replica", "no healthy replica is available", 5.0)),
    ("every replica tried: 503", [replica(A), replica(B), replica(C)], (A, B, C),
     Refusal(503, "no_healthy_replica", "no healthy replica is available", 5.0)),
    ("no replicas at all: 503", [], (), Refusal(503, "no_healthy_replica", "no healthy replica is available", 5.0)),
])
def test_pick_table(name, replicas, exclude, expected):
    assert pick(replicas, "interactive", KEY_A, PickPolicy(affinity_slack=4), frozenset(exclude)) == expected


def test_without_a_lane_every_lanes_load_counts():
    busy = replica(A, 0, other_lanes={"batch": LaneLoad(waiting=30, max_waiting=64)})
    got = pick([busy, replica(B), replica(C)], None, KEY_A, PickPolicy(affinity_slack=4))
    assert got.url != A and got.reason == LEAST_LOADED


def test_a_lane_the_replica_does_not_report_counts_as_empty():
    got = pick([replica(A, 0), replica(B), replica(C)], "new-lane", KEY_A)
    assert isinstance(got, Pick)


def test_policy_validation():
    with pytest.raises(ValueError, match="affinity_slack"):
        PickPolicy(affinity_slack=-1)


# --------------------------------------------------------------------------- properties

URLS = [f"http://10.1.0.{i}:8000" for i in range(1, 9)]
lane_loads = st.builds(LaneLoad, waiting=st.integers(0, 20), running=st.integers(0, 16),
                       max_waiting=st.one_of(st.none(), st.integers(1, 16)), max_running=st.just(16))
views = st.lists(
    st.builds(ReplicaView, url=st.sampled_from(URLS), healthy=st.booleans(),
              lanes=st.fixed_dictionaries({"interactive": lane_loads, "batch": lane_loads}),
              kv_usage=st.floats(0, 1), kv_reject_watermark=st.one_of(st.none(), st.just(0.95)),
              dispatched=st.fixed_dictionaries({"interactive": st.integers(0, 5)})),
    max_size=8, unique_by=lambda v: v.url)
keys = st.binary(max_size=64)


@settings(max_examples=examples(100, thorough_run=400), deadline=None)
@given(replicas=views, lane=st.sampled_from(["interactive", "batch", None]), key=keys,
       exclude=st.frozensets(st.sampled_from(URLS)), slack=st.floats(0, 10))
def test_never_picks_a_down_tried_or_saturated_replica(replicas, lane, key, exclude, slack):
    got = pick(replicas, lane, key, PickPolicy(affinity_slack=slack), exclude)
    by_url = {r.url: r for r in replicas}
    if isinstance(got, Pick):
        chosen = by_url[got.url]
        assert chosen.healthy and got.url not in exclude
        assert saturation(chosen, lane) is None
    else:
        assert got.status in (429, 503) and got.retry_after_s > 0
        if got.code == "no_healthy_replica":
            assert not any(r.healthy and r.url not in exclude for r in replicas)


@settings(max_examples=examples(50, thorough_run=200), deadline=None)
@given(replicas=views, key=keys)
def test_same_inputs_same_pick_whatever_the_order(replicas, key):
    assert pick(replicas, "interactive", key) == pick(list(reversed(replicas)), "interactive", key)


@settings(max_examples=examples(20, thorough_run=50), deadline=None)
@given(n=st.integers(2, 8), leaving=st.integers(0, 7), salt=st.binary(max_size=8))
def test_about_one_nth_of_keys_move_when_a_replica_leaves(n, leaving, salt):
    urls = URLS[:n]
    gone = urls[leaving % n]
    rest = [u for u in urls if u != gone]
    keys = [salt + f"prefix-{i}".encode() for i in range(2000)]
    before = {k: affine_replica(urls, k) for k in keys}
    after = {k: affine_replica(rest, k) for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    # Exactly the keys of the replica that left move, and nothing else.
    assert all(before[k] == gone for k in moved)
    assert len(moved) == sum(1 for k in keys if before[k] == gone)
    assert len(moved) / len(keys) <= 1 / n + 0.05  # ~1/N: rendezvous hashing spreads keys evenly


def test_keys_spread_evenly_over_replicas():
    counts = {u: 0 for u in URLS[:4]}
    for i in range(4000):
        counts[affine_replica(URLS[:4], f"k{i}".encode())] += 1
    assert min(counts.values()) > 800, counts  # 1000 each on average


# --------------------------------------------------------------------------- request facts

SYSTEM = "You are a helpful assistant. " * 20  # 580 characters


def test_shared_system_prompt_gives_one_key():
    one = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}]}
    two = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "what is 2+2?"}]}
    other = {"messages": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "hi"}]}
    assert affinity_key(one, True, 256) == affinity_key(two, True, 256) != affinity_key(other, True, 256)
    assert len(affinity_key(one, True, 256)) == 256


@pytest.mark.parametrize("body, chat, key", [
    ({"prompt": "abcdef"}, False, b"abc"),
    ({"prompt": ["abcdef", "zzz"]}, False, b"abc"),
    ({"prompt": [1, 22, 333]}, False, b"1,2"),
    ({"prompt": [[5, 6], [7]]}, False, b"5,6"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "hey"}]}]}, True, b"use"),
    ({"messages": "oops"}, True, b""),
    (None, False, b""),
    ({"prompt": None}, False, b""),
])
def test_affinity_key_shapes(body, chat, key):
    assert affinity_key(body, chat, 3) == key


@pytest.mark.parametrize("body, chat, tokens", [
    ({"prompt": "x" * 400}, False, 100),
    ({"prompt": list(range(37))}, False, 37),
    ({"prompt": ["x" * 40, "y" * 800]}, False, 200),
    ({"prompt": [[1, 2], [3, 4, 5]]}, False, 3),
    ({"messages": [{"role": "system", "content": "x" * 80}, {"role": "user", "content": "y" * 40}]}, True, 38),
    ({"messages": None}, True, 0),
    ("not a dict", False, 0),
])
def test_prompt_token_estimate(body, chat, tokens):
    assert estimate_prompt_tokens(body, chat) == tokens
