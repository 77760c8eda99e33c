"""In-process backend for same-process tests: a sender copies each payload straight into its
receiver's queue. One LocalBackend instance links the channels it opens and connects."""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from dataclasses import replace

import torch

from engine.openmp import one_openmp_thread_here
from engine.thread_priority import start_at_process_priority
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
from kv_transfer.layers import FeedCancelled, LayerFeed
from kv_transfer.packing import check_payload, empty_payload


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
        if item.payload is not None:
            self._announce(item.header)
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
    """Completes each send at once (DONE, or FAILED when the channel is gone); a layer feed
    on a thread of its own, as the network backends' channel thread would."""

    streams_layers = True

    def __init__(self, backend: LocalBackend, address: ChannelAddress) -> None:
        self._backend = backend
        self._address = address
        self._lock = threading.Lock()
        self._done: dict[int, TransferResult | None] = {}  # guarded by _lock; None: in flight
        self._error: str | None = None
        self._closed = False

    def send_layers(self, feed: LayerFeed) -> None:
        if self._closed:
            raise RuntimeError("sender is closed")
        ticket = feed.header.ticket_id
        with self._lock:
            if ticket in self._done:
                raise ValueError(f"ticket {ticket} is already outstanding")
            self._done[ticket] = None
        start_at_process_priority(  # called from the engine loop, which may run lower
            threading.Thread(target=self._gather, args=(feed,), name=f"kv-local-{ticket}", daemon=True))

    def _gather(self, feed: LayerFeed, timeout_s: float = 30.0) -> None:
        one_openmp_thread_here()  # engine.openmp: no second OpenMP pool beside the engine loop's
        header, start = feed.header, time.perf_counter()
        payload = empty_payload(header)
        try:
            for layer in range(header.num_layers if header.num_blocks else 0):
                payload[layer] = feed.get(layer, timeout_s)
            token, at_us = feed.trailer(timeout_s)
        except FeedCancelled as e:  # as the network backends: D hears of it, P's channel lives on
            result = TransferResult(header.ticket_id, TransferState.FAILED, 0, time.perf_counter() - start,
                                    f"ticket {header.ticket_id} cancelled: {e}")
            receiver = self._backend.channels.get(self._address)
            if receiver is not None:
                receiver.deliver(ReceivedKV(header, None, result))
            with self._lock:
                self._done[header.ticket_id] = result
            return
        self._deliver(replace(header, first_token_id=token, first_token_at_us=at_us), payload, start)

    def send(self, header: TransferHeader, payload: torch.Tensor) -> None:
        if self._closed:
            raise RuntimeError("sender is closed")
        check_payload(header, payload)
        with self._lock:
            if header.ticket_id in self._done:
                raise ValueError(f"ticket {header.ticket_id} is already outstanding")
        # the receiver owns its copy; the sender's stays the caller's
        self._deliver(header, payload.clone(), time.perf_counter())

    def _deliver(self, header: TransferHeader, payload: torch.Tensor, start: float) -> None:
        receiver = self._backend.channels.get(self._address)
        if receiver is None:
            self._error = f"no local channel {self._address.channel_id!r}"
        if self._error is not None:
            result = TransferResult(header.ticket_id, TransferState.FAILED, 0, 0.0, self._error)
        else:
            result = TransferResult(header.ticket_id, TransferState.DONE, header.payload_nbytes,
                                    time.perf_counter() - start)
            receiver.deliver(ReceivedKV(header, payload, result))
        with self._lock:
            self._done[header.ticket_id] = result

    def poll(self) -> list[TransferResult]:
        with self._lock:
            results = [r for r in self._done.values() if r is not None]
            for r in results:
                del self._done[r.ticket_id]
        return results

    def state(self, ticket_id: int) -> TransferState:
        with self._lock:
            result = self._done[ticket_id]
        return TransferState.IN_FLIGHT if result is None else result.state

    @property
    def outstanding(self) -> int:
        with self._lock:
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
