"""`tokenlane router`: a thin HTTP router in front of a fleet of `tokenlane serve` replicas.

    client -> router (lane, load, prefix affinity: runtime/fleet/pick.py) -> one replica

- The replicas, their scraped load and health: runtime/fleet/state.py (`BackendSet`, static
  from `--backend`, or kept up to date from a Service's EndpointSlices by
  runtime/fleet/discovery.py; `Fleet`, one scrape loop each).
- Generation requests are forwarded unchanged (body and headers) to the picked replica; its
  response (status, headers, body; SSE included) is passed through byte for byte. A client
  that goes away closes the upstream connection at once, so the replica aborts the request
  and frees its KV blocks.
- Retries happen only before the first response byte: a connection refused or reset, or a
  replica refusal that never admitted the request (503 draining, 429 queue_full, 503
  kv_watermark) goes to another replica, each replica at most once per request. Once the
  response has started, an upstream failure ends the client's response (never a retry).
- When no replica is ready at all (a pool scaled to zero, or one that is starting), a request
  is held in a bounded queue until a scrape finds a replica ready, then forwarded; past
  `hold_timeout_s`, or with `hold_queue_size` requests held already, it gets 503 with
  Retry-After (codes hold_timeout, hold_queue_full). Streaming requests alike: nothing is sent
  to the client before a replica answers.
- When no replica can take the request the router answers 429/503 itself, with Retry-After
  and OpenAI's error body.

With `--config runtime.yaml` the router applies the runtime's own tenant and lane rules
(runtime/entrypoints/routing.py) to know each request's lane; prompt-length match rules use an estimate
(fleet_pick.estimate_prompt_tokens). The replica still decides the lane itself from the
unchanged request. See docs/fleet.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Mapping, Optional

import anyio
import httpx
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tokenlane import kube
from tokenlane.runtime.config import ConfigError, RuntimeConfig, load_config
from tokenlane.runtime.fleet.pick import (DEFAULT_HOLD_QUEUE_SIZE, DEFAULT_HOLD_TIMEOUT_S, NO_HEALTHY_RETRY_AFTER_S,
                                          PickPolicy, Refusal, affinity_key, estimate_prompt_tokens, pick)
from tokenlane.runtime.fleet.discovery import EndpointSliceWatcher
from tokenlane.runtime.fleet.state import RETRY, BackendSet, Fleet, RouterMetrics
from tokenlane.runtime.entrypoints.http_errors import api_error_response, error_response
from tokenlane.runtime.entrypoints.protocol import APIError
from tokenlane.runtime.entrypoints.routing import authenticate, choose_lane
from tokenlane.runtime.entrypoints.sse import wait_disconnect

log = logging.getLogger("tokenlane.fleet_router")

RETRYABLE_REFUSALS = ("draining", "queue_full", "kv_watermark")
# Request and response headers that belong to one connection, not to the message.
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
                        "trailer", "trailers", "transfer-encoding", "upgrade", "host", "content-length"})
REPLICA_HEADER = "x-tokenlane-replica"
GENERATION_PATHS = {"/v1/completions": False, "/v1/chat/completions": True}  # path -> is chat


# --------------------------------------------------------------------------- forwarding


@dataclass(frozen=True)
class RouterOptions:
    scrape_interval_s: float = 0.25
    stale_after_s: Optional[float] = None  # default: max(1 s, 4 scrape intervals)
    affinity_prefix_chars: int = 256
    affinity_slack: float = 4.0
    connect_timeout_s: float = 2.0
    upstream_timeout_s: float = 600.0  # waiting for a replica's response to begin, and between chunks
    # Requests held while no replica is ready (0: none, such a request gets 503 at once), and
    # how long each may wait for one (a cold start from zero takes tens of seconds or more).
    hold_queue_size: int = DEFAULT_HOLD_QUEUE_SIZE
    hold_timeout_s: float = DEFAULT_HOLD_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.affinity_prefix_chars < 0:
            raise ValueError(f"affinity prefix must be >= 0 characters, got {self.affinity_prefix_chars}")
        if self.hold_queue_size < 0:
            raise ValueError(f"hold queue size must be >= 0 requests, got {self.hold_queue_size}")
        for name in ("connect_timeout_s", "upstream_timeout_s", "hold_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")


def _error_code(raw: bytes) -> Optional[str]:
    try:
        code = json.loads(raw)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None
    return code if isinstance(code, str) else None


async def _send_whole(response: Response, send) -> None:
    """Send a complete (non-streaming) Starlette response through a raw ASGI `send`."""
    await send({"type": "http.response.start", "status": response.status_code, "headers": response.raw_headers})
    await send({"type": "http.response.body", "body": response.body, "more_body": False})


class Forwarder:
    """The ASGI endpoint that forwards one request to a picked replica (generation endpoints
    with lane and affinity; the others, such as /v1/models, by load alone)."""

    def __init__(self, fleet: Fleet, config: Optional[RuntimeConfig], options: RouterOptions) -> None:
        self.fleet = fleet
        self.config = config
        self.options = options
        self.policy = PickPolicy(affinity_slack=options.affinity_slack)
        self.metrics = fleet.metrics
        self.client: Optional[httpx.AsyncClient] = None
        self.held = 0  # requests waiting now for a replica to become ready

    async def start(self) -> None:
        timeout = httpx.Timeout(self.options.upstream_timeout_s, connect=self.options.connect_timeout_s)
        self.client = httpx.AsyncClient(timeout=timeout, trust_env=False,
                                        limits=httpx.Limits(max_connections=4096, max_keepalive_connections=256))

    async def stop(self) -> None:
        if self.client is not None:
            await self.client.aclose()

    async def __call__(self, scope, receive, send) -> None:
        chunks = []
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self.metrics.disconnects.inc()
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        try:
            lane, key = self._route(scope["path"], headers, body)
        except APIError as exc:
            await api_error_response(exc)(scope, receive, send)
            return

        completed = False

        async def tracked_send(message) -> None:
            nonlocal completed
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                completed = True

        gone = False
        async with anyio.create_task_group() as tg:

            async def watch() -> None:
                nonlocal gone
                await wait_disconnect(receive)  # also returns once the response is complete
                gone = not completed
                tg.cancel_scope.cancel()

            tg.start_soon(watch)
            try:
                await self._forward(scope, headers, body, lane, key, tracked_send)
            finally:
                tg.cancel_scope.cancel()
        if gone:
            self.metrics.disconnects.inc()

    def _route(self, path: str, headers: Mapping[str, str], body: bytes) -> tuple[Optional[str], bytes]:
        """The request's lane (None when the router has no config and no X-Lane) and its
        affinity key (empty for non-generation requests)."""
        chat = GENERATION_PATHS.get(path)
        if chat is None:
            return None, b""
        try:
            payload = json.loads(body) if body else None
        except ValueError:
            payload = None  # the replica answers the 400
        key = affinity_key(payload, chat, self.options.affinity_prefix_chars)
        if self.config is None:
            return headers.get("x-lane", "").strip() or None, key
        caller = authenticate(self.config, headers)
        return choose_lane(self.config, caller, headers, estimate_prompt_tokens(payload, chat)), key

    async def _forward(self, scope, headers: Mapping[str, str], body: bytes, lane: Optional[str], key: bytes,
                       send) -> None:
        assert self.client is not None, "Forwarder.start() first"
        # From the raw list: a header sent twice (e.g. Cookie) is forwarded twice.
        upstream_headers = [(k, v) for k, v in scope["headers"] if k.decode("latin-1").lower() not in HOP_BY_HOP]
        target = scope["path"] + (("?" + scope["query_string"].decode("latin-1")) if scope.get("query_string") else "")
        tried: set[str] = set()
        refused: Optional[tuple[int, httpx.Headers, bytes]] = None  # the last replica refusal
        if scope["path"] in GENERATION_PATHS:
            self.metrics.requests.inc()
        waited = False  # held once already: a request is held at most once
        while True:
            choice = pick(self.fleet.views(), lane, key, self.policy, frozenset(tried))
            if isinstance(choice, Refusal) and not tried and not waited and self.fleet.healthy_count() == 0:
                self.metrics.arrived_without_replica.inc()
                if self.options.hold_queue_size > 0:
                    waited = True
                    held_refusal = await self._hold()
                    if held_refusal is None:
                        continue  # a replica became ready: pick again
                    choice = held_refusal
            if isinstance(choice, Refusal):
                await self._answer_refusal(choice, tried, refused, send)
                return
            url = choice.url
            self.metrics.picks.labels(RETRY if tried else choice.reason).inc()
            tried.add(url)
            self.fleet.note_dispatch(url, lane)
            request = self.client.build_request(scope["method"], url + target, headers=upstream_headers,
                                                content=body)
            try:
                response = await self.client.send(request, stream=True)
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:  # refused, unreachable: nothing sent
                self.metrics.upstream_errors.labels("connect").inc()
                self.fleet.mark_down(url, f"connect failed: {type(exc).__name__}: {exc}")
                continue
            except httpx.TimeoutException:
                # The replica took the request but its response did not begin in time: it may be
                # running it, so it is not sent again.
                self.metrics.upstream_errors.labels("timeout").inc()
                await _send_whole(error_response(504, f"the replica did not begin its response within "
                                                      f"{self.options.upstream_timeout_s:g} s",
                                                 code="upstream_timeout", headers={REPLICA_HEADER: url}), send)
                return
            except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError):
                # The connection broke before the response began (the replica died, or a pooled
                # keep-alive connection was closed by it): the request never started streaming.
                self.metrics.upstream_errors.labels("reset").inc()
                continue
            if response.status_code in (429, 503):
                raw = await self._read_all(response)
                code = _error_code(raw)
                if code in RETRYABLE_REFUSALS:  # never admitted there: try another replica
                    self.metrics.upstream_errors.labels(code).inc()
                    if code == "draining":
                        self.fleet.mark_down(url, "draining")
                    refused = (response.status_code, response.headers, raw)
                    continue
                await self._send_buffered(response.status_code, response.headers, raw, url, send)
                return
            await self._stream(response, url, send)
            return

    async def _hold(self) -> Optional[Refusal]:
        """Wait until a replica is ready (None), or why the request will not wait (a Refusal):
        the hold queue is full, or `hold_timeout_s` passed. A client that goes away cancels the
        wait (Forwarder.__call__), which leaves the queue at once."""
        if self.held >= self.options.hold_queue_size:
            return Refusal(503, "hold_queue_full",
                           f"no replica is ready and {self.held} requests are already waiting for one",
                           NO_HEALTHY_RETRY_AFTER_S)
        self.held += 1
        self.metrics.held.inc()
        try:
            with anyio.move_on_after(self.options.hold_timeout_s):
                while self.fleet.healthy_count() == 0:
                    await self.fleet.wait_for_healthy_replica()
                return None
            return Refusal(503, "hold_timeout",
                           f"no replica became ready within {self.options.hold_timeout_s:g} s",
                           NO_HEALTHY_RETRY_AFTER_S)
        finally:
            self.held -= 1
            self.metrics.held.dec()

    async def _read_all(self, response: httpx.Response) -> bytes:
        try:
            return await response.aread()
        finally:
            await response.aclose()

    async def _answer_refusal(self, refusal: Refusal, tried: set[str],
                              refused: Optional[tuple[int, httpx.Headers, bytes]], send) -> None:
        """No (more) replica to try: the last replica refusal as it was, or the router's own."""
        if refused is not None:
            status, headers, raw = refused
            await self._send_buffered(status, headers, raw, None, send)
            return
        if tried and refusal.code == "no_healthy_replica":  # every replica left was tried, and broke
            refusal = Refusal(503, "upstream_unavailable",
                              f"no replica could be reached ({len(tried)} tried)", refusal.retry_after_s)
        self.metrics.refusals.labels(refusal.code).inc()
        await _send_whole(error_response(refusal.status, refusal.message, code=refusal.code,
                                         retry_after_s=refusal.retry_after_s), send)

    @staticmethod
    def _response_headers(headers: httpx.Headers, url: Optional[str], keep_length: bool) -> list[tuple[bytes, bytes]]:
        out = [(k.lower(), v) for k, v in headers.raw
               if k.lower().decode("latin-1") not in HOP_BY_HOP or (keep_length and k.lower() == b"content-length")]
        if url is not None:
            out.append((REPLICA_HEADER.encode(), url.encode()))
        return out

    async def _send_buffered(self, status: int, headers: httpx.Headers, raw: bytes, url: Optional[str],
                             send) -> None:
        # aread() decoded any content-encoding: send the decoded bytes without it.
        out = [(k, v) for k, v in self._response_headers(headers, url, keep_length=False)
               if k != b"content-encoding"]
        out.append((b"content-length", str(len(raw)).encode()))
        await send({"type": "http.response.start", "status": status, "headers": out})
        await send({"type": "http.response.body", "body": raw, "more_body": False})

    async def _stream(self, response: httpx.Response, url: str, send) -> None:
        """Pass the response through byte for byte (raw: still content-encoded, as the replica
        sent it). From here on there is no retry: an upstream failure ends the client's
        response without its final chunk, so the client sees it broke."""
        try:
            await send({"type": "http.response.start", "status": response.status_code,
                        "headers": self._response_headers(response.headers, url, keep_length=True)})
            try:
                async for chunk in response.aiter_raw():
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            except httpx.HTTPError as exc:
                self.metrics.upstream_errors.labels("mid_stream").inc()
                log.warning("replica %s broke off a response: %s: %s", url, type(exc).__name__, exc)
                return
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            # Also on cancellation (the client went away): closing an unfinished response
            # closes its connection, and the replica aborts the request.
            with anyio.CancelScope(shield=True):
                await response.aclose()


# --------------------------------------------------------------------------- the app


def create_router_app(backends: BackendSet, config: Optional[RuntimeConfig] = None,
                      options: Optional[RouterOptions] = None,
                      discovery: Optional[EndpointSliceWatcher] = None) -> Starlette:
    """The router's ASGI app; its lifespan starts the scrapers, the upstream client and the
    discovery of `backends`, when given."""
    options = options or RouterOptions()
    metrics = RouterMetrics(config.model.name if config is not None else "")
    fleet = Fleet(backends, metrics, scrape_interval_s=options.scrape_interval_s,
                  stale_after_s=options.stale_after_s)
    forwarder = Forwarder(fleet, config, options)

    async def health(request: Request) -> Response:
        # Liveness: the router itself; replicas being down is what /ready reports.
        return JSONResponse({"status": "ok"})

    async def ready(request: Request) -> Response:
        healthy = fleet.healthy_count()
        if healthy == 0 and options.hold_queue_size == 0:
            return error_response(503, "no healthy replica", code="no_healthy_replica")
        # With holding on the router is ready at zero replicas: it takes the requests that wake the pool.
        return JSONResponse({"status": "ready", "healthy_replicas": healthy, "replicas": len(backends.urls)})

    async def prometheus_metrics(request: Request) -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def not_found(request: Request, exc: StarletteHTTPException) -> Response:
        return error_response(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", code=None)

    @asynccontextmanager
    async def lifespan(app: Starlette):
        await forwarder.start()
        if discovery is not None:
            await discovery.start()  # the first list, so the first scrape sees the replicas
        await fleet.start()
        await fleet.scrape_all_once()  # a first view before the first request
        log.info("routing to %d replicas (%d healthy)", len(backends.urls), fleet.healthy_count())
        try:
            yield
        finally:
            await fleet.stop()
            if discovery is not None:
                await discovery.stop()
            await forwarder.stop()

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/ready", ready, methods=["GET"]),
        Route("/metrics", prometheus_metrics, methods=["GET"]),
        Route("/v1/completions", forwarder, methods=["POST"]),
        Route("/v1/chat/completions", forwarder, methods=["POST"]),
        Route("/v1/models", forwarder, methods=["GET"]),
        Route("/v1/models/{model_id:path}", forwarder, methods=["GET"]),
        Route("/tokenize", forwarder, methods=["POST"]),
        Route("/detokenize", forwarder, methods=["POST"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={StarletteHTTPException: not_found})
    app.state.fleet = fleet
    app.state.forwarder = forwarder
    return app


# --------------------------------------------------------------------------- the command line


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tokenlane router",
        description="Route OpenAI API requests across tokenlane replicas by lane, load and prompt prefix.",
    )
    p.add_argument("--backend", action="append", default=[], metavar="URL",
                   help="a replica's base URL, e.g. http://127.0.0.1:8001 (repeat for each replica)")
    p.add_argument("--endpointslice-service", metavar="NAME",
                   help="instead of --backend: the ready pods of this Service, from its EndpointSlices "
                        "(in a Kubernetes pod, through its service account)")
    p.add_argument("--namespace", help="the Service's namespace (default: the pod's own)")
    p.add_argument("--config", help="runtime.yaml of the replicas: the router then knows tenants and lane rules")
    p.add_argument("--host", default="0.0.0.0", help="bind address (default 0.0.0.0)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--scrape-interval-ms", type=float, default=250.0,
                   help="how often each replica's /metrics and /ready are read (default 250)")
    p.add_argument("--stale-after-ms", type=float, default=None,
                   help="a replica whose last good scrape is older is down (default max(1000, 4 intervals))")
    p.add_argument("--affinity-prefix-chars", type=int, default=256,
                   help="prompt characters hashed for prefix affinity (default 256; 0: load only)")
    p.add_argument("--affinity-slack", type=float, default=4.0,
                   help="queued requests the affine replica may have above the least loaded one (default 4)")
    p.add_argument("--upstream-timeout-s", type=float, default=600.0,
                   help="how long a replica may take to begin its response, and between chunks (default 600)")
    p.add_argument("--hold-queue-size", type=int, default=DEFAULT_HOLD_QUEUE_SIZE,
                   help="requests held while no replica is ready, e.g. a pool scaled to zero (default 1000; "
                        "0: answer 503 at once)")
    p.add_argument("--hold-timeout-s", type=float, default=DEFAULT_HOLD_TIMEOUT_S,
                   help="how long a held request waits for a replica to become ready before its 503 (default 300)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p


def main(argv: Optional[list[str]] = None) -> int:
    import uvicorn

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per scrape otherwise
    if bool(args.backend) == bool(args.endpointslice_service):
        print("tokenlane router: give either --backend URL (repeatable) or --endpointslice-service NAME",
              file=sys.stderr)
        return 2
    discovery = None
    try:
        backends = BackendSet(args.backend)
        if args.endpointslice_service:
            namespace = args.namespace or kube.in_cluster_namespace()
            if not namespace:
                raise ValueError("--endpointslice-service needs --namespace outside a Kubernetes pod")
            discovery = EndpointSliceWatcher(kube.in_cluster(), namespace, args.endpointslice_service, backends)
        options = RouterOptions(
            scrape_interval_s=args.scrape_interval_ms / 1000.0,
            stale_after_s=None if args.stale_after_ms is None else args.stale_after_ms / 1000.0,
            affinity_prefix_chars=args.affinity_prefix_chars,
            affinity_slack=args.affinity_slack,
            upstream_timeout_s=args.upstream_timeout_s,
            hold_queue_size=args.hold_queue_size,
            hold_timeout_s=args.hold_timeout_s,
        )
        if not options.scrape_interval_s > 0:
            raise ValueError(f"--scrape-interval-ms must be > 0, got {args.scrape_interval_ms:g}")
        PickPolicy(affinity_slack=options.affinity_slack)
        config = load_config(args.config) if args.config else None
    except (ValueError, ConfigError) as exc:
        print(f"tokenlane router: {exc}", file=sys.stderr)
        return 2
    app = create_router_app(backends, config, options, discovery)
    # The replicas' Date and Server headers pass through unchanged; uvicorn adds none of its own.
    uv_config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, lifespan="on",
                               server_header=False, date_header=False, timeout_graceful_shutdown=5)

    class Server(uvicorn.Server):
        """Exits 0 after the graceful shutdown a first SIGTERM/SIGINT starts (uvicorn's own
        handling re-raises the signal once shut down, so the process would end with -15)."""

        def handle_exit(self, sig, frame) -> None:
            if self.should_exit:
                return super().handle_exit(sig, frame)  # a second signal: uvicorn's forced exit
            self.should_exit = True

    Server(uv_config).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
