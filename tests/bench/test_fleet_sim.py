"""Fleet mode of the simulator: replicas behind the router's pick policy, the autoscaler in
the loop, one virtual clock. Small fleets and short traffic, so every check runs in seconds."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tokenlane.operator.policy.autoscaler import AutoscalingPolicy, LaneScalingTarget
from tokenlane.runtime.fleet import pick as fleet_pick
from tokenlane.bench import report
from tokenlane.bench.cli import main
from tokenlane.bench.fleet_sim import (
    ROUND_ROBIN,
    ROUTER,
    AutoscaleSettings,
    SimReplica,
    SystemPrompts,
    _Router,
    ramp_traffic,
    simulate_fleet,
)
from tokenlane.bench.scenarios import production_config
from tokenlane.bench.trace import Burst, LaneMix, TrafficSpec, build_requests
from tokenlane.runtime.core.request import Request, SamplingParams

# A small KV pool (512 blocks of 16 tokens) keeps replicas cheap to build and lets a handful
# of requests move KV usage, the autoscaler's sizing signal.
SMALL_KV_BLOCKS = 512


def small_config(**scheduler):
    return production_config(engine={"enablePrefixCaching": True, "kvCacheBlocks": SMALL_KV_BLOCKS},
                             **({"scheduler": scheduler} if scheduler else {}))


def short_traffic(seed=0, duration_s=3.0, rate_rps=20.0, bursts=()):
    return build_requests(TrafficSpec(source="synthetic", seed=seed, duration_s=duration_s, rate_rps=rate_rps,
                                      bursts=list(bursts), lanes=[LaneMix(None, prompt="short", output="short")]))


def kv_policy(min_replicas=1, max_replicas=3, down_s=2.0):
    """Scales on KV usage alone, so a short synthetic burst moves it."""
    return AutoscalingPolicy(min_replicas=min_replicas, max_replicas=max_replicas, lanes=(), kv_usage_target=0.3,
                             scale_up_stabilization_s=0.0, scale_down_stabilization_s=down_s)


def rows(result):
    return [dataclasses.astuple(r) for r in result.run.records]


def test_same_seed_same_result_and_prefixes_hit_the_cache():
    traffic = short_traffic(seed=4, duration_s=2.0)
    prompts = SystemPrompts(count=3, tokens=256, seed=4)
    a = simulate_fleet(small_config(), traffic, replicas=3, policy=ROUTER, system_prompts=prompts)
    b = simulate_fleet(small_config(), traffic, replicas=3, policy=ROUTER, system_prompts=prompts)
    assert rows(a) == rows(b)
    assert a.run.extra == b.run.extra
    assert sorted(r.index for r in a.run.records) == list(range(len(traffic.requests)))
    assert all(r.outcome == report.OK for r in a.run.records)
    assert a.run.extra["kv_blocks_leaked"] == 0
    # Three 256-token system prompts ahead of ~120-token prompts: most prompt tokens after
    # each prompt's first use come from the prefix cache.
    assert a.prefix_hit_rate > 0.4
    # A different seed gives different traffic, hence a different run.
    c = simulate_fleet(small_config(), short_traffic(seed=5, duration_s=2.0), replicas=3, policy=ROUTER,
                       system_prompts=prompts)
    assert rows(c) != rows(a)


def test_round_robin_spreads_evenly_and_the_router_keeps_a_prefix_on_one_replica():
    traffic = short_traffic(rate_rps=10.0)
    prompts = SystemPrompts(count=8, tokens=256)
    rr = simulate_fleet(small_config(), traffic, replicas=2, policy=ROUND_ROBIN, system_prompts=prompts)
    served = sorted(rr.run.extra["served_per_replica"].values())
    assert served[-1] - served[0] <= 1
    routed = simulate_fleet(small_config(), traffic, replicas=2, policy=ROUTER, system_prompts=prompts)
    # A light load: nearly every pick is the affine replica (a Poisson clump between two
    # scrapes can go over the affinity slack and spill to the other one). Round-robin sends
    # each prompt to both replicas, so each computes it once.
    n = len(traffic.requests)
    assert routed.picks[fleet_pick.AFFINITY] >= 0.9 * n
    assert routed.prefix_hit_rate > rr.prefix_hit_rate


def _queue(replica: SimReplica, lane: str, count: int) -> None:
    """Fill `lane`'s queue on the replica without stepping it (its GPU is busy elsewhere)."""
    for i in range(count):
        replica.engine.add_request(Request(
            request_id=f"{replica.name}-fill-{i}", prompt_token_ids=[1000 + i, 2000, 3000],
            sampling_params=SamplingParams(max_tokens=4, ignore_eos=True), lane=lane, arrival_time=0.0))


def test_the_router_never_picks_a_saturated_replica_while_another_is_free():
    config = small_config()
    config = dataclasses.replace(config, lanes=[dataclasses.replace(lane, max_waiting_requests=3)
                                                if lane.name == "interactive" else lane for lane in config.lanes])
    replicas = [SimReplica(f"replica-{i}", config, 0.0, 0.0) for i in range(3)]
    _queue(replicas[0], "interactive", 3)  # at its cap: the replica's admission would refuse
    router = _Router(ROUTER, config, fleet_pick.PickPolicy())
    router.scrape(replicas)
    # Whatever replica a key is affine to, the saturated one is never picked.
    picked = {router.choose(replicas, "interactive", b"key-%d" % k, frozenset()).url for k in range(200)}
    assert picked == {"replica-1", "replica-2"}
    # Another lane of the same replica is not saturated.
    assert any(router.choose(replicas, "batch", b"key-%d" % k, frozenset()).url == "replica-0" for k in range(200))
    for replica in replicas[1:]:
        _queue(replica, "interactive", 3)
    router.scrape(replicas)
    refusal = router.choose(replicas, "interactive", b"key", frozenset())
    assert isinstance(refusal, fleet_pick.Refusal) and (refusal.status, refusal.code) == (429, "queue_full")


def test_the_autoscaler_stays_in_bounds_and_new_replicas_wait_for_their_start_up():
    traffic = short_traffic(duration_s=8.0, rate_rps=2.0, bursts=[Burst(1.0, 3.0, 60.0)])
    scaling = AutoscaleSettings(policy=kv_policy(min_replicas=1, max_replicas=3), interval_s=0.5, window_s=1.0,
                                startup_delay_s=2.0)
    result = simulate_fleet(small_config(), traffic, replicas=1, policy=ROUTER, autoscale=scaling)
    decisions = result.decisions
    assert any(d["action"] == "up" for d in decisions)
    assert all(1 <= d["desired"] <= 3 for d in decisions)
    assert 2 <= result.run.extra["replicas_active_peak"] <= 3
    added = [r for r in result.run.extra["replicas"] if r["created_at"] > 0]
    assert added
    for r in added:
        assert r["ready_at"] == r["created_at"] + 2.0
        if r["first_request_at"] is not None:
            assert r["first_request_at"] >= r["ready_at"]
    assert any(r["served"] for r in added)
    assert sorted(r.index for r in result.run.records) == list(range(len(traffic.requests)))


def test_a_backlog_that_the_ready_replicas_drain_adds_no_replicas():
    """The queue signal sizes by arrivals against throughput. Once every replica is ready, the
    backlog left on the first one (a request never moves) keeps the queue over its target for
    a while; it is not read as missing capacity (no overshoot), and it blocks a scale-down."""
    config = small_config()
    # Four running sequences at most: a burst queues at once.
    config = dataclasses.replace(config, lanes=[dataclasses.replace(lane, max_active_sequences=4)
                                                if lane.name == "interactive" else lane for lane in config.lanes])
    traffic = short_traffic(duration_s=8.0, rate_rps=2.0, bursts=[Burst(1.0, 5.0, 80.0)])
    queue_only = AutoscalingPolicy(min_replicas=1, max_replicas=16, kv_usage_target=None, min_requests=5,
                                   lanes=(LaneScalingTarget("interactive", queue_delay_p95_s=0.05),),
                                   scale_down_stabilization_s=30.0)
    scaling = AutoscaleSettings(policy=queue_only, interval_s=0.5, window_s=1.0, startup_delay_s=3.0)
    result = simulate_fleet(config, traffic, replicas=1, policy=ROUTER, autoscale=scaling)
    ups = [d for d in result.decisions if d["action"] == "up"]
    assert ups and all("waiting" in d["reason"] for d in ups), ups
    all_ready = [d for d in result.decisions if d["ready"] == d["current"] and d["at"] > ups[-1]["at"]]
    draining = [d for d in all_ready if "drain" in d["reason"]]
    assert draining, "the backlog never outlasted the start-up"
    assert all(d["action"] == "hold" for d in all_ready), all_ready
    assert sorted(r.index for r in result.run.records) == list(range(len(traffic.requests)))


def test_ramp_traffic_ramps_holds_and_ramps_down():
    traffic = ramp_traffic(0.5, 600.0, 100.0, 120.0, 120.0, factor=5.0, step_s=30.0)
    arrivals = np.array([r.arrival_s for r in traffic.requests])

    def rate(lo: float, hi: float) -> float:
        return ((arrivals >= lo) & (arrivals < hi)).sum() / (hi - lo)

    before, early, held, after = rate(0, 100), rate(100, 160), rate(220, 340), rate(460, 600)
    assert early < held and held > 3 * before and after < 2 * before
    assert sorted(r.index for r in traffic.requests) == list(range(len(traffic.requests)))
    with pytest.raises(ValueError, match="must fit"):
        ramp_traffic(0.5, 300.0, 100.0, 120.0, 120.0)


def test_no_request_is_lost_when_a_replica_is_removed():
    # A burst scales the fleet up; the quiet tail scales it down again while requests run.
    traffic = short_traffic(duration_s=14.0, rate_rps=3.0, bursts=[Burst(0.5, 2.5, 60.0)])
    scaling = AutoscaleSettings(policy=kv_policy(min_replicas=1, max_replicas=3, down_s=1.0), interval_s=0.5,
                                window_s=1.0, startup_delay_s=0.5)
    result = simulate_fleet(small_config(), traffic, replicas=1, policy=ROUTER, autoscale=scaling)
    assert any(d["action"] == "down" for d in result.decisions)
    drained = [r for r in result.run.extra["replicas"] if r["removed_at"] is not None and r["served"]]
    assert drained, "a replica that served requests was removed"
    assert sorted(r.index for r in result.run.records) == list(range(len(traffic.requests)))
    assert all(r.outcome == report.OK for r in result.run.records)
    assert result.run.extra["kv_blocks_leaked"] == 0
    # Replica-hours count every replica from its creation until it has drained.
    assert result.replica_seconds > result.run.extra["virtual_seconds"]
    assert result.replica_seconds < 3 * result.run.extra["virtual_seconds"]


def test_bad_fleet_arguments_are_refused():
    traffic = short_traffic(duration_s=1.0)
    with pytest.raises(ValueError, match="policy"):
        simulate_fleet(small_config(), traffic, policy="random")
    with pytest.raises(ValueError, match="at least one replica"):
        simulate_fleet(small_config(), traffic, replicas=0)
    with pytest.raises(ValueError, match="share"):
        SystemPrompts(count=2, share=1.5)
    with pytest.raises(ValueError, match="startup delay"):
        AutoscaleSettings(policy=kv_policy(), startup_delay_s=-1)
    with pytest.raises(ValueError, match="settle"):
        AutoscaleSettings(policy=kv_policy(), settle_s=-1)


def test_fleet_command_prints_the_table_and_writes_json(tmp_path, capsys):
    cfg = tmp_path / "runtime.yaml"
    import yaml

    data = small_config().to_dict()
    cfg.write_text(yaml.safe_dump(data))
    code = main(["fleet", "--config", str(cfg), "--replicas", "2", "--policy", "both", "--system-prompts", "2",
                 "--system-prompt-tokens", "64", "--lane", ":1:short:short", "--rate", "8", "--duration", "1",
                 "--out", str(tmp_path), "--no-progress"])
    assert code == 0
    out = capsys.readouterr().out
    assert "| round-robin | 2 |" in out and "| router | 2 |" in out
    assert "router vs round-robin: interactive TTFT p95" in out
    assert (tmp_path / "fleet.json").exists()
    assert main(["fleet", "--config", str(cfg), "--autoscale", "--policy", "both", "--duration", "1",
                 "--out", str(tmp_path)]) == 2


def test_fleet_command_passes_the_autoscaler_knobs(tmp_path):
    from tokenlane.bench import cli, fleet_sim

    cfg = tmp_path / "runtime.yaml"
    import yaml

    cfg.write_text(yaml.safe_dump(small_config().to_dict()))
    base = ["fleet", "--config", str(cfg), "--autoscale", "--policy", "router", "--duration", "1"]

    def scaling(*flags: str):
        args = cli.build_parser().parse_args(base + list(flags))
        experiment, config = cli._fleet_phases(args)
        return cli._fleet_scaling(args, experiment, config).policy

    defaults = scaling()
    assert (defaults.running_share_target, defaults.headroom_replicas, defaults.target_utilization) == (
        fleet_sim.SIM_RUNNING_SHARE_TARGET, fleet_sim.SIM_HEADROOM_REPLICAS, fleet_sim.SIM_TARGET_UTILIZATION)
    help_text = " ".join(cli.build_parser()._subparsers._group_actions[0].choices["fleet"].format_help().split())
    for value in (fleet_sim.SIM_RUNNING_SHARE_TARGET, fleet_sim.SIM_HEADROOM_REPLICAS,
                  fleet_sim.SIM_TARGET_UTILIZATION):
        assert f"(default {value:g}" in help_text  # the help's numbers are the simulator's
    knobs = scaling("--running-share-target", "0.3", "--headroom-replicas", "1.5", "--target-utilization", "0.6")
    assert (knobs.running_share_target, knobs.headroom_replicas, knobs.target_utilization) == (0.3, 1.5, 0.6)
    assert scaling("--running-share-target", "off").running_share_target is None
    with pytest.raises(ValueError, match="runningShareTarget"):
        scaling("--running-share-target", "1.5")
    assert main(base + ["--target-utilization", "0", "--out", str(tmp_path)]) == 2  # refused, with the field named


# --------------------------------------------------------------------------- scale to zero


def test_idle_day_scale_to_zero_uses_fewer_replica_hours_and_answers_the_first_request_after_idle():
    from tokenlane.bench.fleet_sim import idle_day_traffic, scale_to_zero_experiment

    hour_s, cold_start_s = 10.0, 20.0
    traffic, idle_start, idle_end = idle_day_traffic(hour_s, 8, 0.5)
    assert (idle_start, idle_end) == (80.0, 160.0)
    assert not any(idle_start <= r.arrival_s < idle_end for r in traffic.requests)
    base, zero = scale_to_zero_experiment(hour_s=hour_s, idle_hours=8, rate_rps=0.5, cold_start_s=cold_start_s,
                                          scale_to_zero_after_h=2.0)
    assert (base.min_replicas, zero.min_replicas) == (1, 0)
    for run in (base, zero):
        assert len(run.result.run.records) == len(traffic.requests)  # every request answered once
        assert run.refused == 0 and run.first_after_idle_outcome == "ok"
        assert run.result.run.extra["kv_blocks_leaked"] == 0
    # minReplicas 1 never goes below one replica; scale to zero sleeps through the idle hours only.
    assert min(n for _, n in base.result.replica_timeline) == 1
    asleep = [t for t, n in zero.result.replica_timeline if n == 0]
    assert asleep and all(idle_start < t <= idle_end + zero.result.decisions[1]["at"] for t in asleep)
    assert zero.result.run.extra["held_peak"] >= 1
    assert any("scale from zero 0 -> 1" in d["reason"] for d in zero.result.decisions)
    assert any("scale to zero 1 -> 0" in d["reason"] for d in zero.result.decisions)
    # Fewer replica-hours; the first request after idle waits for the cold start, and gets served.
    assert zero.replica_day_hours < base.replica_day_hours
    assert zero.first_after_idle_ttft_s >= cold_start_s > base.first_after_idle_ttft_s


def test_held_requests_past_the_hold_timeout_are_refused_and_still_wake_the_pool():
    from tokenlane.bench.fleet_sim import default_scaling_policy

    config = small_config()
    late = short_traffic(seed=2, duration_s=2.0, rate_rps=5.0)
    late = dataclasses.replace(late, requests=[dataclasses.replace(r, arrival_s=r.arrival_s + 50.0)
                                               for r in late.requests])
    policy = dataclasses.replace(default_scaling_policy(config, 0, 2), scale_to_zero_after_s=5.0)
    # Held from 50 s; the decision at 60 s wakes the pool; the replica is ready at 90 s, after the
    # 12 s hold bound of every request.
    result = simulate_fleet(config, late, replicas=1, policy=ROUTER, hold_timeout_s=12.0,
                            autoscale=AutoscaleSettings(policy, startup_delay_s=30.0))
    assert result.run.records and {(r.outcome, r.reason) for r in result.run.records} == {("rejected", "hold_timeout")}
    assert result.run.extra["arrived_without_replica"] == len(late.requests)
    assert any("scale from zero" in d["reason"] for d in result.decisions)
