"""Block pool and block hashing: ids, reference counts, LRU order, prefix-cache index, events."""

from __future__ import annotations

import hashlib
import struct

import pytest

from engine.kv_cache.block_pool import BlockEvents, BlockPool
from engine.kv_cache.hashing import ROOT_HASH, hash_block, hash_full_blocks


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def free_queue_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_queue]


# ------------------------------------------------------------------ hashing
def test_root_hash_is_sha256_of_the_versioned_tag():
    assert ROOT_HASH == hashlib.sha256(b"pdserve:kv-block:v1").digest()
    assert ROOT_HASH.hex() == "38f630f692ff639119060c6060bfcdfa9a438f87386972678083c54493bba143"


def test_block_hash_of_fixed_tokens_is_pinned_so_a_change_of_the_function_is_caught():
    # Prefill workers, decode workers and routers must agree on this value forever
    # (or bump the "v1" tag); these digests were computed once and pinned.
    assert hash_block(ROOT_HASH, [1, 2, 3, 4]).hex() == (
        "f01b1f9ee61c30849c0611b36ca295582b5293e317516e8692fc8dc8d00a09ce"
    )
    assert [h.hex() for h in hash_full_blocks([1, 2, 3, 4, 5, 6, 7, 8], 4)] == [
        "f01b1f9ee61c30849c0611b36ca295582b5293e317516e8692fc8dc8d00a09ce",
        "30f7c35f4a939107bcd069669ae2da1359520dfe409bcdfb55f8508370db62f1",
    ]


def test_block_hash_is_sha256_of_parent_and_little_endian_int64_tokens():
    expected = hashlib.sha256(ROOT_HASH + struct.pack("<3q", 7, -1, 2**40)).digest()
    assert hash_block(ROOT_HASH, [7, -1, 2**40]) == expected
    assert len(expected) == 32


def test_same_tokens_give_the_same_hash_across_calls_and_sequence_types():
    first = hash_full_blocks([5, 6, 7, 8, 9, 10, 11, 12], 4)
    second = hash_full_blocks((5, 6, 7, 8, 9, 10, 11, 12), 4)
    assert first == second
    assert hash_block(ROOT_HASH, [5, 6, 7, 8]) == hash_block(ROOT_HASH, (5, 6, 7, 8))


def test_hash_is_chained_so_the_same_block_under_different_parents_differs():
    a = hash_full_blocks([1, 2, 3, 4, 9, 9, 9, 9], 4)
    b = hash_full_blocks([5, 6, 7, 8, 9, 9, 9, 9], 4)
    assert a[0] != b[0]
    assert a[1] != b[1]  # identical second-block tokens, different prefixes
    assert a[1] == hash_block(a[0], [9, 9, 9, 9])


def test_hash_depends_on_token_order_within_a_block():
    assert hash_block(ROOT_HASH, [1, 2, 3, 4]) != hash_block(ROOT_HASH, [4, 3, 2, 1])


def test_hash_full_blocks_ignores_a_trailing_partial_block():
    full = hash_full_blocks([1, 2, 3, 4, 5, 6, 7, 8], 4)
    assert hash_full_blocks([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], 4) == full
    assert len(hash_full_blocks([1, 2, 3], 4)) == 0
    assert hash_full_blocks([], 4) == []


def test_hash_full_blocks_continues_from_a_given_parent():
    whole = hash_full_blocks([1, 2, 3, 4, 5, 6, 7, 8], 4)
    tail = hash_full_blocks([5, 6, 7, 8], 4, parent=whole[0])
    assert tail == [whole[1]]


# ------------------------------------------------------------- allocation
def test_fresh_pool_hands_out_block_ids_in_ascending_order():
    pool = BlockPool(5)
    assert ids(pool.get_new_blocks(2)) == [0, 1]
    assert ids(pool.get_new_blocks(3)) == [2, 3, 4]
    assert pool.num_free_blocks == 0
    assert pool.usage == 1.0


def test_new_blocks_have_one_reference_and_leave_the_free_queue():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(2)
    assert [b.ref_cnt for b in blocks] == [1, 1]
    assert free_queue_ids(pool) == [2, 3]
    assert pool.num_free_blocks == 2
    assert pool.usage == 0.5


def test_get_new_blocks_returns_none_and_takes_nothing_when_short():
    pool = BlockPool(4)
    pool.get_new_blocks(3)
    assert pool.get_new_blocks(2) is None
    assert pool.num_free_blocks == 1
    assert free_queue_ids(pool) == [3]
    assert [b.ref_cnt for b in pool.blocks] == [1, 1, 1, 0]


def test_get_new_blocks_of_zero_returns_an_empty_list():
    pool = BlockPool(2)
    assert pool.get_new_blocks(0) == []
    assert pool.num_free_blocks == 2


def test_pool_rejects_a_non_positive_block_count():
    with pytest.raises(ValueError, match="num_blocks must be positive, got 0"):
        BlockPool(0)


def test_freed_blocks_go_to_the_tail_of_the_free_queue():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    pool.free([a])
    assert free_queue_ids(pool) == [2, 3, 0]
    pool.free([b])
    assert free_queue_ids(pool) == [2, 3, 0, 1]
    assert [ids(pool.get_new_blocks(1)) for _ in range(4)] == [[2], [3], [0], [1]]


def test_blocks_freed_last_first_are_reallocated_tail_of_prefix_first():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(3)  # one request's table: 0, 1, 2
    pool.free(reversed(blocks))
    assert free_queue_ids(pool) == [3, 2, 1, 0]
    assert ids(pool.get_new_blocks(2)) == [2, 3]  # the queue's first two (3, 2), by id
    assert free_queue_ids(pool) == [1, 0]


def test_blocks_taken_together_come_by_id_and_evict_in_queue_order():
    """Which blocks a call takes is the free queue's (LRU) choice; the table gets them by id, so
    a reused request's blocks run forwards through memory (the decode kernel's fastest order)."""
    pool = BlockPool(6)
    first = pool.get_new_blocks(6)
    assert ids(first) == [0, 1, 2, 3, 4, 5]
    pool.free(reversed(first[:4]))  # a finished request frees 3, 2, 1, 0
    assert free_queue_ids(pool) == [3, 2, 1, 0]
    assert ids(pool.get_new_blocks(3)) == [1, 2, 3]
    assert free_queue_ids(pool) == [0]


def test_a_shared_block_returns_to_the_queue_only_when_its_last_reference_drops():
    pool = BlockPool(3)
    (block,) = pool.get_new_blocks(1)
    pool.touch([block])
    assert block.ref_cnt == 2
    pool.free([block])
    assert block.ref_cnt == 1
    assert free_queue_ids(pool) == [1, 2]
    pool.free([block])
    assert block.ref_cnt == 0
    assert free_queue_ids(pool) == [1, 2, 0]


def test_double_free_asserts():
    pool = BlockPool(2)
    (block,) = pool.get_new_blocks(1)
    pool.free([block])
    with pytest.raises(AssertionError, match=r"double free of Block\(id=0, ref=0, cached=False\)"):
        pool.free([block])
    assert free_queue_ids(pool) == [1, 0]


# ------------------------------------------------------------ prefix cache
def test_cached_block_stays_findable_after_free_until_reused():
    pool = BlockPool(3)
    h = hash_block(ROOT_HASH, [1, 2, 3, 4])
    (block,) = pool.get_new_blocks(1)
    pool.cache(block, h)
    pool.free([block])
    assert pool.lookup(h) is block
    assert pool.num_cached_blocks == 1
    assert free_queue_ids(pool) == [1, 2, 0]
    # Two allocations that do not reach block 0 leave it findable.
    assert ids(pool.get_new_blocks(2)) == [1, 2]
    assert pool.lookup(h) is block
    # The next one reuses block 0 and evicts its hash.
    assert ids(pool.get_new_blocks(1)) == [0]
    assert pool.lookup(h) is None
    assert block.block_hash is None
    assert pool.num_cached_blocks == 0


def test_events_record_stored_then_evicted_hashes_once_each():
    pool = BlockPool(2)
    h0 = hash_block(ROOT_HASH, [1, 2, 3, 4])
    h1 = hash_block(h0, [5, 6, 7, 8])
    b0, b1 = pool.get_new_blocks(2)
    pool.cache(b0, h0)
    pool.cache(b1, h1)
    assert pool.take_events() == BlockEvents(stored=(h0, h1), evicted=())
    assert pool.take_events() == BlockEvents(stored=(), evicted=())
    pool.free([b1, b0])  # last-first: b1 is evicted first
    assert ids(pool.get_new_blocks(1)) == [1]
    assert pool.take_events() == BlockEvents(stored=(), evicted=(h1,))
    assert pool.lookup(h0) is b0


def test_touch_on_a_cached_free_block_takes_it_off_the_free_queue():
    pool = BlockPool(3)
    h = hash_block(ROOT_HASH, [1, 2, 3, 4])
    (block,) = pool.get_new_blocks(1)
    pool.cache(block, h)
    pool.free([block])
    assert pool.num_free_blocks == 3
    pool.touch([pool.lookup(h)])
    assert block.ref_cnt == 1
    assert free_queue_ids(pool) == [1, 2]
    assert pool.num_free_blocks == 2
    # In use, it cannot be evicted: allocating everything else leaves it cached.
    assert ids(pool.get_new_blocks(2)) == [1, 2]
    assert pool.get_new_blocks(1) is None
    assert pool.lookup(h) is block


def test_cache_first_writer_wins_and_a_duplicate_block_stays_private():
    pool = BlockPool(3)
    h = hash_block(ROOT_HASH, [1, 2, 3, 4])
    a, b = pool.get_new_blocks(2)
    pool.cache(a, h)
    pool.cache(b, h)
    assert pool.lookup(h) is a
    assert b.block_hash is None
    assert pool.take_events() == BlockEvents(stored=(h,), evicted=())
    # Reusing the private duplicate evicts nothing.
    pool.free([b])
    assert ids(pool.get_new_blocks(2)) == [1, 2]  # queue order 2, 1; by id
    assert pool.take_events() == BlockEvents(stored=(), evicted=())
    assert pool.lookup(h) is a


def test_cache_does_not_rehash_an_already_cached_block():
    pool = BlockPool(2)
    h0 = hash_block(ROOT_HASH, [1, 2, 3, 4])
    h1 = hash_block(ROOT_HASH, [9, 9, 9, 9])
    (block,) = pool.get_new_blocks(1)
    pool.cache(block, h0)
    pool.cache(block, h1)
    assert block.block_hash == h0
    assert pool.lookup(h1) is None


def test_pool_without_caching_never_finds_or_stores_hashes():
    pool = BlockPool(2, enable_caching=False)
    h = hash_block(ROOT_HASH, [1, 2, 3, 4])
    (block,) = pool.get_new_blocks(1)
    pool.cache(block, h)
    assert block.block_hash is None
    assert pool.lookup(h) is None
    assert pool.take_events() == BlockEvents(stored=(), evicted=())


def test_reset_prefix_cache_is_refused_while_a_block_is_in_use_then_forgets_every_hash():
    pool = BlockPool(2)
    h = hash_block(ROOT_HASH, [1, 2, 3, 4])
    a, b = pool.get_new_blocks(2)
    pool.cache(a, h)
    pool.take_events()
    pool.free([a])
    assert pool.reset_prefix_cache() is False
    assert pool.lookup(h) is a
    pool.free([b])
    assert pool.reset_prefix_cache() is True
    assert pool.lookup(h) is None
    assert pool.num_cached_blocks == 0
    assert pool.take_events() == BlockEvents(stored=(), evicted=(h,))
    assert pool.num_free_blocks == 2


def test_pending_events_that_nobody_takes_stay_bounded(monkeypatch):
    monkeypatch.setattr(BlockPool, "MAX_PENDING_EVENTS", 3)
    pool = BlockPool(8)
    hashes = []
    parent = ROOT_HASH
    for i, block in enumerate(pool.get_new_blocks(6)):
        parent = hash_block(parent, [i])
        hashes.append(parent)
        pool.cache(block, parent)
    # At twice the bound (6) the oldest are dropped down to the bound (3).
    assert pool.take_events() == BlockEvents(stored=tuple(hashes[3:]), evicted=())
