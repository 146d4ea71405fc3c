"""The scheduler's one door to the KV pool: every block a request takes or gives back goes
through `LaneKVAllocator`, which checks the lane's KV shares and charges or releases them in
the same call.

    allocate(request, num_new_tokens, lane) -> new block ids | None
    free(request)

`allocate` grows the request's block table to cover `num_new_tokens` more tokens (a decode's
one token, a prefill chunk, a first chunk on top of cached prefix blocks) if the free blocks
and the lane's room (its cap, less the other lanes' unmet reserves; kv_quotas.py) allow, and
returns the block ids it added (an empty list when the table already covers them); None, and
nothing changed, when they don't. `free` releases the blocks and the lane's charge together,
so the quota books never need a recount: they follow every block-table change as it happens.
Parallel sampling goes through here too: a fork adds table entries to the follower's lane
within its room (`fork` returns None when the lane's cap cannot take them), and a sequence
about to write into a block its group still shares gets its own copy within the same
`allocate` call (the copy takes one more free block from the lane's room; the
(src, dst) pair goes to the step's `block_copies`).

Pure Python, like the rest of runtime/core.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Optional, Sequence

from tokenlane.runtime.config import LaneBudgets
from tokenlane.runtime.core.kv_cache import KVCacheManager
from tokenlane.runtime.core.kv_quotas import LaneKVQuotas
from tokenlane.runtime.core.request import Request


class LaneKVAllocator:
    def __init__(self, kv: KVCacheManager, quotas: LaneKVQuotas) -> None:
        self.kv = kv
        self.quotas = quotas
        # request_id -> the lane its block-table entries are charged to (released to the same
        # lane, even if a reload moved the request since: `configure` re-books those).
        self._charged_lane: dict[str, str] = {}

    # ------------------------------------------------------------------ config

    def configure(self, budgets: Mapping[str, LaneBudgets], holders: Iterable[Request]) -> None:
        """Take the lanes' shares (hot reload) and re-book the block holders under their
        current lanes (a removed lane's requests moved to the default lane)."""
        self.quotas.configure(budgets)
        holders = [r for r in holders if r.request_id in self._charged_lane]
        for request in holders:
            self._charged_lane[request.request_id] = request.lane
        self.quotas.recount(holders)

    # ------------------------------------------------------------------ queries

    def room(self, lane: str) -> int:
        """Blocks the lane may take now (the free blocks, without KV shares)."""
        return self.quotas.room(lane, self.kv.num_free_blocks)

    def fits(self, num_blocks: int, lane: Optional[str], table_growth: Optional[int] = None) -> bool:
        """Whether `num_blocks` free blocks may be taken for the lane; `table_growth`: the
        block-table entries that adds, when more (prefix hits on blocks in use count against
        the lane's cap but take no free block)."""
        quotas = self.quotas
        if lane is None or not quotas.active:
            return self.kv.can_allocate(num_blocks)
        if table_growth is not None and table_growth > num_blocks:
            cap = quotas.cap.get(lane, quotas.num_blocks)
            if cap < quotas.num_blocks and quotas.held.get(lane, 0) + table_growth > cap:
                return False
        return num_blocks <= self.room(lane)

    def blocks_needed(
        self, request: Request, num_new_tokens: int, cached_blocks: Sequence[int] = (), num_restored: int = 0
    ) -> int:
        """Free blocks `allocate(request, num_new_tokens, lane, cached_blocks, restore_slots)`
        needs in the lane's room (with KV shares, prefix hits on another lane's blocks count
        too; each host-tier hit takes a fresh block)."""
        if not cached_blocks and not num_restored and request.block_ids:  # a running request: kept lean
            table = request.block_ids
            new = -(-(request.num_computed_tokens + num_new_tokens) // self.kv.block_size) - len(table)
            copy = request.group is not None and self._shared_write_index(request) is not None
            return max(new, 0) + copy
        need = self.kv.num_blocks_to_allocate(request, num_new_tokens, cached_blocks, num_restored)
        if cached_blocks and self.quotas.active:
            need += self.quotas.unmet_growth_of_sharing(request.lane, cached_blocks)
        return need

    def tokens_in_room(self, request: Request, lane: str) -> int:
        """The most tokens the request's table can cover with the blocks the lane may take now."""
        copy = self._shared_write_index(request) is not None
        return (len(request.block_ids) + self.room(lane) - copy) * self.kv.block_size

    def usage_of(self, lane: str) -> float:
        """The lane's KV usage for its watermarks (against its own capacity with KV shares)."""
        return self.quotas.usage_of(lane, self.kv.num_free_blocks)

    def within_reserve(self, lane: str) -> bool:
        """Whether the lane owns no more blocks than its reserve (evicting its requests frees
        nothing the other lanes may take)."""
        quotas = self.quotas
        return quotas.owned.get(lane, 0) <= quotas.reserve.get(lane, 0)

    # ------------------------------------------------------------------ actions

    def allocate(
        self,
        request: Request,
        num_new_tokens: int,
        lane: str,
        cached_blocks: Sequence[int] = (),
        restore_slots: Sequence[int] = (),
        *,
        block_copies: Optional[list[tuple[int, int]]] = None,
    ) -> Optional[list[int]]:
        """Grow the request's block table to cover `num_new_tokens` more tokens, charged to
        `lane`: the block ids added, or None (nothing changed) if the pool or the lane's room
        lacks them. `cached_blocks` (from `find_cached_prefix`) only on a request's first
        allocation, and `restore_slots` (from `find_host_prefix`: host-tier hits copied into
        fresh blocks, charged to `lane` like any new block) with them. If the request's next token goes into a block its sequence group still
        shares, it gets its own copy first, and (src, dst) is appended to `block_copies` (the
        table keeps its length, so the charge does not change)."""
        kv = self.kv
        table = request.block_ids
        held = len(table)
        hits = len(cached_blocks) + len(restore_slots)
        if not hits and held:
            # A running request (a decode, or its next prefill chunk): the hot path, kept lean.
            new = -(-(request.num_computed_tokens + num_new_tokens) // kv.block_size) - held
            copy_at = None if request.group is None else self._shared_write_index(request)
            if copy_at is None:
                if new <= 0:
                    return []
                if not (self.fits(new, lane) if self.quotas.active else new <= kv.num_free_blocks):
                    return None
            elif not self.fits(max(new, 0) + 1, lane):
                return None
            else:
                self._copy(request, copy_at, lane, block_copies)
            if new <= 0:
                return []
            for _ in range(new):
                kv.append_block(request)
            added = table[held:]
            self.quotas.take(lane, added)
            return added
        copy_at = None if hits else self._shared_write_index(request)
        need = kv.num_blocks_to_allocate(request, num_new_tokens, cached_blocks, len(restore_slots))
        need += copy_at is not None
        if cached_blocks and self.quotas.active:
            need += self.quotas.unmet_growth_of_sharing(lane, cached_blocks)
        covered = request.num_computed_tokens + hits * kv.block_size + num_new_tokens
        if not self.fits(need, lane, kv.blocks_for_tokens(covered) - held):
            return None
        if copy_at is not None:
            self._copy(request, copy_at, lane, block_copies)
        kv.allocate(request, num_new_tokens, cached_blocks, restore_slots)
        self._charge(request, lane, table[held:])
        return table[held:]

    def _copy(
        self, request: Request, index: int, lane: str, block_copies: Optional[list[tuple[int, int]]]
    ) -> None:
        assert block_copies is not None, "a shared block to copy, and nowhere to record it"
        src, dst = self.kv.copy_on_write(request, index)
        self.quotas.drop(lane, (src,))
        self.quotas.take(lane, (dst,))
        block_copies.append((src, dst))

    def _shared_write_index(self, request: Request) -> Optional[int]:
        """Index in the request's table of the block its next token goes into, if another
        table holds that block too (only a forked sequence group shares a partly filled
        block; prefix-cache hits are full blocks, never written again)."""
        if request.group is None:
            return None
        index = request.num_computed_tokens // self.kv.block_size
        table = request.block_ids
        return index if index < len(table) and self.kv.is_shared(table[index]) else None

    def fork(self, parent: Request, child: Request, num_tokens: int) -> Optional[list[int]]:
        """Share the parent's blocks covering `num_tokens` with the child (kv_cache.fork),
        charged to the child's lane like any allocation (shared entries count per holder
        against its cap; they take no free block): the child's table, or None (nothing
        changed) if the lane's room lacks them."""
        kv, lane = self.kv, child.lane
        shared = parent.block_ids[: kv.blocks_for_tokens(num_tokens)]
        need = self.quotas.unmet_growth_of_sharing(lane, shared) if self.quotas.active else 0
        if not self.fits(need, lane, len(shared)):
            return None
        kv.fork(parent, child, num_tokens)
        self._charge(child, lane, child.block_ids)
        return child.block_ids

    def free(self, request: Request) -> None:
        """Release the request's blocks and its lane's charge for them. Idempotent."""
        lane = self._charged_lane.pop(request.request_id, None)
        if lane is not None:
            self.quotas.drop(lane, request.block_ids)
        self.kv.free(request)

    def _charge(self, request: Request, lane: str, block_ids: Sequence[int]) -> None:
        self._charged_lane[request.request_id] = lane
        self.quotas.take(lane, block_ids)

    # ------------------------------------------------------------------ checks

    def check_invariants(self, live: Iterable[Request], running: Iterable[Request]) -> None:
        """The pool's books (kv_cache), the quota books against a recount (kv_quotas), and
        every block holder charged to its own lane."""
        live = list(live)
        self.kv.check_invariants(live)
        running = list(running)
        self.quotas.check_invariants(running, self.kv.num_free_blocks)
        for request in live:
            if request.block_ids:
                assert self._charged_lane.get(request.request_id) == request.lane, request.request_id
        assert set(self._charged_lane) <= {r.request_id for r in live}, "a finished request still charged"
