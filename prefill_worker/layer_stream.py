"""LayerStreams: the prefill worker's KV sent layer by layer while its last chunk computes.

Why: the one-shot path packs and sends a request's KV after its whole prefill, so the transfer's
wire time adds to the request's time to first token. Here, when a request's last prompt chunk
is in a step, a LayerFeed (kv_transfer/layers.py) is opened on its channel before the forward
pass; after each layer the engine's step listener copies that layer's blocks into the feed, and
the channel's thread sends them while the next layers compute. The first token finishes the feed.

Per request (engine loop thread only):
    want()            queued with a channel that can stream layers
    before_forward()  its last chunk is scheduled: the feed opens (header on the wire)
    (each layer)      the layer's blocks are copied into the feed
    take()            first token sampled: the worker finishes the feed and releases the blocks
    drop()            the request ended first: the feed is cancelled (D fails only that ticket,
                      keeps its reservation for a retry)
Where a stream cannot open (no channel yet, a backend that sends whole payloads, block counts
that disagree) the worker's one-shot path runs as before.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from engine.core import EngineCore
from engine.runner import LayerDone
from engine.scheduler import ScheduledRequest, SchedulerOutput
from kv_transfer.base import ChannelAddress, TransferHeader
from kv_transfer.layers import LayerFeed
from kv_transfer.packing import block_index, dtype_code, pack_layer
from kv_transfer.pool import ChannelPool
from prefill_worker.states import DecodeTarget

logger = logging.getLogger(__name__)


class LayerStreams:
    def __init__(self, core: EngineCore, channels: ChannelPool) -> None:
        self._core = core
        self._channels = channels
        self._wanted: dict[str, tuple[ChannelAddress, DecodeTarget]] = {}
        self._feeds: dict[str, tuple[LayerFeed, tuple[int, ...]]] = {}
        """Open feeds by request id, with the blocks they carry."""

    def want(self, request_id: str, address: ChannelAddress, target: DecodeTarget) -> None:
        self._wanted[request_id] = (address, target)

    def before_forward(self, plan: SchedulerOutput) -> LayerDone | None:
        """The runner's step listener: open a feed for each wanted request whose last chunk
        is in `plan`; the returned callable copies layer i of each into its feed."""
        opened: list[tuple[LayerFeed, torch.Tensor]] = []
        for work in plan.scheduled:
            wanted = self._wanted.pop(work.request_id, None) if work.sample else None
            if wanted is not None:
                feed = self._open(work, *wanted)
                if feed is not None:
                    opened.append(feed)
        if not opened:
            return None
        caches = self._core.kv_caches

        def layer_done(layer: int) -> None:
            for feed, index in opened:
                try:
                    feed.put(layer, pack_layer(caches[layer], index))
                except Exception as exc:  # this request's stream only; the step goes on
                    logger.exception("copying layer %d into ticket %d's feed failed", layer, feed.header.ticket_id)
                    feed.cancel(f"copying layer {layer} failed: {exc}")

        return layer_done

    def take(self, request_id: str, held_block_ids: Sequence[int]) -> LayerFeed | None:
        """The request's open feed, if it carries exactly these blocks (else it is cancelled
        and None: the one-shot path sends them)."""
        self._wanted.pop(request_id, None)
        feed, blocks = self._feeds.pop(request_id, (None, ()))
        if feed is not None and tuple(held_block_ids) != blocks:
            feed.cancel(f"blocks changed while streaming: {blocks} then {tuple(held_block_ids)}")
            return None
        return feed

    def drop(self, request_id: str, reason: str) -> None:
        """The request ended: cancel its feed, if any. Idempotent."""
        self._wanted.pop(request_id, None)
        feed, _ = self._feeds.pop(request_id, (None, ()))
        if feed is not None:
            feed.cancel(reason)

    def drop_all(self, reason: str) -> None:
        for request_id in list(self._feeds):
            self.drop(request_id, reason)
        self._wanted.clear()

    def _open(self, work: ScheduledRequest, address: ChannelAddress,
              target: DecodeTarget) -> tuple[LayerFeed, torch.Tensor] | None:
        sender = self._channels.get(address)
        block_size = self._core.config.block_size
        blocks = tuple(work.block_ids[target.num_cached_tokens // block_size:])
        if sender is None or not sender.streams_layers or not blocks or len(blocks) != target.num_blocks:
            return None
        caches = self._core.kv_caches
        _, _, _, heads, head_dim = caches[0].shape
        feed = LayerFeed(TransferHeader(target.ticket_id, 0, len(caches), len(blocks), block_size, heads,
                                        head_dim, dtype_code(caches[0].dtype)))
        try:
            sender.send_layers(feed)
        except (ValueError, RuntimeError) as exc:  # closed, or the ticket is still outstanding
            logger.debug("ticket %d goes one-shot: %s", target.ticket_id, exc)
            return None
        self._feeds[work.request_id] = (feed, blocks)
        return feed, block_index(blocks, caches)
