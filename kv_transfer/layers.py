"""LayerFeed: one transfer's KV handed over layer by layer while the prefill still computes.

Why: sending a request's KV only after its whole prefill put the transfer's wire time after
the compute, on the request's critical path. With a feed, the engine thread puts layer i as
soon as the forward pass has stored it (runner step listener) and the sender's thread pushes it
while layers i+1.. are computed; the first token, known only after the last layer and the
sampler, follows in a trailer.

    engine thread                        sender thread (the channel's)
    LayerFeed(header)  -> send_layers    header on the wire
    put(0, kv) ... put(n-1, kv)          get(i): wait for layer i, send it (then drop it)
    finish(first_token_id, sampled_at)   trailer(): wait, send (ticket, COMPLETE, token, time)
    or cancel(reason) at any point       the layers not yet put go as zeros, trailer CANCELLED:
                                         the channel stays in step, D fails only this ticket

A sender whose sends may be posted from any thread (gloo) sets on_finish(post) once its last
layer's send is posted: finish() then runs post on the engine thread, so the trailer leaves as
the token is sampled, and the sender's thread only waits for it (posted()).

Thread-safe; every wait is bounded by the caller's timeout. Imports torch only for typing.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from kv_transfer.base import TransferHeader

if TYPE_CHECKING:
    import torch


class TrailerStatus(enum.IntEnum):
    """The second int of a transfer's trailer on the wire."""

    COMPLETE = 0
    CANCELLED = 1


TRAILER_LEN = 4  # (ticket_id, status, first_token_id, first_token_at_us) as int64


class FeedCancelled(Exception):
    """The producer cancelled the feed (the request ended) or stopped feeding in time."""


class LayerFeed:
    def __init__(self, header: TransferHeader) -> None:
        """header: as for a one-shot send; its first_token_id is a placeholder until finish()."""
        self.header = header
        self._cond = threading.Condition()
        self._layers: dict[int, torch.Tensor] = {}  # guarded by _cond; popped once sent
        self._first: tuple[int, int] | None = None  # (first_token_id, first_token_at_us)
        self._cancelled: str | None = None
        self._post: Callable[[tuple[int, int]], object] | None = None
        self._post_ran = False
        self._posted: object = None
        """What `_post` returned (or the exception it raised), once it ran."""

    # ------------------------------------------------------------- producer
    def put(self, layer: int, kv: torch.Tensor) -> None:
        """Layer `layer`'s blocks, [2, num_blocks, block_size, num_kv_heads, head_dim],
        contiguous and owned by the feed from now on. Ignored once cancelled."""
        if not 0 <= layer < self.header.num_layers:
            raise ValueError(f"layer {layer} out of range for {self.header.num_layers} layers")
        with self._cond:
            if self._cancelled is None:
                self._layers[layer] = kv
                self._cond.notify_all()

    def finish(self, first_token_id: int, first_token_at: float | None) -> None:
        """Every layer is in; the first token (unix time it was sampled, None: unknown).
        A no-op once cancelled."""
        at_us = round(first_token_at * 1e6) if first_token_at else 0
        with self._cond:
            if self._cancelled is None:
                self._first = (first_token_id, at_us)
                self._run_post()
                self._cond.notify_all()

    def _run_post(self) -> None:
        """Under `_cond`, finished: the consumer's post, once, if it set one."""
        if self._post is not None and not self._post_ran:
            self._post_ran = True
            try:
                self._posted = self._post(self._first)
            except Exception as exc:  # noqa: BLE001 - the consumer raises it on its own thread
                self._posted = exc

    def cancel(self, reason: str) -> None:
        """The request ended: nothing more will be put. Idempotent; a no-op after finish()."""
        with self._cond:
            if self._first is None and self._cancelled is None:
                self._cancelled = reason
                self._layers.clear()
                self._cond.notify_all()

    # ------------------------------------------------------------- consumer
    def ready(self, layer: int) -> bool:
        """Layer `layer` is in (or the feed is cancelled): get() would not wait. Never blocks."""
        with self._cond:
            return layer in self._layers or self._cancelled is not None

    def finished(self) -> bool:
        """The first token is in (or the feed is cancelled): trailer() would not wait."""
        with self._cond:
            return self._first is not None or self._cancelled is not None

    def get(self, layer: int, timeout_s: float) -> torch.Tensor:
        """Layer `layer`, once put (it leaves the feed). Raises FeedCancelled when cancelled
        or not put within timeout_s."""
        with self._cond:
            if not self._cond.wait_for(lambda: layer in self._layers or self._cancelled, timeout_s):
                self._cancelled = f"layer {layer} not computed within {timeout_s:g} s"
            if self._cancelled is not None:
                raise FeedCancelled(self._cancelled)
            return self._layers.pop(layer)

    def on_finish(self, post: Callable[[tuple[int, int]], object]) -> None:
        """Consumer: have finish() call post((first_token_id, first_token_at_us)) on the
        producer's thread, so the trailer leaves the moment the token exists instead of after
        the consumer's thread wakes (the engine thread holds the GIL through its next step's
        Python: that wake took 0.4 ms at the median and up to 3 ms here). Runs it now when the
        feed is finished already; never once cancelled. `post` must not block; posted() gives
        what it returned."""
        with self._cond:
            self._post = post
            if self._first is not None:
                self._run_post()

    def posted(self, timeout_s: float) -> object:
        """What on_finish's post returned, once finished. Raises FeedCancelled as trailer(),
        and what post raised."""
        self.trailer(timeout_s)
        with self._cond:
            if isinstance(self._posted, Exception):
                raise self._posted
            return self._posted

    def trailer(self, timeout_s: float) -> tuple[int, int]:
        """(first_token_id, first_token_at_us) once finished. Raises FeedCancelled as get()."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._first is not None or self._cancelled, timeout_s):
                self._cancelled = f"no first token within {timeout_s:g} s"
            if self._first is None:
                raise FeedCancelled(self._cancelled)
            return self._first

    @property
    def cancelled(self) -> str | None:
        with self._cond:
            return self._cancelled
