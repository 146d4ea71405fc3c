"""The fleet router's view of its replicas: the replica set, one scrape loop per replica that
keeps each one's load and health fresh, and the router's own metrics.

- `BackendSet`: the replicas' base URLs. Static (from `--backend`) unless a discovery watcher
  (EndpointSlices) calls `update`; the scrapers follow the set within one scrape interval.
- Every replica's /metrics and /ready are read every `scrape_interval_s` (250 ms by default):
  per-lane queue and running counts, lane caps, KV usage and its reject watermark. A scrape
  that fails, a /ready that is not 200, or a last good scrape older than `stale_after_s` marks
  the replica down; so does a request that cannot connect to it (`Fleet.mark_down`), until a
  scrape that starts later succeeds.
- `Fleet.views()` is what the pick policy (runtime/fleet/pick.py) sees.
- A scrape that finds a replica healthy that was not wakes every request the router holds for
  want of a ready replica (`Fleet.wait_for_healthy_replica`; scale from zero, docs/fleet.md).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence
from urllib.parse import urlsplit

import httpx
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from tokenlane.runtime.fleet.pick import AFFINITY, LEAST_LOADED, LaneLoad, ReplicaView

log = logging.getLogger("tokenlane.fleet_router")

RETRY = "retry"
PICK_REASONS = (AFFINITY, LEAST_LOADED, RETRY)
# Upstream error kinds: a connection that could not be opened, one that broke before the
# response began, a timeout waiting for it, a replica refusal that never admitted the request
# (retried elsewhere), a response that broke after it began (never retried), a failed scrape.
UPSTREAM_ERROR_KINDS = ("connect", "reset", "timeout", "draining", "queue_full", "kv_watermark",
                        "mid_stream", "scrape")
REFUSAL_CODES = ("no_healthy_replica", "queue_full", "kv_watermark", "upstream_unavailable", "hold_queue_full",
                 "hold_timeout")


# --------------------------------------------------------------------------- the replica set


class BackendSet:
    """The replicas' base URLs. Static (from `--backend`) unless a discovery watcher calls
    `update`; the scrapers follow the set within one scrape interval."""

    def __init__(self, urls: Sequence[str] = ()) -> None:
        self._urls: tuple[str, ...] = ()
        self.update(urls)

    @property
    def urls(self) -> tuple[str, ...]:
        return self._urls

    def update(self, urls: Sequence[str]) -> None:
        self._urls = tuple(dict.fromkeys(normalize_backend_url(u) for u in urls))


def normalize_backend_url(url: str) -> str:
    """`http://host:port` (no trailing slash), or ValueError naming what is wrong."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"backend {url!r} must be an http:// or https:// URL with a host, e.g. http://127.0.0.1:8001")
    if parts.query or parts.fragment:
        raise ValueError(f"backend {url!r} must not have a query or fragment")
    return f"{parts.scheme}://{parts.netloc}{parts.path.rstrip('/')}"


# --------------------------------------------------------------------------- scraping

_WANTED = ("tokenlane_requests_waiting", "tokenlane_requests_running", "tokenlane_kv_cache_usage_ratio",
           "tokenlane_kv_cache_watermark", "tokenlane_lane_budget")
# Asked for with prometheus_client's `name[]` filter, so a replica that honours it renders only
# these families (its full exposition is mostly histograms); one that ignores it sends all.
SCRAPE_PARAMS = [("name[]", name) for name in _WANTED]
_SAMPLE_RE = re.compile(r'^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>.*)\})?\s+(?P<value>\S+)')
_LABEL_RE = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


@dataclass
class ReplicaLoad:
    """The numbers of one /metrics scrape that the pick policy uses."""

    lanes: dict[str, LaneLoad] = field(default_factory=dict)
    kv_usage: float = 0.0
    kv_reject_watermark: Optional[float] = None


def parse_replica_metrics(text: str) -> ReplicaLoad:
    """The load numbers from a replica's Prometheus text (runtime/observability/metrics.py names). Only the
    samples of the wanted families are parsed (a line-level parse: the router scrapes several
    replicas a few times a second). ValueError on a sample it cannot read."""
    lanes: dict[str, dict[str, float]] = {}
    load = ReplicaLoad()
    for line in text.splitlines():
        if not line.startswith(_WANTED):
            continue
        match = _SAMPLE_RE.match(line)
        if match is None:
            raise ValueError(f"unreadable sample line {line[:120]!r}")
        name, value = match["name"], float(match["value"])
        labels = dict(_LABEL_RE.findall(match["labels"] or ""))
        lane = labels.get("lane")
        if name == "tokenlane_requests_waiting" and lane:
            lanes.setdefault(lane, {})["waiting"] = value
        elif name == "tokenlane_requests_running" and lane:
            lanes.setdefault(lane, {})["running"] = value
        elif name == "tokenlane_lane_budget" and lane:
            budget = labels.get("budget")
            if budget == "maxWaitingRequests":
                lanes.setdefault(lane, {})["max_waiting"] = value
            elif budget == "maxActiveSequences":
                lanes.setdefault(lane, {})["max_running"] = value
        elif name == "tokenlane_kv_cache_usage_ratio":
            load.kv_usage = value
        elif name == "tokenlane_kv_cache_watermark" and labels.get("watermark") == "reject":
            load.kv_reject_watermark = value
    load.lanes = {name: LaneLoad(**values) for name, values in lanes.items()}
    return load


@dataclass
class ReplicaState:
    """The router's running view of one replica."""

    url: str
    load: ReplicaLoad = field(default_factory=ReplicaLoad)
    scrape_ok: bool = False
    scraped_at: Optional[float] = None  # monotonic start time of the last good scrape
    down_since: Optional[float] = None  # a request saw it fail (cleared by a later good scrape)
    down_why: str = "not scraped yet"
    dispatched: dict[Optional[str], int] = field(default_factory=dict)  # lane -> sent since last scrape

    def healthy(self, now: float, stale_after_s: float) -> bool:
        return (self.scrape_ok and self.down_since is None and self.scraped_at is not None
                and now - self.scraped_at <= stale_after_s)

    def view(self, now: float, stale_after_s: float) -> ReplicaView:
        return ReplicaView(url=self.url, healthy=self.healthy(now, stale_after_s), lanes=self.load.lanes,
                           kv_usage=self.load.kv_usage, kv_reject_watermark=self.load.kv_reject_watermark,
                           dispatched=dict(self.dispatched))


class RouterMetrics:
    """The router's own metrics (its own registry; docs/fleet.md)."""

    def __init__(self, model: str = "") -> None:
        r = self.registry = CollectorRegistry()
        p = "tokenlane_router_"
        self.model = model  # the served model name (from --config), so Prometheus can tell fleets apart
        self.picks = Counter(p + "picks", "Replica picks by reason (affinity|least_loaded|retry).", ["reason"], registry=r)
        self.upstream_errors = Counter(p + "upstream_errors", "Upstream failures by kind.", ["kind"], registry=r)
        self.refusals = Counter(p + "refusals", "Requests the router answered 429/503 itself, by code.", ["code"],
                                registry=r)
        self.disconnects = Counter(p + "client_disconnects", "Clients that went away before their response ended.",
                                   registry=r)
        self.backend_up = Gauge(p + "backend_up", "1 when the replica is healthy (fresh scrape, ready).", ["backend"],
                                registry=r)
        # Scale from zero: the autoscaler reads these (held demand wakes the pool; no arrivals
        # for a while lets it sleep).
        self.requests = Counter(p + "requests", "Generation requests the router received.", ["model"],
                                registry=r).labels(model)
        self.arrived_without_replica = Counter(
            p + "requests_without_replica", "Requests (any endpoint) that arrived while no replica was ready.",
            ["model"], registry=r).labels(model)
        self.held = Gauge(p + "held_requests", "Requests held now, waiting for a replica to become ready.",
                          ["model"], registry=r).labels(model)
        for reason in PICK_REASONS:
            self.picks.labels(reason)
        for kind in UPSTREAM_ERROR_KINDS:
            self.upstream_errors.labels(kind)
        for code in REFUSAL_CODES:
            self.refusals.labels(code)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class Fleet:
    """The replica states, kept fresh by one scrape loop per replica."""

    def __init__(self, backends: BackendSet, metrics: RouterMetrics, *, scrape_interval_s: float = 0.25,
                 stale_after_s: Optional[float] = None, scrape_timeout_s: float = 1.0) -> None:
        if not scrape_interval_s > 0:
            raise ValueError(f"scrape interval must be > 0 seconds, got {scrape_interval_s!r}")
        self.backends = backends
        self.metrics = metrics
        self.scrape_interval_s = scrape_interval_s
        self.stale_after_s = stale_after_s if stale_after_s is not None else max(1.0, 4 * scrape_interval_s)
        self.scrape_timeout_s = scrape_timeout_s
        self.states: dict[str, ReplicaState] = {}
        self._scrapers: dict[str, asyncio.Task] = {}
        self._supervisor: Optional[asyncio.Task] = None
        self._client: Optional[httpx.AsyncClient] = None
        # Set (and replaced) each time a replica becomes healthy: held requests wait on it.
        self._became_healthy = asyncio.Event()

    # ---- views for the pick policy

    def views(self) -> list[ReplicaView]:
        now = time.monotonic()
        return [self.states[url].view(now, self.stale_after_s) for url in self.backends.urls if url in self.states]

    def healthy_count(self) -> int:
        return sum(view.healthy for view in self.views())

    async def wait_for_healthy_replica(self) -> None:
        """Return once some replica has become healthy (by a scrape) after this call began."""
        await self._became_healthy.wait()

    def _notify_healthy(self) -> None:
        event, self._became_healthy = self._became_healthy, asyncio.Event()
        event.set()

    def note_dispatch(self, url: str, lane: Optional[str]) -> None:
        state = self.states.get(url)
        if state is not None:
            state.dispatched[lane] = state.dispatched.get(lane, 0) + 1

    def mark_down(self, url: str, why: str) -> None:
        """A request could not reach the replica: down until a scrape that starts later succeeds."""
        state = self.states.get(url)
        if state is not None and state.down_since is None:
            state.down_since = time.monotonic()
            state.down_why = why
            self.metrics.backend_up.labels(url).set(0)
            log.warning("replica %s marked down: %s", url, why)

    # ---- scraping

    async def start(self) -> None:
        self._client = httpx.AsyncClient(timeout=self.scrape_timeout_s, trust_env=False)
        self._sync()
        self._supervisor = asyncio.get_running_loop().create_task(self._supervise(), name="fleet-supervisor")

    async def stop(self) -> None:
        tasks = [t for t in [self._supervisor, *self._scrapers.values()] if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._scrapers.clear()
        if self._client is not None:
            await self._client.aclose()

    async def scrape_all_once(self) -> None:
        """One scrape of every replica now (used at start-up, and by tests)."""
        await asyncio.gather(*(self._scrape(self.states[url]) for url in self.backends.urls if url in self.states))

    def _sync(self) -> None:
        """Start scrapers for new replicas, stop those of replicas that left the set."""
        urls = set(self.backends.urls)
        for url in urls - set(self.states):
            self.states[url] = ReplicaState(url)
            self.metrics.backend_up.labels(url).set(0)
            self._scrapers[url] = asyncio.get_running_loop().create_task(self._scrape_forever(url),
                                                                        name=f"scrape {url}")
        for url in set(self.states) - urls:
            self._scrapers.pop(url).cancel()
            del self.states[url]
            try:
                self.metrics.backend_up.remove(url)
            except KeyError:
                pass

    async def _supervise(self) -> None:
        while True:
            await asyncio.sleep(self.scrape_interval_s)
            self._sync()

    async def _scrape_forever(self, url: str) -> None:
        while True:
            state = self.states.get(url)
            if state is None:
                return
            await self._scrape(state)
            await asyncio.sleep(self.scrape_interval_s)

    async def _scrape(self, state: ReplicaState) -> None:
        assert self._client is not None, "Fleet.start() first"
        started = time.monotonic()
        was_healthy = state.healthy(started, self.stale_after_s)
        sent_before = dict(state.dispatched)
        try:
            metrics_resp, ready_resp = await asyncio.gather(
                self._client.get(state.url + "/metrics", params=SCRAPE_PARAMS),
                self._client.get(state.url + "/ready"))
            if metrics_resp.status_code != 200:
                raise ValueError(f"/metrics answered {metrics_resp.status_code}")
            load = parse_replica_metrics(metrics_resp.text)
        except (httpx.HTTPError, ValueError) as exc:
            was_ok = state.scrape_ok
            state.scrape_ok = False
            state.down_why = f"scrape failed: {type(exc).__name__}: {exc}"
            self.metrics.upstream_errors.labels("scrape").inc()
            self.metrics.backend_up.labels(state.url).set(0)
            if was_ok:
                log.warning("replica %s down: %s", state.url, state.down_why)
            return
        state.load = load
        state.scraped_at = started
        state.scrape_ok = ready_resp.status_code == 200
        if not state.scrape_ok:
            state.down_why = f"/ready answered {ready_resp.status_code}"
        if state.down_since is not None and state.down_since < started:
            state.down_since = None  # this scrape began after the failure and found it well
        for lane, count in sent_before.items():  # those are in this scrape's numbers now
            left = state.dispatched.get(lane, 0) - count
            if left > 0:
                state.dispatched[lane] = left
            else:
                state.dispatched.pop(lane, None)
        healthy = state.healthy(time.monotonic(), self.stale_after_s)
        self.metrics.backend_up.labels(state.url).set(1 if healthy else 0)
        if healthy and not was_healthy:
            self._notify_healthy()
