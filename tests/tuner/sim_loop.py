"""Traffic for the tuner's closed-loop test; the loop itself is the package's
(bench/tuned_sim.py, shared with `tokenlane plan`)."""

from __future__ import annotations

import dataclasses

from tokenlane.bench.trace import PlannedRequest
from tokenlane.bench.tuned_sim import OK_STATUSES, LoopResult, is_refused, run

__all__ = ["OK_STATUSES", "LoopResult", "flood_traffic", "run", "refused_share"]


def refused_share(result: LoopResult, lane: str, start_s: float, end_s: float) -> float:
    """Share of `lane`'s requests finished in [start_s, end_s) that were refused or timed out
    (by the rule the operator reads Prometheus with)."""
    done = [r for r in result.finished if r.lane == lane and start_s <= r.finish_time < end_s]
    return sum(1 for r in done if is_refused(r)) / len(done) if done else 0.0


def flood_traffic(*, seconds: float, interactive_rps: float, flood_start_s: float, flood_rps: float,
                  flood_prompt_tokens: int, seed: int = 0) -> list[PlannedRequest]:
    """Steady interactive chat traffic, light batch traffic, then a long-prompt flood in batch."""
    import random

    rng = random.Random(seed)
    out: list[PlannedRequest] = []

    def poisson(rate: float, start: float, end: float):
        t = start
        while True:
            t += rng.expovariate(rate)
            if t >= end:
                return
            yield t

    for t in poisson(interactive_rps, 0.0, seconds):
        out.append(PlannedRequest(len(out), t, "interactive", "default",
                                  prompt_tokens=rng.randint(200, 1200), max_tokens=rng.randint(64, 256)))
    for t in poisson(0.5, 0.0, seconds):
        out.append(PlannedRequest(len(out), t, "batch", "default", prompt_tokens=rng.randint(500, 2000),
                                  max_tokens=256))
    for t in poisson(flood_rps, flood_start_s, seconds):
        out.append(PlannedRequest(len(out), t, "batch", "default",
                                  prompt_tokens=rng.randint(flood_prompt_tokens // 2, flood_prompt_tokens),
                                  max_tokens=128))
    out.sort(key=lambda p: p.arrival_s)
    return [dataclasses.replace(p, index=i) for i, p in enumerate(out)]
