"""ChannelPool: P's open channels, `lanes` per decode worker, at most `max_channels` x `lanes`.

A channel (a 2-rank process group) costs sockets, a thread, and with NCCL GPU memory, so P
keeps a bounded set: the least recently used idle channel is closed to make room, and a
broken one is dropped once its results have been polled. Whoever hands out addresses (the
prefill worker's ChannelOpenings) hears of each close through `on_close`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from kv_transfer.base import ChannelAddress, KVSender, KVTransferBackend, TransferResult


class ChannelPool:
    """Lazily connected senders keyed by address. Used from one thread (the worker's loop)."""

    def __init__(self, backend: KVTransferBackend, max_channels: int | None = None, lanes: int = 1) -> None:
        """max_channels: decode workers' worth of channels (the backend's config when None);
        lanes: channels per decode worker (a channel carries one transfer at a time)."""
        self._backend = backend
        self.lanes = lanes
        self.max_channels = (max_channels or backend.config.max_channels) * lanes
        self._senders: OrderedDict[ChannelAddress, KVSender] = OrderedDict()
        self.on_close: Callable[[ChannelAddress], None] | None = None
        """Called (on the pool's thread) with each channel the pool closes."""

    def get(self, address: ChannelAddress) -> KVSender | None:
        """The sender for `address`, connecting if needed (does not block on the network).

        Returns None when the pool is full of channels that still have outstanding
        transfers (scarcity: poll and retry). Marks the channel most recently used.
        """
        sender = self._senders.get(address)
        if sender is not None:  # a broken one stays until poll() drains it: sends FAIL
            self._senders.move_to_end(address)
            return sender
        if len(self._senders) >= self.max_channels and not self._evict_one():
            return None
        sender = self._backend.connect(address)
        self._senders[address] = sender
        return sender

    def poll(self) -> list[TransferResult]:
        """Results from every channel since the last poll; drops broken, drained channels."""
        results = [r for sender in self._senders.values() for r in sender.poll()]
        for address, sender in list(self._senders.items()):
            if sender.error is not None and sender.outstanding == 0:
                self._close(address)
        return results

    def addresses(self) -> list[ChannelAddress]:
        """Open channels, least recently used first."""
        return list(self._senders)

    def close(self) -> None:
        """Close every channel (each blocks at most about its timeout). Idempotent."""
        for address in list(self._senders):
            self._close(address)

    def _evict_one(self) -> bool:
        for address, sender in self._senders.items():  # least recently used first
            if sender.outstanding == 0:
                self._close(address)
                return True
        return False

    def _close(self, address: ChannelAddress) -> None:
        self._senders.pop(address).close()
        if self.on_close is not None:
            self.on_close(address)
