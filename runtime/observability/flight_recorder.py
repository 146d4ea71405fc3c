"""The step flight recorder: the last N engine steps in memory, for post-incident reviews.

An `EngineObserver` that keeps every step's `StepStats` (the engine builds a fresh one each
step, so keeping a reference costs no copy), with the wall time, a step id, the refusals and
other final statuses since the previous step, and the hash of the config in force, in a
`deque(maxlen=N)`. Nothing is encoded per step: entries become dicts only when read
(`GET /debug/steps`, a SIGUSR1 dump). See docs/operations.md, "Flight recorder".
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

from tokenlane.runtime.config import RuntimeConfig
from tokenlane.runtime.observability.metrics import reason_label
from tokenlane.runtime.core.request import FinishReason, Request
from tokenlane.runtime.core.stats import StepStats

log = logging.getLogger("tokenlane.flight_recorder")

DEFAULT_CAPACITY = 4096
# A `since` below this is a step id; at or above it, a unix time in seconds (2001-09-09 on):
# a server running 100 steps a second reaches 10**9 steps after about 4 months.
SINCE_TIME_THRESHOLD = 1e9
UNKNOWN_LANE = "unknown"


def default_dump_dir() -> Path:
    return Path(tempfile.gettempdir()) / "tokenlane-dumps"


def config_hash(config: RuntimeConfig) -> str:
    """Hash of the whole config in force (hot-reloadable fields included), 16 hex digits."""
    canonical = json.dumps(config.to_dict(), sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


class _ConfigFacts:
    """What every entry records about the config in force; built once per config."""

    __slots__ = ("hash", "restart_hash", "high_watermark", "reject_watermark", "lanes")

    def __init__(self, config: Optional[RuntimeConfig]) -> None:
        if config is None:
            self.hash = self.restart_hash = ""
            self.high_watermark = self.reject_watermark = None
            self.lanes: frozenset[str] = frozenset()
            return
        self.hash = config_hash(config)
        self.restart_hash = config.restart_hash()
        self.high_watermark = config.scheduler.kv_cache_high_watermark
        self.reject_watermark = config.scheduler.kv_cache_reject_watermark
        self.lanes = frozenset(lane.name for lane in config.lanes)


class FlightRecorder:
    """Implements `EngineObserver`. `on_step` runs in the engine's step thread,
    `on_request_finished` also on the event loop (refusals): the small lock keeps the
    per-step event counts and the ring consistent between them and the readers."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY, config: Optional[RuntimeConfig] = None,
                 wall_clock: Callable[[], float] = time.time) -> None:
        if capacity < 1:
            raise ValueError(f"flight recorder capacity must be at least 1 step, got {capacity}")
        self.capacity = capacity
        self.wall_clock = wall_clock
        self._ring: deque[tuple] = deque(maxlen=capacity)
        self._lock = threading.Lock()
        self._next_step = 1
        # (lane, reason) -> count, since the previous step.
        self._refusals: dict[tuple[str, str], int] = {}
        self._finished: dict[tuple[str, str], int] = {}
        self._config = _ConfigFacts(config)

    # ---- EngineObserver

    def set_config(self, config: RuntimeConfig) -> None:
        self._config = _ConfigFacts(config)

    def on_config_applied(self, config: object, ok: bool, message: str) -> None:
        if ok and isinstance(config, RuntimeConfig):
            self.set_config(config)

    def on_request_finished(self, request: Request) -> None:
        lane = request.lane if request.lane in self._config.lanes else UNKNOWN_LANE
        key = (lane, reason_label(request))
        refused = request.finish_reason == FinishReason.REJECTED
        with self._lock:  # picks the dict under the lock: on_step may just have swapped it
            counts = self._refusals if refused else self._finished
            counts[key] = counts.get(key, 0) + 1

    def on_step(self, stats: StepStats) -> None:
        now = self.wall_clock()
        with self._lock:
            refusals, finished = self._refusals, self._finished
            if refusals:
                self._refusals = {}
            if finished:
                self._finished = {}
            self._ring.append((self._next_step, now, stats, refusals or None, finished or None, self._config))
            self._next_step += 1

    # ---- reading

    def __len__(self) -> int:
        return len(self._ring)

    @property
    def last_step(self) -> int:
        """The id of the newest recorded step (0 before the first)."""
        return self._next_step - 1

    def entries(self, since: Optional[float] = None) -> list[dict[str, Any]]:
        """The recorded steps, oldest first, as dicts; with `since`, only the steps after that
        step id (below SINCE_TIME_THRESHOLD) or recorded after that unix time."""
        with self._lock:
            rows = list(self._ring)
        if since is not None:
            position = 1 if since >= SINCE_TIME_THRESHOLD else 0  # wall time, or step id
            rows = [row for row in rows if row[position] > since]
        return [_entry(row) for row in rows]

    def jsonl(self, since: Optional[float] = None) -> str:
        """`entries(since)` as JSON Lines (one step a line, newline-terminated)."""
        return "".join(json.dumps(entry, separators=(",", ":")) + "\n" for entry in self.entries(since))


def parse_since(value: Optional[str]) -> Optional[float]:
    """The `since` query parameter: a step id or a unix time; ValueError with the rule."""
    if value is None or value == "":
        return None
    try:
        since = float(value)
    except ValueError:
        raise ValueError(f"since must be a step id or a unix time in seconds, got {value!r}") from None
    if since != since or since < 0 or since == float("inf"):
        raise ValueError(f"since must be a non-negative number, got {value!r}")
    return since


def _nested(counts: Optional[dict[tuple[str, str], int]]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for (lane, reason), count in (counts or {}).items():
        out.setdefault(lane, {})[reason] = count
    return out


def _entry(row: tuple) -> dict[str, Any]:
    step, wall, stats, refusals, finished, config = row
    used = stats.kv_blocks_total - stats.kv_blocks_free
    return {
        "step": step,
        "time": wall,
        "duration_s": stats.step_seconds + stats.schedule_seconds,
        "execute_s": stats.step_seconds,
        "schedule_s": stats.schedule_seconds,
        "batched_tokens": stats.num_batched_tokens,
        "prefill_tokens": stats.num_prefill_tokens,
        "decode_tokens": stats.num_decode_tokens,
        "preemptions": stats.num_preemptions,
        "oom_events": stats.oom_events,
        "lanes": {
            name: {
                "prefill_tokens": lane.prefill_tokens,
                "decode_tokens": lane.decode_tokens,
                "running": lane.running,
                "waiting": lane.waiting,
                "queued": lane.queued,
                "started": lane.started,
                "preempted": lane.preempted,
            }
            for name, lane in stats.lanes.items()
        },
        "kv": {
            "blocks_used": used,
            "blocks_free": stats.kv_blocks_free,
            "blocks_cached_free": stats.kv_blocks_cached_free,  # free, still holding a cached prefix
            "blocks_reserved": stats.kv_blocks_reserved,  # free, held back for lanes' unmet reserves
            "blocks_total": stats.kv_blocks_total,
            "releases": len(stats.kv_releases),
            "release_max_s": max((seconds for _, seconds in stats.kv_releases), default=0.0),
            "usage": stats.kv_usage,
            "high_watermark": config.high_watermark,
            "reject_watermark": config.reject_watermark,
        },
        "prefix_cache": {"queried_tokens": stats.prefix_cache_queries, "hit_tokens": stats.prefix_cache_hits,
                         "host_hit_tokens": stats.prefix_cache_host_hits},
        # The host tier (engine.kvOffload): blocks copied out and back in this step.
        "kv_host": {"offloaded_blocks": stats.kv_blocks_offloaded, "restored_blocks": stats.kv_blocks_restored,
                    "restore_s": stats.kv_restore_seconds, "blocks_used": stats.kv_host_blocks_used,
                    "blocks_total": stats.kv_host_blocks_total},
        "refusals": _nested(refusals),
        "finished": _nested(finished),
        "config_hash": config.hash,
        "restart_hash": config.restart_hash,
    }


# --------------------------------------------------------------------------- dumps


def write_dump(directory: Path, *, steps: Iterable[dict[str, Any]], metrics_text: str, config_text: str,
               reason: str, wall_clock: Callable[[], float] = time.time) -> Path:
    """Write one JSON file {reason, time, pid, steps, metrics, config} under `directory`
    (created if missing) and return its path. Written to a temporary name, then renamed, so
    a reader never sees half a file. OSError if it cannot be written."""
    now = wall_clock()
    directory.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(now)) + f"{now % 1:.3f}"[1:] + "Z"
    path = directory / f"tokenlane-dump-{stamp}-{os.getpid()}.json"
    partial = path.with_name(path.name + ".partial")
    try:
        text = dump_document_json(reason=reason, time=now, pid=os.getpid(), steps=steps,
                                  metrics=metrics_text, config=config_text)
        with open(partial, "w") as f:
            f.write(text)
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    return path



def dump_document_json(*, reason: str, time: float, pid: int, steps: Iterable[dict[str, Any]],
                       metrics: str, config: str) -> str:
    """The dump file's text: `json.dumps` of {reason, time, pid, steps, metrics, config} with
    compact separators, encoded one step at a time. json.dumps runs the C encoder (json.dump
    streams through the pure-Python one, 4-5x slower: a full ring took over 4 s beside a busy
    step thread, past the operator's timeout), but one call over the whole ring holds the GIL
    for its 0.3-1 s, and every stream of the server pauses that long; between two steps'
    calls the interpreter can switch threads."""
    def encode(value: Any) -> str:
        return json.dumps(value, separators=(",", ":"))

    fields = [("reason", encode(reason)), ("time", encode(time)), ("pid", encode(pid)),
              ("steps", "[" + ",".join(encode(step) for step in steps) + "]"),
              ("metrics", encode(metrics)), ("config", encode(config))]
    return "{" + ",".join(f"{encode(key)}:{value}" for key, value in fields) + "}"


def read_steps(path: str | Path) -> list[dict[str, Any]]:
    """The steps of a `GET /debug/steps` JSON Lines file or of a dump file; ValueError if the
    file is neither."""
    text = Path(path).read_text()
    try:
        document = json.loads(text)
    except json.JSONDecodeError:
        document = None  # several lines: JSON Lines
    if isinstance(document, dict):
        steps = document["steps"] if "steps" in document else [document]
    else:
        try:
            steps = [json.loads(line) for line in text.splitlines() if line.strip()]
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: neither a flight recorder dump nor JSON Lines of steps ({exc})") from None
    if not all(isinstance(step, dict) and "step" in step and "lanes" in step for step in steps):
        raise ValueError(f"{path}: not flight recorder steps (each needs 'step' and 'lanes')")
    return steps
