"""The paged KV cache's bookkeeping: a pool of fixed-size blocks with ref counts and a prefix cache.

Pure Python (no torch): the executor owns the tensors; this module only decides which block
ids each request's block table holds. Blocks are shared between requests through the prefix
cache: every *full* block whose K/V has been computed gets a chained hash (hash of the
previous block's hash and this block's token ids; the first block's parent is seeded by the
request's LoRA adapter, so KV computed with one adapter is never reused by another), so a later request whose prompt starts
with the same tokens reuses those blocks instead of recomputing them.

A free block may still hold a cached prefix: it stays findable until the allocator hands it
out again (least recently freed first), so "free" means "evictable", and

    num_free_blocks + num_used_blocks == num_blocks

holds at all times (`check_invariants()` verifies it and the ref counts).

With a host tier (`engine.kvOffload`, kv_host_tier.py) a cached block evicted for reuse is
copied to host memory first, and a prefix lookup that misses on the device continues there:
its hits are copied back into fresh device blocks and count as cached like device hits. The
copies of the step being planned collect here; the scheduler moves them into the plan
(`take_transfers`), which the executor performs before the forward pass, offloads first.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from typing import Iterable, Optional, Sequence

from tokenlane.runtime.core.kv_host_tier import HostKVTier
from tokenlane.runtime.core.request import Request

BlockHash = bytes  # sha256 digest: collision-resistant, so one tenant can't forge another's prefix


def hash_block(parent: Optional[BlockHash], token_ids: Sequence[int]) -> BlockHash:
    """Chained hash of one full block: depends on every token before it, not just its own."""
    h = hashlib.sha256(parent or b"")
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def adapter_seed(adapter: Optional[str]) -> Optional[BlockHash]:
    """The parent hash of a request's first block: None for the base model, a digest of the
    adapter's name otherwise, so blocks computed with different adapters never match."""
    if adapter is None:
        return None
    return hashlib.sha256(b"tokenlane-lora-adapter\0" + adapter.encode()).digest()


class Block:
    __slots__ = ("block_id", "ref_count", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: Optional[BlockHash] = None  # set once the block is full and computed


class KVCacheManager:
    """Block pool + per-request block tables + prefix cache. Check/act pairs:
    `num_blocks_to_allocate` / `can_allocate` before `allocate`; `find_cached_prefix` before
    `allocate(..., cached_blocks=...)`."""

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, num_host_blocks: int = 0
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free (ref 0) block ids in eviction order: first = evicted first. Blocks without a
        # cached prefix go to the front, cached ones to the back (LRU).
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[BlockHash, int] = {}  # block hash -> block id holding that prefix
        # request_id -> its block table (the same list object as request.block_ids).
        self._tables: dict[str, list[int]] = {}
        # request_id -> chained hashes of the request's full blocks (memo: each hashed once).
        self._hashes: dict[str, list[BlockHash]] = {}
        # request_id -> how many of its leading blocks are registered in the prefix cache.
        self._registered: dict[str, int] = {}
        # Counters for metrics (tokens).
        self.prefix_queries = 0
        self.prefix_hits = 0
        # Free blocks still holding a cached prefix (kept as blocks move, not by a scan: the
        # flight recorder reads it every step).
        self._num_cached_free = 0
        # The host tier (none without prefix caching: it only keeps prefix-cache blocks).
        self.host: Optional[HostKVTier] = (
            HostKVTier(num_host_blocks) if num_host_blocks > 0 and enable_prefix_caching else None
        )
        self.host_prefix_hits = 0  # tokens of prefix_hits restored from the host tier
        # Copies of the step being planned: (device block, host slot) and (host slot, device block).
        self._offloads: list[tuple[int, int]] = []
        self._restores: list[tuple[int, int]] = []

    # ------------------------------------------------------------------ queries

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_free_blocks(self) -> int:
        """Free blocks that still hold a cached prefix (a prefix hit can revive them; the
        allocator evicts them last)."""
        return self._num_cached_free

    @property
    def usage(self) -> float:
        """Share of blocks held by requests (0..1); cached-but-free blocks count as free."""
        return self.num_used_blocks / self.num_blocks

    def usage_after(self, num_new_blocks: int) -> float:
        return (self.num_used_blocks + num_new_blocks) / self.num_blocks

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_blocks_to_allocate(
        self, request: Request, num_new_tokens: int, cached_blocks: Sequence[int] = (), num_restored: int = 0
    ) -> int:
        """Free blocks `allocate(request, num_new_tokens, cached_blocks, restore_slots)` would
        take (`num_restored` = len(restore_slots): each takes a fresh block)."""
        have = len(request.block_ids) + len(cached_blocks)
        hit_tokens = (len(cached_blocks) + num_restored) * self.block_size
        need = self.blocks_for_tokens(request.num_computed_tokens + hit_tokens + num_new_tokens)
        # A cached hit that is currently free leaves the free list too.
        revived = sum(1 for b in cached_blocks if self.blocks[b].ref_count == 0)
        return max(0, need - have) + revived

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def find_cached_prefix(self, request: Request, max_tokens: Optional[int] = None) -> list[int]:
        """Block ids holding the longest cached prefix of the request's tokens (not yet taken).

        Only for a request holding no blocks. The last known token is never served from the
        cache: it must be computed so the model produces logits for the next token.
        `max_tokens` caps the prefix (a request that needs the logits of earlier positions,
        for prompt logprobs, must compute them)."""
        if not self.enable_prefix_caching or request.block_ids:
            return []
        num_blocks = (request.num_tokens - 1) // self.block_size
        if max_tokens is not None:
            num_blocks = min(num_blocks, max_tokens // self.block_size)
        if num_blocks <= 0:
            return []
        hashes = self._request_hashes(request, num_blocks)
        hits: list[int] = []
        for block_hash in hashes:
            block_id = self._cached.get(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def find_host_prefix(self, request: Request, num_device_hits: int, max_tokens: Optional[int] = None) -> list[int]:
        """Host slots holding the blocks that continue the device hits (`find_cached_prefix`)
        of the request's prefix, under the same limits; empty without a host tier."""
        host = self.host
        if host is None or request.block_ids:
            return []
        num_blocks = (request.num_tokens - 1) // self.block_size
        if max_tokens is not None:
            num_blocks = min(num_blocks, max_tokens // self.block_size)
        if num_blocks <= num_device_hits:
            return []
        hashes = self._request_hashes(request, num_blocks)
        slots: list[int] = []
        for block_hash in hashes[num_device_hits:]:
            slot = host.lookup(block_hash)
            if slot is None:
                break
            slots.append(slot)
        return slots

    # ------------------------------------------------------------------ actions

    def allocate(
        self,
        request: Request,
        num_new_tokens: int,
        cached_blocks: Sequence[int] = (),
        restore_slots: Sequence[int] = (),
    ) -> None:
        """Grow the request's block table to cover `num_new_tokens` more tokens.

        `cached_blocks` (from `find_cached_prefix`, first schedule only) are shared;
        `restore_slots` (from `find_host_prefix`, right after them) are copied into fresh
        blocks; the request's num_computed_tokens / num_cached_tokens advance past both."""
        assert self.can_allocate(
            self.num_blocks_to_allocate(request, num_new_tokens, cached_blocks, len(restore_slots))
        )
        table = request.block_ids
        self._tables[request.request_id] = table
        if cached_blocks or restore_slots:
            assert not table and request.num_computed_tokens == 0, "prefix hits only on first schedule"
            for block_id in cached_blocks:
                block = self.blocks[block_id]
                if block.ref_count == 0:
                    del self._free[block_id]
                    self._num_cached_free -= 1  # a prefix hit always carries its hash
                block.ref_count += 1
                table.append(block_id)
            if restore_slots:
                self._restore(request, len(cached_blocks), restore_slots)
            num_hits = len(cached_blocks) + len(restore_slots)
            self._registered[request.request_id] = num_hits
            num_cached = num_hits * self.block_size
            request.num_computed_tokens = num_cached
            request.num_cached_tokens = max(request.num_cached_tokens, num_cached)
        need = self.blocks_for_tokens(request.num_computed_tokens + num_new_tokens)
        for _ in range(need - len(table)):
            table.append(self._take_free_block())

    def append_block(self, request: Request) -> None:
        """One more block for a running request (a decode crossing a block boundary); the
        caller checked `can_allocate(1)`."""
        request.block_ids.append(self._take_free_block())

    def record_prefix_query(
        self, request: Request, cached_blocks: Sequence[int], restore_slots: Sequence[int] = ()
    ) -> None:
        if self.enable_prefix_caching:
            self.prefix_queries += request.num_prompt_tokens
            self.prefix_hits += (len(cached_blocks) + len(restore_slots)) * self.block_size
            self.host_prefix_hits += len(restore_slots) * self.block_size

    # ------------------------------------------------------------------ host tier

    def _restore(self, request: Request, first: int, slots: Sequence[int]) -> None:
        """Fresh blocks for the host hits at table positions `first`..., registered in the
        prefix cache at once (the copies run before any forward pass reads them)."""
        host = self.host
        assert host is not None
        hashes = self._request_hashes(request, first + len(slots))[first:]
        for block_hash, slot in zip(hashes, slots):
            # Pinned before any block is taken: an eviction below must not drop them.
            assert host.take_for_restore(block_hash) == slot, "host hit moved before its restore"
        table = request.block_ids
        for block_hash, slot in zip(hashes, slots):
            block_id = self._take_free_block()
            self.blocks[block_id].block_hash = block_hash
            self._cached.setdefault(block_hash, block_id)
            table.append(block_id)
            self._restores.append((slot, block_id))

    def begin_step(self) -> None:
        """A new plan starts: the previous plan's copies ran."""
        if self.host is not None:
            self.host.end_step()

    def take_transfers(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The planned step's (offloads, restores), handed to its plan."""
        out = (self._offloads, self._restores)
        self._offloads, self._restores = [], []
        return out

    def forget_failed_transfers(self, offloads: Sequence[tuple[int, int]], restores: Sequence[tuple[int, int]]) -> None:
        """A step failed: its offload copies may be incomplete (the host slots are dropped),
        and so may its restores (the device blocks stop serving as prefix hits)."""
        if self.host is not None:
            self.host.discard(slot for _, slot in offloads)
        for _, block_id in restores:
            block = self.blocks[block_id]
            if block.block_hash is None:
                continue
            if self._cached.get(block.block_hash) == block_id:
                del self._cached[block.block_hash]
            block.block_hash = None
            if block.ref_count == 0:
                self._num_cached_free -= 1
                self._free.move_to_end(block_id, last=False)

    def cache_computed_blocks(self, request: Request) -> None:
        """Register the request's blocks that became full and computed (each block once)."""
        if not self.enable_prefix_caching:
            return
        num_full = request.num_computed_tokens // self.block_size
        done = self._registered.get(request.request_id, 0)
        if num_full <= done:
            return
        hashes = self._request_hashes(request, num_full)
        table = request.block_ids
        self._registered[request.request_id] = num_full
        for i in range(done, num_full):
            block = self.blocks[table[i]]
            if block.block_hash is None:
                block.block_hash = hashes[i]
                # First writer wins; an identical block computed twice stays unregistered.
                self._cached.setdefault(hashes[i], block.block_id)

    def free(self, request: Request) -> None:
        """Release the request's blocks (finished, cancelled or preempted). Idempotent."""
        table = self._tables.pop(request.request_id, None)
        self._hashes.pop(request.request_id, None)
        self._registered.pop(request.request_id, None)
        if table is None:
            assert not request.block_ids, "blocks not allocated through this manager"
            return
        # Reverse order: a chain's tail is evicted before its head, keeping prefixes useful.
        for block_id in reversed(table):
            block = self.blocks[block_id]
            assert block.ref_count > 0, f"double free of block {block_id}"
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
                if block.block_hash is None:
                    self._free.move_to_end(block_id, last=False)
                else:
                    self._num_cached_free += 1
        table.clear()

    # ------------------------------------------------------------------ parallel sampling

    def fork(self, parent: Request, child: Request, num_tokens: int) -> None:
        """Share the parent's blocks covering its first `num_tokens` computed tokens with a
        child holding none (ref counts +1): the child continues from there. The last of them
        may be partly filled; whoever writes into it while shared copies it first
        (`is_shared` / `copy_on_write`)."""
        assert not child.block_ids and child.num_computed_tokens == 0, "fork into a fresh sequence only"
        assert parent.num_computed_tokens >= num_tokens, "fork past the parent's computed tokens"
        table = child.block_ids
        for block_id in parent.block_ids[: self.blocks_for_tokens(num_tokens)]:
            self.blocks[block_id].ref_count += 1
            table.append(block_id)
        self._tables[child.request_id] = table
        # Its full blocks were registered by the parent (each block is registered once).
        self._registered[child.request_id] = num_tokens // self.block_size
        child.num_computed_tokens = num_tokens

    def is_shared(self, block_id: int) -> bool:
        """Whether another block table holds this block too (writing it needs a copy)."""
        return self.blocks[block_id].ref_count > 1

    def copy_on_write(self, request: Request, index: int) -> tuple[int, int]:
        """Give the request its own copy of the shared block at `index` of its table; returns
        (src, dst) for the executor to copy before the step. The caller checked
        `can_allocate(1)`."""
        table = request.block_ids
        src = table[index]
        assert self.is_shared(src), f"block {src} is not shared"
        dst = self._take_free_block()
        self.blocks[src].ref_count -= 1  # still held by the others: never freed here
        table[index] = dst
        return src, dst

    # ------------------------------------------------------------------ internals

    def _take_free_block(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:  # evict its cached prefix
            self._num_cached_free -= 1
            if self._cached.get(block.block_hash) == block_id:
                del self._cached[block.block_hash]
                if self.host is not None:  # to the host tier (copied before the block is reused)
                    slot = self.host.store(block.block_hash)
                    if slot is not None:
                        self._offloads.append((block_id, slot))
            block.block_hash = None
        block.ref_count = 1
        return block_id

    def _request_hashes(self, request: Request, num_full_blocks: int) -> list[BlockHash]:
        """The request's chained block hashes up to `num_full_blocks`, computed once each."""
        hashes = self._hashes.setdefault(request.request_id, [])
        if len(hashes) < num_full_blocks:
            prompt, output = request.prompt_token_ids, request.output_token_ids
            n_prompt = len(prompt)
            bs = self.block_size
            parent = hashes[-1] if hashes else adapter_seed(request.adapter)
            for i in range(len(hashes), num_full_blocks):
                lo, hi = i * bs, (i + 1) * bs
                if hi <= n_prompt:
                    tokens = prompt[lo:hi]
                elif lo >= n_prompt:
                    tokens = output[lo - n_prompt : hi - n_prompt]
                else:  # the block straddles the end of the prompt
                    tokens = prompt[lo:] + output[: hi - n_prompt]
                parent = hash_block(parent, tokens)
                hashes.append(parent)
        return hashes[:num_full_blocks] if len(hashes) > num_full_blocks else hashes

    # ------------------------------------------------------------------ checks

    def check_invariants(self, live_requests: Optional[Iterable[Request]] = None) -> None:
        """Raise AssertionError if the pool's books don't balance.

        free + used == total; the free list holds exactly the ref-0 blocks; each block's ref
        count equals the number of block tables holding it (no leak, no double free); every
        cached hash points at a block carrying that hash. With `live_requests`, their tables
        must be exactly the tables this manager knows."""
        refs = [0] * self.num_blocks
        for table in self._tables.values():
            for block_id in table:
                refs[block_id] += 1
            assert len(set(table)) == len(table), f"block repeated in one table: {table}"
        used = 0
        for block in self.blocks:
            assert block.ref_count == refs[block.block_id], (
                f"block {block.block_id}: ref_count {block.ref_count} but held by "
                f"{refs[block.block_id]} table(s)"
            )
            in_free = block.block_id in self._free
            assert in_free == (block.ref_count == 0), f"block {block.block_id} free-list mismatch"
            used += block.ref_count > 0
        assert len(self._free) + used == self.num_blocks, "free + used != total"
        cached_free = sum(1 for block_id in self._free if self.blocks[block_id].block_hash is not None)
        assert cached_free == self._num_cached_free, (
            f"cached-free count {self._num_cached_free} but {cached_free} free blocks hold a prefix"
        )
        for block_hash, block_id in self._cached.items():
            assert self.blocks[block_id].block_hash == block_hash, f"stale cache entry {block_id}"
        if self.host is not None:
            self.host.check_invariants()
            restored = [block_id for _, block_id in self._restores]
            assert len(set(restored)) == len(restored), "two restores into one device block"
            for _, block_id in self._restores:  # (pending only while a step is planned)
                assert self.blocks[block_id].block_hash is not None, (
                    f"restore target {block_id} was reused in the step it is restored"
                )
        if live_requests is not None:
            live = {r.request_id: r for r in live_requests if r.block_ids}
            assert set(live) == set(self._tables), (
                f"tables of {sorted(set(self._tables) ^ set(live))} out of sync"
            )
            for rid, request in live.items():
                assert self._tables[rid] is request.block_ids
