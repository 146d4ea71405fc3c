"""The go-live checklist as rules over a validated configuration (no I/O; `tokenlane check`
reads the inputs, operator/tools/check.py).

A `Subject` is one serving unit: a runtime.yaml, or a ModelService with the runtime.yaml of
each pool it renders. Each rule reads it and yields `Problem`s keyed in runtime.yaml terms
(`lanes[batch].queueTimeoutMs`); the subject's locator turns them into `Finding`s naming the
object and field a user edits. `RULES` is the catalogue with each rule's severity;
docs/check.md explains every rule and why its thresholds are where they are.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Optional

from tokenlane.runtime.config import LANE_CLASSES, LaneConfig, RuntimeConfig

SEVERITIES = ("error", "warning", "info")

# Thresholds of the rules; docs/check.md says why each is where it is.
FP8_KV_DTYPES = ("fp8_e4m3", "fp8_e5m2")
ISOLATION_KV_RESERVE = 0.05  # the interactive reserve the shipped configs use (docs/tuning.md)
MIN_WATERMARK_GAP = 0.05  # the tuner treats KV usage within 0.05 of the reject watermark as pressure
MIN_HIGH_WATERMARK = 0.5
MAX_HIGH_WATERMARK = 0.95
MAX_REJECT_WATERMARK = 0.98
MIN_STREAM_IDLE_TIMEOUT_MS = 1000
INTERACTIVE_QUEUE_TIMEOUT_FACTOR = 10  # an interactive request queued 10x its TTFT target is lost

# The alerts a go-live needs (all in manifests/monitoring/prometheusrule.yaml; a test keeps them there).
RUNTIME_ALERTS = (
    "TokenlaneLaneTTFTBudgetBurnFast",
    "TokenlaneLaneTTFTBudgetBurnSlow",
    "TokenlaneLaneTPOTBudgetBurnFast",
    "TokenlaneLaneTPOTBudgetBurnSlow",
    "TokenlaneKVCacheNearRejectWatermark",
    "TokenlaneHighRejectionRate",
    "TokenlaneHighTimeoutRate",
    "TokenlaneHighErrorRate",
    "TokenlaneConfigReloadRejected",
)
OPERATOR_ALERTS = (
    "TokenlaneRolledBack",
    "TokenlaneResourceDegraded",
    "TokenlaneOperatorDown",
)


# --------------------------------------------------------------------------- findings and rules


@dataclass(frozen=True)
class Rule:
    id: str
    severity: str
    summary: str


_RULE_LIST = [
    Rule("config-invalid", "error", "the config, ModelService or ServingLane does not validate, or a lane is refused"),
    Rule("max-model-len-unset", "warning", "neither model.maxModelLen nor scheduler.maxModelLen is set"),
    Rule("max-model-len-above-checkpoint", "error", "model.maxModelLen exceeds the checkpoint's max_position_embeddings"),
    Rule("max-model-len-cap-no-effect", "info", "scheduler.maxModelLen is above model.maxModelLen"),
    Rule("watermark-gap", "warning", "kvCacheRejectWatermark is less than 0.05 above kvCacheHighWatermark"),
    Rule("watermark-high-too-low", "warning", "kvCacheHighWatermark below 0.5 leaves half the KV pool unused"),
    Rule("watermark-too-high", "warning", "kvCacheHighWatermark above 0.95 or kvCacheRejectWatermark above 0.98"),
    Rule("continuous-batching-off", "warning", "engine.continuousBatching is false (static batching)"),
    Rule("prefill-not-chunked", "warning", "a prefill chunk may fill a whole step (prefillChunkSize = maxBatchedTokens)"),
    Rule("prefill-chunk-above-max-model-len", "info", "prefillChunkSize >= the longest request: prompts are never split"),
    Rule("lane-class-missing", "warning", "no lane of class interactive, long-context or batch"),
    Rule("default-lane-unset", "warning", "several lanes and none has default: true"),
    Rule("lane-priority-order", "warning", "a batch lane's priority is not below every interactive lane's"),
    Rule("lane-cap-above-global", "warning", "a lane cap above the global budget has no effect"),
    Rule("lane-match-unreachable", "warning", "match.minPromptTokens is above the longest request allowed"),
    Rule("slo-missing", "warning", "an interactive lane without ttftP95Ms/tpotP95Ms, a long-context lane without ttftP95Ms"),
    Rule("slo-batch-none", "info", "a batch lane declares no SLO (a donor for the tuner)"),
    Rule("slo-e2e-below-ttft", "error", "slo.e2eP95Ms is below slo.ttftP95Ms"),
    Rule("queue-timeout-below-ttft", "error", "a lane's queue timeout is below its TTFT target"),
    Rule("queue-timeout-above-e2e", "warning", "a non-batch lane's queue timeout is above its end-to-end target"),
    Rule("interactive-queue-timeout-long", "warning", "an interactive lane queues requests over 10x its TTFT target"),
    Rule("batch-queue-timeout-short", "warning", "a batch lane's queue timeout is not longer than the interactive lanes'"),
    Rule("stream-idle-timeout-short", "warning", "scheduler.streamIdleTimeoutMs below 1000 ms"),
    Rule("kv-pool-unknown", "info", "the KV pool size is only known at start: KV rules not checked"),
    Rule("kv-pool-below-max-model-len", "error", "the KV pool cannot hold one request of the maximum length"),
    Rule("kv-pool-below-running-set", "warning", "the KV pool below the high watermark has less than one block per running sequence"),
    Rule("kv-batched-tokens-above-pool", "warning", "one step's maxBatchedTokens exceed the KV pool below the high watermark"),
    Rule("kv-long-context-overcommit", "warning", "a long-context lane's running set at full length exceeds the KV pool"),
    Rule("kv-overcommit", "info", "the global running set at full length exceeds the KV pool"),
    Rule("kv-long-context-fits-fp8", "warning",
         "a long-context lane's requests at full length exceed the KV pool, but would fit an fp8 cache"),
    Rule("lane-isolation-off", "warning",
         "an interactive lane with an SLO shares its pool with lower-priority lanes without lane isolation"),
    Rule("tenant-keys-missing", "warning", "several tenants and no API key: any client can claim any tenant"),
    Rule("tenant-without-key", "warning", "API keys are on but a tenant has none: it cannot authenticate"),
    Rule("tenant-key-duplicate", "error", "two tenants share one API key digest"),
    Rule("tenant-lane-unknown", "error", "a tenant's lanes or defaultLane name no ServingLane of the ModelService"),
    Rule("replicas-single", "info", "the ModelService runs one replica"),
    Rule("tuning-without-slo", "warning", "tuning is on but no lane declares an SLO"),
    Rule("model-source-without-cache", "warning",
         "a huggingFace or s3 model source with more than one replica and no model cache: each pod downloads it"),
    Rule("rollout-without-prometheus", "info", "no tuning.prometheusUrl: the rollout guard checks readiness only"),
    Rule("parallel-tensor-above-node", "warning", "tensorParallelSize above 8: more GPUs in one pod than most nodes have"),
    Rule("parallel-tensor-heads", "error", "tensorParallelSize does not divide the checkpoint's attention heads"),
    Rule("parallel-pipeline-above-layers", "error", "pipelineParallelSize exceeds the checkpoint's layers"),
    Rule("alerts-not-found", "warning", "no Prometheus alert rules were given or found"),
    Rule("alerts-missing", "warning", "the alert rules lack alerts the checklist needs"),
]
RULES: dict[str, Rule] = {rule.id: rule for rule in _RULE_LIST}


@dataclass(frozen=True)
class Finding:
    rule: str
    severity: str
    object: str  # "runtime.yaml", "ModelService ns/name", "ServingLane ns/name", "alerts"
    key: str  # the key concerned, in the object's own terms ("spec.budgets.queueTimeoutMs")
    message: str
    fix: str
    lane: Optional[str] = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Problem:
    """What a rule reports, keyed in runtime.yaml terms; the subject turns it into a Finding."""

    rule: str
    key: str  # "scheduler.maxModelLen", "lanes[batch].queueTimeoutMs", "tenants[a].apiKeySha256", "lanes"
    message: str
    fix: str
    lane: Optional[str] = None


# --------------------------------------------------------------------------- what is checked


@dataclass(frozen=True)
class Checkpoint:
    """The few checkpoint dimensions the KV rules need (from a Hugging Face config.json)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: Optional[int]
    num_attention_heads: Optional[int] = None

    def kv_bytes_per_block(self, block_size: int, dtype_bytes: int) -> int:
        # Same formula as the runtime's kv_cache_bytes_per_block: K and V, every layer.
        return 2 * self.num_layers * block_size * self.num_kv_heads * self.head_dim * dtype_bytes


_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8_e4m3": 1, "fp8_e5m2": 1}


@dataclass
class Subject:
    """One serving unit: a runtime.yaml, or a ModelService with the pools it renders."""

    label: str
    configs: list[RuntimeConfig]  # configs[0] serves the shared pool; others are dedicated pools
    locate: Callable[[Problem], tuple[str, str]]  # -> (object, key) of a Finding
    on_cpu: Optional[bool] = None  # None: not known before start (device auto)
    checkpoint: Optional[Checkpoint] = None
    spec: Optional[dict] = None  # the ModelService spec (defaulted), manifests only
    lane_names: list[str] = field(default_factory=list)  # every admitted lane, manifests only

    @property
    def shared(self) -> RuntimeConfig:
        return self.configs[0]

    def lanes(self) -> Iterator[tuple[RuntimeConfig, LaneConfig]]:
        """Every lane with the config of the pool serving it. With only dedicated lanes the
        shared pool's implicit `default` lane serves nothing a user declared: it is left out."""
        for config in self.configs:
            for lane in config.lanes:
                if self.declares(lane):
                    yield config, lane

    def declares(self, lane: LaneConfig) -> bool:
        return not self.lane_names or lane.name in self.lane_names


# --------------------------------------------------------------------------- the rules


def _camel(attr: str) -> str:
    head, *rest = attr.split("_")
    return head + "".join(part.capitalize() for part in rest)


def _max_model_len(subject: Subject, config: RuntimeConfig) -> Optional[int]:
    """The longest request the runtime will take, where it can be known without starting it."""
    limits = [v for v in (config.model.max_model_len, config.scheduler.max_model_len) if v]
    if not config.model.max_model_len and subject.checkpoint and subject.checkpoint.max_position_embeddings:
        limits.append(subject.checkpoint.max_position_embeddings)
    return min(limits) if limits else None


def _pool_blocks(subject: Subject, config: RuntimeConfig) -> Optional[int]:
    engine = config.engine
    if engine.kv_cache_blocks:
        return engine.kv_cache_blocks
    if engine.executor != "model" or not subject.on_cpu or not subject.checkpoint:
        return None
    # The cache's dtype: engine.kvCacheDtype, else the model's (auto on CPU = float32).
    kv_dtype = engine.kv_cache_dtype if engine.kv_cache_dtype != "auto" else config.model.dtype
    dtype_bytes = _DTYPE_BYTES.get(kv_dtype, 4)
    per_block = subject.checkpoint.kv_bytes_per_block(engine.block_size, dtype_bytes)
    return int(engine.cpu_kv_cache_gib * 2**30 // per_block)


def rule_max_model_len(subject: Subject) -> Iterator[Problem]:
    config = subject.shared
    model_len, sched_len = config.model.max_model_len, config.scheduler.max_model_len
    ckpt = subject.checkpoint
    if not model_len and not sched_len:
        default = (f"the checkpoint's max_position_embeddings ({ckpt.max_position_embeddings})"
                   if ckpt and ckpt.max_position_embeddings else "the checkpoint's max_position_embeddings")
        yield Problem("max-model-len-unset", "model.maxModelLen",
                      f"no maximum request length: it defaults to {default}, so one request may take a "
                      "large share of the KV pool",
                      "set model.maxModelLen to the longest prompt + output you mean to serve")
    if model_len and ckpt and ckpt.max_position_embeddings and model_len > ckpt.max_position_embeddings:
        yield Problem("max-model-len-above-checkpoint", "model.maxModelLen",
                      f"maxModelLen {model_len} exceeds the checkpoint's max_position_embeddings "
                      f"{ckpt.max_position_embeddings}: the runtime refuses to start",
                      f"set model.maxModelLen to at most {ckpt.max_position_embeddings}")
    if model_len and sched_len and sched_len > model_len:
        yield Problem("max-model-len-cap-no-effect", "scheduler.maxModelLen",
                      f"scheduler.maxModelLen {sched_len} is above model.maxModelLen {model_len}; the smaller wins",
                      "lower scheduler.maxModelLen or remove it")


def rule_watermarks(subject: Subject) -> Iterator[Problem]:
    s = subject.shared.scheduler
    high, reject = s.kv_cache_high_watermark, s.kv_cache_reject_watermark
    if reject - high < MIN_WATERMARK_GAP - 1e-9:
        yield Problem("watermark-gap", "scheduler.kvCacheRejectWatermark",
                      f"reject watermark {reject} is only {reject - high:.2f} above the high watermark {high}: "
                      "running decodes keep growing after prefills stop, so the pool crosses the reject "
                      "watermark at once and new requests get 503 in bursts",
                      f"keep kvCacheRejectWatermark at least {MIN_WATERMARK_GAP} above kvCacheHighWatermark "
                      "(defaults 0.88 / 0.95)")
    if high < MIN_HIGH_WATERMARK:
        yield Problem("watermark-high-too-low", "scheduler.kvCacheHighWatermark",
                      f"high watermark {high}: no new prefill starts once {high:.0%} of the KV pool is used, "
                      "so the rest of the pool serves only running decodes",
                      "raise kvCacheHighWatermark (default 0.88); lower maxActiveSequences to relieve memory instead")
    if high > MAX_HIGH_WATERMARK or reject > MAX_REJECT_WATERMARK:
        yield Problem("watermark-too-high", "scheduler.kvCacheHighWatermark" if high > MAX_HIGH_WATERMARK
                      else "scheduler.kvCacheRejectWatermark",
                      f"watermarks {high} / {reject}: prefills start and requests are admitted until the pool "
                      "is nearly full, leaving running decodes no room to grow (preemptions, recomputation)",
                      f"keep kvCacheHighWatermark <= {MAX_HIGH_WATERMARK} and kvCacheRejectWatermark <= "
                      f"{MAX_REJECT_WATERMARK}")


def rule_batching(subject: Subject) -> Iterator[Problem]:
    config = subject.shared
    s = config.scheduler
    if not config.engine.continuous_batching:
        yield Problem("continuous-batching-off", "engine.continuousBatching",
                      "static batching: a new batch starts only when the whole previous one finished; "
                      "short requests wait for the longest one",
                      "set engine.continuousBatching: true (false is the rollback lever, not a serving mode)")
    if s.prefill_chunk_size >= s.max_batched_tokens:
        yield Problem("prefill-not-chunked", "scheduler.prefillChunkSize",
                      f"prefillChunkSize {s.prefill_chunk_size} equals maxBatchedTokens {s.max_batched_tokens}: "
                      "one long prompt can fill a whole step and every running stream waits for it (TPOT spikes)",
                      "set prefillChunkSize to a fraction of maxBatchedTokens (the default is 2048 of 8192)")
    # A lane's chunk is capped by the global one (lane_budgets), so the global check covers the lanes.
    max_len = _max_model_len(subject, config)
    if max_len and s.prefill_chunk_size >= max_len:
        yield Problem("prefill-chunk-above-max-model-len", "scheduler.prefillChunkSize",
                      f"prefillChunkSize {s.prefill_chunk_size} >= the longest request ({max_len} tokens): "
                      "every prompt is prefilled in one step, chunking never applies",
                      f"lower prefillChunkSize below {max_len} if long prompts stall decodes")


def rule_lanes(subject: Subject) -> Iterator[Problem]:
    lanes = [lane for _, lane in subject.lanes()]
    classes = {lane.lane_class for lane in lanes}
    for lane_class in LANE_CLASSES:
        if lane_class not in classes:
            yield Problem("lane-class-missing", "lanes",
                          f"no {lane_class} lane: {_CLASS_WHY[lane_class]}",
                          f"add a lane with class: {lane_class} ({_CLASS_FIX[lane_class]})")
    shared = [lane for lane in subject.shared.lanes if subject.declares(lane)]
    if len(shared) > 1 and not any(lane.default for lane in shared):
        yield Problem("default-lane-unset", "lanes",
                      f"no lane has default: true, so the first lane ({shared[0].name}) takes every request "
                      "that names no lane and matches no rule",
                      "set default: true on the lane that should take unclassified traffic (usually interactive)")
    interactive = [lane for lane in lanes if lane.lane_class == "interactive"]
    for lane in lanes:
        if lane.lane_class != "batch":
            continue
        above = [i.name for i in interactive if lane.priority >= i.priority]
        if above:
            yield Problem("lane-priority-order", f"lanes[{lane.name}].priority",
                          f"batch lane priority {lane.priority} is not below interactive lane(s) {above}: batch "
                          "work is served first (or level) and preempted last",
                          "give the batch lane a lower priority than every interactive lane (e.g. 10 vs 100)",
                          lane=lane.name)
    for config, lane in subject.lanes():
        # Every budget of RuntimeConfig.lane_budgets: a lane value above the one in force is a
        # cap the global budget overrides (a replacing knob, queueTimeoutMs, never is).
        budgets = config.lane_budgets(lane.name)
        for f in dataclasses.fields(budgets):
            cap, in_force = getattr(lane, f.name, None), getattr(budgets, f.name)
            if cap is not None and cap > in_force:
                key = _camel(f.name)
                yield Problem("lane-cap-above-global", f"lanes[{lane.name}].{key}",
                              f"lane cap {key}={cap} is above the global {getattr(config.scheduler, f.name)}; "
                              f"{in_force} applies",
                              f"lower the lane's {key} to at most {in_force}, or raise scheduler.{key}",
                              lane=lane.name)
        max_len = _max_model_len(subject, config)
        min_prompt = lane.match.min_prompt_tokens
        if max_len and min_prompt and min_prompt >= max_len:
            yield Problem("lane-match-unreachable", f"lanes[{lane.name}].match.minPromptTokens",
                          f"match.minPromptTokens {min_prompt} is not below the longest request ({max_len}): "
                          "the rule never matches (a request needs room for at least one output token)",
                          f"lower match.minPromptTokens below {max_len}", lane=lane.name)


_CLASS_WHY = {
    "interactive": "chat traffic has no lane whose TTFT is protected",
    "long-context": "long prompts share a lane with short ones and their prefills stall them",
    "batch": "offline work competes with interactive traffic at the same priority",
}
_CLASS_FIX = {
    "interactive": "high priority, default: true, ttftP95Ms/tpotP95Ms",
    "long-context": "match.minPromptTokens, its own prefillChunkSize, or isolation: dedicated",
    "batch": "low priority, long queueTimeoutMs",
}


def rule_slos(subject: Subject) -> Iterator[Problem]:
    for _, lane in subject.lanes():
        slo = lane.slo
        if lane.lane_class == "interactive":
            missing = [k for k, v in (("ttftP95Ms", slo.ttft_p95_ms), ("tpotP95Ms", slo.tpot_p95_ms)) if v is None]
        elif lane.lane_class == "long-context":
            missing = ["ttftP95Ms"] if slo.ttft_p95_ms is None else []
        else:
            missing = []
            if slo.ttft_p95_ms is None and slo.tpot_p95_ms is None and slo.e2e_p95_ms is None:
                yield Problem("slo-batch-none", f"lanes[{lane.name}].slo",
                              "no SLO: the lane's latency is not alerted on and the tuner takes budget from it first",
                              "fine for best-effort work; else set slo.e2eP95Ms", lane=lane.name)
        if missing:
            yield Problem("slo-missing", f"lanes[{lane.name}].slo.{missing[0]}",
                          f"{lane.lane_class} lane without {' and '.join(missing)}: no SLO alert fires for it and "
                          "the tuner cannot protect it",
                          f"set slo.{' and slo.'.join(missing)} (p95 targets in ms)", lane=lane.name)
        if slo.e2e_p95_ms is not None and slo.ttft_p95_ms is not None and slo.e2e_p95_ms < slo.ttft_p95_ms:
            yield Problem("slo-e2e-below-ttft", f"lanes[{lane.name}].slo.e2eP95Ms",
                          f"e2eP95Ms {slo.e2e_p95_ms:g} is below ttftP95Ms {slo.ttft_p95_ms:g}, but a request's end "
                          "to end time includes its first token",
                          "raise e2eP95Ms above ttftP95Ms (or lower ttftP95Ms)", lane=lane.name)


def rule_timeouts(subject: Subject) -> Iterator[Problem]:
    interactive_timeouts: list[tuple[str, int]] = []
    for config, lane in subject.lanes():
        timeout = config.lane_budgets(lane.name).queue_timeout_ms
        key = f"lanes[{lane.name}].queueTimeoutMs" if lane.queue_timeout_ms else "scheduler.queueTimeoutMs"
        ttft, e2e = lane.slo.ttft_p95_ms, lane.slo.e2e_p95_ms
        if lane.lane_class == "interactive":
            interactive_timeouts.append((lane.name, timeout))
        if ttft is not None and timeout < ttft:
            yield Problem("queue-timeout-below-ttft", key,
                          f"lane {lane.name} times requests out after {timeout} ms in the queue, before its TTFT "
                          f"target of {ttft:g} ms: requests still on target get 504 queue_timeout",
                          f"set the lane's queueTimeoutMs to at least its ttftP95Ms ({ttft:g})", lane=lane.name)
        if e2e is not None and timeout > e2e and lane.lane_class != "batch":
            yield Problem("queue-timeout-above-e2e", key,
                          f"lane {lane.name} keeps requests queued up to {timeout} ms, past its end-to-end target "
                          f"of {e2e:g} ms: a request that old has already missed, and still costs a full answer",
                          f"set the lane's queueTimeoutMs to at most its e2eP95Ms ({e2e:g})", lane=lane.name)
        if (lane.lane_class == "interactive" and ttft is not None
                and timeout > INTERACTIVE_QUEUE_TIMEOUT_FACTOR * ttft):
            yield Problem("interactive-queue-timeout-long", key,
                          f"interactive lane {lane.name} queues requests up to {timeout} ms, over "
                          f"{INTERACTIVE_QUEUE_TIMEOUT_FACTOR}x its TTFT target ({ttft:g} ms): under overload its "
                          "users are gone long before, while the queue keeps growing",
                          f"set the lane's queueTimeoutMs to at most {INTERACTIVE_QUEUE_TIMEOUT_FACTOR * ttft:g} ms "
                          "(fail fast; clients retry)", lane=lane.name)
    longest_interactive = max(interactive_timeouts, key=lambda item: item[1], default=None)
    if longest_interactive:
        for config, lane in subject.lanes():
            if lane.lane_class != "batch":
                continue
            timeout = config.lane_budgets(lane.name).queue_timeout_ms
            if timeout <= longest_interactive[1]:
                yield Problem("batch-queue-timeout-short",
                              f"lanes[{lane.name}].queueTimeoutMs" if lane.queue_timeout_ms else "scheduler.queueTimeoutMs",
                              f"batch lane {lane.name} gives up after {timeout} ms in the queue, no later than "
                              f"interactive lane {longest_interactive[0]} ({longest_interactive[1]} ms), though it is "
                              "served last: under load batch work times out first",
                              "give the batch lane a long queueTimeoutMs (minutes, e.g. 600000)", lane=lane.name)
    idle = subject.shared.scheduler.stream_idle_timeout_ms
    if idle < MIN_STREAM_IDLE_TIMEOUT_MS:
        yield Problem("stream-idle-timeout-short", "scheduler.streamIdleTimeoutMs",
                      f"a streaming client whose network stalls for {idle} ms has its request cancelled",
                      f"set streamIdleTimeoutMs to at least {MIN_STREAM_IDLE_TIMEOUT_MS} (default 10000)")


def rule_kv_pool(subject: Subject) -> Iterator[Problem]:
    config = subject.shared
    blocks = _pool_blocks(subject, config)
    if blocks is None:
        if config.engine.executor != "model":
            why = "the simulated executor sizes it from its profile"
        elif subject.on_cpu:
            why = "the checkpoint's dimensions are unknown (pass --checkpoint DIR with its config.json)"
        elif subject.on_cpu is None:
            why = "engine.device is auto: CPU or GPU is only known at start"
        else:
            why = "it is sized from free GPU memory at start (gpuMemoryUtilization)"
        yield Problem("kv-pool-unknown", "engine.kvCacheBlocks",
                      f"KV budgets not checked: the pool size is not known here; {why}",
                      "set engine.kvCacheBlocks to check offline, or read tokenlane_kv_blocks_total on a running pod")
        return
    s = config.scheduler
    block_size = config.engine.block_size
    pool_tokens = blocks * block_size
    usable_tokens = int(pool_tokens * s.kv_cache_high_watermark)
    max_len = _max_model_len(subject, config)
    where = f"{blocks} blocks x {block_size} = {pool_tokens} tokens"
    if max_len and pool_tokens < max_len:
        yield Problem("kv-pool-below-max-model-len", "model.maxModelLen",
                      f"the KV pool ({where}) cannot hold one request of maxModelLen {max_len}",
                      f"lower maxModelLen to at most {pool_tokens}, or grow the pool (kvCacheBlocks, cpuKvCacheGib, "
                      "gpuMemoryUtilization)")
    if int(blocks * s.kv_cache_high_watermark) < s.max_active_sequences:
        yield Problem("kv-pool-below-running-set", "scheduler.maxActiveSequences",
                      f"below the high watermark the pool has {int(blocks * s.kv_cache_high_watermark)} blocks, "
                      f"fewer than maxActiveSequences {s.max_active_sequences}: the running set can never fill",
                      "lower maxActiveSequences or grow the pool")
    if s.max_batched_tokens > usable_tokens:
        yield Problem("kv-batched-tokens-above-pool", "scheduler.maxBatchedTokens",
                      f"maxBatchedTokens {s.max_batched_tokens} exceeds the pool below the high watermark "
                      f"({usable_tokens} tokens): steps that large never happen",
                      f"lower maxBatchedTokens to at most {usable_tokens}")
    if not max_len:
        return
    for config_, lane in subject.lanes():
        if lane.lane_class != "long-context":
            continue
        running = config_.lane_budgets(lane.name).max_active_sequences
        if running * max_len > usable_tokens:
            fits = max(1, usable_tokens // max_len)
            yield Problem("kv-long-context-overcommit", f"lanes[{lane.name}].maxActiveSequences",
                          f"{running} running long-context requests of up to {max_len} tokens need "
                          f"{running * max_len} tokens; the pool holds {usable_tokens} below the high watermark: "
                          "a burst of long prompts ends in preemption and recomputation",
                          f"cap the lane's maxActiveSequences at {fits}, lower maxModelLen, or grow the pool",
                          lane=lane.name)
    demand = s.max_active_sequences * max_len
    if demand > usable_tokens:
        yield Problem("kv-overcommit", "scheduler.maxActiveSequences",
                      f"a full running set of maximum-length requests ({s.max_active_sequences} x {max_len} tokens) "
                      f"is {demand / usable_tokens:.1f}x the pool below the high watermark ({usable_tokens} tokens); "
                      "usual for mixed traffic, the watermarks and preemption absorb it",
                      "lower maxActiveSequences if your requests are mostly long")


def _fp8_pool_blocks(subject: Subject, config: RuntimeConfig) -> Optional[int]:
    """The pool an fp8 cache would get from the same bytes; None where the pool is not sized in
    bytes here (an explicit kvCacheBlocks, or a pool only known at start)."""
    engine = config.engine
    if engine.kv_cache_blocks or engine.kv_cache_dtype in FP8_KV_DTYPES or _pool_blocks(subject, config) is None:
        return None
    assert subject.checkpoint is not None  # _pool_blocks sized it from the checkpoint
    return int(engine.cpu_kv_cache_gib * 2**30 // subject.checkpoint.kv_bytes_per_block(engine.block_size, 1))


def rule_kv_fp8(subject: Subject) -> Iterator[Problem]:
    for config, lane in subject.lanes():
        if lane.lane_class != "long-context":
            continue
        blocks, fp8_blocks, max_len = _pool_blocks(subject, config), _fp8_pool_blocks(subject, config), \
            _max_model_len(subject, config)
        if blocks is None or fp8_blocks is None or not max_len:
            continue
        high = config.scheduler.kv_cache_high_watermark
        block_size = config.engine.block_size
        usable, fp8_usable = int(blocks * block_size * high), int(fp8_blocks * block_size * high)
        running = config.lane_budgets(lane.name).max_active_sequences
        need = running * max_len
        if usable < need <= fp8_usable:
            yield Problem("kv-long-context-fits-fp8", "engine.kvCacheDtype",
                          f"{running} running {lane.name} requests of up to {max_len} tokens need {need} tokens; the "
                          f"pool holds {usable} below the high watermark with kvCacheDtype "
                          f"{config.engine.kv_cache_dtype}, and would hold {fp8_usable} in fp8 (the same bytes, one "
                          "byte per element)",
                          "set engine.kvCacheDtype: fp8_e4m3 (check accuracy on your prompts first: docs/check.md), "
                          "or cap the lane's maxActiveSequences", lane=lane.name)


def rule_isolation(subject: Subject) -> Iterator[Problem]:
    for config in subject.configs:
        lanes = [lane for lane in config.lanes if subject.declares(lane)]
        for lane in lanes:
            if lane.lane_class != "interactive" or (lane.slo.ttft_p95_ms is None and lane.slo.tpot_p95_ms is None):
                continue
            below = [other.name for other in lanes if other.priority < lane.priority]
            if not below:
                continue
            if config.scheduler.step_time_budget != "auto":
                yield Problem("lane-isolation-off", "scheduler.stepTimeBudget",
                              f"interactive lane {lane.name} shares its pool with {below} and every step may take as "
                              "long as their prefills make it: a long-prompt flood pushes its TPOT and TTFT past "
                              "target",
                              "set scheduler.stepTimeBudget: auto (steps stay within the tightest TPOT target; "
                              "lower-priority prefills yield)", lane=lane.name)
            if not lane.kv_cache_reserved:
                yield Problem("lane-isolation-off", f"lanes[{lane.name}].kvCacheReserved",
                              f"interactive lane {lane.name} has no KV reserve: {below} can fill the KV cache past "
                              "the high watermark, and then no interactive prefill starts",
                              f"set the lane's kvCacheReserved (e.g. {ISOLATION_KV_RESERVE}: a share of the KV "
                              "blocks no other lane may take)", lane=lane.name)


def rule_tenants(subject: Subject) -> Iterator[Problem]:
    tenants = subject.shared.tenants
    if subject.spec is not None:  # the ModelService's tenants, before the operator filters them per pool
        tenants_raw = subject.spec.get("tenants") or []
        names = set(subject.lane_names)
        for t in tenants_raw:
            unknown = [lane for lane in (t.get("lanes") or []) if lane not in names]
            if t.get("defaultLane") and t["defaultLane"] not in names:
                unknown.append(t["defaultLane"])
            if unknown:
                yield Problem("tenant-lane-unknown", f"tenants[{t['name']}].lanes",
                              f"tenant {t['name']} names lane(s) {sorted(set(unknown))} that no admitted ServingLane "
                              f"serves (lanes: {sorted(names)}); the operator drops them silently",
                              "fix the lane names, or create the ServingLanes they refer to")
        keyed = [(t["name"], t.get("apiKeySha256")) for t in tenants_raw]
    else:
        keyed = [(t.name, t.api_key_sha256) for t in tenants]
    with_key = [name for name, key in keyed if key]
    if len(keyed) > 1 and not with_key:
        yield Problem("tenant-keys-missing", "tenants",
                      f"{len(keyed)} tenants and no API key: the server is open and any client picks its tenant "
                      "(and so its lanes and quotas) with the X-Tenant header",
                      "set apiKeySha256 on every tenant (sha256 of the key; never the key itself)")
    if with_key:
        for name, key in keyed:
            if not key:
                yield Problem("tenant-without-key", f"tenants[{name}].apiKeySha256",
                              f"API keys are on, but tenant {name} has none: no request can authenticate as it",
                              "set the tenant's apiKeySha256, or remove the tenant")
    by_key: dict[str, list[str]] = {}
    for name, key in keyed:
        if key:
            by_key.setdefault(key, []).append(name)
    for key, names_ in by_key.items():
        if len(names_) > 1:
            yield Problem("tenant-key-duplicate", f"tenants[{names_[1]}].apiKeySha256",
                          f"tenants {names_} share one API key digest: requests with that key are attributed to "
                          "one of them only",
                          "give each tenant its own key")


def rule_model_service(subject: Subject) -> Iterator[Problem]:
    spec = subject.spec
    if spec is None:
        return
    if spec.get("replicas", 1) == 1:
        yield Problem("replicas-single", "replicas",
                      "one replica: a pod restart or node drain stops serving until it is back",
                      "run at least 2 replicas (the rendered PodDisruptionBudget then keeps one up)")
    model = spec.get("model") or {}
    fetched = [k for k in ("huggingFace", "s3") if k in (model.get("source") or {})]
    autoscaling = spec.get("autoscaling") or {}
    most = max(spec.get("replicas", 1), autoscaling.get("maxReplicas") or 0 if autoscaling.get("enabled") else 0)
    if fetched and not model.get("cache") and most > 1:
        yield Problem("model-source-without-cache", "model.cache",
                      f"up to {most} pods each download the whole checkpoint from the {fetched[0]} source at start: "
                      "slow cold starts, and the source's rate limits or egress costs multiplied",
                      "set model.cache (a ReadWriteMany pvc shared by the replicas, or nodeLocal) so a revision "
                      "is downloaded once")
    tuning = spec.get("tuning") or {}
    if not tuning.get("prometheusUrl"):
        yield Problem("rollout-without-prometheus", "tuning.prometheusUrl",
                      "without Prometheus the rollout guard verifies pod readiness only: a spec change that makes "
                      "a lane miss its SLO is not rolled back",
                      "set tuning.prometheusUrl (tuning itself may stay disabled)")
    if tuning.get("enabled"):
        slos = [lane.slo for _, lane in subject.lanes()]
        if not any(s.ttft_p95_ms or s.tpot_p95_ms or s.e2e_p95_ms for s in slos):
            yield Problem("tuning-without-slo", "tuning.enabled",
                          "tuning is on but no lane declares an SLO: the tuner has no target and never moves a budget",
                          "declare slo targets on the lanes, or set tuning.enabled: false")


# GPUs per node of the common GPU servers; more in one pod may never be scheduled.
GPUS_PER_NODE = 8


def rule_parallelism(subject: Subject) -> Iterator[Problem]:
    """What can be seen before start of engine.tensorParallelSize / pipelineParallelSize
    (spec.parallelism): the runtime refuses the checkpoint mismatches at start too."""
    engine = subject.shared.engine
    tensor, pipeline = engine.tensor_parallel_size or 1, engine.pipeline_parallel_size or 1
    if tensor > GPUS_PER_NODE and subject.on_cpu is not True:
        yield Problem("parallel-tensor-above-node", "engine.tensorParallelSize",
                      f"{tensor} tensor-parallel ranks, one GPU each, in one pod: few nodes have more than "
                      f"{GPUS_PER_NODE} GPUs, so the pod may never be scheduled",
                      f"keep tensorParallelSize at the GPUs of one node (<= {GPUS_PER_NODE}) and split the rest "
                      "into pipelineParallelSize stages, one pod each")
    ckpt = subject.checkpoint
    if ckpt is None:
        return
    if ckpt.num_attention_heads and ckpt.num_attention_heads % tensor:
        yield Problem("parallel-tensor-heads", "engine.tensorParallelSize",
                      f"tensorParallelSize {tensor} does not divide the checkpoint's {ckpt.num_attention_heads} "
                      "attention heads: the runtime refuses to start",
                      "pick a divisor of the attention heads")
    if pipeline > ckpt.num_layers:
        yield Problem("parallel-pipeline-above-layers", "engine.pipelineParallelSize",
                      f"pipelineParallelSize {pipeline} exceeds the checkpoint's {ckpt.num_layers} layers: a stage "
                      "would hold none, and the runtime refuses to start",
                      f"use at most {ckpt.num_layers} stages")


CONFIG_RULES: list[Callable[[Subject], Iterable[Problem]]] = [
    rule_max_model_len, rule_watermarks, rule_batching, rule_lanes, rule_slos, rule_timeouts, rule_kv_pool,
    rule_kv_fp8, rule_isolation, rule_tenants, rule_model_service, rule_parallelism,
]


def check_subject(subject: Subject) -> list[Finding]:
    findings: list[Finding] = []
    for rule in CONFIG_RULES:
        for problem in rule(subject):
            obj, key = subject.locate(problem)
            findings.append(Finding(problem.rule, RULES[problem.rule].severity, obj, key, problem.message,
                                    problem.fix, problem.lane))
    return findings


# --------------------------------------------------------------------------- alert rules


@dataclass
class AlertRules:
    """The alert names found, and where (None: nothing was given or found)."""

    names: set[str]
    source: str


def alert_names(docs: Iterable[Any]) -> set[str]:
    """Alert names of PrometheusRule objects and plain Prometheus rule files."""
    names: set[str] = set()
    for doc in docs:
        if not isinstance(doc, dict):
            continue
        groups = (doc.get("spec") or {}).get("groups") if doc.get("kind") == "PrometheusRule" else doc.get("groups")
        for group in groups or []:
            for rule in (group or {}).get("rules") or []:
                if isinstance(rule, dict) and rule.get("alert"):
                    names.add(str(rule["alert"]))
    return names


def check_alerts(alerts: Optional[AlertRules], *, operator: bool, absent_why: str = "") -> list[Finding]:
    needed = list(RUNTIME_ALERTS) + (list(OPERATOR_ALERTS) if operator else [])
    if alerts is None or not alerts.names:
        where = alerts.source if alerts else "alerts"
        why = absent_why or ("no alert rules given (--alerts) or found next to the input"
                             if alerts is None else f"{alerts.source} holds no alert rules")
        return [Finding("alerts-not-found", RULES["alerts-not-found"].severity, where, "groups",
                        f"{why}: nobody is paged when a lane misses its SLO or the KV cache fills",
                        "install manifests/monitoring (PrometheusRule) or prometheus/tokenlane-rules.yaml, and "
                        "pass it with --alerts")]
    missing = [name for name in needed if name not in alerts.names]
    if not missing:
        return []
    return [Finding("alerts-missing", RULES["alerts-missing"].severity, alerts.source, "groups",
                    f"missing alert(s): {', '.join(missing)}",
                    "take the rules from manifests/monitoring/prometheusrule.yaml (same names, runbooks in "
                    "docs/operations.md)")]
