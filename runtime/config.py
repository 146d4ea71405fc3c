"""The runtime configuration file (`runtime.yaml`): one validated dataclass per section.

This module is the contract between the operator (which renders the file into a ConfigMap)
and the runtime (which reads and hot-reloads it). It must import without torch: the operator
image does not ship it. Keys in the file are camelCase, mirroring the CRD fields; attributes
here are snake_case. User mistakes raise `ConfigError` (a `ValueError`) naming the key.

Sections: `model` and `engine` need a restart to change (but `model.adapters`, the LoRA
adapters, which hot-reload); `scheduler`, `lanes` and `tenants` are hot-reloadable
(docs/architecture.md, "Contracts").

`KNOBS` is the one table of budget knobs (the numeric limits of `scheduler:` and `lanes[]`):
the lane caps, `RuntimeConfig.lane_budgets`, the metrics' `budget` label, the operator's
builders, tuner and rollout fallback, the CRD schemas and the docs' knob tables all derive
from it (tests/runtime/test_knobs.py fails when one of them does not).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

LANE_CLASSES = ("interactive", "long-context", "batch")
POLICIES = ("decode-first", "mixed")
STEP_TIME_BUDGETS = ("off", "auto")
DTYPES = ("auto", "float32", "float16", "bfloat16")
DEVICES = ("auto", "cpu", "cuda")
ATTENTION_BACKENDS = ("auto", "torch", "triton", "native")
EXECUTORS = ("model", "simulated")
CPU_COMPUTE_DTYPES = ("auto", "model", "float32")  # engine.cpuComputeDtype (runtime/executor/cpu_dense.py)
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "fp8_e4m3", "fp8_e5m2")  # engine.kvCacheDtype
MAX_CUDA_GRAPH_BATCH = 512  # engine.cudaGraphMaxBatch: static buffers and start-up grow with it

_NAME_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
ADAPTER_NAME_RE = re.compile(r"^[a-z0-9](?:[-a-z0-9._]{0,126}[a-z0-9])?$")


class ConfigError(ValueError):
    """A user-facing configuration mistake; the message names the offending key."""


def _camel(name: str) -> str:
    if name == "lane_class":  # `class` is a Python keyword
        return "class"
    head, *rest = name.split("_")
    return head + "".join(part[:1].upper() + part[1:] for part in rest)


def _check(cond: bool, where: str, message: str) -> None:
    if not cond:
        raise ConfigError(f"{where}: {message}")


def _convert(value: Any, tp: Any, where: str) -> Any:
    """Convert a YAML value to the annotated type, or raise ConfigError naming `where`."""
    origin = typing.get_origin(tp)
    if origin is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _convert(value, args[0], where)
    if dataclasses.is_dataclass(tp):
        return _from_dict(tp, value, where)
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        _check(isinstance(value, list), where, f"expected a list, got {type(value).__name__}")
        return [_convert(v, item_tp, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        _check(isinstance(value, dict), where, f"expected a mapping, got {type(value).__name__}")
        return {str(k): str(v) for k, v in value.items()}
    if tp is bool:
        _check(isinstance(value, bool), where, f"expected true/false, got {value!r}")
        return value
    if tp is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
        _check(ok, where, f"expected an integer, got {value!r}")
        return value
    if tp is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        _check(ok, where, f"expected a number, got {value!r}")
        return float(value)
    if tp is str:
        _check(isinstance(value, str), where, f"expected a string, got {value!r}")
        return value
    raise AssertionError(f"unsupported config type {tp!r} at {where}")


def _from_dict(cls: type, data: Any, where: str) -> Any:
    _check(isinstance(data, dict), where, f"expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    by_key = {_camel(f.name): f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(by_key))
    _check(not unknown, where, f"unknown key(s) {unknown}; known: {sorted(by_key)}")
    kwargs = {}
    for key, value in data.items():
        f = by_key[key]
        kwargs[f.name] = _convert(value, hints[f.name], f"{where}.{key}")
    missing = [
        _camel(f.name)
        for f in dataclasses.fields(cls)
        if f.name not in kwargs
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING  # type: ignore[misc]
    ]
    _check(not missing, where, f"missing required key(s) {missing}")
    try:
        return cls(**kwargs)
    except ConfigError as exc:
        raise ConfigError(f"{where}.{exc}") from None


def _to_dict(obj: Any) -> Any:
    """camelCase dict of a config dataclass, dropping None values (canonical form)."""
    if dataclasses.is_dataclass(obj):
        out = {}
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if value is None:
                continue
            out[_camel(f.name)] = _to_dict(value)
        return out
    if isinstance(obj, list):
        return [_to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: _to_dict(v) for k, v in obj.items()}
    return obj


def _positive(value: Optional[float], key: str, *, allow_zero: bool = False) -> None:
    if value is None:
        return
    ok = value >= 0 if allow_zero else value > 0
    _check(ok, key, f"must be {'>= 0' if allow_zero else '> 0'}, got {value}")


def _snake(key: str) -> str:
    return "".join("_" + c.lower() if c.isupper() else c for c in key)


# --------------------------------------------------------------------------- budget knobs

# Where a knob lives: the global `scheduler:` section, each entry of `lanes:`, or both.
SCHEDULER, LANE, BOTH = "scheduler", "lane", "both"
# How a lane's value meets the global one (knobs in BOTH): the smaller wins, or the lane's
# value replaces the global one (a batch lane may wait longer than the global queue timeout).
CAP_MIN, CAP_REPLACE = "min", "replace"

# engine.cpuBind's grammar; the placement itself is runtime/executor/cpu_placement.py.
MAX_CPU = 4096


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """"0-3,8" -> (0, 1, 2, 3, 8), in the order written. ValueError on anything else, a
    reversed range or a CPU listed twice."""
    cpus: list[int] = []
    for part in text.split(","):
        part = part.strip()
        first, dash, last = part.partition("-")
        if not first.strip().isdigit() or (dash and not last.strip().isdigit()):
            raise ValueError(f"{text!r} is not a CPU list like '0-3,8' (bad part {part!r})")
        lo, hi = int(first), int(last) if dash else int(first)
        if hi < lo:
            raise ValueError(f"{text!r}: range {part!r} runs backwards")
        if hi >= MAX_CPU:
            raise ValueError(f"{text!r}: CPU {hi} is out of range (< {MAX_CPU})")
        cpus.extend(range(lo, hi + 1))
    seen = set()
    for cpu in cpus:
        if cpu in seen:
            raise ValueError(f"{text!r} lists CPU {cpu} twice")
        seen.add(cpu)
    return tuple(cpus)


def format_cpu_list(cpus) -> str:
    """(0, 1, 2, 5) -> "0-2,5" (sorted)."""
    out: list[str] = []
    run: list[int] = []
    for cpu in sorted(cpus):
        if run and cpu == run[-1] + 1:
            run.append(cpu)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [cpu]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def check_cpu_bind(setting: Optional[str], cpu_threads: Optional[int]) -> None:
    """ValueError unless `setting` is unset, auto, none or a CPU list whose length is
    `cpuThreads` (when that is set too)."""
    if setting is None or setting in ("auto", "none"):
        return
    cpus = parse_cpu_list(setting)
    if cpu_threads is not None and cpu_threads != len(cpus):
        raise ValueError(f"lists {len(cpus)} CPUs but cpuThreads is {cpu_threads}: one compute "
                         f"thread runs on each listed CPU (leave cpuThreads unset)")


@dataclass(frozen=True)
class Knob:
    """One budget knob: a numeric limit of `scheduler:` and/or `lanes[]`.

    Its default is the SchedulerConfig field's; a lane's value is optional (unset: the global
    value is in force).
    """

    key: str  # camelCase key in runtime.yaml and in the CRDs; the attribute is its snake_case
    scope: str  # SCHEDULER | LANE | BOTH
    cap: Optional[str]  # BOTH: CAP_MIN or CAP_REPLACE; else None
    type: type  # int | float
    minimum: float  # CRD schema range (the runtime checks int knobs are > 0)
    maximum: Optional[float]
    doc: str  # CRD description of the global key
    lane_doc: str = ""  # CRD description of the lane key
    exclusive_minimum: bool = False
    tuner_step: Optional[float] = None  # the operator's tuner may move it, in steps of this; None: never
    lane_default: Optional[float] = None  # LANE scope: the value in force when a lane leaves it unset
    fallback_scaled: bool = False  # the Conservative fallback profile scales its global value down
    attr: str = field(init=False)  # the snake_case attribute on the config dataclasses

    def __post_init__(self) -> None:
        object.__setattr__(self, "attr", _snake(self.key))  # computed once: lane_budgets runs per request
        assert self.scope in (SCHEDULER, LANE, BOTH), self
        assert (self.cap in (CAP_MIN, CAP_REPLACE)) == (self.scope == BOTH), self
        assert bool(self.lane_doc) == self.in_lane, self

    @property
    def in_scheduler(self) -> bool:
        return self.scope in (SCHEDULER, BOTH)

    @property
    def in_lane(self) -> bool:
        return self.scope in (LANE, BOTH)

    def effective(self, lane_value: Any, global_value: Any) -> Any:
        """A lane's value in force, given its own (None: unset) and the global one."""
        if lane_value is None or self.scope == LANE:
            return global_value if lane_value is None else lane_value
        return min(lane_value, global_value) if self.cap == CAP_MIN else lane_value


KNOBS: tuple[Knob, ...] = (
    Knob("maxActiveSequences", BOTH, CAP_MIN, int, 1, 65536, "Running sequences per step.",
         "Running sequences of this lane per step.", tuner_step=1, fallback_scaled=True),
    Knob("maxWaitingRequests", BOTH, CAP_MIN, int, 1, 1048576,
         "Queued requests over all lanes; beyond it requests get 429.", "Queue length of this lane; beyond it 429.",
         tuner_step=1),
    Knob("maxBatchedTokens", BOTH, CAP_MIN, int, 1, 1048576, "Tokens per step (decodes plus prefill chunks).",
         "Tokens of this lane per step.", tuner_step=16, fallback_scaled=True),
    Knob("maxModelLen", SCHEDULER, None, int, 1, None, "Optional extra cap on prompt + output tokens."),
    Knob("prefillChunkSize", BOTH, CAP_MIN, int, 1, 1048576,
         "Largest prefill chunk per request per step (chunked prefill).",
         "Largest prefill chunk of this lane's requests.", tuner_step=16, fallback_scaled=True),
    Knob("queueTimeoutMs", BOTH, CAP_REPLACE, int, 1, None, "A request waiting longer in its queue gets 504.",
         "Queue timeout of this lane (replaces the global one); then 504."),
    Knob("streamIdleTimeoutMs", SCHEDULER, None, int, 1, None, "A stalled stream consumer is cancelled after this."),
    Knob("kvCacheHighWatermark", SCHEDULER, None, float, 0, 1, "KV pool usage above which no new prefill starts.",
         exclusive_minimum=True, tuner_step=0.01),
    Knob("kvCacheRejectWatermark", SCHEDULER, None, float, 0, 1, "KV pool usage above which new requests get 503.",
         exclusive_minimum=True),
    # Lane isolation (docs/tuning.md, "Lane isolation"): shares of the KV pool's blocks.
    Knob("maxKvCacheShare", LANE, None, float, 0, 1, "",
         "Largest share of the KV cache's blocks this lane's requests may hold.",
         exclusive_minimum=True, tuner_step=0.01, lane_default=1.0),
    Knob("kvCacheReserved", LANE, None, float, 0, 1, "",
         "Share of the KV cache's blocks kept for this lane: other lanes never take it.",
         tuner_step=0.01, lane_default=0.0),
)
SCHEDULER_KNOBS = tuple(k for k in KNOBS if k.in_scheduler)
LANE_KNOBS = tuple(k for k in KNOBS if k.in_lane)
TUNED_KNOBS = tuple(k for k in KNOBS if k.tuner_step is not None)
FALLBACK_SCALED_KEYS = tuple(k.key for k in KNOBS if k.fallback_scaled)
_KNOB_BY_KEY = {k.key: k for k in KNOBS}


def knob(key: str) -> Knob:
    """The knob of a camelCase key; KeyError if it is not a budget knob."""
    return _KNOB_BY_KEY[key]


def _check_int_knobs(section: Any, knobs: tuple[Knob, ...]) -> None:
    for k in knobs:
        if k.type is int:
            _positive(getattr(section, k.attr), k.key)


# --------------------------------------------------------------------------- sections


# engine.maxLoraRank's ceiling and the LoRA target modules a PEFT adapter may name (multi-LoRA,
# docs/lora.md): the short names of the attention and MLP projections.
MAX_LORA_RANK = 512
DEFAULT_MAX_LORAS = 8
DEFAULT_MAX_LORA_RANK = 64
LORA_TARGET_MODULES = ("q", "k", "v", "o", "gate", "up", "down")


@dataclass(frozen=True)
class AdapterConfig:
    """One entry of `model.adapters:` — a PEFT LoRA adapter served next to the base model
    under its own model name (hot-reloadable: adding or removing one needs no restart)."""

    name: str  # the model name requests select it by; DNS-1123-ish
    # A local PEFT folder (adapter_config.json + adapter_model.safetensors), or a source URI
    # (hf://ORG/NAME[@REV], s3://BUCKET/PREFIX) fetched into model.adapterCacheDir at load time.
    path: str

    def __post_init__(self) -> None:
        _check(bool(ADAPTER_NAME_RE.match(self.name)), "name",
               f"{self.name!r} is not a valid adapter name (lowercase letters, digits, '-', '.', '_'; "
               "starts and ends with a letter or digit; at most 128 characters)")
        _check(bool(self.path.strip()), "path", "must not be empty")


@dataclass(frozen=True)
class ModelConfig:
    """`model:` — which checkpoint to serve (restart to change; `adapters` hot-reload)."""

    path: str  # local Hugging Face checkpoint folder (config.json + safetensors + tokenizer)
    served_name: Optional[str] = None  # name in the API; default: the folder's name
    dtype: str = "auto"  # auto = float32 on CPU, bfloat16 on CUDA
    max_model_len: Optional[int] = None  # prompt + output cap; default: the checkpoint's
    tokenizer: Optional[str] = None  # tokenizer folder if not `path`
    # LoRA adapters served by name next to the base (multi-LoRA); unset = none. Hot-reloadable:
    # not part of restart_fields, so adding one never restarts a pod.
    adapters: Optional[list[AdapterConfig]] = None
    # Where adapters given as source URIs are fetched to; unset = a folder under the system
    # temp dir (the operator renders /model-cache/adapters when a model cache is mounted).
    adapter_cache_dir: Optional[str] = None

    def __post_init__(self) -> None:
        _check(bool(self.path), "path", "must not be empty")
        _check(self.dtype in DTYPES, "dtype", f"must be one of {DTYPES}, got {self.dtype!r}")
        _positive(self.max_model_len, "maxModelLen")
        names = [a.name for a in self.adapters or ()]
        dupes = sorted({n for n in names if names.count(n) > 1})
        _check(not dupes, "adapters", f"duplicate adapter name(s) {dupes}")
        _check(self.name not in names, "adapters",
               f"adapter name {self.name!r} is the served model's own name; pick another")
        if self.adapter_cache_dir is not None:
            _check(bool(self.adapter_cache_dir.strip()), "adapterCacheDir", "must not be empty")

    @property
    def adapter_names(self) -> list[str]:
        return [a.name for a in self.adapters or ()]

    @property
    def name(self) -> str:
        return self.served_name or Path(self.path.rstrip("/")).name


@dataclass(frozen=True)
class KVOffloadConfig:
    """`engine.kvOffload:` — the prefix cache's host-memory tier (docs/kv-offload.md)."""

    host_bytes: int  # host memory for evicted prefix blocks (pinned on CUDA); checked at start

    def __post_init__(self) -> None:
        _positive(self.host_bytes, "hostBytes")


# Largest engine.tensorParallelSize / pipelineParallelSize accepted (ranks of one model).
MAX_PARALLEL_SIZE = 64


@dataclass(frozen=True)
class EngineConfig:
    """`engine:` — memory layout and execution mode (restart to change)."""

    block_size: int = 16  # tokens per KV block
    kv_cache_blocks: Optional[int] = None  # explicit pool size; else from gpuMemoryUtilization
    gpu_memory_utilization: float = 0.90  # share of device memory for weights + KV cache
    cpu_kv_cache_gib: float = 1.0  # KV pool size on CPU when kvCacheBlocks is not set
    continuous_batching: bool = True  # false = request-level static batching (rollback lever)
    enable_prefix_caching: bool = True
    device: str = "auto"
    # The CPU's dense-layer dtype; auto = float32 when the CPU has no native bf16/fp16 matmul.
    # The KV cache keeps the model dtype either way.
    cpu_compute_dtype: str = "auto"
    # The KV cache's dtype; auto = the model dtype. A narrower cache holds more blocks in the
    # same memory and halves the bytes decode attention reads.
    kv_cache_dtype: str = "auto"
    # auto = triton on CUDA; on the CPU native (the C decode kernel) if it builds, else torch.
    attention_backend: str = "auto"
    # Decode steps replay CUDA graphs recorded at start-up (runtime/executor/cuda_graphs.py); off until
    # measured on a GPU. Batches above cudaGraphMaxBatch sequences run eager.
    cuda_graphs: bool = False
    cuda_graph_max_batch: int = 64
    executor: str = "model"  # simulated = cost-model step times (benchmarks, no weights run)
    simulator_profile: Optional[str] = None  # cost-model profile name for executor=simulated
    seed: int = 0
    # torch compute threads of the engine on the CPU; unset = auto (docs/configuration.md).
    cpu_threads: Optional[int] = None
    # The step loop in a process of its own (runtime/engine/core_process.py), off the HTTP server's GIL.
    # Unset = off; unset rather than false so that configs written before the key existed keep
    # their restart hash (an operator upgrade does not roll every pod).
    core_process: Optional[bool] = None
    # Thread placement (runtime/executor/cpu_placement.py): auto | none | a CPU list such as "2-15".
    # Unset = auto; unset rather than "auto" to keep the restart hash of older configs.
    cpu_bind: Optional[str] = None
    # The prefix cache's host-memory tier; unset = none (and older configs keep their restart hash).
    kv_offload: Optional[KVOffloadConfig] = None
    # Multi-LoRA (docs/lora.md): adapter slots resident at once, and the largest rank a slot
    # holds. Unset = 8 and 64 (unset rather than defaulted to keep older configs' restart hash).
    max_loras: Optional[int] = None
    max_lora_rank: Optional[int] = None
    # Ranks serving one model (docs/parallelism.md): tensor-parallel ranks per pipeline stage, and
    # pipeline stages. Unset = 1 (unset rather than 1 to keep the restart hash of older configs).
    tensor_parallel_size: Optional[int] = None
    pipeline_parallel_size: Optional[int] = None

    @property
    def tp_size(self) -> int:
        """engine.tensorParallelSize in force."""
        return self.tensor_parallel_size or 1

    @property
    def pp_size(self) -> int:
        """engine.pipelineParallelSize in force."""
        return self.pipeline_parallel_size or 1

    @property
    def lora_slots(self) -> int:
        """engine.maxLoras in force: adapters resident at once (and in one step)."""
        return DEFAULT_MAX_LORAS if self.max_loras is None else self.max_loras

    @property
    def lora_max_rank(self) -> int:
        """engine.maxLoraRank in force: the largest adapter rank a slot holds."""
        return DEFAULT_MAX_LORA_RANK if self.max_lora_rank is None else self.max_lora_rank

    def __post_init__(self) -> None:
        _check(1 <= self.block_size <= 256, "blockSize", f"must be in [1, 256], got {self.block_size}")
        _check(self.cpu_threads is None or 1 <= self.cpu_threads <= 1024, "cpuThreads",
               f"must be in [1, 1024], got {self.cpu_threads}")
        try:
            check_cpu_bind(self.cpu_bind, self.cpu_threads)
        except ValueError as exc:
            raise ConfigError(f"cpuBind: {exc}") from None
        _check(
            self.block_size & (self.block_size - 1) == 0,
            "blockSize",
            f"must be a power of two, got {self.block_size}",
        )
        _positive(self.kv_cache_blocks, "kvCacheBlocks")
        _check(
            0.0 < self.gpu_memory_utilization <= 1.0,
            "gpuMemoryUtilization",
            f"must be in (0, 1], got {self.gpu_memory_utilization}",
        )
        _positive(self.cpu_kv_cache_gib, "cpuKvCacheGib")
        _check(self.device in DEVICES, "device", f"must be one of {DEVICES}")
        _check(
            self.cpu_compute_dtype in CPU_COMPUTE_DTYPES,
            "cpuComputeDtype",
            f"must be one of {CPU_COMPUTE_DTYPES}, got {self.cpu_compute_dtype!r}",
        )
        _check(
            self.kv_cache_dtype in KV_CACHE_DTYPES,
            "kvCacheDtype",
            f"must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}",
        )
        _check(
            self.attention_backend in ATTENTION_BACKENDS,
            "attentionBackend",
            f"must be one of {ATTENTION_BACKENDS}",
        )
        _check(
            1 <= self.cuda_graph_max_batch <= MAX_CUDA_GRAPH_BATCH,
            "cudaGraphMaxBatch",
            f"must be in [1, {MAX_CUDA_GRAPH_BATCH}], got {self.cuda_graph_max_batch}",
        )
        if self.cuda_graphs:
            _check(self.device != "cpu", "cudaGraphs", "needs a CUDA device, but engine.device is cpu")
            _check(
                self.attention_backend in ("auto", "triton"),
                "cudaGraphs",
                "needs the triton attention backend (auto or triton): the torch and native paths "
                "run on the host inside the forward pass",
            )
        _check(self.executor in EXECUTORS, "executor", f"must be one of {EXECUTORS}")
        _check(self.max_loras is None or 1 <= self.max_loras <= 256, "maxLoras",
               f"must be in [1, 256], got {self.max_loras}")
        _check(self.max_lora_rank is None or 1 <= self.max_lora_rank <= MAX_LORA_RANK, "maxLoraRank",
               f"must be in [1, {MAX_LORA_RANK}], got {self.max_lora_rank}")
        for key, size in (("tensorParallelSize", self.tensor_parallel_size),
                          ("pipelineParallelSize", self.pipeline_parallel_size)):
            _check(size is None or (isinstance(size, int) and 1 <= size <= MAX_PARALLEL_SIZE), key,
                   f"must be an integer in [1, {MAX_PARALLEL_SIZE}], got {size!r}")
        if self.tp_size * self.pp_size > 1:
            _check(self.executor == "model", "tensorParallelSize",
                   "needs engine.executor: model (the simulated executor runs no ranks)")
        _check(
            self.kv_offload is None or self.enable_prefix_caching,
            "kvOffload",
            "keeps prefix-cache blocks, so it needs enablePrefixCaching: true",
        )


@dataclass(frozen=True)
class SchedulerConfig:
    """`scheduler:` — global budgets (hot-reloadable). Lanes may cap them further."""

    max_active_sequences: int = 128  # running sequences per step
    max_waiting_requests: int = 512  # queued requests over all lanes
    max_batched_tokens: int = 8192  # tokens per step (decodes + prefill chunks)
    max_model_len: Optional[int] = None  # optional extra cap on prompt + output tokens
    prefill_chunk_size: int = 2048  # largest prefill chunk per request per step
    policy: str = "decode-first"  # decode-first | mixed
    queue_timeout_ms: int = 30000  # a request waiting longer gets 504
    stream_idle_timeout_ms: int = 10000  # a stalled stream consumer is cancelled after this
    kv_cache_high_watermark: float = 0.88  # above: no new prefills start
    kv_cache_reject_watermark: float = 0.95  # above: new requests get 503
    # auto: cap each step's estimated time so the tightest TPOT target of the running lanes
    # holds (docs/tuning.md, "Lane isolation"); off: steps are bounded by token budgets only.
    step_time_budget: str = "off"

    def __post_init__(self) -> None:
        _check_int_knobs(self, SCHEDULER_KNOBS)
        _check(
            self.step_time_budget in STEP_TIME_BUDGETS,
            "stepTimeBudget",
            f"must be one of {STEP_TIME_BUDGETS}, got {self.step_time_budget!r}",
        )
        _check(self.policy in POLICIES, "policy", f"must be one of {POLICIES}, got {self.policy!r}")
        _check(
            self.prefill_chunk_size <= self.max_batched_tokens,
            "prefillChunkSize",
            f"({self.prefill_chunk_size}) must be <= maxBatchedTokens ({self.max_batched_tokens})",
        )
        _check(
            self.max_active_sequences <= self.max_batched_tokens,
            "maxActiveSequences",
            f"({self.max_active_sequences}) must be <= maxBatchedTokens "
            f"({self.max_batched_tokens}): every running sequence needs one token per step",
        )
        _check(
            0.0 < self.kv_cache_high_watermark < self.kv_cache_reject_watermark <= 1.0,
            "kvCacheHighWatermark",
            "must satisfy 0 < kvCacheHighWatermark < kvCacheRejectWatermark <= 1, got "
            f"{self.kv_cache_high_watermark} and {self.kv_cache_reject_watermark}",
        )


# A lane with a TTFT or TPOT target and no `maxRefusedShare` may have this share of its
# requests refused (429/503) or timed out in the queue (504) per window.
DEFAULT_MAX_REFUSED_SHARE = 0.01


@dataclass(frozen=True)
class SLOConfig:
    """A lane's latency targets (milliseconds, 95th percentile) and its availability target."""

    ttft_p95_ms: Optional[float] = None
    tpot_p95_ms: Optional[float] = None
    e2e_p95_ms: Optional[float] = None
    # Unset: DEFAULT_MAX_REFUSED_SHARE for a lane with a latency target, none for a lane
    # without (a best-effort batch lane is refused by design when flooded). Kept unset
    # rather than defaulted so a lane without an SLO renders no SLO.
    max_refused_share: Optional[float] = None

    def __post_init__(self) -> None:
        for key in ("ttft_p95_ms", "tpot_p95_ms", "e2e_p95_ms"):
            _positive(getattr(self, key), _camel(key))
        if self.max_refused_share is not None:
            _check(0 <= self.max_refused_share <= 1, "maxRefusedShare",
                   f"must be a fraction in [0, 1], got {self.max_refused_share}")

    @property
    def refused_share_target(self) -> Optional[float]:
        """The share of refused requests the lane tolerates; None: no availability target."""
        if self.max_refused_share is not None:
            return self.max_refused_share
        has_latency_target = self.ttft_p95_ms is not None or self.tpot_p95_ms is not None
        return DEFAULT_MAX_REFUSED_SHARE if has_latency_target else None


@dataclass(frozen=True)
class LaneMatch:
    """Classifier rules, tried in lane order when a request names no lane."""

    min_prompt_tokens: Optional[int] = None  # prompts at least this long go here
    max_prompt_tokens: Optional[int] = None
    tenants: list[str] = field(default_factory=list)  # requests of these tenants go here
    headers: dict[str, str] = field(default_factory=dict)  # header name -> exact value
    # Requests whose `model` is one of these (the base's served name or an adapter's) go here;
    # unset = any model (kept unset so older configs render as before).
    models: Optional[list[str]] = None

    def __post_init__(self) -> None:
        _positive(self.min_prompt_tokens, "minPromptTokens")
        _positive(self.max_prompt_tokens, "maxPromptTokens")
        if self.min_prompt_tokens and self.max_prompt_tokens:
            _check(
                self.min_prompt_tokens <= self.max_prompt_tokens,
                "minPromptTokens",
                "must be <= maxPromptTokens",
            )

    @property
    def is_empty(self) -> bool:
        return not (self.min_prompt_tokens or self.max_prompt_tokens or self.tenants or self.headers
                    or self.models)


@dataclass(frozen=True)
class LaneConfig:
    """One traffic class: its own queue, share of the step, caps and SLO."""

    name: str
    lane_class: str = "interactive"  # key `class` in the file
    priority: int = 50  # higher is served first among lanes with work
    weight: float = 1.0  # fair share of the token budget among lanes of equal priority
    default: bool = False  # requests matching no rule go here
    # The lane's budget knobs (KNOBS rows with a lane scope); unset = the global value.
    max_active_sequences: Optional[int] = None
    max_batched_tokens: Optional[int] = None
    prefill_chunk_size: Optional[int] = None
    max_waiting_requests: Optional[int] = None
    queue_timeout_ms: Optional[int] = None
    max_kv_cache_share: Optional[float] = None
    kv_cache_reserved: Optional[float] = None
    # false = static batching for this lane only: its requests start as a fresh batch once
    # the lane's previous batch has finished (the other lanes keep continuous batching).
    continuous_batching: bool = True
    slo: SLOConfig = field(default_factory=SLOConfig)
    match: LaneMatch = field(default_factory=LaneMatch)

    def __post_init__(self) -> None:
        _check(bool(_NAME_RE.match(self.name)), "name", f"{self.name!r} is not a DNS-1123 label")
        _check(
            self.lane_class in LANE_CLASSES,
            "class",
            f"must be one of {LANE_CLASSES}, got {self.lane_class!r}",
        )
        _check(0 <= self.priority <= 1000, "priority", f"must be in [0, 1000], got {self.priority}")
        _positive(self.weight, "weight")
        _check_int_knobs(self, LANE_KNOBS)
        if self.prefill_chunk_size and self.max_batched_tokens:
            _check(
                self.prefill_chunk_size <= self.max_batched_tokens,
                "prefillChunkSize",
                "must be <= the lane's maxBatchedTokens",
            )
        if self.max_kv_cache_share is not None:
            _check(
                0.0 < self.max_kv_cache_share <= 1.0,
                "maxKvCacheShare",
                f"must be in (0, 1], got {self.max_kv_cache_share}",
            )
        if self.kv_cache_reserved is not None:
            _check(
                0.0 <= self.kv_cache_reserved < 1.0,
                "kvCacheReserved",
                f"must be in [0, 1), got {self.kv_cache_reserved}",
            )
            share = 1.0 if self.max_kv_cache_share is None else self.max_kv_cache_share
            _check(
                self.kv_cache_reserved <= share,
                "kvCacheReserved",
                f"({self.kv_cache_reserved}) must be <= maxKvCacheShare ({share}): a lane cannot "
                "keep more than it may hold",
            )


@dataclass(frozen=True)
class TenantConfig:
    """A team calling the API: its key (stored as a SHA-256 hex digest), allowed lanes, its
    fair share inside a lane and an optional token-rate limit."""

    name: str
    api_key_sha256: Optional[str] = None
    default_lane: Optional[str] = None
    lanes: list[str] = field(default_factory=list)  # allowed lanes; empty = all
    # Share of a lane's new starts among its waiting tenants (lanes.py); unset = 1 (left
    # unset so configs that do not use it render as before).
    weight: Optional[float] = None
    tokens_per_minute: Optional[int] = None  # prompt + output tokens; over it: 429 tenant_rate_limit
    # LoRA adapters (by name) this tenant may use; unset or empty = all. Others answer 404.
    adapters: Optional[list[str]] = None

    def __post_init__(self) -> None:
        _check(bool(_NAME_RE.match(self.name)), "name", f"{self.name!r} is not a DNS-1123 label")
        _positive(self.weight, "weight")
        _positive(self.tokens_per_minute, "tokensPerMinute")
        if self.api_key_sha256 is not None:
            _check(
                bool(_SHA256_RE.match(self.api_key_sha256)),
                "apiKeySha256",
                "must be 64 lowercase hex characters (sha256 of the key)",
            )

    @property
    def fair_share_weight(self) -> float:
        return 1.0 if self.weight is None else self.weight


@dataclass(frozen=True)
class LaneBudgets:
    """A lane's effective budgets: each lane knob's value in force (derived, not parsed)."""

    max_active_sequences: int
    max_batched_tokens: int
    prefill_chunk_size: int
    max_waiting_requests: int
    queue_timeout_ms: int
    max_kv_cache_share: float
    kv_cache_reserved: float


# Keys of `model:` a hot reload applies (adapters load and unload without a restart).
HOT_MODEL_KEYS = ("adapters",)


@dataclass(frozen=True)
class RuntimeConfig:
    """The whole `runtime.yaml`."""

    model: ModelConfig
    engine: EngineConfig = field(default_factory=EngineConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    lanes: list[LaneConfig] = field(default_factory=list)
    tenants: list[TenantConfig] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.lanes:
            # No lanes declared: one implicit default lane, so the runtime always has one.
            object.__setattr__(self, "lanes", [LaneConfig(name="default", default=True)])
        names = [lane.name for lane in self.lanes]
        dupes = sorted({n for n in names if names.count(n) > 1})
        _check(not dupes, "lanes", f"duplicate lane name(s) {dupes}")
        defaults = [lane.name for lane in self.lanes if lane.default]
        _check(len(defaults) <= 1, "lanes", f"more than one default lane: {defaults}")
        tenant_names = [t.name for t in self.tenants]
        dupes = sorted({n for n in tenant_names if tenant_names.count(n) > 1})
        _check(not dupes, "tenants", f"duplicate tenant name(s) {dupes}")
        for i, tenant in enumerate(self.tenants):
            for lane in tenant.lanes:
                _check(lane in names, f"tenants[{i}].lanes", f"unknown lane {lane!r}; lanes: {names}")
            if tenant.default_lane is not None:
                _check(
                    tenant.default_lane in names,
                    f"tenants[{i}].defaultLane",
                    f"unknown lane {tenant.default_lane!r}",
                )
                _check(
                    not tenant.lanes or tenant.default_lane in tenant.lanes,
                    f"tenants[{i}].defaultLane",
                    f"{tenant.default_lane!r} is not among the tenant's lanes {tenant.lanes}",
                )
        reserved = sum(lane.kv_cache_reserved or 0.0 for lane in self.lanes)
        _check(
            reserved < 1.0,
            "lanes",
            f"the lanes' kvCacheReserved add up to {reserved:g}; they must add up to less than 1 "
            "(some of the KV cache must stay shared)",
        )
        for i, lane in enumerate(self.lanes):
            for tenant in lane.match.tenants:
                _check(
                    tenant in tenant_names,
                    f"lanes[{i}].match.tenants",
                    f"unknown tenant {tenant!r}",
                )
        # Adapter names in tenants[].adapters and lanes[].match.models are not checked against
        # model.adapters: adapters loaded at runtime (POST /v1/load_lora_adapter) may be named.
        for i, tenant in enumerate(self.tenants):
            for name in tenant.adapters or ():
                _check(bool(ADAPTER_NAME_RE.match(name)), f"tenants[{i}].adapters",
                       f"{name!r} is not a valid adapter name")

    # ---- derived views

    @property
    def default_lane(self) -> LaneConfig:
        return next((lane for lane in self.lanes if lane.default), self.lanes[0])

    def lane(self, name: str) -> LaneConfig:
        for lane in self.lanes:
            if lane.name == name:
                return lane
        raise KeyError(name)

    def lane_budgets(self, name: str) -> LaneBudgets:
        """Each lane knob's value in force for lane `name`, by the knob's cap rule."""
        lane = self.lane(name)
        values = {
            k.attr: k.effective(getattr(lane, k.attr), getattr(self.scheduler, k.attr, k.lane_default))
            for k in LANE_KNOBS
        }
        # The scheduler's rule: a prefill chunk fits in the step's token budget.
        values["prefill_chunk_size"] = min(values["prefill_chunk_size"], values["max_batched_tokens"])
        return LaneBudgets(**values)

    @property
    def auth_enabled(self) -> bool:
        return any(t.api_key_sha256 for t in self.tenants)

    # ---- (de)serialisation

    @classmethod
    def from_dict(cls, data: Any) -> "RuntimeConfig":
        return _from_dict(cls, data, "config")

    def to_dict(self) -> dict[str, Any]:
        return _to_dict(self)

    def restart_fields(self) -> dict[str, Any]:
        """The fields that only take effect on a restart (model and engine sections)."""
        out = self.to_dict()
        model = {k: v for k, v in out["model"].items() if k not in HOT_MODEL_KEYS}
        return {"model": model, "engine": out.get("engine", {})}

    def restart_hash(self) -> str:
        """Hash of the restart-only fields: the operator puts it on the pod template."""
        canonical = json.dumps(self.restart_fields(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]

    def reloadable_changes_only(self, new: "RuntimeConfig") -> bool:
        return self.restart_fields() == new.restart_fields()


def loads_config(text: str) -> RuntimeConfig:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"config: not valid YAML: {exc}") from None
    return RuntimeConfig.from_dict(data)


def load_config(path: str | Path) -> RuntimeConfig:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"config: cannot read {path}: {exc.strerror}") from None
    return loads_config(text)


def dumps_config(config: RuntimeConfig) -> str:
    return yaml.safe_dump(config.to_dict(), sort_keys=False)


def hash_api_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()
