"""/v1/completions and /v1/chat/completions: a request body becomes one engine request per
prompt and sequence (a batch shares lane, tenant and deadline), then a JSON body or a stream
of SSE events.

Parallel sampling (n > 1, best_of): the sequences of one prompt are one SequenceGroup, admitted
together; they share the prompt's KV (runtime/core/request.py). Sequence j samples with
`sequence_seed(seed, j)`. choices[].index is prompt_index * n + j. With best_of the n sequences
with the highest cumulative logprob (the sum of their tokens' logprobs) are returned, as
OpenAI and vLLM do. Usage counts each prompt once and the tokens of every sequence generated
(best_of's discarded ones too: they were computed).

A batch is all or nothing: a prompt refused at admission, or one that fails part way,
cancels the others, and the cause (not the prompts cancelled because of it) decides the
status. The first output of every prompt is awaited before answering, so a queue timeout or
late rejection still gets its own status (504/429/503) rather than a 200 and an error event.

vLLM's `return_token_ids` (completions): each choice carries `prompt_token_ids` and `token_ids`
(the generated ids, echo or not); streamed, a choice's first chunk has the prompt's ids (later
ones null) and every chunk its new ids, so a token whose text is held back still gets one.
Unlike vLLM, echo keeps the prompt's text in `text` with the ids asked for.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from typing import TYPE_CHECKING, Any, AsyncIterator, Optional

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response

from tokenlane.runtime.core.admission import AdmissionError
from tokenlane.runtime.entrypoints.http_errors import (
    api_error_response,
    error_of_final,
    error_response,
    log_refusal,
    refused_before_admission,
)
from tokenlane.runtime.entrypoints.logprobs import CompletionLogprobs, chat_logprobs_content, vllm_prompt_logprobs
from tokenlane.runtime.entrypoints.protocol import (
    APIError,
    ChatChoice,
    ChatCompletionResponse,
    ChatMessageOut,
    CompletionChoice,
    CompletionResponse,
    FunctionCall,
    ToolCall,
    Usage,
)
from tokenlane.runtime.executor.structured_output import GrammarCompiler, parse_tool_call, tool_call_schema
from tokenlane.runtime.core.request import FinishReason, Request, SamplingParams, SequenceGroup, sequence_seed
from tokenlane.runtime.entrypoints.routing import AdapterDenied, Caller, choose_lane, parse_deadline_ms, resolve_model
from tokenlane.runtime.entrypoints.sse import (DONE_EVENT, ClientGone, DirectChunks, EventStreamResponse,
                                              TextEventTemplate, sse_event, until_disconnect)
from tokenlane.runtime.entrypoints.text_codec import TextCodec

if TYPE_CHECKING:
    from tokenlane.runtime.entrypoints.app import ServerState

log = logging.getLogger("tokenlane.server")

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
TOKENIZE_INLINE_MAX_CHARS = 8192  # longer prompts are tokenized in a worker thread


def _finish_reason(reason: Optional[FinishReason]) -> Optional[str]:
    if reason is None:
        return None
    if reason in (FinishReason.STOP, FinishReason.LENGTH):
        return reason.value
    return "abort"


@dataclasses.dataclass
class _Want:
    """What the response shows besides text, from the body."""

    echo: bool = False  # completions: the prompt's text (and logprobs) before the completion
    logprobs: Optional[int] = None  # top-k per generated token (chat: top_logprobs); None = off
    prompt_logprobs: Optional[int] = None  # vLLM's extension; None = off
    token_ids: bool = False  # vLLM's return_token_ids: the prompt's and the generated ids
    # Chat: the tools whose calls the output may hold (tool_choice other than "none").
    tools: list = dataclasses.field(default_factory=list)

    @classmethod
    def of(cls, body, chat: bool) -> "_Want":
        if chat:
            tools = body.tool_dicts() if body.effective_tool_choice != "none" else []
            return cls(logprobs=(body.top_logprobs or 0) if body.logprobs else None, tools=tools)
        return cls(echo=body.echo, logprobs=body.logprobs, prompt_logprobs=body.prompt_logprobs,
                   token_ids=bool(body.return_token_ids))

    @property
    def engine_prompt_logprobs(self) -> Optional[int]:
        """The top-k the engine computes per prompt token: enough for echo and the extension."""
        ks = [k for k in (self.logprobs if self.echo else None, self.prompt_logprobs) if k is not None]
        return max(ks) if ks else None


@dataclasses.dataclass
class _Job:
    """One sequence of one prompt of a request (a batch or n > 1 has several): its engine
    request and stream."""

    index: int  # choices[].index (best_of: set once the best n are known)
    request: Request
    prompt_text: Optional[str]  # for echo
    prompt_index: int = 0  # which prompt of the batch
    sample_index: int = 0  # which sequence of that prompt (0 .. n or best_of - 1)
    stream: Any = None  # RequestStream once submitted
    first: Any = None  # its first RequestOutput
    finished: bool = False  # its final output arrived
    aborted: bool = False  # we cancelled it
    started: bool = False  # streaming: its first chunk went out
    ids_sent: bool = False  # streaming with return_token_ids: its prompt_token_ids went out


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
    try:
        adapter = resolve_model(body.model, state.model_name, {a.name for a in state.client.served_adapters()},
                                caller)
    except AdapterDenied as exc:
        state.metrics.record_adapter_denied(exc.tenant, exc.adapter)
        raise
    want = _Want.of(body, chat)
    if (want.logprobs is not None or want.engine_prompt_logprobs is not None) and not state.supports_logprobs:
        raise APIError(400, "logprobs need the model executor (this server runs the simulated one)",
                       code="invalid_parameter", param="logprobs" if want.logprobs is not None else "prompt_logprobs")
    num_sequences = body.num_sequences
    # best_of ranks sequences by cumulative logprob: the engine computes them (top 0) if the
    # client did not ask.
    ranks_by_logprob = num_sequences > body.n
    if ranks_by_logprob and not state.supports_logprobs:
        raise APIError(400, "best_of > n ranks by logprobs, which need the model executor (this server "
                       "runs the simulated one)", code="invalid_parameter", param="best_of")
    engine_logprobs = 0 if ranks_by_logprob and want.logprobs is None else want.logprobs
    grammar = _grammar(state, body, chat)
    if chat:
        messages = [m.template_dict() for m in body.messages]
        tools = body.tool_dicts() if body.tools else None
        prompts: list[tuple[list[int], Optional[str]]] = [(state.codec.encode_chat(messages, tools=tools), None)]
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
    lane = choose_lane(config, caller, http.headers, max(len(ids) for ids, _ in prompts),
                       model=adapter or state.model_name)
    deadline_ms = parse_deadline_ms(http.headers)
    max_len = state.client.max_model_len
    now = state.client.clock()
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
                logprobs=engine_logprobs,
                prompt_logprobs=want.engine_prompt_logprobs,
                presence_penalty=body.presence_penalty,
                frequency_penalty=body.frequency_penalty,
                repetition_penalty=body.repetition_penalty,
                logit_bias=logit_bias,
                min_p=body.min_p,
                min_tokens=body.min_tokens,
                grammar=grammar,
            )
        except ValueError as exc:
            raise APIError(400, str(exc), code="invalid_parameter") from None
        group = []
        for j in range(num_sequences):
            k = i * num_sequences + j  # the sequence's place in the whole body
            request = Request(
                request_id=base_id if k == 0 else f"{base_id}-{k}",
                prompt_token_ids=prompt_ids,
                sampling_params=dataclasses.replace(sampling, seed=sequence_seed(body.seed, j)),
                lane=lane,
                tenant=caller.tenant,
                adapter=adapter,
                priority=body.priority,
                deadline=None if deadline_ms is None else now + deadline_ms / 1000.0,
                arrival_time=now,
            )
            group.append(request)
            jobs.append(_Job(i * body.n + j, request, text, prompt_index=i, sample_index=j))
        if len(group) > 1:
            SequenceGroup.of(group)
    return jobs


def _grammar(state: ServerState, body, chat: bool):
    """The compiled grammar the output must follow (response_format, guided_json, or a tool
    call forced by tool_choice), or None."""
    schema, param = body.output_schema, "guided_json" if body.guided_json is not None else "response_format"
    if chat and body.forced_tool_call is not None:
        choice = body.forced_tool_call
        schema = tool_call_schema(body.tool_dicts(), None if choice == "required" else choice.function.name)
        param = "tools"
    if schema is None:
        return None
    if not state.supports_logprobs or state.codec.tokenizer is None:
        raise APIError(400, "structured output needs the model executor (this server runs the simulated one)",
                       code="invalid_parameter", param=param)
    try:
        return GrammarCompiler.of(state.codec.tokenizer, state.vocab_size).json_schema(schema)
    except ValueError as exc:
        raise APIError(400, str(exc), code="invalid_parameter", param=param) from None


def _chat_message(text: str, finish: Optional[str], tools: list) -> tuple[ChatMessageOut, Optional[str]]:
    """The assistant message of a generated text: a tool call when all of the text is one
    (of `tools`), with finish_reason "tool_calls"; else the text."""
    call = parse_tool_call(text, tools) if tools and finish == "stop" else None
    if call is None:
        return ChatMessageOut(content=text), finish
    tool_call = ToolCall(id=f"call_{uuid.uuid4().hex[:24]}", function=FunctionCall(**call))
    return ChatMessageOut(content=None, tool_calls=[tool_call]), "tool_calls"


def _abort_jobs(jobs: list[_Job], why: str) -> None:
    """Cancel every job still running (their KV blocks are freed at the next step)."""
    for job in jobs:
        if job.stream is not None and not job.finished and not job.aborted:
            job.aborted = True
            _abort(job.stream, why)


async def generate(state: ServerState, caller: Caller, body, http: HTTPRequest, chat: bool):
    # While draining, submit() refuses with 503 "draining" (and the engine counts it).
    base_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    try:
        if _text_chars(body, chat) > TOKENIZE_INLINE_MAX_CHARS:
            # Long texts are tokenized off the event loop, so other streams are not held up.
            jobs = await asyncio.to_thread(_build_jobs, state, caller, body, http, chat, base_id)
        else:
            jobs = _build_jobs(state, caller, body, http, chat, base_id)
    except APIError as exc:
        return refused_before_admission(state, http, exc, base_id)
    head = jobs[0].request
    routing = {"X-Lane": head.lane, "X-Tenant": head.tenant, "X-Request-Id": head.request_id}
    per_prompt = body.num_sequences
    num_prompts = len(jobs) // per_prompt
    for p in range(num_prompts):
        group = jobs[p * per_prompt : (p + 1) * per_prompt]
        try:
            if per_prompt == 1:
                group[0].stream = await state.client.submit(group[0].request)
            else:  # the prompt's sequences are admitted together (they share its KV)
                streams = await state.client.submit_group([job.request for job in group])
                for job, stream in zip(group, streams):
                    job.stream = stream
        except AdmissionError as exc:
            # All or nothing: the prompts admitted before this one are cancelled at once.
            _abort_jobs(jobs, "batch_rejected")
            message = exc.message if num_prompts == 1 else f"prompt {p} of the batch was refused: {exc.message}"
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
        await until_disconnect(asyncio.gather(*(first_of(job) for job in jobs)), http.receive)
    except ClientGone:
        _abort_jobs(jobs, "client_disconnect")
        return Response(status_code=499)
    except BaseException:
        _abort_jobs(jobs, "server_error")
        raise
    if any(job.first is None for job in jobs):
        _abort_jobs(jobs, "server_error")
        log_refusal(head.request_id, head.lane, head.tenant, 500, "engine_error", "no output", refused=False)
        return error_response(500, "engine closed the request stream without an output", code="engine_error",
                              headers=routing)
    for job in jobs:
        err = error_of_final(job.first) if job.first.finished and not job.first.new_token_ids else None
        if err is not None:
            _abort_jobs(jobs, "batch_failed")
            return api_error_response(err, headers=routing)

    # Time from arrival to first schedule (known once the first output is out); benchmarks
    # read it (tokenlane bench: queue delay per lane).
    if head.first_scheduled_time is not None:
        routing["X-Queue-Delay-Ms"] = f"{(head.first_scheduled_time - head.arrival_time) * 1e3:.2f}"

    model = head.adapter or state.model_name  # the model the client named, as vLLM answers
    created = int(time.time())
    synthetic = state.codec.tokenizer is None
    want = _Want.of(body, chat)

    if body.stream:
        idle_s = state.config.scheduler.stream_idle_timeout_ms / 1000.0
        events = _chat_events if chat else _completion_events
        direct = DirectChunks()
        gen = events(state, jobs, want, model, created, body.include_usage_in_stream, synthetic, direct)
        return EventStreamResponse(gen, lambda how: _abort_jobs(jobs, how), idle_s, routing, direct)

    # Non-streaming: collect everything, watching the client meanwhile.
    async def collect(job: _Job) -> list:
        outputs = [job.first]
        # Non-final outputs join the list as they are dispatched, without waking this task for
        # each (the stream calls the hook only while it waits here with nothing queued).
        def take(out) -> bool:
            outputs.append(out)
            return True

        job.stream.direct = take
        while not outputs[-1].finished:
            outputs.append(await job.stream.__anext__())
        job.finished = True
        if len(jobs) > 1 and error_of_final(outputs[-1]) is not None:
            _abort_jobs(jobs, "batch_failed")  # the request fails: stop the others now
        return outputs

    try:
        results = await until_disconnect(asyncio.gather(*(collect(job) for job in jobs)), http.receive)
    except ClientGone:
        _abort_jobs(jobs, "client_disconnect")
        return Response(status_code=499)
    except BaseException:
        _abort_jobs(jobs, "server_error")
        raise
    # Cancelled by the server, or failed, part way: no partial answer. The cause, not the
    # prompts we cancelled because of it, decides the status.
    errors = [(job.aborted, error_of_final(outputs[-1])) for job, outputs in zip(jobs, results)]
    errors = sorted((e for e in errors if e[1] is not None), key=lambda e: e[0])
    if errors:
        return api_error_response(errors[0][1], headers=routing)
    texts = state.token_texts
    choices = []
    prompt_tokens = completion_tokens = 0
    for job, outputs in zip(jobs, results):  # usage: every sequence computed, each prompt once
        if job.sample_index == 0:
            prompt_tokens += outputs[-1].num_prompt_tokens
        completion_tokens += outputs[-1].num_output_tokens
    if body.num_sequences > body.n:
        jobs, results = _best_of(jobs, results, body.n)
    for job, outputs in zip(jobs, results):
        last = outputs[-1]
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
            message, reason = _chat_message(text, reason, want.tools)
            choices.append(ChatChoice(index=job.index, message=message, logprobs=logprobs, finish_reason=reason))
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
        if want.token_ids:
            choice.prompt_token_ids, choice.token_ids = list(job.request.prompt_token_ids), new_ids
        choices.append(choice)
    usage = Usage.of(prompt_tokens, completion_tokens)
    if chat:
        payload = ChatCompletionResponse(id=head.request_id, created=created, model=model, usage=usage,
                                         choices=choices).model_dump()
    else:
        payload = CompletionResponse(id=head.request_id, created=created, model=model, usage=usage,
                                     choices=choices).model_dump()
        absent = [key for key, asked in (("prompt_logprobs", want.prompt_logprobs is not None),
                                         ("prompt_token_ids", want.token_ids), ("token_ids", want.token_ids))
                  if not asked]
        for choice in payload["choices"]:
            for key in absent:
                del choice[key]
    return JSONResponse(payload, headers=routing)


def _best_of(jobs: list[_Job], results: list[list], n: int) -> tuple[list[_Job], list[list]]:
    """Per prompt, the n sequences with the highest cumulative logprob (ties: the lower
    sequence first), re-indexed prompt_index * n + rank in that order."""
    by_prompt: dict[int, list[tuple[float, int, _Job, list]]] = {}
    for job, outputs in zip(jobs, results):
        total = sum(e.logprob for o in outputs for e in (o.new_logprobs or []))
        by_prompt.setdefault(job.prompt_index, []).append((-total, job.sample_index, job, outputs))
    kept_jobs, kept_results = [], []
    for p in sorted(by_prompt):
        for rank, (_, _, job, outputs) in enumerate(sorted(by_prompt[p], key=lambda e: e[:2])[:n]):
            job.index = p * n + rank
            kept_jobs.append(job)
            kept_results.append(outputs)
    return kept_jobs, kept_results


def _abort(stream, why: str) -> None:
    """Cancel a request we no longer need; `why` becomes its metrics reason label."""
    stream.abort(why)
    log.info("cancelling %s: %s", stream.request_id, why)  # logged once the abort is staged


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


def _write_plain_chunks_directly(jobs: list[_Job], plain: dict, synthetic: bool,
                                 direct: Optional[DirectChunks]) -> None:
    """A single sequence's non-final chunks of text alone, written as the engine's outputs are
    dispatched (DirectChunks) instead of by the events generator's loop: exactly the chunk
    its template case makes (and nothing, as there, for an output with no text). Called where
    that case covers every non-final output: no usage totals to keep, no logprobs, no ids, no
    held-back text. The stream calls the hook only once its consumer waits in `_merged` with
    nothing queued, i.e. after the first output (and any echo) went out through the loop."""
    template = plain.get(jobs[0].index) if len(jobs) == 1 else None
    if direct is None or template is None:
        return

    def write(out) -> bool:
        write_now = direct.write
        if write_now is None:
            return False
        if synthetic and out.new_token_ids:
            out.new_text = TextCodec.synthetic_text(out.new_token_ids)
        return write_now(template(out.new_text)) if out.new_text else True

    jobs[0].stream.direct = write


def _stream_error(out) -> Optional[APIError]:
    """An error to send as the stream's last event (a server cancel ends with "abort")."""
    if out.finished and out.finish_reason in (FinishReason.TIMEOUT, FinishReason.REJECTED, FinishReason.ERROR):
        return error_of_final(out)
    return None


class _UsageTotals:
    """Streamed usage: each prompt once, the output tokens of every sequence."""

    def __init__(self) -> None:
        self.last: dict[int, Any] = {}  # choices[].index -> its latest output
        self.prompt_tokens: dict[int, int] = {}  # prompt index -> its tokens

    def add(self, job: "_Job", out) -> None:
        self.last[job.index] = out
        self.prompt_tokens[job.prompt_index] = out.num_prompt_tokens

    def payload(self) -> dict:
        completion = sum(o.num_output_tokens for o in self.last.values())
        return Usage.of(sum(self.prompt_tokens.values()), completion).model_dump()


async def _completion_events(state, jobs, want: _Want, model, created, include_usage, synthetic,
                             direct: Optional[DirectChunks] = None) -> AsyncIterator[str]:
    base = {"id": jobs[0].request.request_id, "object": "text_completion", "created": created, "model": model}
    texts = state.token_texts
    formatters = {job.index: CompletionLogprobs(texts, want.logprobs) for job in jobs} if want.logprobs is not None else {}
    usage = _UsageTotals()

    def payload(job: _Job, text: str, logprobs, finish, prompt_logprobs=None, token_ids=()) -> dict:
        choice = {"index": job.index, "text": text, "logprobs": logprobs, "finish_reason": finish}
        if want.prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs
        if want.token_ids:  # as vLLM: the prompt's ids in the choice's first chunk only
            choice["prompt_token_ids"] = None if job.ids_sent else list(job.request.prompt_token_ids)
            choice["token_ids"] = list(token_ids)
            job.ids_sent = True
        out = {**base, "choices": [choice]}
        if include_usage:
            out["usage"] = None
        return out

    def chunk(*args, **kwargs) -> str:
        return sse_event(payload(*args, **kwargs))

    # A choice's chunks of text alone (no logprobs, ids or prompt logprobs; not its last) come
    # from a template: most chunks of most streams.
    plain = {}
    if want.logprobs is None and want.prompt_logprobs is None and not want.token_ids:
        plain = {job.index: TextEventTemplate.of(payload(job, TextEventTemplate.TEXT_SLOT, None, None))
                 for job in jobs}
    if not include_usage:
        _write_plain_chunks_directly(jobs, plain, synthetic, direct)

    async for job, out in _merged(jobs, synthetic):
        if include_usage:
            usage.add(job, out)
        err = _stream_error(out)
        if err is not None:
            yield sse_event(err.body())
            _abort_jobs(jobs, "batch_failed")
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
                yield chunk(job, job.prompt_text if want.echo else "", echo_lp, None, prompt_lp)
        # A token whose text is held back (a stop string may follow) still gets a chunk when its
        # logprobs or ids are asked for.
        template = None if out.finished else plain.get(job.index)
        if template is not None:
            if out.new_text:
                yield template(out.new_text)
        elif out.new_text or out.finished or ((fmt is not None or want.token_ids) and out.new_token_ids):
            lp = fmt.build(out.new_token_ids, out.new_logprobs or []) if fmt is not None else None
            yield chunk(job, out.new_text, lp, _finish_reason(out.finish_reason) if out.finished else None,
                        token_ids=out.new_token_ids)
    if include_usage:
        yield sse_event({**base, "choices": [], "usage": usage.payload()})
    yield DONE_EVENT


async def _chat_events(state, jobs, want: _Want, model, created, include_usage, synthetic,
                       direct: Optional[DirectChunks] = None) -> AsyncIterator[str]:
    base = {"id": jobs[0].request.request_id, "object": "chat.completion.chunk", "created": created, "model": model}
    texts = state.token_texts
    usage = _UsageTotals()

    def payload(index: int, delta: dict, finish: Optional[str], logprobs=None) -> dict:
        out = {**base, "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}
        if include_usage:
            out["usage"] = None
        return out

    def chunk(*args) -> str:
        return sse_event(payload(*args))

    # A choice's content deltas without logprobs come from a template (most chunks).
    plain = {job.index: TextEventTemplate.of(payload(job.index, {"content": TextEventTemplate.TEXT_SLOT}, None))
             for job in jobs}

    for job in jobs:
        yield chunk(job.index, {"role": "assistant", "content": ""}, None)
    # With tools the text may be a tool call, known only at its end: held back, then sent as
    # one content delta or one tool_calls delta (OpenAI's chunk shape).
    held: dict[int, tuple[list[str], list]] = {job.index: ([], []) for job in jobs} if want.tools else {}
    if not include_usage and not held and want.logprobs is None:
        _write_plain_chunks_directly(jobs, plain, synthetic, direct)
    async for job, out in _merged(jobs, synthetic):
        if include_usage:
            usage.add(job, out)
        err = _stream_error(out)
        if err is not None:
            yield sse_event(err.body())
            _abort_jobs(jobs, "batch_failed")
            break
        with_lp = want.logprobs is not None and bool(out.new_token_ids)
        if held:
            texts_so_far, lps_so_far = held[job.index]
            texts_so_far.append(out.new_text)
            lps_so_far += out.new_logprobs or []
            if not out.finished:
                continue
            message, reason = _chat_message("".join(texts_so_far), _finish_reason(out.finish_reason), want.tools)
            lp = ({"content": chat_logprobs_content(texts, want.logprobs, lps_so_far)}
                  if want.logprobs is not None else None)
            if message.tool_calls:
                delta = {"tool_calls": [{"index": 0, **c.model_dump()} for c in message.tool_calls]}
            else:
                delta = {"content": message.content}
            yield chunk(job.index, delta, None, lp)
            yield chunk(job.index, {}, reason)
            continue
        template = None if with_lp else plain[job.index]
        if template is not None:
            if out.new_text:
                yield template(out.new_text)
        elif out.new_text or with_lp:
            lp = {"content": chat_logprobs_content(texts, want.logprobs, out.new_logprobs or [])} if with_lp else None
            yield chunk(job.index, {"content": out.new_text}, None, lp)
        if out.finished:
            yield chunk(job.index, {}, _finish_reason(out.finish_reason))
    if include_usage:
        yield sse_event({**base, "choices": [], "usage": usage.payload()})
    yield DONE_EVENT
