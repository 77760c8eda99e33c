"""CudaIpcBackend moves payloads between two processes on one GPU (and within one process),
byte for byte, including payloads larger than the staging buffer and empty ones."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kv_transfer.base import TransferConfig, TransferState
from kv_transfer.packing import make_header
from tests.gpu.ipc_sender import PAYLOADS, make_payload

pytestmark = pytest.mark.gpu
pytest.importorskip("cupy", reason="the cuda_ipc backend needs cupy")

from kv_transfer.cuda_ipc import CudaIpcBackend  # noqa: E402 - after the skip

REPO = Path(__file__).resolve().parents[2]


def receive_all(receiver, count: int, limit_s: float = 60.0):
    got, deadline = [], time.monotonic() + limit_s
    while len(got) < count and time.monotonic() < deadline:
        got += receiver.poll()
        time.sleep(0.01)
    return got


def assert_received_exactly_the_payloads(got):
    assert [item.header.ticket_id for item in got] == [t for t, _, _ in PAYLOADS]
    for item, (ticket, shape, dtype) in zip(got, PAYLOADS):
        assert item.result.state is TransferState.DONE, item.result.error
        assert item.header.first_token_id == 100 + ticket
        expected = make_payload(ticket, shape, dtype, "cpu")
        assert item.payload.device == torch.device("cuda:0")
        assert torch.equal(item.payload.cpu().view(torch.uint8), expected.view(torch.uint8))


def test_two_processes_transfer_payloads_through_cuda_ipc():
    backend = CudaIpcBackend(TransferConfig(device="cuda:0", timeout_s=30.0),
                             staging_bytes=1 << 20)
    receiver = backend.open_receiver()
    address = receiver.open_channel()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.gpu.ipc_sender", address.host, str(address.port),
         address.channel_id], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True)
    try:
        got = receive_all(receiver, len(PAYLOADS))
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
        receiver.close()
    assert proc.returncode == 0, stderr
    assert json.loads(stdout.strip().splitlines()[-1]) == {
        str(t): TransferState.DONE.value for t, _, _ in PAYLOADS}
    assert_received_exactly_the_payloads(got)


def test_sender_and_receiver_in_one_process_share_the_staging_buffer():
    backend = CudaIpcBackend(TransferConfig(device="cuda:0", timeout_s=30.0),
                             staging_bytes=1 << 20)
    receiver = backend.open_receiver()
    sender = backend.connect(receiver.open_channel())
    try:
        for ticket, shape, dtype in PAYLOADS:
            payload = make_payload(ticket, shape, dtype, "cuda:0")
            sender.send(make_header(ticket, 100 + ticket, payload), payload)
        got = receive_all(receiver, len(PAYLOADS))
    finally:
        sender.close()
        receiver.close()
    assert_received_exactly_the_payloads(got)
