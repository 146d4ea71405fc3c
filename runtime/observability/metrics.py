"""Prometheus metrics of the runtime (docs/metrics.md): an `EngineObserver` over its own
`CollectorRegistry`.

Names carry the `tokenlane_` prefix. Labels: `model` everywhere; `lane` on per-lane series;
`tenant` on the request and token counters (values limited to configured tenants and
"default", which the router guarantees); `endpoint` on the request counter (the two OpenAI
paths, or "other" for callers of the engine itself). Latency histograms are per lane, not
per tenant, to keep the series count bounded; the tuner reads them per lane.

The engine calls the observer from its step thread; prometheus_client is thread-safe.
"""

from __future__ import annotations

import logging
import re
import time
from typing import Iterable, Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from tokenlane.runtime.config import LANE_KNOBS, RuntimeConfig
from tokenlane.runtime.observability.gpu_metrics import register_gpu_metrics
from tokenlane.runtime.core.request import FinishReason, Request
from tokenlane.runtime.core.startup import StartupPhase
from tokenlane.runtime.core.stats import StepStats

log = logging.getLogger("tokenlane.metrics")

PREFIX = "tokenlane_"
CONTENT_TYPE = CONTENT_TYPE_LATEST

# Buckets suited to LLM serving (seconds), close to vLLM's.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05,
                0.06, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
REQUEST_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                   40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0)
STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64,
                1.28, 2.56, 5.12)
BATCH_TOKEN_BUCKETS = tuple(float(2**i) for i in range(0, 16))  # 1 .. 32768
# KV release: a step boundary away at most for a cancel, microseconds for a finish.
KV_RELEASE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                      0.25, 0.5, 1.0, 2.5, 5.0)

# The `endpoint` label of the request counter, from the request id's prefix (the server's
# ids are OpenAI's: "cmpl-…", "chatcmpl-…"); any other id (bench, direct engine callers)
# counts as OTHER_ENDPOINT.
ENDPOINT_OF_ID_PREFIX = {"cmpl": "/v1/completions", "chatcmpl": "/v1/chat/completions"}
ENDPOINTS = tuple(ENDPOINT_OF_ID_PREFIX.values())
OTHER_ENDPOINT = "other"

OUTCOME_OF_FINISH = {
    FinishReason.STOP: "finished",
    FinishReason.LENGTH: "finished",
    FinishReason.CANCELLED: "cancelled",
    FinishReason.TIMEOUT: "timeout",
    FinishReason.REJECTED: "rejected",
    FinishReason.ERROR: "error",
}

# Budget gauge label value -> LaneBudgets attribute: every lane knob.
BUDGET_KEYS = {k.key: k.attr for k in LANE_KNOBS}

# SLO gauge label value -> SLOConfig attribute (milliseconds in the config, seconds exported).
SLO_KEYS = {"ttft_p95": "ttft_p95_ms", "tpot_p95": "tpot_p95_ms", "e2e_p95": "e2e_p95_ms"}

CONFIG_RELOAD_RESULTS = ("success", "invalid", "restart_required", "error")

# The `requests_total` (outcome, reason) pairs created at zero for every configured lane and
# tenant, so a rate() over them works from the first scrape (a counter that first appears
# already at its final value has no rate). The reasons the engine and server produce; a bounded
# set (lanes x tenants x these), never derived from request data.
EXPECTED_OUTCOMES = (
    ("finished", "eos"),
    ("finished", "stop_token"),
    ("finished", "stop_string"),
    ("finished", "max_tokens"),
    ("finished", "max_model_len"),
    ("cancelled", "cancelled"),
    ("cancelled", "client_disconnect"),
    ("timeout", "queue_timeout"),
    ("timeout", "deadline"),
    ("rejected", "queue_full"),
    ("rejected", "kv_watermark"),
    ("rejected", "deadline"),
    ("rejected", "draining"),
    ("rejected", "tenant_rate_limit"),
    ("error", "oom"),
    ("error", "other"),
)

# `reason` values of outcome="invalid": requests the server refused with a 400 before
# admission (the error's code); any other code counts as "other". The first is created at
# zero for every lane and tenant.
INVALID_REASONS = (
    "invalid_parameter",
    "context_length_exceeded",
    "empty_prompt",
    "invalid_token_id",
    "no_chat_template",
    "chat_template_error",
    "unknown_lane",
    "invalid_deadline",
)

# The lane/tenant label of a request whose lane or tenant is not configured (e.g. one
# rejected for naming an unknown lane): never the caller's own string.
UNKNOWN_LABEL = "unknown"

_REASON_RE = re.compile(r"^[a-z][a-z0-9_]{0,39}$")


def endpoint_label(request_id: str) -> str:
    """The `endpoint` label of a request, from its id's prefix (bounded: ENDPOINTS or OTHER_ENDPOINT)."""
    return ENDPOINT_OF_ID_PREFIX.get(request_id.split("-", 1)[0], OTHER_ENDPOINT)


def reason_label(request: Request) -> str:
    """A bounded `reason` label: the finish detail when it is an identifier, else a default."""
    detail = (request.finish_detail or "").strip().lower()
    if _REASON_RE.match(detail):
        return detail
    if request.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
        return request.finish_reason.value
    return "other" if detail else "unspecified"


class PrometheusMetrics:
    """The runtime's metrics; implements `EngineObserver` (on_step / on_request_finished /
    on_config_applied)."""

    def __init__(self, model: str, registry: Optional[CollectorRegistry] = None) -> None:
        self.model = model
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        lane = ["model", "lane"]
        tenant = ["model", "lane", "tenant"]

        def hist(name, doc, labels, buckets):
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=r)

        self.ttft = hist("time_to_first_token_seconds", "Arrival to first output token.", lane, TTFT_BUCKETS)
        self.tpot = hist(
            "time_per_output_token_seconds",
            "Mean time per output token after the first, per request.",
            lane,
            TPOT_BUCKETS,
        )
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to final token.", lane, REQUEST_BUCKETS)
        self.queue_delay = hist(
            "queue_delay_seconds", "Arrival to first scheduled (time in the lane queue).", lane, REQUEST_BUCKETS
        )
        self.prefill_time = hist(
            "prefill_time_seconds", "First scheduled to first token (prefill, all chunks).", lane, REQUEST_BUCKETS
        )
        self.decode_time = hist("decode_time_seconds", "First token to final token.", lane, REQUEST_BUCKETS)
        self.step_time = hist(
            "scheduler_step_seconds", "One engine step: planning plus model execution.", ["model"], STEP_BUCKETS
        )
        self.batch_tokens = hist(
            "batch_tokens", "Tokens computed per engine step (prefill chunks + decodes).", ["model"], BATCH_TOKEN_BUCKETS
        )

        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of admitted requests.", tenant, registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Generated tokens.", tenant, registry=r)
        self.requests = Counter(
            PREFIX + "requests",
            "Requests by endpoint, final outcome (finished|cancelled|timeout|rejected|error|invalid) and reason.",
            tenant + ["endpoint", "outcome", "reason"],
            registry=r,
        )
        self.prefill_tokens = Counter(
            PREFIX + "prefill_tokens",
            "Prompt tokens computed (prefill chunks; recomputed after a preemption, prefix-cache hits not).",
            lane,
            registry=r,
        )
        self.decode_tokens = Counter(PREFIX + "decode_tokens", "Tokens computed by decode steps.", lane, registry=r)
        self.kv_release = hist(
            "kv_release_seconds",
            "From a request's end being known (cancel call, deadline, last token computed) to its KV blocks free.",
            lane,
            KV_RELEASE_BUCKETS,
        )
        self.oom_events = Counter(
            PREFIX + "oom_events",
            "Engine steps that ran out of accelerator memory (their requests failed with reason oom).",
            ["model"],
            registry=r,
        )
        self.preemptions = Counter(PREFIX + "preemptions", "Requests preempted (recompute).", ["model"], registry=r)
        self.tenant_throttled = Counter(
            PREFIX + "tenant_throttled",
            "Requests refused because their tenant was over its tokensPerMinute (429 tenant_rate_limit).",
            ["model", "tenant"],
            registry=r,
        )
        self.prefix_queries = Counter(
            PREFIX + "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", ["model"], registry=r
        )
        self.prefix_hits = Counter(
            PREFIX + "prefix_cache_hits",
            "Prompt tokens found in the prefix cache, by tier (device; host: restored from engine.kvOffload).",
            ["model", "tier"],
            registry=r,
        )
        # The prefix cache's host tier (engine.kvOffload).
        self.kv_host_transfer_blocks = Counter(
            PREFIX + "kv_host_transfer_blocks",
            "KV blocks copied between the device pool and the host tier (direction: offload|restore).",
            ["model", "direction"],
            registry=r,
        )
        self.kv_host_transfer_bytes = Counter(
            PREFIX + "kv_host_transfer_bytes",
            "Bytes of KV blocks copied between the device pool and the host tier (direction: offload|restore).",
            ["model", "direction"],
            registry=r,
        )
        self.kv_restore = Histogram(
            PREFIX + "kv_restore_seconds",
            "Per step: time to copy the step's host-tier restores back into device blocks.",
            ["model"],
            buckets=KV_RELEASE_BUCKETS,
            registry=r,
        )
        self.kv_host_total = Gauge(PREFIX + "kv_host_blocks", "Blocks of the host tier (0: none).", ["model"],
                                   registry=r)
        self.kv_host_used = Gauge(PREFIX + "kv_host_blocks_used", "Host-tier blocks holding a prefix block.",
                                  ["model"], registry=r)
        self.config_reloads = Counter(
            PREFIX + "config_reloads",
            "Config file changes by result (success|invalid|restart_required|error).",
            ["model", "result"],
            registry=r,
        )

        self.running = Gauge(PREFIX + "requests_running", "Sequences in the running set.", lane, registry=r)
        self.waiting = Gauge(PREFIX + "requests_waiting", "Requests in the lane queue.", lane, registry=r)
        self.lane_kv_blocks = Gauge(
            PREFIX + "lane_kv_blocks",
            "KV block-table entries held by the lane's running requests (shared prefix blocks count per holder).",
            lane,
            registry=r,
        )
        self.time_capped_steps = Counter(
            PREFIX + "time_capped_steps",
            "Steps in which the step-time budget (stepTimeBudget: auto) shortened or skipped the lane's work.",
            lane,
            registry=r,
        )
        self.kv_usage = Gauge(PREFIX + "kv_cache_usage_ratio", "Used / total KV blocks (0..1).", ["model"], registry=r)
        self.kv_free = Gauge(PREFIX + "kv_blocks_free", "Free KV blocks.", ["model"], registry=r)
        self.kv_total = Gauge(PREFIX + "kv_blocks_total", "KV blocks in the pool.", ["model"], registry=r)
        self.kv_cached_free = Gauge(
            PREFIX + "kv_blocks_cached_free", "Free KV blocks still holding a cached prefix.", ["model"], registry=r
        )
        self.continuous_batching = Gauge(
            PREFIX + "continuous_batching_enabled", "1 = continuous batching, 0 = static batching.", ["model"], registry=r
        )
        self.lane_budget = Gauge(
            PREFIX + "lane_budget",
            "Effective per-lane budget in force (the lane's caps applied to the global ones).",
            ["model", "lane", "budget"],
            registry=r,
        )
        self.kv_watermark = Gauge(
            PREFIX + "kv_cache_watermark",
            "KV usage watermarks in force (high: no new prefills; reject: new requests get 503).",
            ["model", "watermark"],
            registry=r,
        )
        self.slo_target = Gauge(
            PREFIX + "lane_slo_target_seconds",
            "Each lane's latency targets from the config in force (p95, seconds); alert rules compare "
            "the lane's histograms against them.",
            ["model", "lane", "slo"],
            registry=r,
        )
        self.config_info = Gauge(
            PREFIX + "config_info", "The restart hash of the config in force (value 1).", ["model", "restart_hash"], registry=r
        )
        self.startup_phase = Gauge(
            PREFIX + "startup_phase_seconds",
            "How long each phase of this process's start-up took (import, config, tokenizer, load, kv, warmup, "
            "engine, serve; total: process start to ready).",
            ["model", "phase"],
            registry=r,
        )
        # Multi-LoRA (docs/lora.md): per adapter, and the denials of adapters a tenant may not use.
        adapter = ["model", "adapter"]
        self.adapter_running = Gauge(PREFIX + "adapter_requests_running",
                                     "Running requests of each served LoRA adapter.", adapter, registry=r)
        self.adapter_waiting = Gauge(PREFIX + "adapter_requests_waiting",
                                     "Queued requests of each served LoRA adapter.", adapter, registry=r)
        self.adapter_requests = Counter(PREFIX + "adapter_requests",
                                        "Requests of each LoRA adapter by final outcome.",
                                        ["model", "adapter", "outcome"], registry=r)
        self.adapter_prompt_tokens = Counter(PREFIX + "adapter_prompt_tokens",
                                             "Prompt tokens of admitted requests of each LoRA adapter.", adapter,
                                             registry=r)
        self.adapter_generation_tokens = Counter(PREFIX + "adapter_generation_tokens",
                                                 "Tokens generated by each LoRA adapter.", adapter, registry=r)
        self.adapter_denied = Counter(PREFIX + "adapter_denied",
                                      "Requests for a LoRA adapter the tenant may not use (answered 404).",
                                      ["model", "tenant", "adapter"], registry=r)
        # The Gateway API Inference Extension's model-server protocol (docs/fleet.md maps them
        # to the endpoint picker's metric flags): queue and running totals, the LoRA info
        # gauge (value: the time it was set; the picker reads the newest series) and the cache
        # config info.
        self.num_requests_waiting = Gauge(PREFIX + "num_requests_waiting",
                                          "Requests waiting in the queues (all lanes).", ["model"], registry=r)
        self.num_requests_running = Gauge(PREFIX + "num_requests_running",
                                          "Requests in the running set (all lanes).", ["model"], registry=r)
        self.lora_requests_info = Gauge(
            PREFIX + "lora_requests_info",
            "LoRA adapters of the running and waiting requests (comma-separated) and maxLoras; value: "
            "the Unix time it was last set.",
            ["model", "max_lora", "running_lora_adapters", "waiting_lora_adapters"], registry=r)
        self.cache_config_info = Gauge(PREFIX + "cache_config_info",
                                       "The KV cache's block size and number of blocks (value 1).",
                                       ["model", "block_size", "num_gpu_blocks"], registry=r)
        self._adapters: set[str] = set()
        self._lora_info: Optional[tuple[str, str, str]] = None
        self._cache_info: Optional[tuple[str, str]] = None
        for result in CONFIG_RELOAD_RESULTS:  # present from the start, so rate() works at once
            self.config_reloads.labels(model, result)
        # The children every step writes, looked up once (a `labels()` call takes a lock and
        # builds its key: about half of on_step's time when there were ~20 of them a step).
        # The model's never go away: its counters and histograms exist from here (at zero, so
        # rate() works at once), its gauges from the first occupancy that has them. A lane's
        # are rebuilt by set_config, which removes the series of lanes that went away.
        self._step = _StepSeries(self, model)
        self._kv_gauges: Optional[_KvGauges] = None
        self._request_gauges: Optional[tuple] = None  # (running, waiting) of the model
        self._lane_series: dict[str, _LaneSeries] = {}  # of the configured lanes
        self._tenants: set[str] = set()
        self._restart_hash: Optional[str] = None
        # GPU utilization and memory, read from NVML at scrape time; absent without a GPU.
        self.gpu = register_gpu_metrics(model, r)

    def set_startup(self, total_s: float, phases: Iterable[StartupPhase]) -> None:
        """The start-up's phases (runtime/core/startup.py), set once when the server is ready."""
        for phase in phases:
            self.startup_phase.labels(self.model, phase.name).set(phase.seconds)
        self.startup_phase.labels(self.model, "total").set(total_s)

    # ---- config

    def set_config(self, config: RuntimeConfig) -> None:
        """Export the budgets and watermarks of the config in force."""
        m = self.model
        lanes = {lane.name for lane in config.lanes}
        for gone in self._lane_series.keys() - lanes:
            for budget in BUDGET_KEYS:
                _remove(self.lane_budget, m, gone, budget)
            for slo in SLO_KEYS:
                _remove(self.slo_target, m, gone, slo)
            _remove(self.running, m, gone)
            _remove(self.waiting, m, gone)
            _remove(self.lane_kv_blocks, m, gone)
            _remove(self.time_capped_steps, m, gone)
            _remove(self.prefill_tokens, m, gone)
            _remove(self.decode_tokens, m, gone)
        tenants = ["default"] + [t.name for t in config.tenants]
        for name in lanes:
            budgets = config.lane_budgets(name)
            for label, attr in BUDGET_KEYS.items():
                self.lane_budget.labels(m, name, label).set(getattr(budgets, attr))
            slo = config.lane(name).slo
            for label, attr in SLO_KEYS.items():
                target_ms = getattr(slo, attr)
                if target_ms is None:
                    _remove(self.slo_target, m, name, label)
                else:
                    self.slo_target.labels(m, name, label).set(target_ms / 1000.0)
            # Every lane's series exist from the start (at zero), so rate() and absent() work.
            self.running.labels(m, name)
            self.waiting.labels(m, name)
            self.lane_kv_blocks.labels(m, name)
            self.time_capped_steps.labels(m, name)
            self.prefill_tokens.labels(m, name)
            self.decode_tokens.labels(m, name)
            for hist in (self.ttft, self.tpot, self.e2e, self.queue_delay, self.prefill_time, self.decode_time,
                         self.kv_release):
                hist.labels(m, name)
            for tenant in tenants:
                self.prompt_tokens.labels(m, name, tenant)
                self.generation_tokens.labels(m, name, tenant)
                for endpoint in ENDPOINTS:
                    for outcome, reason in EXPECTED_OUTCOMES:
                        self.requests.labels(m, name, tenant, endpoint, outcome, reason)
                    self.requests.labels(m, name, tenant, endpoint, "invalid", INVALID_REASONS[0])
        for tenant in tenants:
            self.tenant_throttled.labels(m, tenant)
        self._lane_series = {name: _LaneSeries(self, m, name) for name in sorted(lanes)}
        self._tenants = set(tenants)
        self.kv_watermark.labels(m, "high").set(config.scheduler.kv_cache_high_watermark)
        self.kv_watermark.labels(m, "reject").set(config.scheduler.kv_cache_reject_watermark)
        self.continuous_batching.labels(m).set(1 if config.engine.continuous_batching else 0)
        restart_hash = config.restart_hash()
        if restart_hash != self._restart_hash:
            if self._restart_hash is not None:
                _remove(self.config_info, m, self._restart_hash)
            self.config_info.labels(m, restart_hash).set(1)
            self._restart_hash = restart_hash

    def record_config_reload(self, result: str) -> None:
        assert result in CONFIG_RELOAD_RESULTS, result
        self.config_reloads.labels(self.model, result).inc()

    # ---- EngineObserver

    def on_step(self, stats: StepStats) -> None:
        series = self._step
        if stats.num_batched_tokens > 0:
            series.step_time.observe(stats.step_seconds + stats.schedule_seconds)
            series.batch_tokens.observe(stats.num_batched_tokens)
        if stats.num_preemptions:
            series.preemptions.inc(stats.num_preemptions)
        if stats.prefix_cache_queries:
            series.prefix_queries.inc(stats.prefix_cache_queries)
        if stats.prefix_cache_hits > stats.prefix_cache_host_hits:
            series.prefix_hits_device.inc(stats.prefix_cache_hits - stats.prefix_cache_host_hits)
        if stats.prefix_cache_host_hits:
            series.prefix_hits_host.inc(stats.prefix_cache_host_hits)
        if stats.kv_blocks_offloaded:
            series.offload_blocks.inc(stats.kv_blocks_offloaded)
            series.offload_bytes.inc(stats.kv_bytes_offloaded)
        if stats.kv_blocks_restored:
            series.restore_blocks.inc(stats.kv_blocks_restored)
            series.restore_bytes.inc(stats.kv_bytes_restored)
        if stats.kv_restore_seconds is not None:
            series.kv_restore.observe(stats.kv_restore_seconds)
        if stats.oom_events:
            series.oom_events.inc(stats.oom_events)
        lane_series = self._lane_series
        for name, lane in stats.lanes.items():
            per_lane = lane_series.get(name)  # configured lanes only (see set_occupancy)
            if per_lane is not None:
                if lane.prefill_tokens:
                    per_lane.prefill_tokens.inc(lane.prefill_tokens)
                if lane.decode_tokens:
                    per_lane.decode_tokens.inc(lane.decode_tokens)
                if lane.time_capped:
                    per_lane.time_capped.inc()
        lanes = self._lane_series
        for name, seconds in stats.kv_releases:
            self.kv_release.labels(self.model, name if name in lanes else UNKNOWN_LABEL).observe(seconds)
        self.set_occupancy(stats)

    def set_occupancy(self, stats: StepStats) -> None:
        """Gauges from a step's (or a snapshot's) numbers."""
        if stats.kv_blocks_total:
            kv = self._kv_gauges
            if kv is None:
                kv = self._kv_gauges = _KvGauges(self, self.model)
            kv.total.set(stats.kv_blocks_total)
            kv.free.set(stats.kv_blocks_free)
            kv.cached_free.set(stats.kv_blocks_cached_free)
            kv.usage.set(stats.kv_usage)
            kv.host_total.set(stats.kv_host_blocks_total)
            kv.host_used.set(stats.kv_host_blocks_used)
        # Configured lanes only: a step that ran before a reload took effect must not bring
        # back the series of a lane the reload removed (they would stay, stale, for good).
        lanes = stats.lanes
        for name, per_lane in self._lane_series.items():
            lane = lanes.get(name)
            per_lane.running.set(lane.running if lane else 0)
            per_lane.waiting.set(lane.waiting if lane else 0)
            per_lane.kv_blocks.set(lane.kv_blocks_held if lane else 0)
        requests = self._request_gauges
        if requests is None:
            requests = self._request_gauges = (self.num_requests_running.labels(self.model),
                                               self.num_requests_waiting.labels(self.model))
        requests[0].set(sum(lane.running for lane in lanes.values()))
        requests[1].set(sum(lane.waiting for lane in lanes.values()))
        self._set_adapters(stats)

    def _set_adapters(self, stats: StepStats) -> None:
        """The per-adapter gauges and the model-server protocol's info gauges."""
        m = self.model
        if stats.block_size and stats.kv_blocks_total:
            cache = (str(stats.block_size), str(stats.kv_blocks_total))
            if cache != self._cache_info:
                if self._cache_info is not None:
                    _remove(self.cache_config_info, m, *self._cache_info)
                self.cache_config_info.labels(m, *cache).set(1)
                self._cache_info = cache
        adapters = stats.adapters
        for gone in self._adapters - set(adapters):
            _remove(self.adapter_running, m, gone)
            _remove(self.adapter_waiting, m, gone)
        for name, (running, waiting) in adapters.items():
            self.adapter_running.labels(m, name).set(running)
            self.adapter_waiting.labels(m, name).set(waiting)
        self._adapters = set(adapters)
        if not stats.max_loras:
            return
        info = (str(stats.max_loras),
                ",".join(sorted(name for name, (running, _) in adapters.items() if running)),
                ",".join(sorted(name for name, (_, waiting) in adapters.items() if waiting)))
        if info != self._lora_info:
            if self._lora_info is not None:
                _remove(self.lora_requests_info, m, *self._lora_info)
            self._lora_info = info
        self.lora_requests_info.labels(m, *info).set(time.time())

    def record_adapter_denied(self, tenant: str, adapter: str) -> None:
        """A request for an existing adapter its tenant may not use (the API answered 404)."""
        tenant = tenant if tenant in self._tenants else UNKNOWN_LABEL
        self.adapter_denied.labels(self.model, tenant, adapter).inc()

    def on_request_finished(self, request: Request) -> None:
        m, lane, tenant = self.model, request.lane, request.tenant
        if self._lane_series:  # label values stay bounded whatever a direct engine caller passed
            lane = lane if lane in self._lane_series else UNKNOWN_LABEL
            tenant = tenant if tenant in self._tenants else UNKNOWN_LABEL
        reason = request.finish_reason or FinishReason.ERROR
        outcome = OUTCOME_OF_FINISH[reason]
        self.requests.labels(m, lane, tenant, endpoint_label(request.request_id), outcome, reason_label(request)).inc()
        adapter = request.adapter
        if adapter is not None:
            self.adapter_requests.labels(m, adapter, outcome).inc()
            if outcome != "rejected" and request.first_scheduled_time is not None:
                self.adapter_prompt_tokens.labels(m, adapter).inc(request.num_prompt_tokens)
            if outcome != "rejected" and request.num_output_tokens:
                self.adapter_generation_tokens.labels(m, adapter).inc(request.num_output_tokens)
        if outcome == "rejected" and request.finish_detail == "tenant_rate_limit":
            self.tenant_throttled.labels(m, tenant).inc()
        if outcome == "rejected":
            return  # never admitted: no tokens, no latencies
        if request.first_scheduled_time is not None:
            self.prompt_tokens.labels(m, lane, tenant).inc(request.num_prompt_tokens)
            self.queue_delay.labels(m, lane).observe(max(0.0, request.first_scheduled_time - request.arrival_time))
        elif outcome == "timeout" and request.finish_time is not None:
            # Timed out in the queue: its whole life was queue delay.
            self.queue_delay.labels(m, lane).observe(max(0.0, request.finish_time - request.arrival_time))
        if request.num_output_tokens:
            self.generation_tokens.labels(m, lane, tenant).inc(request.num_output_tokens)
        first, done = request.first_token_time, request.finish_time
        if first is None:
            return
        self.ttft.labels(m, lane).observe(max(0.0, first - request.arrival_time))
        if request.first_scheduled_time is not None:
            self.prefill_time.labels(m, lane).observe(max(0.0, first - request.first_scheduled_time))
        if done is None or outcome != "finished":
            return  # cancelled/errored requests would skew the latency SLO histograms
        last = request.token_times[-1] if request.token_times else done
        self.e2e.labels(m, lane).observe(max(0.0, done - request.arrival_time))
        self.decode_time.labels(m, lane).observe(max(0.0, last - first))
        if request.num_output_tokens > 1:
            self.tpot.labels(m, lane).observe(max(0.0, (last - first) / (request.num_output_tokens - 1)))

    def record_invalid(self, lane: str, tenant: str, reason: str, endpoint: str = OTHER_ENDPOINT) -> None:
        """A request the server refused with a 400 before admission (it never reached the
        engine): outcome="invalid", reason one of INVALID_REASONS or "other"; `endpoint` the
        path it was sent to (one of ENDPOINTS, else "other")."""
        lane = lane if lane in self._lane_series else UNKNOWN_LABEL
        tenant = tenant if tenant in self._tenants else UNKNOWN_LABEL
        reason = reason if reason in INVALID_REASONS else "other"
        endpoint = endpoint if endpoint in ENDPOINTS else OTHER_ENDPOINT
        self.requests.labels(self.model, lane, tenant, endpoint, "invalid", reason).inc()

    def on_config_applied(self, config: object, ok: bool, message: str) -> None:
        if ok and isinstance(config, RuntimeConfig):
            self.set_config(config)

    # ---- exposition

    def render(self, names: Optional[Iterable[str]] = None) -> bytes:
        """The exposition; with `names`, only those samples (prometheus_client's `name[]`
        filter, which `tokenlane router` uses to scrape a replica several times a second)."""
        names = list(names or ())
        return generate_latest(self.registry.restricted_registry(names) if names else self.registry)


class _StepSeries:
    """The model's counters and histograms a step writes."""

    __slots__ = ("step_time", "batch_tokens", "preemptions", "prefix_queries", "prefix_hits_device",
                 "prefix_hits_host", "offload_blocks", "offload_bytes", "restore_blocks", "restore_bytes",
                 "kv_restore", "oom_events")

    def __init__(self, metrics: PrometheusMetrics, m: str) -> None:
        self.step_time = metrics.step_time.labels(m)
        self.batch_tokens = metrics.batch_tokens.labels(m)
        self.preemptions = metrics.preemptions.labels(m)
        self.prefix_queries = metrics.prefix_queries.labels(m)
        self.prefix_hits_device = metrics.prefix_hits.labels(m, "device")
        self.prefix_hits_host = metrics.prefix_hits.labels(m, "host")
        self.offload_blocks = metrics.kv_host_transfer_blocks.labels(m, "offload")
        self.offload_bytes = metrics.kv_host_transfer_bytes.labels(m, "offload")
        self.restore_blocks = metrics.kv_host_transfer_blocks.labels(m, "restore")
        self.restore_bytes = metrics.kv_host_transfer_bytes.labels(m, "restore")
        self.kv_restore = metrics.kv_restore.labels(m)
        self.oom_events = metrics.oom_events.labels(m)


class _KvGauges:
    """The model's KV pool gauges."""

    __slots__ = ("total", "free", "cached_free", "usage", "host_total", "host_used")

    def __init__(self, metrics: PrometheusMetrics, m: str) -> None:
        self.total = metrics.kv_total.labels(m)
        self.free = metrics.kv_free.labels(m)
        self.cached_free = metrics.kv_cached_free.labels(m)
        self.usage = metrics.kv_usage.labels(m)
        self.host_total = metrics.kv_host_total.labels(m)
        self.host_used = metrics.kv_host_used.labels(m)


class _LaneSeries:
    """One configured lane's children of the series a step writes."""

    __slots__ = ("running", "waiting", "kv_blocks", "prefill_tokens", "decode_tokens", "time_capped")

    def __init__(self, metrics: PrometheusMetrics, m: str, lane: str) -> None:
        self.running = metrics.running.labels(m, lane)
        self.waiting = metrics.waiting.labels(m, lane)
        self.kv_blocks = metrics.lane_kv_blocks.labels(m, lane)
        self.prefill_tokens = metrics.prefill_tokens.labels(m, lane)
        self.decode_tokens = metrics.decode_tokens.labels(m, lane)
        self.time_capped = metrics.time_capped_steps.labels(m, lane)


def _remove(metric, *labels: str) -> None:
    try:
        metric.remove(*labels)
    except KeyError:
        pass
