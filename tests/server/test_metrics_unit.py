"""The Prometheus observer: names, labels and values from engine events."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from tokenlane.runtime.config import loads_config
from tokenlane.runtime.observability.metrics import PrometheusMetrics
from tokenlane.runtime.core.request import Request, RequestStatus, SamplingParams
from tokenlane.runtime.core.stats import LaneStepStats, StepStats

CFG = loads_config("""
model: {path: /models/tiny, servedName: tiny}
engine: {continuousBatching: false}
lanes:
  - {name: interactive, default: true, maxBatchedTokens: 128, slo: {ttftP95Ms: 500, tpotP95Ms: 60}}
  - {name: batch, class: batch}
tenants: [{name: team-a}]
""")


def families(metrics):
    return {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}


def samples(metrics, name):
    return [s for f in families(metrics).values() for s in f.samples if s.name == name]


def value(metrics, name, **labels):
    found = [s.value for s in samples(metrics, name) if all(s.labels.get(k) == v for k, v in labels.items())]
    assert found, (name, labels)
    return sum(found)


def finished_request(status, detail="", tokens=5):
    r = Request("cmpl-r1", [1, 2, 3, 4], SamplingParams(max_tokens=8), lane="interactive", tenant="team-a",
                arrival_time=100.0)
    r.first_scheduled_time = 100.5
    if tokens:
        r.first_token_time = 101.0
        r.output_token_ids = list(range(tokens))
        r.token_times = [101.0 + 0.1 * i for i in range(tokens)]
    r.finish(status, detail, now=101.0 + 0.1 * max(tokens - 1, 0))
    return r


def test_names_and_labels_of_design_3_4():
    m = PrometheusMetrics("tiny")
    m.set_config(CFG)
    names = set(families(m))
    for hist in ("time_to_first_token_seconds", "time_per_output_token_seconds", "e2e_request_latency_seconds",
                 "queue_delay_seconds", "prefill_time_seconds", "decode_time_seconds", "scheduler_step_seconds",
                 "batch_tokens"):
        assert "tokenlane_" + hist in names, hist
    for counter in ("prompt_tokens", "generation_tokens", "requests", "preemptions", "prefix_cache_queries",
                    "prefix_cache_hits", "config_reloads"):
        assert "tokenlane_" + counter in names, counter
    for gauge in ("requests_running", "requests_waiting", "kv_cache_usage_ratio", "kv_blocks_free",
                  "kv_blocks_total", "continuous_batching_enabled", "lane_budget", "kv_cache_watermark",
                  "lane_slo_target_seconds"):
        assert "tokenlane_" + gauge in names, gauge
    assert value(m, "tokenlane_lane_budget", lane="interactive", budget="maxBatchedTokens") == 128
    assert value(m, "tokenlane_lane_budget", lane="batch", budget="maxBatchedTokens") == 8192
    assert value(m, "tokenlane_continuous_batching_enabled") == 0
    assert value(m, "tokenlane_kv_cache_watermark", watermark="reject") == 0.95
    assert value(m, "tokenlane_lane_slo_target_seconds", lane="interactive", slo="ttft_p95") == 0.5
    assert value(m, "tokenlane_lane_slo_target_seconds", lane="interactive", slo="tpot_p95") == 0.06
    assert not [s for s in samples(m, "tokenlane_lane_slo_target_seconds") if s.labels["lane"] == "batch"]
    # Per-lane series exist at zero before any request (rate() and absent() work at once).
    assert value(m, "tokenlane_time_to_first_token_seconds_count", lane="batch") == 0
    assert value(m, "tokenlane_generation_tokens_total", lane="batch", tenant="team-a") == 0


def test_request_outcomes_and_latencies():
    m = PrometheusMetrics("tiny")
    m.set_config(CFG)
    m.on_request_finished(finished_request(RequestStatus.FINISHED_LENGTH, "max_tokens", tokens=5))
    m.on_request_finished(finished_request(RequestStatus.FINISHED_CANCELLED, "client_disconnect", tokens=2))
    m.on_request_finished(finished_request(RequestStatus.FINISHED_REJECTED, "queue_full", tokens=0))
    m.on_request_finished(finished_request(RequestStatus.FINISHED_ERROR, "CUDA error: out of memory", tokens=0))
    assert value(m, "tokenlane_requests_total", outcome="finished", reason="max_tokens", tenant="team-a") == 1
    assert value(m, "tokenlane_requests_total", outcome="cancelled", reason="client_disconnect") == 1
    assert value(m, "tokenlane_requests_total", outcome="rejected", reason="queue_full") == 1
    assert value(m, "tokenlane_requests_total", outcome="error", reason="other") == 1  # free text is bounded
    assert value(m, "tokenlane_generation_tokens_total", lane="interactive", tenant="team-a") == 7
    assert value(m, "tokenlane_prompt_tokens_total") == 12  # the rejected one never ran
    assert value(m, "tokenlane_time_to_first_token_seconds_count", lane="interactive") == 2
    assert value(m, "tokenlane_time_to_first_token_seconds_sum", lane="interactive") == 2.0
    # Only the finished request feeds E2E/TPOT (SLO histograms).
    assert value(m, "tokenlane_e2e_request_latency_seconds_count") == 1
    assert abs(value(m, "tokenlane_time_per_output_token_seconds_sum") - 0.1) < 1e-9
    assert value(m, "tokenlane_queue_delay_seconds_sum") == 1.5
    # A rejected request naming a lane/tenant that is not configured gets no series of its own.
    for i in range(3):
        r = Request(f"x{i}", [1], SamplingParams(), lane=f"no-such-lane-{i}", tenant=f"who-{i}")
        r.finish(RequestStatus.FINISHED_REJECTED, "invalid", now=1.0)
        m.on_request_finished(r)
    lanes = {s.labels["lane"] for s in samples(m, "tokenlane_requests_total")}
    assert lanes == {"interactive", "batch", "unknown"}
    assert value(m, "tokenlane_requests_total", lane="unknown", tenant="unknown", reason="invalid") == 3


def test_step_stats_and_lane_removal():
    m = PrometheusMetrics("tiny")
    m.set_config(CFG)
    m.on_step(StepStats(step_seconds=0.02, schedule_seconds=0.001, num_batched_tokens=40, num_preemptions=1,
                        prefix_cache_queries=32, prefix_cache_hits=16, kv_blocks_total=100, kv_blocks_free=75,
                        kv_usage=0.25, lanes={"interactive": LaneStepStats(running=3, waiting=2, scheduled_tokens=40)}))
    assert value(m, "tokenlane_requests_running", lane="interactive") == 3
    assert value(m, "tokenlane_requests_waiting", lane="batch") == 0
    assert value(m, "tokenlane_kv_cache_usage_ratio") == 0.25
    assert value(m, "tokenlane_kv_blocks_free") == 75
    assert value(m, "tokenlane_preemptions_total") == 1
    assert value(m, "tokenlane_prefix_cache_hits_total") == 16
    assert value(m, "tokenlane_batch_tokens_sum") == 40
    # A reload that drops the batch lane removes its series.
    m.on_config_applied(loads_config("model: {path: /models/tiny, servedName: tiny}\nlanes: [{name: interactive}]"),
                        True, "")
    assert not [s for s in samples(m, "tokenlane_lane_budget") if s.labels["lane"] == "batch"]
    # The config watcher exports a new config before the engine's step boundary applies it: a
    # step of the old config in between must not revive the removed lane's gauges.
    m.set_occupancy(StepStats(lanes={"interactive": LaneStepStats(running=1), "batch": LaneStepStats(running=2)}))
    m.on_config_applied(loads_config("model: {path: /models/tiny, servedName: tiny}\nlanes: [{name: interactive}]"),
                        True, "")
    assert not [s for s in samples(m, "tokenlane_requests_running") if s.labels["lane"] == "batch"]
    assert value(m, "tokenlane_requests_running", lane="interactive") == 1


def test_a_lane_dropped_then_brought_back_by_reloads_gets_its_step_series_again():
    """The per-step series are looked up once per config: a lane that a reload removed and a
    later reload brings back writes to its new series, not to the removed ones."""
    m = PrometheusMetrics("tiny")
    m.set_config(CFG)
    # The model's gauges appear with the engine's first numbers, not at zero before them.
    assert not samples(m, "tokenlane_kv_blocks_total") and not samples(m, "tokenlane_num_requests_running")
    m.on_step(StepStats(num_batched_tokens=8, kv_blocks_total=100, kv_blocks_free=90,
                        lanes={"batch": LaneStepStats(running=2, decode_tokens=8)}))
    assert value(m, "tokenlane_decode_tokens_total", lane="batch") == 8
    m.set_config(loads_config("model: {path: /models/tiny, servedName: tiny}\nlanes: [{name: interactive}]"))
    assert not [s for s in samples(m, "tokenlane_decode_tokens") if s.labels["lane"] == "batch"]
    m.set_config(CFG)
    m.on_step(StepStats(num_batched_tokens=5, kv_blocks_total=100, kv_blocks_free=80,
                        lanes={"batch": LaneStepStats(running=1, decode_tokens=5, prefill_tokens=3)}))
    assert value(m, "tokenlane_decode_tokens_total", lane="batch") == 5  # a new series, from zero
    assert value(m, "tokenlane_prefill_tokens_total", lane="batch") == 3
    assert value(m, "tokenlane_requests_running", lane="batch") == 1
    assert value(m, "tokenlane_requests_running", lane="interactive") == 0
    assert value(m, "tokenlane_kv_blocks_free") == 80
    assert value(m, "tokenlane_batch_tokens_count") == 2


def test_outcome_and_latency_series_exist_at_zero_for_every_lane_and_tenant():
    """rate() needs a counter to exist before its first increment: every configured lane (also
    one added by a hot reload) has its finished/rejected/timeout counters and its TTFT/TPOT
    buckets at zero from the start, with a bounded label set."""
    m = PrometheusMetrics("tiny")
    m.set_config(CFG)
    for lane in ("interactive", "batch"):
        for tenant in ("default", "team-a"):
            for outcome, reason in (("finished", "eos"), ("finished", "max_tokens"), ("finished", "stop_string"),
                                    ("rejected", "queue_full"), ("timeout", "queue_timeout"), ("error", "other")):
                assert value(m, "tokenlane_requests_total", lane=lane, tenant=tenant, outcome=outcome,
                             reason=reason) == 0
        assert value(m, "tokenlane_time_to_first_token_seconds_bucket", lane=lane, le="+Inf") == 0
        assert value(m, "tokenlane_time_per_output_token_seconds_count", lane=lane) == 0
    for name in ("tokenlane_preemptions_total", "tokenlane_scheduler_step_seconds_count"):
        assert value(m, name, model="tiny") == 0
    series = len(samples(m, "tokenlane_requests_total"))
    m.on_request_finished(finished_request(RequestStatus.FINISHED_STOPPED, "eos"))
    assert len(samples(m, "tokenlane_requests_total")) == series  # the pre-made series took it
    m.set_config(loads_config("""
model: {path: /models/tiny, servedName: tiny}
lanes:
  - {name: interactive, default: true}
  - {name: batch, class: batch}
  - {name: long, class: long-context}
tenants: [{name: team-a}]
"""))
    assert value(m, "tokenlane_requests_total", lane="long", tenant="team-a", outcome="finished", reason="eos") == 0
    assert value(m, "tokenlane_time_to_first_token_seconds_count", lane="long") == 0
    assert len(samples(m, "tokenlane_requests_total")) == series * 3 // 2
