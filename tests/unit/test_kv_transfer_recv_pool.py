"""RecvBufferPool: which idle buffer a payload lands in, and the budget on idle bytes."""

from __future__ import annotations

import pytest
import torch

from kv_transfer.base import DTypeCode, TransferHeader
from kv_transfer.recv_pool import RecvBufferPool

MB = 1 << 20


def header(blocks: int, dtype: DTypeCode = DTypeCode.FLOAT32) -> TransferHeader:
    """A payload of blocks * 64 KiB in float32 ([2, 2, blocks, 16, 4, 64])."""
    return TransferHeader(1, 0, 2, blocks, 16, 4, 64, dtype)


def storage_ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def test_a_recycled_payload_serves_the_next_one_of_the_same_size():
    pool = RecvBufferPool(64 * MB)
    first = pool.take(header(16))
    ptr = storage_ptr(first)
    pool.put(first)
    assert pool.idle_bytes == 16 * 64 * 1024
    again = pool.take(header(16))
    assert (storage_ptr(again), tuple(again.shape), again.dtype) == (
        ptr, (2, 2, 16, 16, 4, 64), torch.float32)
    assert again.is_contiguous()
    assert pool.idle_bytes == 0


def test_take_uses_the_smallest_idle_buffer_that_fits():
    pool = RecvBufferPool(64 * MB)
    buffers = {blocks: torch.empty(blocks * 64 * 1024, dtype=torch.uint8) for blocks in (4, 6, 8)}
    for buffer in buffers.values():
        pool.put(buffer)
    got = pool.take(header(5))
    assert storage_ptr(got) == storage_ptr(buffers[6])
    assert pool.idle_bytes == (4 + 8) * 64 * 1024


def test_a_buffer_over_twice_the_payload_is_left_for_a_larger_one():
    pool = RecvBufferPool(64 * MB)
    big = torch.empty(16 * 64 * 1024, dtype=torch.uint8)
    pool.put(big)
    small = pool.take(header(7))  # 16 > 2 * 7 blocks
    assert storage_ptr(small) != storage_ptr(big)
    assert pool.idle_bytes == 16 * 64 * 1024
    half = pool.take(header(8))  # exactly 2x fits
    assert storage_ptr(half) == storage_ptr(big)


def test_recycling_a_view_returns_its_whole_buffer():
    pool = RecvBufferPool(64 * MB)
    pool.put(torch.empty(10 * 64 * 1024, dtype=torch.uint8))
    view = pool.take(header(6))
    assert view.numel() * 4 == 6 * 64 * 1024
    pool.put(view)
    assert pool.idle_bytes == 10 * 64 * 1024


@pytest.mark.parametrize(("code", "dtype"), [(DTypeCode.BFLOAT16, torch.bfloat16),
                                             (DTypeCode.FLOAT8_E4M3FN, torch.float8_e4m3fn)])
def test_a_float32_buffer_is_reused_for_a_narrower_dtype(code, dtype):
    pool = RecvBufferPool(64 * MB)
    first = pool.take(header(8))
    pool.put(first)
    got = pool.take(header(8 * 4 // code.itemsize, code))
    assert (storage_ptr(got), got.dtype, tuple(got.shape)) == (
        storage_ptr(first), dtype, (2, 2, 8 * 4 // code.itemsize, 16, 4, 64))


def test_idle_bytes_never_exceed_the_budget_and_the_oldest_go_first():
    pool = RecvBufferPool(3 * MB)
    buffers = [torch.empty(MB, dtype=torch.uint8) for _ in range(5)]
    for i, buffer in enumerate(buffers):
        pool.put(buffer)
        assert pool.idle_bytes == min(i + 1, 3) * MB
    pool.put(torch.empty(4 * MB, dtype=torch.uint8))  # larger than the whole budget: dropped
    assert pool.idle_bytes == 3 * MB
    taken = [storage_ptr(pool.take(TransferHeader(1, 0, 1, 1, 1, 1, MB // 2, DTypeCode.FLOAT8_E4M3FN)))
             for _ in range(3)]
    assert sorted(taken) == sorted(storage_ptr(b) for b in buffers[2:])


def test_recycling_the_same_payload_twice_keeps_it_once():
    pool = RecvBufferPool(64 * MB)
    payload = pool.take(header(4))
    pool.put(payload)
    pool.put(payload)
    assert pool.idle_bytes == 4 * 64 * 1024
    assert storage_ptr(pool.take(header(4))) == storage_ptr(payload)
    assert storage_ptr(pool.take(header(4))) != storage_ptr(payload)


def test_a_zero_budget_keeps_nothing():
    pool = RecvBufferPool(0)
    pool.put(pool.take(header(4)))
    assert pool.idle_bytes == 0
    with pytest.raises(ValueError, match="budget_bytes must be >= 0, got -1"):
        RecvBufferPool(-1)
