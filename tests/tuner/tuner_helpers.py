"""Shared builders for the tuner tests: two or three lanes, budgets, samples, a model plant,
and the runtime.yaml adapters that drive the tuner against a runtime without an operator."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenlane.operator.api.tuning_types import (
    Bounds,
    EffectiveBudgets,
    LaneMetrics,
    LaneTarget,
    MetricSample,
    TunerSettings,
)

INTERACTIVE_BOUNDS = {
    "maxBatchedTokens": Bounds(512, 8192),
    "maxActiveSequences": Bounds(8, 128),
    "prefillChunkSize": Bounds(256, 2048),
}
BATCH_BOUNDS = {
    "maxBatchedTokens": Bounds(512, 8192),
    "maxActiveSequences": Bounds(4, 128),
    "prefillChunkSize": Bounds(256, 4096),
}


def lanes(with_long: bool = False) -> list[LaneTarget]:
    out = [
        LaneTarget("interactive", "interactive", 100, ttft_p95_ms=500, tpot_p95_ms=60, bounds=INTERACTIVE_BOUNDS),
        LaneTarget("batch", "batch", 10, bounds=BATCH_BOUNDS),
    ]
    if with_long:
        out.insert(1, LaneTarget("long-context", "long-context", 50, ttft_p95_ms=8000, tpot_p95_ms=120,
                                 bounds={"prefillChunkSize": Bounds(256, 4096)}))
    return out


def budgets(**overrides) -> EffectiveBudgets:
    base = {
        "interactive": {"maxBatchedTokens": 2048, "maxActiveSequences": 32, "prefillChunkSize": 512},
        "batch": {"maxBatchedTokens": 8192, "maxActiveSequences": 64, "prefillChunkSize": 2048},
        "long-context": {"maxBatchedTokens": 8192, "maxActiveSequences": 128, "prefillChunkSize": 2048},
    }
    for key, value in overrides.items():
        lane, knob = key.split("__")
        base[lane.replace("_", "-")][knob] = value
    return EffectiveBudgets(base, {"kvCacheHighWatermark": 0.88})


SETTINGS = TunerSettings(
    cooldown_s=60, window_s=60, min_requests=20,
    global_bounds={"kvCacheHighWatermark": Bounds(0.7, 0.9)},
)


def sample(
    ttft_ms: float = 300,
    tpot_ms: float = 30,
    queue_ms: float = 50,
    rate: float = 5.0,
    batch_rate: float = 2.0,
    batch_waiting: float = 0.0,
    kv: float = 0.5,
    preemptions: float = 0.0,
    throughput: float = 1000.0,
    long: LaneMetrics | None = None,
) -> MetricSample:
    lanes_ = {
        "interactive": LaneMetrics(rate, ttft_ms / 1000, tpot_ms / 1000, queue_ms / 1000, 0.0, 0.0, throughput / 4),
        "batch": LaneMetrics(batch_rate, 5.0, 0.05, 4.0, 0.0, batch_waiting, throughput * 3 / 4),
    }
    if long is not None:
        lanes_["long-context"] = long
    return MetricSample(60, lanes_, kv_usage=kv, preemption_rate=preemptions)


@dataclass
class Plant:
    """A small queueing model of one GPU shared by an interactive and a batch lane.

    Per step the engine can batch `capacity` tokens; batch work (a flood, always backlogged)
    takes up to its lane caps; the interactive lane gets what its caps and the rest allow.
    Interactive TTFT = prefill time + M/M/1-like queueing on the share it gets; TPOT grows
    with the prefill chunks that share the step. Throughput is what the batch lane pushes.
    """

    capacity: float = 8192.0
    interactive_demand: float = 1500.0  # tokens per step the interactive lane needs
    batch_demand: float = 12000.0  # the flood: more than the GPU has
    prefill_ms: float = 150.0
    noise: float = 0.0
    rng: object = None
    history: list = field(default_factory=list)

    def observe(self, b: EffectiveBudgets) -> MetricSample:
        i, bt = b.lanes["interactive"], b.lanes["batch"]
        batch_tokens = min(self.batch_demand, bt["maxBatchedTokens"], bt["maxActiveSequences"] * 256)
        available = min(i["maxBatchedTokens"], i["maxActiveSequences"] * 96, self.capacity - batch_tokens * 0.85)
        rho = self.interactive_demand / max(available, 1.0)
        queue_ms = 60.0 * rho / (1.0 - rho) if rho < 0.97 else 4000.0
        chunk_tokens = bt["prefillChunkSize"] + i["prefillChunkSize"]
        tpot_ms = 20.0 + chunk_tokens / 100.0

        def jitter(x: float) -> float:
            return x * (1.0 + (self.rng.uniform(-self.noise, self.noise) if self.rng else 0.0))

        ttft = jitter(self.prefill_ms + queue_ms)
        self.history.append(ttft)
        return MetricSample(
            60,
            {
                "interactive": LaneMetrics(5.0, ttft / 1000, jitter(tpot_ms) / 1000, queue_ms / 1000, 0.0, rho, 200.0),
                "batch": LaneMetrics(3.0, 20.0, 0.08, 15.0, 0.0, 50.0, jitter(batch_tokens / 4)),
            },
            kv_usage=0.6,
        )


# --------------------------------------------------------------------------- runtime.yaml adapters
# The real-Prometheus test and the closed-loop simulation run the tuner against a runtime's
# own config, the way the operator runs it against a ModelService (operator/controllers/tuning.py).


# Both live in the package, shared with `tokenlane plan` (bench/tuned_sim.py).
from tokenlane.bench.tuned_sim import apply_budgets, lane_targets  # noqa: E402,F401  (re-exported)
