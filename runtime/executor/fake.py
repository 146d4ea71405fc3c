"""A fake executor for engine and scheduler tests: no torch, deterministic, and strict.

`FakeExecutor` samples token `f(request_id, position)` (so recompute after preemption, or a
prefix-cache hit, must reproduce exactly the same output), and it keeps a pretend KV cache:
every computed position writes its token id into the slot its block table names, and every
chunk checks that the whole context before it reads back as the request's own tokens. A
wrong block table, a prefix-cache hit on the wrong block, a block shared while written, or a
chunk that skips or repeats positions fails loudly. With `num_host_kv_blocks` it keeps a
pretend host tier too: the plan's kv_offloads copy a block's slots out, its kv_restores copy
them back (offloads first, as the model executor does), so a restore of the wrong block fails
the same check.

It returns logprobs too (`fake_logprob(position, token)`), and checks that a request that
asks for prompt logprobs never starts a chunk past a prompt position whose logprob it does
not have yet (it must not have taken those positions from the prefix cache).

LoRA adapters: `add_adapter(name, folder)` validates a PEFT folder as the model executor does
for its files and config (`check_adapter_folder`: adapter_config.json readable, a LoRA, rank
<= maxLoraRank, target modules among q, k, v, o, gate, up, down, the weights file present)
and keeps no weights. Each KV slot remembers the adapter it was computed with, so KV shared
across adapters fails the same check, and a step with more than `max_loras` distinct adapters
fails loudly.

`StepGate` holds any executor's steps on demand (server tests use it to keep a request
running, or queued, for as long as an assertion needs).
"""

from __future__ import annotations

import json
import os
import threading
import zlib
from dataclasses import dataclass
from typing import Callable, Optional

from tokenlane.runtime.core.step_plan import ExecutorOutput, StepPlan
from tokenlane.runtime.core.request import TokenLogprob


def fake_token(request_id: str, position: int, vocab_size: int) -> int:
    return zlib.crc32(f"{request_id}:{position}".encode()) % vocab_size


def fake_logprob(position: int, token: int) -> TokenLogprob:
    """The fake logprob of `token` at `position` (a function of both only, so a
    recomputation or another batch gives the same value)."""
    return TokenLogprob(token, -(zlib.crc32(f"{position}:{token}".encode()) % 1000) / 100.0, 1, ())


# PEFT module names -> the short names engine.maxLoraRank's docs use.
_PEFT_MODULES = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o", "gate_proj": "gate",
                 "up_proj": "up", "down_proj": "down"}


@dataclass(frozen=True)
class AdapterInfo:
    name: str
    rank: int
    target_modules: tuple[str, ...]
    bytes: int


def check_adapter_folder(name: str, folder: str, max_rank: int) -> AdapterInfo:
    """The checks of a PEFT LoRA folder that need no model: ValueError naming the adapter."""
    config_path = os.path.join(folder, "adapter_config.json")
    weights = os.path.join(folder, "adapter_model.safetensors")
    if not os.path.isdir(folder):
        raise ValueError(f"adapter {name!r}: {folder} is not a folder")
    try:
        with open(config_path, encoding="utf-8") as f:
            adapter_config = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"adapter {name!r}: cannot read {config_path}: {exc}") from None
    if not isinstance(adapter_config, dict) or adapter_config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"adapter {name!r}: {config_path} does not describe a LoRA adapter")
    rank = adapter_config.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"adapter {name!r}: rank r={rank!r} in {config_path} is not a positive integer")
    if rank > max_rank:
        raise ValueError(f"adapter {name!r}: rank {rank} exceeds engine.maxLoraRank ({max_rank})")
    modules = adapter_config.get("target_modules") or []
    if isinstance(modules, str):
        modules = [modules]
    short = []
    for module in modules:
        key = _PEFT_MODULES.get(str(module).rsplit(".", 1)[-1])
        if key is None:
            raise ValueError(f"adapter {name!r}: target module {module!r} is not one of "
                             f"{sorted(_PEFT_MODULES)}")
        short.append(key)
    if not os.path.isfile(weights):
        raise ValueError(f"adapter {name!r}: {weights} is missing")
    return AdapterInfo(name, rank, tuple(short), os.path.getsize(weights))


class FakeExecutor:
    """Implements the Executor protocol; `step_seconds` may be a function of the plan."""

    supports_logprobs = True

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
        num_host_kv_blocks: int = 0,
        max_loras: int = 8,
        max_lora_rank: int = 64,
    ) -> None:
        self.num_kv_blocks = num_kv_blocks
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.adapters: dict[str, AdapterInfo] = {}
        self.max_adapters_in_a_step = 0
        self.unloaded_adapter_used = False
        self.num_host_kv_blocks = num_host_kv_blocks
        self.host_slots: list[list[Optional[int]]] = [[None] * block_size for _ in range(num_host_kv_blocks)]
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.max_model_len = max_model_len
        self.step_seconds = step_seconds
        self.check_kv = check_kv
        self.token_fn = token_fn or (lambda rid, pos: fake_token(rid, pos, vocab_size))
        # Each slot holds (adapter, token id) of the position computed into it.
        self.slots: list[Optional[tuple]] = [None] * (num_kv_blocks * block_size)
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
        bs = self.block_size
        for block, slot in plan.kv_offloads:
            self.host_slots[slot] = self.slots[block * bs : (block + 1) * bs]
        for slot, block in plan.kv_restores:
            self.slots[block * bs : (block + 1) * bs] = self.host_slots[slot]
        for src, dst in plan.block_copies:
            self.slots[dst * bs : (dst + 1) * bs] = self.slots[src * bs : (src + 1) * bs]
        output = ExecutorOutput()
        written: set[int] = set()
        step_adapters = {c.request.adapter for c in plan.chunks if c.request.adapter is not None}
        # Recorded before the checks: the engine re-runs a failed step in halves, which would pass.
        self.max_adapters_in_a_step = max(self.max_adapters_in_a_step, len(step_adapters))
        missing = step_adapters - set(self.adapters)
        self.unloaded_adapter_used = self.unloaded_adapter_used or bool(missing)
        assert len(step_adapters) <= self.max_loras, f"{len(step_adapters)} adapters in one step: {step_adapters}"
        assert not missing, f"step uses adapters that are not loaded: {missing}"
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
            params = request.sampling_params
            if params.prompt_logprobs is not None:
                self._prompt_logprobs(request, chunk.start, end, output)
            if chunk.sample:
                token = self.token_fn(request.request_id, end)
                output.sampled[request.request_id] = token
                if params.logprobs is not None:
                    output.logprobs[request.request_id] = fake_logprob(end, token)
        step = self.step_seconds
        output.step_seconds = step(plan) if callable(step) else step
        return output

    @staticmethod
    def _prompt_logprobs(request, start: int, end: int, output: ExecutorOutput) -> None:
        prompt = request.prompt_token_ids
        known = len(request.prompt_logprobs)
        # Scoring prompt token start + 1 needs every token before it scored (or this chunk
        # to start at 0): a chunk further on skipped positions whose logits were needed.
        assert start == 0 or known >= min(start + 1, len(prompt)), (
            f"{request.request_id}: chunk at {start} but only {known} prompt logprobs known"
        )
        lo = max(start, known - 1)
        hi = min(end, len(prompt) - 1)
        if hi > lo:
            entries = [fake_logprob(p, prompt[p + 1]) for p in range(lo, hi)]
            output.prompt_logprobs[request.request_id] = (lo + 1, entries)

    def _write_and_check(self, request, start: int, end: int, written: set[int]) -> None:
        bs = self.block_size
        tokens = request.all_token_ids
        table = request.block_ids
        adapter = request.adapter
        for pos in range(start, end):
            slot = table[pos // bs] * bs + pos % bs
            assert slot not in written, f"slot {slot} written twice in one step"
            written.add(slot)
            self.slots[slot] = (adapter, tokens[pos])
        for pos in range(end):  # the whole context must read back as this request's tokens
            slot = table[pos // bs] * bs + pos % bs
            assert self.slots[slot] == (adapter, tokens[pos]), (
                f"{request.request_id}: KV of position {pos} holds {self.slots[slot]}, "
                f"expected {(adapter, tokens[pos])}"
            )

    # ---- LoRA adapters (no weights: the folder is checked, nothing is kept)

    def add_adapter(self, name: str, folder: str) -> AdapterInfo:
        if name in self.adapters:
            raise ValueError(f"adapter {name!r} is already loaded")
        info = check_adapter_folder(name, folder, self.max_lora_rank)
        self.adapters[name] = info
        return info

    def remove_adapter(self, name: str) -> None:
        del self.adapters[name]

    def adapter_names(self) -> list[str]:
        return list(self.adapters)


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


class StepGate:
    """Holds an executor's steps on demand, so a test can keep requests exactly where they
    are (running, queued, holding KV blocks) for as long as it needs, without racing the
    model's speed. While the gate is closed, the step in flight waits in the engine's step
    thread before it computes; the asyncio front keeps serving (admission, metrics, aborts
    are staged for the next step boundary).

        with StepGate(engine.executor) as gate:
            gate.pause_when(lambda plan: ...)  # close before the first step that matches
            ...                                # drive requests
            gate.wait_paused()                 # a step is now held
            ...                                # assert on the frozen state
        # leaving the block opens the gate and puts the executor's execute back
    """

    def __init__(self, executor) -> None:
        self.executor = executor
        self._execute = executor.execute
        self._open = threading.Event()
        self._open.set()
        self._held = threading.Event()  # a step is waiting at the closed gate
        self._lock = threading.Lock()
        self._condition: Optional[Callable[[StepPlan], bool]] = None

    def __enter__(self) -> "StepGate":
        self.executor.execute = self._gated_execute
        return self

    def __exit__(self, *exc_info) -> None:
        self.executor.execute = self._execute
        with self._lock:
            self._condition = None
        self.resume()

    def pause(self) -> None:
        """Hold the next step (and every later one) until resume()."""
        self._open.clear()

    def pause_when(self, condition: Callable[[StepPlan], bool]) -> None:
        """Hold the first step whose plan satisfies `condition` (checked in the step thread,
        after scheduling, before computing), and every later one until resume()."""
        with self._lock:
            self._condition = condition

    def resume(self) -> None:
        """Let the held step (and the following ones) run; a pause_when condition set before
        stays armed."""
        with self._lock:
            self._held.clear()
            self._open.set()

    def wait_paused(self, timeout_s: float = 60.0) -> None:
        """Return once a step is held at the gate (AssertionError after `timeout_s`, a bound
        for a broken test, not a timing assumption)."""
        assert self._held.wait(timeout_s), "no step reached the closed gate"

    def _gated_execute(self, plan: StepPlan) -> ExecutorOutput:
        with self._lock:
            if self._condition is not None and self._condition(plan):
                self._condition = None
                self._open.clear()
            held = not self._open.is_set()
            if held:
                self._held.set()  # cleared by resume()
        if held:
            self._open.wait()
        return self._execute(plan)
