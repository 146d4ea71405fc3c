"""The FastAPI app: probes, metrics, models, tokenize, the OpenAI endpoints and the flight
recorder's steps, error handlers that keep every error in OpenAI's shape, and the state the
endpoints share.

    HTTP (FastAPI) -> router (tenant, lane, deadline) -> EngineClient.submit (admission)
    -> RequestStream -> JSON body, or SSE events `data: {...}` ... `data: [DONE]`

The generation endpoints themselves are in runtime/entrypoints/completions.py.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import hmac
import logging
import os
import uuid
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Callable, Optional, Union

from fastapi import Depends, FastAPI, Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenlane.runtime.entrypoints.completions import generate
from tokenlane.runtime.config import RuntimeConfig, dumps_config
from tokenlane.runtime.engine.client import EngineClient
from tokenlane.runtime.engine.config_watch import ConfigWatcher
from tokenlane.runtime.observability.flight_recorder import (
    DEFAULT_CAPACITY,
    FlightRecorder,
    default_dump_dir,
    parse_since,
    write_dump,
)
from tokenlane.runtime.entrypoints.http_errors import (
    DRAINING_RETRY_AFTER_S,
    RequestLog,
    error_response,
    log_refusal,
    nominal_route,
    refused_before_admission,
    validation_message,
)
from tokenlane.runtime.entrypoints.logprobs import TokenTexts
from tokenlane.runtime.observability.metrics import CONTENT_TYPE, PrometheusMetrics
from tokenlane.runtime.entrypoints.protocol import (
    APIError,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    LoadLoraAdapterRequest,
    ModelCard,
    ModelList,
    UnloadLoraAdapterRequest,
    TokenizeRequest,
    TokenizeResponse,
)
from tokenlane.runtime.entrypoints.routing import AdapterDenied, Caller, authenticate, resolve_model
from tokenlane.runtime.entrypoints.text_codec import TextCodec
from tokenlane.runtime.entrypoints.sse import RAW_SEND

log = logging.getLogger("tokenlane.server")

ADMIN_KEY_ENV = "TOKENLANE_ADMIN_API_KEY"
JSONL_CONTENT_TYPE = "application/x-ndjson"
MAX_DUMP_REASON_CHARS = 200


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
    _declare_validation_rules(schema, getattr(app.state.tokenlane, "vocab_size", None))
    app.openapi_schema = schema
    return schema


def _declare_validation_rules(schema: dict[str, Any], vocab_size: Optional[int]) -> None:
    """Rules the validators enforce that FastAPI's document does not show, so that a request
    valid under the document is one the server accepts (schemathesis checks both ways)."""
    components = schema["components"]["schemas"]

    def token_ids(items: dict[str, Any]) -> None:
        if vocab_size is not None:
            items["maximum"] = vocab_size - 1

    # A prompt (and each prompt of a batch) is non-empty; token ids are in the vocabulary.
    for variant in components["CompletionRequest"]["properties"]["prompt"]["anyOf"]:
        if variant["type"] == "string":
            variant["minLength"] = 1
            continue
        variant["minItems"] = 1
        inner = variant["items"]
        if inner.get("type") == "array":
            inner["minItems"] = 1
            inner = inner["items"]
        if inner.get("type") == "string":
            inner["minLength"] = 1
        else:
            token_ids(inner)
    token_ids(components["DetokenizeRequest"]["properties"]["tokens"]["items"])
    # Only an assistant turn may come without content; a tool turn names its call.
    components["ChatMessage"]["allOf"] = [
        {"if": {"properties": {"role": {"not": {"const": "assistant"}}}},
         "then": {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}}},
        {"if": {"properties": {"role": {"const": "tool"}}, "required": ["role"]},
         "then": {"required": ["tool_call_id"], "properties": {"tool_call_id": {"type": "string"}}}},
    ]
    # /tokenize takes exactly one of prompt and messages.
    components["TokenizeRequest"]["oneOf"] = [
        {"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
        {"required": ["messages"], "properties": {"messages": {"type": "array"}}},
    ]
    for parameter in schema["paths"]["/debug/dump"]["post"].get("parameters", []):
        if parameter["name"] == "reason":  # (and printable, which a JSON Schema pattern cannot say)
            parameter["schema"].update(minLength=1, maxLength=MAX_DUMP_REASON_CHARS)


# --------------------------------------------------------------------------- the app


@dataclasses.dataclass
class ServerOptions:
    shutdown_grace_s: float = 30.0
    config_poll_interval_s: float = 1.0
    # Re-applies command-line overrides to each new version of the config file.
    config_transform: Callable[[RuntimeConfig], RuntimeConfig] = lambda c: c
    # Steps the flight recorder keeps (0: no recorder), and where dumps are written.
    flight_recorder_steps: int = DEFAULT_CAPACITY
    dump_dir: Path = dataclasses.field(default_factory=default_dump_dir)
    # The admin key of POST /v1/load_lora_adapter and /v1/unload_lora_adapter (env
    # TOKENLANE_ADMIN_API_KEY); None: those endpoints answer 404, as vLLM's do without
    # VLLM_ALLOW_RUNTIME_LORA_UPDATING.
    admin_api_key: Optional[str] = dataclasses.field(default_factory=lambda: os.environ.get(ADMIN_KEY_ENV) or None)


class ServerState:
    """What the endpoints share: the engine, metrics, config watcher and draining state."""

    def __init__(self, client: EngineClient, metrics: PrometheusMetrics, watcher: Optional[ConfigWatcher],
                 options: ServerOptions) -> None:
        self.client = client
        self.metrics = metrics
        self.watcher = watcher
        self.options = options
        self.vocab_size: Optional[int] = client.vocab_size
        self.codec = TextCodec(client.tokenizer, self.vocab_size)
        self.token_texts = TokenTexts(client.tokenizer)
        self.supports_logprobs = client.supports_logprobs
        self.model_name = client.config.model.name
        self.draining = False
        self._drain_task: Optional[asyncio.Task] = None
        self.recorder: Optional[FlightRecorder] = None
        if options.flight_recorder_steps > 0:
            self.recorder = FlightRecorder(options.flight_recorder_steps, client.config)
        # Flight recorder reads (dumps, /debug/steps) have a thread of their own: in asyncio's
        # default executor they would queue behind tokenization (long prompts, /tokenize)
        # under a flood, and the operator's dump at a rollback gives up after a few seconds.
        self._dump_worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tokenlane-dump")

    @property
    def config(self) -> RuntimeConfig:
        return self.client.config  # the config in force (hot reloads land here)

    def write_dump(self, reason: str) -> Path:
        """Write the recorded steps, a metrics snapshot and the config in force to one JSON
        file under options.dump_dir; its path. Blocking (file I/O, JSON encoding): call it
        off the event loop. OSError if the file cannot be written."""
        try:
            self.metrics.set_occupancy(self.client.snapshot())
        except Exception:  # a dump must not fail because of a racing step
            log.debug("snapshot for the dump failed", exc_info=True)
        steps = self.recorder.entries() if self.recorder is not None else []
        return write_dump(Path(self.options.dump_dir), steps=steps,
                          metrics_text=self.metrics.render().decode(), config_text=dumps_config(self.config),
                          reason=reason)

    async def dump(self, reason: str) -> Optional[Path]:
        """`write_dump` in the dump thread; logs the path, or the error (None) and goes on."""
        try:
            path = await asyncio.get_running_loop().run_in_executor(self._dump_worker, self.write_dump, reason)
        except Exception as exc:
            log.error("flight recorder dump (%s) to %s failed: %s", reason, self.options.dump_dir, exc)
            return None
        log.info("flight recorder dump (%s) written to %s", reason, path)
        return path

    def close(self) -> None:
        """Let the dump thread go once its dump (if any) is written."""
        self._dump_worker.shutdown(wait=False)

    def begin_drain(self) -> asyncio.Task:
        """Stop admitting; finish in-flight work within the grace period (idempotent)."""
        if self._drain_task is None:
            self.draining = True
            log.info("draining: refusing new requests; in-flight work has %.0fs to finish",
                     self.options.shutdown_grace_s)
            self._drain_task = asyncio.get_running_loop().create_task(
                self.client.shutdown(self.options.shutdown_grace_s), name="drain"
            )
        return self._drain_task


class _App(FastAPI):
    """FastAPI that hands its streaming responses the server's `send` (sse.RAW_SEND), as long as
    no middleware of ours was added (one could rewrite the body: gzip)."""

    async def __call__(self, scope, receive, send) -> None:
        if not self.user_middleware:
            scope[RAW_SEND] = send
        await super().__call__(scope, receive, send)


def create_app(
    client: EngineClient,
    config_source: Union[None, str, Path, ConfigWatcher] = None,
    *,
    metrics: Optional[PrometheusMetrics] = None,
    options: Optional[ServerOptions] = None,
) -> FastAPI:
    """The FastAPI app serving the engine behind `client`.

    `config_source`: the config file to watch for hot reloads (a path, or a ready
    ConfigWatcher), or None to serve `client.config` unchanged.
    The engine is started (and drained) by the app's lifespan.
    """
    options = options or ServerOptions()
    metrics = metrics or PrometheusMetrics(client.config.model.name)
    watcher: Optional[ConfigWatcher]
    if config_source is None or isinstance(config_source, ConfigWatcher):
        watcher = config_source
    else:
        watcher = ConfigWatcher(config_source, client.config, client, recorder=metrics,
                                transform=options.config_transform, interval_s=options.config_poll_interval_s)
    state = ServerState(client, metrics, watcher, options)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        metrics.set_config(client.config)
        client.add_observer(metrics)
        if state.recorder is not None:
            state.recorder.set_config(client.config)
            client.add_observer(state.recorder)
        client.add_observer(RequestLog())
        await client.start()
        if watcher is not None:
            watcher.start()
        log.info("serving %s (lanes: %s)", state.model_name, ", ".join(l.name for l in client.config.lanes))
        try:
            yield
        finally:
            if watcher is not None:
                await watcher.stop()
            await state.begin_drain()
            state.close()

    app = _App(title="tokenlane", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.tokenlane = state
    app.openapi = lambda: _openapi_document(app)

    # ---- errors: always OpenAI's shape, never a 422

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: HTTPRequest, exc: RequestValidationError):
        message, param = validation_message(exc)
        return refused_before_admission(state, request, APIError(400, message, param=param, code="invalid_parameter"))

    @app.exception_handler(APIError)
    async def _api_error(request: HTTPRequest, exc: APIError):
        return refused_before_admission(state, request, exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: HTTPRequest, exc: StarletteHTTPException):
        if exc.status_code == 400:  # Starlette could not parse the body (e.g. not UTF-8)
            return refused_before_admission(state, request, APIError(
                400, "request body is not valid JSON (it must be UTF-8)", code="invalid_parameter"))
        return error_response(exc.status_code, str(exc.detail), code=None, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _crash(request: HTTPRequest, exc: Exception):
        log.exception("internal error serving %s", request.url.path)
        lane, tenant = nominal_route(state, request.headers)
        log_refusal(f"req-{uuid.uuid4().hex}", lane, tenant, 500, "internal_error", type(exc).__name__,
                    refused=False)
        return error_response(500, f"internal server error: {type(exc).__name__}", code="internal_error")

    # ---- probes and metrics

    @app.get("/health", responses=_errors(503))
    async def health():
        if client.healthy:
            return {"status": "ok"}
        return error_response(503, "engine step loop is not running", code="engine_dead")

    @app.get("/ready", responses=_errors(503))
    async def ready():
        if state.draining or not client.ready:
            why = "draining" if state.draining or client.draining else "not_started"
            return error_response(503, f"not ready: {why}", code=why, retry_after_s=DRAINING_RETRY_AFTER_S)
        return {"status": "ready", "model": state.model_name}

    @app.get("/metrics", response_class=PlainTextResponse,
             responses={200: {"description": "Prometheus text exposition format 0.0.4"}})
    async def prometheus_metrics(http: HTTPRequest):
        try:
            metrics.set_occupancy(client.snapshot())  # fresh gauges even when the engine idles
        except Exception:  # a scrape must not fail because of a racing step
            log.debug("snapshot for /metrics failed", exc_info=True)
        return Response(metrics.render(http.query_params.getlist("name[]")), media_type=CONTENT_TYPE)

    # ---- the OpenAI API. The key is checked before the body's fields are validated, so a bad
    # key with bad parameters is a 401; only a body that is not JSON at all is a 400 first
    # (FastAPI decodes JSON before it runs dependencies). Neither reveals anything.

    # async: FastAPI runs a plain `def` dependency in its thread pool, a round trip through a
    # worker thread (and the GIL, which the step thread holds between kernels) on every request.
    async def caller(request: HTTPRequest) -> Caller:
        return authenticate(state.config, request.headers)

    def model_cards(who: Caller) -> list[ModelCard]:
        """The base and each adapter the caller may use (vLLM's cards: parent = the base)."""
        base = state.model_name
        cards = [ModelCard(id=base, max_model_len=client.max_model_len, root=state.config.model.path)]
        for adapter in client.served_adapters():
            if who.may_use_adapter(adapter.name):
                cards.append(ModelCard(id=adapter.name, max_model_len=client.max_model_len, root=adapter.source,
                                       parent=base))
        return cards

    @app.get("/v1/models", responses=_errors(401))
    async def models(who: Caller = Depends(caller)):
        return ModelList(data=model_cards(who)).model_dump()

    @app.get("/v1/models/{model_id:path}", responses=_errors(401, 404))
    async def model(model_id: str, who: Caller = Depends(caller)):
        for card in model_cards(who):
            if card.id == model_id:
                return card.model_dump()
        return error_response(404, f"model {model_id!r} does not exist; this server serves {state.model_name!r} "
                              "and its adapters (GET /v1/models)", code="model_not_found", param="model")

    # ---- LoRA adapters at runtime (vLLM's endpoints), behind the admin key

    def check_admin(http: HTTPRequest) -> None:
        key = state.options.admin_api_key
        if not key:
            raise APIError(404, f"runtime LoRA adapter loading is off: set {ADMIN_KEY_ENV} to enable it",
                           type="not_found_error", code="not_found")
        scheme, _, given = http.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), key.encode()):
            raise APIError(401, "this endpoint needs the admin key: 'Authorization: Bearer <admin key>'",
                           type="authentication_error", code="invalid_admin_key")

    @app.post("/v1/load_lora_adapter", responses={
        200: {"description": "The adapter is loaded and served", "content": {"text/plain": {"schema": {"type": "string"}}}},
        **_errors(400, 401, 404)})
    async def load_lora_adapter(body: LoadLoraAdapterRequest, http: HTTPRequest):
        """vLLM's: load a LoRA adapter (a PEFT folder, or an hf:// or s3:// source) and serve it
        under `lora_name`. Admin key only; 400 with the reason if it cannot be loaded."""
        check_admin(http)
        try:
            await client.load_adapter(body.lora_name, body.lora_path)
        except ValueError as exc:
            raise APIError(400, str(exc), code="invalid_adapter", param="lora_path") from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", responses={
        200: {"description": "The adapter is no longer served", "content": {"text/plain": {"schema": {"type": "string"}}}},
        **_errors(400, 401, 404)})
    async def unload_lora_adapter(body: UnloadLoraAdapterRequest, http: HTTPRequest):
        """vLLM's: stop serving a LoRA adapter. New requests for it get 404 at once; its queued
        and running requests finish, then its weights are freed. Admin key only."""
        check_admin(http)
        try:
            await client.unload_adapter(body.lora_name)
        except KeyError:
            raise APIError(404, f"the LoRA adapter '{body.lora_name}' cannot be found", type="not_found_error",
                           code="model_not_found", param="lora_name") from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    @app.get("/debug/steps", responses={
        200: {"description": "The flight recorder's steps, oldest first, one JSON object a line",
              "content": {JSONL_CONTENT_TYPE: {}}},
        **_errors(400, 401, 404)})
    async def debug_steps(since: Optional[str] = None, who: Caller = Depends(caller)):
        """The engine steps the flight recorder holds; `since`: a step id (only later steps)
        or a unix time in seconds (only steps recorded after it), see docs/operations.md."""
        recorder = state.recorder
        if recorder is None:
            return error_response(404, "the flight recorder is off (--flight-recorder-steps 0)",
                                  code="flight_recorder_off")
        try:
            since_value = parse_since(since)
        except ValueError as exc:
            return error_response(400, str(exc), param="since", code="invalid_parameter")
        # Up to a few MB of JSON, encoded on the recorder's thread (not behind tokenization).
        body = await asyncio.get_running_loop().run_in_executor(state._dump_worker, recorder.jsonl, since_value)
        return Response(body, media_type=JSONL_CONTENT_TYPE)

    @app.post("/debug/dump", responses={
        200: {"description": "The dump file written on this server: {path, reason}"},
        **_errors(400, 401, 500)})
    async def debug_dump(reason: str = "api", who: Caller = Depends(caller)):
        """Write the flight recorder's steps, a metrics snapshot and the config in force to a
        file under --dump-dir, as SIGUSR1 does (the operator asks for one when it rolls a
        revision back); `reason` is recorded in the file. See docs/operations.md."""
        if not reason.isprintable() or not 0 < len(reason) <= MAX_DUMP_REASON_CHARS:
            return error_response(400, f"reason must be 1 to {MAX_DUMP_REASON_CHARS} printable characters",
                                  param="reason", code="invalid_parameter")
        path = await state.dump(reason)
        if path is None:
            return error_response(500, f"the dump could not be written under {state.options.dump_dir} "
                                       "(the server log says why)", code="dump_failed")
        return {"path": str(path), "reason": reason}

    def check_model(name: Optional[str], who: Caller) -> None:
        try:
            resolve_model(name, state.model_name, {a.name for a in client.served_adapters()}, who)
        except AdapterDenied as exc:
            metrics.record_adapter_denied(exc.tenant, exc.adapter)
            raise

    @app.post("/tokenize", response_model=TokenizeResponse, responses=_errors(400, 401, 404))
    async def tokenize(body: TokenizeRequest, who: Caller = Depends(caller)):
        """vLLM's /tokenize: the ids the server would compute for this prompt or chat."""
        check_model(body.model, who)
        if body.messages is not None:
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
            ids = await asyncio.to_thread(state.codec.encode_chat, messages, body.add_generation_prompt,
                                          bool(body.add_special_tokens))
        else:
            add = True if body.add_special_tokens is None else body.add_special_tokens
            ids = await asyncio.to_thread(state.codec.encode_text, body.prompt, add)
        return TokenizeResponse(count=len(ids), max_model_len=client.max_model_len, tokens=ids).model_dump()

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=_errors(400, 401, 404))
    async def detokenize(body: DetokenizeRequest, who: Caller = Depends(caller)):
        """vLLM's /detokenize: the text of token ids (special tokens kept)."""
        check_model(body.model, who)
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
        return await generate(state, who, body, request, chat=False)

    @app.post("/v1/chat/completions", responses={
        200: {"model": ChatCompletionResponse,
              "description": "The chat completion (JSON), or server-sent events with `stream: true`",
              "content": {"text/event-stream": {}}},
        **GENERATION_ERRORS})
    async def chat_completions(body: ChatCompletionRequest, request: HTTPRequest, who: Caller = Depends(caller)):
        return await generate(state, who, body, request, chat=True)

    return app
