"""The segmented LoRA product: many adapters' low-rank deltas in one batch (Punica / S-LoRA style).

A step's rows (tokens) belong to different adapters, each resident in a *slot* of stacked
weight tensors, or to none (slot -1, the base model). Per target projection the delta of row t
with slot s is

    y[t, cols_g] += (x[t] @ A[s, g*r_s : (g+1)*r_s].T) @ B_g[s, :r_s] * scaling[s, g]

for each of the G sub-projections g of a (possibly fused) projection: q, k and v share one
input and one stacked `A` (one *shrink* for the three), each writes its own column slice of
the fused output (one *expand* each). Shapes:

- `x` [T, K]; `outs[g]` [T, N_g] (column views of the fused output are fine: rows may have any
  stride, columns must be contiguous);
- `lora_a` [S, G * R, K]: slot s holds its G sub-projections' A matrices stacked by its own rank
  r_s (rows g*r_s .. (g+1)*r_s), zero past G * r_s;
- `lora_b[g]` [S, R, N_g]: B transposed (PEFT stores [N, r]), rows past r_s zero;
- `scaling` [S, G] float32: lora_alpha / r (or / sqrt(r) with rsLoRA) per slot and sub-projection.

Rows are grouped by slot once per step (`lora_segments`) and every layer and projection of that
step reuses the grouping. Two implementations behind `add_lora`: Triton kernels
(kernels/lora_triton.py: shrink into a
float32 [M, G*R] buffer of the M adapter rows in slot order, then one expand per
sub-projection that adds into the output rows in place) and a CPU path of one matmul per
segment and sub-projection at the slot's own rank (no padding to R, no per-adapter forward).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

LORA_BACKENDS = ("auto", "torch", "triton")


@dataclass
class LoraSegments:
    """A step's adapter rows grouped by slot: segment i covers `order[starts[i] : starts[i] +
    lengths[i]]`, the batch rows of slot `slots[i]` (ascending), with that slot's rank."""

    num_rows: int  # T, the batch's rows (adapter rows and base rows)
    order: torch.Tensor  # [M] int64 on the batch's device: adapter rows, grouped by slot
    starts: list[int]
    lengths: list[int]
    slots: list[int]
    ranks: list[int]
    # Per segment, the rows as a slice where they are one contiguous run (a prefill chunk, or
    # a decode batch already in slot order), else an index tensor: the CPU path gathers less.
    rows: list
    # Device copies of the segment table for the Triton kernels: int32 [num_segments] each.
    seg_start: torch.Tensor
    seg_len: torch.Tensor
    seg_slot: torch.Tensor
    seg_rank: torch.Tensor
    max_length: int

    @property
    def num_adapter_rows(self) -> int:
        return int(self.order.shape[0])


def lora_segments(runs: Sequence[tuple[int, int, int]], num_rows: int, slot_ranks: Sequence[int],
                  device: torch.device | str = "cpu") -> Optional[LoraSegments]:
    """Group a batch's rows by adapter slot. `runs` are (first row, rows, slot) of consecutive
    rows sharing a slot (one per scheduled chunk; slot -1 = base rows, skipped); `slot_ranks[s]`
    is slot s's rank. None when no row has an adapter."""
    by_slot: dict[int, list[tuple[int, int]]] = {}
    for first, count, slot in runs:
        if slot < 0 or count <= 0:
            continue
        if first < 0 or first + count > num_rows:
            raise ValueError(f"LoRA run [{first}, {first + count}) outside the batch's {num_rows} rows")
        if slot >= len(slot_ranks):
            raise ValueError(f"LoRA slot {slot} out of range: {len(slot_ranks)} slots")
        by_slot.setdefault(slot, []).append((first, count))
    if not by_slot:
        return None
    order: list[int] = []
    starts, lengths, slots, ranks, rows = [], [], [], [], []
    for slot in sorted(by_slot):
        merged: list[list[int]] = []
        for first, count in by_slot[slot]:
            if merged and merged[-1][0] + merged[-1][1] == first:
                merged[-1][1] += count
            else:
                merged.append([first, count])
        starts.append(len(order))
        for first, count in merged:
            order.extend(range(first, first + count))
        lengths.append(len(order) - starts[-1])
        slots.append(slot)
        ranks.append(int(slot_ranks[slot]))
        rows.append(slice(merged[0][0], merged[0][0] + merged[0][1]) if len(merged) == 1 else None)
    device = torch.device(device)
    order_t = torch.tensor(order, dtype=torch.int64)
    table = torch.tensor([starts, lengths, slots, ranks], dtype=torch.int32)
    if device.type != "cpu":
        order_t, table = order_t.to(device), table.to(device)
    rows = [r if r is not None else order_t[s : s + n] for r, s, n in zip(rows, starts, lengths)]
    return LoraSegments(num_rows=num_rows, order=order_t, starts=starts, lengths=lengths, slots=slots,
                        ranks=ranks, rows=rows, seg_start=table[0], seg_len=table[1], seg_slot=table[2],
                        seg_rank=table[3], max_length=max(lengths))


def resolve_lora_backend(backend: str, device: torch.device) -> str:
    """auto = Triton on CUDA, torch on the CPU. The attention backends map here too: `native`
    (the CPU's C kernels) runs the torch path."""
    if backend == "native":
        backend = "torch"
    if backend not in LORA_BACKENDS:
        raise ValueError(f"LoRA backend must be one of {LORA_BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "triton" if torch.device(device).type == "cuda" else "torch"
    return backend


def check_lora_args(outs: Sequence[torch.Tensor], x: torch.Tensor, lora_a: torch.Tensor,
                    lora_b: Sequence[torch.Tensor], scaling: torch.Tensor, segments: LoraSegments) -> None:
    """Shapes, strides, dtypes and devices of one `add_lora` call (ValueError on a mismatch)."""
    groups = len(lora_b)
    if groups == 0 or len(outs) != groups:
        raise ValueError(f"add_lora: {len(outs)} outputs for {groups} B matrices")
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"add_lora: x must be [T, K] with contiguous rows, got shape {tuple(x.shape)} "
                         f"strides {x.stride()}")
    T, K = x.shape
    if T != segments.num_rows:
        raise ValueError(f"add_lora: x has {T} rows, the segments {segments.num_rows}")
    if lora_a.dim() != 3 or not lora_a.is_contiguous() or lora_a.shape[2] != K or lora_a.shape[1] % groups:
        raise ValueError(f"add_lora: lora_a must be a contiguous [S, G*R, {K}] with G={groups}, "
                         f"got {tuple(lora_a.shape)}")
    S, R = lora_a.shape[0], lora_a.shape[1] // groups
    if tuple(scaling.shape) != (S, groups) or scaling.dtype != torch.float32 or not scaling.is_contiguous():
        raise ValueError(f"add_lora: scaling must be a contiguous float32 [{S}, {groups}], got {scaling.dtype} "
                         f"{tuple(scaling.shape)}")
    for g, (out, b) in enumerate(zip(outs, lora_b)):
        if b.dim() != 3 or not b.is_contiguous() or b.shape[0] != S or b.shape[1] != R:
            raise ValueError(f"add_lora: lora_b[{g}] must be a contiguous [{S}, {R}, N], got {tuple(b.shape)}")
        if out.dim() != 2 or out.shape[0] != T or out.shape[1] != b.shape[2] or out.stride(1) != 1:
            raise ValueError(f"add_lora: outs[{g}] must be [{T}, {b.shape[2]}] with contiguous columns, "
                             f"got shape {tuple(out.shape)} strides {out.stride()}")
        if out.dtype != x.dtype or b.dtype != x.dtype:
            raise ValueError(f"add_lora: dtypes differ: x {x.dtype}, lora_b[{g}] {b.dtype}, outs[{g}] {out.dtype}")
    if lora_a.dtype != x.dtype:
        raise ValueError(f"add_lora: dtypes differ: x {x.dtype}, lora_a {lora_a.dtype}")
    tensors = [x, lora_a, scaling, segments.order, *outs, *lora_b]
    if len({t.device for t in tensors}) != 1:
        raise ValueError("add_lora: all tensors must be on one device")
    if max(segments.slots) >= S:
        raise ValueError(f"add_lora: slot {max(segments.slots)} out of range for {S} slots")
    if max(segments.ranks) > R:
        raise ValueError(f"add_lora: rank {max(segments.ranks)} above the slots' rank {R}")


def add_lora(outs: Sequence[torch.Tensor], x: torch.Tensor, lora_a: torch.Tensor, lora_b: Sequence[torch.Tensor],
             scaling: torch.Tensor, segments: Optional[LoraSegments], backend: str = "auto", *,
             check: bool = True) -> None:
    """Add each adapter row's LoRA delta into `outs` in place (module docstring). Rows of slot -1
    and a None `segments` (no adapter rows) are left alone. `check=False` skips the argument
    checks (the model's per-layer calls, whose tensors the slot table made)."""
    if segments is None:
        return
    if check:
        check_lora_args(outs, x, lora_a, lora_b, scaling, segments)
    if resolve_lora_backend(backend, x.device) == "triton":
        from tokenlane.kernels.lora_triton import lora_expand_triton, lora_shrink_triton

        buffer = lora_shrink_triton(x, lora_a, segments)
        for g, (out, b) in enumerate(zip(outs, lora_b)):
            lora_expand_triton(buffer, b, scaling, g, len(lora_b), out, segments)
        return
    _add_lora_torch(outs, x, lora_a, lora_b, scaling, segments)


def _add_lora_torch(outs, x, lora_a, lora_b, scaling, segments: LoraSegments) -> None:
    groups = len(lora_b)
    scales = scaling.tolist()  # host floats: addmm's alpha, no tensor op per product
    for rows, slot, rank in zip(segments.rows, segments.slots, segments.ranks):
        if rank == 0:
            continue
        contiguous = isinstance(rows, slice)
        xs = x[rows] if contiguous else x.index_select(0, rows)
        shrunk = torch.mm(xs, lora_a[slot, : groups * rank].t())  # [n, G * r]
        for g, (out, b) in enumerate(zip(outs, lora_b)):
            part = shrunk[:, g * rank : (g + 1) * rank] if groups > 1 else shrunk
            if contiguous:  # one fused product-and-add into the output rows
                out[rows].addmm_(part, b[slot, :rank], alpha=scales[slot][g])
            else:
                out.index_add_(0, rows, torch.mm(part, b[slot, :rank]), alpha=scales[slot][g])


__all__ = ["LORA_BACKENDS", "LoraSegments", "add_lora", "check_lora_args", "lora_segments", "resolve_lora_backend"]
