"""In-process backend for same-process tests: a sender copies each payload straight into its
receiver's queue. One LocalBackend instance links the channels it opens and connects."""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque

import torch

from kv_transfer.base import (
    ChannelAddress,
    KVReceiver,
    KVSender,
    KVTransferBackend,
    ReceivedKV,
    TransferConfig,
    TransferHeader,
    TransferResult,
    TransferState,
)
from kv_transfer.packing import check_payload


class LocalReceiver(KVReceiver):
    def __init__(self, backend: LocalBackend) -> None:
        self._backend = backend
        self._inbox: deque[ReceivedKV] = deque()
        self._arrived = threading.Event()
        self._closed = False

    def open_channel(self) -> ChannelAddress:
        if self._closed:
            raise RuntimeError("receiver is closed")
        address = ChannelAddress("local", 0, f"local-{next(self._backend.ids)}")
        self._backend.channels[address] = self
        return address

    def close_channel(self, address: ChannelAddress) -> None:
        if self._backend.channels.get(address) is self:
            del self._backend.channels[address]

    def deliver(self, item: ReceivedKV) -> None:
        self._inbox.append(item)
        self._arrived.set()

    def poll(self) -> list[ReceivedKV]:
        self._arrived.clear()  # before draining: a delivery after this sets it again
        items = []
        while self._inbox:  # popleft: a sender on another thread may append meanwhile
            items.append(self._inbox.popleft())
        return items

    def wait(self, timeout_s: float) -> None:
        self._arrived.wait(timeout_s)

    def close(self) -> None:
        for address in [a for a, r in self._backend.channels.items() if r is self]:
            del self._backend.channels[address]
        self._closed = True
        self._arrived.set()


class LocalSender(KVSender):
    """Completes each send at once (DONE, or FAILED when the channel is gone)."""

    def __init__(self, backend: LocalBackend, address: ChannelAddress) -> None:
        self._backend = backend
        self._address = address
        self._done: dict[int, TransferResult] = {}
        self._error: str | None = None
        self._closed = False

    def send(self, header: TransferHeader, payload: torch.Tensor) -> None:
        if self._closed:
            raise RuntimeError("sender is closed")
        check_payload(header, payload)
        if header.ticket_id in self._done:
            raise ValueError(f"ticket {header.ticket_id} is already outstanding")
        receiver = self._backend.channels.get(self._address)
        if receiver is None:
            self._error = f"no local channel {self._address.channel_id!r}"
        if self._error is not None:
            self._done[header.ticket_id] = TransferResult(
                header.ticket_id, TransferState.FAILED, 0, 0.0, self._error)
            return
        start = time.perf_counter()
        copy = payload.clone()  # the receiver owns its copy; the sender's stays the caller's
        result = TransferResult(header.ticket_id, TransferState.DONE, header.payload_nbytes,
                                time.perf_counter() - start)
        receiver.deliver(ReceivedKV(header, copy, result))
        self._done[header.ticket_id] = result

    def poll(self) -> list[TransferResult]:
        results = list(self._done.values())
        self._done.clear()
        return results

    def state(self, ticket_id: int) -> TransferState:
        return self._done[ticket_id].state

    @property
    def outstanding(self) -> int:
        return len(self._done)

    @property
    def error(self) -> str | None:
        return self._error

    def close(self) -> None:
        self._closed = True


class LocalBackend(KVTransferBackend):
    name = "local"

    def __init__(self, config: TransferConfig = TransferConfig()) -> None:
        super().__init__(config)
        self.channels: dict[ChannelAddress, LocalReceiver] = {}
        self.ids = itertools.count(1)

    def open_receiver(self) -> LocalReceiver:
        return LocalReceiver(self)

    def connect(self, address: ChannelAddress) -> LocalSender:
        return LocalSender(self, address)
