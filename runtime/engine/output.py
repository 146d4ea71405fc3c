"""What one step gives each request (`RequestOutput`), and a request's streamed text
(`TextState`: the incremental detokenizer with stop strings held back until they are clear).

The engine builds the outputs; whichever side detokenizes (the step loop in process, the API
process for an engine core of its own: runtime/engine/core_client.py) keeps one TextState per
request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from tokenlane.runtime.core.request import FinishReason, Request, TokenLogprob


@dataclass
class RequestOutput:
    request_id: str
    lane: str
    new_token_ids: list[int]
    new_text: str  # incremental detokenized text ("" without tokenizer, or when detokenize=False)
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
