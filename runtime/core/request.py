"""A request's lifecycle: status enum, finish reasons, sampling parameters and timestamps.

Pure Python (no torch): the scheduler and the benchmarks' simulated executor use it too.
"""

from __future__ import annotations

import enum
import hashlib
import time
from dataclasses import dataclass, field
from typing import NamedTuple, Optional


class TokenLogprob(NamedTuple):
    """One token's log-probability under the model's distribution at its position:
    log_softmax of the raw logits in float32 (before temperature, top-k, top-p, min-p, the
    penalties and logit_bias)."""

    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token at this position
    # The most likely tokens at this position, most likely first: (token id, logprob); as
    # many as the request asked for (logprobs / prompt_logprobs), possibly none.
    top: tuple[tuple[int, float], ...] = ()


class RequestStatus(enum.IntEnum):
    """Ordered: every status at or after FINISHED_STOPPED is final."""

    WAITING = 0  # in its lane's queue, never scheduled (or waiting again after preemption)
    RUNNING = 1  # in the running set: holds KV blocks, gets tokens each step
    PREEMPTED = 2  # evicted by recompute: blocks freed, back at the head of its lane's queue
    FINISHED_STOPPED = 3  # EOS, stop token id or stop string
    FINISHED_LENGTH = 4  # max_tokens or the model length
    FINISHED_CANCELLED = 5  # client abort / disconnect / stream idle timeout
    FINISHED_TIMEOUT = 6  # waited in the queue longer than its lane's queue timeout
    FINISHED_REJECTED = 7  # refused by admission (queue full, KV watermark, deadline)
    FINISHED_ERROR = 8  # internal error while running this request

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"
    TIMEOUT = "timeout"
    REJECTED = "rejected"
    ERROR = "error"


FINISH_REASON_OF_STATUS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_CANCELLED: FinishReason.CANCELLED,
    RequestStatus.FINISHED_TIMEOUT: FinishReason.TIMEOUT,
    RequestStatus.FINISHED_REJECTED: FinishReason.REJECTED,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


# Most top logprobs a request may ask for per position (OpenAI's limit).
MAX_LOGPROBS = 20


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = disabled
    seed: Optional[int] = None  # per-request generator seed (reproducible sampling)
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)  # stop strings (checked on decoded text)
    ignore_eos: bool = False
    # Log-probabilities (see TokenLogprob), computed from the logits the step samples from:
    # None = off; k >= 0 = each sampled token's logprob plus the k most likely tokens.
    logprobs: Optional[int] = None
    # The same for every prompt token after the first (the first has no context: None).
    # Such a request computes its whole prompt: it takes no cached prefix blocks for the
    # positions whose logprobs it still needs (see Request.max_cached_prefix_tokens).
    prompt_logprobs: Optional[int] = None
    # Logits processors (runtime/executor/sampler.py). They change what is drawn (greedy included),
    # never the reported logprobs, which stay those of the raw model distribution.
    presence_penalty: float = 0.0  # OpenAI: minus this once per token already generated
    frequency_penalty: float = 0.0  # OpenAI: minus this times the token's count in the output
    repetition_penalty: float = 1.0  # HF/vLLM: over prompt + output tokens; 1 = off, > 1 discourages
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    min_p: float = 0.0  # drop tokens under min_p x the top token's probability; 0 = off
    min_tokens: int = 0  # EOS and stop_token_ids are not drawn before this many tokens
    # A compiled grammar (runtime/executor/structured_output.py) the output must follow; None = free.
    grammar: Optional[object] = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        low = 0 if self.prompt_logprobs is not None else 1
        if not isinstance(self.max_tokens, int) or self.max_tokens < low:
            raise ValueError(
                f"max_tokens must be an integer >= 1 (0 only with prompt logprobs), got {self.max_tokens!r}"
            )
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (not isinstance(k, int) or not 0 <= k <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {k!r}")
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.top_k < 2**31:
            raise ValueError(f"top_k must be in [0, 2**31) (0 disables it), got {self.top_k}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty < float("inf"):
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens], got {self.min_tokens!r}")
        for token, value in self.logit_bias.items():
            if not isinstance(token, int) or token < 0:
                raise ValueError(f"logit_bias keys must be token ids >= 0, got {token!r}")
            if not -100.0 <= value <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {value}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            # the range torch.Generator.manual_seed accepts
            raise ValueError(f"seed must be in [-2**63, 2**64), got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def uses_logits_processors(self) -> bool:
        """Whether the sampler must change this row's logits before picking (the penalties,
        logit_bias, min_tokens; min_p applies with the draw)."""
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
            or self.logit_bias or self.min_tokens
        )


def sequence_seed(seed: Optional[int], index: int) -> Optional[int]:
    """The sampling seed of sequence `index` of a parallel-sampling group (n > 1, best_of)
    whose request asked for `seed`: sequence 0 keeps the request's seed (so it samples what
    an n=1 request would), sequence i > 0 gets the first 63 bits of
    sha256("{seed}:{i}"). Same seed, same n outputs; None stays None (unseeded)."""
    if seed is None or index == 0:
        return seed
    digest = hashlib.sha256(f"{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


@dataclass(eq=False)
class SequenceGroup:
    """The sequences one prompt is sampled into in parallel (n > 1, best_of), in index order.

    members[0], the leader, computes the prompt as an n=1 request would. Once it has computed
    all prompt tokens but the last, the others fork from it: they share its blocks (ref
    counted) and each computes the last prompt token itself and samples from its own logits.
    The block holding that token is copied on write by whichever sequence writes into it
    while it is still shared (`StepPlan.block_copies`)."""

    members: list["Request"]
    forked: bool = False  # the followers hold their share of the leader's blocks

    @classmethod
    def of(cls, members: list["Request"]) -> "SequenceGroup":
        """Tie `members` (index order, at least two) into one group."""
        if len(members) < 2:
            raise ValueError(f"a sequence group needs at least 2 sequences, got {len(members)}")
        group = cls(list(members))
        # A one-token prompt has nothing to share: the sequences run independently.
        group.forked = members[0].num_prompt_tokens <= 1
        for i, member in enumerate(members):
            member.group = group
            member.awaits_fork = i > 0 and not group.forked
        return group

    @property
    def leader(self) -> "Request":
        return self.members[0]

    @property
    def fork_tokens(self) -> int:
        """Prompt tokens the followers take from the leader (all but the last)."""
        return self.leader.num_prompt_tokens - 1


@dataclass(slots=True)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    lane: str = "default"
    tenant: str = "default"
    priority: int = 0  # within a lane: higher first; across lanes the lane's priority rules
    deadline: Optional[float] = None  # absolute time.monotonic() by which it must finish
    arrival_time: float = field(default_factory=time.monotonic)
    eos_token_id: Optional[int] = None
    # The LoRA adapter (by name) the request runs with; None = the base model. Part of its
    # prefix-cache hashes (KV is never shared across adapters) and of the adapter-slot rule.
    adapter: Optional[str] = None

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (first schedule)
    block_ids: list[int] = field(default_factory=list)  # the block table, in order
    num_preemptions: int = 0
    finish_reason: Optional[FinishReason] = None
    finish_detail: str = ""  # e.g. the rejection reason: queue_full, kv_watermark, deadline
    # Log-probabilities, when sampling_params asks for them. output_logprobs[i] belongs to
    # output_token_ids[i]; prompt_logprobs[i] to prompt_token_ids[i] (entry 0 is None), filled
    # chunk by chunk as the prefill computes them (recomputation after a preemption does not
    # add them twice).
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[Optional[TokenLogprob]] = field(default_factory=list)
    prompt_logprobs_sent: bool = False  # the engine handed them to an output already
    # Parallel sampling: the group this sequence belongs to (None: a single sequence), and
    # whether it still waits for its leader's prompt before it can run (a follower before
    # the fork: counted as running once its leader started, holding no blocks).
    group: Optional[SequenceGroup] = None
    awaits_fork: bool = False

    # Timestamps (time.monotonic()); they feed TTFT, TPOT, queue delay, prefill/decode time.
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    token_times: list[float] = field(default_factory=list)
    finish_time: Optional[float] = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Tokens known so far (prompt + generated); the next step computes up to this."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def max_cached_prefix_tokens(self) -> Optional[int]:
        """Most prompt tokens this request may take from the prefix cache (None: no limit).

        The logprob of prompt token i comes from the logits at position i - 1, which only a
        forward pass over that position produces: a request that still needs prompt logprobs
        from token j on must compute positions j - 1 onwards itself."""
        if self.sampling_params.prompt_logprobs is None:
            return None
        known = len(self.prompt_logprobs)  # tokens whose logprobs are already recorded
        if known >= self.num_prompt_tokens:
            return None  # all recorded (e.g. recomputing after a preemption)
        return max(0, known - 1)

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed_tokens < self.num_tokens - 1

    def finish(self, status: RequestStatus, detail: str = "", now: Optional[float] = None) -> None:
        assert status.is_finished, status
        self.status = status
        self.finish_reason = FINISH_REASON_OF_STATUS[status]
        self.finish_detail = detail
        self.finish_time = time.monotonic() if now is None else now
