"""Named simulator experiments (`tokenlane bench simulate --scenario NAME`).

Each scenario is a list of phases (name, runtime config, traffic) run through sim.simulate on
the same traffic, so the table and the ratios compare configurations, not luck.

- continuous-vs-static: the Azure conversation trace, sped up until static batching saturates,
  against the three-lane production config with continuousBatching true, then false.
- lanes-flood: the interactive lane's trace traffic alone and then with a concurrent flood of
  8k-16k-token prompts in the long-context lane; with lanes + chunked prefill (budgets tuned for
  the flood, and the production example budgets), with one FIFO lane and chunked prefill, and
  with one FIFO lane and no chunking; and with the example lanes without lane isolation.
- lanes-kv-flood: 60% interactive, 40% long-context requests with 4k-16k-token prompts and
  64-2048-token outputs (they hold KV blocks for seconds): two equal lanes, the example lanes
  without lane isolation, and the production config (the example lanes with it: a KV reserve
  for the interactive lane and the step-time budget).
- lanes-batch-flood: the interactive trace with/without a flood of long-output batch requests
  (many long decodes read their KV every step), example lanes with and without isolation.
- kv-fp8: the lanes-kv-flood traffic against the production config with a bf16 KV cache and
  with an fp8 one (twice the blocks, half the bytes read per decode).
- conversation-host-tier: multi-turn conversations whose histories add up to 4x the device KV
  pool, prefix caching on, without and with the host-memory tier (engine.kvOffload).
"""

from __future__ import annotations

import copy
import dataclasses
import random
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from tokenlane.bench.report import LaneSLO, slos_from_config
from tokenlane.bench.trace import LaneMix, PlannedRequest, Traffic, TrafficSpec, build_requests, merge, summarize
from tokenlane.runtime.config import RuntimeConfig

# The production example config (see docs/configuration.md) on a simulated H200 serving a Llama-3-8B-like model. Budgets are
# the documented example's; the KV pool is sized from gpuMemoryUtilization like vLLM does. Prefix caching is
# off because the trace carries no prompt contents (nothing could be shared). Lane isolation is on
# (docs/tuning.md, "Lane isolation"): the interactive lane keeps 5% of the KV cache that no other lane can
# take (its requests are short: a few hundred blocks of ~50k) and the step-time budget keeps every step
# within the interactive TPOT target, lower-priority prefills yielding to the interactive ones.
PRODUCTION_CONFIG: dict[str, Any] = {
    "model": {"path": "simulated/llama3-8b", "servedName": "llama3-8b", "maxModelLen": 32768},
    "engine": {
        "executor": "simulated",
        "simulatorProfile": "h200-llama3-8b",
        "blockSize": 16,
        "gpuMemoryUtilization": 0.90,
        "enablePrefixCaching": False,
        "continuousBatching": True,
    },
    "scheduler": {
        "maxActiveSequences": 128,
        "maxWaitingRequests": 4096,
        "maxBatchedTokens": 8192,
        "prefillChunkSize": 2048,
        "policy": "decode-first",
        "queueTimeoutMs": 30000,
        "kvCacheHighWatermark": 0.88,
        "kvCacheRejectWatermark": 0.95,
        "stepTimeBudget": "auto",
    },
    "lanes": [
        {"name": "interactive", "class": "interactive", "priority": 100, "weight": 4, "default": True,
         "maxActiveSequences": 96, "maxBatchedTokens": 4096, "prefillChunkSize": 512,
         "maxWaitingRequests": 1024, "queueTimeoutMs": 10000, "kvCacheReserved": 0.05,
         "slo": {"ttftP95Ms": 500, "tpotP95Ms": 60}},
        {"name": "long-context", "class": "long-context", "priority": 50, "weight": 2,
         "match": {"minPromptTokens": 8192}, "maxBatchedTokens": 2048, "prefillChunkSize": 2048,
         "maxWaitingRequests": 256, "slo": {"ttftP95Ms": 8000, "tpotP95Ms": 120}},
        {"name": "batch", "class": "batch", "priority": 10, "weight": 1, "maxWaitingRequests": 4096,
         "queueTimeoutMs": 600000},
    ],
}


def production_config(**overrides: Any) -> RuntimeConfig:
    """PRODUCTION_CONFIG with top-level sections replaced or patched: e.g.
    production_config(engine={"continuousBatching": False})."""
    data = copy.deepcopy(PRODUCTION_CONFIG)
    for section, value in overrides.items():
        if isinstance(value, dict) and isinstance(data.get(section), dict):
            data[section].update(value)
        else:
            data[section] = value
    return RuntimeConfig.from_dict(data)


# Lane budgets for a long-prompt flood: the long-context lane gets at most 256 tokens of each
# step (its prompts still finish prefill within ~2 s, far inside its 8 s TTFT target) and the
# interactive lane prefills in 1024-token chunks (fewer steps per prompt). These are exactly the
# knobs the operator's tuner moves (ServingLane budgets, hot-reloaded).
FLOOD_TUNED_LANES = {
    "interactive": {"prefillChunkSize": 1024},
    "long-context": {"maxBatchedTokens": 256, "prefillChunkSize": 256},
}


def lanes_config(lane_patches: Optional[dict[str, dict[str, Any]]] = None) -> RuntimeConfig:
    lanes = copy.deepcopy(PRODUCTION_CONFIG["lanes"])
    for lane in lanes:
        lane.update((lane_patches or {}).get(lane["name"], {}))
    return production_config(lanes=lanes)


def unprotected_config() -> RuntimeConfig:
    """The production config without lane isolation (no KV reserve, no step-time budget): what
    it shipped as before isolation was on by default."""
    lanes = copy.deepcopy(PRODUCTION_CONFIG["lanes"])
    for lane in lanes:
        lane.pop("kvCacheReserved", None)
    return production_config(lanes=lanes, scheduler={"stepTimeBudget": "off"})


def fifo_config(chunked: bool) -> RuntimeConfig:
    """One lane, no per-lane caps or priorities; `chunked=False` makes a prefill one chunk."""
    scheduler: dict[str, Any] = {"maxActiveSequences": 128, "maxWaitingRequests": 4096, "queueTimeoutMs": 30000,
                                 "stepTimeBudget": "off"}
    if chunked:
        scheduler.update(maxBatchedTokens=8192, prefillChunkSize=2048)
    else:
        # Every prompt (up to maxModelLen) is prefilled in one step, like an engine without
        # chunked prefill.
        scheduler.update(maxBatchedTokens=32768, prefillChunkSize=32768)
    return production_config(scheduler=scheduler, lanes=[{"name": "default", "default": True}])


@dataclass
class Phase:
    name: str
    config: RuntimeConfig
    traffic: Traffic
    slos: Optional[dict[str, LaneSLO]] = None


@dataclass
class Scenario:
    name: str
    title: str
    phases: list[Phase]
    notes: list[str] = field(default_factory=list)
    # (phase, baseline phase) pairs whose ratios the scenario is about
    ratio_pairs: list[tuple[str, str]] = field(default_factory=list)


def conversation_traffic(time_scale: float, duration_s: float, seed: int, lane: Optional[str] = None,
                         trace_start_s: float = 0.0) -> Traffic:
    return build_requests(
        TrafficSpec(source="trace", seed=seed, duration_s=duration_s, time_scale=time_scale,
                    trace_start_s=trace_start_s, lanes=[LaneMix(lane=lane)], tenants=["default"])
    )


def continuous_vs_static(time_scale: float = 3.0, duration_s: float = 120.0, seed: int = 0) -> Scenario:
    traffic = conversation_traffic(time_scale, duration_s, seed)
    return Scenario(
        name="continuous-vs-static",
        title=f"H200 + Llama-3-8B-like (simulated): Azure conversation trace x{time_scale:g}",
        phases=[
            Phase("continuous", production_config(), traffic),
            Phase("static", production_config(engine={"continuousBatching": False}), traffic),
        ],
        ratio_pairs=[("continuous", "static")],
    )


def flood_traffic(rate_rps: float, duration_s: float, seed: int) -> Traffic:
    return build_requests(
        TrafficSpec(source="synthetic", seed=seed + 1000, duration_s=duration_s, rate_rps=rate_rps,
                    lanes=[LaneMix(lane="long-context", prompt="long", output="short")],
                    tenants=["default"], max_prompt_tokens=16384)
    )


def lanes_flood(time_scale: float = 2.0, duration_s: float = 120.0, flood_rps: float = 1.5,
                seed: int = 0) -> Scenario:
    quiet = conversation_traffic(time_scale, duration_s, seed, lane="interactive")
    flooded = merge(quiet, flood_traffic(flood_rps, duration_s, seed))
    slos = slos_from_config(production_config())  # same targets for every config, per traffic class
    labels = ("lanes-tuned", "lanes-default", "lanes-unprotected", "fifo+chunked", "fifo+unchunked")
    configs = (lanes_config(FLOOD_TUNED_LANES), lanes_config(), unprotected_config(), fifo_config(True),
               fifo_config(False))
    phases = []
    for label, cfg in zip(labels, configs):
        phases.append(Phase(f"{label}/quiet", cfg, quiet, slos))
        phases.append(Phase(f"{label}/flood", cfg, flooded, slos))
    return Scenario(
        name="lanes-flood",
        title=(f"Interactive lane (trace x{time_scale:g}) with/without a {flood_rps:g} req/s flood of "
               "8k-16k-token prompts in the long-context lane"),
        phases=phases,
        ratio_pairs=[(f"{label}/flood", f"{label}/quiet") for label in labels],
    )


def kv_flood_traffic(rate_rps: float, duration_s: float, seed: int) -> Traffic:
    """60% interactive (short prompts and outputs), 40% long-context (4k-16k-token prompts,
    64-2048-token outputs): long sequences that hold KV blocks for many seconds."""
    return build_requests(
        TrafficSpec(source="synthetic", seed=seed, duration_s=duration_s, rate_rps=rate_rps,
                    lanes=[LaneMix(lane="interactive", share=3, prompt="short", output="short"),
                           LaneMix(lane="long-context", share=2, prompt="long", output="long")],
                    tenants=["default"], max_prompt_tokens=16384)
    )


def lanes_kv_flood(duration_s: float = 120.0, rate_rps: float = 16.0, seed: int = 0) -> Scenario:
    traffic = kv_flood_traffic(rate_rps, duration_s, seed)
    slos = slos_from_config(production_config())
    # Nothing protects the interactive lane: same priority and weight, no shares, no time cap.
    equal = [{"name": "interactive", "default": True, "slo": {"ttftP95Ms": 500, "tpotP95Ms": 60}},
             {"name": "long-context", "class": "long-context", "slo": {"ttftP95Ms": 8000, "tpotP95Ms": 120}}]
    return Scenario(
        name="lanes-kv-flood",
        title=(f"{rate_rps:g} req/s for {duration_s:g} s: 60% interactive, 40% long-context "
               "(4k-16k-token prompts, 64-2048-token outputs), no tuner"),
        phases=[
            Phase("equal-lanes", production_config(lanes=equal, scheduler={"stepTimeBudget": "off"}), traffic, slos),
            Phase("lanes-unprotected", unprotected_config(), traffic, slos),
            Phase("lanes-default", lanes_config(), traffic, slos),
        ],
        ratio_pairs=[("lanes-default", "equal-lanes"), ("lanes-unprotected", "equal-lanes"),
                     ("lanes-default", "lanes-unprotected")],
    )


def batch_flood_traffic(rate_rps: float, duration_s: float, seed: int) -> Traffic:
    """Batch-lane requests with medium prompts and long outputs (64-2048 tokens)."""
    return build_requests(
        TrafficSpec(source="synthetic", seed=seed + 2000, duration_s=duration_s, rate_rps=rate_rps,
                    lanes=[LaneMix(lane="batch", prompt="medium", output="long")], tenants=["default"])
    )


def lanes_batch_flood(time_scale: float = 2.0, duration_s: float = 120.0, flood_rps: float = 6.0,
                      seed: int = 0) -> Scenario:
    quiet = conversation_traffic(time_scale, duration_s, seed, lane="interactive")
    flooded = merge(quiet, batch_flood_traffic(flood_rps, duration_s, seed))
    slos = slos_from_config(production_config())
    phases = []
    for label, cfg in (("lanes-unprotected", unprotected_config()), ("lanes-default", lanes_config())):
        phases.append(Phase(f"{label}/quiet", cfg, quiet, slos))
        phases.append(Phase(f"{label}/flood", cfg, flooded, slos))
    return Scenario(
        name="lanes-batch-flood",
        title=(f"Interactive lane (trace x{time_scale:g}) with/without a {flood_rps:g} req/s flood of "
               "long-output requests in the batch lane"),
        phases=phases,
        ratio_pairs=[(f"{label}/flood", f"{label}/quiet") for label in ("lanes-unprotected", "lanes-default")],
    )


def with_engine(config: RuntimeConfig, **engine: Any) -> RuntimeConfig:
    """`config` with engine fields replaced (snake_case names, e.g. kv_cache_dtype="fp8_e4m3")."""
    return dataclasses.replace(config, engine=dataclasses.replace(config.engine, **engine))


def kv_fp8(duration_s: float = 120.0, rate_rps: float = 16.0, seed: int = 0) -> Scenario:
    traffic = kv_flood_traffic(rate_rps, duration_s, seed)
    slos = slos_from_config(production_config())
    return Scenario(
        name="kv-fp8",
        title=(f"KV cache dtype under lanes-kv-flood traffic ({rate_rps:g} req/s for {duration_s:g} s, 40% "
               "long-context): the production config with a bf16 and an fp8 KV cache"),
        phases=[
            Phase("bf16", lanes_config(), traffic, slos),
            Phase("fp8", with_engine(lanes_config(), kv_cache_dtype="fp8_e4m3"), traffic, slos),
        ],
        ratio_pairs=[("fp8", "bf16")],
    )


# The conversation scenario's device pool: small, so that a working set of 4x it stays a short
# simulation; what the host tier changes depends on working set / pool, not on the pool's size.
CONVERSATION_POOL_BLOCKS = 4096


def conversation_turns_traffic(duration_s: float, seed: int, *, conversations: int = 48,
                               first_prompt: tuple[int, int] = (500, 2000), user_turn: tuple[int, int] = (100, 1000),
                               reply: tuple[int, int] = (100, 500), think_s: tuple[float, float] = (10.0, 40.0),
                               lane: str = "interactive") -> Traffic:
    """Multi-turn chats: each conversation opens with a system prompt and a question, and every
    later turn's prompt is the whole history so far (earlier prompts, the replies, the new user
    message, up to a pasted page), a think time after the previous turn. Lengths in tokens."""
    rng = random.Random(seed)
    rows: list[tuple[float, int, int, int]] = []  # arrival, conversation, prompt, max_tokens
    for conv in range(conversations):
        t = rng.uniform(0.0, think_s[1])
        history = rng.randint(*first_prompt)
        while t < duration_s:
            out = rng.randint(*reply)
            rows.append((t, conv, history, out))
            history += out + rng.randint(*user_turn)
            t += rng.uniform(*think_s)
    rows.sort()
    requests = [PlannedRequest(index=i, arrival_s=t, lane=lane, tenant="default", prompt_tokens=prompt,
                               max_tokens=out, conversation=conv)
                for i, (t, conv, prompt, out) in enumerate(rows)]
    traffic = Traffic(requests, "", TrafficSpec(source="synthetic", seed=seed, duration_s=duration_s))
    traffic.description = (f"{conversations} conversations, {len(requests)} turns in {duration_s:g} s; histories end "
                           f"at {conversation_working_set(traffic)} tokens in all; {summarize(requests)}")
    return traffic


def conversation_working_set(traffic: Traffic) -> int:
    """Tokens of every conversation's longest history (prompt plus reply)."""
    last: dict[int, int] = {}
    for r in traffic.requests:
        last[r.conversation] = max(last.get(r.conversation, 0), r.prompt_tokens + r.max_tokens)
    return sum(last.values())


# Host tier for the conversation scenario: room for the whole working set and more.
CONVERSATION_HOST_BYTES = 64 * 1024**3


def conversation_config(host_bytes: Optional[int] = None) -> RuntimeConfig:
    engine: dict[str, Any] = {"enablePrefixCaching": True, "kvCacheBlocks": CONVERSATION_POOL_BLOCKS}
    if host_bytes:
        engine["kvOffload"] = {"hostBytes": host_bytes}
    return production_config(engine=engine)


def conversation_host_tier(duration_s: float = 150.0, seed: int = 0) -> Scenario:
    traffic = conversation_turns_traffic(duration_s, seed)
    pool_tokens = CONVERSATION_POOL_BLOCKS * PRODUCTION_CONFIG["engine"]["blockSize"]
    ratio = conversation_working_set(traffic) / pool_tokens
    return Scenario(
        name="conversation-host-tier",
        title=(f"Multi-turn conversations, working set {ratio:.1f}x the device KV pool ({pool_tokens} tokens), "
               "prefix caching on: without and with the host tier"),
        phases=[
            Phase("device-only", conversation_config(), traffic),
            Phase("host-tier", conversation_config(CONVERSATION_HOST_BYTES), traffic),
        ],
        ratio_pairs=[("host-tier", "device-only")],
    )


def lora(time_scale: float = 3.0, duration_s: float = 120.0, seed: int = 0, adapters: int = 4,
         rank: int = 16) -> Scenario:
    """The conversation trace on the base alone, then spread uniformly over `adapters` LoRA
    adapters of rank `rank` (and of rank 64) over every projection: what the segmented LoRA
    products cost the same traffic (runtime/executor/simulated.py, `lora_cost`)."""
    from tokenlane.bench import lora_cost as lora_traffic

    traffic = conversation_traffic(time_scale, duration_s, seed)
    names = lora_traffic.adapter_names(adapters)
    spread = lora_traffic.spread_over_adapters(traffic, names, seed)
    return Scenario(
        name="lora",
        title=f"H200 + Llama-3-8B-like (simulated): Azure conversation trace x{time_scale:g}, "
              f"base vs {adapters} LoRA adapters",
        phases=[
            Phase("base", production_config(), traffic),
            Phase(f"lora-{adapters}-r{rank}", lora_traffic.with_adapters(production_config(), names, rank), spread),
            Phase(f"lora-{adapters}-r64", lora_traffic.with_adapters(production_config(), names, 64), spread),
        ],
        ratio_pairs=[(f"lora-{adapters}-r{rank}", "base"), (f"lora-{adapters}-r64", "base")],
    )


SCENARIOS: dict[str, Callable[..., Scenario]] = {
    "continuous-vs-static": continuous_vs_static,
    "lanes-flood": lanes_flood,
    "lanes-kv-flood": lanes_kv_flood,
    "lanes-batch-flood": lanes_batch_flood,
    "kv-fp8": kv_fp8,
    "conversation-host-tier": conversation_host_tier,
    "lora": lora,
}
