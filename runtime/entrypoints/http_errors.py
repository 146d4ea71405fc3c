"""Error responses in OpenAI's shape, and the one log line per refused or failed request.

Status codes (see docs/architecture.md, Contracts: HTTP API): 400 invalid parameters (never
422), 401 bad/missing key, 403 lane not allowed, 404 unknown model, 429 + Retry-After lane
queue full or deadline unmeetable, 503 + Retry-After KV reject watermark or draining, 504
queue timeout. Every error body is OpenAI's `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import json
import logging
import math
import uuid
from typing import TYPE_CHECKING, Any, Optional

from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from tokenlane.runtime.observability.metrics import reason_label
from tokenlane.runtime.entrypoints.protocol import APIError, error_body
from tokenlane.runtime.core.request import FinishReason, Request
from tokenlane.runtime.entrypoints.routing import authenticate

if TYPE_CHECKING:
    from tokenlane.runtime.entrypoints.app import ServerState

# One structured line per refused or failed request (see log_refusal).
request_log = logging.getLogger("tokenlane.requests")

DRAINING_RETRY_AFTER_S = 5.0

# Error type per status, as OpenAI names them.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}


def _retry_after(seconds: Optional[float]) -> str:
    return str(max(1, math.ceil(seconds))) if seconds else "1"


def error_response(
    status: int,
    message: str,
    *,
    type: Optional[str] = None,
    code: Optional[str] = None,
    param: Optional[str] = None,
    retry_after_s: Optional[float] = None,
    headers: Optional[dict[str, str]] = None,
) -> JSONResponse:
    out = dict(headers or {})
    if status in (429, 503) or retry_after_s:
        out["Retry-After"] = _retry_after(retry_after_s)
    return JSONResponse(
        error_body(message, type or ERROR_TYPES.get(status, "server_error"), code, param),
        status_code=status,
        headers=out,
    )


def api_error_response(exc: APIError, headers: Optional[dict[str, str]] = None) -> JSONResponse:
    return error_response(
        exc.status,
        exc.message,
        type=exc.type if exc.type != "invalid_request_error" else None,
        code=exc.code,
        param=exc.param,
        retry_after_s=exc.retry_after_s,
        headers=headers,
    )


def validation_message(exc: RequestValidationError) -> tuple[str, Optional[str]]:
    parts, param = [], None
    for err in exc.errors():
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        if err.get("type") == "json_invalid":
            parts.append("request body is not valid JSON")
            continue
        named = getattr((err.get("ctx") or {}).get("error"), "param", None)  # a ParamError
        if named:
            param = param or named
            parts.append(msg)
        elif loc:
            param = param or loc[0]
            parts.append(f"{'.'.join(loc)}: {msg}")
        else:
            parts.append(msg)
    return "; ".join(parts) or "invalid request", param


def error_of_final(output: Any) -> Optional[APIError]:
    """The API error for a request that ended without a normal finish."""
    reason, detail = output.finish_reason, output.finish_detail or ""
    if reason in (FinishReason.STOP, FinishReason.LENGTH, None):
        return None
    if reason == FinishReason.TIMEOUT:
        message = ("the request's deadline (X-Request-Deadline-Ms) passed before it finished"
                   if detail == "deadline" else
                   f"request timed out in the lane queue ({detail or 'queue_timeout'})")
        return APIError(504, message, type="timeout_error", code=detail or "queue_timeout")
    if reason == FinishReason.REJECTED:
        status = 503 if detail in ("kv_watermark", "draining") else 400 if detail in ("too_long", "invalid") else 429
        return APIError(status, f"request rejected: {detail}", type=ERROR_TYPES[status], code=detail or "rejected",
                        retry_after_s=1.0 if status != 400 else None)
    if reason == FinishReason.CANCELLED:
        return APIError(503, f"request cancelled by the server ({detail or 'cancelled'})",
                        type=ERROR_TYPES[503], code=detail or "cancelled", retry_after_s=DRAINING_RETRY_AFTER_S)
    return APIError(500, f"internal error while generating: {detail or 'unknown'}", type="server_error",
                    code="engine_error")


def log_refusal(request_id: str, lane: str, tenant: str, status: int, reason: str, message: str = "",
                *, refused: bool = True) -> None:
    """The one log line of a refused (never ran) or failed request: a JSON object (also on the
    record as `record.tokenlane`), so log pipelines can index request id, lane, tenant, status
    and reason (a bounded identifier, as the metrics' reason label; details in `message`)."""
    fields = {"event": "request_refused" if refused else "request_failed", "request_id": request_id,
              "lane": lane, "tenant": tenant, "status": status, "reason": reason}
    if message:
        fields["message"] = message[:300]
    request_log.warning("%s", json.dumps(fields, separators=(",", ":")), extra={"tokenlane": fields})


class RequestLog:
    """EngineObserver: logs (log_refusal) each request the engine refused (admission, draining)
    or that ended without a normal finish (timeout, error, cancelled by the server). A client
    that went away is not a refusal or failure, and is not logged here."""

    def on_step(self, stats) -> None:
        pass

    def on_config_applied(self, config: object, ok: bool, message: str) -> None:
        pass

    def on_request_finished(self, request: Request) -> None:
        if request.finish_detail == "client_disconnect":
            return
        err = error_of_final(request)
        if err is None:
            return
        log_refusal(request.request_id, request.lane, request.tenant, err.status, reason_label(request),
                    err.message, refused=request.finish_reason == FinishReason.REJECTED)


GENERATION_PATHS = {"/v1/completions": "cmpl", "/v1/chat/completions": "chatcmpl"}


def nominal_route(state: "ServerState", headers) -> tuple[str, str]:
    """(lane, tenant) labels of a request refused before routing: its authenticated tenant
    ("unknown" if the key is bad) and the lane it asked for in X-Lane, else its tenant's
    default lane, else the default lane (the lane it would most likely have had)."""
    config = state.config
    try:
        who = authenticate(config, headers)
    except APIError:
        return config.default_lane.name, "unknown"
    names = {lane.name for lane in config.lanes}
    asked = headers.get("x-lane")
    if asked in names:
        return asked, who.tenant
    if who.default_lane in names:
        return who.default_lane, who.tenant
    return config.default_lane.name, who.tenant


def refused_before_admission(state: "ServerState", http: HTTPRequest, exc: APIError,
                              request_id: Optional[str] = None) -> JSONResponse:
    """The error response of a request refused before it reached the engine: logged, and a
    400 on a generation endpoint counted as outcome="invalid"."""
    prefix = GENERATION_PATHS.get(http.url.path)
    request_id = request_id or f"{prefix or 'req'}-{uuid.uuid4().hex}"
    lane, tenant = nominal_route(state, http.headers)
    reason = exc.code or "invalid"
    if exc.status == 400 and prefix is not None:
        state.metrics.record_invalid(lane, tenant, reason, endpoint=http.url.path)
    log_refusal(request_id, lane, tenant, exc.status, reason, exc.message)
    return api_error_response(exc, headers={"X-Request-Id": request_id})
