"""Per-lane shares of the KV cache: a cap on what a lane holds, a reserve other lanes never take.

A lane's `maxKvCacheShare` caps the blocks its requests hold; its `kvCacheReserved` is a
share of the pool that the other lanes may not allocate into while the lane holds less than
it. The cap is counted in block-table entries (`held`: a prefix block shared by two requests
counts for each holder, never under-counted); the reserve in the blocks only the lane's
requests hold (`owned`: a block shared with another lane stays taken when the lane lets go of
it, so it cannot stand in for a free block of the reserve). With `T` blocks in the pool, for
every lane `L`:

    cap(L)     = floor(maxKvCacheShare(L) x T)
    reserve(L) = floor(kvCacheReserved(L) x T)
    unmet(L)   = max(0, reserve(L) - owned(L))
    room(L)    = min(free - sum of unmet(M) over the other lanes M, cap(L) - held(L))

and a lane only allocates within its room (a prefix hit on a block only another lane holds
counts as taking what that lane's unmet reserve grows by), so `free >= sum of unmet` holds at
every step, and after any request lets go of its blocks (the reserves are free whenever
their lanes may want them). The high watermark is applied to
each lane against its own capacity (`usage_of`), and a lane still inside its reserve ignores
it: that is what lets the interactive lane keep starting prefills while the long-context lane
sits above the watermark (docs/tuning.md, "Lane isolation").

Pure Python; the KV allocator (kv_allocator.py) keeps the books: it records every block-table
entry it adds (`take`) and every one it lets go (`drop`), so they stay exact without a
recount (`recount` only re-books the holders after a reload). Without shares in force only
`held` is kept (the per-block books serve the reserves); a reload that brings shares in
recounts them.
"""

from __future__ import annotations

import math
from typing import Iterable, Mapping, Sequence

from tokenlane.runtime.config import LaneBudgets
from tokenlane.runtime.core.request import Request


class LaneKVQuotas:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.cap: dict[str, int] = {}  # lane -> most blocks it may hold
        self.reserve: dict[str, int] = {}  # lane -> blocks kept for it
        self.held: dict[str, int] = {}  # lane -> block-table entries of its requests
        self.owned: dict[str, int] = {}  # lane -> blocks no other lane's request holds
        self.active = False  # some lane has a cap below the pool or a reserve
        # block id -> lane -> block-table entries of that lane holding it
        self._block_lanes: dict[int, dict[str, int]] = {}

    def configure(self, budgets: Mapping[str, LaneBudgets]) -> None:
        """Take the lanes' shares (hot reload); held counts of known lanes stay. The caller
        recounts after it (`LaneKVAllocator.configure`): that fills the per-block books when
        shares come into force."""
        total = self.num_blocks
        self.cap = {name: math.floor(b.max_kv_cache_share * total + 1e-9) for name, b in budgets.items()}
        self.reserve = {name: math.floor(b.kv_cache_reserved * total + 1e-9) for name, b in budgets.items()}
        self.held = {name: self.held.get(name, 0) for name in budgets}
        self.owned = {name: self.owned.get(name, 0) for name in budgets}
        self.active = any(c < total for c in self.cap.values()) or any(self.reserve.values())

    # ---- books

    def recount(self, holders: Iterable[Request]) -> None:
        """Rebuild the books from the requests holding blocks, under their current lanes."""
        self.held = dict.fromkeys(self.held, 0)
        self.owned = dict.fromkeys(self.held, 0)
        self._block_lanes = {}
        for request in holders:
            self.take(request.lane, request.block_ids)

    def take(self, lane: str, block_ids: Sequence[int]) -> None:
        """Block-table entries added to a request of `lane`."""
        held, owned, block_lanes = self.held, self.owned, self._block_lanes
        if not self.active:  # only `held` is read without shares (`configure` then recounts)
            held[lane] = held.get(lane, 0) + len(block_ids)
            return
        for block_id in block_ids:
            held[lane] = held.get(lane, 0) + 1
            lanes = block_lanes.get(block_id)
            if lanes is None:
                block_lanes[block_id] = {lane: 1}
                owned[lane] = owned.get(lane, 0) + 1
            elif lane in lanes:
                lanes[lane] += 1
            else:
                if len(lanes) == 1:  # it was the other lane's alone
                    (only,) = lanes
                    owned[only] -= 1
                lanes[lane] = 1

    def drop(self, lane: str, block_ids: Sequence[int]) -> None:
        """Block-table entries a request of `lane` let go of."""
        held, owned, block_lanes = self.held, self.owned, self._block_lanes
        if not self.active:
            held[lane] -= len(block_ids)
            return
        for block_id in block_ids:
            held[lane] -= 1
            lanes = block_lanes[block_id]
            left = lanes[lane] - 1
            if left:
                lanes[lane] = left
                continue
            del lanes[lane]
            if not lanes:
                del block_lanes[block_id]
                owned[lane] -= 1
            elif len(lanes) == 1:  # now the remaining lane's alone
                (only,) = lanes
                owned[only] = owned.get(only, 0) + 1

    def unmet_growth_of_sharing(self, lane: str, block_ids: Iterable[int]) -> int:
        """How much the other lanes' unmet reserves grow if `lane` takes prefix hits on these
        blocks: a block only another lane held stops counting for that lane's reserve."""
        taken: dict[str, int] = {}
        for block_id in block_ids:
            lanes = self._block_lanes.get(block_id)
            if lanes is not None and len(lanes) == 1 and lane not in lanes:
                (only,) = lanes
                taken[only] = taken.get(only, 0) + 1
        growth = 0
        for other, n in taken.items():
            reserve, owned = self.reserve.get(other, 0), self.owned.get(other, 0)
            growth += max(0, reserve - (owned - n)) - max(0, reserve - owned)
        return growth

    # ---- queries

    def unmet(self, lane: str) -> int:
        return max(0, self.reserve.get(lane, 0) - self.owned.get(lane, 0))

    def reserved_for_others(self, lane: str) -> int:
        """Free blocks `lane` must leave alone: the other lanes' unmet reserves."""
        return sum(self.unmet(other) for other in self.reserve if other != lane)

    def room(self, lane: str, num_free: int) -> int:
        """Blocks `lane` may allocate now (free blocks minus the others' reserves, within its cap)."""
        if not self.active:
            return num_free
        others = self.reserved_for_others(lane)
        cap = self.cap.get(lane, self.num_blocks)
        return max(0, min(num_free - others, cap - self.held.get(lane, 0)))

    def capacity(self, lane: str) -> int:
        """The most blocks `lane` can ever hold: its cap, less the other lanes' reserves."""
        others = sum(r for other, r in self.reserve.items() if other != lane)
        return max(0, min(self.cap.get(lane, self.num_blocks), self.num_blocks - others))

    def in_reserve(self, lane: str, num_blocks: int) -> bool:
        """Whether `num_blocks` more blocks stay inside the lane's reserve."""
        return self.held.get(lane, 0) + num_blocks <= self.reserve.get(lane, 0)

    def usage_of(self, lane: str, num_free: int) -> float:
        """The lane's KV usage for its watermarks: the share of its capacity it cannot take
        now (its own blocks, and blocks others hold out of its reach). 0 while the lane is
        inside its reserve. Without quotas, the pool's usage."""
        if not self.active:
            return 1.0 - num_free / self.num_blocks
        if self.held.get(lane, 0) < self.reserve.get(lane, 0):
            return 0.0
        capacity = self.capacity(lane)
        if capacity <= 0:
            return 1.0
        return min(1.0, max(0.0, 1.0 - self.room(lane, num_free) / capacity))

    # ---- checks

    def check_invariants(self, running: Iterable[Request], num_free: int) -> None:
        """Held and owned counts equal a recount; with shares in force, no lane above its cap
        and every unmet reserve free."""
        recount = LaneKVQuotas(self.num_blocks)
        recount.active = self.active
        recount.held = dict.fromkeys(self.held, 0)
        recount.recount(running)
        held = recount.held
        for lane in set(held) | set(self.held):
            assert held.get(lane, 0) == self.held.get(lane, 0), (lane, held.get(lane, 0), self.held.get(lane, 0))
        for lane in set(recount.owned) | set(self.owned):
            assert recount.owned.get(lane, 0) == self.owned.get(lane, 0), ("owned", lane)
        assert recount._block_lanes == self._block_lanes
        if not self.active:
            return
        for lane, n in held.items():  # (shared prefix blocks count per holder: only real caps bind)
            cap = self.cap.get(lane, self.num_blocks)
            assert cap >= self.num_blocks or n <= cap, f"lane {lane} holds {n} > cap {cap}"
        unmet = sum(self.unmet(lane) for lane in self.reserve)
        assert num_free >= unmet, f"{num_free} free blocks but {unmet} reserved"
