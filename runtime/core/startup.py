"""The phases of a start-up, from process start to ready, as the start-up log states them.

Each phase is measured where it happens (the server: import, config and serve; the engine:
tokenizer; the executor: load, kv and warm-up) and logged as one `startup: NAME 0.12s
(what it did)` line; once the server answers, one summary line lists them all:

    startup: ready in 3.21s: import 1.62s config 0.00s tokenizer 1.05s load 0.03s kv 0.01s warmup 0.00s serve 0.38s

`parse_summary` reads that line back (the cold-start benchmark uses it). Plain Python.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Iterable, Optional

# In start-up order; a phase that did not run is absent (`engine`: what the engine's own
# phases leave of its start, e.g. an engine core process's spawn and imports).
PHASES = ("import", "config", "tokenizer", "load", "kv", "warmup", "engine", "serve")

SUMMARY_PREFIX = "startup: ready in "
_SUMMARY = re.compile(r"startup: ready in (?P<total>\d+(?:\.\d+)?)s:(?P<phases>(?: [a-z_-]+ \d+(?:\.\d+)?s)*)")
_PHASE = re.compile(r" ([a-z_-]+) (\d+(?:\.\d+)?)s")


@dataclasses.dataclass(frozen=True)
class StartupPhase:
    name: str
    seconds: float
    detail: str = ""  # what the phase did: bytes, blocks, what the warm-up ran

    def log_line(self) -> str:
        return f"startup: {self.name} {self.seconds:.2f}s" + (f" ({self.detail})" if self.detail else "")


def summary_line(total_s: float, phases: Iterable[StartupPhase]) -> str:
    """The one greppable line: the total to ready, then each phase's seconds in order."""
    return SUMMARY_PREFIX + f"{total_s:.2f}s:" + "".join(f" {p.name} {p.seconds:.2f}s" for p in phases)


def parse_summary(text: str) -> Optional[tuple[float, dict[str, float]]]:
    """(total seconds, {phase: seconds}) of the last summary line in `text`, or None."""
    found = None
    for match in _SUMMARY.finditer(text):
        found = match
    if found is None:
        return None
    return float(found["total"]), {name: float(s) for name, s in _PHASE.findall(found["phases"])}


__all__ = ["PHASES", "StartupPhase", "parse_summary", "summary_line"]
