"""A model executor whose step time comes from a cost model instead of running weights.

`SimulatedExecutor(config)` implements the `Executor` protocol (runtime/core/step_plan.py): the engine's
real scheduler, KV pool, lanes and admission run unchanged; only the model step is replaced by
a roofline estimate for one GPU serving one dense transformer:

    compute_s = FLOPs / (peak bf16 FLOP/s x achievable fraction)
    memory_s  = bytes / (HBM bandwidth x achievable fraction)
    step_s    = max(compute_s, memory_s) + fixed per-step overhead

FLOPs: 2 x (non-embedding linear parameters) per batched token, the LM head only for tokens
that are sampled, and causal attention (4 x q_heads x head_dim x context per query token per
layer). Bytes: every weight once per step, every scheduled sequence's KV context once (paged
attention reads it), and the new tokens' K/V written. Prefill chunks are compute-bound, decode
batches memory-bound, which is what makes the scheduling policies differ.

The KV cache's bytes per token follow `engine.kvCacheDtype` (`kv_element_bytes`): an fp8 cache
holds twice the blocks of a bf16 one in the same memory and its decode attention reads half the
bytes (dequantized inside the kernel, so the FLOPs stay those of bf16). The host tier's block
copies (`StepPlan.kv_offloads`, `kv_restores`) cost block bytes / the host link's bandwidth
(`GPUProfile.host_link_bytes_per_s`), all before the forward pass as the plan orders them (an
offloaded block may be reused by this very step, a restored one is read by it), so they add to
the step (`kv_transfer_seconds`, `SimulatedExecutor.execute`).

LoRA adapters (multi-LoRA): each target projection of a token whose request runs an adapter
also goes through the segmented shrink/expand product, x @ A [d_in, r] then @ B [r, d_out], so
`lora_cost` adds 2 x r x (d_in + d_out) FLOPs per token per target module and layer; bytes are
each adapter's A and B read once per step it appears in (its weights, whatever its row count)
plus the LoRA rows' activations read and the product added back, per module. One forward pass
serves every adapter and the base, as the model executor runs it.

No torch. Sampled tokens are synthetic (deterministic per request and position) and never EOS:
requests end by max_tokens (or by the client). With a virtual clock (bench/sim.py) the clock is
advanced by each step's simulated seconds; without one (e.g. `tokenlane serve` with
`engine.executor: simulated`) the step sleeps for that long, so the server behaves in real time
like the simulated GPU.
"""

from __future__ import annotations

import dataclasses
import time
import zlib
from dataclasses import dataclass
from typing import Callable, Optional

from tokenlane.runtime.core.step_plan import ExecutorOutput, StepPlan

GIB = 1024**3


@dataclass(frozen=True)
class GPUProfile:
    name: str
    peak_bf16_flops: float  # dense (no sparsity) tensor-core bf16 FLOP/s, vendor datasheet
    hbm_bytes_per_s: float  # HBM bandwidth, vendor datasheet
    memory_bytes: float  # device memory
    # Achievable fractions of the peaks for a whole model step (not a single ideal GEMM).
    compute_efficiency: float
    memory_efficiency: float
    step_overhead_s: float  # launch + scheduling + sampling per step (CUDA graphs assumed)
    # Effective host <-> device bandwidth of KV block copies (the host tier), each direction.
    host_link_bytes_per_s: float
    source: str


@dataclass(frozen=True)
class ModelProfile:
    name: str
    num_params: float  # total parameters
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_model_len: int
    dtype_bytes: int = 2  # bf16 weights (and the KV cache unless engine.kvCacheDtype says otherwise)
    source: str = ""
    intermediate_size: int = 0  # the MLP's width (gate/up out, down in): LoRA's MLP shapes

    def lora_module_dims(self) -> dict[str, tuple[int, int]]:
        """(d_in, d_out) of each LoRA target projection (runtime.config.LORA_TARGET_MODULES)."""
        h, q, kv, i = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, \
            self.intermediate_size
        return {"q": (h, q), "k": (h, kv), "v": (h, kv), "o": (q, h), "gate": (h, i), "up": (h, i), "down": (i, h)}

    @property
    def kv_elements_per_token(self) -> int:
        # K and V, every layer, every KV head.
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim

    @property
    def kv_bytes_per_token(self) -> int:
        """In the model dtype; SimulatorProfile.kv_bytes_per_token is the cache's."""
        return self.kv_elements_per_token * self.dtype_bytes

    @property
    def weight_bytes(self) -> float:
        return self.num_params * self.dtype_bytes

    @property
    def embedding_params(self) -> float:
        return float(self.vocab_size * self.hidden_size)

    @property
    def linear_params_per_token(self) -> float:
        # Every batched token goes through all layers; the input embedding is a lookup (no
        # FLOPs) and the (untied) LM head runs only for sampled tokens.
        return self.num_params - 2 * self.embedding_params


# Sources: vendor datasheets for the peaks; the achievable fractions and the overhead were
# measured on an H200 here (`python -m tokenlane.bench.calibrate`, a Llama-3-8B-shaped
# bf16 forward under CUDA graphs; numbers in docs/calibration-h200.json and docs/benchmarks.md):
# decode steps moved 3.5-4.0 TB/s (0.72-0.84 of 4.8 TB/s), prefill chunks of 512-8192 tokens ran
# at 600-675 TFLOP/s (0.61-0.68 of 989). We take 0.65 of compute and 0.75 of bandwidth plus
# 1.5 ms per step for what that forward leaves out (norms, rotary, sampling, the scheduler),
# which puts the model 1-36% above the measured bare forward (most for small decode batches,
# where the fixed overhead weighs most): a slightly pessimistic engine.
# - NVIDIA H100 SXM5 datasheet: 989 TFLOP/s dense BF16 (1979 with sparsity), 3.35 TB/s HBM3, 80 GB.
# - NVIDIA H200 SXM datasheet: same Hopper compute (989 TFLOP/s dense BF16), 4.8 TB/s HBM3e, 141 GB.
# Host link: both attach over PCIe Gen5 x16, 64 GB/s per direction on paper (~55 GB/s for large
# pinned cudaMemcpy). A KV block is scattered over 2 x num_layers pieces of block_size x
# kv_heads x head_dim elements (32 KiB each for a bf16 Llama-3-8B block of 16 tokens), and copies
# that small fall short of the large-copy rate: we take 25 GB/s, under half the link, until a
# restore's throughput is measured on the GPU (pessimistic for the host tier).
HOST_LINK_BYTES_PER_S = 25e9
GPU_PROFILES: dict[str, GPUProfile] = {
    "h100": GPUProfile(
        name="H100-SXM5-80GB",
        peak_bf16_flops=989e12,
        hbm_bytes_per_s=3.35e12,
        memory_bytes=80e9,
        compute_efficiency=0.65,
        memory_efficiency=0.75,
        step_overhead_s=0.0015,
        host_link_bytes_per_s=HOST_LINK_BYTES_PER_S,
        source="NVIDIA H100 datasheet: 989 TFLOP/s dense BF16, 3.35 TB/s HBM3, 80 GB",
    ),
    "h200": GPUProfile(
        name="H200-SXM-141GB",
        peak_bf16_flops=989e12,
        hbm_bytes_per_s=4.8e12,
        memory_bytes=141e9,
        compute_efficiency=0.65,
        memory_efficiency=0.75,
        step_overhead_s=0.0015,
        host_link_bytes_per_s=HOST_LINK_BYTES_PER_S,
        source="NVIDIA H200 datasheet: 989 TFLOP/s dense BF16, 4.8 TB/s HBM3e, 141 GB",
    ),
}

# Meta Llama-3-8B config.json: 32 layers, hidden 4096, 32 query / 8 KV heads of 128, vocab
# 128256, untied LM head; 8.03B parameters. bf16 KV: 2 x 32 x 8 x 128 x 2 B = 128 KiB/token.
# Context 131072 as in Llama-3.1-8B (same shapes), so long-context lanes fit.
MODEL_PROFILES: dict[str, ModelProfile] = {
    "llama3-8b": ModelProfile(
        name="Llama-3-8B-like",
        num_params=8.03e9,
        num_layers=32,
        hidden_size=4096,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        vocab_size=128256,
        max_model_len=131072,
        intermediate_size=14336,
        source="meta-llama/Meta-Llama-3-8B config.json (Llama-3.1-8B context length)",
    ),
}

DEFAULT_PROFILE = "h200-llama3-8b"
# Memory kept back for activations, CUDA graphs and the sampler when sizing the KV pool.
ACTIVATION_RESERVE_BYTES = 4 * GIB


# Bytes of one stored KV element per engine.kvCacheDtype ("auto": the model dtype).
KV_DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8_e4m3": 1, "fp8_e5m2": 1}


def kv_element_bytes(kv_cache_dtype: str, model: ModelProfile) -> int:
    if kv_cache_dtype == "auto":
        return model.dtype_bytes
    if kv_cache_dtype not in KV_DTYPE_BYTES:
        raise ValueError(f"kvCacheDtype {kv_cache_dtype!r} has no simulator size; known: {sorted(KV_DTYPE_BYTES)}")
    return KV_DTYPE_BYTES[kv_cache_dtype]


@dataclass(frozen=True)
class SimulatorProfile:
    gpu: GPUProfile
    model: ModelProfile
    kv_dtype_bytes: int = 2  # bytes per stored KV element (engine.kvCacheDtype)

    @property
    def name(self) -> str:
        return f"{self.gpu.name} + {self.model.name}"

    @property
    def kv_bytes_per_token(self) -> int:
        return self.model.kv_elements_per_token * self.kv_dtype_bytes


def get_profile(name: Optional[str] = None, kv_cache_dtype: str = "auto") -> SimulatorProfile:
    """`<gpu>-<model>`, e.g. "h200-llama3-8b" (the default) or "h100-llama3-8b", with the KV
    cache stored in `kv_cache_dtype` (an engine.kvCacheDtype value)."""
    name = (name or DEFAULT_PROFILE).lower()
    gpu_name, _, model_name = name.partition("-")
    if gpu_name not in GPU_PROFILES or model_name not in MODEL_PROFILES:
        known = [f"{g}-{m}" for g in GPU_PROFILES for m in MODEL_PROFILES]
        raise ValueError(f"unknown simulator profile {name!r}; known: {known}")
    model = MODEL_PROFILES[model_name]
    return SimulatorProfile(GPU_PROFILES[gpu_name], model, kv_element_bytes(kv_cache_dtype, model))


@dataclass(frozen=True)
class ChunkShape:
    """What the cost model needs of one scheduled chunk."""

    start: int  # tokens already in the cache before this chunk
    num_tokens: int  # tokens computed this step
    sample: bool
    adapter: Optional[str] = None  # the request's LoRA adapter; None = the base model


@dataclass(frozen=True)
class LoraShape:
    """What the cost model needs of one loaded adapter: its rank and target modules."""

    rank: int
    target_modules: tuple[str, ...]


@dataclass(frozen=True)
class LoraCost:
    flops: float
    bytes: float
    distinct_adapters: int


def lora_width(model: ModelProfile, lora: LoraShape) -> int:
    """Sum over layers and target modules of d_in + d_out: A and B hold rank x this many elements."""
    dims = model.lora_module_dims()
    unknown = [t for t in lora.target_modules if t not in dims]
    if unknown:
        raise ValueError(f"LoRA target module(s) {unknown} unknown to the simulator; known: {sorted(dims)}")
    return model.num_layers * sum(dims[t][0] + dims[t][1] for t in lora.target_modules)


def lora_cost(profile: SimulatorProfile, chunks: list[ChunkShape], adapters: dict[str, LoraShape]) -> LoraCost:
    """The LoRA products of one step (see the module docstring): per adapter in the step,
    2 x rank x width FLOPs per token, its weights read once, its rows' activations read and
    written once per module."""
    tokens: dict[str, int] = {}
    for c in chunks:
        if c.adapter is not None and c.num_tokens:
            tokens[c.adapter] = tokens.get(c.adapter, 0) + c.num_tokens
    flops = nbytes = 0.0
    b = profile.model.dtype_bytes
    for name, n in tokens.items():
        if name not in adapters:
            raise ValueError(f"adapter {name!r} is not loaded in the simulator")
        lora = adapters[name]
        width = lora_width(profile.model, lora)
        flops += 2.0 * lora.rank * width * n
        nbytes += lora.rank * width * b + n * width * b
    return LoraCost(flops, nbytes, len(tokens))


@dataclass(frozen=True)
class StepCost:
    flops: float
    bytes: float
    compute_s: float
    memory_s: float
    seconds: float  # max(compute_s, memory_s) + overhead, 0 for an empty step


def step_cost(profile: SimulatorProfile, chunks: list[ChunkShape],
              adapters: Optional[dict[str, LoraShape]] = None) -> StepCost:
    """Roofline estimate of one model step over `chunks` (see the module docstring);
    `adapters`: the loaded LoRA adapters the chunks may name."""
    if not chunks:
        return StepCost(0.0, 0.0, 0.0, 0.0, 0.0)
    m, g = profile.model, profile.gpu
    tokens = sum(c.num_tokens for c in chunks)
    sampled = sum(1 for c in chunks if c.sample)
    flops = 2.0 * m.linear_params_per_token * tokens + 2.0 * m.embedding_params * sampled
    q_width = m.num_heads * m.head_dim
    attn_pairs = 0.0  # (query token, key token) pairs over the batch, causal
    context_tokens = 0  # KV entries read by attention
    for c in chunks:
        attn_pairs += c.num_tokens * (c.start + (c.num_tokens + 1) / 2.0)
        context_tokens += c.start + c.num_tokens
    flops += 4.0 * m.num_layers * q_width * attn_pairs
    nbytes = (
        m.weight_bytes
        + context_tokens * profile.kv_bytes_per_token  # attention reads each sequence's context
        + tokens * profile.kv_bytes_per_token  # K/V of the new tokens written
    )
    if any(c.adapter is not None for c in chunks):
        lora = lora_cost(profile, chunks, adapters or {})
        flops += lora.flops
        nbytes += lora.bytes
    compute_s = flops / (g.peak_bf16_flops * g.compute_efficiency)
    memory_s = nbytes / (g.hbm_bytes_per_s * g.memory_efficiency)
    return StepCost(flops, nbytes, compute_s, memory_s, max(compute_s, memory_s) + g.step_overhead_s)


def block_copy_seconds(profile: SimulatorProfile, block_size: int, num_copies: int) -> float:
    """Time of a step's KV block copies (parallel sampling's copy on write): each copy reads
    and writes one block of every layer's K and V, memory-bound."""
    nbytes = 2.0 * num_copies * block_size * profile.kv_bytes_per_token
    return nbytes / (profile.gpu.hbm_bytes_per_s * profile.gpu.memory_efficiency)


def kv_transfer_seconds(profile: SimulatorProfile, block_size: int, num_blocks: int) -> float:
    """Time to copy `num_blocks` KV blocks one way over the host link (the host tier)."""
    return num_blocks * block_size * profile.kv_bytes_per_token / profile.gpu.host_link_bytes_per_s


def kv_blocks_for(profile: SimulatorProfile, block_size: int, gpu_memory_utilization: float) -> int:
    """KV pool size the way vLLM sizes it: device memory share minus weights and activations."""
    budget = profile.gpu.memory_bytes * gpu_memory_utilization
    free = budget - profile.model.weight_bytes - ACTIVATION_RESERVE_BYTES
    blocks = int(free // (block_size * profile.kv_bytes_per_token))
    if blocks < 1:
        raise ValueError(
            f"{profile.name}: gpuMemoryUtilization {gpu_memory_utilization} leaves no room for "
            f"a KV cache after {profile.model.weight_bytes / 1e9:.1f} GB of weights"
        )
    return blocks


class SimulatedExecutor:
    """Executor protocol over the cost model. `clock`: a VirtualClock to advance, or None to
    sleep in real time for each step's simulated duration."""

    def __init__(self, config, clock: Optional["VirtualClock"] = None, *, realtime: Optional[bool] = None):
        engine = config.engine
        self.profile = get_profile(engine.simulator_profile, engine.kv_cache_dtype)
        self.block_size: int = engine.block_size
        self.num_kv_blocks: int = engine.kv_cache_blocks or kv_blocks_for(
            self.profile, engine.block_size, engine.gpu_memory_utilization
        )
        offload = engine.kv_offload
        # Slots of the host tier (engine.kvOffload): its bytes over the cache's bytes per block.
        self.num_host_kv_blocks: int = (
            int(offload.host_bytes // (engine.block_size * self.profile.kv_bytes_per_token)) if offload else 0
        )
        self.eos_token_id: Optional[int] = None  # synthetic tokens never end a request
        self.max_model_len: int = self.profile.model.max_model_len
        self.vocab_size: int = self.profile.model.vocab_size
        self.seed: int = engine.seed
        self.clock = clock
        self.realtime = (clock is None) if realtime is None else realtime
        # Totals over the run (the benchmarks report them).
        self.num_steps = 0
        self.busy_seconds = 0.0
        self.total_flops = 0.0
        self.total_bytes = 0.0
        self.num_block_copies = 0
        self.num_blocks_offloaded = 0  # device -> host (the host tier)
        self.num_blocks_restored = 0  # host -> device
        self.host_link_seconds = 0.0  # time the host link was busy with them
        self.last_cost: Optional[StepCost] = None
        # LoRA adapters (no weights): their rank and target modules, from the PEFT folder's
        # adapter_config.json; the cost model charges their products.
        self.max_lora_rank: int = engine.lora_max_rank
        self.adapters: dict[str, LoraShape] = {}

    def add_adapter(self, name: str, folder: str):
        from tokenlane.runtime.executor.fake import check_adapter_folder

        if name in self.adapters:
            raise ValueError(f"adapter {name!r} is already loaded")
        info = check_adapter_folder(name, folder, self.max_lora_rank)
        try:
            lora_width(self.profile.model, LoraShape(info.rank, info.target_modules))
        except ValueError as exc:
            raise ValueError(f"adapter {name!r}: {exc}") from None
        self.adapters[name] = LoraShape(info.rank, info.target_modules)
        return info

    def remove_adapter(self, name: str) -> None:
        del self.adapters[name]

    def adapter_names(self) -> list[str]:
        return list(self.adapters)

    def token_for(self, request_id: str, position: int) -> int:
        """Deterministic synthetic token id (never special: ids 0..999 are left out)."""
        h = zlib.crc32(f"{self.seed}:{request_id}:{position}".encode())
        return 1000 + h % (self.vocab_size - 1000)

    def execute(self, plan: StepPlan) -> ExecutorOutput:
        shapes = [ChunkShape(c.start, c.num_tokens, c.sample, c.request.adapter) for c in plan.chunks]
        cost = step_cost(self.profile, shapes, self.adapters)
        if plan.block_copies:  # copied before the forward pass, as the model executor does
            copies = len(plan.block_copies)
            copy_s = block_copy_seconds(self.profile, self.block_size, copies)
            copy_bytes = 2.0 * copies * self.block_size * self.profile.kv_bytes_per_token
            cost = dataclasses.replace(cost, bytes=cost.bytes + copy_bytes, memory_s=cost.memory_s + copy_s,
                                       seconds=cost.seconds + copy_s)
            self.num_block_copies += copies
        cost, transfer_s = self._host_tier_cost(plan, cost)
        out = ExecutorOutput(step_seconds=cost.seconds, kv_restore_seconds=transfer_s if plan.kv_restores else None)
        for c in plan.chunks:
            if c.sample:
                out.sampled[c.request.request_id] = self.token_for(c.request.request_id, c.start + c.num_tokens)
        self.last_cost = cost
        if shapes:
            self.num_steps += 1
            self.busy_seconds += cost.seconds
            self.total_flops += cost.flops
            self.total_bytes += cost.bytes
        if self.clock is not None:
            self.clock.advance(cost.seconds)
        elif self.realtime and cost.seconds > 0:
            time.sleep(cost.seconds)
        return out

    def _host_tier_cost(self, plan: StepPlan, cost: StepCost) -> tuple[StepCost, float]:
        """The step with the host tier's copies before its forward pass, and their seconds."""
        offloads, restores = len(plan.kv_offloads), len(plan.kv_restores)
        if not offloads and not restores:
            return cost, 0.0
        transfer_s = kv_transfer_seconds(self.profile, self.block_size, offloads + restores)
        self.num_blocks_offloaded += offloads
        self.num_blocks_restored += restores
        self.host_link_seconds += transfer_s
        return dataclasses.replace(cost, seconds=cost.seconds + transfer_s), transfer_s


class VirtualClock:
    """A monotonic clock that only moves when told to: `clock()` reads it."""

    def __init__(self, start: float = 0.0):
        self.now = float(start)

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        assert seconds >= 0, seconds
        self.now += seconds

    def advance_to(self, t: float) -> None:
        self.now = max(self.now, float(t))


ClockFn = Callable[[], float]
