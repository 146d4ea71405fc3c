"""Failing the group fast: heartbeats, and the watch rank 0 keeps over the other ranks.

Every worker rank bumps a counter in the leader's rendezvous store twice a second (a thread of
its own, so a long step does not stop it). Rank 0's watchdog thread looks at its local
children's exit status five times a second and at every worker's counter each second: a
child that exited, or a counter that stood still for HEARTBEAT_STALE_S (a hung or unreachable
rank), fails the group: one error line naming the rank, every local rank killed, and then, once
an in-flight step has ended its streams with an error, the process exits with status 1 (an
engine core process's exit fails the API's streams and /health the same way).

A worker whose store operation fails (the leader died, hung, or its node is gone) or whose
parent process is gone exits with status 1 itself: no rank outlives its group.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from datetime import timedelta
from typing import Callable, Optional

from tokenlane.runtime.distributed.launch import LocalRanks, describe_exit
from tokenlane.runtime.observability.process_exit import exit_now

log = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 0.5
HEARTBEAT_STALE_S = 4.0
# After a failure: how long rank 0 waits for an in-flight step to end its streams with the
# error, then how long it lets the server write them, before it exits.
STEP_GRACE_S = 2.0
FLUSH_GRACE_S = 1.0

_BEAT = "tokenlane/heartbeat/{}"


def end_now(code: int) -> None:
    """Exit at once, logs flushed, no exit functions and no interpreter teardown
    (runtime/observability/process_exit.py)."""
    exit_now(code, run_exit_functions=False)


class Heartbeat:
    """A worker's heartbeat thread: it also watches the leader (the store lives in rank 0's
    process) and its parent process (the node's first rank)."""

    def __init__(self, store, rank: int, parent_pid: Optional[int], on_lost: Callable[[str], None] = None) -> None:
        self.store = store
        self.rank = rank
        self.parent_pid = parent_pid
        self.on_lost = on_lost or self._exit
        self._stop = threading.Event()
        store.set_timeout(timedelta(seconds=HEARTBEAT_STALE_S + 1.0))
        self._thread = threading.Thread(target=self._run, name=f"tokenlane-heartbeat-{rank}", daemon=True)

    def start(self) -> "Heartbeat":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        key = _BEAT.format(self.rank)
        while not self._stop.is_set():
            if self.parent_pid is not None and os.getppid() != self.parent_pid:
                self.on_lost(f"rank {self.rank}: its parent process {self.parent_pid} is gone")
                return
            try:
                self.store.add(key, 1)
            except Exception as exc:
                if not self._stop.is_set():
                    self.on_lost(f"rank {self.rank}: lost the leader (rank 0's store): {exc}")
                return
            self._stop.wait(HEARTBEAT_INTERVAL_S)

    def _exit(self, message: str) -> None:
        log.error("%s; exiting", message)
        end_now(1)


class GroupWatchdog:
    """Rank 0's watch over the group; `fail` is the one way the group goes down."""

    def __init__(self, store, local: LocalRanks, world_size: int, exit_on_failure: bool = True) -> None:
        self.store = store
        self.local = local
        self.world_size = world_size
        self.exit_on_failure = exit_on_failure
        self.failed: Optional[str] = None
        self.step_idle = threading.Event()  # set while no step is in flight
        self.step_idle.set()
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tokenlane-group-watchdog", daemon=True)

    def start(self) -> "GroupWatchdog":
        self._thread.start()
        return self

    def stop(self) -> None:
        """A clean shutdown: watch no more."""
        self._stopped.set()

    def _run(self) -> None:
        keys = {rank: _BEAT.format(rank) for rank in range(1, self.world_size)}
        seen = {rank: (-1, time.monotonic()) for rank in keys}
        next_beat_check = time.monotonic()
        while not self._stopped.wait(0.2):
            gone = self.local.exited()
            if gone:
                self.fail("; ".join(describe_exit(*g) for g in gone))
                return
            now = time.monotonic()
            if now < next_beat_check:
                continue
            next_beat_check = now + 1.0
            for rank, key in keys.items():
                try:
                    count = self.store.add(key, 0)
                except Exception as exc:  # our own store: nothing else can go on
                    self.fail(f"rank 0: its rendezvous store failed: {exc}")
                    return
                last, since = seen[rank]
                if count != last:
                    seen[rank] = (count, now)
                elif now - since > HEARTBEAT_STALE_S:
                    self.fail(f"rank {rank} sent no heartbeat for {now - since:.1f} s (hung or unreachable)")
                    return

    def diagnose(self, exc: BaseException) -> str:
        """Why a step failed: a local rank that exited names itself (a peer's socket closes a
        moment before its exit status is known), else the error rank 0 saw."""
        if self.failed is not None:
            return self.failed
        gone = self.local.wait_exit(1.0)
        if gone:
            return "; ".join(describe_exit(*g) for g in gone)
        return f"rank 0: a step's collective failed: {type(exc).__name__}: {exc}"

    def fail(self, message: str) -> None:
        with self._lock:
            if self.failed is not None or self._stopped.is_set():
                return
            self.failed = message
        log.error("parallel group failed: %s", message)
        self._stopped.set()
        self.local.kill()
        if self.exit_on_failure:
            threading.Thread(target=self._exit_after_grace, name="tokenlane-group-exit", daemon=True).start()

    def _exit_after_grace(self) -> None:
        self.step_idle.wait(STEP_GRACE_S)
        time.sleep(FLUSH_GRACE_S)  # the streams' error events on their way out
        end_now(1)
