"""The data channels a prefill worker has asked decode workers to open, by incarnation.

Opening a channel is an RPC to the decode worker plus a rendezvous, so concurrent requests
for the same decode worker share one opening; a failed opening (or a transfer that failed on
the channel) is forgotten, and the next request opens a new one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from kv_transfer.base import ChannelAddress

ChannelOpener = Callable[[str], Awaitable[ChannelAddress]]
"""Asks the decode worker at a gRPC address to open a data channel for us."""


class ChannelOpenings:
    """Used on the asyncio loop; `forget` may be called from any thread."""

    def __init__(self, open_channel: ChannelOpener) -> None:
        self._open_channel = open_channel
        self._openings: dict[tuple[str, str], asyncio.Future[ChannelAddress]] = {}

    async def get(self, decode_address: str, incarnation: str) -> ChannelAddress:
        """The channel's address, opening it once for all concurrent callers. Cancelling one
        caller does not cancel the shared opening. Raises what the opener raised."""
        key = (decode_address, incarnation)
        opening = self._openings.get(key)
        if opening is None:
            opening = self._openings[key] = asyncio.ensure_future(self._open_channel(decode_address))
        try:
            return await asyncio.shield(opening)
        except Exception:
            self.forget(key, opening)
            raise

    def forget(self, key: tuple[str, str], opening: asyncio.Future | None = None) -> None:
        """Drop the channel of `key` (only if it is still `opening`, when given)."""
        if opening is None or self._openings.get(key) is opening:
            self._openings.pop(key, None)
