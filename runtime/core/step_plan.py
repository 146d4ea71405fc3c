"""The contract between scheduler and executor: one step's plan, and what comes back.

The scheduler (pure Python) returns a `StepPlan`; the executor turns it into flat batch
tensors, runs the model and samples; it returns an `ExecutorOutput`, which goes back to the
scheduler through its single `update_from_output` method.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Protocol

from tokenlane.runtime.core.request import Request, TokenLogprob


@dataclass(slots=True)
class ScheduledChunk:
    """One request's share of a step."""

    request: Request
    # First token position computed this step (== request.num_computed_tokens at planning).
    start: int
    # Tokens computed this step: 1 for a decode, up to the prefill chunk size for a prefill.
    num_tokens: int
    # True when the chunk reaches the last known token, so a new token is sampled for it.
    # False for a prefill chunk that stops inside the prompt.
    sample: bool


@dataclass
class StepPlan:
    # Chunks in batch order: decodes first, then prefill chunks (decode-first policy).
    chunks: list[ScheduledChunk] = field(default_factory=list)
    # Requests evicted this step by recompute; their blocks are already freed.
    preempted: list[Request] = field(default_factory=list)
    # Requests that reached a final status since the previous plan (finished, cancelled,
    # timed out, errored); the executor drops any per-request state it holds for them
    # (e.g. sampling generators).
    finished: list[Request] = field(default_factory=list)
    # Sum of num_tokens over chunks; never above the step's token budget.
    num_batched_tokens: int = 0
    # Block ids to copy before the step's forward pass, (src, dst): parallel sampling's copy
    # on write (a sequence about to write into a block its group still shares gets its own
    # copy; see SequenceGroup in request.py). Each dst is a fresh block of this step.
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # The host-memory tier of the prefix cache (engine.kvOffload; kv_host_tier.py), performed
    # before the forward pass, every offload before any restore:
    # (device block, host slot): copy a cached block's K/V (all layers) to the host before the
    # block is reused in this step;
    kv_offloads: list[tuple[int, int]] = field(default_factory=list)
    # (host slot, device block): copy a host block back into a fresh device block, which the
    # step's chunks read as a prefix hit.
    kv_restores: list[tuple[int, int]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.chunks

    @property
    def num_prefill_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks if c.start < c.request.num_prompt_tokens)

    @property
    def num_decode_tokens(self) -> int:
        return self.num_batched_tokens - self.num_prefill_tokens


@dataclass
class ExecutorOutput:
    # request_id -> the token sampled this step (only for chunks with sample=True).
    sampled: dict[str, int] = field(default_factory=dict)
    # request_id -> the sampled token's logprob (requests with sampling_params.logprobs set),
    # from the same logits the token was sampled from.
    logprobs: dict[str, TokenLogprob] = field(default_factory=dict)
    # request_id -> (index of the first prompt token scored, logprobs of the prompt tokens
    # this step's chunk scored), for requests with sampling_params.prompt_logprobs set. A
    # chunk over positions [start, start + n) scores prompt tokens start + 1 .. start + n.
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprob]]] = field(default_factory=dict)
    # request_id -> error message, for requests the executor could not run (finished as error).
    errors: dict[str, str] = field(default_factory=dict)
    # Wall (or simulated) seconds the model step took; feeds deadline estimates and metrics.
    step_seconds: float = 0.0
    # Seconds the plan's kv_restores took until the forward pass could read them (None: no
    # restores, or not measured).
    kv_restore_seconds: Optional[float] = None


class ExecutorGroupFailed(RuntimeError):
    """A rank of a multi-rank executor (engine.tensorParallelSize x pipelineParallelSize) died,
    hung or failed a step: the whole group is down. The engine re-raises it at once (no
    per-request isolation: every request of the group would fail the same way)."""


class Executor(Protocol):
    """Runs one step's plan: the model executor (executor.py) or the simulated one (bench)."""

    block_size: int  # tokens per KV block (from engine.blockSize)
    # Whether it fills ExecutorOutput.logprobs / prompt_logprobs (the simulated one does not;
    # the server refuses logprobs then). Optional attribute, False when absent.
    # supports_logprobs: bool
    num_kv_blocks: int  # KV pool size the executor allocated (or simulates)
    # Optional attribute: slots of the host-memory tier (engine.kvOffload) it allocated; 0 or
    # absent = no tier.
    # num_host_kv_blocks: int
    eos_token_id: Optional[int]  # None: the model has no EOS (simulated executor)

    def execute(self, plan: StepPlan) -> ExecutorOutput:
        """Copy blocks, write K/V, run attention over the chunks, sample where sample=True."""
        ...
