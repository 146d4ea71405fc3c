"""The engine on a virtual clock with the simulated executor: determinism and invariants."""

from __future__ import annotations

import dataclasses

from tokenlane.bench import report
from tokenlane.bench.scenarios import lanes_config, production_config
from tokenlane.bench.sim import simulate
from tokenlane.bench.trace import LaneMix, TrafficSpec, build_requests, merge


def small_traffic(seed=0, **kw):
    spec = dict(source="trace", seed=seed, duration_s=20, time_scale=3.0)
    spec.update(kw)
    return build_requests(TrafficSpec(**spec))


def test_deterministic_and_every_request_accounted_for():
    traffic = small_traffic(cancel_share=0.1, lanes=[LaneMix("interactive", 3), LaneMix("batch", 1)])
    a = simulate(production_config(), traffic, "a")
    b = simulate(production_config(), traffic, "b")
    assert [dataclasses.astuple(r) for r in a.records] == [dataclasses.astuple(r) for r in b.records]
    assert a.extra["virtual_seconds"] == b.extra["virtual_seconds"]
    assert sorted(r.index for r in a.records) == list(range(len(traffic.requests)))
    assert a.extra["unfinished"] == 0
    # Every KV block is back in the pool at the end.
    assert a.extra["kv_blocks_free_at_end"] == a.extra["kv_blocks_total"]
    planned = {p.index: p for p in traffic.requests}
    for r in a.records:
        p = planned[r.index]
        if r.outcome == report.OK:
            assert r.output_tokens == p.max_tokens  # synthetic tokens never stop early
            assert 0 <= r.queue_delay_s <= r.ttft_s <= r.e2e_s
            assert r.ttft_s > 0
        elif r.outcome == report.CANCELLED:
            assert p.cancel_after_tokens is not None
            assert r.output_tokens >= p.cancel_after_tokens
    assert sum(r.outcome == report.CANCELLED for r in a.records) == sum(
        p.cancel_after_tokens is not None for p in traffic.requests)
    assert 0 <= a.extra["kv_waste"] < 0.04
    assert {r.lane for r in a.records} == {"interactive", "batch"}


def test_continuous_batching_beats_static_on_the_trace():
    traffic = small_traffic()
    cont = report.summarize(simulate(production_config(), traffic, "continuous"))
    static = report.summarize(simulate(production_config(engine={"continuousBatching": False}), traffic, "static"))
    assert cont["all"]["goodput_rps"] > 3 * static["all"]["goodput_rps"]
    assert cont["all"]["ttft_s"]["p95"] < static["all"]["ttft_s"]["p95"]


def test_admission_rejections_and_queue_timeouts_are_recorded():
    # A tiny waiting room and a short queue timeout under a burst.
    cfg = production_config(
        scheduler={"maxWaitingRequests": 8, "maxActiveSequences": 4, "queueTimeoutMs": 500},
        lanes=[{"name": "default", "default": True}],
    )
    traffic = build_requests(TrafficSpec(source="synthetic", duration_s=2, rate_rps=40, seed=3,
                                         lanes=[LaneMix(None, prompt="medium", output="long")]))
    res = simulate(cfg, traffic, "overload")
    s = report.summarize(res)["all"]
    assert s["outcomes"][report.REJECTED] > 0
    assert set(s["rejections"]) <= {"queue_full", "deadline", "kv_watermark"}
    assert s["outcomes"][report.TIMEOUT] > 0
    assert sum(s["outcomes"].values()) == len(traffic.requests)
    assert res.extra["kv_blocks_free_at_end"] == res.extra["kv_blocks_total"]


def test_lane_labels_survive_a_config_without_those_lanes():
    quiet = small_traffic(lanes=[LaneMix("interactive")])
    flood = build_requests(TrafficSpec(source="synthetic", duration_s=20, rate_rps=0.5, seed=1,
                                       lanes=[LaneMix("long-context", prompt="long", output="short")]))
    fifo = production_config(lanes=[{"name": "default", "default": True}])
    res = simulate(fifo, merge(quiet, flood), "fifo", slos=report.slos_from_config(lanes_config()))
    assert {r.lane for r in res.records} == {"interactive", "long-context"}
    assert report.summarize(res)["lanes"]["interactive"]["slo"]["ttft_ms"] == 500


def test_simulate_forces_the_simulated_executor():
    cfg = production_config(engine={"executor": "model"})
    res = simulate(cfg, small_traffic(duration_s=2), "x")
    assert res.extra["profile"].startswith("H200")


def test_conversation_turns_extend_their_history_and_only_their_own():
    from tokenlane.bench.scenarios import (
        CONVERSATION_POOL_BLOCKS,
        conversation_turns_traffic,
        conversation_working_set,
    )
    from tokenlane.bench.sim import conversation_prompt_ids

    traffic = conversation_turns_traffic(150.0, seed=3)
    by_conversation: dict[int, list] = {}
    for r in traffic.requests:
        by_conversation.setdefault(r.conversation, []).append(r)
    for turns in by_conversation.values():
        for earlier, later in zip(turns, turns[1:]):
            # The next prompt holds the previous prompt, its reply and a new message.
            assert later.prompt_tokens > earlier.prompt_tokens + earlier.max_tokens
            a = conversation_prompt_ids(earlier.conversation, earlier.prompt_tokens)
            b = conversation_prompt_ids(later.conversation, later.prompt_tokens)
            assert b[: len(a)] == a and len(b) == later.prompt_tokens
    first = [turns[0].prompt_tokens for turns in by_conversation.values()]
    assert conversation_prompt_ids(0, 64)[:16] != conversation_prompt_ids(1, 64)[:16]  # no block shared across
    assert len(set(first)) > 1
    # The scenario's point: the histories outgrow the device pool several times over.
    assert conversation_working_set(traffic) >= 3.5 * CONVERSATION_POOL_BLOCKS * 16


def test_the_host_tier_turns_recomputed_history_into_restores():
    from tokenlane.bench.scenarios import SCENARIOS

    scenario = SCENARIOS["conversation-host-tier"](duration_s=40.0, seed=5)
    device_only, tier = (simulate(ph.config, ph.traffic, ph.name, slos=ph.slos) for ph in scenario.phases)
    assert device_only.extra["kv_blocks_restored"] == 0 and device_only.extra["host_link_seconds"] == 0
    assert tier.extra["kv_blocks_offloaded"] > 0 and tier.extra["kv_blocks_restored"] > 0
    assert tier.extra["host_link_seconds"] > 0
    assert tier.extra["prefix_cache_hit_rate"] > device_only.extra["prefix_cache_hit_rate"]
    # Every request ran to its length either way: the tier changes where the KV comes from, not the output.
    assert [r.output_tokens for r in tier.records] == [r.output_tokens for r in device_only.records]
