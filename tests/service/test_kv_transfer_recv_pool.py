"""gloo receiver with its buffer pool, both ends in this process (real sockets on 127.0.0.1):
a recycled payload's memory receives the next transfer that fits, byte for byte, and the
pool's idle memory stays within its budget."""

from __future__ import annotations

import time

import pytest
import torch

from kv_transfer.base import KV_TRANSFER_BACKENDS, TransferConfig, TransferState
from kv_transfer.packing import make_header
from proto.auth import load_cluster_secret

SECRET = load_cluster_secret()  # tests/conftest.py sets it for the run

pytestmark = pytest.mark.timeout(60)

BLOCK_BYTES = 2 * 2 * 16 * 3 * 64 * 4  # one block of payload(): 2 layers, K and V, float32


def gloo(pool_bytes: int = 1 << 30):
    config = TransferConfig(timeout_s=5.0, connect_timeout_s=5.0,
                            recv_buffer_pool_bytes=pool_bytes, secret=SECRET)
    return KV_TRANSFER_BACKENDS.get("gloo")(config)


def payload(seed: int, blocks: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(2, 2, blocks, 16, 3, 64, generator=gen)


def storage_ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def transfer(sender, receiver, ticket: int, data: torch.Tensor):
    """Send one payload and wait for it at both ends; the ReceivedKV."""
    sender.send(make_header(ticket, 100 + ticket, data), data)
    got, results, deadline = [], [], time.monotonic() + 10.0
    while (not got or not results) and time.monotonic() < deadline:
        got += receiver.poll()
        results += sender.poll()
        time.sleep(0.001)
    assert [(r.ticket_id, r.state) for r in results] == [(ticket, TransferState.DONE)]
    (kv,) = got
    assert (kv.header.ticket_id, kv.result.state) == (ticket, TransferState.DONE)
    return kv


@pytest.fixture
def pair(request):
    receiver = gloo(getattr(request, "param", 1 << 30)).open_receiver()
    sender = gloo().connect(receiver.open_channel())
    yield sender, receiver
    sender.close()
    receiver.close()


def test_after_recycle_the_next_transfer_of_that_size_lands_in_the_same_storage(pair):
    sender, receiver = pair
    first = transfer(sender, receiver, 1, payload(1, blocks=8))
    ptr = storage_ptr(first.payload)
    receiver.recycle(first.payload)
    sent = payload(2, blocks=8)
    second = transfer(sender, receiver, 2, sent)
    assert storage_ptr(second.payload) == ptr
    assert torch.equal(second.payload, sent)
    assert second.header.first_token_id == 102


def test_a_smaller_transfer_reuses_a_recycled_buffer_and_gets_exact_bytes(pair):
    sender, receiver = pair
    first = transfer(sender, receiver, 1, payload(1, blocks=8))
    ptr = storage_ptr(first.payload)
    receiver.recycle(first.payload)
    sent = payload(3, blocks=5)  # 5 of the buffer's 8 blocks; the rest holds stale bytes
    second = transfer(sender, receiver, 2, sent)
    assert (storage_ptr(second.payload), tuple(second.payload.shape)) == (ptr, (2, 2, 5, 16, 3, 64))
    assert torch.equal(second.payload, sent)


def test_a_payload_not_recycled_is_never_received_into_again(pair):
    sender, receiver = pair
    kept_data = payload(1, blocks=4)
    kept = transfer(sender, receiver, 1, kept_data)
    for ticket in (2, 3):
        got = transfer(sender, receiver, ticket, payload(ticket, blocks=4))
        assert storage_ptr(got.payload) != storage_ptr(kept.payload)
        receiver.recycle(got.payload)
    assert torch.equal(kept.payload, kept_data)


@pytest.mark.parametrize("pair", [3 * 4 * BLOCK_BYTES], indirect=True)
def test_recycled_memory_kept_idle_never_exceeds_the_budget(pair):
    sender, receiver = pair
    held = [transfer(sender, receiver, t, payload(t, blocks=4)) for t in range(1, 6)]
    for i, kv in enumerate(held):
        receiver.recycle(kv.payload)
        assert receiver._pool.idle_bytes == min(i + 1, 3) * 4 * BLOCK_BYTES
    ptrs = {storage_ptr(kv.payload) for kv in held[2:]}  # the oldest two were let go
    del held
    for ticket in range(6, 9):
        sent = payload(ticket, blocks=4)
        got = transfer(sender, receiver, ticket, sent)
        assert storage_ptr(got.payload) in ptrs
        assert torch.equal(got.payload, sent)
        ptrs.discard(storage_ptr(got.payload))
    assert receiver._pool.idle_bytes == 0
