"""KVImporter: writes arriving KV into the reserved blocks, off the engine step: layer by layer
on the receiving thread as the layers land, else (receivers that deliver whole payloads) on its
own thread.

Why: unpacking a payload (a copy of every layer's blocks) on the engine loop made each decode
step after an arrival pay for it, so other requests' inter-token latency rose with every prompt
that landed. A thread beside the loop still took the decode worker's core for the whole copy
at once (10-20 ms for a 2k-token prompt's 47 MB on one core), right when the payload was
complete. Written a layer at a time as P streams them, the same copy is spread over P's
forward pass, in pieces of ~0.4 ms. The loop only sees "KV complete" (an Arrival) and commits
(DecodeWorker._poll_transfers).

Who may write a ticket's blocks (the engine allocated them; only the loop frees them):

    expect(ticket, blocks)   loop, at reservation: a landing opens; the blocks may be written
    (receiving thread)       a layer of the ticket's payload is in (the receiver's layer hook):
                             under the landing's lock, if it is still open, write that layer
                             into the blocks (a failed or cancelled transfer may leave some
                             written: the ticket stays open, and a retry writes them all again)
    (receiving thread)       the ticket's payload is complete (the receiver's landed hook):
                             under the landing's lock, if it is still open, hand the first
                             token to the landing's early sink (if any: the stream gets it
                             now, not at the loop's next step boundary, nor after this thread
                             wakes)
    (import thread)          the payload is polled: under the landing's lock, if it is still
                             open, offer the first token to the sink if the hook did not,
                             unpack into the blocks (unless the layer hook wrote every layer)
                             and close it; then an Arrival goes to the loop (take())
    cancel(ticket)           loop, before it frees the blocks (abort, expiry, failure, drain):
                             closes the landing, waiting for a write in progress (one unpack at
                             most), so no write lands in a block once it is freed and reused

Priorities: a whole-payload unpack is bulk work, so the import thread runs at the engine
thread's nice (it shares the cores with the steps as the step threads share them with each
other); the first token and the per-layer writes go from the receiving thread, which stays at
the process's priority.

A failed transfer (no payload) leaves the landing open: the router retries the prefill with the
same ticket. A payload of the wrong size is reported and written nowhere.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine.openmp import one_openmp_thread_here
from engine.thread_priority import lower_thread_priority
from kv_transfer.base import KVReceiver, ReceivedKV, TransferHeader, TransferResult
from kv_transfer.packing import block_index, unpack_blocks, unpack_layer

logger = logging.getLogger(__name__)

WAIT_S = 0.05
"""Longest the thread sleeps in receiver.wait() between polls (bounds how long stop() takes;
an arrival wakes it at once on the gloo and local receivers)."""

Unpack = Callable[[torch.Tensor, Sequence[torch.Tensor], Sequence[int]], None]
EarlySink = Callable[[TransferHeader], bool]
"""Called once per payload with its header (first token id and sample time), before its unpack:
on the receiving thread when the receiver has a landed hook, else on the import thread. True
when it streamed the first token (the loop then must not stream it again). Must not block: it
only queues the token for the request's stream."""


@dataclass(frozen=True)
class Arrival:
    """One transfer's outcome, for the engine loop."""

    header: TransferHeader
    result: TransferResult
    """FAILED: the transfer broke (nothing written; the ticket stays open for a retry)."""
    error: str | None
    """Why a delivered payload was not imported (the request fails); None when it was."""
    arrived_at: float
    """Unix time the import finished (or the failure was seen) on this worker."""
    first_token_sent: bool = False
    """The landing's early sink already streamed the first token (before the unpack)."""


class _Landing:
    """Where one ticket's KV goes. `open` is read and written only under `lock`."""

    def __init__(self, block_ids: tuple[int, ...], early: EarlySink | None) -> None:
        self.block_ids = block_ids
        self.early = early
        self.lock = threading.Lock()
        self.open = True
        self.offered = False
        """The first token went to `early` (which may have declined it); under `lock`."""
        self.first_sent = False
        """`early` streamed the first token; under `lock`."""
        self.index: torch.Tensor | None = None
        """block_ids as an index tensor, made by the first layer written; under `lock`."""

    def offer_first_token(self, header: TransferHeader) -> None:
        """Under `lock`: give the first token to the early sink, once."""
        if not self.offered:
            self.offered = True
            self.first_sent = self.early is not None and self.early(header)


class KVImporter:
    """Polls a KVReceiver on its own thread and imports each payload into its ticket's blocks.

    expect/cancel/take are called by the engine loop thread; they never wait for the network,
    and cancel waits at most for one unpack already under way.
    """

    def __init__(self, receiver: KVReceiver, kv_caches: Sequence[torch.Tensor],
                 unpack: Unpack = unpack_blocks, nice: int = 0) -> None:
        """nice: steps below the process this thread runs at (the engine thread's)."""
        self._receiver = receiver
        self._nice = nice
        self._kv_caches = kv_caches
        self._unpack = unpack
        self._lock = threading.Lock()
        self._landings: dict[int, _Landing] = {}  # guarded by _lock
        self._arrivals: deque[Arrival] = deque()  # appended here, popped by the loop
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-import", daemon=True)
        receiver.on_landed(self._landed)
        receiver.on_layer(self._layer_in)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Bounded: the thread notices within WAIT_S plus the unpack it may be doing."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    @property
    def open_landings(self) -> int:
        with self._lock:
            return len(self._landings)

    # ------------------------------------------------------------ loop thread
    def expect(self, ticket_id: int, block_ids: Sequence[int], early: EarlySink | None = None) -> None:
        """The ticket's KV may be written into `block_ids` from now until cancel(); `early`
        gets the payload's header first (the first token streams before the unpack)."""
        with self._lock:
            self._landings[ticket_id] = _Landing(tuple(block_ids), early)

    def cancel(self, ticket_id: int) -> None:
        """Nothing is written into the ticket's blocks after this returns. Idempotent."""
        with self._lock:
            landing = self._landings.pop(ticket_id, None)
        if landing is not None:
            with landing.lock:  # waits for a write in progress
                landing.open = False

    def take(self) -> list[Arrival]:
        """Arrivals since the last call, each returned once, in order."""
        items = []
        while self._arrivals:
            items.append(self._arrivals.popleft())
        return items

    # ------------------------------------------------------- receiving thread
    def _landed(self, header: TransferHeader) -> None:
        """The receiver's landed hook: the first token goes now, before the import thread wakes
        (a payload of the wrong size is left to _import, which fails it)."""
        with self._lock:
            landing = self._landings.get(header.ticket_id)
        if landing is None or landing.early is None or header.num_blocks != len(landing.block_ids):
            return
        with landing.lock:
            if landing.open:
                landing.offer_first_token(header)

    def _layer_in(self, header: TransferHeader, layer: int, kv: torch.Tensor) -> bool:
        """The receiver's layer hook: write `layer` into the ticket's blocks now. False (the
        import thread unpacks the whole payload, or drops it) for an unknown or closed ticket
        or a payload of the wrong size."""
        with self._lock:
            landing = self._landings.get(header.ticket_id)
        if landing is None or header.num_blocks != len(landing.block_ids):
            return False
        with landing.lock:
            if not landing.open:
                return False
            if landing.index is None:
                landing.index = block_index(landing.block_ids, self._kv_caches)
            unpack_layer(kv, self._kv_caches[layer], landing.index)
        return True

    # ---------------------------------------------------------- import thread
    def _run(self) -> None:
        lower_thread_priority(self._nice)
        one_openmp_thread_here()  # unpacking must not start a second OpenMP pool (engine.openmp)
        while not self._stop.is_set():
            self._receiver.wait(WAIT_S)
            for received in self._receiver.poll():
                try:
                    arrival = self._import(received)
                except Exception as exc:  # this ticket fails; the thread and the others go on
                    logger.exception("importing the KV of ticket %d failed", received.header.ticket_id)
                    arrival = Arrival(received.header, received.result, f"importing its KV failed: {exc}",
                                      time.time())
                if arrival is not None:
                    self._arrivals.append(arrival)

    def _import(self, received: ReceivedKV) -> Arrival | None:
        header, payload = received.header, received.payload
        if payload is None:
            return Arrival(header, received.result, None, time.time())
        try:
            with self._lock:
                landing = self._landings.get(header.ticket_id)
            if landing is None:
                logger.warning("KV for unknown or expired ticket %d dropped", header.ticket_id)
                return None
            if header.num_blocks != len(landing.block_ids):
                return Arrival(header, received.result,
                               f"got {header.num_blocks} blocks, reserved {len(landing.block_ids)}", time.time())
            with landing.lock:
                if not landing.open:  # cancelled, or a second payload for a filled ticket
                    logger.warning("KV for closed ticket %d dropped", header.ticket_id)
                    return None
                landing.open = False
                landing.offer_first_token(header)  # a no-op when the landed hook gave it
                sent = landing.first_sent
                if received.layers_written < header.num_layers:  # else the layer hook wrote them all
                    self._unpack(payload, self._kv_caches, landing.block_ids)
            with self._lock:
                if self._landings.get(header.ticket_id) is landing:
                    del self._landings[header.ticket_id]
            return Arrival(header, received.result, None, time.time(), sent)
        finally:
            self._receiver.recycle(payload)  # copied into blocks (or dropped): D may reuse it
