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
