"""The prefix cache's host-memory tier (`engine.kvOffload`): which host slot holds which block.

Pure Python, like kv_cache.py: the executor owns the host pool's memory (a second KV pool with
the device pool's layout and dtype, pinned on CUDA); this module only keeps the index

    block hash -> host slot, least recently used first

When the device pool evicts a full, cached block for reuse, the KV cache manager stores its
hash here and the step's plan copies the block out (`StepPlan.kv_offloads`); a prefix lookup
that misses on the device continues here, and a hit is copied back into a fresh device block
(`StepPlan.kv_restores`) instead of being recomputed. A restore copies: the host keeps its
copy, so a prefix evicted again later needs no second offload.

Within one step the executor performs every offload before any restore, so:
- a slot read by a restore of the step being planned is *pinned*: no offload of the same step
  may overwrite it (it is not evicted, even when least recently used);
- a slot written by an offload of the step being planned is *filling*: a lookup does not see
  it until the step ran (its copy may fail; see `discard`).
`end_step` (at the next plan) clears both marks.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, Optional

BlockHash = bytes


class HostKVTier:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"the host KV tier needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self._by_hash: OrderedDict[BlockHash, int] = OrderedDict()  # LRU: first = evicted first
        self._hash_of: dict[int, BlockHash] = {}
        self._free_slots: list[int] = list(range(num_slots - 1, -1, -1))  # pop() gives slot 0 first
        self._pinned: set[int] = set()
        self._filling: set[int] = set()
        # Counters (blocks) for metrics.
        self.num_offloaded = 0
        self.num_restored = 0
        self.num_dropped = 0  # evicted from the host tier to make room

    # ------------------------------------------------------------------ queries

    @property
    def num_used_slots(self) -> int:
        return len(self._hash_of)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._by_hash

    def lookup(self, block_hash: BlockHash) -> Optional[int]:
        """The slot holding this block, if its copy is complete (not filling this step)."""
        slot = self._by_hash.get(block_hash)
        if slot is None or slot in self._filling:
            return None
        return slot

    # ------------------------------------------------------------------ actions

    def store(self, block_hash: BlockHash) -> Optional[int]:
        """A slot for a block being offloaded (the caller records the copy): the block's
        current slot is refreshed instead if it is already here (returns None: no copy
        needed); the least recently used unpinned slot is dropped when the tier is full.
        None as well when every slot is pinned (the block is simply not kept)."""
        if block_hash in self._by_hash:
            self._by_hash.move_to_end(block_hash)
            return None
        if self._free_slots:
            slot = self._free_slots.pop()
        else:
            victim = next((h for h, s in self._by_hash.items() if s not in self._pinned), None)
            if victim is None:
                return None
            slot = self._by_hash.pop(victim)
            del self._hash_of[slot]
            self.num_dropped += 1
        self._by_hash[block_hash] = slot
        self._hash_of[slot] = block_hash
        self._filling.add(slot)
        self.num_offloaded += 1
        return slot

    def take_for_restore(self, block_hash: BlockHash) -> int:
        """Mark a hit's slot as read by this step (pinned, most recently used); the caller
        checked `lookup`."""
        slot = self._by_hash[block_hash]
        assert slot not in self._filling, f"host slot {slot} restored while its offload is pending"
        self._by_hash.move_to_end(block_hash)
        self._pinned.add(slot)
        self.num_restored += 1
        return slot

    def discard(self, slots: Iterable[int]) -> None:
        """Forget these slots' blocks (their copies of a failed step may be incomplete)."""
        for slot in slots:
            block_hash = self._hash_of.pop(slot, None)
            if block_hash is not None:
                del self._by_hash[block_hash]
                self._free_slots.append(slot)
            self._filling.discard(slot)
            self._pinned.discard(slot)

    def end_step(self) -> None:
        """The planned step ran: its offloads are complete and its restores read."""
        self._pinned.clear()
        self._filling.clear()

    # ------------------------------------------------------------------ checks

    def check_invariants(self) -> None:
        assert len(self._by_hash) == len(self._hash_of), "host tier index out of sync"
        for block_hash, slot in self._by_hash.items():
            assert self._hash_of.get(slot) == block_hash, f"host slot {slot} maps to another block"
        free = set(self._free_slots)
        assert len(free) == len(self._free_slots), "a host slot is free twice"
        assert not free & set(self._hash_of), "a host slot is both free and used"
        assert len(free) + len(self._hash_of) == self.num_slots, "host slots leaked"
        assert self._pinned <= set(self._hash_of), "a pinned host slot holds no block"
        assert not self._pinned & self._filling, "a host slot is read and written in one step"
