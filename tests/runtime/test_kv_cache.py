"""The KV block pool: allocation, ref counts, prefix caching, eviction, invariants."""

from __future__ import annotations

import pytest

from tokenlane.runtime.core.kv_cache import KVCacheManager, hash_block
from tokenlane.runtime.core.request import Request, SamplingParams


def req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=8))


def compute(kv: KVCacheManager, request: Request, n: int) -> None:
    """Allocate and 'compute' n more tokens (what scheduler + executor do)."""
    kv.allocate(request, n)
    request.num_computed_tokens += n
    kv.cache_computed_blocks(request)


def test_allocate_free_and_invariants():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = req("a", range(10))
    assert kv.num_blocks_to_allocate(a, 10) == 3
    assert kv.can_allocate(3)
    kv.allocate(a, 10)
    assert len(a.block_ids) == 3 and kv.num_used_blocks == 3 and kv.num_free_blocks == 5
    assert kv.usage == pytest.approx(3 / 8)
    assert kv.usage_after(2) == pytest.approx(5 / 8)
    kv.check_invariants([a])
    # Growing within the last block takes nothing; crossing a boundary takes one.
    a.num_computed_tokens = 10
    assert kv.num_blocks_to_allocate(a, 2) == 0
    assert kv.num_blocks_to_allocate(a, 3) == 1
    kv.free(a)
    assert a.block_ids == [] and kv.num_free_blocks == 8
    kv.check_invariants([a])
    kv.free(a)  # idempotent
    kv.check_invariants()


def test_cannot_allocate_beyond_pool():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    a = req("a", range(12))
    assert not kv.can_allocate(kv.num_blocks_to_allocate(a, 12))
    with pytest.raises(AssertionError):
        kv.allocate(a, 12)
    kv.check_invariants()


def test_prefix_cache_hit_shares_full_blocks_only():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    a = req("a", range(10))
    compute(kv, a, 10)  # blocks [0..3], [4..7] full and cached; [8, 9] partial
    b = req("b", list(range(8)) + [99, 98, 97])
    hits = kv.find_cached_prefix(b)
    assert hits == a.block_ids[:2]
    assert kv.num_blocks_to_allocate(b, 3, hits) == 1  # only the tail block is new
    kv.allocate(b, 3, hits)
    assert b.num_computed_tokens == 8 and b.num_cached_tokens == 8
    assert b.block_ids[:2] == a.block_ids[:2] and b.block_ids[2] != a.block_ids[2]
    assert kv.blocks[a.block_ids[0]].ref_count == 2
    kv.check_invariants([a, b])
    kv.free(a)
    kv.check_invariants([b])
    assert kv.blocks[b.block_ids[0]].ref_count == 1
    kv.free(b)
    kv.check_invariants()
    assert kv.num_free_blocks == 16


def test_last_token_is_never_served_from_cache():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    a = req("a", range(8))
    compute(kv, a, 8)
    kv.free(a)
    same = req("same", range(8))  # identical prompt: 2 full cached blocks
    hits = kv.find_cached_prefix(same)
    assert len(hits) == 1, "the block holding the last prompt token must be recomputed"


def test_chained_hash_depends_on_whole_prefix():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    a = req("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    compute(kv, a, 9)
    # Same second block, different first block: no hit at all.
    b = req("b", [0, 2, 3, 4, 5, 6, 7, 8, 9])
    assert kv.find_cached_prefix(b) == []
    assert hash_block(None, [1, 2]) != hash_block(hash_block(None, [0]), [1, 2])


def test_free_cached_blocks_are_reused_then_evicted_lru():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    a = req("a", [1, 2, 3, 4, 5])
    compute(kv, a, 5)  # 3 blocks: [1,2] [3,4] cached, [5] partial
    kv.free(a)
    assert kv.num_free_blocks == 4  # cached blocks count as free (evictable)
    # A hit revives a free cached block: it leaves the free list again.
    b = req("b", [1, 2, 3, 4, 7])
    hits = kv.find_cached_prefix(b)
    assert len(hits) == 2
    assert kv.num_blocks_to_allocate(b, 1, hits) == 3  # 2 revived + 1 new
    kv.allocate(b, 1, hits)
    kv.check_invariants([b])
    kv.free(b)
    # Unrelated allocation of all blocks evicts every cached prefix.
    c = req("c", range(100, 108))
    kv.allocate(c, 8)
    kv.check_invariants([c])
    assert kv.find_cached_prefix(req("d", [1, 2, 3, 4, 5])) == []


def test_uncached_blocks_are_evicted_before_cached_ones():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    a = req("a", [1, 2, 3])
    compute(kv, a, 3)  # block0 cached, block1 partial
    kv.free(a)
    b = req("b", [9, 9])
    kv.allocate(b, 2)  # must take a never-cached block, keeping [1, 2] findable
    assert len(kv.find_cached_prefix(req("c", [1, 2, 3]))) == 1
    kv.check_invariants([b])


def test_prefix_caching_disabled():
    kv = KVCacheManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    a = req("a", [1, 2, 3, 4, 5])
    compute(kv, a, 5)
    assert kv.find_cached_prefix(req("b", [1, 2, 3, 4, 5])) == []


def test_double_free_is_detected():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    a = req("a", [1, 2, 3])
    kv.allocate(a, 3)
    kv.blocks[a.block_ids[0]].ref_count = 0  # corrupt the books
    with pytest.raises(AssertionError):
        kv.check_invariants([a])


def test_cache_same_content_twice_keeps_one_entry():
    kv = KVCacheManager(num_blocks=8, block_size=2)
    a, b = req("a", [1, 2, 3]), req("b", [1, 2, 3])
    kv.allocate(a, 3)
    kv.allocate(b, 3)  # both computed in the same step: no hit possible yet
    for r in (a, b):
        r.num_computed_tokens = 3
        kv.cache_computed_blocks(r)
    kv.check_invariants([a, b])
    kv.free(a)
    kv.free(b)
    kv.check_invariants()
    assert len(kv.find_cached_prefix(req("c", [1, 2, 3]))) == 1


def test_zero_blocks_rejected():
    with pytest.raises(ValueError):
        KVCacheManager(num_blocks=0, block_size=4)
