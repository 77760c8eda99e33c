"""The in-process backend: send -> poll delivers an exact copy, results once, states."""

from __future__ import annotations

import pytest
import torch

from kv_transfer.base import KV_TRANSFER_BACKENDS, ChannelAddress, TransferResult, TransferState
from kv_transfer.packing import make_header


def payload(seed: int, blocks: int = 3) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(2, 2, blocks, 4, 2, 8, generator=gen)


def pair():
    backend = KV_TRANSFER_BACKENDS.get("local")()
    receiver = backend.open_receiver()
    return receiver, backend.connect(receiver.open_channel())


def test_local_send_delivers_an_exact_copy_with_its_header():
    receiver, sender = pair()
    data = payload(0)
    header = make_header(ticket_id=11, first_token_id=3, payload=data)
    sender.send(header, data)
    assert sender.state(11) is TransferState.DONE
    (got,) = receiver.poll()
    assert got.header == header
    assert torch.equal(got.payload, data)
    assert got.payload.data_ptr() != data.data_ptr()
    assert (got.result.ticket_id, got.result.state, got.result.nbytes) == (
        11, TransferState.DONE, data.numel() * 4)
    assert receiver.poll() == []


def test_local_results_are_returned_once_and_then_the_ticket_is_forgotten():
    _, sender = pair()
    for ticket in (1, 2):
        data = payload(ticket)
        sender.send(make_header(ticket, 0, data), data)
    assert sender.outstanding == 2
    assert [(r.ticket_id, r.state) for r in sender.poll()] == [
        (1, TransferState.DONE), (2, TransferState.DONE)]
    assert sender.poll() == []
    assert sender.outstanding == 0
    with pytest.raises(KeyError):
        sender.state(1)


def test_local_send_of_an_outstanding_ticket_or_a_mismatched_payload_raises():
    _, sender = pair()
    data = payload(5)
    sender.send(make_header(5, 0, data), data)
    with pytest.raises(ValueError, match="ticket 5 is already outstanding"):
        sender.send(make_header(5, 0, data), data)
    with pytest.raises(ValueError, match="does not match its header"):
        sender.send(make_header(6, 0, data), payload(6, blocks=2))


def test_local_send_to_a_closed_channel_fails_the_transfer():
    receiver, sender = pair()
    receiver.close()
    data = payload(7)
    sender.send(make_header(7, 0, data), data)
    (result,) = sender.poll()
    assert result == TransferResult(7, TransferState.FAILED, 0, 0.0,
                                    "no local channel 'local-1'")
    assert sender.error == "no local channel 'local-1'"


def test_local_backends_do_not_share_channels():
    first, second = (KV_TRANSFER_BACKENDS.get("local")() for _ in range(2))
    address = first.open_receiver().open_channel()
    assert address == ChannelAddress("local", 0, "local-1")
    sender = second.connect(address)
    data = payload(8)
    sender.send(make_header(8, 0, data), data)
    assert sender.poll()[0].state is TransferState.FAILED
