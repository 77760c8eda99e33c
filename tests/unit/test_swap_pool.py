"""SwapPool: which request holds which host swap blocks; exact ids, nothing taken on refusal."""

from __future__ import annotations

import pytest

from engine.kv_cache.swap_pool import SwapPool, swap_blocks_for


def test_blocks_are_handed_out_from_the_head_of_the_free_queue_in_id_order():
    pool = SwapPool(6)
    assert pool.allocate("a", 2) == (0, 1)
    assert pool.allocate("b", 3) == (2, 3, 4)
    assert pool.blocks_of("a") == (0, 1)
    assert (pool.num_used_blocks, pool.num_free_blocks) == (5, 1)


def test_freed_blocks_go_to_the_back_of_the_free_queue():
    pool = SwapPool(4)
    pool.allocate("a", 2)
    assert pool.free("a") == (0, 1)
    assert pool.allocate("b", 3) == (2, 3, 0)
    assert pool.allocate("c", 1) == (1,)
    assert pool.num_free_blocks == 0


def test_a_request_that_does_not_fit_gets_none_and_nothing_is_taken():
    pool = SwapPool(3)
    pool.allocate("a", 2)
    assert pool.allocate("b", 2) is None
    assert pool.blocks_of("b") == ()
    assert (pool.num_used_blocks, pool.num_free_blocks) == (2, 1)
    assert pool.allocate("b", 1) == (2,)


def test_an_empty_pool_refuses_every_request_and_zero_blocks_are_never_allocated():
    assert SwapPool(0).allocate("a", 1) is None
    pool = SwapPool(2)
    assert pool.allocate("a", 0) is None
    assert pool.blocks_of("a") == ()
    assert pool.num_used_blocks == 0


def test_free_is_idempotent_and_unknown_requests_free_nothing():
    pool = SwapPool(2)
    pool.allocate("a", 2)
    assert pool.free("a") == (0, 1)
    assert pool.free("a") == ()
    assert pool.free("never") == ()
    assert (pool.num_used_blocks, pool.num_free_blocks) == (0, 2)


def test_a_request_cannot_hold_two_swap_allocations_at_once():
    pool = SwapPool(4)
    pool.allocate("a", 1)
    with pytest.raises(ValueError, match=r"request 'a' already holds swap blocks \(0,\)"):
        pool.allocate("a", 1)
    assert pool.num_used_blocks == 1


def test_a_negative_pool_size_is_rejected():
    with pytest.raises(ValueError, match="num_blocks must not be negative, got -1"):
        SwapPool(-1)


@pytest.mark.parametrize(
    ("gib", "bytes_per_block", "blocks"),
    [
        (0, 8192, 0),
        (1, 8192, 131072),
        (4, 3 * 2**20, 1365),  # 4096 MiB / 3 MiB, rounded down
        (64 * 8192 / 2**30, 8192, 64),
        (0.5, 2**30, 0),  # less than one block
    ],
)
def test_swap_space_in_gib_becomes_whole_blocks(gib, bytes_per_block, blocks):
    assert swap_blocks_for(gib, bytes_per_block) == blocks


def test_swap_blocks_for_rejects_a_block_size_of_zero_bytes():
    with pytest.raises(ValueError, match="bytes_per_block must be positive, got 0"):
        swap_blocks_for(1, 0)
