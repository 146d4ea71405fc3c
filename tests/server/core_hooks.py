"""`on_start` hooks for an engine core process (engine.coreProcess) in tests. The core is a
spawned child: a hook must be a top-level function of an importable module (this one: the
server tests' folder is on sys.path, and a spawned child inherits sys.path), bound to its
arguments with functools.partial."""

from __future__ import annotations

import time
from pathlib import Path


def hold_from_step(gate_file: str, core) -> None:
    """The core's executor holds before step K while `gate_file` exists and holds the number
    K (steps counted from 1 in the core). Removing the file releases it. A test makes a
    stream stay open by construction, not by racing the model."""
    executor = core.engine.executor
    execute = executor.execute
    steps = 0

    def held_execute(plan):
        nonlocal steps
        steps += 1
        while True:
            try:
                hold_at = int(Path(gate_file).read_text() or 0)
            except (FileNotFoundError, ValueError):
                break
            if steps < hold_at:
                break
            time.sleep(0.01)
        return execute(plan)

    executor.execute = held_execute


def hold_decoding_until_aborted(gate_file: str, core) -> None:
    """While `gate_file` exists, a step that would give a sequence its second token waits
    until that sequence's abort is staged in the core (60 s bound). A sequence with its first
    token has its client's response headers out, so the client can leave; its disconnect
    then reaches the core before the core could finish the request, however fast or slow
    the machine is. Other sequences in the step wait with it, never for their own client."""
    engine = core.engine
    executor = engine.executor
    execute, abort_request = executor.execute, engine.abort_request
    aborted: set[str] = set()  # ids whose abort the core's command thread has staged

    def recorded_abort_request(request_id, *args):
        abort_request(request_id, *args)
        aborted.add(request_id)

    def held_execute(plan):
        if Path(gate_file).exists():
            decoding = {chunk.request.request_id for chunk in plan.chunks if chunk.request.num_output_tokens}
            deadline = time.monotonic() + 60
            while not decoding <= aborted and time.monotonic() < deadline:
                time.sleep(0.01)
        return execute(plan)

    engine.abort_request = recorded_abort_request
    executor.execute = held_execute
