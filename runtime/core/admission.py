"""Admission control: refuse work the engine cannot take, with a reason and an HTTP status.

Checked when a request is submitted, before it enters a lane's queue:

- 400 `invalid`    empty prompt, a token id outside the vocabulary, unknown lane
- 400 `too_long`   prompt + max_tokens over the model length, or more KV blocks than the pool has
- 503 `draining`   the server is shutting down (raised by the async front)
- 429 `tenant_rate_limit` the tenant's tokensPerMinute budget does not hold the prompt now;
                   Retry-After: the seconds until it does (tenant_limits.py). Checked before
                   the load: a tenant over its rate is told so even when the queue is full too
- 429 `queue_full` maxWaitingRequests reached, globally or in the request's lane
- 503 `kv_watermark` KV cache usage at or above kvCacheRejectWatermark
- 429 `deadline`   the request's deadline cannot be met even if it were served at once, at the
                   step times measured recently (a lower bound, never a guess)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from tokenlane.runtime.core.request import Request
from tokenlane.runtime.core.tenant_limits import TenantRateLimiter


class AdmissionError(Exception):
    """A refused request: HTTP `status`, machine-readable `reason`, optional Retry-After."""

    def __init__(
        self, status: int, reason: str, message: str, retry_after_s: Optional[float] = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.message = message
        self.retry_after_s = retry_after_s

    def __repr__(self) -> str:
        return f"AdmissionError({self.status}, {self.reason!r}, {self.message!r})"


class StepTimeEstimator:
    """Exponential moving averages of measured step times, split by step kind, so deadline
    checks follow the current load (a step with many sequences is slower)."""

    def __init__(self, alpha: float = 0.2) -> None:
        self.alpha = alpha
        self.decode_step_s: Optional[float] = None  # steps without prefill tokens
        self.prefill_token_s: Optional[float] = None  # seconds per prefill token (mixed steps)

    def observe(self, step_seconds: float, num_prefill_tokens: int, num_decode_tokens: int) -> None:
        if step_seconds <= 0:
            return
        a = self.alpha
        if num_prefill_tokens == 0:
            if num_decode_tokens:
                prev = self.decode_step_s
                self.decode_step_s = step_seconds if prev is None else (1 - a) * prev + a * step_seconds
        else:
            # The step's decodes cost about a decode step; the rest is the prefill's.
            prefill_s = step_seconds - (self.decode_step_s or 0.0) * (num_decode_tokens > 0)
            per_token = max(0.0, prefill_s) / num_prefill_tokens
            prev = self.prefill_token_s
            self.prefill_token_s = per_token if prev is None else (1 - a) * prev + a * per_token

    def min_service_seconds(self, request: Request) -> Optional[float]:
        """A lower bound of the model time the request needs if it started now; None before
        anything was measured.

        The prompt counts at its measured per-token prefill rate. Decode steps count only
        when the length is certain: with ignore_eos and no stop token or string exactly
        max_tokens tokens come out; otherwise the request might stop after its first token,
        so only the first token is certain (refusing on a guess would turn away requests
        that would have made it)."""
        if self.decode_step_s is None:
            return None
        params = request.sampling_params
        prefill = (self.prefill_token_s or 0.0) * request.num_prompt_tokens
        exact_length = params.ignore_eos and not params.stop and not params.stop_token_ids
        decodes = max(0, params.max_tokens - 1) * self.decode_step_s if exact_length else 0.0
        return max(prefill, self.decode_step_s) + decodes


@dataclass
class AdmissionLimits:
    """What admission compares against (filled from the config and the executor)."""

    max_model_len: int
    kv_blocks_total: int
    block_size: int
    vocab_size: Optional[int] = None  # prompt token ids must be below it (None: unchecked)


def check_request_shape(request: Request, limits: AdmissionLimits) -> None:
    """400s: input the engine can never serve, whatever the load."""
    n_prompt = request.num_prompt_tokens
    if n_prompt == 0:
        raise AdmissionError(400, "invalid", "the prompt is empty")
    if limits.vocab_size is not None:
        ids = request.prompt_token_ids
        low, high = min(ids), max(ids)
        if low < 0 or high >= limits.vocab_size:
            raise AdmissionError(
                400, "invalid",
                f"token id {low if low < 0 else high} is outside the vocabulary [0, {limits.vocab_size})",
            )
    max_tokens = request.sampling_params.max_tokens
    if n_prompt + max_tokens > limits.max_model_len:
        raise AdmissionError(
            400,
            "too_long",
            f"this model's maximum context length is {limits.max_model_len} tokens; the request "
            f"has {n_prompt} prompt tokens and max_tokens={max_tokens} "
            f"({n_prompt + max_tokens} in total)",
        )
    blocks = -(-(n_prompt + max_tokens) // limits.block_size)
    if blocks > limits.kv_blocks_total:
        raise AdmissionError(
            400,
            "too_long",
            f"the request needs {blocks} KV cache blocks ({n_prompt} prompt tokens + "
            f"max_tokens={max_tokens}) but the cache has only {limits.kv_blocks_total}",
        )


def check_load(
    request: Request,
    *,
    waiting_total: int,
    waiting_in_lane: int,
    max_waiting_total: int,
    max_waiting_lane: int,
    kv_usage: float,
    kv_reject_watermark: float,
    estimator: StepTimeEstimator,
    now: float,
) -> None:
    """429/503s: refusals that depend on the current load (a retry may succeed)."""
    # Retry-After: about ten steps at the measured pace (a queue slot or blocks free up as
    # requests finish), 1 s before anything was measured.
    step_s = estimator.decode_step_s
    retry = max(0.1, 10 * step_s) if step_s else 1.0
    if waiting_total >= max_waiting_total:
        raise AdmissionError(
            429, "queue_full", f"the server's queue is full ({max_waiting_total} waiting)", retry
        )
    if waiting_in_lane >= max_waiting_lane:
        raise AdmissionError(
            429,
            "queue_full",
            f"lane {request.lane!r} queue is full ({max_waiting_lane} waiting)",
            retry,
        )
    if kv_usage >= kv_reject_watermark:
        raise AdmissionError(
            503,
            "kv_watermark",
            f"KV cache usage {kv_usage:.0%} is at the reject watermark {kv_reject_watermark:.0%}",
            retry,
        )
    if request.deadline is not None:
        left = request.deadline - now
        if left <= 0:
            raise AdmissionError(429, "deadline", "the request's deadline has already passed")
        need = estimator.min_service_seconds(request)
        if need is not None and need > left:
            raise AdmissionError(
                429,
                "deadline",
                f"the deadline cannot be met: at least {need * 1000:.0f} ms of model time is "
                f"needed for {request.num_prompt_tokens} prompt tokens and max_tokens="
                f"{request.sampling_params.max_tokens} at the current pace, "
                f"{left * 1000:.0f} ms are left",
            )


def check_tenant_rate(request: Request, limiter: TenantRateLimiter, now: float) -> None:
    """429 `tenant_rate_limit` when the tenant's token bucket cannot pay the prompt now (the
    caller charges the prompt once the request is admitted)."""
    wait = limiter.retry_after(request.tenant, request.num_prompt_tokens, now)
    if wait is not None:
        raise AdmissionError(
            429,
            "tenant_rate_limit",
            f"tenant {request.tenant!r} is over its token rate ({limiter.limit_of(request.tenant)} tokens "
            f"per minute, prompt + output); {request.num_prompt_tokens} prompt tokens fit again in {wait:.1f} s",
            wait,
        )
