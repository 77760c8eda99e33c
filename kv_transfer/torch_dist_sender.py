"""P's end of one torch.distributed channel.

Lifecycle: connect() starts the channel thread, which joins D's group (rank 0) and then
drains the queue, one transfer at a time: PENDING (queued) -> IN_FLIGHT (on the wire) ->
DONE (D acknowledged) | FAILED. The first wire failure breaks the channel for good (a timed-out
gloo operation poisons its group): later transfers FAIL at once with the same reason, and the
caller gets a fresh channel from D. A layer feed that its producer cancels FAILS only its own
transfer: the missing layers go as zeros under a CANCELLED trailer, so the channel stays in step.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from engine.thread_priority import start_at_process_priority
from kv_transfer.base import (
    ChannelAddress,
    KVSender,
    TransferHeader,
    TransferResult,
    TransferState,
)
from kv_transfer.layers import FeedCancelled, LayerFeed, TrailerStatus
from kv_transfer.packing import TORCH_DTYPES, check_payload
from kv_transfer import wire

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup, Store

    from kv_transfer.torch_dist import TorchDistBackend

log = logging.getLogger(__name__)


class TorchDistSender(KVSender):
    def __init__(self, backend: TorchDistBackend, address: ChannelAddress) -> None:
        self._backend = backend
        self._config = backend.config
        self.address = address
        self._queue: queue.SimpleQueue[tuple[TransferHeader, torch.Tensor | LayerFeed] | None] = (
            queue.SimpleQueue())
        self._lock = threading.Lock()
        self._states: dict[int, TransferState] = {}  # guarded by _lock
        self._results: deque[TransferResult] = deque()
        self._error: str | None = None
        self._closing = False
        self._thread = threading.Thread(
            target=self._run, name=f"kv-send-{address.channel_id}", daemon=True)
        # P makes its senders from the engine loop, which runs at a lower priority; the sends
        # (and the process group's own threads this one starts) must not queue behind the step.
        start_at_process_priority(self._thread)

    # ---------------------------------------------------------------- caller's thread
    def send(self, header: TransferHeader, payload: torch.Tensor) -> None:
        if self._closing:
            raise RuntimeError(f"sender to {self._where()} is closed")
        check_payload(header, payload)
        self._backend.wire_device(payload.device)  # raises where this backend cannot send it
        self._enqueue(header, payload)

    streams_layers = True

    def send_layers(self, feed: LayerFeed) -> None:
        if self._closing:
            raise RuntimeError(f"sender to {self._where()} is closed")
        self._enqueue(feed.header, feed)

    def _enqueue(self, header: TransferHeader, source: torch.Tensor | LayerFeed) -> None:
        with self._lock:
            if header.ticket_id in self._states:
                raise ValueError(f"ticket {header.ticket_id} is already outstanding")
            self._states[header.ticket_id] = TransferState.PENDING
        self._queue.put((header, source))

    def poll(self) -> list[TransferResult]:
        with self._lock:
            results = list(self._results)
            self._results.clear()
            for result in results:
                del self._states[result.ticket_id]
        return results

    def state(self, ticket_id: int) -> TransferState:
        with self._lock:
            return self._states[ticket_id]

    @property
    def outstanding(self) -> int:
        with self._lock:
            return len(self._states)

    @property
    def error(self) -> str | None:
        return self._error

    def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        self._queue.put(None)
        limit = self._config.connect_timeout_s + self._config.timeout_s + 1.0
        self._thread.join(limit)
        if self._thread.is_alive():
            log.warning("kv sender thread to %s still running after %.1fs", self._where(), limit)

    # ---------------------------------------------------------------- channel thread
    def _run(self) -> None:
        store = group = None
        try:
            self._backend.prepare_thread()
            store = wire.channel_store(self.address.host, self.address.port,
                                       self.address.channel_id, self._config.connect_timeout_s)
            c, channel_id = self._config, self.address.channel_id
            nonce = wire.prove(store, c.secret, channel_id, c.connect_timeout_s)
            group = self._backend.make_group(store, wire.RANK_P)
            wire.exchange_group_proofs(group, c.secret, channel_id, nonce, wire.RANK_P,
                                       c.device, c.timeout_s)
            store.set_timeout(wire.seconds(self._config.timeout_s))
        except Exception as e:  # noqa: BLE001 - any failure to join breaks the channel
            self._break(f"could not join channel {self._where()}: {e}")
        seq = 1
        while (item := self._queue.get()) is not None:
            header, payload = item
            if self._closing or self._error is not None:
                self._finish(header, 0, 0.0, self._error or "sender closed before sending")
                continue
            assert store is not None and group is not None, "channel works without a group"
            with self._lock:
                self._states[header.ticket_id] = TransferState.IN_FLIGHT
            self._transfer(store, group, seq, header, payload)
            seq += 1
        if store is not None and self._error is None:
            try:
                store.set(wire.ring_key(seq), wire.CLOSE)
            except Exception as e:  # noqa: BLE001 - D may already be gone; closing anyway
                log.debug("could not ring close on %s: %s", self._where(), e)
        del group  # drops the sockets: a peer still in an operation fails at once

    def _transfer(self, store: Store, group: ProcessGroup, seq: int, header: TransferHeader,
                  source: torch.Tensor | LayerFeed) -> None:
        """Budgets: timeout_s for the header; a feed's layers and first token each within
        timeout_s / 2 of the one before (the prefill computes meanwhile: a step may take longer
        than timeout_s in all, a layer never should; D's recvs are bounded per layer alike);
        then timeout_s for the rest of the wire once every byte exists."""
        started = wire.Deadline(self._config.timeout_s)
        nbytes = header.payload_nbytes
        device = self._backend.wire_device(
            source.device if isinstance(source, torch.Tensor) else torch.device(self._config.device))
        cancelled, idle = None, _Idle(self._config.timeout_s)
        try:
            store.set(wire.ring_key(seq), wire.XFER)
            started.wait(group.send(
                [wire.header_tensor(header.to_ints(), device)], wire.RANK_D,
                wire.TAG_HEADER))
            posted, cancelled = self._post_layers(group, header, source, device, idle) if nbytes else ([], None)
            # Every layer's send is posted: on a host wire, finish() posts the trailer from the
            # engine thread as the token is sampled (FIFO per tag keeps it after this ticket's
            # layers on D). A device wire's sends stay on this thread (its streams).
            streamed = isinstance(source, LayerFeed) and cancelled is None
            early = streamed and device.type == "cpu"
            if early:
                source.on_finish(lambda first: _send_trailer(
                    group, (header.ticket_id, TrailerStatus.COMPLETE, *first), device))
            if streamed and not source.finished():
                idle.drain(posted)
                with idle.waiting():
                    trailer = _trailer(header, source, cancelled, self._config.timeout_s / 2)
            else:
                trailer = _trailer(header, source, cancelled, self._config.timeout_s / 2)
            if early and trailer[1] == TrailerStatus.COMPLETE:
                trailer_sent = source.posted(0.0)  # finished: it ran (or raises what it raised)
            else:
                trailer_sent = _send_trailer(group, trailer, device)
            rest = wire.Deadline(self._config.timeout_s)
            for work, _ in posted[idle.drained:]:  # a gloo send is waited once: a second wait hangs
                rest.wait(work)
            rest.wait(trailer_sent[0])
            ack = torch.empty(2, dtype=torch.int64, device=device)
            rest.wait(group.recv([ack], wire.RANK_D, wire.TAG_ACK))
            if tuple(ack.tolist()) != (header.ticket_id, nbytes):
                raise RuntimeError(f"D acknowledged {tuple(ack.tolist())}, expected "
                                   f"{(header.ticket_id, nbytes)}")
        except Exception as e:  # noqa: BLE001 - gloo/nccl/store errors all fail the transfer
            error = (f"transfer of ticket {header.ticket_id} ({nbytes} bytes) to "
                     f"{self._where()} failed after {started.elapsed():.2f}s: {e}")
            self._break(error)
            self._finish(header, 0, started.elapsed(), error)
            return
        if cancelled is not None:  # only this transfer fails; the channel is in step
            self._finish(header, 0, started.elapsed(), f"ticket {header.ticket_id} cancelled: {cancelled}")
            return
        took = started.elapsed()
        self._finish(header, nbytes, took, None, max(took - idle.seconds, 0.0))

    def _post_layers(self, group: ProcessGroup, header: TransferHeader, source: torch.Tensor | LayerFeed,
                     device: torch.device, idle: _Idle) -> tuple[list, str | None]:
        """Post every layer's send in turn, each as soon as it exists (sends overlap each other
        and the wait for the next layer). Returns the posted (work, tensor) pairs (the tensor
        must live until its send completes) and None, or why the feed was cancelled (the
        layers it lacks then go as zeros). A layer not computed yet: the sends posted finish
        first (wire time), then the wait for the layer counts as idle."""
        cancelled, posted = None, []
        for layer in range(header.num_layers):
            if isinstance(source, torch.Tensor):
                kv = source[layer]  # a contiguous view
            elif cancelled is None:
                if not source.ready(layer):
                    idle.drain(posted)
                try:
                    with idle.waiting():
                        kv = source.get(layer, self._config.timeout_s / 2)
                except FeedCancelled as e:
                    cancelled = str(e)
            if cancelled is not None:
                kv = torch.zeros(header.payload_shape[1:], dtype=TORCH_DTYPES[header.dtype], device=device)
            kv = kv.to(device)  # a copy only where the wire is elsewhere (gloo from a GPU)
            posted.append((group.send([kv], wire.RANK_D, wire.TAG_PAYLOAD), kv))
        return posted, cancelled

    def _finish(self, header: TransferHeader, nbytes: int, secs: float, error: str | None,
                wire_s: float | None = None) -> None:
        state = TransferState.FAILED if error is not None else TransferState.DONE
        with self._lock:
            self._states[header.ticket_id] = state
            self._results.append(TransferResult(header.ticket_id, state, nbytes, secs, error, wire_s))

    def _break(self, error: str) -> None:
        if self._error is None:
            self._error = error
            log.warning("kv channel broken: %s", error)

    def _where(self) -> str:
        a = self.address
        return f"{a.host}:{a.port}/{a.channel_id}"


class _Idle:
    """The seconds one transfer's sender spent waiting for the producer (the prefill's compute)
    with nothing of this transfer on the wire: what `seconds` less this leaves is wire time."""

    def __init__(self, timeout_s: float) -> None:
        self.seconds = 0.0
        self.drained = 0
        """posted[:drained] were waited for (gloo counts completions: never wait one twice)."""
        self._timeout_s = timeout_s

    def drain(self, posted: list) -> None:
        """Let every posted send finish (the wire's time, not idle). Bounded like the rest of
        the wire: timeout_s for all of them; raises RuntimeError past it."""
        budget = wire.Deadline(self._timeout_s)
        for work, _ in posted[self.drained:]:
            budget.wait(work)
        self.drained = len(posted)

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        began = time.perf_counter()
        try:
            yield
        finally:
            self.seconds += time.perf_counter() - began


def _send_trailer(group: ProcessGroup, trailer: tuple[int, ...], device: torch.device) -> tuple:
    """Posts `trailer`'s send; (work, tensor): the tensor must live until the send completes."""
    tensor = wire.header_tensor(trailer, device)
    return group.send([tensor], wire.RANK_D, wire.TAG_TRAILER), tensor


def _trailer(header: TransferHeader, source: torch.Tensor | LayerFeed, cancelled: str | None,
             wait_s: float) -> tuple[int, ...]:
    """(ticket_id, status, first_token_id, first_token_at_us): a feed's first token comes last."""
    if cancelled is None and isinstance(source, LayerFeed):
        try:
            token, at_us = source.trailer(wait_s)
            return (header.ticket_id, TrailerStatus.COMPLETE, token, at_us)
        except FeedCancelled as e:
            cancelled = str(e)
    if cancelled is not None:
        return (header.ticket_id, TrailerStatus.CANCELLED, 0, 0)
    return (header.ticket_id, TrailerStatus.COMPLETE, header.first_token_id, header.first_token_at_us)

