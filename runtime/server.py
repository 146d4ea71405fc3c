"""`tokenlane serve`: the OpenAI-compatible HTTP server in front of the engine.

    HTTP (FastAPI) -> router (tenant, lane, deadline) -> AsyncEngine.submit (admission)
    -> RequestStream -> JSON body, or SSE events `data: {...}` ... `data: [DONE]`

Status codes (DESIGN.md §3.2): 400 invalid parameters (never 422), 401 bad/missing key,
403 lane not allowed, 404 unknown model, 429 + Retry-After lane queue full or deadline
unmeetable, 503 + Retry-After KV reject watermark or draining, 504 queue timeout. Every
error body is OpenAI's `{"error": {"message", "type", "param", "code"}}`.

A client that disconnects (streaming or not) has its request aborted in the engine at once
(it leaves the queue or running set at the next step and frees its KV blocks); a streaming
consumer that stops reading for `scheduler.streamIdleTimeoutMs` is cancelled the same way.

Shutdown on SIGTERM (or SIGINT) is graceful: /ready and new requests answer 503 with
Retry-After at once, in-flight requests finish or are aborted when the grace period ends,
then the process exits 0. A second signal exits at once.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import math
import sys
import time
import uuid
import zlib
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Optional, Union

import anyio
import uvicorn
from fastapi import Depends, FastAPI, Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenlane.runtime.config import (
    ConfigError,
    ModelConfig,
    RuntimeConfig,
    load_config,
)
from tokenlane.runtime.config_watch import ConfigWatcher
from tokenlane.runtime.metrics import CONTENT_TYPE, PrometheusMetrics, reason_label
from tokenlane.runtime.protocol import (
    APIError,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessageOut,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    Usage,
    error_body,
)
from tokenlane.runtime import tokenizer as tokenizer_lib
from tokenlane.runtime.logprobs import CompletionLogprobs, TokenTexts, chat_logprobs_content, vllm_prompt_logprobs
from tokenlane.runtime.admission import AdmissionError
from tokenlane.runtime.request import FinishReason, Request, RequestStatus, SamplingParams
from tokenlane.runtime.router import Caller, authenticate, choose_lane, parse_deadline_ms

log = logging.getLogger("tokenlane.server")
# One structured line per refused or failed request (see log_refusal).
request_log = logging.getLogger("tokenlane.requests")

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
DRAINING_RETRY_AFTER_S = 5.0
TOKENIZE_INLINE_MAX_CHARS = 8192  # longer prompts are tokenized in a worker thread

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


# --------------------------------------------------------------------------- text <-> ids


class TextCodec:
    """Prompt encoding and chat templating through the engine's tokenizer (runtime/tokenizer.py).

    An engine without a tokenizer (`engine.executor: simulated`) still takes text and chat:
    each 4 bytes of UTF-8 (about a BPE token's worth of English) become one synthetic id, so
    any OpenAI load generator can drive a simulated server with realistic prompt lengths.
    """

    SYNTHETIC_BYTES_PER_TOKEN = 4
    SYNTHETIC_FIRST_ID = 10  # clear of the special ids

    def __init__(self, tokenizer: Any, vocab_size: Optional[int] = None) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size or 32000

    def _synthetic(self, text: str) -> list[int]:
        data = text.encode("utf-8")
        step, low = self.SYNTHETIC_BYTES_PER_TOKEN, self.SYNTHETIC_FIRST_ID
        span = max(1, self.vocab_size - low)
        return [low + zlib.crc32(data[i:i + step]) % span for i in range(0, len(data), step)]

    @staticmethod
    def synthetic_text(token_ids: list[int]) -> str:
        """Placeholder text of generated ids when there is no tokenizer: one word per token,
        so streaming clients see a chunk per token (TTFT/TPOT measurable over HTTP)."""
        return "".join(f" t{t}" for t in token_ids)

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            return self._synthetic(text)
        return list(tokenizer_lib.encode_prompt(self.tokenizer, text))

    def decode(self, token_ids: list[int]) -> str:
        """Text of a token-id prompt (echo): special tokens skipped."""
        if self.tokenizer is None:
            return self.synthetic_text(token_ids)
        return self.tokenizer.decode(token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def encode_text(self, text: str, add_special_tokens: bool) -> list[int]:
        """/tokenize: a text with or without the tokenizer's special tokens."""
        if self.tokenizer is None:
            return self._synthetic(text)
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode_all(self, token_ids: list[int]) -> str:
        """/detokenize: the text of the ids, special tokens included (as vLLM does)."""
        if self.tokenizer is None:
            return self.synthetic_text(token_ids)
        return self.tokenizer.decode(token_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def encode_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                    add_special_tokens: bool = False) -> list[int]:
        if self.tokenizer is None:
            text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
            return self._synthetic(text + ("assistant: " if add_generation_prompt else ""))
        try:
            return list(tokenizer_lib.apply_chat_template(self.tokenizer, messages,
                                                          add_generation_prompt=add_generation_prompt,
                                                          add_special_tokens=add_special_tokens))
        except ValueError as exc:  # e.g. no chat template in the checkpoint
            raise APIError(400, str(exc), code="no_chat_template", param="messages") from None
        except Exception as exc:  # jinja errors raised by the checkpoint's own template
            raise APIError(400, f"the chat template failed on these messages: {exc}",
                           code="chat_template_error", param="messages") from None


# --------------------------------------------------------------------------- helpers


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


def _api_error_response(exc: APIError, headers: Optional[dict[str, str]] = None) -> JSONResponse:
    return error_response(
        exc.status,
        exc.message,
        type=exc.type if exc.type != "invalid_request_error" else None,
        code=exc.code,
        param=exc.param,
        retry_after_s=exc.retry_after_s,
        headers=headers,
    )


def _validation_message(exc: RequestValidationError) -> tuple[str, Optional[str]]:
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


async def _wait_disconnect(receive: Callable) -> None:
    """Returns when the client has gone (the request body has been read already)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class ClientGone(Exception):
    pass


async def _until_disconnect(awaitable, receive: Callable):
    """Await `awaitable`, or raise ClientGone as soon as the client disconnects."""
    work = asyncio.ensure_future(awaitable)
    gone = asyncio.ensure_future(_wait_disconnect(receive))
    try:
        done, _ = await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        if work in done:
            return work.result()
        raise ClientGone()
    finally:
        for task in (work, gone):
            if not task.done():
                task.cancel()


def _finish_reason(reason: Optional[FinishReason]) -> Optional[str]:
    if reason is None:
        return None
    if reason in (FinishReason.STOP, FinishReason.LENGTH):
        return reason.value
    return "abort"


def _error_of_final(output: Any) -> Optional[APIError]:
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
        err = _error_of_final(request)
        if err is None:
            return
        log_refusal(request.request_id, request.lane, request.tenant, err.status, reason_label(request),
                    err.message, refused=request.finish_reason == FinishReason.REJECTED)


GENERATION_PATHS = {"/v1/completions": "cmpl", "/v1/chat/completions": "chatcmpl"}


def _nominal_route(state: "ServerState", headers) -> tuple[str, str]:
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


def _refused_before_admission(state: "ServerState", http: HTTPRequest, exc: APIError,
                              request_id: Optional[str] = None) -> JSONResponse:
    """The error response of a request refused before it reached the engine: logged, and a
    400 on a generation endpoint counted as outcome="invalid"."""
    prefix = GENERATION_PATHS.get(http.url.path)
    request_id = request_id or f"{prefix or 'req'}-{uuid.uuid4().hex}"
    lane, tenant = _nominal_route(state, http.headers)
    reason = exc.code or "invalid"
    if exc.status == 400 and prefix is not None:
        state.metrics.record_invalid(lane, tenant, reason)
    log_refusal(request_id, lane, tenant, exc.status, reason, exc.message)
    return _api_error_response(exc, headers={"X-Request-Id": request_id})


def _sse(payload: Any) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


class EventStreamResponse(Response):
    """An SSE response that watches the client while it streams.

    Unlike a plain StreamingResponse it (1) listens for `http.disconnect` concurrently, so a
    client that goes away while the engine is still computing is noticed at once, not at the
    next write, and (2) bounds every write by the stream idle timeout: a consumer that stops
    reading blocks the transport's flow control, and after the timeout the request is
    cancelled and the connection closed. `on_close` runs exactly once in every case.
    """

    def __init__(
        self,
        events: AsyncIterator[str],
        on_close: Callable[[str], None],
        idle_timeout_s: float,
        headers: dict[str, str],
    ) -> None:
        # As StreamingResponse does: no body attribute, so no Content-Length header.
        self.status_code = 200
        self.media_type = "text/event-stream"
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", **headers})
        self.events = events
        self.on_close = on_close
        self.idle_timeout_s = idle_timeout_s

    async def __call__(self, scope, receive, send) -> None:
        how = "client_disconnect"
        async with anyio.create_task_group() as tg:

            async def watch() -> None:
                await _wait_disconnect(receive)
                tg.cancel_scope.cancel()

            tg.start_soon(watch)
            try:
                await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
                async for event in self.events:
                    with anyio.fail_after(self.idle_timeout_s):
                        await send({"type": "http.response.body", "body": event.encode(), "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                how = "completed"
            except TimeoutError:
                how = "stream_idle_timeout"
                log.warning("stream consumer stalled for %.1fs; cancelling the request", self.idle_timeout_s)
            except OSError:
                how = "client_disconnect"
            finally:
                self.on_close(how)
                tg.cancel_scope.cancel()
                with anyio.CancelScope(shield=True):
                    await self.events.aclose()


# --------------------------------------------------------------------------- OpenAPI


def _errors(*statuses: int) -> dict[Union[int, str], dict[str, Any]]:
    """`responses=` entries declaring OpenAI's error body for these statuses."""
    what = {400: "Invalid request (never 422)", 401: "Missing or unknown API key", 403: "Lane not allowed",
            404: "Unknown model", 429: "Lane queue full or deadline unmeetable (Retry-After)",
            500: "Internal error", 503: "KV watermark, draining or engine down (Retry-After)",
            504: "Queue timeout or deadline passed"}
    return {status: {"model": ErrorResponse, "description": what[status]} for status in statuses}


GENERATION_ERRORS = _errors(400, 401, 403, 404, 429, 500, 503, 504)


def _openapi_document(app: FastAPI) -> dict[str, Any]:
    """FastAPI's document, corrected to what the server does: its 422 responses (and their
    schemas) removed, since every validation error is a 400 in OpenAI's error shape."""
    if app.openapi_schema:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    for operations in schema.get("paths", {}).values():
        for operation in operations.values():
            operation.get("responses", {}).pop("422", None)
    components = schema.get("components", {}).get("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    app.openapi_schema = schema
    return schema


# --------------------------------------------------------------------------- the app


@dataclasses.dataclass
class ServerOptions:
    shutdown_grace_s: float = 30.0
    config_poll_interval_s: float = 1.0
    # Re-applies command-line overrides to each new version of the config file.
    config_transform: Callable[[RuntimeConfig], RuntimeConfig] = lambda c: c


class ServerState:
    """What the endpoints share: the engine, metrics, config watcher and draining state."""

    def __init__(self, async_engine, metrics: PrometheusMetrics, watcher: Optional[ConfigWatcher],
                 options: ServerOptions) -> None:
        self.async_engine = async_engine
        self.engine = async_engine.engine
        self.metrics = metrics
        self.watcher = watcher
        self.options = options
        self.vocab_size: Optional[int] = getattr(getattr(self.engine, "executor", None), "vocab_size", None)
        self.codec = TextCodec(getattr(self.engine, "tokenizer", None), self.vocab_size)
        self.token_texts = TokenTexts(getattr(self.engine, "tokenizer", None))
        self.supports_logprobs = bool(getattr(getattr(self.engine, "executor", None), "supports_logprobs", False))
        self.model_name = self.engine.config.model.name
        self.draining = False
        self._drain_task: Optional[asyncio.Task] = None

    @property
    def config(self) -> RuntimeConfig:
        return self.engine.config  # the config in force (hot reloads land here)

    def begin_drain(self) -> asyncio.Task:
        """Stop admitting; finish in-flight work within the grace period (idempotent)."""
        if self._drain_task is None:
            self.draining = True
            log.info("draining: refusing new requests; in-flight work has %.0fs to finish",
                     self.options.shutdown_grace_s)
            self._drain_task = asyncio.get_running_loop().create_task(
                self.async_engine.shutdown(self.options.shutdown_grace_s), name="drain"
            )
        return self._drain_task


def create_app(
    async_engine,
    config_source: Union[None, str, Path, ConfigWatcher] = None,
    *,
    metrics: Optional[PrometheusMetrics] = None,
    options: Optional[ServerOptions] = None,
) -> FastAPI:
    """The FastAPI app serving `async_engine`.

    `config_source`: the config file to watch for hot reloads (a path, or a ready
    ConfigWatcher), or None to serve `async_engine.engine.config` unchanged.
    The engine's step loop is started (and drained) by the app's lifespan.
    """
    options = options or ServerOptions()
    engine = async_engine.engine
    metrics = metrics or PrometheusMetrics(engine.config.model.name)
    watcher: Optional[ConfigWatcher]
    if config_source is None or isinstance(config_source, ConfigWatcher):
        watcher = config_source
    else:
        watcher = ConfigWatcher(config_source, engine.config, async_engine, recorder=metrics,
                                transform=options.config_transform, interval_s=options.config_poll_interval_s)
    state = ServerState(async_engine, metrics, watcher, options)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        metrics.set_config(engine.config)
        engine.add_observer(metrics)
        engine.add_observer(RequestLog())
        await async_engine.start()
        if watcher is not None:
            watcher.start()
        log.info("serving %s (lanes: %s)", state.model_name, ", ".join(l.name for l in engine.config.lanes))
        try:
            yield
        finally:
            if watcher is not None:
                await watcher.stop()
            await state.begin_drain()

    app = FastAPI(title="tokenlane", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.tokenlane = state
    app.openapi = lambda: _openapi_document(app)

    # ---- errors: always OpenAI's shape, never a 422

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: HTTPRequest, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return _refused_before_admission(state, request, APIError(400, message, param=param, code="invalid_parameter"))

    @app.exception_handler(APIError)
    async def _api_error(request: HTTPRequest, exc: APIError):
        return _refused_before_admission(state, request, exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: HTTPRequest, exc: StarletteHTTPException):
        if exc.status_code == 400:  # Starlette could not parse the body (e.g. not UTF-8)
            return _refused_before_admission(state, request, APIError(
                400, "request body is not valid JSON (it must be UTF-8)", code="invalid_parameter"))
        return error_response(exc.status_code, str(exc.detail), code=None, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _crash(request: HTTPRequest, exc: Exception):
        log.exception("internal error serving %s", request.url.path)
        lane, tenant = _nominal_route(state, request.headers)
        log_refusal(f"req-{uuid.uuid4().hex}", lane, tenant, 500, "internal_error", type(exc).__name__,
                    refused=False)
        return error_response(500, f"internal server error: {type(exc).__name__}", code="internal_error")

    # ---- probes and metrics

    @app.get("/health", responses=_errors(503))
    async def health():
        if state.async_engine.healthy:
            return {"status": "ok"}
        return error_response(503, "engine step loop is not running", code="engine_dead")

    @app.get("/ready", responses=_errors(503))
    async def ready():
        if state.draining or not state.async_engine.ready:
            why = "draining" if state.draining or state.async_engine.draining else "not_started"
            return error_response(503, f"not ready: {why}", code=why, retry_after_s=DRAINING_RETRY_AFTER_S)
        return {"status": "ready", "model": state.model_name}

    @app.get("/metrics", response_class=PlainTextResponse,
             responses={200: {"description": "Prometheus text exposition format 0.0.4"}})
    async def prometheus_metrics():
        try:
            metrics.set_occupancy(engine.snapshot())  # fresh gauges even when the engine idles
        except Exception:  # a scrape must not fail because of a racing step
            log.debug("snapshot for /metrics failed", exc_info=True)
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    # ---- the OpenAI API. The key is checked before the body's fields are validated, so a bad
    # key with bad parameters is a 401; only a body that is not JSON at all is a 400 first
    # (FastAPI decodes JSON before it runs dependencies). Neither reveals anything.

    def caller(request: HTTPRequest) -> Caller:
        return authenticate(state.config, request.headers)

    @app.get("/v1/models", responses=_errors(401))
    async def models(who: Caller = Depends(caller)):
        card = ModelCard(id=state.model_name, max_model_len=engine.max_model_len)
        return ModelList(data=[card]).model_dump()

    @app.get("/v1/models/{model_id:path}", responses=_errors(401, 404))
    async def model(model_id: str, who: Caller = Depends(caller)):
        if model_id != state.model_name:
            return error_response(404, f"model {model_id!r} does not exist; this server serves {state.model_name!r}",
                                  code="model_not_found", param="model")
        return ModelCard(id=state.model_name, max_model_len=engine.max_model_len).model_dump()

    def check_model(name: Optional[str]) -> None:
        if name is not None and name != state.model_name:
            raise APIError(404, f"model {name!r} does not exist; this server serves {state.model_name!r}",
                           type="not_found_error", code="model_not_found", param="model")

    @app.post("/tokenize", response_model=TokenizeResponse, responses=_errors(400, 401, 404))
    async def tokenize(body: TokenizeRequest, who: Caller = Depends(caller)):
        """vLLM's /tokenize: the ids the server would compute for this prompt or chat."""
        check_model(body.model)
        if body.messages is not None:
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
            ids = await asyncio.to_thread(state.codec.encode_chat, messages, body.add_generation_prompt,
                                          bool(body.add_special_tokens))
        else:
            add = True if body.add_special_tokens is None else body.add_special_tokens
            ids = await asyncio.to_thread(state.codec.encode_text, body.prompt, add)
        return TokenizeResponse(count=len(ids), max_model_len=engine.max_model_len, tokens=ids).model_dump()

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=_errors(400, 401, 404))
    async def detokenize(body: DetokenizeRequest, who: Caller = Depends(caller)):
        """vLLM's /detokenize: the text of token ids (special tokens kept)."""
        check_model(body.model)
        vocab = state.vocab_size
        if vocab is not None and body.tokens and max(body.tokens) >= vocab:
            raise APIError(400, f"token id {max(body.tokens)} is out of the vocabulary (size {vocab})",
                           code="invalid_token_id", param="tokens")
        text = await asyncio.to_thread(state.codec.decode_all, list(body.tokens))
        return DetokenizeResponse(prompt=text).model_dump()

    @app.post("/v1/completions", responses={
        200: {"model": CompletionResponse,
              "description": "The completion (JSON), or server-sent events with `stream: true`",
              "content": {"text/event-stream": {}}},
        **GENERATION_ERRORS})
    async def completions(body: CompletionRequest, request: HTTPRequest, who: Caller = Depends(caller)):
        return await _generate(state, who, body, request, chat=False)

    @app.post("/v1/chat/completions", responses={
        200: {"model": ChatCompletionResponse,
              "description": "The chat completion (JSON), or server-sent events with `stream: true`",
              "content": {"text/event-stream": {}}},
        **GENERATION_ERRORS})
    async def chat_completions(body: ChatCompletionRequest, request: HTTPRequest, who: Caller = Depends(caller)):
        return await _generate(state, who, body, request, chat=True)

    return app


# --------------------------------------------------------------------------- generation


@dataclasses.dataclass
class _Want:
    """What the response shows besides text, from the body."""

    echo: bool = False  # completions: the prompt's text (and logprobs) before the completion
    logprobs: Optional[int] = None  # top-k per generated token (chat: top_logprobs); None = off
    prompt_logprobs: Optional[int] = None  # vLLM's extension; None = off

    @classmethod
    def of(cls, body, chat: bool) -> "_Want":
        if chat:
            return cls(logprobs=(body.top_logprobs or 0) if body.logprobs else None)
        return cls(echo=body.echo, logprobs=body.logprobs, prompt_logprobs=body.prompt_logprobs)

    @property
    def engine_prompt_logprobs(self) -> Optional[int]:
        """The top-k the engine computes per prompt token: enough for echo and the extension."""
        ks = [k for k in (self.logprobs if self.echo else None, self.prompt_logprobs) if k is not None]
        return max(ks) if ks else None


@dataclasses.dataclass
class _Job:
    """One prompt of a request (a batch has several): its engine request and stream."""

    index: int  # choices[].index
    request: Request
    prompt_text: Optional[str]  # for echo
    stream: Any = None  # RequestStream once submitted
    first: Any = None  # its first RequestOutput
    finished: bool = False  # its final output arrived
    aborted: bool = False  # we cancelled it
    started: bool = False  # streaming: its first chunk went out


def _prompt_ids(state: ServerState, prompt, where: str) -> list[int]:
    if isinstance(prompt, str):
        ids = state.codec.encode(prompt)
    else:
        ids = list(prompt)
        vocab = state.vocab_size
        if vocab is not None and ids and max(ids) >= vocab:
            raise APIError(400, f"{where}: token id {max(ids)} is out of the vocabulary (size {vocab})",
                           code="invalid_token_id", param="prompt")
    if not ids:
        raise APIError(400, f"{where} encodes to zero tokens", code="empty_prompt", param="prompt")
    return ids


def _text_chars(body, chat: bool) -> int:
    if chat:
        return sum(len(m.text()) for m in body.messages)
    return sum(len(p) for p in body.prompts if isinstance(p, str))


def _build_jobs(state: ServerState, caller: Caller, body, http: HTTPRequest, chat: bool,
                base_id: str) -> list[_Job]:
    """One engine request per prompt (a batch shares the lane, tenant, deadline and body)."""
    config = state.config
    if body.model is not None and body.model != state.model_name:
        raise APIError(404, f"model {body.model!r} does not exist; this server serves {state.model_name!r}",
                       code="model_not_found", param="model")
    want = _Want.of(body, chat)
    if (want.logprobs is not None or want.engine_prompt_logprobs is not None) and not state.supports_logprobs:
        raise APIError(400, "logprobs need the model executor (this server runs the simulated one)",
                       code="invalid_parameter", param="logprobs" if want.logprobs is not None else "prompt_logprobs")
    if chat:
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        prompts: list[tuple[list[int], Optional[str]]] = [(state.codec.encode_chat(messages), None)]
    else:
        batch = body.prompts
        prompts = []
        for i, prompt in enumerate(batch):
            ids = _prompt_ids(state, prompt, f"prompt[{i}]" if len(batch) > 1 else "prompt")
            text = None
            if want.echo:
                text = prompt if isinstance(prompt, str) else state.codec.decode(ids)
            prompts.append((ids, text))
    logit_bias = {int(k): float(v) for k, v in (body.logit_bias or {}).items()}
    vocab = state.vocab_size
    if vocab is not None and logit_bias and max(logit_bias) >= vocab:
        raise APIError(400, f"logit_bias: token id {max(logit_bias)} is out of the vocabulary (size {vocab})",
                       code="invalid_token_id", param="logit_bias")
    # A batch goes to one lane, chosen by its longest prompt.
    lane = choose_lane(config, caller, http.headers, max(len(ids) for ids, _ in prompts))
    deadline_ms = parse_deadline_ms(http.headers)
    max_len = state.engine.max_model_len
    now = state.engine.clock()
    jobs = []
    for i, (prompt_ids, text) in enumerate(prompts):
        max_tokens = body.requested_max_tokens if chat else body.max_tokens
        if max_tokens is None:
            # Chat: whatever fits in the model (OpenAI's default); completions: OpenAI's 16.
            max_tokens = max(1, max_len - len(prompt_ids)) if chat else DEFAULT_COMPLETION_MAX_TOKENS
        if len(prompt_ids) + max_tokens > max_len:
            which = f"prompt {i} of the batch" if len(prompts) > 1 else "prompt"
            raise APIError(
                400,
                f"{which} ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) exceeds the model's "
                f"maximum length of {max_len} tokens",
                code="context_length_exceeded",
                param="max_tokens",
            )
        if body.min_tokens > max_tokens:
            raise APIError(400, f"min_tokens ({body.min_tokens}) must not exceed max_tokens ({max_tokens})",
                           code="invalid_parameter", param="min_tokens")
        try:
            sampling = SamplingParams(
                max_tokens=max_tokens,
                temperature=body.temperature,
                top_p=body.top_p,
                top_k=max(0, body.top_k),
                seed=body.seed,
                stop_token_ids=list(body.stop_token_ids or []),
                stop=list(body.stop or []),
                ignore_eos=body.ignore_eos,
                logprobs=want.logprobs,
                prompt_logprobs=want.engine_prompt_logprobs,
                presence_penalty=body.presence_penalty,
                frequency_penalty=body.frequency_penalty,
                repetition_penalty=body.repetition_penalty,
                logit_bias=logit_bias,
                min_p=body.min_p,
                min_tokens=body.min_tokens,
            )
        except ValueError as exc:
            raise APIError(400, str(exc), code="invalid_parameter") from None
        request = Request(
            request_id=base_id if i == 0 else f"{base_id}-{i}",
            prompt_token_ids=prompt_ids,
            sampling_params=sampling,
            lane=lane,
            tenant=caller.tenant,
            priority=body.priority,
            deadline=None if deadline_ms is None else now + deadline_ms / 1000.0,
            arrival_time=now,
        )
        jobs.append(_Job(i, request, text))
    return jobs


def _abort_jobs(state: ServerState, jobs: list[_Job], why: str) -> None:
    """Cancel every job still running (their KV blocks are freed at the next step)."""
    for job in jobs:
        if job.stream is not None and not job.finished and not job.aborted:
            job.aborted = True
            _abort(state, job.stream, why)


async def _generate(state: ServerState, caller: Caller, body, http: HTTPRequest, chat: bool):
    # While draining, submit() refuses with 503 "draining" (and the engine counts it).
    base_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    try:
        if _text_chars(body, chat) > TOKENIZE_INLINE_MAX_CHARS:
            # Long texts are tokenized off the event loop, so other streams are not held up.
            jobs = await asyncio.to_thread(_build_jobs, state, caller, body, http, chat, base_id)
        else:
            jobs = _build_jobs(state, caller, body, http, chat, base_id)
    except APIError as exc:
        return _refused_before_admission(state, http, exc, base_id)
    head = jobs[0].request
    routing = {"X-Lane": head.lane, "X-Tenant": head.tenant, "X-Request-Id": head.request_id}
    for job in jobs:
        try:
            job.stream = state.async_engine.submit(job.request)
        except AdmissionError as exc:
            # All or nothing: the prompts admitted before this one are cancelled at once.
            _abort_jobs(state, jobs, "batch_rejected")
            message = exc.message if len(jobs) == 1 else f"prompt {job.index} of the batch was refused: {exc.message}"
            return error_response(exc.status, message, code=exc.reason,
                                  retry_after_s=exc.retry_after_s, headers=routing)

    # Wait for every prompt's first output before answering, so a queue timeout or late
    # rejection still gets its own status (504/429/503) instead of a 200 followed by an error.
    async def first_of(job: _Job) -> None:
        try:
            job.first = await job.stream.__anext__()
        except StopAsyncIteration:
            job.first = None
            return
        job.finished = job.first.finished

    try:
        await _until_disconnect(asyncio.gather(*(first_of(job) for job in jobs)), http.receive)
    except ClientGone:
        _abort_jobs(state, jobs, "client_disconnect")
        return Response(status_code=499)
    except BaseException:
        _abort_jobs(state, jobs, "server_error")
        raise
    if any(job.first is None for job in jobs):
        _abort_jobs(state, jobs, "server_error")
        log_refusal(head.request_id, head.lane, head.tenant, 500, "engine_error", "no output", refused=False)
        return error_response(500, "engine closed the request stream without an output", code="engine_error",
                              headers=routing)
    for job in jobs:
        err = _error_of_final(job.first) if job.first.finished and not job.first.new_token_ids else None
        if err is not None:
            _abort_jobs(state, jobs, "batch_failed")
            return _api_error_response(err, headers=routing)

    # Time from arrival to first schedule (known once the first output is out); benchmarks
    # read it (tokenlane bench: queue delay per lane).
    if head.first_scheduled_time is not None:
        routing["X-Queue-Delay-Ms"] = f"{(head.first_scheduled_time - head.arrival_time) * 1e3:.2f}"

    model = state.model_name
    created = int(time.time())
    synthetic = state.codec.tokenizer is None
    want = _Want.of(body, chat)

    if body.stream:
        idle_s = state.config.scheduler.stream_idle_timeout_ms / 1000.0
        events = _chat_events if chat else _completion_events
        gen = events(state, jobs, want, model, created, body.include_usage_in_stream, synthetic)
        return EventStreamResponse(gen, lambda how: _abort_jobs(state, jobs, how), idle_s, routing)

    # Non-streaming: collect everything, watching the client meanwhile.
    async def collect(job: _Job) -> list:
        outputs = [job.first]
        while not outputs[-1].finished:
            outputs.append(await job.stream.__anext__())
        job.finished = True
        if len(jobs) > 1 and _error_of_final(outputs[-1]) is not None:
            _abort_jobs(state, jobs, "batch_failed")  # the request fails: stop the others now
        return outputs

    try:
        results = await _until_disconnect(asyncio.gather(*(collect(job) for job in jobs)), http.receive)
    except ClientGone:
        _abort_jobs(state, jobs, "client_disconnect")
        return Response(status_code=499)
    except BaseException:
        _abort_jobs(state, jobs, "server_error")
        raise
    # Cancelled by the server, or failed, part way: no partial answer. The cause, not the
    # prompts we cancelled because of it, decides the status.
    errors = [(job.aborted, _error_of_final(outputs[-1])) for job, outputs in zip(jobs, results)]
    errors = sorted((e for e in errors if e[1] is not None), key=lambda e: e[0])
    if errors:
        return _api_error_response(errors[0][1], headers=routing)
    texts = state.token_texts
    choices = []
    prompt_tokens = completion_tokens = 0
    for job, outputs in zip(jobs, results):
        last = outputs[-1]
        prompt_tokens += last.num_prompt_tokens
        completion_tokens += last.num_output_tokens
        if synthetic:
            text = "".join(TextCodec.synthetic_text(o.new_token_ids) for o in outputs)
        else:
            text = "".join(o.new_text for o in outputs)
        reason = _finish_reason(last.finish_reason)
        new_ids = [t for o in outputs for t in o.new_token_ids]
        new_lps = [e for o in outputs for e in (o.new_logprobs or [])]
        prompt_lps = next((o.prompt_logprobs for o in outputs if o.prompt_logprobs is not None), [])
        if chat:
            logprobs = None
            if want.logprobs is not None:
                logprobs = {"content": chat_logprobs_content(texts, want.logprobs, new_lps)}
            choices.append(ChatChoice(index=job.index, message=ChatMessageOut(content=text),
                                      logprobs=logprobs, finish_reason=reason))
            continue
        logprobs = None
        ids, lps = new_ids, new_lps
        if want.echo:
            text = job.prompt_text + text
            ids, lps = job.request.prompt_token_ids + new_ids, list(prompt_lps) + new_lps
        if want.logprobs is not None:
            logprobs = CompletionLogprobs(texts, want.logprobs).build(ids, lps)
        choice = CompletionChoice(index=job.index, text=text, logprobs=logprobs, finish_reason=reason)
        if want.prompt_logprobs is not None:
            choice.prompt_logprobs = vllm_prompt_logprobs(texts, want.prompt_logprobs, prompt_lps)
        choices.append(choice)
    usage = Usage.of(prompt_tokens, completion_tokens)
    if chat:
        payload = ChatCompletionResponse(id=head.request_id, created=created, model=model, usage=usage,
                                         choices=choices).model_dump()
    else:
        payload = CompletionResponse(id=head.request_id, created=created, model=model, usage=usage,
                                     choices=choices).model_dump()
        if want.prompt_logprobs is None:
            for choice in payload["choices"]:
                del choice["prompt_logprobs"]
    return JSONResponse(payload, headers=routing)


def _abort(state: ServerState, stream, why: str) -> None:
    """Cancel a request whose client is gone; `why` becomes its metrics reason label."""
    log.info("cancelling %s: %s", stream.request_id, why)
    # The engine keeps the first abort's detail; stream.abort() then wakes the step loop.
    state.engine.abort_request(stream.request_id, RequestStatus.FINISHED_CANCELLED, why)
    stream.abort()


async def _merged(jobs: list[_Job], synthetic: bool) -> AsyncIterator[tuple[_Job, Any]]:
    """(job, output) for every output of every job as it arrives, each job's first output
    first; `synthetic` (no tokenizer) gives each token a placeholder text so every token is
    a chunk. Sets job.finished as final outputs go by."""

    def prepared(out):
        if synthetic and out.new_token_ids:
            out.new_text = TextCodec.synthetic_text(out.new_token_ids)
        return out

    for job in jobs:
        yield job, prepared(job.first)
    if len(jobs) == 1:  # the common case: no task per output
        job = jobs[0]
        while not job.finished:
            out = await job.stream.__anext__()
            job.finished = out.finished
            yield job, prepared(out)
        return
    pending = {asyncio.ensure_future(job.stream.__anext__()): job for job in jobs if not job.finished}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=lambda t: pending[t].index):
                job = pending.pop(task)
                out = task.result()
                job.finished = out.finished
                if not out.finished:
                    pending[asyncio.ensure_future(job.stream.__anext__())] = job
                yield job, prepared(out)
    finally:
        for task in pending:
            task.cancel()


def _stream_error(out) -> Optional[APIError]:
    """An error to send as the stream's last event (a server cancel ends with "abort")."""
    if out.finished and out.finish_reason in (FinishReason.TIMEOUT, FinishReason.REJECTED, FinishReason.ERROR):
        return _error_of_final(out)
    return None


class _UsageTotals:
    def __init__(self) -> None:
        self.last: dict[int, Any] = {}

    def payload(self) -> dict:
        outs = self.last.values()
        return Usage.of(sum(o.num_prompt_tokens for o in outs), sum(o.num_output_tokens for o in outs)).model_dump()


async def _completion_events(state, jobs, want: _Want, model, created, include_usage, synthetic) -> AsyncIterator[str]:
    base = {"id": jobs[0].request.request_id, "object": "text_completion", "created": created, "model": model}
    texts = state.token_texts
    formatters = {job.index: CompletionLogprobs(texts, want.logprobs) for job in jobs} if want.logprobs is not None else {}
    usage = _UsageTotals()

    def chunk(index: int, text: str, logprobs, finish, prompt_logprobs=None) -> str:
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
        if want.prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs
        out = {**base, "choices": [choice]}
        if include_usage:
            out["usage"] = None
        return _sse(out)

    async for job, out in _merged(jobs, synthetic):
        usage.last[job.index] = out
        err = _stream_error(out)
        if err is not None:
            yield _sse(err.body())
            _abort_jobs(state, jobs, "batch_failed")
            break
        fmt = formatters.get(job.index)
        if not job.started:
            job.started = True
            if want.echo or want.prompt_logprobs is not None:
                # The prompt first: echoed text and its logprobs, vLLM's prompt_logprobs.
                entries = out.prompt_logprobs or []
                echo_lp = None
                if want.echo and fmt is not None:
                    echo_lp = fmt.build(job.request.prompt_token_ids, entries)
                prompt_lp = (vllm_prompt_logprobs(texts, want.prompt_logprobs, entries)
                             if want.prompt_logprobs is not None else None)
                yield chunk(job.index, job.prompt_text if want.echo else "", echo_lp, None, prompt_lp)
        if out.new_text or out.finished or (fmt is not None and out.new_token_ids):
            lp = fmt.build(out.new_token_ids, out.new_logprobs or []) if fmt is not None else None
            yield chunk(job.index, out.new_text, lp, _finish_reason(out.finish_reason) if out.finished else None)
    if include_usage:
        yield _sse({**base, "choices": [], "usage": usage.payload()})
    yield "data: [DONE]\n\n"


async def _chat_events(state, jobs, want: _Want, model, created, include_usage, synthetic) -> AsyncIterator[str]:
    base = {"id": jobs[0].request.request_id, "object": "chat.completion.chunk", "created": created, "model": model}
    texts = state.token_texts
    usage = _UsageTotals()

    def chunk(index: int, delta: dict, finish: Optional[str], logprobs=None) -> str:
        out = {**base, "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}
        if include_usage:
            out["usage"] = None
        return _sse(out)

    for job in jobs:
        yield chunk(job.index, {"role": "assistant", "content": ""}, None)
    async for job, out in _merged(jobs, synthetic):
        usage.last[job.index] = out
        err = _stream_error(out)
        if err is not None:
            yield _sse(err.body())
            _abort_jobs(state, jobs, "batch_failed")
            break
        with_lp = want.logprobs is not None and bool(out.new_token_ids)
        if out.new_text or with_lp:
            lp = {"content": chat_logprobs_content(texts, want.logprobs, out.new_logprobs or [])} if with_lp else None
            yield chunk(job.index, {"content": out.new_text}, None, lp)
        if out.finished:
            yield chunk(job.index, {}, _finish_reason(out.finish_reason))
    if include_usage:
        yield _sse({**base, "choices": [], "usage": usage.payload()})
    yield "data: [DONE]\n\n"


# --------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tokenlane serve",
        description="Serve a model over the OpenAI API with per-lane continuous batching.",
    )
    p.add_argument("--config", help="runtime.yaml (see docs/configuration.md); watched for hot reloads")
    p.add_argument("--host", default="0.0.0.0", help="bind address (default 0.0.0.0)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    g = p.add_argument_group("config overrides (take precedence over the file)")
    g.add_argument("--model", help="model.path: checkpoint folder")
    g.add_argument("--served-model-name", help="model.servedName")
    g.add_argument("--dtype", help="model.dtype")
    g.add_argument("--max-model-len", type=int, help="model.maxModelLen")
    g.add_argument("--kv-cache-blocks", type=int, help="engine.kvCacheBlocks")
    g.add_argument("--block-size", type=int, help="engine.blockSize")
    g.add_argument("--device", help="engine.device (auto|cpu|cuda)")
    g.add_argument("--attention-backend", help="engine.attentionBackend (auto|torch|triton)")
    g.add_argument("--executor", help="engine.executor (model|simulated)")
    g.add_argument("--no-continuous-batching", action="store_true",
                   help="engine.continuousBatching=false (request-level static batching)")
    g.add_argument("--no-prefix-caching", action="store_true", help="engine.enablePrefixCaching=false")
    p.add_argument("--shutdown-grace-seconds", type=float, default=30.0,
                   help="on SIGTERM, time in-flight requests get to finish (default 30)")
    p.add_argument("--config-poll-seconds", type=float, default=1.0,
                   help="how often the config file is checked for changes (default 1)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p


def apply_overrides(config: RuntimeConfig, args: argparse.Namespace) -> RuntimeConfig:
    """The config with the command-line overrides applied (validated again)."""
    model_changes = {
        k: v for k, v in {
            "path": args.model,
            "served_name": args.served_model_name,
            "dtype": args.dtype,
            "max_model_len": args.max_model_len,
        }.items() if v is not None
    }
    engine_changes = {
        k: v for k, v in {
            "kv_cache_blocks": args.kv_cache_blocks,
            "block_size": args.block_size,
            "device": args.device,
            "attention_backend": args.attention_backend,
            "executor": args.executor,
        }.items() if v is not None
    }
    if args.no_continuous_batching:
        engine_changes["continuous_batching"] = False
    if args.no_prefix_caching:
        engine_changes["enable_prefix_caching"] = False
    try:
        model = dataclasses.replace(config.model, **model_changes)
    except ConfigError as exc:
        raise ConfigError(f"config.model.{exc}") from None
    try:
        engine = dataclasses.replace(config.engine, **engine_changes)
    except ConfigError as exc:
        raise ConfigError(f"config.engine.{exc}") from None
    return dataclasses.replace(config, model=model, engine=engine)


class GracefulServer(uvicorn.Server):
    """uvicorn.Server whose first SIGTERM/SIGINT drains the engine before exiting: uvicorn's
    own handling would close the listening socket at once (clients would see connection
    refused, not a 503) and re-raise the signal (exit status -15 instead of 0)."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._drain_requested = False

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)

    def handle_exit(self, sig, frame) -> None:
        if self._drain_requested or self._loop is None:
            return super().handle_exit(sig, frame)  # second signal, or not started: exit now
        self._drain_requested = True
        self._loop.call_soon_threadsafe(self._drain_then_exit)

    def _drain_then_exit(self) -> None:
        log.info("shutdown signal: draining")
        task = self.state.begin_drain()
        task.add_done_callback(lambda _task: setattr(self, "should_exit", True))


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.config:
            file_config = load_config(args.config)
        elif args.model:
            file_config = RuntimeConfig(model=ModelConfig(path=args.model))
        else:
            print("tokenlane serve: give --config runtime.yaml or --model PATH", file=sys.stderr)
            return 2
        config = apply_overrides(file_config, args)
    except ConfigError as exc:
        print(f"tokenlane serve: invalid configuration: {exc}", file=sys.stderr)
        return 2

    from tokenlane.runtime.async_engine import AsyncEngine

    try:
        async_engine = AsyncEngine.from_config(config)
    except (ValueError, OSError) as exc:
        print(f"tokenlane serve: cannot load {config.model.path}: {exc}", file=sys.stderr)
        return 1
    options = ServerOptions(
        shutdown_grace_s=args.shutdown_grace_seconds,
        config_poll_interval_s=args.config_poll_seconds,
        config_transform=lambda c: apply_overrides(c, args),
    )
    app = create_app(async_engine, args.config, options=options)
    uv_config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                               timeout_graceful_shutdown=5, lifespan="on")
    server = GracefulServer(uv_config, app.state.tokenlane)
    server.run()
    return 0 if async_engine.healthy or app.state.tokenlane.draining else 1


if __name__ == "__main__":
    sys.exit(main())
