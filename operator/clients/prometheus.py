"""Reading the runtime's metrics back from Prometheus (HTTP API, PromQL) for the tuner.

One `MetricSample` per model and window: per lane TTFT / TPOT / queue-delay p95 from the
runtime's histograms (docs/metrics.md), answered and refused request rates (the thin-data
check and the refused share: 429/503 refusals and 504 queue timeouts, 429 queue_full also
on its own), generated tokens per second, queued requests; and for the
whole model the highest KV usage and the preemption rate. Any failure (connection refused,
timeout, HTTP error, a PromQL error) gives `MetricSample.unavailable(reason)`, never an
exception: the tuner then holds the budgets and says why.
"""

from __future__ import annotations

import asyncio
import math
import re
from dataclasses import dataclass
from typing import Mapping, Optional

import httpx

from tokenlane.operator.api.tuning_types import LaneMetrics, MetricSample

PREFIX = "tokenlane_"
_LABEL_VALUE_RE = re.compile(r'^[^"\\\n]*$')


class PrometheusError(Exception):
    """Prometheus could not answer (unreachable, timeout, bad status, query error)."""


@dataclass(frozen=True)
class Series:
    labels: Mapping[str, str]
    value: Optional[float]  # None for NaN / +-Inf (e.g. a quantile over no observations)


def _matchers(model: str, extra: Mapping[str, str]) -> str:
    pairs = {"model": model, **extra}
    for key, value in pairs.items():
        if not _LABEL_VALUE_RE.match(value):
            raise ValueError(f"label value for {key!r} may not contain quotes, backslashes or newlines")
    return ",".join(f'{key}="{value}"' for key, value in sorted(pairs.items()))


def _duration(seconds: float) -> str:
    return f"{max(1, int(round(seconds)))}s"


def queries(model: str, window_s: float, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The PromQL this module runs, by name (also useful to paste into Grafana)."""
    m, w = _matchers(model, extra or {}), _duration(window_s)

    def p95(histogram: str) -> str:
        return (
            f"histogram_quantile(0.95, sum by (le, lane) "
            f"(rate({PREFIX}{histogram}_bucket{{{m}}}[{w}])))"
        )

    return {
        "ttft_p95": p95("time_to_first_token_seconds"),
        "tpot_p95": p95("time_per_output_token_seconds"),
        "queue_delay_p95": p95("queue_delay_seconds"),
        "requests": f"sum by (lane, outcome, reason) (rate({PREFIX}requests_total{{{m}}}[{w}]))",
        "throughput": f"sum by (lane) (rate({PREFIX}generation_tokens_total{{{m}}}[{w}]))",
        "waiting": f"sum by (lane) (avg_over_time({PREFIX}requests_waiting{{{m}}}[{w}]))",
        "kv_usage": f"max(max_over_time({PREFIX}kv_cache_usage_ratio{{{m}}}[{w}]))",
        "preemptions": f"sum(rate({PREFIX}preemptions_total{{{m}}}[{w}]))",
    }


# outcome="rejected" reasons the server answers with a 400 (the request itself is at fault).
CLIENT_ERROR_REJECTIONS = ("too_long", "invalid")


def refused(outcome: str, reason: str) -> bool:
    """A request the lane refused (429/503) or let time out (504): what a lane's
    `slo.maxRefusedShare` budgets. Invalid requests (400) are the caller's fault, not a refusal."""
    if outcome == "timeout":
        return True
    return outcome == "rejected" and reason not in CLIENT_ERROR_REJECTIONS


def _number(text: str) -> Optional[float]:
    value = float(text)
    return None if math.isnan(value) or math.isinf(value) else value


class PrometheusClient:
    """A small async client for the instant-query endpoint (/api/v1/query)."""

    def __init__(self, url: str, *, timeout_s: float = 5.0, client: httpx.AsyncClient | None = None) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"prometheusUrl must start with http:// or https://, got {url!r}")
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self._client = client

    async def query(self, promql: str, at: float | None = None) -> list[Series]:
        params = {"query": promql}
        if at is not None:
            params["time"] = f"{at:.3f}"
        try:
            if self._client is not None:
                response = await self._client.get(f"{self.url}/api/v1/query", params=params, timeout=self.timeout_s)
            else:
                async with httpx.AsyncClient(timeout=self.timeout_s) as client:
                    response = await client.get(f"{self.url}/api/v1/query", params=params)
        except httpx.TimeoutException:
            raise PrometheusError(f"timed out after {self.timeout_s:.0f}s querying {self.url}") from None
        except httpx.HTTPError as exc:
            raise PrometheusError(f"cannot reach {self.url}: {exc.__class__.__name__}: {exc}") from None
        try:
            body = response.json()
        except ValueError:
            raise PrometheusError(f"{self.url} answered HTTP {response.status_code} with a non-JSON body") from None
        if response.status_code != 200 or body.get("status") != "success":
            error = body.get("error") or f"HTTP {response.status_code}"
            raise PrometheusError(f"query failed: {body.get('errorType', 'error')}: {error}")
        data = body.get("data") or {}
        if data.get("resultType") != "vector":
            raise PrometheusError(f"expected an instant vector, got {data.get('resultType')!r}")
        return [Series(item.get("metric", {}), _number(item["value"][1])) for item in data.get("result", [])]

    async def query_all(self, named: Mapping[str, str], at: float | None = None) -> dict[str, list[Series]]:
        """Every query of `named` (name -> PromQL) at once, over one connection pool: the
        injected client, else one opened for the batch (not one per query). The first
        failure raises PrometheusError."""
        if self._client is None:
            async with httpx.AsyncClient(timeout=self.timeout_s) as client:
                return await PrometheusClient(self.url, timeout_s=self.timeout_s, client=client).query_all(named, at)
        results = await asyncio.gather(*(self.query(promql, at) for promql in named.values()), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return dict(zip(named, results))

    async def read_sample(
        self,
        model: str,
        window_s: float,
        *,
        lanes: list[str] | None = None,
        extra_matchers: Mapping[str, str] | None = None,
        at: float | None = None,
    ) -> MetricSample:
        """All tuner inputs for one model over the window ending now (or at `at`)."""
        try:
            results = await self.query_all(queries(model, window_s, extra_matchers), at)
        except PrometheusError as exc:
            return MetricSample.unavailable(str(exc), window_s)
        return sample_from_results(results, window_s, lanes=lanes, at=at)


def sample_from_results(
    results: Mapping[str, list[Series]], window_s: float, *, lanes: list[str] | None = None, at: float | None = None
) -> MetricSample:
    """Assemble a MetricSample from the named query results (see `queries`)."""
    per_lane: dict[str, dict] = {}

    def lane_of(series: Series) -> str:
        return series.labels.get("lane", "")

    def put(lane: str, key: str, value: Optional[float], add: bool = False) -> None:
        entry = per_lane.setdefault(lane, {})
        if add:
            entry[key] = entry.get(key, 0.0) + (value or 0.0)
        else:
            entry[key] = value

    for key, name in (("ttft_p95_s", "ttft_p95"), ("tpot_p95_s", "tpot_p95"), ("queue_delay_p95_s", "queue_delay_p95")):
        for series in results.get(name, []):
            put(lane_of(series), key, series.value)
    for series in results.get("requests", []):
        outcome, reason = series.labels.get("outcome", ""), series.labels.get("reason", "")
        key = "rejection_rate" if refused(outcome, reason) else "request_rate"
        put(lane_of(series), key, series.value, add=True)
        if key == "rejection_rate" and reason == "queue_full":
            put(lane_of(series), "queue_full_rate", series.value, add=True)
    for series in results.get("throughput", []):
        put(lane_of(series), "throughput_tokens_s", series.value, add=True)
    for series in results.get("waiting", []):
        put(lane_of(series), "waiting", series.value, add=True)

    per_lane.pop("", None)  # series without a lane label carry no per-lane meaning
    names = lanes if lanes is not None else sorted(per_lane)
    lane_metrics = {name: LaneMetrics(**per_lane.get(name, {})) for name in names}

    def scalar(name: str) -> Optional[float]:
        series = results.get(name, [])
        return series[0].value if series else None

    return MetricSample(
        window_s=window_s,
        lanes=lane_metrics,
        kv_usage=scalar("kv_usage"),
        preemption_rate=scalar("preemptions") or 0.0,
        at=at,
    )
