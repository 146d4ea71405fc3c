"""One step's flat batch, built from the scheduled chunks with a few tensor ops.

The model reads every scheduled token of a step as one flat batch (docs/architecture.md,
"The request path"): token ids, positions, the KV-cache slot of each token, and for the
sequences that attend through the paged cache their block tables, context lengths and
query offsets. Decodes are the common case (one token per sequence), so the per-chunk
Python work is a few appends, and the rest is a handful of tensor ops:

- each request's block table lives as a row of one persistent int32 table
  (`PersistentBlockTables`), rewritten only when its `block_ids` list changed (a block
  appended every blockSize tokens, a copy on write, a preemption), so a step gathers its
  rows with one `index_select` instead of converting nested Python lists;
- a multi-token chunk's positions and slots are extended one block at a time from
  `range`s (no Python work per token: measured faster on the CPU than a gather per chunk);
- the int64 inputs (ids, positions, slots) become one tensor in one conversion, the int32
  metadata (context lengths, query offsets) another, so an accelerator gets three copies;
  each goes through numpy (`host_tensor`): a list to an array is one C loop, 2-4 times faster
  than `torch.tensor` of the same list;
- a step of decodes alone (every chunk one sampled token) is built column by column, one
  comprehension per input (`_build_decodes`), instead of chunk by chunk.

Chunked prefill stays exact: a chunk covers positions [start, start + n) of its request,
whatever mix of prompt and generated tokens they are.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate
from typing import Optional, Sequence

import numpy as np
import torch

from tokenlane.kernels.lora import LoraSegments, lora_segments
from tokenlane.runtime.executor.llama import AttentionMetadata
from tokenlane.runtime.executor.sampler import argmax_only
from tokenlane.runtime.core.step_plan import ScheduledChunk
from tokenlane.runtime.core.request import Request


def host_tensor(values: list, dtype: np.dtype) -> torch.Tensor:
    """A CPU tensor of a (nested) list of ints, through numpy: several times faster than
    `torch.tensor` for the few hundred values of a step's inputs."""
    return torch.from_numpy(np.array(values, dtype=dtype))


def chunk_token_ids(chunk: ScheduledChunk) -> list[int]:
    """The token ids at positions [start, start + num_tokens) of the chunk's request."""
    request, start, n = chunk.request, chunk.start, chunk.num_tokens
    prompt = request.prompt_token_ids
    if start + n <= len(prompt):
        return prompt[start : start + n]
    if start >= len(prompt):
        out_start = start - len(prompt)
        return request.output_token_ids[out_start : out_start + n]
    return (prompt + request.output_token_ids)[start : start + n]


class PersistentBlockTables:
    """Each request's block ids as one row of a host int32 table, past its length zero.

    A row is rewritten when the request's `block_ids` differ from the copy taken at the
    last write (an O(blocks) list comparison in C, no tensor work when nothing changed).
    Rows are handed back by `release` (finished or preempted requests)."""

    def __init__(self, width: int, capacity: int = 64) -> None:
        self.width = max(1, width)
        self._set_table(torch.zeros((capacity, self.width), dtype=torch.int32))
        self.rows: dict[str, int] = {}  # request id -> its row
        self.known: dict[str, list[int]] = {}  # request id -> the block ids its row holds
        self._free: list[int] = list(range(capacity - 1, -1, -1))

    def __len__(self) -> int:
        return len(self.rows)

    def row_of(self, request: Request) -> int:
        """The request's row, brought up to date with its block ids."""
        rid = request.request_id
        row = self.rows.get(rid)
        if row is None:
            row = self.rows[rid] = self._take_row()
            self.known[rid] = []
        blocks = request.block_ids
        known = self.known[rid]
        if blocks != known:
            if len(blocks) > self.width:
                self._widen(len(blocks))
            n_known = len(known)
            # Through the table's numpy view: a list written there is one C loop, where a
            # torch.tensor and an index_put cost two dispatches (a decode step appends a block
            # to one sequence in block_size, every step).
            target = self._table_view[row]
            if n_known < len(blocks) and blocks[:n_known] == known:
                target[n_known : len(blocks)] = blocks[n_known:]
            else:
                target[:] = 0
                if blocks:
                    target[: len(blocks)] = blocks
            self.known[rid] = list(blocks)
        return row

    def gather(self, rows: list[int], width: int) -> torch.Tensor:
        """The first `width` columns of these rows, as a new contiguous [len(rows), width]
        int32 tensor (only the columns in use: the table is as wide as the longest context)."""
        return torch.from_numpy(self._table_view[rows, :width])

    def release(self, request_id: str) -> None:
        row = self.rows.pop(request_id, None)
        if row is not None:
            self.known.pop(request_id)
            self._table_view[row] = 0
            self._free.append(row)

    def _widen(self, width: int) -> None:
        wider = torch.zeros((self.table.shape[0], max(width, 2 * self.width)), dtype=torch.int32)
        wider[:, : self.width] = self.table
        self._set_table(wider)

    def _set_table(self, table: torch.Tensor) -> None:
        self.table, self.width = table, table.shape[1]
        self._table_view = table.numpy()  # shares the tensor's memory

    def _take_row(self) -> int:
        if not self._free:
            capacity = self.table.shape[0]
            grown = torch.zeros((2 * capacity, self.width), dtype=torch.int32)
            grown[:capacity] = self.table
            self._set_table(grown)
            self._free = list(range(2 * capacity - 1, capacity - 1, -1))
        return self._free.pop()


@dataclass
class BatchInputs:
    """The model's inputs for one step plus what the sampler and logprobs need."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    # Rows of the batch that get logits: one per sampling chunk, then the prompt-logprob rows.
    logits_rows: list[int]
    sampled_chunks: list[ScheduledChunk]
    prompt_targets: list[int] = field(default_factory=list)  # prompt token each prompt row scores
    prompt_ks: list[int] = field(default_factory=list)
    prompt_spans: list[tuple[str, int, int]] = field(default_factory=list)  # (request id, first scored, count)
    # Every sampled row takes the argmax of its raw logits and nothing else reads them
    # (sampler.argmax_only), and no row scores prompt logprobs: the LM head may hand back
    # the tokens instead of the logits.
    argmax_only: bool = False

    @property
    def num_sampled(self) -> int:
        return len(self.sampled_chunks)


class BatchInputBuilder:
    """Builds `BatchInputs` for a device; holds the persistent block tables."""

    def __init__(self, block_size: int, max_model_len: int, device: torch.device, backend: str,
                 sdpa_fresh_prefill: bool) -> None:
        self.block_size = block_size
        self.device = torch.device(device)
        self.backend = backend
        # Where the attention kernels do not take prefill chunks without cached context
        # (start == 0; kernels.api.fresh_prefill_through_cache), they skip the paged cache
        # (model.py): such chunks go last, outside the block tables.
        self.sdpa_fresh_prefill = sdpa_fresh_prefill
        self.block_tables = PersistentBlockTables(-(-max_model_len // block_size))
        # Each running request's sampler.argmax_only, taken when it first runs (a request's
        # sampling parameters do not change while it runs): one dict lookup a row and step.
        self._argmax: dict[str, bool] = {}

    def release(self, request_id: str) -> None:
        self.block_tables.release(request_id)
        self._argmax.pop(request_id, None)

    def _argmax_only(self, request: Request) -> bool:
        argmax = self._argmax.get(request.request_id)
        if argmax is None:
            argmax = self._argmax[request.request_id] = argmax_only(request.sampling_params)
        return argmax

    def build(self, chunks: list[ScheduledChunk], adapter_slots: Optional[dict[str, int]] = None,
              slot_ranks: Sequence[int] = ()) -> BatchInputs:
        """`adapter_slots`: the slot of each adapter of the step's requests (the LoRA slot table's
        ranks in `slot_ranks`); the batch's rows are grouped by slot once, for every layer."""
        if not adapter_slots:
            decodes = self._build_decodes(chunks)
            if decodes is not None:
                return decodes
        if adapter_slots:
            # Each adapter's rows side by side (a stable sort: base rows first, then by slot), so
            # that the LoRA products take them as slices of the batch, not gathers.
            chunks = sorted(chunks, key=lambda c: adapter_slots.get(c.request.adapter, -1))
        if self.sdpa_fresh_prefill:
            paged = [c for c in chunks if c.start > 0]
            fresh = [c for c in chunks if c.start == 0]
            ordered = paged + fresh if fresh else paged
        else:
            ordered = paged = chunks
        bs = self.block_size
        block_tables = self.block_tables
        row_of, rows_get, known_get = block_tables.row_of, block_tables.rows.get, block_tables.known.get
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        query_lens: list[int] = []
        rows: list[int] = []
        logits_rows: list[int] = []
        sampled_chunks: list[ScheduledChunk] = []
        prompt_rows: list[int] = []
        prompt_targets: list[int] = []
        prompt_ks: list[int] = []
        prompt_spans: list[tuple[str, int, int]] = []
        lora_runs: Optional[list[tuple[int, int, int]]] = [] if adapter_slots else None
        all_argmax = True
        offset = 0
        for c in ordered:
            request, n, start = c.request, c.num_tokens, c.start
            if lora_runs is not None:
                adapter = request.adapter
                if adapter is not None:
                    lora_runs.append((offset, n, adapter_slots[adapter]))
            blocks = request.block_ids
            row = rows_get(request.request_id)
            if row is None or known_get(request.request_id) != blocks:
                row = row_of(request)
            rows.append(row)
            prompt = request.prompt_token_ids
            if n == 1:  # a decode (or a one-token chunk): its slot at once
                token_ids.append(prompt[start] if start < len(prompt) else request.output_token_ids[start - len(prompt)])
                positions.append(start)
                slots.append(blocks[start // bs] * bs + start % bs)
            else:  # a run of slots per block (ranges: no Python work per token)
                token_ids += chunk_token_ids(c)
                end = start + n
                positions += range(start, end)
                for b in range(start // bs, (end - 1) // bs + 1):
                    base = blocks[b] * bs - b * bs
                    slots += range(base + max(start, b * bs), base + min(end, b * bs + bs))
            seq_lens.append(start + n)
            query_lens.append(n)
            k = request.sampling_params.prompt_logprobs
            if k is not None:
                # Position p scores prompt token p + 1: positions lo .. end - 1 here, past
                # the tokens already scored (a recomputation after a preemption has them).
                lo = max(start, len(request.prompt_logprobs) - 1)
                end = min(start + n, len(prompt) - 1)
                if end > lo:
                    prompt_rows += range(offset + lo - start, offset + end - start)
                    prompt_targets += prompt[lo + 1 : end + 1]
                    prompt_ks += [k] * (end - lo)
                    prompt_spans.append((request.request_id, lo + 1, end - lo))
            offset += n
            if c.sample:
                logits_rows.append(offset - 1)
                sampled_chunks.append(c)
                if all_argmax and not self._argmax_only(request):
                    all_argmax = False

        lora = lora_segments(lora_runs, len(token_ids), slot_ranks, self.device) if lora_runs else None
        flat, meta = self._tensors(token_ids, positions, slots, seq_lens, query_lens, rows, len(paged), lora)
        return BatchInputs(
            input_ids=flat[0],
            positions=flat[1],
            meta=meta,
            logits_rows=logits_rows + prompt_rows,
            sampled_chunks=sampled_chunks,
            prompt_targets=prompt_targets,
            prompt_ks=prompt_ks,
            prompt_spans=prompt_spans,
            argmax_only=all_argmax and not prompt_rows,
        )

    def _tensors(self, token_ids: list[int], positions: list[int], slots: list[int], seq_lens: list[int],
                 query_lens: list[int], rows: list[int], n_paged: int, lora: Optional[LoraSegments] = None
                 ) -> tuple[torch.Tensor, AttentionMetadata]:
        """The batch's tensors from its columns (the first `n_paged` sequences attend through
        the paged cache): [3, T] int64 ids, positions and slots, and the attention metadata."""
        # int64 inputs in one conversion (and, on an accelerator, one copy): ids, positions, slots.
        flat = host_tensor([token_ids, positions, slots], np.int64)
        paged_lens, paged_query_lens = seq_lens[:n_paged], query_lens[:n_paged]
        # int32 metadata of the paged sequences in one conversion: context lengths, query offsets.
        small = host_tensor(paged_lens + list(accumulate(paged_query_lens, initial=0)), np.int32)
        if n_paged:
            tables = self.block_tables.gather(rows[:n_paged], -(-max(paged_lens) // self.block_size))
        else:
            tables = torch.zeros((0, 1), dtype=torch.int32)
        dev = self.device
        if dev.type != "cpu":
            flat, small, tables = flat.to(dev), small.to(dev), tables.to(dev)
        meta = AttentionMetadata(
            slot_mapping=flat[2],
            block_tables=tables,
            seq_lens=small[:n_paged],
            query_start_loc=small[n_paged:],
            num_paged_tokens=sum(paged_query_lens),
            max_query_len=max(paged_query_lens, default=0),
            max_seq_len=max(paged_lens, default=0),
            fresh_query_lens=query_lens[n_paged:],
            all_seq_lens=seq_lens,
            all_query_lens=query_lens,
            backend=self.backend,
            lora=lora,
        )
        return flat, meta

    def _build_decodes(self, chunks: list[ScheduledChunk]) -> Optional[BatchInputs]:
        """The batch of a step of decodes alone (every chunk one token, sampled, with context
        before it: most steps), built column by column instead of chunk by chunk; None for any
        other step, which `build`'s loop takes. The same inputs as that loop makes (tested).

        A sampled chunk of one token computes its request's last known token, so its id is the
        last output token (the prompt's last, before the first output), and it scores no
        prompt logprobs."""
        if not chunks or not all([c.num_tokens == 1 and c.sample for c in chunks]):
            return None
        starts = [c.start for c in chunks]
        if min(starts) < 1:  # a one-token prompt: a fresh prefill, which may skip the paged cache
            return None
        requests = [c.request for c in chunks]
        block_tables = self.block_tables
        rows_get, known_get, row_of = block_tables.rows.get, block_tables.known.get, block_tables.row_of
        rows = [row if (row := rows_get(r.request_id)) is not None and known_get(r.request_id) == r.block_ids
                else row_of(r) for r in requests]
        token_ids = [r.output_token_ids[-1] if r.output_token_ids else r.prompt_token_ids[-1] for r in requests]
        bs = self.block_size
        slots = [r.block_ids[s // bs] * bs + s % bs for r, s in zip(requests, starts)]
        all_argmax = all([self._argmax_only(r) for r in requests])
        n = len(chunks)
        flat, meta = self._tensors(token_ids, starts, slots, [s + 1 for s in starts], [1] * n, rows, n)
        return BatchInputs(input_ids=flat[0], positions=flat[1], meta=meta, logits_rows=list(range(n)),
                           sampled_chunks=list(chunks), argmax_only=all_argmax)
