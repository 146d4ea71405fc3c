"""A fake executor for engine and scheduler tests: no torch, deterministic, and strict.

`FakeExecutor` samples token `f(request_id, position)` (so recompute after preemption, or a
prefix-cache hit, must reproduce exactly the same output), and it keeps a pretend KV cache:
every computed position writes its token id into the slot its block table names, and every
chunk checks that the whole context before it reads back as the request's own tokens. A
wrong block table, a prefix-cache hit on the wrong block, a block shared while written, or a
chunk that skips or repeats positions fails loudly.
"""

from __future__ import annotations

import zlib
from typing import Callable, Optional

from tokenlane.runtime.plan import ExecutorOutput, StepPlan


def fake_token(request_id: str, position: int, vocab_size: int) -> int:
    return zlib.crc32(f"{request_id}:{position}".encode()) % vocab_size


class FakeExecutor:
    """Implements the Executor protocol; `step_seconds` may be a function of the plan."""

    def __init__(
        self,
        num_kv_blocks: int = 64,
        block_size: int = 4,
        *,
        vocab_size: int = 1000,
        eos_token_id: Optional[int] = None,
        max_model_len: Optional[int] = 4096,
        step_seconds: float | Callable[[StepPlan], float] = 0.01,
        check_kv: bool = True,
        token_fn: Optional[Callable[[str, int], int]] = None,
    ) -> None:
        self.num_kv_blocks = num_kv_blocks
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.max_model_len = max_model_len
        self.step_seconds = step_seconds
        self.check_kv = check_kv
        self.token_fn = token_fn or (lambda rid, pos: fake_token(rid, pos, vocab_size))
        self.slots: list[Optional[int]] = [None] * (num_kv_blocks * block_size)
        self.plans: list[StepPlan] = []
        self.dropped: set[str] = set()  # request ids the executor was told had finished
        self.fail_next: Optional[Exception] = None  # raise this from the next execute()

    def execute(self, plan: StepPlan) -> ExecutorOutput:
        if self.fail_next is not None:
            exc, self.fail_next = self.fail_next, None
            raise exc
        self.plans.append(plan)
        for request in plan.finished:
            self.dropped.add(request.request_id)
        for src, dst in plan.block_copies:
            bs = self.block_size
            self.slots[dst * bs : (dst + 1) * bs] = self.slots[src * bs : (src + 1) * bs]
        output = ExecutorOutput()
        written: set[int] = set()
        for chunk in plan.chunks:
            request = chunk.request
            end = chunk.start + chunk.num_tokens
            assert chunk.num_tokens >= 1
            assert chunk.start == request.num_computed_tokens, (request.request_id, chunk.start)
            assert end <= request.num_tokens
            assert len(request.block_ids) * self.block_size >= end, "block table too short"
            assert chunk.sample == (end == request.num_tokens)
            if self.check_kv:
                self._write_and_check(request, chunk.start, end, written)
            if chunk.sample:
                output.sampled[request.request_id] = self.token_fn(request.request_id, end)
        step = self.step_seconds
        output.step_seconds = step(plan) if callable(step) else step
        return output

    def _write_and_check(self, request, start: int, end: int, written: set[int]) -> None:
        bs = self.block_size
        tokens = request.all_token_ids
        table = request.block_ids
        for pos in range(start, end):
            slot = table[pos // bs] * bs + pos % bs
            assert slot not in written, f"slot {slot} written twice in one step"
            written.add(slot)
            self.slots[slot] = tokens[pos]
        for pos in range(end):  # the whole context must read back as this request's tokens
            slot = table[pos // bs] * bs + pos % bs
            assert self.slots[slot] == tokens[pos], (
                f"{request.request_id}: KV of position {pos} holds {self.slots[slot]}, "
                f"expected {tokens[pos]}"
            )


def make_config(
    *,
    lanes: Optional[list[dict]] = None,
    block_size: int = 4,
    continuous_batching: bool = True,
    prefix_caching: bool = True,
    max_model_len: int = 4096,
    **scheduler: object,
):
    """A RuntimeConfig for tests: scheduler keys in snake_case, lanes as camelCase dicts.
    Small defaults: 32 tokens per step, chunks of 16, 8 sequences."""
    scheduler.setdefault("max_batched_tokens", 32)
    mbt = int(scheduler["max_batched_tokens"])  # type: ignore[call-overload]
    scheduler.setdefault("prefill_chunk_size", min(16, mbt))
    scheduler.setdefault("max_active_sequences", min(8, mbt))
    from tokenlane.runtime.config import (
        EngineConfig,
        ModelConfig,
        RuntimeConfig,
        SchedulerConfig,
        LaneConfig,
        _from_dict,
    )

    return RuntimeConfig(
        model=ModelConfig(path="/test-model", max_model_len=max_model_len),
        engine=EngineConfig(
            block_size=block_size,
            continuous_batching=continuous_batching,
            enable_prefix_caching=prefix_caching,
        ),
        scheduler=SchedulerConfig(**scheduler),  # type: ignore[arg-type]
        lanes=[_from_dict(LaneConfig, lane, "lanes") for lane in (lanes or [])],
    )
