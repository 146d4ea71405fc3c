"""An online cost model of one engine step, and the per-step time budget it drives.

A step's time is modelled as linear in four terms of its chunks (the simulator's roofline
terms, runtime/executor/simulated.py, without the hardware constants):

    seconds ~ a + b x tokens + c x KV tokens read + d x prefill attention pairs

- tokens: every scheduled token (weights' FLOPs, K/V written);
- KV tokens read: each chunk's context (`start + num_tokens`: paged attention reads it all);
- attention pairs: for prefill chunks, `num_tokens x (start + (num_tokens + 1) / 2)` (the
  causal attention FLOPs that make a chunk deep in a long prompt slower).

The coefficients are fitted from measured steps by exponentially weighted least squares
(recent steps count most, so the model follows the hardware and the load), on scaled terms
with a small ridge so a few steps give a usable fit. Until `MIN_OBSERVATIONS` steps were
measured the model is not `ready` and no step is capped.

`StepTimeBudget` applies it to one step (`scheduler.stepTimeBudget: auto`, docs/tuning.md,
"Lane isolation"): the scheduler adds each chunk's terms as it builds the step and asks how
large a prefill chunk still fits in the cap, or whether a decode may be skipped.
"""

from __future__ import annotations

from typing import Iterable, Optional

# Terms are scaled to similar magnitudes before fitting (keeps the normal equations sane).
_SCALE = (1.0, 1e-3, 1e-6, 1e-9)
MIN_OBSERVATIONS = 16
FORGETTING = 0.995  # weight of the past per observed step (an effective window of ~200 steps)
RIDGE = 1e-6
REFIT_EVERY = 8  # re-solve the normal equations every this many observations


def chunk_terms(start: int, num_tokens: int) -> tuple[float, float, float]:
    """(tokens, KV tokens read, attention pairs) of one chunk."""
    pairs = num_tokens * (start + (num_tokens + 1) / 2.0) if num_tokens > 1 else 0.0
    return float(num_tokens), float(start + num_tokens), pairs


def _solve(a: list[list[float]], b: list[float]) -> Optional[list[float]]:
    """Gaussian elimination with partial pivoting; None if singular."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-18:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            if f:
                for c in range(col, n + 1):
                    m[r][c] -= f * m[col][c]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x


class StepCostModel:
    """Seconds of a step from its chunks' terms, fitted online from measured steps."""

    def __init__(self) -> None:
        n = len(_SCALE)
        self._xtx = [[RIDGE if i == j else 0.0 for j in range(n)] for i in range(n)]
        self._xty = [0.0] * n
        self.coefficients: Optional[list[float]] = None
        self.observations = 0

    @property
    def ready(self) -> bool:
        return self.coefficients is not None and self.observations >= MIN_OBSERVATIONS

    def observe(self, chunks: Iterable[tuple[int, int]], seconds: float) -> None:
        """One measured step: its chunks' (start, num_tokens) and its seconds."""
        tokens = kv = pairs = 0.0
        for start, num_tokens in chunks:
            t, k, p = chunk_terms(start, num_tokens)
            tokens += t
            kv += k
            pairs += p
        if tokens <= 0 or seconds <= 0:
            return
        x = [s * v for s, v in zip(_SCALE, (1.0, tokens, kv, pairs))]
        xtx, xty = self._xtx, self._xty
        for i in range(len(x)):
            xty[i] = FORGETTING * xty[i] + x[i] * seconds
            row = xtx[i]
            for j in range(len(x)):
                row[j] = FORGETTING * row[j] + x[i] * x[j] + (RIDGE * (1 - FORGETTING) if i == j else 0.0)
        self.observations += 1
        if self.observations % REFIT_EVERY == 0 or self.coefficients is None:
            solved = _solve(xtx, xty)
            if solved is not None:
                self.coefficients = solved

    def predict(self, tokens: float, kv: float, pairs: float) -> float:
        """Estimated seconds of a step with these summed terms (0 before any fit)."""
        c = self.coefficients
        if c is None or tokens <= 0:
            return 0.0
        x = (1.0, tokens, kv, pairs)
        return max(0.0, sum(ci * s * v for ci, s, v in zip(c, _SCALE, x)))


class StepTimeBudget:
    """One step's time cap and the terms scheduled so far (`cap_s` None: no cap)."""

    def __init__(self, model: StepCostModel, cap_s: Optional[float]) -> None:
        self.model = model
        self.cap_s = cap_s if model.ready else None
        self.tokens = self.kv = self.pairs = 0.0
        self.capped = False  # something was shortened or skipped for the cap this step
        self.has_prefill = False  # a prefill chunk is in the step already
        # Highest lane priority with prefill work this step: lower ones yield (scheduler).
        self.prefill_priority = -1
        self.floored_lanes: set[str] = set()  # yielding lanes that got their floor this step
        self.denied_lane: Optional[str] = None  # the lane whose last chunk the cap cut to nothing

    def lane_out_of_time(self, lane: str) -> bool:
        """Whether the cap cut the lane's last chunk to nothing."""
        return self.denied_lane == lane
    @property
    def active(self) -> bool:
        return self.cap_s is not None

    def add(self, start: int, num_tokens: int) -> None:
        if num_tokens > 1:
            self.has_prefill = True
        t, k, p = chunk_terms(start, num_tokens)
        self.tokens += t
        self.kv += k
        self.pairs += p

    def add_pending_prefill(self) -> None:
        """A prefill chunk is going into the step (its terms are added once it is placed)."""
        self.has_prefill = True

    def seconds_with(self, start: int, num_tokens: int) -> float:
        t, k, p = chunk_terms(start, num_tokens)
        return self.model.predict(self.tokens + t, self.kv + k, self.pairs + p)

    def fits(self, start: int, num_tokens: int, limit_s: Optional[float] = None) -> bool:
        limit = self.cap_s if limit_s is None else limit_s
        return limit is None or self.seconds_with(start, num_tokens) <= limit

    def seconds(self) -> float:
        """Estimated seconds of the step as scheduled so far."""
        return self.model.predict(self.tokens, self.kv, self.pairs)

    def largest_chunk(self, start: int, num_tokens: int, floor: int, share: float = 1.0) -> int:
        """The largest chunk of at most `num_tokens` from `start` that keeps the step in its
        cap and adds at most `share` of the cap to it, but at least `min(floor, num_tokens)`
        (so prefills always progress)."""
        assert self.cap_s is not None
        limit = self.cap_s if share >= 1.0 else min(self.cap_s, self.seconds() + share * self.cap_s)
        if self.fits(start, num_tokens, limit):
            return num_tokens
        self.capped = True
        lo, hi = 0, num_tokens  # lo fits (or is 0), hi does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.fits(start, mid, limit):
                lo = mid
            else:
                hi = mid
        return max(lo, min(floor, num_tokens))
