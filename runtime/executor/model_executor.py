"""The model executor: a StepPlan in, sampled tokens out.

Per step it applies the plan's block copies (parallel sampling's copy on write), lays all
scheduled chunks out as one flat batch (token ids, positions, slot mapping, block tables,
sequence and query lengths), runs the model once, computes logits only for the positions
that sample, and samples.

It owns the device, the weights and the paged KV pool; the scheduler owns which blocks
each request holds (`request.block_ids`), the executor only reads and writes them.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import sys
import time
from pathlib import Path
from typing import Optional

import torch

from tokenlane.kernels import cpu_native
from tokenlane.kernels.api import fresh_prefill_through_cache, resolve_backend
from tokenlane.runtime.executor.batch_inputs import BatchInputBuilder, chunk_token_ids
from tokenlane.runtime.config import RuntimeConfig
from tokenlane.runtime.executor.cpu_dense import select_compute_dtype
from tokenlane.runtime.executor.cpu_placement import bind_compute_threads, placement_for
from tokenlane.runtime.executor.cuda_graphs import make_decode_runner
from tokenlane.runtime.executor.llama import AttentionMetadata, CausalLM, kv_cache_bytes_per_block
from tokenlane.runtime.core.step_plan import ExecutorOutput, ScheduledChunk, StepPlan
from tokenlane.runtime.core.request import TokenLogprob
from tokenlane.runtime.executor.sampler import Sampler, argmax_only, make_generator
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


def select_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """engine.kvCacheDtype: auto = the model's dtype."""
    return model_dtype if name == "auto" else getattr(torch, name)


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

    def __init__(self, config: RuntimeConfig):
        self.config = config
        self.device = select_device(config.engine.device)
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
        self.model = CausalLM.from_pretrained(
            model_path, dtype=self.compute_dtype, device=self.device, weight_dtype=self.dtype
        )
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

        # engine.kvCacheDtype: the model dtype unless set; the kernels widen a narrower cache.
        self.kv_dtype = select_kv_cache_dtype(config.engine.kv_cache_dtype, self.dtype)
        self.num_kv_blocks = self._pool_size()
        shape = (self.num_kv_blocks, self.block_size, self.args.num_kv_heads, self.args.head_dim)
        self.kv_caches = [
            (kv_cache_tensor(shape, self.kv_dtype, self.device),
             kv_cache_tensor(shape, self.kv_dtype, self.device))
            for _ in range(self.args.num_layers)
        ]
        self.sampler = Sampler(self.device, seed=config.engine.seed)
        self.generators: dict[str, torch.Generator] = {}
        self.grammars = GrammarMatchers()  # structured output: a matcher per constrained request
        # The flat batch of each step (runtime/executor/batch_inputs.py): fresh prefills go straight to
        # SDPA where the attention kernels do not take them (the torch path, and head sizes the
        # native prefill kernel lacks), so they come last and skip the block tables.
        through_cache = fresh_prefill_through_cache(self.backend, self.device, self.args.head_dim,
                                                    self.args.num_heads // self.args.num_kv_heads)
        self.inputs = BatchInputBuilder(self.block_size, self.max_model_len, self.device, self.backend,
                                        sdpa_fresh_prefill=not through_cache)
        # engine.cudaGraphs: decode steps replay graphs recorded here (runtime/executor/cuda_graphs.py).
        self.decode_runner = make_decode_runner(
            config.engine.cuda_graphs, self.model, self.kv_caches, block_size=self.block_size,
            max_model_len=self.max_model_len, max_batch=config.engine.cuda_graph_max_batch,
            backend=self.backend, device=self.device,
        )

    def pin_step_thread(self) -> None:
        """Called by a step loop in its own thread before its first step: pins that thread's
        OpenMP team (its compute threads) as engine.cpuBind plans."""
        if self.placement.pinned:
            log.info("thread placement: %s", bind_compute_threads(self.placement))
            self.cpu_threads = torch.get_num_threads()

    # ---- KV pool sizing

    def _pool_size(self) -> int:
        engine = self.config.engine
        per_block = kv_cache_bytes_per_block(self.args, self.block_size, self.kv_dtype)
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

    def _profile_activation_bytes(self) -> int:
        """Peak activation memory of the largest step (vLLM-style profiling run)."""
        tokens = min(self.config.scheduler.max_batched_tokens, self.max_model_len)
        n_blocks = -(-tokens // self.block_size)
        shape = (n_blocks, self.block_size, self.args.num_kv_heads, self.args.head_dim)
        caches = [(torch.zeros(shape, dtype=self.kv_dtype, device=self.device),
                   torch.zeros(shape, dtype=self.kv_dtype, device=self.device))
                  for _ in range(self.args.num_layers)]
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        ids = torch.zeros(tokens, dtype=torch.long, device=self.device)
        pos = torch.arange(tokens, device=self.device)
        meta = AttentionMetadata(
            slot_mapping=pos.clone(),
            block_tables=torch.arange(n_blocks, dtype=torch.int32, device=self.device)[None],
            seq_lens=torch.tensor([tokens], dtype=torch.int32, device=self.device),
            query_start_loc=torch.tensor([0, tokens], dtype=torch.int32, device=self.device),
            num_paged_tokens=tokens,
            max_query_len=tokens,
            max_seq_len=tokens,
            fresh_query_lens=[],
            all_seq_lens=[tokens],
            all_query_lens=[tokens],
            backend=self.backend,
        )
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
        if plan.block_copies:
            self._copy_blocks(plan.block_copies)
        chunks = [c for c in plan.chunks if self._check_chunk(c, output.errors)]
        if chunks:
            self._run(chunks, output)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
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
        if chunk.start >= request.num_prompt_tokens:
            return True  # generated tokens: the sampler's own, in the vocabulary
        # Prompt tokens (the engine's admission checks them too; an id outside the table
        # would be a device-side assert on CUDA, fatal to every request).
        ids = chunk_token_ids(chunk)
        if request.sampling_params.prompt_logprobs is not None and end < request.num_prompt_tokens:
            ids = ids + [request.prompt_token_ids[end]]  # scored by this chunk's last row
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            errors[request.request_id] = (
                f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})"
            )
            return False
        return True

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole KV blocks src -> dst, every layer, before the step's forward pass (so
        a source written by this step is copied as it was before it). One gather/scatter per
        cache tensor; the dsts are distinct fresh blocks."""
        src = torch.tensor([s for s, _ in copies], dtype=torch.long, device=self.device)
        dst = torch.tensor([d for _, d in copies], dtype=torch.long, device=self.device)
        for key_cache, value_cache in self.kv_caches:
            key_cache[dst] = key_cache[src]
            value_cache[dst] = value_cache[src]

    def _forward(self, input_ids, positions, meta, logits_indices, argmax_only: bool = False) -> torch.Tensor:
        """The model's logits of `logits_indices` (or, with `argmax_only`, possibly their
        argmax token ids: see Transformer.forward); a decode batch the decode runner (CUDA
        graphs) can take replays its graph instead of running eager."""
        runner = self.decode_runner
        if runner is not None and runner.can_run(input_ids.shape[0], meta, logits_indices.shape[0]):
            return runner.run(input_ids, positions, meta, logits_indices)
        return self.model(input_ids, positions, self.kv_caches, meta, logits_indices, argmax_only=argmax_only)

    def _run(self, chunks: list[ScheduledChunk], output: ExecutorOutput) -> None:
        inputs = self.inputs.build(chunks)
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
        greedy = not prompt_rows and all(argmax_only(c.request.sampling_params) for c in sampled_chunks)
        with step_threads:
            logits = self._forward(input_ids, pos, meta, torch.tensor(rows, dtype=torch.long, device=dev), greedy)
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
