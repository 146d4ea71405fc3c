"""What one step gives each request (`RequestOutput`), a request's streamed text (`TextState`:
the incremental detokenizer with stop strings held back until they are clear), and the front
end's `OutputProcessor`, which keeps one TextState per request.

The engine builds the outputs with token ids only: it never detokenizes. Both EngineClients
(runtime/engine/client.py) run one OutputProcessor on the event loop of the API process, as
their stream table dispatches a step's outputs (runtime/engine/async_engine.py), so text work
never delays a step. Offline callers of `LLMEngine.step()` that want text step it through an
`OfflineFront`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional

from tokenlane.runtime.core.request import FinishReason, Request, RequestStatus, TokenLogprob

log = logging.getLogger(__name__)


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    lane: str
    new_token_ids: list[int]
    new_text: str  # incremental text: "" from the engine, filled in by the front end's OutputProcessor
    finished: bool
    finish_reason: Optional[FinishReason]
    finish_detail: str  # e.g. "queue_timeout", "stop_string", "eos", rejection reason
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    # Logprobs of new_token_ids (one each), when the request asked for logprobs.
    new_logprobs: Optional[list[TokenLogprob]] = None
    # Every prompt token's logprob (entry 0 None), on the request's first output only, when
    # it asked for prompt logprobs.
    prompt_logprobs: Optional[list[Optional[TokenLogprob]]] = None
    # When the request was first scheduled (engine clock), for a front that holds only a
    # copy of the request (the engine core process's API side: X-Queue-Delay-Ms).
    scheduled_at: Optional[float] = None


class TextState:
    """One request's streamed text: incremental detokenizer plus stop-string hold-back.

    Text that could be the start of a stop string is held back until it is clear either
    way, so a client never receives part of a stop string."""

    def __init__(self, tokenizer: Any, request: Request) -> None:
        from tokenlane.runtime.engine.tokenizer import IncrementalDetokenizer

        self.detok = IncrementalDetokenizer(tokenizer, request.prompt_token_ids)
        self.stop = [s for s in request.sampling_params.stop if s]
        # Per stop string: its KMP failure table and how many of its leading characters
        # the text ends with now, so the hold-back costs O(new characters), not
        # O(len(stop string)**2) per token (long stop strings would stall the step loop).
        self.fail = [_kmp_failure(s) for s in self.stop]
        self.matched = [0] * len(self.stop)
        self.text = ""  # all decoded output text
        self.sent = 0  # characters of `text` already emitted

    def add(self, token_ids: list[int]) -> tuple[str, bool]:
        """(text to emit now, True if a stop string ended the request)."""
        delta = self.detok.add_tokens(token_ids)
        self.text += delta
        if not self.stop:  # nothing is ever held back
            self.sent = len(self.text)
            return delta, False
        from tokenlane.runtime.engine.tokenizer import find_stop_string

        found = find_stop_string(self.text, self.stop, len(delta))
        if found is not None:
            self.text = self.text[: found[0]]
            return self._emit(len(self.text)), True
        hold = 0
        matched = self.matched
        for j, s in enumerate(self.stop):
            q, fail = matched[j], self.fail[j]
            for ch in delta:
                while q and s[q] != ch:
                    q = fail[q - 1]
                if s[q] == ch:
                    q += 1
                    if q == len(s):  # not reached: find_stop_string saw no match
                        q = fail[q - 1]
            matched[j] = q
            if q > hold:
                hold = q
        return self._emit(len(self.text) - hold), False

    def finish(self) -> str:
        """Everything still held back (the request ended without a stop string)."""
        self.text += self.detok.flush()
        return self._emit(len(self.text))

    def _emit(self, upto: int) -> str:
        if upto <= self.sent:
            return ""
        out = self.text[self.sent : upto]
        self.sent = upto
        return out


# end_request(request_id, status, detail): end a request in the engine at its next step boundary.
EndRequest = Callable[[str, RequestStatus, str], None]


class OutputProcessor:
    """The front end's output processing, one per engine front: each request's streamed text,
    stop strings, and the end in the engine of a request the front end ended.

    `process(outputs, request_of)` fills in the outputs' text (a step's outputs in order;
    `request_of(request_id)` is the Request being served, or None once nobody waits for it).
    A stop string makes the output final (finish reason stop, "stop_string") and ends the
    request in the engine through `end_request` (FINISHED_STOPPED), which frees its KV blocks
    at the engine's next step boundary; a detokenizer error does the same for that request
    alone (FINISHED_ERROR). The engine's later outputs of a request ended here are dropped.
    Not thread-safe: one thread calls it (the event loop)."""

    def __init__(self, tokenizer: Any, end_request: EndRequest) -> None:
        self.tokenizer = tokenizer
        self._end_request = end_request
        self._texts: dict[str, TextState] = {}
        self._ended_here: set[str] = set()  # ended by a stop string or error; the engine's end pending
        if tokenizer is not None:
            from tokenlane.runtime.engine.tokenizer import byte_level_table

            byte_level_table(tokenizer)  # built here, not by the first request's first token

    @property
    def num_tracked(self) -> int:
        """Requests with text state or an end in the engine still to come (0 when idle)."""
        return len(self._texts) + len(self._ended_here)

    def process(self, outputs: list[RequestOutput],
                request_of: Callable[[str], Optional[Request]]) -> list[RequestOutput]:
        if self.tokenizer is None:  # the simulated executor: ids only (the server makes placeholder text)
            return outputs
        texts, ended_here = self._texts, self._ended_here
        kept = []
        for out in outputs:
            request_id = out.request_id
            if request_id in ended_here:
                if out.finished:
                    ended_here.discard(request_id)
                continue
            request = request_of(request_id)
            if request is None:  # nobody waits for it any more: its text is moot
                texts.pop(request_id, None)
                kept.append(out)
                continue
            state = texts.get(request_id)
            end_in_engine = None
            try:
                stopped = False
                if out.new_token_ids:
                    if state is None:
                        state = texts[request_id] = TextState(self.tokenizer, request)
                    out.new_text, stopped = state.add(out.new_token_ids)
                if stopped:
                    out.finish_reason, out.finish_detail = FinishReason.STOP, "stop_string"
                    end_in_engine = RequestStatus.FINISHED_STOPPED
                elif out.finished and state is not None:
                    out.new_text += state.finish()
            except Exception as exc:  # this request's text only: it fails, the others go on
                log.exception("detokenizing %s failed", request_id)
                out.new_text = ""
                out.finish_reason, out.finish_detail = FinishReason.ERROR, f"detokenizer error: {exc}"
                end_in_engine = RequestStatus.FINISHED_ERROR
            if end_in_engine is not None and not out.finished:
                out.finished = True
                ended_here.add(request_id)
                self._end_request(request_id, end_in_engine, out.finish_detail)
            if out.finished:
                texts.pop(request_id, None)
            kept.append(out)
        return kept

    def clear(self) -> None:
        """Forget every request (the engine stopped: no more outputs come)."""
        self._texts.clear()
        self._ended_here.clear()


class OfflineFront:
    """An LLMEngine stepped by its caller (tests, benchmarks, offline runs), its outputs with
    text: the engine's `add_request`/`add_group`, and `step()` through an OutputProcessor
    whose stop strings end requests in the engine (freed at its next step)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.processor = OutputProcessor(engine.tokenizer, engine.abort_request)
        self._requests: dict[str, Request] = {}

    def add_request(self, request: Request) -> None:
        self.engine.add_request(request)
        self._requests[request.request_id] = request

    def add_group(self, requests: list[Request]) -> None:
        self.engine.add_group(requests)
        for request in requests:
            self._requests[request.request_id] = request

    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        outputs = self.processor.process(self.engine.step(), self._requests.get)
        for out in outputs:
            if out.finished:
                self._requests.pop(out.request_id, None)
        return outputs


def _kmp_failure(s: str) -> list[int]:
    """fail[i]: length of the longest proper prefix of s[:i+1] that is also its suffix."""
    fail = [0] * len(s)
    k = 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = fail[k - 1]
        if s[i] == s[k]:
            k += 1
        fail[i] = k
    return fail
