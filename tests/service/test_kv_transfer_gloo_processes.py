"""gloo transfers between real processes on 127.0.0.1: this test process is the prefill
worker (P); a child process is the decode worker (D). D opens a channel, tells P its address
on stdout (one JSON line), and reports each received transfer back the same way.

Shapes are SmolLM2-135M's KV cache: 30 layers, 3 KV heads, head_dim 64, blocks of 16, float32.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from kv_transfer.base import KV_TRANSFER_BACKENDS, ChannelAddress, TransferConfig, TransferState
from kv_transfer.packing import make_header, pack_blocks, unpack_blocks
from proto.auth import load_cluster_secret

SECRET = load_cluster_secret()  # tests/conftest.py sets it for the run

REPO = Path(__file__).resolve().parents[2]
LAYERS, BLOCK, HEADS, DIM, CACHE_BLOCKS = 30, 16, 3, 64, 80
# ticket -> (block ids on P, block ids on D): 1, 7 and 64 blocks, with holes.
PLAN = {
    1: ([5], [70]),
    2: ([0, 2, 3, 9, 11, 12, 40], [1, 3, 4, 8, 20, 21, 79]),
    3: (list(range(10, 74)), list(range(79, 15, -1))),
}


def pattern_caches(num_blocks: int = CACHE_BLOCKS) -> list[torch.Tensor]:
    """P's cache: exact float32 values (integers below 2**24), different per layer and slot."""
    shape = (2, num_blocks, BLOCK, HEADS, DIM)
    n = 2 * num_blocks * BLOCK * HEADS * DIM
    return [((torch.arange(n) * 2654435761 + 7919 * layer) % 1000003).float().view(shape)
            for layer in range(LAYERS)]


def decode_main() -> None:
    """The child: D. Reports each ReceivedKV until stdin closes or 60 s pass."""
    config = TransferConfig(host="127.0.0.1", timeout_s=float(sys.argv[1]),
                            connect_timeout_s=10.0, secret=SECRET)
    receiver = KV_TRANSFER_BACKENDS.get("gloo")(config).open_receiver()
    quit_event = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), quit_event.set()), daemon=True).start()
    src = pattern_caches()
    dst = [torch.zeros_like(c) for c in src]
    address = receiver.open_channel()
    print(json.dumps({"address": [address.host, address.port, address.channel_id]}), flush=True)
    deadline = time.monotonic() + 60
    try:
        while not quit_event.is_set() and time.monotonic() < deadline:
            for got in receiver.poll():
                report = {"ticket_id": got.header.ticket_id, "state": got.result.state.value,
                          "first_token_id": got.header.first_token_id,
                          "nbytes": got.result.nbytes, "error": got.result.error}
                if got.payload is not None and got.header.ticket_id in PLAN:
                    src_ids, dst_ids = PLAN[got.header.ticket_id]
                    unpack_blocks(got.payload, dst, dst_ids)
                    report["exact"] = all(
                        torch.equal(d[:, dst_ids], s[:, src_ids]) for d, s in zip(dst, src))
                print(json.dumps(report), flush=True)
            time.sleep(0.001)
    finally:
        receiver.close()


def prefill_dies_after_header_main() -> None:
    """The child: a P that joins argv's channel, sends one header of 64 blocks, and dies."""
    from kv_transfer import wire

    host, port, channel_id = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    backend = KV_TRANSFER_BACKENDS.get("gloo")(TransferConfig(connect_timeout_s=10.0, secret=SECRET))
    store = wire.channel_store(host, port, channel_id, 10.0)
    nonce = wire.prove(store, SECRET, channel_id, 10.0)
    group = backend.make_group(store, wire.RANK_P)
    wire.exchange_group_proofs(group, SECRET, channel_id, nonce, wire.RANK_P, "cpu", 10.0)
    store.set(wire.ring_key(1), wire.XFER)
    header = make_header(3, 0, pack_blocks(pattern_caches(), PLAN[3][0]))
    group.send([wire.header_tensor(header.to_ints(), "cpu")], wire.RANK_D, wire.TAG_HEADER).wait()
    os._exit(17)


class DecodeChild:
    """A running D child and a bounded reader of its JSON lines."""

    def __init__(self, tmp_path: Path, timeout_s: float) -> None:
        self.stderr = open(tmp_path / "decode.stderr", "w+")  # noqa: SIM115 - closed in stop()
        code = "from tests.service.test_kv_transfer_gloo_processes import decode_main; decode_main()"
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code, str(timeout_s)], cwd=REPO, stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=self.stderr, text=True)
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._lines.put(line)

    def next(self, timeout: float = 30.0) -> dict:
        try:
            return json.loads(self._lines.get(timeout=timeout))
        except queue.Empty:
            self.stderr.seek(0)
            raise AssertionError(f"no line from D in {timeout}s; stderr:\n{self.stderr.read()}")

    def address(self) -> ChannelAddress:
        return ChannelAddress(*self.next()["address"])

    def stop(self) -> None:
        try:
            if self.proc.poll() is None:
                self.proc.stdin.close()
                self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(timeout=10)
            self.stderr.close()


@pytest.fixture
def decode_child(tmp_path):
    children: list[DecodeChild] = []

    def start(timeout_s: float = 10.0) -> DecodeChild:
        children.append(DecodeChild(tmp_path, timeout_s))
        return children[-1]

    yield start
    for child in children:
        child.stop()


def wait_results(sender, count: int, limit_s: float) -> list:
    results, deadline = [], time.monotonic() + limit_s
    while len(results) < count and time.monotonic() < deadline:
        results += sender.poll()
        time.sleep(0.001)
    return results


@pytest.mark.timeout(120)
def test_three_transfers_arrive_exactly_in_another_process(decode_child):
    child = decode_child()
    sender = KV_TRANSFER_BACKENDS.get("gloo")(TransferConfig(timeout_s=10.0, secret=SECRET)).connect(
        child.address())
    src = pattern_caches()
    try:
        for ticket, (src_ids, _) in PLAN.items():
            payload = pack_blocks(src, src_ids)
            sender.send(make_header(ticket, 1000 + ticket, payload), payload)
            (result,) = wait_results(sender, 1, 30.0)
            report = child.next()
            assert (result.ticket_id, result.state, result.error) == (
                ticket, TransferState.DONE, None)
            assert result.nbytes == LAYERS * 2 * len(src_ids) * BLOCK * HEADS * DIM * 4
            assert report == {"ticket_id": ticket, "state": "done", "first_token_id": 1000 + ticket,
                              "nbytes": result.nbytes, "error": None, "exact": True}
            print(f"gloo 127.0.0.1 P->D: {len(src_ids):3d} blocks {result.nbytes / 1e6:7.2f} MB "
                  f"in {result.seconds * 1e3:7.2f} ms = {result.gbps:.2f} GB/s")
    finally:
        sender.close()


@pytest.mark.timeout(60)
def test_sending_to_a_decode_worker_that_died_fails_within_the_timeout(decode_child):
    child = decode_child()
    sender = KV_TRANSFER_BACKENDS.get("gloo")(TransferConfig(timeout_s=5.0, secret=SECRET)).connect(
        child.address())
    src = pattern_caches()
    try:
        payload = pack_blocks(src, PLAN[1][0])
        sender.send(make_header(1, 0, payload), payload)
        assert [r.state for r in wait_results(sender, 1, 30.0)] == [TransferState.DONE]
        child.proc.kill()
        child.proc.wait(timeout=10)
        payload = pack_blocks(src, PLAN[3][0])
        start = time.monotonic()
        sender.send(make_header(3, 0, payload), payload)
        (result,) = wait_results(sender, 1, 10.0)
        assert time.monotonic() - start < 10.0
        assert (result.ticket_id, result.state, result.nbytes) == (3, TransferState.FAILED, 0)
        assert result.error.startswith("transfer of ticket 3 (47185920 bytes) to 127.0.0.1:")
        assert sender.error == result.error
        print("dead D:", result.error)
        sender.send(make_header(4, 0, payload), payload)  # the channel stays broken
        assert [(r.ticket_id, r.error) for r in wait_results(sender, 1, 5.0)] == [
            (4, result.error)]
    finally:
        sender.close()


@pytest.mark.timeout(60)
def test_sending_to_a_stalled_decode_worker_times_out_instead_of_hanging(decode_child):
    child = decode_child()
    sender = KV_TRANSFER_BACKENDS.get("gloo")(TransferConfig(timeout_s=2.0, secret=SECRET)).connect(
        child.address())
    src = pattern_caches()
    try:
        payload = pack_blocks(src, PLAN[1][0])
        sender.send(make_header(1, 0, payload), payload)
        assert [r.state for r in wait_results(sender, 1, 30.0)] == [TransferState.DONE]
        os.kill(child.proc.pid, signal.SIGSTOP)
        payload = pack_blocks(src, PLAN[3][0])
        start = time.monotonic()
        sender.send(make_header(3, 0, payload), payload)
        (result,) = wait_results(sender, 1, 10.0)
        elapsed = time.monotonic() - start
        assert (result.ticket_id, result.state) == (3, TransferState.FAILED)
        assert 1.9 < elapsed < 5.0, result.error
        assert "timed out" in result.error.lower() or "timeout" in result.error.lower()
        print("stalled D:", result.error)
    finally:
        os.kill(child.proc.pid, signal.SIGKILL)
        start = time.monotonic()
        sender.close()
        assert time.monotonic() - start < 5.0


@pytest.mark.timeout(60)
def test_decode_gets_a_failed_ticket_when_prefill_dies_between_header_and_payload(tmp_path):
    receiver = KV_TRANSFER_BACKENDS.get("gloo")(TransferConfig(timeout_s=5.0, secret=SECRET)).open_receiver()
    address = receiver.open_channel()
    code = ("from tests.service.test_kv_transfer_gloo_processes import "
            "prefill_dies_after_header_main as m; m()")
    with open(tmp_path / "prefill.stderr", "w+") as stderr:
        child = subprocess.Popen([sys.executable, "-c", code, address.host, str(address.port),
                                  address.channel_id], cwd=REPO, stderr=stderr)
        try:
            if child.wait(timeout=30) != 17:
                stderr.seek(0)
                raise AssertionError(f"the prefill child failed:\n{stderr.read()}")
            got, deadline = [], time.monotonic() + 10.0
            while not got and time.monotonic() < deadline:
                got = receiver.poll()
                time.sleep(0.001)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait(timeout=10)
            receiver.close()
    (received,) = got
    assert (received.header.ticket_id, received.header.num_blocks, received.payload) == (3, 64, None)
    assert (received.result.state, received.result.nbytes) == (TransferState.FAILED, 0)
    assert received.result.error.startswith(f"receiving ticket 3 on channel {address.channel_id} ")
