"""Async HTTP load generator for any OpenAI-compatible endpoint (tokenlane, vLLM, ...).

Replays a list of `PlannedRequest` (trace.py) at their arrival offsets with httpx, one task per
request, and records per request: TTFT (arrival -> first streamed token), TPOT, E2E, HTTP
status and the error `code` of a refusal (queue_full, kv_watermark, deadline, draining, ...),
the lane that served it (`X-Lane` response header, else the lane asked for), queue delay when
the server reports it (`X-Queue-Delay-Ms` response header, or `usage.queue_delay_ms`), and
planned client cancellations (the stream is closed after N tokens).

Bounded: at most `max_requests` requests, `time_limit_s` for the whole run, and
`request_timeout_s` each. Loopback only: the target must resolve to 127.0.0.0/8 or ::1.
Prompts are token-id lists by default (exact lengths on any server that accepts them, as
OpenAI's completions API and vLLM do); `prompt_mode="text"` sends words instead.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import socket
import time
from dataclasses import dataclass
from typing import Any, Optional
from urllib.parse import urlparse

from tokenlane.bench.report import (
    CANCELLED,
    ERROR,
    OK,
    REJECTED,
    TIMEOUT,
    LaneSLO,
    RequestRecord,
    RunResult,
    TokenBins,
)
from tokenlane.bench.trace import PlannedRequest, Traffic

MAX_REQUESTS_HARD = 100_000
REJECT_STATUSES = (400, 401, 403, 413, 422, 429, 503)


def check_loopback(base_url: str) -> None:
    """ValueError unless base_url's host is a loopback address (the harness never leaves the box)."""
    parsed = urlparse(base_url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ValueError(f"target {base_url!r} must be an http(s) URL, e.g. http://127.0.0.1:8000")
    try:
        infos = socket.getaddrinfo(parsed.hostname, parsed.port or 80, proto=socket.IPPROTO_TCP)
    except socket.gaierror as exc:
        raise ValueError(f"target host {parsed.hostname!r} does not resolve: {exc}") from None
    for info in infos:
        if not ipaddress.ip_address(info[4][0]).is_loopback:
            raise ValueError(
                f"target {base_url!r} resolves to {info[4][0]}, which is not a loopback address: "
                "tokenlane bench only drives servers on this machine (127.0.0.1 / ::1)"
            )


@dataclass
class Target:
    base_url: str  # e.g. http://127.0.0.1:8000
    model: Optional[str] = None  # None: the first model of GET /v1/models
    api_key: Optional[str] = None
    endpoint: str = "completions"  # completions | chat
    prompt_mode: str = "tokens"  # tokens | text
    token_id_low: int = 10  # token-id prompts draw from [low, high): valid for any vocab >= high
    token_id_high: int = 1000
    temperature: float = 0.0
    send_ignore_eos: bool = True  # vLLM and tokenlane accept ignore_eos; plain OpenAI does not

    def __post_init__(self) -> None:
        self.base_url = self.base_url.rstrip("/")
        if self.endpoint not in ("completions", "chat"):
            raise ValueError(f"endpoint must be 'completions' or 'chat', got {self.endpoint!r}")
        if self.prompt_mode not in ("tokens", "text"):
            raise ValueError(f"prompt_mode must be 'tokens' or 'text', got {self.prompt_mode!r}")
        if self.endpoint == "chat" and self.prompt_mode == "tokens":
            self.prompt_mode = "text"  # chat messages are text


def _prompt(target: Target, planned: PlannedRequest) -> Any:
    span = target.token_id_high - target.token_id_low
    if target.prompt_mode == "tokens":
        # Unique first token per request, so prefix caching finds nothing shared (like the trace).
        return [target.token_id_low + (planned.index * 7919 + i * 31) % span for i in range(planned.prompt_tokens)]
    words = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel")
    return f"{planned.index} " + " ".join(words[(planned.index + i) % len(words)] for i in range(planned.prompt_tokens - 1))


def _body(target: Target, planned: PlannedRequest) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": target.model,
        "max_tokens": planned.max_tokens,
        "temperature": target.temperature,
        "stream": planned.stream,
    }
    if planned.stream:
        body["stream_options"] = {"include_usage": True}
    if target.send_ignore_eos:
        body["ignore_eos"] = planned.ignore_eos
    if planned.priority:
        body["priority"] = planned.priority
    if target.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": _prompt(target, planned)}]
    else:
        body["prompt"] = _prompt(target, planned)
    return body


def _headers(target: Target, planned: PlannedRequest) -> dict[str, str]:
    h = {"X-Tenant": planned.tenant}
    if planned.lane:
        h["X-Lane"] = planned.lane
    if planned.deadline_ms is not None:
        h["X-Request-Deadline-Ms"] = str(int(planned.deadline_ms))
    if target.api_key:
        h["Authorization"] = f"Bearer {target.api_key}"
    return h


def _error_code(status: int, raw: bytes) -> str:
    try:
        err = json.loads(raw)["error"]
        return str(err.get("code") or err.get("type") or f"http_{status}")
    except (ValueError, KeyError, TypeError):
        return f"http_{status}"


def _queue_delay(headers, usage: Optional[dict]) -> Optional[float]:
    raw = headers.get("x-queue-delay-ms")
    if raw is None and usage:
        raw = usage.get("queue_delay_ms")
    try:
        return None if raw is None else float(raw) / 1e3
    except (TypeError, ValueError):
        return None


async def _one(client, target: Target, planned: PlannedRequest, t0: float, bins: TokenBins,
               request_timeout_s: float) -> RequestRecord:
    import httpx

    await asyncio.sleep(max(0.0, t0 + planned.arrival_s - time.perf_counter()))
    start = time.perf_counter()
    rec = RequestRecord(
        index=planned.index,
        lane=planned.lane or "",
        tenant=planned.tenant,
        arrival_s=start - t0,
        prompt_tokens=planned.prompt_tokens,
        max_tokens=planned.max_tokens,
        stream=planned.stream,
        deadline_ms=planned.deadline_ms,
    )
    path = "/v1/chat/completions" if target.endpoint == "chat" else "/v1/completions"
    async def exchange() -> None:
        if planned.stream:
            await _stream(client, target, planned, path, start, t0, rec, bins)
            return
        resp = await client.post(path, json=_body(target, planned), headers=_headers(target, planned))
        _apply_headers(rec, resp)
        if resp.status_code != 200:
            _refused(rec, resp.status_code, resp.content)
            return
        data = resp.json()
        end = time.perf_counter()
        usage = data.get("usage") or {}
        rec.output_tokens = int(usage.get("completion_tokens", 0))
        rec.prompt_tokens = int(usage.get("prompt_tokens", rec.prompt_tokens))
        rec.finish_reason = (data.get("choices") or [{}])[0].get("finish_reason")
        rec.e2e_s = end - start
        if rec.queue_delay_s is None:
            rec.queue_delay_s = _queue_delay({}, usage)
        bins.add(end - t0, rec.output_tokens)

    try:
        await asyncio.wait_for(exchange(), request_timeout_s)
    except asyncio.TimeoutError:
        rec.outcome, rec.reason = TIMEOUT, "client_timeout"
    except httpx.HTTPError as exc:
        rec.outcome, rec.reason = ERROR, type(exc).__name__
    return rec


def _apply_headers(rec: RequestRecord, resp) -> None:
    rec.http_status = resp.status_code
    rec.lane = resp.headers.get("x-lane") or rec.lane or "(unknown)"
    rec.queue_delay_s = _queue_delay(resp.headers, None)


def _refused(rec: RequestRecord, status: int, raw: bytes) -> None:
    code = _error_code(status, raw)
    if status == 504:
        rec.outcome, rec.reason = TIMEOUT, code
    elif status in REJECT_STATUSES:
        rec.outcome, rec.reason = REJECTED, code
    else:
        rec.outcome, rec.reason = ERROR, code


async def _stream(client, target, planned, path, start, t0, rec, bins) -> None:
    async with client.stream("POST", path, json=_body(target, planned), headers=_headers(target, planned)) as resp:
        _apply_headers(rec, resp)
        if resp.status_code != 200:
            _refused(rec, resp.status_code, await resp.aread())
            return
        first = last = None
        chunks = 0
        usage = None
        finish_reason = None
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                break
            event = json.loads(payload)
            if "error" in event:
                rec.outcome, rec.reason = ERROR, str(event["error"].get("code") or event["error"].get("message"))
                break
            if event.get("usage"):
                usage = event["usage"]
            for choice in event.get("choices") or []:
                text = choice.get("text")
                if text is None:
                    text = (choice.get("delta") or {}).get("content")
                if text:
                    now = time.perf_counter()
                    first = first if first is not None else now
                    last = now
                    chunks += 1
                    bins.add(now - t0)
                if choice.get("finish_reason"):
                    finish_reason = choice["finish_reason"]
            if planned.cancel_after_tokens is not None and chunks >= planned.cancel_after_tokens:
                rec.outcome, rec.reason = CANCELLED, "client_cancel"
                break  # leaving the block closes the connection: the server aborts the request
        end = time.perf_counter()
    n = int(usage["completion_tokens"]) if usage else chunks
    if usage and n > chunks and last is not None:
        bins.add(last - t0, n - chunks)  # tokens held back and sent together
    rec.output_tokens = n
    if usage:
        rec.prompt_tokens = int(usage.get("prompt_tokens", rec.prompt_tokens))
    rec.finish_reason = finish_reason
    rec.ttft_s = None if first is None else first - start
    rec.tpot_s = (last - first) / (n - 1) if first is not None and last is not None and n > 1 else None
    rec.e2e_s = end - start
    if rec.queue_delay_s is None:
        rec.queue_delay_s = _queue_delay({}, usage)
    if rec.outcome == OK and finish_reason in ("cancelled", "timeout", "error"):
        rec.outcome = {"cancelled": CANCELLED, "timeout": TIMEOUT, "error": ERROR}[finish_reason]
        rec.reason = rec.reason or f"finish_{finish_reason}"
    if rec.outcome == OK and first is None and n == 0:
        rec.outcome, rec.reason = ERROR, "no_tokens"


async def resolve_model(client) -> str:
    resp = await client.get("/v1/models")
    resp.raise_for_status()
    data = resp.json().get("data") or []
    if not data:
        raise ValueError("GET /v1/models lists no model")
    return data[0]["id"]


async def run_load(
    target: Target,
    traffic: Traffic,
    name: str = "run",
    *,
    slos: Optional[dict[str, LaneSLO]] = None,
    max_requests: int = 10_000,
    time_limit_s: float = 600.0,
    request_timeout_s: float = 120.0,
    max_connections: int = 512,
    progress: bool = True,
) -> RunResult:
    """Send `traffic` to `target`; return the phase's RunResult. Requests still unsent when
    time_limit_s runs out are cancelled and left out of the result (counted in extra)."""
    import httpx

    check_loopback(target.base_url)
    if max_requests > MAX_REQUESTS_HARD:
        raise ValueError(f"max_requests must be <= {MAX_REQUESTS_HARD}")
    planned = traffic.requests[:max_requests]
    limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
    timeout = httpx.Timeout(request_timeout_s, connect=10.0)
    bins = TokenBins()
    async with httpx.AsyncClient(base_url=target.base_url, limits=limits, timeout=timeout, trust_env=False) as client:
        if target.model is None:
            target.model = await resolve_model(client)
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=len(planned), desc=f"bench {name}", unit="req", leave=False)
        t0 = time.perf_counter()

        async def task(p: PlannedRequest) -> RequestRecord:
            rec = await _one(client, target, p, t0, bins, request_timeout_s)
            if bar is not None:
                bar.update(1)
            return rec

        tasks = [asyncio.create_task(task(p)) for p in planned]
        done, not_done = await asyncio.wait(tasks, timeout=time_limit_s)
        for t in not_done:
            t.cancel()
        await asyncio.gather(*not_done, return_exceptions=True)
        if bar is not None:
            bar.close()
        end = time.perf_counter()
    records = sorted((t.result() for t in done if not t.cancelled() and t.exception() is None), key=lambda r: r.index)
    crashed = [t for t in done if not t.cancelled() and t.exception() is not None]
    if crashed:
        raise RuntimeError(f"{len(crashed)} load task(s) failed: {crashed[0].exception()!r}")
    last_end = max((r.arrival_s + (r.e2e_s or 0.0) for r in records), default=end - t0)
    first = min((r.arrival_s for r in records), default=0.0)
    return RunResult(
        name=name,
        records=records,
        duration_s=max(last_end - first, 1e-9),
        slos=slos or {},
        token_bins=dict(bins.bins),
        extra={"target": target.base_url, "model": target.model, "unfinished_at_time_limit": len(not_done),
               "wall_seconds": end - t0},
        description=traffic.description,
    )
