"""What rank 0 sends the other ranks: one message per step (or per adapter change, or stop).

Typed and versioned. A step's message carries diffs, as vLLM's SchedulerOutput does: a request
travels whole once (`NewRequest`: prompt, sampling parameters with any grammar, adapter), then
each step only what the workers' mirror of it lacks (`ChunkUpdate`: the chunk, the block ids
added to its table or the whole table when it changed otherwise, the output tokens sampled
since). Every rank of a group runs the same build, so a version mismatch is a deployment error
the worker refuses at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from tokenlane.runtime.core.request import SamplingParams

WIRE_VERSION = 1


@dataclass(frozen=True)
class NewRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling_params: SamplingParams
    adapter: Optional[str]
    eos_token_id: Optional[int]


@dataclass(frozen=True)
class ChunkUpdate:
    request_id: str
    start: int
    num_tokens: int
    sample: bool
    # Block ids appended to the mirror's table, or (replace_blocks) its whole new table.
    block_ids: tuple[int, ...]
    replace_blocks: bool
    # Output tokens the mirror lacks (sampled since the request's previous chunk).
    new_output_tokens: tuple[int, ...]
    # Prompt logprobs already recorded (requests asking for them): the executor scores only
    # the positions past them.
    num_prompt_logprobs: int = 0


@dataclass(frozen=True)
class StepMessage:
    step: int
    new_requests: tuple[NewRequest, ...]
    chunks: tuple[ChunkUpdate, ...]
    preempted: tuple[str, ...]  # mirrors whose blocks were freed (applied before the chunks)
    finished: tuple[str, ...]  # mirrors to drop
    block_copies: tuple[tuple[int, int], ...]
    kv_offloads: tuple[tuple[int, int], ...]
    kv_restores: tuple[tuple[int, int], ...]
    version: int = WIRE_VERSION


@dataclass(frozen=True)
class AdapterCommand:
    """add: load a PEFT folder (every rank answers, see DistributedExecutor.add_adapter);
    remove: drop it; discard: drop it where loaded (undoing a partly failed add)."""

    op: str
    name: str
    folder: str = ""
    version: int = WIRE_VERSION


@dataclass(frozen=True)
class Stop:
    reason: str
    version: int = WIRE_VERSION
