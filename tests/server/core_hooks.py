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

