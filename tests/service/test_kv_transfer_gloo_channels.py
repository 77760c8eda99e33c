"""gloo channels with both ends in this process (threads, real sockets on 127.0.0.1): several
groups at once, closing from either side, nobody listening, a channel nobody joins."""

from __future__ import annotations

import os
import socket
import sys
import threading
import time

import pytest
import torch

from engine.thread_priority import lower_thread_priority
from kv_transfer.base import (
    KV_TRANSFER_BACKENDS,
    ChannelAddress,
    TransferConfig,
    TransferState,
)
from kv_transfer.packing import make_header
from kv_transfer.pool import ChannelPool
from proto.auth import load_cluster_secret

SECRET = load_cluster_secret()  # tests/conftest.py sets it for the run

pytestmark = pytest.mark.timeout(60)


def gloo(timeout_s: float = 5.0, connect_timeout_s: float = 5.0):
    config = TransferConfig(timeout_s=timeout_s, connect_timeout_s=connect_timeout_s, secret=SECRET)
    return KV_TRANSFER_BACKENDS.get("gloo")(config)


def payload(seed: int, blocks: int = 4) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(2, 2, blocks, 16, 3, 64, generator=gen)


def drain(poll, count: int, limit_s: float = 10.0) -> list:
    got, deadline = [], time.monotonic() + limit_s
    while len(got) < count and time.monotonic() < deadline:
        got += poll()
        time.sleep(0.001)
    return got


def recv_threads_alive(address: ChannelAddress) -> bool:
    return any(t.name == f"kv-recv-{address.channel_id}" for t in threading.enumerate())


@pytest.fixture
def receiver():
    receiver = gloo().open_receiver()
    yield receiver
    receiver.close()


def test_two_prefill_channels_into_one_receiver_deliver_every_payload_exactly(receiver):
    backend = gloo()
    senders = [backend.connect(receiver.open_channel()) for _ in range(2)]
    sent = {}
    try:
        for ticket in range(1, 7):
            sent[ticket] = payload(ticket, blocks=ticket)
            senders[ticket % 2].send(make_header(ticket, 100 + ticket, sent[ticket]),
                                     sent[ticket])
        got = drain(receiver.poll, 6)
        results = drain(senders[0].poll, 3) + drain(senders[1].poll, 3)
    finally:
        for sender in senders:
            sender.close()
    assert sorted(g.header.ticket_id for g in got) == [1, 2, 3, 4, 5, 6]
    for g in got:
        assert torch.equal(g.payload, sent[g.header.ticket_id])
        assert g.header.first_token_id == 100 + g.header.ticket_id
    assert sorted((r.ticket_id, r.state) for r in results) == [
        (t, TransferState.DONE) for t in range(1, 7)]


def test_a_transfer_of_zero_blocks_carries_only_its_header(receiver):
    sender = gloo().connect(receiver.open_channel())
    try:
        empty = payload(0, blocks=0)
        sender.send(make_header(9, 55, empty), empty)
        (result,) = drain(sender.poll, 1)
        (got,) = drain(receiver.poll, 1)
    finally:
        sender.close()
    assert (result.state, result.nbytes) == (TransferState.DONE, 0)
    assert (got.header.ticket_id, got.header.first_token_id, tuple(got.payload.shape)) == (
        9, 55, (2, 2, 0, 16, 3, 64))


def test_prefill_close_ends_the_decode_channel_thread(receiver):
    address = receiver.open_channel()
    sender = gloo().connect(address)
    data = payload(1)
    sender.send(make_header(1, 0, data), data)
    assert [r.state for r in drain(sender.poll, 1)] == [TransferState.DONE]
    sender.close()
    deadline = time.monotonic() + 5.0
    while recv_threads_alive(address) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert recv_threads_alive(address) is False


def test_decode_closing_a_channel_fails_the_next_send_quickly(receiver):
    address = receiver.open_channel()
    sender = gloo(timeout_s=30.0).connect(address)
    try:
        data = payload(2)
        sender.send(make_header(1, 0, data), data)
        assert [r.state for r in drain(sender.poll, 1)] == [TransferState.DONE]
        start = time.monotonic()
        receiver.close_channel(address)
        assert recv_threads_alive(address) is False
        sender.send(make_header(2, 0, data), data)
        (result,) = drain(sender.poll, 1, limit_s=30.0)
        assert (result.ticket_id, result.state) == (2, TransferState.FAILED)
        assert time.monotonic() - start < 5.0, result.error
    finally:
        sender.close()


def test_connecting_where_nobody_listens_fails_queued_transfers_in_bounded_time():
    with socket.socket() as probe:  # a port that was free a moment ago
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    address = ChannelAddress("127.0.0.1", port, "nobody")
    sender = gloo(connect_timeout_s=1.0).connect(address)
    data = payload(3)
    start = time.monotonic()
    sender.send(make_header(1, 0, data), data)
    (result,) = drain(sender.poll, 1)
    elapsed = time.monotonic() - start
    sender.close()
    assert (result.ticket_id, result.state, result.nbytes) == (1, TransferState.FAILED, 0)
    assert result.error.startswith(f"could not join channel 127.0.0.1:{port}/nobody: ")
    assert elapsed < 6.0  # the store client retries once: about 2 x connect_timeout_s


def test_receiver_close_returns_promptly_while_a_channel_waits_for_its_prefill_worker():
    receiver = gloo(connect_timeout_s=30.0).open_receiver()
    address = receiver.open_channel()
    start = time.monotonic()
    receiver.close()
    assert time.monotonic() - start < 2.0
    assert recv_threads_alive(address) is False


def test_sender_rejects_use_after_close_and_payloads_not_matching_their_header(receiver):
    sender = gloo().connect(receiver.open_channel())
    data = payload(4)
    with pytest.raises(ValueError, match="does not match its header"):
        sender.send(make_header(1, 0, data), payload(4, blocks=3))
    sender.close()
    with pytest.raises(RuntimeError, match="is closed"):
        sender.send(make_header(1, 0, data), data)


def test_pool_over_gloo_reuses_one_channel_per_decode_address(receiver):
    pool = ChannelPool(gloo(), max_channels=1)
    first, second = receiver.open_channel(), receiver.open_channel()
    try:
        data = payload(5)
        pool.get(first).send(make_header(1, 0, data), data)
        assert pool.get(second) is None  # the only slot is busy until polled
        assert [(r.ticket_id, r.state) for r in drain(pool.poll, 1)] == [(1, TransferState.DONE)]
        pool.get(second).send(make_header(2, 0, data), data)
        assert [(r.ticket_id, r.state) for r in drain(pool.poll, 1)] == [(2, TransferState.DONE)]
        assert pool.addresses() == [second]
        assert sorted(g.header.ticket_id for g in drain(receiver.poll, 2)) == [1, 2]
    finally:
        pool.close()


def test_a_channel_idle_for_longer_than_its_timeouts_still_delivers():
    backend = gloo(timeout_s=0.5, connect_timeout_s=0.5)
    receiver = backend.open_receiver()
    sender = backend.connect(receiver.open_channel())
    try:
        for ticket in (1, 2):
            data = payload(ticket)
            sender.send(make_header(ticket, 0, data), data)
            assert [(r.ticket_id, r.state) for r in drain(sender.poll, 1)] == [
                (ticket, TransferState.DONE)]
            (got,) = drain(receiver.poll, 1)
            assert torch.equal(got.payload, data)
            time.sleep(1.5)  # D waits on its doorbell, never in a gloo recv that could time out
    finally:
        sender.close()
        receiver.close()


def wait_thread_gone(address: ChannelAddress, limit_s: float = 5.0) -> bool:
    deadline = time.monotonic() + limit_s
    while recv_threads_alive(address) and time.monotonic() < deadline:
        time.sleep(0.01)
    return not recv_threads_alive(address)


def test_a_peer_with_the_wrong_secret_is_refused_while_the_right_one_joins_the_same_receiver(
        receiver, caplog):
    wrong = KV_TRANSFER_BACKENDS.get("gloo")(
        TransferConfig(timeout_s=5.0, connect_timeout_s=5.0, secret=b"not-the-cluster-secret"))
    bad_address, good_address = receiver.open_channel(), receiver.open_channel()
    bad, good = wrong.connect(bad_address), gloo().connect(good_address)
    data = payload(3)
    try:
        bad.send(make_header(1, 0, data), data)
        (failed,) = drain(bad.poll, 1)
        where = f"{bad_address.host}:{bad_address.port}/{bad_address.channel_id}"
        assert (failed.ticket_id, failed.state, failed.error) == (
            1, TransferState.FAILED, f"could not join channel {where}: the decode worker refused "
                                     "this channel: the cluster secrets differ")
        assert wait_thread_gone(bad_address)
        good.send(make_header(2, 7, data), data)
        assert [(r.ticket_id, r.state) for r in drain(good.poll, 1)] == [(2, TransferState.DONE)]
        (got,) = drain(receiver.poll, 1)
        assert (got.header.ticket_id, got.header.first_token_id) == (2, 7)
        assert torch.equal(got.payload, data)
    finally:
        bad.close()
        good.close()
    refusals = [r.getMessage() for r in caplog.records if "refused a peer" in r.getMessage()]
    assert refusals == [f"kv channel {bad_address.channel_id} refused a peer whose hello does not "
                        "prove the cluster secret; channel dropped"]


def test_a_raw_store_client_saying_hello_without_a_proof_never_gets_a_group(receiver):
    from kv_transfer import wire

    address = receiver.open_channel()
    store = wire.channel_store(address.host, address.port, address.channel_id, 5.0)
    store.set(wire.ring_key(0), wire.HELLO)  # the pre-authentication protocol's hello
    assert wire.wait_get(store, wire.REPLY_KEY, wire.seconds(5.0)) == wire.REFUSED
    assert wait_thread_gone(address)
    assert receiver.poll() == []


def test_a_peer_in_the_group_without_the_group_proof_is_dropped_before_any_kv(receiver, caplog):
    """What a rogue store client that won the group's rendezvous race would look like to D:
    it joins the group but cannot prove the secret over it (here: sends zeros)."""
    from kv_transfer import wire

    address = receiver.open_channel()
    store = wire.channel_store(address.host, address.port, address.channel_id, 5.0)
    wire.prove(store, SECRET, address.channel_id, 5.0)
    group = gloo().make_group(store, wire.RANK_P)
    group.send([torch.zeros(4, dtype=torch.int64)], wire.RANK_D, wire.TAG_PROOF).wait()
    answer = torch.empty(4, dtype=torch.int64)
    with pytest.raises(RuntimeError):  # D dropped the group instead of answering with its proof
        group.recv([answer], wire.RANK_D, wire.TAG_PROOF).wait(wire.seconds(5.0))
    assert wait_thread_gone(address)
    assert receiver.poll() == []
    assert [r.getMessage() for r in caplog.records if "closed before" in r.getMessage()] == [
        f"kv channel {address.channel_id} closed before a prefill worker joined: the peer in the "
        "group did not prove the cluster secret (P side)"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice is Linux's")
def test_a_sender_made_from_the_lowered_engine_loop_sends_at_the_process_priority(receiver):
    """P makes its senders from the engine loop (EngineConfig.engine_nice below the process):
    the sender's thread and the process group's threads it starts must not inherit that."""
    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    made: list = []
    address = receiver.open_channel()  # D opens it, at its own priority

    def engine_loop():
        lower_thread_priority(7)
        sender = gloo().connect(address)
        made.append(sender)
        sent = payload(1)
        sender.send(make_header(1, 101, sent), sent)

    loop = threading.Thread(target=engine_loop)
    loop.start()
    loop.join(10)
    sender = made[0]
    try:
        assert [g.header.ticket_id for g in drain(receiver.poll, 1)] == [1]
        assert [r.state for r in drain(sender.poll, 1)] == [TransferState.DONE]
        lowered = [tid for tid in os.listdir("/proc/self/task") if _task_nice(tid) != base]
        assert lowered == [], f"threads left below the process's nice {base}: {[_comm(t) for t in lowered]}"
    finally:
        sender.close()


def _task_nice(tid: str) -> int:
    try:
        with open(f"/proc/self/task/{tid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[16])  # field 19: nice
    except FileNotFoundError:  # the thread ended meanwhile
        return os.getpriority(os.PRIO_PROCESS, os.getpid())


def _comm(tid: str) -> str:
    try:
        with open(f"/proc/self/task/{tid}/comm") as f:
            return f"{tid} {f.read().strip()} nice {_task_nice(tid)}"
    except FileNotFoundError:
        return f"{tid} (ended)"
