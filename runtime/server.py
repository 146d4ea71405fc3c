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
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenlane.runtime.config import (
    ConfigError,
    ModelConfig,
    RuntimeConfig,
    load_config,
)
from tokenlane.runtime.config_watch import ConfigWatcher
from tokenlane.runtime.metrics import CONTENT_TYPE, PrometheusMetrics
from tokenlane.runtime.protocol import (
    APIError,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessageOut,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
    Usage,
    error_body,
)
from tokenlane.runtime import tokenizer as tokenizer_lib
from tokenlane.runtime.admission import AdmissionError
from tokenlane.runtime.request import FinishReason, Request, RequestStatus, SamplingParams
from tokenlane.runtime.router import Caller, authenticate, choose_lane, parse_deadline_ms

log = logging.getLogger("tokenlane.server")

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

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        if self.tokenizer is None:
            return self._synthetic("".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: ")
        try:
            return list(tokenizer_lib.apply_chat_template(self.tokenizer, messages, add_generation_prompt=True))
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
        if loc:
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

    # ---- errors: always OpenAI's shape, never a 422

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: HTTPRequest, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return error_response(400, message, param=param, code="invalid_parameter")

    @app.exception_handler(APIError)
    async def _api_error(request: HTTPRequest, exc: APIError):
        return _api_error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: HTTPRequest, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail), code=None, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _crash(request: HTTPRequest, exc: Exception):
        log.exception("internal error serving %s", request.url.path)
        return error_response(500, f"internal server error: {type(exc).__name__}", code="internal_error")

    # ---- probes and metrics

    @app.get("/health")
    async def health():
        if state.async_engine.healthy:
            return {"status": "ok"}
        return error_response(503, "engine step loop is not running", code="engine_dead")

    @app.get("/ready")
    async def ready():
        if state.draining or not state.async_engine.ready:
            why = "draining" if state.draining or state.async_engine.draining else "not_started"
            return error_response(503, f"not ready: {why}", code=why, retry_after_s=DRAINING_RETRY_AFTER_S)
        return {"status": "ready", "model": state.model_name}

    @app.get("/metrics")
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

    @app.get("/v1/models")
    async def models(who: Caller = Depends(caller)):
        card = ModelCard(id=state.model_name, max_model_len=engine.max_model_len)
        return ModelList(data=[card]).model_dump()

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: HTTPRequest, who: Caller = Depends(caller)):
        return await _generate(state, who, body, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: HTTPRequest, who: Caller = Depends(caller)):
        return await _generate(state, who, body, request, chat=True)

    return app


# --------------------------------------------------------------------------- generation


def _prompt_ids(state: ServerState, body, chat: bool) -> list[int]:
    if chat:
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        return state.codec.encode_chat(messages)
    prompt = body.prompt
    if isinstance(prompt, str):
        ids = state.codec.encode(prompt)
    else:
        ids = list(prompt)
        vocab = state.vocab_size
        if vocab is not None and max(ids) >= vocab:
            raise APIError(400, f"token id {max(ids)} is out of the vocabulary (size {vocab})",
                           code="invalid_token_id", param="prompt")
    if not ids:
        raise APIError(400, "prompt encodes to zero tokens", code="empty_prompt", param="prompt")
    return ids


def _text_chars(body, chat: bool) -> int:
    if chat:
        return sum(len(m.text()) for m in body.messages)
    return len(body.prompt) if isinstance(body.prompt, str) else 0


def _build_request(state: ServerState, caller: Caller, body, http: HTTPRequest, chat: bool) -> Request:
    config = state.config
    if body.model is not None and body.model != state.model_name:
        raise APIError(404, f"model {body.model!r} does not exist; this server serves {state.model_name!r}",
                       code="model_not_found", param="model")
    prompt_ids = _prompt_ids(state, body, chat)
    lane = choose_lane(config, caller, http.headers, len(prompt_ids))
    deadline_ms = parse_deadline_ms(http.headers)
    max_len = state.engine.max_model_len
    max_tokens = body.requested_max_tokens if chat else body.max_tokens
    if max_tokens is None:
        # Chat: whatever fits in the model (OpenAI's default); completions: OpenAI's 16.
        max_tokens = max(1, max_len - len(prompt_ids)) if chat else DEFAULT_COMPLETION_MAX_TOKENS
    if len(prompt_ids) + max_tokens > max_len:
        raise APIError(
            400,
            f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) exceeds the model's "
            f"maximum length of {max_len} tokens",
            code="context_length_exceeded",
            param="max_tokens",
        )
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
        )
    except ValueError as exc:
        raise APIError(400, str(exc), code="invalid_parameter") from None
    now = state.engine.clock()
    prefix = "chatcmpl" if chat else "cmpl"
    return Request(
        request_id=f"{prefix}-{uuid.uuid4().hex}",
        prompt_token_ids=prompt_ids,
        sampling_params=sampling,
        lane=lane,
        tenant=caller.tenant,
        priority=body.priority,
        deadline=None if deadline_ms is None else now + deadline_ms / 1000.0,
        arrival_time=now,
    )


async def _generate(state: ServerState, caller: Caller, body, http: HTTPRequest, chat: bool):
    # While draining, submit() refuses with 503 "draining" (and the engine counts it).
    try:
        if _text_chars(body, chat) > TOKENIZE_INLINE_MAX_CHARS:
            # Long texts are tokenized off the event loop, so other streams are not held up.
            request = await asyncio.to_thread(_build_request, state, caller, body, http, chat)
        else:
            request = _build_request(state, caller, body, http, chat)
    except APIError as exc:
        return _api_error_response(exc)
    routing = {"X-Lane": request.lane, "X-Tenant": request.tenant, "X-Request-Id": request.request_id}
    try:
        stream = state.async_engine.submit(request)
    except AdmissionError as exc:
        return error_response(exc.status, exc.message, code=exc.reason,
                              retry_after_s=exc.retry_after_s, headers=routing)

    finished = False

    def abort(why: str) -> None:
        if not finished:
            _abort(state, stream, why)

    # Wait for the first output before answering, so a queue timeout or late rejection still
    # gets its own status (504/429/503) instead of a 200 followed by an error event.
    try:
        first = await _until_disconnect(stream.__anext__(), http.receive)
    except ClientGone:
        abort("client_disconnect")
        return Response(status_code=499)
    except StopAsyncIteration:
        return error_response(500, "engine closed the request stream without an output", code="engine_error",
                              headers=routing)
    except BaseException:
        abort("server_error")
        raise
    if first.finished:
        finished = True
        err = _error_of_final(first) if not first.new_token_ids else None
        if err is not None:
            return _api_error_response(err, headers=routing)

    # Time from arrival to first schedule (known once the first output is out); benchmarks
    # read it (tokenlane bench: queue delay per lane).
    if request.first_scheduled_time is not None:
        routing["X-Queue-Delay-Ms"] = f"{(request.first_scheduled_time - request.arrival_time) * 1e3:.2f}"

    model = state.model_name
    created = int(time.time())
    synthetic = state.codec.tokenizer is None

    if body.stream:
        idle_s = state.config.scheduler.stream_idle_timeout_ms / 1000.0
        progress = _Progress(finished=first.finished)
        events = _chat_events if chat else _completion_events
        gen = events(request, stream, first, model, created, body.include_usage_in_stream, progress, synthetic)

        def on_close(how: str) -> None:
            if not progress.finished:
                _abort(state, stream, how)

        return EventStreamResponse(gen, on_close, idle_s, routing)

    # Non-streaming: collect everything, watching the client meanwhile.
    async def collect():
        outputs = [first]
        while not outputs[-1].finished:
            outputs.append(await stream.__anext__())
        return outputs

    try:
        outputs = await _until_disconnect(collect(), http.receive) if not first.finished else [first]
    except ClientGone:
        abort("client_disconnect")
        return Response(status_code=499)
    except BaseException:
        abort("server_error")
        raise
    finished = True
    last = outputs[-1]
    if synthetic:
        text = "".join(TextCodec.synthetic_text(o.new_token_ids) for o in outputs)
    else:
        text = "".join(o.new_text for o in outputs)
    err = _error_of_final(last)
    if err is not None:  # cancelled by the server, or failed, part way: no partial answer
        return _api_error_response(err, headers=routing)
    usage = Usage.of(last.num_prompt_tokens, last.num_output_tokens)
    reason = _finish_reason(last.finish_reason)
    if chat:
        payload = ChatCompletionResponse(
            id=request.request_id, created=created, model=model, usage=usage,
            choices=[ChatChoice(message=ChatMessageOut(content=text), finish_reason=reason)],
        )
    else:
        payload = CompletionResponse(
            id=request.request_id, created=created, model=model, usage=usage,
            choices=[CompletionChoice(text=text, finish_reason=reason)],
        )
    return JSONResponse(payload.model_dump(), headers=routing)


def _abort(state: ServerState, stream, why: str) -> None:
    """Cancel a request whose client is gone; `why` becomes its metrics reason label."""
    log.info("cancelling %s: %s", stream.request_id, why)
    # The engine keeps the first abort's detail; stream.abort() then wakes the step loop.
    state.engine.abort_request(stream.request_id, RequestStatus.FINISHED_CANCELLED, why)
    stream.abort()


@dataclasses.dataclass
class _Progress:
    finished: bool  # the engine sent the request's final output (nothing left to abort)


async def _outputs(stream, first, progress: _Progress, synthetic: bool) -> AsyncIterator[Any]:
    """The request's outputs, `first` included; `synthetic` (no tokenizer) gives each token a
    placeholder text so every token is a chunk."""
    out = first
    while True:
        if synthetic and out.new_token_ids:
            out.new_text = TextCodec.synthetic_text(out.new_token_ids)
        yield out
        if out.finished:
            return
        out = await stream.__anext__()
        progress.finished = out.finished


def _stream_error(out) -> Optional[APIError]:
    """An error to send as the stream's last event (a server cancel ends with "abort")."""
    if out.finished and out.finish_reason in (FinishReason.TIMEOUT, FinishReason.REJECTED, FinishReason.ERROR):
        return _error_of_final(out)
    return None


def _usage_payload(last) -> dict:
    return Usage.of(last.num_prompt_tokens, last.num_output_tokens).model_dump()


async def _completion_events(request, stream, first, model, created, include_usage, progress,
                             synthetic) -> AsyncIterator[str]:
    base = {"id": request.request_id, "object": "text_completion", "created": created, "model": model}
    last = first
    async for out in _outputs(stream, first, progress, synthetic):
        last = out
        err = _stream_error(out)
        if err is not None:
            yield _sse(err.body())
            break
        if out.new_text or out.finished:
            chunk = {**base, "choices": [{"index": 0, "text": out.new_text, "logprobs": None,
                                          "finish_reason": _finish_reason(out.finish_reason) if out.finished else None}]}
            if include_usage:
                chunk["usage"] = None
            yield _sse(chunk)
    if include_usage:
        yield _sse({**base, "choices": [], "usage": _usage_payload(last)})
    yield "data: [DONE]\n\n"


async def _chat_events(request, stream, first, model, created, include_usage, progress,
                       synthetic) -> AsyncIterator[str]:
    base = {"id": request.request_id, "object": "chat.completion.chunk", "created": created, "model": model}

    def chunk(delta: dict, finish: Optional[str]) -> dict:
        out = {**base, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
        if include_usage:
            out["usage"] = None
        return out

    yield _sse(chunk({"role": "assistant", "content": ""}, None))
    last = first
    async for out in _outputs(stream, first, progress, synthetic):
        last = out
        err = _stream_error(out)
        if err is not None:
            yield _sse(err.body())
            break
        if out.new_text:
            yield _sse(chunk({"content": out.new_text}, None))
        if out.finished:
            yield _sse(chunk({}, _finish_reason(out.finish_reason)))
    if include_usage:
        yield _sse({**base, "choices": [], "usage": _usage_payload(last)})
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
