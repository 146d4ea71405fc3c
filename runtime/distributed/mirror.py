"""A step's plan as diffs (rank 0), and the workers' mirror requests rebuilt from them.

`PlanEncoder` remembers what the workers know of each request (its block table, how many of
its output tokens) and turns a `StepPlan` into a `StepMessage` of what changed. `RequestMirrors`
applies a message to a worker's `Request` objects and hands back an equivalent `StepPlan`:
the same chunks in the same order, each request with the same id, prompt, output tokens, block
table, computed tokens, sampling parameters and adapter, so `ModelExecutor.execute` runs on it
unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenlane.runtime.core.request import Request, RequestStatus
from tokenlane.runtime.core.step_plan import ScheduledChunk, StepPlan
from tokenlane.runtime.distributed.messages import ChunkUpdate, NewRequest, StepMessage


@dataclass
class _Known:
    blocks: list[int] = field(default_factory=list)
    outputs: int = 0


class PlanEncoder:
    """Rank 0's side: what the workers' mirrors hold, and the diffs that bring them up to date."""

    def __init__(self) -> None:
        self.known: dict[str, _Known] = {}
        self.steps = 0

    def encode(self, plan: StepPlan) -> StepMessage:
        known = self.known
        preempted = []
        for request in plan.preempted:
            k = known.get(request.request_id)
            if k is not None:
                k.blocks = []
                preempted.append(request.request_id)
        new_requests = []
        chunks = []
        for chunk in plan.chunks:
            request = chunk.request
            rid = request.request_id
            k = known.get(rid)
            if k is None:
                k = known[rid] = _Known()
                new_requests.append(NewRequest(rid, tuple(request.prompt_token_ids), request.sampling_params,
                                               request.adapter, request.eos_token_id))
            blocks, have = request.block_ids, k.blocks
            n = len(have)
            if len(blocks) >= n and blocks[:n] == have:
                added, replace = tuple(blocks[n:]), False
                have.extend(added)
            else:  # a copy on write replaced a block, or the table shrank
                added, replace = tuple(blocks), True
                k.blocks = list(blocks)
            outputs = request.output_token_ids
            new_outputs = tuple(outputs[k.outputs:])
            k.outputs = len(outputs)
            chunks.append(ChunkUpdate(
                rid, chunk.start, chunk.num_tokens, chunk.sample, added, replace, new_outputs,
                len(request.prompt_logprobs) if request.sampling_params.prompt_logprobs is not None else 0,
            ))
        finished = tuple(r.request_id for r in plan.finished if known.pop(r.request_id, None) is not None)
        self.steps += 1
        return StepMessage(
            step=self.steps,
            new_requests=tuple(new_requests),
            chunks=tuple(chunks),
            preempted=tuple(preempted),
            finished=finished,
            block_copies=tuple(plan.block_copies),
            kv_offloads=tuple(plan.kv_offloads),
            kv_restores=tuple(plan.kv_restores),
        )


class RequestMirrors:
    """A worker's side: its mirror of every request rank 0 has sent and not yet finished."""

    def __init__(self) -> None:
        self.requests: dict[str, Request] = {}

    def __len__(self) -> int:
        return len(self.requests)

    def apply(self, message: StepMessage) -> StepPlan:
        mirrors = self.requests
        for new in message.new_requests:
            mirrors[new.request_id] = Request(
                new.request_id, list(new.prompt_token_ids), new.sampling_params, adapter=new.adapter,
                eos_token_id=new.eos_token_id, status=RequestStatus.RUNNING,
            )
        preempted = []
        for rid in message.preempted:
            request = mirrors[rid]
            request.block_ids = []
            request.num_computed_tokens = 0
            preempted.append(request)
        chunks = []
        tokens = 0
        for update in message.chunks:
            request = mirrors[update.request_id]
            if update.replace_blocks:
                request.block_ids = list(update.block_ids)
            else:
                request.block_ids.extend(update.block_ids)
            if update.new_output_tokens:
                request.output_token_ids.extend(update.new_output_tokens)
            if len(request.prompt_logprobs) != update.num_prompt_logprobs:
                request.prompt_logprobs = [None] * update.num_prompt_logprobs
            request.num_computed_tokens = update.start
            chunks.append(ScheduledChunk(request, update.start, update.num_tokens, update.sample))
            tokens += update.num_tokens
        finished = [mirrors.pop(rid) for rid in message.finished if rid in mirrors]
        return StepPlan(
            chunks=chunks,
            preempted=preempted,
            finished=finished,
            num_batched_tokens=tokens,
            block_copies=list(message.block_copies),
            kv_offloads=list(message.kv_offloads),
            kv_restores=list(message.kv_restores),
        )
