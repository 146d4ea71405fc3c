"""Per-tenant token-rate limits (`tenants[].tokensPerMinute`): one token bucket per tenant.

A bucket holds up to one minute of the tenant's tokens and refills continuously. Admission
charges a request's prompt tokens when it admits it; output tokens are charged as the engine
produces them, so a long generation can drive the bucket below zero (a debt the tenant repays
before its next request is admitted). A request is admitted when the bucket holds its prompt
tokens, capped at the bucket's size (a prompt larger than a minute's budget waits for a full
bucket, then leaves it in debt); otherwise it gets 429 `tenant_rate_limit` with Retry-After
the seconds until the bucket holds that much again.

Pure and clock-injected: every call takes `now` (seconds, any monotonic origin).
"""

from __future__ import annotations

from typing import Iterable, Optional

from tokenlane.runtime.config import TenantConfig


class TokenBucket:
    """`tokens_per_minute` tokens per minute, at most one minute's worth in reserve."""

    def __init__(self, tokens_per_minute: int, now: float) -> None:
        if tokens_per_minute <= 0:
            raise ValueError(f"tokensPerMinute must be > 0, got {tokens_per_minute}")
        self.tokens_per_minute = tokens_per_minute
        self.level = float(tokens_per_minute)  # starts full
        self._updated = now

    @property
    def capacity(self) -> float:
        return float(self.tokens_per_minute)

    @property
    def rate_per_s(self) -> float:
        return self.tokens_per_minute / 60.0

    def _refill(self, now: float) -> None:
        if now > self._updated:
            self.level = min(self.capacity, self.level + (now - self._updated) * self.rate_per_s)
            self._updated = now

    def seconds_until(self, tokens: int, now: float) -> float:
        """Seconds until the bucket holds `tokens` (capped at its size); 0 if it does now."""
        self._refill(now)
        need = min(float(tokens), self.capacity)
        if self.level >= need:
            return 0.0
        return (need - self.level) / self.rate_per_s

    def charge(self, tokens: int, now: float) -> None:
        """Take `tokens` (the level may go negative: a debt)."""
        self._refill(now)
        self.level -= tokens

    def set_rate(self, tokens_per_minute: int, now: float) -> None:
        """Hot reload: the new rate from now on; the level is kept, capped at the new size."""
        self._refill(now)
        self.tokens_per_minute = tokens_per_minute
        self.level = min(self.level, self.capacity)


class TenantRateLimiter:
    """The buckets of the tenants that have `tokensPerMinute`; others are unlimited."""

    def __init__(self, tenants: Iterable[TenantConfig], now: float) -> None:
        self._buckets: dict[str, TokenBucket] = {}
        self.configure(tenants, now)

    def configure(self, tenants: Iterable[TenantConfig], now: float) -> None:
        """Take the tenants' limits (hot reload): a kept limit keeps its bucket's level."""
        buckets: dict[str, TokenBucket] = {}
        for tenant in tenants:
            if tenant.tokens_per_minute is None:
                continue
            bucket = self._buckets.get(tenant.name)
            if bucket is None:
                bucket = TokenBucket(tenant.tokens_per_minute, now)
            else:
                bucket.set_rate(tenant.tokens_per_minute, now)
            buckets[tenant.name] = bucket
        self._buckets = buckets

    def limit_of(self, tenant: str) -> Optional[int]:
        bucket = self._buckets.get(tenant)
        return None if bucket is None else bucket.tokens_per_minute

    def retry_after(self, tenant: str, tokens: int, now: float) -> Optional[float]:
        """Seconds until the tenant may spend `tokens`; None if it may now (or is unlimited)."""
        bucket = self._buckets.get(tenant)
        if bucket is None:
            return None
        wait = bucket.seconds_until(tokens, now)
        return wait if wait > 0 else None

    def charge(self, tenant: str, tokens: int, now: float) -> None:
        bucket = self._buckets.get(tenant)
        if bucket is not None and tokens:
            bucket.charge(tokens, now)
