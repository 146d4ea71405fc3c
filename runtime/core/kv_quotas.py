"""Per-lane shares of the KV cache: a cap on what a lane holds, a reserve other lanes never take.

A lane's `maxKvCacheShare` caps the blocks its requests hold; its `kvCacheReserved` is a
share of the pool that the other lanes may not allocate into while the lane holds less than
it. Both are counted in block-table entries (a prefix block shared by two requests counts for
each holder: never under-counted). With `T` blocks in the pool, for every lane `L`:

    cap(L)     = floor(maxKvCacheShare(L) x T)
    reserve(L) = floor(kvCacheReserved(L) x T)
    unmet(L)   = max(0, reserve(L) - held(L))
    room(L)    = min(free - sum of unmet(M) over the other lanes M, cap(L) - held(L))

and a lane only allocates within its room, so `free >= sum of unmet` holds at every step
(the reserves are free whenever their lanes may want them). The high watermark is applied to
each lane against its own capacity (`usage_of`), and a lane still inside its reserve ignores
it: that is what lets the interactive lane keep starting prefills while the long-context lane
sits above the watermark (docs/tuning.md, "Lane isolation").

Pure Python; the scheduler owns one and tells it every allocation (`charge`) and release
(`release`); `recount` rebuilds the books from the running set once per step.
"""

from __future__ import annotations

import math
from typing import Iterable, Mapping

from tokenlane.runtime.config import LaneBudgets
from tokenlane.runtime.core.request import Request


class LaneKVQuotas:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.cap: dict[str, int] = {}  # lane -> most blocks it may hold
        self.reserve: dict[str, int] = {}  # lane -> blocks kept for it
        self.held: dict[str, int] = {}  # lane -> block-table entries of its requests
        self.active = False  # some lane has a cap below the pool or a reserve

    def configure(self, budgets: Mapping[str, LaneBudgets]) -> None:
        """Take the lanes' shares (hot reload); held counts of known lanes stay."""
        total = self.num_blocks
        self.cap = {name: math.floor(b.max_kv_cache_share * total + 1e-9) for name, b in budgets.items()}
        self.reserve = {name: math.floor(b.kv_cache_reserved * total + 1e-9) for name, b in budgets.items()}
        self.held = {name: self.held.get(name, 0) for name in budgets}
        self.active = any(c < total for c in self.cap.values()) or any(self.reserve.values())

    # ---- books

    def recount(self, running: Iterable[Request]) -> None:
        held = dict.fromkeys(self.held, 0)
        for request in running:
            held[request.lane] = held.get(request.lane, 0) + len(request.block_ids)
        self.held = held

    def charge(self, lane: str, num_blocks: int) -> None:
        self.held[lane] = self.held.get(lane, 0) + num_blocks

    def release(self, lane: str, num_blocks: int) -> None:
        self.held[lane] = self.held.get(lane, 0) - num_blocks

    # ---- queries

    def unmet(self, lane: str) -> int:
        return max(0, self.reserve.get(lane, 0) - self.held.get(lane, 0))

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
        """With shares in force: held counts equal a recount, no lane above its cap, every
        unmet reserve free."""
        if not self.active:
            return
        held: dict[str, int] = {}
        for request in running:
            held[request.lane] = held.get(request.lane, 0) + len(request.block_ids)
        for lane in set(held) | set(self.held):
            assert held.get(lane, 0) == self.held.get(lane, 0), (lane, held.get(lane, 0), self.held.get(lane, 0))
        for lane, n in held.items():  # (shared prefix blocks count per holder: only real caps bind)
            cap = self.cap.get(lane, self.num_blocks)
            assert cap >= self.num_blocks or n <= cap, f"lane {lane} holds {n} > cap {cap}"
        unmet = sum(self.unmet(lane) for lane in self.reserve)
        assert num_free >= unmet, f"{num_free} free blocks but {unmet} reserved"
