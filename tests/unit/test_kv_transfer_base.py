"""kv_transfer.base and pool: the header's wire form, results, config, registry, channel pool."""

from __future__ import annotations

import pytest

from kv_transfer.base import (
    HEADER_LEN,
    HEADER_MAGIC,
    HEADER_VERSION,
    KV_TRANSFER_BACKENDS,
    ChannelAddress,
    DTypeCode,
    KVReceiver,
    KVSender,
    KVTransferBackend,
    TransferConfig,
    TransferHeader,
    TransferResult,
    TransferState,
)
from kv_transfer.pool import ChannelPool

HEADER = TransferHeader(ticket_id=42, first_token_id=9001, num_layers=30, num_blocks=7,
                        block_size=16, num_kv_heads=3, head_dim=64, dtype=DTypeCode.BFLOAT16,
                        first_token_at_us=1_790_000_000_123_456)


def test_header_round_trips_through_its_fixed_length_ints():
    ints = HEADER.to_ints()
    assert ints == (HEADER_MAGIC, HEADER_VERSION, 42, 9001, 30, 7, 16, 3, 64, 2, 1_790_000_000_123_456)
    assert len(ints) == HEADER_LEN
    assert TransferHeader.from_ints(list(ints)) == HEADER


def test_header_describes_its_payload_shape_and_bytes():
    assert HEADER.payload_shape == (30, 2, 7, 16, 3, 64)
    assert HEADER.payload_nbytes == 30 * 2 * 7 * 16 * 3 * 64 * 2


def test_header_with_bad_magic_is_rejected():
    ints = (0x1234, *HEADER.to_ints()[1:])
    with pytest.raises(ValueError, match="bad transfer header magic 0x1234, expected 0x4b565846"):
        TransferHeader.from_ints(ints)


def test_header_with_other_version_or_length_is_rejected():
    with pytest.raises(ValueError, match="transfer header version 1, expected 2"):
        TransferHeader.from_ints((HEADER_MAGIC, 1, *HEADER.to_ints()[2:]))
    with pytest.raises(ValueError, match="a transfer header has 11 ints, got 10"):
        TransferHeader.from_ints(HEADER.to_ints()[:-1])


def test_header_with_unknown_dtype_code_or_bad_dims_is_rejected():
    with pytest.raises(ValueError, match="99 is not a valid DTypeCode"):
        TransferHeader.from_ints((*HEADER.to_ints()[:-2], 99, 0))
    with pytest.raises(ValueError, match="head_dim must be positive, got 0"):
        TransferHeader(1, 2, 30, 7, 16, 3, 0, DTypeCode.FLOAT32)
    with pytest.raises(ValueError, match="num_blocks must be >= 0, got -1"):
        TransferHeader(1, 2, 30, -1, 16, 3, 64, DTypeCode.FLOAT32)


def test_result_reports_gigabytes_per_second():
    result = TransferResult(7, TransferState.DONE, nbytes=3_000_000_000, seconds=1.5)
    assert result.gbps == 2.0
    assert TransferResult(7, TransferState.DONE, nbytes=10, seconds=0.0).gbps == 0.0


def test_result_must_be_terminal_and_carry_an_error_exactly_when_failed():
    with pytest.raises(ValueError, match="a result's state must be terminal"):
        TransferResult(1, TransferState.IN_FLIGHT, 0, 0.0)
    with pytest.raises(ValueError, match="error is set exactly when the state is FAILED"):
        TransferResult(1, TransferState.FAILED, 0, 0.0)
    with pytest.raises(ValueError, match="error is set exactly when the state is FAILED"):
        TransferResult(1, TransferState.DONE, 0, 0.0, error="boom")


def test_config_rejects_non_positive_limits():
    with pytest.raises(ValueError, match="timeout_s must be positive, got 0"):
        TransferConfig(timeout_s=0)
    with pytest.raises(ValueError, match="max_channels must be positive, got 0"):
        TransferConfig(max_channels=0)
    with pytest.raises(ValueError, match="recv_buffer_pool_bytes must be >= 0, got -1"):
        TransferConfig(recv_buffer_pool_bytes=-1)
    assert TransferConfig().host == "127.0.0.1"
    assert TransferConfig(recv_buffer_pool_bytes=0).recv_buffer_pool_bytes == 0


def test_registry_lists_the_three_backends_and_names_them_on_a_miss():
    assert KV_TRANSFER_BACKENDS.names() == ["cuda_ipc", "gloo", "local", "nccl"]
    with pytest.raises(KeyError) as info:
        KV_TRANSFER_BACKENDS.get("ucx")
    assert info.value.args[0] == "unknown kv transfer backend 'ucx'; known: cuda_ipc, gloo, local, nccl"


def test_registry_loads_the_gloo_backend_class_lazily():
    backend = KV_TRANSFER_BACKENDS.get("gloo")
    assert backend.__name__ == "GlooBackend"
    assert backend.name == "gloo"
    assert issubclass(backend, KVTransferBackend)


def test_nccl_backend_raises_a_clear_error_without_cuda():
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.raises(RuntimeError, match="needs a CUDA device .* use the 'gloo' backend on CPU"):
        KV_TRANSFER_BACKENDS.get("nccl")()


# ------------------------------------------------------------------- channel pool
class FakeSender(KVSender):
    def __init__(self, address: ChannelAddress) -> None:
        self.address, self.sent, self.closed, self.broken = address, [], False, None

    def send(self, header, payload):
        self.sent.append(header.ticket_id)

    def poll(self):
        done = [TransferResult(t, TransferState.DONE, 1, 1.0) for t in self.sent]
        self.sent = []
        return done

    def state(self, ticket_id):
        return TransferState.PENDING

    @property
    def outstanding(self):
        return len(self.sent)

    @property
    def error(self):
        return self.broken

    def close(self):
        self.closed = True


class FakeBackend(KVTransferBackend):
    name = "fake"

    def __init__(self) -> None:
        super().__init__(TransferConfig(max_channels=2))
        self.connected: list[FakeSender] = []

    def open_receiver(self) -> KVReceiver:
        raise NotImplementedError

    def connect(self, address):
        self.connected.append(FakeSender(address))
        return self.connected[-1]


def addr(n: int) -> ChannelAddress:
    return ChannelAddress("127.0.0.1", 5000 + n, f"ch{n}")


def test_pool_connects_lazily_once_per_address():
    backend = FakeBackend()
    pool = ChannelPool(backend)
    assert pool.get(addr(1)) is pool.get(addr(1))
    assert [s.address for s in backend.connected] == [addr(1)]


def test_pool_closes_the_least_recently_used_idle_channel_to_make_room():
    backend = FakeBackend()
    pool = ChannelPool(backend)
    one, two = pool.get(addr(1)), pool.get(addr(2))
    pool.get(addr(1))  # 2 is now the least recently used
    pool.get(addr(3))
    assert (one.closed, two.closed) == (False, True)
    assert pool.addresses() == [addr(1), addr(3)]


def test_pool_with_lanes_keeps_that_many_channels_per_decode_worker_and_reports_each_close():
    backend, closed = FakeBackend(), []
    pool = ChannelPool(backend, lanes=2)
    pool.on_close = closed.append
    for n in (1, 2, 3, 4):  # max_channels 2 (FakeBackend's config) x 2 lanes
        pool.get(addr(n))
    assert (pool.max_channels, closed) == (4, [])
    pool.get(addr(5))
    assert (closed, pool.addresses()) == ([addr(1)], [addr(2), addr(3), addr(4), addr(5)])


def test_pool_full_of_busy_channels_returns_none_until_polled():
    backend = FakeBackend()
    pool = ChannelPool(backend)
    for n in (1, 2):
        pool.get(addr(n)).send(HEADER, None)
    assert pool.get(addr(3)) is None
    assert [r.ticket_id for r in pool.poll()] == [42, 42]
    assert pool.get(addr(3)) is backend.connected[-1]
    assert pool.addresses() == [addr(2), addr(3)]


def test_pool_drops_a_broken_channel_once_its_results_are_polled():
    backend = FakeBackend()
    pool = ChannelPool(backend)
    sender = pool.get(addr(1))
    sender.send(HEADER, None)
    sender.broken = "peer died"
    assert pool.poll() == [TransferResult(42, TransferState.DONE, 1, 1.0)]
    assert sender.closed is True
    assert pool.addresses() == []


def test_importing_kv_transfer_and_its_base_loads_no_torch():
    import json
    import subprocess
    import sys
    from pathlib import Path

    code = ("import json, sys, kv_transfer, kv_transfer.base, kv_transfer.pool\n"
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('torch', 'cupy', 'grpc', 'redis', 'ray', 'httpx'))))\n")
    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", code], cwd=repo, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []
