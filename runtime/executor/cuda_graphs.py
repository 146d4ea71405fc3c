"""CUDA graphs for decode batches (`engine.cudaGraphs`).

At small batches a decode step on a GPU is bound by the host: every layer launches a dozen
kernels from Python (the paged-attention launcher alone costs 70-150 µs), while the GPU needs
a few µs for each. A CUDA graph records the whole forward pass once and replays it with one
launch.

vLLM's recipe, for decode-shaped batches only (every sequence computes one token over its paged
context):

- at start-up, for each bucket of batch sizes (1, 2, 4, 8, 16, 24, ... up to
  `engine.cudaGraphMaxBatch`), record one forward pass over *static* input buffers sized for
  that bucket: token ids, positions, slot mapping, block tables (as wide as the longest
  context), sequence lengths, query start offsets and the rows that get logits;
- at a decode step of B sequences, pick the smallest bucket >= B, copy the step's inputs into
  the first B rows of the static buffers, pad the others (slot -1: the KV write skips it;
  context length 1 over block 0: read, never written; token 0 at position 0), replay, and
  return the first N rows of the static logits (N = the rows the step asked for). The rows go
  through a static `logits_indices` buffer too, so a step whose one-token chunks score prompt
  tokens (prompt logprobs) replays like any decode.

Prefill chunks and mixed steps, batches above the largest bucket, and contexts past what the
graphs were recorded for run eager. Inside the graph nothing may depend on host values that
change between replays: the attention launch is sized from the static maximum context
(`max_seq_len` = the graphs' longest context), never from this step's, so the Triton grid, its
KV splits and its autotuned tile are fixed; each split reads its share of the real context
from `seq_lens` on the device.

`DecodeRunner` holds everything but the recording: the eligibility check, bucket choice,
padding and the static-buffer forward pass. `EagerDecodeRunner` runs that forward pass
directly (the CPU tests check it against the unpadded path, and the GPU benchmark uses it to
check the replay); `CudaGraphDecodeRunner` records it per bucket and replays it.
"""

from __future__ import annotations

import bisect
import logging
import time
from typing import Optional

import torch

from tokenlane.runtime.config import MAX_CUDA_GRAPH_BATCH
from tokenlane.runtime.executor.llama import AttentionMetadata, CausalLM

log = logging.getLogger(__name__)


def graph_batch_sizes(max_batch: int) -> list[int]:
    """The buckets recorded for `max_batch`: 1, 2, 4, then multiples of 8, and max_batch."""
    if not 1 <= max_batch <= MAX_CUDA_GRAPH_BATCH:
        raise ValueError(
            f"the largest CUDA-graph batch must be in [1, {MAX_CUDA_GRAPH_BATCH}], got {max_batch}"
        )
    sizes = {b for b in (1, 2, 4) if b <= max_batch}
    sizes.update(range(8, max_batch + 1, 8))
    sizes.add(max_batch)
    return sorted(sizes)


def pick_bucket(sizes: list[int], batch: int) -> Optional[int]:
    """The smallest bucket that holds `batch` sequences; None when it is above them all."""
    i = bisect.bisect_left(sizes, batch)
    return sizes[i] if i < len(sizes) else None


def graph_context_limit(model: CausalLM, max_model_len: int) -> int:
    """Longest context a recorded graph may serve. Dynamic-NTK RoPE recomputes its
    frequencies on the host past the checkpoint's original length: such steps run eager."""
    rotary = model.rotary
    if rotary is not None and rotary.rope_type == "dynamic":
        return min(max_model_len, rotary.original_max)
    return max_model_len


class DecodeRunner:
    """The static-buffer decode forward pass, without the recording (see the module doc)."""

    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        *,
        block_size: int,
        max_model_len: int,
        max_batch: int,
        backend: str,
        device: torch.device,
    ):
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.backend = backend
        self.device = device
        self.batch_sizes = graph_batch_sizes(max_batch)
        self.max_batch = self.batch_sizes[-1]
        self.max_context = graph_context_limit(model, max_model_len)
        self.max_blocks = -(-self.max_context // block_size)
        n, dev = self.max_batch, device
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=dev)
        self.block_tables = torch.zeros((n, self.max_blocks), dtype=torch.int32, device=dev)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=dev)
        # One query token per row, padding rows included: fixed for every replay.
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.logits_indices = torch.zeros(n, dtype=torch.int64, device=dev)
        if model.rotary is not None:
            # Grow the RoPE table to the static maximum now: a replay cannot reallocate it.
            model.rotary.cos_sin(torch.zeros(1, dtype=torch.int64, device=dev), [self.max_context], [1],
                                 torch.float32)

    # ---- check

    def eager_reason(self, num_tokens: int, meta: AttentionMetadata, num_logits: int) -> Optional[str]:
        """Why this batch cannot take the static path (None: it can). Host values only."""
        if meta.fresh_query_lens or meta.num_paged_tokens != num_tokens:
            return "prefill chunks in the step"
        if meta.max_query_len != 1 or meta.seq_lens.shape[0] != num_tokens:
            return "a sequence computes more than one token"
        if num_tokens > self.max_batch:
            return f"{num_tokens} sequences exceed the largest graph ({self.max_batch})"
        if meta.max_seq_len > self.max_context:
            return f"a context of {meta.max_seq_len} tokens exceeds the graphs' {self.max_context}"
        if not 0 < num_logits <= num_tokens:
            return "no row samples"
        return None

    def can_run(self, num_tokens: int, meta: AttentionMetadata, num_logits: int) -> bool:
        return self.eager_reason(num_tokens, meta, num_logits) is None

    # ---- act

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """Logits [N, V] of `logits_indices` (N rows), as the model's own forward returns them.

        The result is a view of a static buffer: valid until the next call."""
        num_tokens, num_logits = input_ids.shape[0], logits_indices.shape[0]
        assert self.can_run(num_tokens, meta, num_logits), self.eager_reason(num_tokens, meta, num_logits)
        bucket = pick_bucket(self.batch_sizes, num_tokens)
        self.fill(input_ids, positions, meta, logits_indices, bucket)
        return self._forward(bucket)[:num_logits]

    def fill(self, input_ids, positions, meta: AttentionMetadata, logits_indices, bucket: int) -> None:
        """Copy a batch into the first rows of the static buffers and pad the rest up to `bucket`."""
        b, n = input_ids.shape[0], logits_indices.shape[0]
        self.input_ids[:b].copy_(input_ids)
        self.positions[:b].copy_(positions)
        self.slot_mapping[:b].copy_(meta.slot_mapping)
        self.seq_lens[:b].copy_(meta.seq_lens)
        # Columns past the static width cannot be read (no context exceeds max_context), and
        # entries past a row's own blocks keep older ids: never read (seq_lens bound the reads).
        width = min(meta.block_tables.shape[1], self.max_blocks)
        self.block_tables[:b, :width].copy_(meta.block_tables[:, :width])
        self.logits_indices[:n].copy_(logits_indices)
        if b < bucket:
            self.input_ids[b:bucket].zero_()
            self.positions[b:bucket].zero_()
            self.slot_mapping[b:bucket].fill_(-1)  # the KV write skips negative slots
            self.seq_lens[b:bucket].fill_(1)
            self.block_tables[b:bucket, 0].zero_()  # a padding row reads slot 0 of block 0
        if n < bucket:
            self.logits_indices[n:bucket].zero_()  # padding logits: computed, never returned

    def static_metadata(self, bucket: int) -> AttentionMetadata:
        """The batch layout of a bucket: views of the static buffers, host maxima static."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bucket],
            block_tables=self.block_tables[:bucket],
            seq_lens=self.seq_lens[:bucket],
            query_start_loc=self.query_start_loc[: bucket + 1],
            num_paged_tokens=bucket,
            max_query_len=1,
            max_seq_len=self.max_context,
            fresh_query_lens=[],
            all_seq_lens=[self.max_context] * bucket,
            all_query_lens=[1] * bucket,
            backend=self.backend,
        )

    def forward_static(self, bucket: int) -> torch.Tensor:
        """The model's forward pass over the static buffers of `bucket` (what a graph records)."""
        return self.model(
            self.input_ids[:bucket], self.positions[:bucket], self.kv_caches,
            self.static_metadata(bucket), self.logits_indices[:bucket],
        )

    def _forward(self, bucket: int) -> torch.Tensor:
        raise NotImplementedError


class EagerDecodeRunner(DecodeRunner):
    """The static-buffer path run eagerly: padding and bucketing without recording."""

    def _forward(self, bucket: int) -> torch.Tensor:
        return self.forward_static(bucket)


class CudaGraphDecodeRunner(DecodeRunner):
    """Records one CUDA graph per bucket at construction and replays it per decode step."""

    def __init__(self, model, kv_caches, *, device: torch.device, backend: str, **kwargs):
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {device}")
        if backend != "triton":
            raise ValueError(
                f"CUDA graphs need the triton attention backend (the {backend!r} path "
                "synchronizes with the host inside the forward pass)"
            )
        super().__init__(model, kv_caches, device=device, backend=backend, **kwargs)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.capture_seconds = 0.0
        self._capture_all()

    def _capture_all(self) -> None:
        t0 = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        # Largest first: the smaller graphs reuse the shared pool's memory.
        for bucket in reversed(self.batch_sizes):
            self.graphs[bucket] = self._capture(bucket, pool)
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - t0
        log.info("captured %d decode CUDA graphs (batch %s) in %.1f s",
                 len(self.graphs), self.batch_sizes, self.capture_seconds)

    def _capture(self, bucket: int, pool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # All rows padding: the recording writes no KV (slot -1) and reads block 0 only.
        self.slot_mapping[:bucket].fill_(-1)
        self.seq_lens[:bucket].fill_(1)
        self.block_tables[:bucket].zero_()
        self.logits_indices[:bucket].copy_(torch.arange(bucket, device=self.device))
        # Warm-up outside the recording, on a side stream as torch's docs advise (lazy
        # per-stream state): Triton compiles and autotunes here, with the replay's launch key
        # (static shapes and the static maximum context).
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self.forward_static(bucket)
        torch.cuda.current_stream(self.device).wait_stream(side)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            logits = self.forward_static(bucket)
        return graph, logits

    def _forward(self, bucket: int) -> torch.Tensor:
        graph, logits = self.graphs[bucket]
        graph.replay()
        return logits


def make_decode_runner(
    enabled: bool,
    model: CausalLM,
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    *,
    block_size: int,
    max_model_len: int,
    max_batch: int,
    backend: str,
    device: torch.device,
) -> Optional[DecodeRunner]:
    """The executor's decode runner for `engine.cudaGraphs`: None when off; on a CPU device
    (`device: auto` on a host without a GPU) a warning, and eager steps."""
    if not enabled:
        return None
    if device.type != "cuda":
        log.warning("engine.cudaGraphs is set but the engine runs on %s: decode steps run eager", device)
        return None
    return CudaGraphDecodeRunner(model, kv_caches, block_size=block_size, max_model_len=max_model_len,
                                 max_batch=max_batch, backend=backend, device=device)


__all__ = [
    "CudaGraphDecodeRunner",
    "DecodeRunner",
    "EagerDecodeRunner",
    "graph_batch_sizes",
    "make_decode_runner",
    "pick_bucket",
]
