"""The model executor: a StepPlan in, sampled tokens out.

Per step it performs the plan's host-tier copies (engine.kvOffload: offloads, then restores;
runtime/executor/kv_host_pool.py) and block copies (parallel sampling's copy on write), lays all
scheduled chunks out as one flat batch (token ids, positions, slot mapping, block tables,
sequence and query lengths), runs the model once, computes logits only for the positions
that sample, and samples.

It owns the device, the weights and the paged KV pool; the scheduler owns which blocks
each request holds (`request.block_ids`), the executor only reads and writes them.

LoRA adapters (runtime/executor/lora.py): `add_adapter` / `remove_adapter` / `adapter_names`
keep checked PEFT adapters in host memory; each step makes the adapters of its requests
resident in the slot table (engine.maxLoras slots, reserved before the KV pool is sized), and
the model adds their deltas to the rows of their requests in the same forward pass.

Tensor/pipeline parallel (`parallel`, runtime/executor/parallel_state.py): every rank builds its
own executor over its share of the model (runtime/executor/sharding.py) and runs every step's
plan. The KV pool holds this rank's KV heads of this stage's layers, with the same block count
on every rank (the minimum over ranks), so block ids mean the same everywhere. Only the output
rank samples and computes logprobs; the other ranks return an ExecutorOutput without tokens.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import sys
import time
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from tokenlane.kernels import cpu_native
from tokenlane.kernels.api import fresh_prefill_through_cache, resolve_backend
from tokenlane.kernels.reference import is_fp8
from tokenlane.runtime.executor.batch_inputs import BatchInputBuilder, chunk_token_ids, host_tensor
from tokenlane.runtime.config import RuntimeConfig
from tokenlane.runtime.executor.cpu_dense import select_compute_dtype
from tokenlane.runtime.executor.cpu_placement import bind_compute_threads, placement_for
from tokenlane.runtime.executor.cuda_graphs import make_decode_runner
from tokenlane.runtime.executor.kv_host_pool import HostKVPool, host_available_bytes, host_pool_slots, make_host_pool
from tokenlane.runtime.executor.lora import AdapterInfo, HostAdapter, LoraSlots, load_peft_adapter
from tokenlane.runtime.executor.parallel_state import ParallelState, single_process
from tokenlane.runtime.executor.llama import AttentionMetadata, CausalLM, kv_cache_bytes_per_block, kv_cache_scales
from tokenlane.runtime.core.startup import StartupPhase
from tokenlane.runtime.core.step_plan import ExecutorOutput, ScheduledChunk, StepPlan
from tokenlane.runtime.core.request import TokenLogprob
from tokenlane.runtime.executor.sampler import Sampler, make_generator
from tokenlane.runtime.executor.structured_output import GrammarMatchers

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def token_logprobs(
    logits: torch.Tensor, rows: list[int], token_ids: list[int], ks: list[int]
) -> list[TokenLogprob]:
    """Logprob, rank and top-k of `token_ids[i]` under row `rows[i]` of `logits` [R, V].

    The model's distribution: log_softmax of the raw logits in float32 (no temperature,
    top-k or top-p), as vLLM returns by default. One batched pass, one transfer to the host.
    """
    dev = logits.device
    lp = torch.log_softmax(logits.index_select(0, torch.tensor(rows, dtype=torch.long, device=dev)).float(), dim=-1)
    ids = torch.tensor(token_ids, dtype=torch.long, device=dev)
    chosen = lp.gather(1, ids.unsqueeze(1))
    ranks = (lp > chosen).sum(dim=-1) + 1
    k_max = min(max(ks, default=0), lp.shape[-1])
    if k_max:
        top_values, top_ids = lp.topk(k_max, dim=-1)
        top_values, top_ids = top_values.tolist(), top_ids.tolist()
    chosen_list, rank_list = chosen.squeeze(1).tolist(), ranks.tolist()
    out = []
    for i, (token, k) in enumerate(zip(token_ids, ks)):
        top = tuple(zip(top_ids[i][:k], top_values[i][:k])) if k else ()
        out.append(TokenLogprob(token, chosen_list[i], rank_list[i], top))
    return out


def select_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("engine.device is 'cuda' but no CUDA device is available")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # Linux


def kv_cache_tensor(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed KV cache tensor. On a Linux CPU its memory is asked to be backed by 2 MiB
    transparent huge pages (madvise, before the first touch): decode attention reads blocks
    scattered over the whole pool, and with 4 KiB pages nearly every block is a TLB miss
    (measured: the C decode kernel 15% faster over a 512 MiB pool, a 64-decode step of the
    19M model about 4% faster). Where the kernel says no (THP off, not Linux) it is
    ordinary memory."""
    if device.type != "cpu" or not sys.platform.startswith("linux"):
        return torch.zeros(shape, dtype=dtype, device=device)
    numel = 1
    for size in shape:
        numel *= size
    itemsize = torch.empty(0, dtype=dtype).element_size()
    spare = _HUGE_PAGE // itemsize
    backing = torch.empty(numel + spare, dtype=dtype)
    start = -backing.data_ptr() % _HUGE_PAGE // itemsize  # first 2 MiB-aligned element
    tensor = backing[start : start + numel].view(shape)
    length = numel * itemsize // _HUGE_PAGE * _HUGE_PAGE
    if length:
        _madvise_huge(tensor.data_ptr(), length)
    return tensor.zero_()


def _madvise_huge(address: int, length: int) -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        if libc.madvise(address, length, _MADV_HUGEPAGE) != 0:
            log.debug("madvise(MADV_HUGEPAGE) refused: errno %d", ctypes.get_errno())
    except (OSError, AttributeError) as exc:  # no libc symbol: keep ordinary pages
        log.debug("no madvise: %s", exc)


KV_CACHE_DTYPES = {
    "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
    "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2,
}
# The Triton kernels' fp8 conversions: e4m3 needs Ada/Hopper (sm_89+), e5m2 Ampere (sm_80+).
FP8_MIN_CUDA_CAPABILITY = {torch.float8_e4m3fn: (8, 9), torch.float8_e5m2: (8, 0)}


def select_kv_cache_dtype(name: str, model_dtype: torch.dtype, device: Optional[torch.device] = None) -> torch.dtype:
    """engine.kvCacheDtype: auto = the model's dtype. With `device`, an fp8 dtype the device
    cannot store and convert is refused (ValueError naming kvCacheDtype)."""
    if name == "auto":
        return model_dtype
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"engine.kvCacheDtype must be one of auto, {', '.join(KV_CACHE_DTYPES)}, got {name!r}")
    dtype = KV_CACHE_DTYPES[name]
    if device is not None and is_fp8(dtype):
        check_fp8_kv_cache(name, dtype, torch.device(device))
    return dtype


def check_fp8_kv_cache(name: str, dtype: torch.dtype, device: torch.device) -> None:
    if device.type == "cuda":
        if torch.version.hip and dtype == torch.float8_e4m3fn:
            raise ValueError(f"engine.kvCacheDtype {name!r}: ROCm GPUs store e4m3 as float8_e4m3fnuz, which "
                             "the kernels do not take; use fp8_e5m2 or bfloat16")
        need = FP8_MIN_CUDA_CAPABILITY[dtype]
        have = torch.cuda.get_device_capability(device)
        if tuple(have) < need:
            raise ValueError(
                f"engine.kvCacheDtype {name!r} needs a GPU of compute capability {need[0]}.{need[1]} or "
                f"newer (fp8 conversions); {torch.cuda.get_device_name(device)} is {have[0]}.{have[1]}: "
                f"use bfloat16{' or fp8_e5m2' if dtype != torch.float8_e5m2 and tuple(have) >= (8, 0) else ''}")
    try:
        probe = torch.tensor([1.5, -3.0], device=device).to(dtype).float().tolist()
    except (RuntimeError, TypeError, NotImplementedError) as exc:
        raise ValueError(f"engine.kvCacheDtype {name!r}: this torch build cannot store {dtype} on {device} ({exc})") from exc
    if probe != [1.5, -3.0]:
        raise ValueError(f"engine.kvCacheDtype {name!r}: {dtype} does not round-trip on {device} (got {probe})")


# Computed fp8 scales (a checkpoint without k_scale / v_scale): one forward pass at start-up over
# a fixed prompt, before the pool exists; per layer, scale = amax * headroom / the format's max,
# so values up to `headroom` times the calibration's largest still fit without saturating.
FP8_CALIBRATION_TOKENS = 256
FP8_SCALE_HEADROOM = 2.0


def calibration_token_ids(num_tokens: int, vocab_size: int) -> list[int]:
    """The fixed calibration prompt: ids spread over the whole vocabulary (a stride prime to
    any vocabulary size), the same on every start."""
    return [(1 + 7919 * i) % vocab_size for i in range(num_tokens)]


def select_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    return DTYPES[name]


def place_cpu_threads(setting: Optional[int], device: torch.device) -> int:
    """engine.cpuThreads: torch's compute threads when the engine runs on the CPU (process
    wide: the engine is the process's only torch user). Unset leaves torch's own count, one
    per core it may use. Returns the count in force."""
    if device.type == "cpu" and setting is not None:
        torch.set_num_threads(setting)
    return torch.get_num_threads()


class ModelExecutor:
    """Implements the `Executor` protocol (runtime/core/step_plan.py) with the real model."""

    supports_logprobs = True

    def __init__(self, config: RuntimeConfig, parallel: Optional[ParallelState] = None):
        self.config = config
        self.device = select_device(config.engine.device)
        # This rank's place in a tensor/pipeline-parallel group (runtime/executor/parallel_state.py);
        # a lone process when not given.
        self.parallel = parallel if parallel is not None else single_process(self.device)
        self.dtype = select_dtype(config.model.dtype, self.device)
        self.block_size = config.engine.block_size
        self.backend = resolve_backend(config.engine.attention_backend, self.device)
        self.cpu_threads = place_cpu_threads(config.engine.cpu_threads, self.device)
        if self.device.type == "cpu":
            log.info("%s", cpu_native.describe())  # which native library (level, path), or why none
        # engine.cpuBind: planned now (a CPU list this process may not use fails the start-up),
        # applied by the step loop's own thread (`pin_step_thread`): libgomp keeps an OpenMP
        # pool per calling thread, and a caller's thread of its own is not ours to pin.
        self.placement = placement_for(config.engine, self.device.type)
        log.info("thread placement: %s", self.placement.reason)
        model_path = Path(config.model.path)
        if not model_path.is_dir():
            raise ValueError(f"model.path {config.model.path!r} is not a folder")
        # On a CPU without native bf16/fp16 matmul the dense layers compute in float32; the KV
        # cache below keeps the model dtype (runtime/executor/cpu_dense.py).
        self.compute_dtype = select_compute_dtype(config.engine.cpu_compute_dtype, self.dtype, self.device)
        started = time.perf_counter()
        self.model = CausalLM.from_pretrained(
            model_path, dtype=self.compute_dtype, device=self.device, weight_dtype=self.dtype,
            parallel=self.parallel,
        )
        # This rank's share: its heads, MLP columns and the stage's layers (the KV pool's shape).
        self.shard = self.model.shard
        self.local_args = self.model.local_args
        self.is_output_rank = self.parallel.layout.is_output_rank
        # Start-up phases (runtime/core/startup.py), each logged once done.
        self.startup_phases: list[StartupPhase] = []
        self._startup_phase("load", started, self._load_detail())
        if self.backend == "native":
            self.model.use_native_norms()
        # Steps of these token counts (decode steps) do every product and attention in the C
        # kernels, whose threads then come from their helper pool while torch runs on one
        # thread (kernels/cpu_native.py, `pool_step`); None: every step uses torch's threads.
        self.pool_step_rows = self.model.panel_step_rows() if self.backend == "native" else None
        self.args = self.model.args
        self.vocab_size = self.args.vocab_size
        self.eos_token_id: Optional[int] = self.args.eos_token_id
        # Longest context: the checkpoint's positions, or less if the config says so.
        # Mistral's sliding window is not implemented; within it attention is identical.
        limit = self.args.max_position_embeddings
        if config.model.max_model_len:
            if config.model.max_model_len > limit:
                raise ValueError(
                    f"model.maxModelLen {config.model.max_model_len} exceeds the checkpoint's "
                    f"max_position_embeddings {limit}"
                )
            limit = config.model.max_model_len
        if self.args.sliding_window and self.args.sliding_window < limit:
            log.warning("capping the model length at the sliding window (%d)", self.args.sliding_window)
            limit = self.args.sliding_window
        self.max_model_len = limit
        # LoRA adapters (runtime/executor/lora.py): the slot table is allocated here, before the
        # KV pool is sized, so the pool gets what the slots leave.
        self.adapters: dict[str, HostAdapter] = {}
        self.lora_slots = self._make_lora_slots()

        started = time.perf_counter()
        # engine.kvCacheDtype: the model dtype unless set; the kernels widen a narrower cache.
        self.kv_dtype = select_kv_cache_dtype(config.engine.kv_cache_dtype, self.dtype, self.device)
        # An fp8 cache's per-layer scales, fixed here: the checkpoint's, else calibrated.
        self.kv_scales: Optional[list[tuple[float, float]]] = None
        self.kv_scales_source = "none"
        if is_fp8(self.kv_dtype):
            self.kv_scales = kv_cache_scales(self.model.checkpoint_kv_scales, self.args.num_layers)
            if self.kv_scales is not None:
                self.kv_scales = self.kv_scales[self.shard.layer_start: self.shard.layer_end]
            self.kv_scales_source = "checkpoint"
            if self.kv_scales is None:
                self.kv_scales, self.kv_scales_source = self._calibrate_kv_scales(), "calibrated"
            self.model.set_kv_cache_scales(self.kv_scales)
        # The same count on every rank: the scheduler's block ids index every rank's pool.
        self.num_kv_blocks = self.parallel.min_over_ranks(self._pool_size())
        shape = (self.num_kv_blocks, self.block_size, self.local_args.num_kv_heads, self.args.head_dim)
        self.kv_caches = [
            (kv_cache_tensor(shape, self.kv_dtype, self.device),
             kv_cache_tensor(shape, self.kv_dtype, self.device))
            for _ in range(self.local_args.num_layers)
        ]
        per_block = kv_cache_bytes_per_block(self.local_args, self.block_size, self.kv_dtype)
        log.info("KV cache: %d blocks of %d tokens, %s (%d bytes per block, %.2f GiB)%s",
                 self.num_kv_blocks, self.block_size, config.engine.kv_cache_dtype if is_fp8(self.kv_dtype)
                 else str(self.kv_dtype).removeprefix("torch."), per_block,
                 self.num_kv_blocks * per_block / 2**30,
                 f"; {self.kv_scales_source} scales, k {min(k for k, _ in self.kv_scales):.3g}.."
                 f"{max(k for k, _ in self.kv_scales):.3g}, v {min(v for _, v in self.kv_scales):.3g}.."
                 f"{max(v for _, v in self.kv_scales):.3g}" if self.kv_scales else "")
        self._startup_phase("kv", started, self._kv_detail())
        # engine.kvOffload: the prefix cache's host tier, a second pool in host memory
        # (runtime/executor/kv_host_pool.py); refused at start if the host cannot hold it.
        self.kv_bytes_per_block = kv_cache_bytes_per_block(self.local_args, self.block_size, self.kv_dtype)
        offload = config.engine.kv_offload
        if offload is not None and self.parallel.distributed:  # equal slot counts on every rank too
            slots = host_pool_slots(offload.host_bytes, self.kv_bytes_per_block, host_available_bytes())
            self.host_pool = HostKVPool(self.kv_caches, self.parallel.min_over_ranks(slots), self.device)
            log.info("KV host tier: %d blocks (%.2f GiB)", self.host_pool.num_slots, self.host_pool.nbytes / 2**30)
        else:
            self.host_pool = make_host_pool(offload, self.kv_caches, self.kv_bytes_per_block, self.device)
        self.num_host_kv_blocks = self.host_pool.num_slots if self.host_pool is not None else 0
        self.sampler = Sampler(self.device, seed=config.engine.seed)
        self.generators: dict[str, torch.Generator] = {}
        self.grammars = GrammarMatchers()  # structured output: a matcher per constrained request
        # The flat batch of each step (runtime/executor/batch_inputs.py): fresh prefills go straight to
        # SDPA where the attention kernels do not take them (the torch path, and head sizes the
        # native prefill kernel lacks), so they come last and skip the block tables.
        through_cache = fresh_prefill_through_cache(self.backend, self.device, self.args.head_dim,
                                                    self.local_args.num_heads // self.local_args.num_kv_heads)
        self.inputs = BatchInputBuilder(self.block_size, self.max_model_len, self.device, self.backend,
                                        sdpa_fresh_prefill=not through_cache)
        # engine.cudaGraphs: decode steps replay graphs recorded here (runtime/executor/cuda_graphs.py).
        started = time.perf_counter()
        cuda_graphs = config.engine.cuda_graphs
        if cuda_graphs and self.parallel.distributed:
            # The graphs would record the collectives of one rank's stream; not supported yet.
            log.warning("engine.cudaGraphs is off with %d ranks (tensor/pipeline parallel): decode steps run eager",
                        self.parallel.layout.world_size)
            cuda_graphs = False
        self.decode_runner = make_decode_runner(
            cuda_graphs, self.model, self.kv_caches, block_size=self.block_size,
            max_model_len=self.max_model_len, max_batch=config.engine.cuda_graph_max_batch,
            backend=self.backend, device=self.device,
        )
        self._startup_phase("warmup", started, (
            f"CUDA graphs recorded for {len(self.decode_runner.batch_sizes)} decode batch sizes"
            if self.decode_runner is not None else "none: no CUDA graphs to record, nothing compiled"))

    # ---- start-up

    def _startup_phase(self, name: str, started: float, detail: str) -> None:
        phase = StartupPhase(name, time.perf_counter() - started, detail)
        self.startup_phases.append(phase)
        log.info("%s", phase.log_line())

    def _load_detail(self) -> str:
        loaded = self.model.weights_loaded
        detail = (f"{loaded.bytes / 2**20:.1f} MiB from {loaded.files} safetensors file"
                  f"{'s' if loaded.files != 1 else ''}, memory-mapped; "
                  f"{loaded.mapped_bytes / 2**20:.1f} MiB used in place, the rest copied")
        layout = self.parallel.layout
        if layout.world_size > 1:
            shard = self.shard
            detail = (f"rank {layout.rank} of {layout.world_size} (tensor rank {layout.tp_rank} of {layout.tp}, "
                      f"stage {layout.pp_rank} of {layout.pp}, layers {shard.layer_start}..{shard.layer_end - 1}): "
                      f"{loaded.bytes} bytes read by this rank; {detail}")
        return f"{detail}; {self.device.type}, {str(self.compute_dtype).removeprefix('torch.')}"

    def _kv_detail(self) -> str:
        per_block = kv_cache_bytes_per_block(self.local_args, self.block_size, self.kv_dtype)
        sized = ("engine.kvCacheBlocks" if self.config.engine.kv_cache_blocks
                 else "a profiling forward pass" if self.device.type == "cuda" else "engine.cpuKvCacheGib")
        return (f"{self.num_kv_blocks} blocks of {self.block_size} tokens, "
                f"{self.num_kv_blocks * per_block / 2**20:.1f} MiB zeroed; sized by {sized}")

    def pin_step_thread(self) -> None:
        """Called by a step loop in its own thread before its first step: pins that thread's
        OpenMP team (its compute threads) as engine.cpuBind plans."""
        if self.placement.pinned:
            log.info("thread placement: %s", bind_compute_threads(self.placement))
            self.cpu_threads = torch.get_num_threads()

    # ---- KV pool sizing

    def _pool_size(self) -> int:
        engine = self.config.engine
        per_block = kv_cache_bytes_per_block(self.local_args, self.block_size, self.kv_dtype)
        if engine.kv_cache_blocks:
            return engine.kv_cache_blocks
        if self.device.type == "cuda":
            _, total = torch.cuda.mem_get_info(self.device)
            peak = self._profile_activation_bytes()
            budget = total * engine.gpu_memory_utilization - torch.cuda.memory_allocated(self.device) - peak
            blocks = int(budget // per_block)
            if blocks <= 0:
                raise ValueError(
                    f"no memory left for the KV cache at gpuMemoryUtilization="
                    f"{engine.gpu_memory_utilization} (weights + activations take "
                    f"{(total * engine.gpu_memory_utilization - budget) / 2**30:.2f} GiB)"
                )
            return blocks
        blocks = int(engine.cpu_kv_cache_gib * 2**30 // per_block)
        if blocks <= 0:
            raise ValueError(f"engine.cpuKvCacheGib={engine.cpu_kv_cache_gib} holds no block")
        return blocks

    def _calibrate_kv_scales(self) -> list[tuple[float, float]]:
        """Per-layer fp8 scales from one forward pass over `calibration_token_ids`, into a small
        temporary cache in the compute dtype (scale 1: it keeps K and V as they are)."""
        tokens = min(FP8_CALIBRATION_TOKENS, self.max_model_len)
        ids = torch.tensor(calibration_token_ids(tokens, self.vocab_size), dtype=torch.long, device=self.device)
        caches, pos, meta = self._one_sequence_pass(tokens, self.compute_dtype)
        self.model(ids, pos, caches, meta, torch.zeros(0, dtype=torch.long, device=self.device))
        fmax = torch.finfo(self.kv_dtype).max
        # Over all KV heads of the layer (a MAX over the tensor ranks): each rank stores its
        # own heads with the scales a single process would use.
        amaxes = self.parallel.max_over_tensor_ranks(
            torch.stack([torch.stack([k.abs().max(), v.abs().max()]).float() for k, v in caches]))
        scales = []
        for amax in amaxes.tolist():
            # A layer whose K or V are all zero (cannot happen with real weights) keeps scale 1.
            scales.append(tuple(a * FP8_SCALE_HEADROOM / fmax if a > 0 else 1.0 for a in amax))
        return scales

    def _one_sequence_pass(self, tokens: int, cache_dtype: torch.dtype):
        """A scratch cache and the metadata of one fresh sequence of `tokens` tokens in a single
        chunk (for the start-up passes: fp8 calibration, activation profiling)."""
        n_blocks = -(-tokens // self.block_size)
        shape = (n_blocks, self.block_size, self.local_args.num_kv_heads, self.args.head_dim)
        caches = [(torch.zeros(shape, dtype=cache_dtype, device=self.device),
                   torch.zeros(shape, dtype=cache_dtype, device=self.device))
                  for _ in range(self.local_args.num_layers)]
        pos = torch.arange(tokens, device=self.device)
        meta = AttentionMetadata(
            slot_mapping=pos.clone(),
            block_tables=torch.arange(n_blocks, dtype=torch.int32, device=self.device)[None],
            seq_lens=torch.tensor([tokens], dtype=torch.int32, device=self.device),
            query_start_loc=torch.tensor([0, tokens], dtype=torch.int32, device=self.device),
            num_paged_tokens=tokens, max_query_len=tokens, max_seq_len=tokens,
            fresh_query_lens=[], all_seq_lens=[tokens], all_query_lens=[tokens],
            backend=self.backend,
        )
        return caches, pos, meta

    def _profile_activation_bytes(self) -> int:
        """Peak activation memory of the largest step (vLLM-style profiling run)."""
        tokens = min(self.config.scheduler.max_batched_tokens, self.max_model_len)
        caches, pos, meta = self._one_sequence_pass(tokens, self.kv_dtype)  # not counted: allocated before
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        ids = torch.zeros(tokens, dtype=torch.long, device=self.device)
        max_seqs = self.config.scheduler.max_active_sequences
        self.model(ids, pos, caches, meta, torch.arange(min(max_seqs, tokens), device=self.device))
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before
        del caches
        torch.cuda.empty_cache()
        return int(peak)

    # ---- one step

    def execute(self, plan: StepPlan) -> ExecutorOutput:
        t0 = time.perf_counter()
        for request in plan.finished:
            self.generators.pop(request.request_id, None)
            self.grammars.release(request.request_id)
            self.inputs.release(request.request_id)
        for request in plan.preempted:  # its blocks went back to the pool
            self.inputs.release(request.request_id)
        output = ExecutorOutput()
        host_pool = self.host_pool
        if host_pool is not None and (plan.kv_offloads or plan.kv_restores):
            # Before the block copies too: a copy's fresh dst may be a block offloaded now.
            output.kv_restore_seconds = host_pool.transfer(self.kv_caches, plan.kv_offloads, plan.kv_restores)
        if plan.block_copies:
            self._copy_blocks(plan.block_copies)
        chunks = [c for c in plan.chunks if self._check_chunk(c, output.errors)]
        chunks, adapter_slots = self._lora_step(chunks, output.errors)
        if chunks:
            self._run(chunks, output, adapter_slots)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            if host_pool is not None:
                restore_seconds = host_pool.finish()
                if restore_seconds is not None:
                    output.kv_restore_seconds = restore_seconds
        output.step_seconds = time.perf_counter() - t0
        return output

    def _check_chunk(self, chunk: ScheduledChunk, errors: dict[str, str]) -> bool:
        """Bad input of one request becomes that request's error, never a crashed step."""
        request = chunk.request
        end = chunk.start + chunk.num_tokens
        if end > self.max_model_len:
            errors[request.request_id] = (
                f"context of {end} tokens exceeds the model's maximum length {self.max_model_len}"
            )
            return False
        assert len(request.block_ids) * self.block_size >= end, (
            f"request {request.request_id}: {len(request.block_ids)} blocks cannot hold {end} tokens"
        )
        adapter = request.adapter
        if adapter is not None and adapter not in self.adapters:
            errors[request.request_id] = f"adapter {adapter!r} is not loaded"
            return False
        if chunk.start >= len(request.prompt_token_ids):
            return True  # generated tokens: the sampler's own, in the vocabulary
        # Prompt tokens (the engine's admission checks them too; an id outside the table
        # would be a device-side assert on CUDA, fatal to every request).
        ids = chunk_token_ids(chunk)
        if request.sampling_params.prompt_logprobs is not None and end < request.num_prompt_tokens:
            ids = ids + [request.prompt_token_ids[end]]  # scored by this chunk's last row
        if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):  # no Python call per id
            bad = next(t for t in ids if not 0 <= t < self.vocab_size)
            errors[request.request_id] = (
                f"token id {bad} is outside the vocabulary [0, {self.vocab_size})"
            )
            return False
        return True

    # ---- LoRA adapters

    def _make_lora_slots(self) -> Optional[LoraSlots]:
        """The slot table when adapters are on (engine.maxLoras set, or model.adapters listed),
        else None: no slot memory, and add_adapter refuses."""
        engine, model = self.config.engine, self.config.model
        if engine.max_loras is None and not model.adapters:
            return None
        # Every rank's slots hold its share of each adapter (runtime/executor/sharding.py, lora_shard);
        # adapters are checked against the whole model's shapes (add_adapter).
        slots = LoraSlots(self.local_args, engine.lora_slots, engine.lora_max_rank, self.compute_dtype, self.device,
                          shard=self.shard)
        self.model.attach_lora(slots)
        log.info("LoRA: %d adapter slots of rank up to %d, %.1f MiB", slots.num_slots, slots.max_rank,
                 slots.nbytes / 2**20)
        return slots

    def add_adapter(self, name: str, folder: str) -> AdapterInfo:
        """Read and check a PEFT LoRA folder into host memory (runtime/executor/lora.py); it goes
        into a device slot when a step first needs it. ValueError naming the adapter when it
        cannot be served (nothing else changes)."""
        if self.lora_slots is None:
            raise ValueError(f"adapter {name!r}: LoRA adapters are off; set engine.maxLoras (or list "
                             "model.adapters) so that adapter slots are reserved at start-up")
        if name in self.adapters:
            raise ValueError(f"adapter {name!r} is already loaded")
        adapter = load_peft_adapter(name, folder, self.args, self.lora_slots.max_rank)
        self.adapters[name] = adapter
        log.info("adapter %r loaded: rank %d, %s, %.1f MiB", name, adapter.info.rank,
                 ",".join(adapter.info.target_modules), adapter.info.bytes / 2**20)
        return adapter.info

    def remove_adapter(self, name: str) -> None:
        if name not in self.adapters:
            raise ValueError(f"adapter {name!r} is not loaded")
        del self.adapters[name]
        self.lora_slots.evict(name)

    def adapter_names(self) -> list[str]:
        return list(self.adapters)

    def _lora_step(self, chunks: list[ScheduledChunk], errors: dict[str, str]
                   ) -> tuple[list[ScheduledChunk], Optional[dict[str, int]]]:
        """The step's adapters made resident: {name: slot}, or None when no chunk has one. The
        scheduler keeps a step within engine.maxLoras adapters; past it, the later adapters'
        requests fail rather than the step."""
        names: list[str] = []
        for c in chunks:
            adapter = c.request.adapter
            if adapter is not None and adapter not in names:
                names.append(adapter)
        if not names:
            return chunks, None
        kept = names[: self.lora_slots.num_slots]
        if len(names) > len(kept):
            over = set(names[len(kept):])
            for c in chunks:
                if c.request.adapter in over:
                    errors[c.request.request_id] = (f"more than engine.maxLoras={self.lora_slots.num_slots} "
                                                    "adapters in one step")
            chunks = [c for c in chunks if c.request.adapter not in over]
        return chunks, self.lora_slots.make_resident(kept, self.adapters)

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole KV blocks src -> dst, every layer, before the step's forward pass (so
        a source written by this step is copied as it was before it). One gather/scatter per
        cache tensor; the dsts are distinct fresh blocks."""
        src = torch.tensor([s for s, _ in copies], dtype=torch.long, device=self.device)
        dst = torch.tensor([d for _, d in copies], dtype=torch.long, device=self.device)
        for key_cache, value_cache in self.kv_caches:
            key_cache[dst] = key_cache[src]
            value_cache[dst] = value_cache[src]

    def _forward(self, input_ids, positions, meta, logits_indices, argmax_only: bool = False) -> Optional[torch.Tensor]:
        """The model's logits of `logits_indices` (or, with `argmax_only`, possibly their
        argmax token ids: see CausalLM.forward; None on a pipeline stage before the last); a
        decode batch the decode runner (CUDA graphs) can take replays its graph instead of
        running eager."""
        runner = self.decode_runner
        # A step with adapter rows runs eager: the graphs are recorded without LoRA deltas.
        if runner is not None and meta.lora is None and runner.can_run(input_ids.shape[0], meta, logits_indices.shape[0]):
            return runner.run(input_ids, positions, meta, logits_indices)
        return self.model(input_ids, positions, self.kv_caches, meta, logits_indices, argmax_only=argmax_only)

    def _run(self, chunks: list[ScheduledChunk], output: ExecutorOutput,
             adapter_slots: Optional[dict[str, int]] = None) -> None:
        inputs = self.inputs.build(chunks, adapter_slots, self.lora_slots.ranks if adapter_slots else ())
        input_ids, pos, meta = inputs.input_ids, inputs.positions, inputs.meta
        dev = self.device
        sampled_chunks, prompt_targets = inputs.sampled_chunks, inputs.prompt_targets
        prompt_ks, prompt_spans = inputs.prompt_ks, inputs.prompt_spans
        rows = inputs.logits_rows
        prompt_rows = rows[inputs.num_sampled:]
        pool = (self.pool_step_rows is not None and input_ids.shape[0] in self.pool_step_rows
                and self.cpu_threads > 1)
        if self.pool_step_rows is not None and not pool:
            cpu_native.park_pool()  # the helpers would spin on the cores torch's threads need
        step_threads = cpu_native.pool_step(self.cpu_threads) if pool else contextlib.nullcontext()
        if not rows:
            # Prefill chunks that stop inside their prompts: K/V only, no logits needed.
            with step_threads:
                self.model(input_ids, pos, self.kv_caches, meta, torch.zeros(0, dtype=torch.long, device=dev))
            return
        # One forward pass: logits of the sampling rows first, then the prompt-logprob rows.
        # When every row is greedy and nothing else reads the logits, the LM head may hand
        # back the tokens instead (on the CPU: no [rows, vocab] logits written, then read).
        # Every rank runs it (a tensor-parallel LM head gathers logits); one rank samples.
        with step_threads:
            logits = self._forward(input_ids, pos, meta, host_tensor(rows, np.int64).to(dev), inputs.argmax_only)
        if logits is None or not self.is_output_rank:  # an earlier stage, or a tensor rank that does not sample
            return
        if logits.dtype == torch.int64:
            for c, token in zip(sampled_chunks, logits.tolist()):
                output.sampled[c.request.request_id] = token
            return
        num_sampled = inputs.num_sampled
        tokens: list[int] = []
        if sampled_chunks:
            params = [c.request.sampling_params for c in sampled_chunks]
            generators = [self._generator(c) for c in sampled_chunks]
            histories = [c.request for c in sampled_chunks]
            # Constrained rows get their grammar's mask; on a copy when logprobs read the raw logits.
            copy = any(p.logprobs is not None for p in params)
            sample_logits = self.grammars.masked(logits[:num_sampled], histories, copy=copy)
            tokens = self.sampler(sample_logits, params, generators, histories)
            for c, token in zip(sampled_chunks, tokens):
                output.sampled[c.request.request_id] = token
        want = [j for j, c in enumerate(sampled_chunks) if c.request.sampling_params.logprobs is not None]
        if not want and not prompt_rows:
            return
        entries = token_logprobs(
            logits,
            want + list(range(num_sampled, len(rows))),
            [tokens[j] for j in want] + prompt_targets,
            [sampled_chunks[j].request.sampling_params.logprobs for j in want] + prompt_ks,
        )
        for j, entry in zip(want, entries):
            output.logprobs[sampled_chunks[j].request.request_id] = entry
        at = len(want)
        for rid, first, count in prompt_spans:
            output.prompt_logprobs[rid] = (first, entries[at : at + count])
            at += count

    def _generator(self, chunk: ScheduledChunk) -> Optional[torch.Generator]:
        params = chunk.request.sampling_params
        if params.seed is None or params.greedy:
            return None
        rid = chunk.request.request_id
        if rid not in self.generators:
            self.generators[rid] = make_generator(params.seed, self.device)
        return self.generators[rid]
