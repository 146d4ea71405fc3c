"""Hot reload of `runtime.yaml`: watch the file, hand valid changes to the engine.

A Kubernetes ConfigMap volume changes by an atomic symlink swap (`..data` -> a new
timestamped folder), so the watched path's own mtime may never change, and an editor may
rewrite a file in place within one timestamp tick. So we poll the content itself: each tick
reads the file (through the symlinks) and hashes it (a config is a few KB). A new content is
judged once it read the same on two consecutive ticks (a file caught half-written by a
non-atomic writer is not judged):

- valid, only reloadable sections (scheduler, lanes, tenants, model.adapters) changed -> the engine applies
  it at its next step boundary; `config_reloads_total{result="success"}` and a log line;
- not parseable / fails validation -> a log line with the ConfigError message,
  `{result="invalid"}`; the last good config stays in force;
- model or engine fields changed (the engine refuses it with RestartRequired) -> refused,
  "need a restart", `{result="restart_required"}`;
- the engine refuses it for another reason -> `{result="error"}`; among them a LoRA adapter of
  `model.adapters` that cannot be loaded (the message names it; none of the reload applies,
  the adapters in force stay: docs/lora.md).

Each distinct content is judged once (a bad file is not re-logged every tick). Polling works
on every filesystem; kubelet itself updates ConfigMap volumes only about once a minute.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
from pathlib import Path
from typing import Callable, Optional, Protocol

from tokenlane.runtime.config import ConfigError, RuntimeConfig, loads_config
from tokenlane.runtime.engine.llm_engine import RestartRequired

log = logging.getLogger("tokenlane.config")


class Reloadable(Protocol):
    def reload_config(self, new: RuntimeConfig) -> None:
        """Stage `new`, or raise RestartRequired / ValueError."""


class ReloadRecorder(Protocol):
    """Counts reload results. The config's own gauges are the engine observers' business:
    they are set when the engine applies the config at its step boundary."""

    def record_config_reload(self, result: str) -> None: ...


class ConfigWatcher:
    """Polls one config file and reloads the engine on valid changes."""

    def __init__(
        self,
        path: str | os.PathLike,
        current: RuntimeConfig,
        target: Reloadable,
        *,
        recorder: Optional[ReloadRecorder] = None,
        transform: Callable[[RuntimeConfig], RuntimeConfig] = lambda c: c,
        interval_s: float = 1.0,
    ) -> None:
        """`current` is the config in force (after `transform`); `transform` re-applies the
        command-line overrides to each new file version before it is compared and applied."""
        self.path = Path(path)
        self.config = current  # last good config (as handed to the engine)
        self.target = target
        self.recorder = recorder
        self.transform = transform
        self.interval_s = interval_s
        self._content_hash = self._hash_file()  # of the version last judged (or loaded)
        self._settling: Optional[str] = None  # a new content seen once, not yet judged
        self._missing = False
        self._task: Optional[asyncio.Task] = None
        self.last_result: Optional[str] = None
        self.last_message: str = ""

    def _hash_file(self) -> Optional[str]:
        try:
            return hashlib.sha256(self.path.read_bytes()).hexdigest()
        except OSError:
            return None

    # ---- one check (synchronous, testable)

    def check(self) -> Optional[str]:
        """Look at the file once; returns the result label when a new content was judged."""
        try:
            data = self.path.read_bytes()
        except OSError as exc:
            if not self._missing:
                log.warning("config file %s unreadable (%s); keeping the config in force", self.path, exc)
                self._missing = True
            return None
        self._missing = False
        content_hash = hashlib.sha256(data).hexdigest()
        if content_hash == self._content_hash:
            self._settling = None
            return None
        if content_hash != self._settling:  # new since the last tick: judge it if it stays
            self._settling = content_hash
            return None
        self._content_hash, self._settling = content_hash, None
        return self._judge(data.decode("utf-8", errors="replace"))

    def _judge(self, text: str) -> str:
        try:
            new = self.transform(loads_config(text))
        except ConfigError as exc:
            return self._done("invalid", f"config reload refused: {exc}; keeping the last good config")
        try:
            self.target.reload_config(new)  # the engine decides what needs a restart
        except RestartRequired as exc:
            return self._done("restart_required", f"config reload refused: {exc}; keeping the last good config")
        except ValueError as exc:
            return self._done("error", f"config reload refused by the engine: {exc}")
        self.config = new
        return self._done("success", f"config reloaded from {self.path}; applied at the next step")

    def _done(self, result: str, message: str) -> str:
        (log.info if result == "success" else log.error)(message)
        self.last_result, self.last_message = result, message
        if self.recorder is not None:
            self.recorder.record_config_reload(result)
        return result

    # ---- background polling

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="config-watch")

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                self.check()
            except Exception:  # never let a watcher bug take the server down
                log.exception("config watcher check failed")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
