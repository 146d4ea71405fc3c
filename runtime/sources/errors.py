"""The source's own errors, and the bounded exponential back-off for the transient ones."""

from __future__ import annotations

import random
import sys
import time
from dataclasses import dataclass
from typing import Callable, TypeVar

T = TypeVar("T")


class SourceError(Exception):
    """A source refused or failed: `message` is the source's own text (the Hub's 401/404, S3's
    NoSuchBucket). `transient` errors (connection, 5xx, throttling, a short read) are retried."""

    def __init__(self, message: str, *, transient: bool = False):
        super().__init__(message)
        self.message = message
        self.transient = transient


@dataclass(frozen=True)
class Backoff:
    """`attempts` tries in all; the wait before try k+1 is base * 2**(k-1), capped, with jitter."""

    attempts: int = 5
    base_s: float = 1.0
    max_s: float = 30.0

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"max attempts must be >= 1, got {self.attempts}")
        if self.base_s < 0 or self.max_s < 0:
            raise ValueError("back-off seconds must be >= 0")

    def delay(self, attempt: int) -> float:
        wait = min(self.max_s, self.base_s * 2 ** (attempt - 1))
        return wait * (0.5 + random.random() / 2)  # jitter: replicas do not retry in step

    def run(self, what: str, fn: Callable[[], T], classify: Callable[[BaseException], SourceError]) -> T:
        """Call `fn`; a transient failure is retried up to `attempts` tries in all, anything
        else (401/403/404, a malformed answer) raises at once as a SourceError."""
        for attempt in range(1, self.attempts + 1):
            try:
                return fn()
            except BaseException as exc:  # noqa: BLE001 - classified below, KeyboardInterrupt passes
                if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                    raise
                error = exc if isinstance(exc, SourceError) else classify(exc)
                if not error.transient or attempt == self.attempts:
                    if error is exc:
                        raise
                    raise error from exc
                wait = self.delay(attempt)
                print(f"{what}: {error.message} (try {attempt}/{self.attempts}; retrying in {wait:.1f}s)",
                      file=sys.stderr, flush=True)
                time.sleep(wait)
        raise AssertionError("unreachable")
