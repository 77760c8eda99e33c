"""Layer-by-layer sends over real gloo channels (kv_transfer/layers.py): the layers a producer
puts while it still "computes" arrive exactly as a one-shot send of the same payload, with the
first token from the trailer; a cancelled feed fails only its own ticket and the channel
carries the next transfer."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from kv_transfer.base import TransferState
from kv_transfer.layers import LayerFeed
from kv_transfer.packing import make_header
from tests.service.test_kv_transfer_gloo_channels import drain, gloo, payload

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def receiver():
    receiver = gloo().open_receiver()
    yield receiver
    receiver.close()


def _feed(ticket: int, whole: torch.Tensor) -> LayerFeed:
    return LayerFeed(make_header(ticket, 0, whole))  # first token: a placeholder until finish()


def _produce(feed: LayerFeed, whole: torch.Tensor, layers: int, finish: bool, gap_s: float = 0.02):
    """Put `layers` layers one at a time (as a forward pass would), then finish or cancel."""
    def run() -> None:
        for layer in range(layers):
            time.sleep(gap_s)
            feed.put(layer, whole[layer].clone())
        time.sleep(gap_s)  # the sampler
        if finish:
            feed.finish(4242, 1_790_000_000.25)
        else:
            feed.cancel("the request was aborted")
    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_layers_put_while_computing_arrive_exactly_with_the_trailers_first_token(receiver):
    whole = payload(3, blocks=5)
    sender = gloo().connect(receiver.open_channel())
    try:
        feed = _feed(7, whole)
        sender.send_layers(feed)
        _produce(feed, whole, whole.shape[0], finish=True).join(10)
        (got,) = drain(receiver.poll, 1)
        (result,) = drain(sender.poll, 1)
    finally:
        sender.close()
    assert torch.equal(got.payload, whole)
    assert (got.header.ticket_id, got.header.first_token_id, got.header.first_token_at_us) == (
        7, 4242, 1_790_000_000_250_000)
    assert (result.state, result.nbytes) == (TransferState.DONE, whole.numel() * 4)


def test_a_streamed_transfers_wire_seconds_leave_out_the_wait_for_the_prefills_compute(receiver):
    whole = payload(6, blocks=4)
    layers, gap_s = whole.shape[0], 0.25
    sender = gloo().connect(receiver.open_channel())
    try:
        feed = _feed(10, whole)
        sender.send_layers(feed)
        _produce(feed, whole, layers, finish=True, gap_s=gap_s).join(10)
        drain(receiver.poll, 1)
        (streamed,) = drain(sender.poll, 1)
        sender.send(make_header(11, 5, whole), whole)  # one-shot: every byte exists at once
        (oneshot,) = drain(sender.poll, 1)
    finally:
        sender.close()
    computing_s = (layers + 1) * gap_s  # the producer's sleeps: layers, then the sampler
    # The producer starts its first sleep a moment before the sender opens the transfer.
    assert streamed.seconds > computing_s - 0.1
    # Loaded machine: wide margin; the bytes themselves take milliseconds on loopback.
    assert streamed.wire_seconds < streamed.seconds - computing_s + 0.3, (streamed, computing_s)
    assert streamed.wire_gbps > streamed.gbps
    assert oneshot.wire_seconds == oneshot.seconds


def test_a_cancelled_feed_fails_its_ticket_and_the_channel_carries_the_next(receiver):
    whole, after = payload(4, blocks=3), payload(5, blocks=2)
    sender = gloo().connect(receiver.open_channel())
    try:
        feed = _feed(8, whole)
        sender.send_layers(feed)
        _produce(feed, whole, 1, finish=False).join(10)  # one layer of two, then cancelled
        sender.send(make_header(9, 99, after), after)
        got = drain(receiver.poll, 2)
        results = drain(sender.poll, 2)
    finally:
        sender.close()
    assert [(g.header.ticket_id, g.payload is None, g.result.state) for g in got] == [
        (8, True, TransferState.FAILED), (9, False, TransferState.DONE)]
    assert got[0].result.error == "the prefill worker cancelled ticket 8 mid-transfer"
    assert torch.equal(got[1].payload, after) and got[1].header.first_token_id == 99
    assert [(r.ticket_id, r.state, r.error) for r in results] == [
        (8, TransferState.FAILED, "ticket 8 cancelled: the request was aborted"), (9, TransferState.DONE, None)]
    assert sender.error is None


def test_a_feed_the_producer_abandons_fails_within_the_timeout_and_the_channel_lives(receiver):
    whole = payload(6, blocks=2)
    sender = gloo(timeout_s=1.0).connect(receiver.open_channel())
    try:
        sender.send_layers(_feed(10, whole))  # nothing is ever put
        (got,) = drain(receiver.poll, 1, limit_s=15)
        sender.send(make_header(11, 5, whole), whole)
        results = drain(sender.poll, 2, limit_s=15)
    finally:
        sender.close()
    assert (got.header.ticket_id, got.result.state) == (10, TransferState.FAILED)
    assert [(r.ticket_id, r.state) for r in results] == [(10, TransferState.FAILED), (11, TransferState.DONE)]
    assert results[0].error.startswith("ticket 10 cancelled: layer 0 not computed within ")



def test_a_prefill_longer_than_the_timeout_streams_whole_when_each_layer_comes_in_time(receiver):
    whole = payload(7, blocks=2)  # 2 layers and the first token, 0.45 s apart: 1.35 s > timeout 1 s
    sender = gloo(timeout_s=1.0).connect(receiver.open_channel())
    try:
        feed = _feed(12, whole)
        sender.send_layers(feed)
        _produce(feed, whole, whole.shape[0], finish=True, gap_s=0.45).join(10)
        (got,) = drain(receiver.poll, 1, limit_s=15)
        (result,) = drain(sender.poll, 1, limit_s=15)
    finally:
        sender.close()
    assert (result.state, got.result.state, got.header.first_token_id) == (
        TransferState.DONE, TransferState.DONE, 4242)
    assert torch.equal(got.payload, whole) and result.seconds > 1.0


def _layer_log(receiver, take: bool = True, fail_layer: int | None = None) -> list[tuple[int, int, torch.Tensor]]:
    """Installs a layer hook on `receiver` that records (ticket, layer, copy of the layer) and
    answers `take` (raising on `fail_layer`)."""
    seen: list[tuple[int, int, torch.Tensor]] = []

    def hook(header, layer: int, kv: torch.Tensor) -> bool:
        if layer == fail_layer:
            raise RuntimeError("this layer's write failed")
        seen.append((header.ticket_id, layer, kv.clone()))
        return take
    receiver.on_layer(hook)
    return seen


def test_each_layer_goes_to_the_layer_hook_as_it_lands_before_the_first_token_exists(receiver):
    whole = payload(8, blocks=3)
    seen = _layer_log(receiver)
    sender = gloo().connect(receiver.open_channel())
    try:
        feed = _feed(20, whole)
        sender.send_layers(feed)
        feed.put(0, whole[0].clone())
        deadline = time.monotonic() + 10
        while not seen and time.monotonic() < deadline:  # layer 1 is not computed yet
            time.sleep(0.005)
        before_trailer = [(t, layer) for t, layer, _ in seen]
        feed.put(1, whole[1].clone())
        feed.finish(4242, None)
        (got,) = drain(receiver.poll, 1)
    finally:
        sender.close()
    assert before_trailer == [(20, 0)]
    assert [(t, layer) for t, layer, _ in seen] == [(20, 0), (20, 1)]
    assert all(torch.equal(kv, whole[layer]) for _, layer, kv in seen)
    assert (got.result.state, got.layers_written, got.header.first_token_id) == (TransferState.DONE, 2, 4242)
    assert torch.equal(got.payload, whole)  # the payload still holds every layer


def test_layers_the_hook_declines_or_fails_are_not_counted_and_the_payload_still_arrives(receiver, caplog):
    whole = payload(9, blocks=2)
    _layer_log(receiver, take=False)
    sender = gloo().connect(receiver.open_channel())
    try:
        sender.send(make_header(21, 3, whole), whole)
        (declined,) = drain(receiver.poll, 1)
        _layer_log(receiver, fail_layer=1)
        sender.send(make_header(22, 4, whole), whole)
        (failed,) = drain(receiver.poll, 1)
    finally:
        sender.close()
    assert (declined.result.state, declined.layers_written) == (TransferState.DONE, 0)
    assert (failed.result.state, failed.layers_written) == (TransferState.DONE, 1)
    assert torch.equal(failed.payload, whole)
    assert "the layer hook failed for ticket 22 layer 1" in caplog.text


def test_the_importer_writes_each_layer_on_arrival_and_never_unpacks_the_whole_payload(receiver):
    from decode_worker.kv_import import KVImporter

    whole = payload(10, blocks=3)  # [2 layers, 2, 3 blocks, 16, 3, 64]
    caches = [torch.zeros(2, 8, 16, 3, 64) for _ in range(2)]
    unpacked: list[int] = []
    importer = KVImporter(receiver, caches, unpack=lambda p, c, ids: unpacked.append(len(ids)))
    importer.start()
    sender = gloo().connect(receiver.open_channel())
    try:
        importer.expect(30, [6, 1, 4])
        feed = _feed(30, whole)
        sender.send_layers(feed)
        _produce(feed, whole, whole.shape[0], finish=True).join(10)
        (arrival,) = drain(importer.take, 1)
        # A ticket cancelled before its KV comes: no layer is written, nothing is unpacked.
        importer.expect(31, [0, 2, 3])
        importer.cancel(31)
        sender.send(make_header(31, 5, whole), whole)
        drain(sender.poll, 2)
    finally:
        sender.close()
        importer.stop()
    assert (arrival.header.ticket_id, arrival.error, arrival.result.state) == (30, None, TransferState.DONE)
    assert unpacked == []
    for layer, cache in enumerate(caches):
        assert torch.equal(cache[:, [6, 1, 4]], whole[layer])
        assert not cache[:, [0, 2, 3, 5, 7]].any()
    assert importer.open_landings == 0


class _Work:
    def __init__(self, fill=None, error: str | None = None) -> None:
        self._fill, self._error = fill, error

    def wait(self, timeout=None) -> bool:
        if self._error is not None:
            raise RuntimeError(self._error)
        if self._fill is not None:
            self._fill()
        return True


class _ScriptedGroup:
    """A channel's process group that plays P's side of one transfer from `whole`, logging
    what D does in `events`; the ack's send fails when `ack_error` is set."""

    def __init__(self, header, whole: torch.Tensor, trailer: tuple[int, ...], events: list[str],
                 ack_error: str | None = None) -> None:
        self._header, self._whole, self._trailer = header, whole, trailer
        self._layer, self._events, self._ack_error = 0, events, ack_error

    def recv(self, tensors, src, tag):
        from kv_transfer import wire
        (t,) = tensors
        if tag == wire.TAG_HEADER:
            return _Work(lambda: t.copy_(torch.tensor(self._header.to_ints())))
        if tag == wire.TAG_PAYLOAD:
            layer, self._layer = self._layer, self._layer + 1
            return _Work(lambda: t.copy_(self._whole[layer]))
        return _Work(lambda: t.copy_(torch.tensor(self._trailer)))

    def send(self, tensors, dst, tag):
        self._events.append("ack sent")
        return _Work(lambda: self._events.append("ack done"), self._ack_error)


def _scripted_channel(receiver, events: list[str]):
    from collections import deque

    from kv_transfer.recv_pool import RecvBufferPool
    from kv_transfer.torch_dist_receiver import _Channel

    channel = _Channel.__new__(_Channel)  # its thread and rendezvous are not needed here
    channel._config, channel.address = gloo().config, receiver.open_channel()
    channel._inbox, channel._arrived, channel._pool = deque(), threading.Event(), RecvBufferPool(0)
    channel._announce = lambda header: events.append(f"first token {header.first_token_id}")
    channel._layer_landed = lambda header, layer, kv: True
    return channel


@pytest.mark.parametrize("ack_error", [None, "peer went away"])
def test_the_first_token_is_announced_before_the_ack_is_done_and_a_failed_ack_still_delivers(receiver, ack_error,
                                                                                            caplog):
    whole = payload(11, blocks=2)
    header = make_header(40, 0, whole)
    events: list[str] = []
    channel = _scripted_channel(receiver, events)
    group = _ScriptedGroup(header, whole, (40, 0, 4242, 1_790_000_000_000_000), events, ack_error)
    ok = channel._receive_one(group)
    (got,) = channel._inbox
    assert events[:2] == ["ack sent", "first token 4242"]
    assert ok is (ack_error is None)  # a failed ack breaks the channel, not the ticket
    assert (got.result.state, got.header.first_token_id, got.layers_written) == (TransferState.DONE, 4242, 2)
    assert torch.equal(got.payload, whole)
    assert ("its ack failed" in caplog.text) is (ack_error is not None)


def test_the_trailer_leaves_from_the_thread_that_finishes_the_feed(receiver, monkeypatch):
    """The sender's thread has posted every layer and waits: finish() on the producer's thread
    posts the trailer itself (no wake of the sender's thread on the first token's path)."""
    from kv_transfer import torch_dist_sender
    posted_on, send_trailer = [], torch_dist_sender._send_trailer

    def spy(group, trailer, device):
        posted_on.append(threading.current_thread().name)
        return send_trailer(group, trailer, device)
    monkeypatch.setattr(torch_dist_sender, "_send_trailer", spy)
    whole = payload(12, blocks=2)
    sender = gloo().connect(receiver.open_channel())
    try:
        feed = _feed(13, whole)
        sender.send_layers(feed)
        for layer in range(whole.shape[0]):
            feed.put(layer, whole[layer].clone())
        deadline = time.monotonic() + 10
        while feed._post is None and time.monotonic() < deadline:
            time.sleep(0.01)  # until the sender's thread posted every layer and set its post
        finisher = threading.Thread(target=feed.finish, args=(4242, None), name="engine-step")
        finisher.start()
        finisher.join(5)
        (got,) = drain(receiver.poll, 1)
        (result,) = drain(sender.poll, 1)
    finally:
        sender.close()
    assert posted_on == ["engine-step"]
    assert torch.equal(got.payload, whole) and got.header.first_token_id == 4242
    assert result.state == TransferState.DONE
