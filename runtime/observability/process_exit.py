"""Ending a runtime process at once: the logs and standard streams flushed, the interpreter's
teardown skipped. With torch, transformers and triton loaded that teardown garbage-collects a
few hundred thousand objects and unloads every module, 1-3 s of CPU on a 2-core host, that only
delays whoever waits for the exit (a rollout, a failed group's restart, `tokenlane bench`);
nanobind also prints a leak report there. One helper for the server, the engine core process
and the ranks of a parallel group."""

from __future__ import annotations

import atexit
import logging
import os
import sys


def exit_now(code: int, *, run_exit_functions: bool = True) -> None:
    """Exit with `code` now. With `run_exit_functions` the atexit handlers run first (logging
    flushes its handlers there; a multi-rank executor stops its worker ranks there); without,
    only the logs are flushed: a rank whose group failed waits on nothing."""
    if run_exit_functions:
        atexit._run_exitfuncs()
    else:
        logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or gone: nothing left to keep
            pass
    os._exit(code)
