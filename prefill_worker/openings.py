"""The data channels a prefill worker has asked decode workers to open, by incarnation.

Opening a channel is an RPC to the decode worker plus a rendezvous, so concurrent requests
for the same decode worker share one opening; a failed opening (or a transfer that failed on
the channel) is forgotten, and the next request opens a new one.

Lanes: a channel carries one transfer at a time, so the requests of one prefill batch used to
queue on one channel: only the first streamed its layers during the forward pass, and the k-th
request's KV (and first token) reached the decode worker k transfers late (30-80 ms apart on
2 loaded cores). With `lanes` channels per decode worker, taken in turn by successive requests,
a batch's transfers stream side by side during the compute.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable

from kv_transfer.base import ChannelAddress

ChannelOpener = Callable[[str], Awaitable[ChannelAddress]]
"""Asks the decode worker at a gRPC address to open a data channel for us."""

CHANNEL_LANES = 4
"""Lanes a prefill worker opens to each decode worker over gloo (a channel costs two sockets
and a thread on each side); 1 over NCCL, where a group costs GPU memory."""

Key = tuple[str, str]
"""(decode worker's gRPC address, its incarnation)."""


class ChannelOpenings:
    """get() runs on the asyncio loop; `forget` and `forget_address` may be called from any
    thread (the engine loop calls them when a transfer fails or the pool closes a channel)."""

    def __init__(self, open_channel: ChannelOpener, lanes: int = 1) -> None:
        if lanes < 1:
            raise ValueError(f"lanes must be at least 1, got {lanes}")
        self._open_channel = open_channel
        self._lanes = lanes
        self._lock = threading.Lock()
        self._openings: dict[Key, list[asyncio.Future[ChannelAddress] | None]] = {}  # guarded
        self._turns: dict[Key, int] = {}  # the next lane per key; guarded

    async def get(self, decode_address: str, incarnation: str) -> ChannelAddress:
        """The address of the next lane's channel, opening it once for all concurrent callers.
        Cancelling one caller does not cancel the shared opening. Raises what the opener raised."""
        key = (decode_address, incarnation)
        with self._lock:
            lanes = self._openings.setdefault(key, [None] * self._lanes)
            turn = self._turns.get(key, 0)
            self._turns[key] = turn + 1
            opening = lanes[turn % self._lanes]
            if opening is None:
                opening = lanes[turn % self._lanes] = asyncio.ensure_future(self._open_channel(decode_address))
        try:
            return await asyncio.shield(opening)
        except Exception:
            self.forget(key, opening)
            raise

    def forget(self, key: Key, opening: asyncio.Future | None = None) -> None:
        """Drop the channels of `key` (only the lane that is still `opening`, when given)."""
        with self._lock:
            if opening is None:
                self._openings.pop(key, None)
                return
            lanes = self._openings.get(key, [])
            for i, lane in enumerate(lanes):
                if lane is opening:
                    lanes[i] = None

    def forget_address(self, address: ChannelAddress) -> None:
        """Drop the lane whose channel is `address` (the pool closed it): the next request on
        that lane opens a new one instead of joining a channel the decode worker has closed."""
        with self._lock:
            for lanes in self._openings.values():
                for i, lane in enumerate(lanes):
                    if lane is not None and lane.done() and not lane.cancelled() \
                            and lane.exception() is None and lane.result() == address:
                        lanes[i] = None
