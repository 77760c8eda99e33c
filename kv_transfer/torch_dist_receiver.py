"""D's end of the torch.distributed channels: a TCPStore rendezvous and one thread per channel.

Lifecycle of a channel: open_channel() (sets the channel's nonce) -> thread waits for P's hello
(connect_timeout_s) -> the hello proves the cluster secret, or the channel is dropped (logged)
-> both join the group -> per transfer: doorbell, header, payload (each layer to the layer hook
as it lands), trailer, ack -> a ReceivedKV lands in the inbox that poll() drains -> until either
side rings "close", or a wire error breaks it.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque
from dataclasses import replace
from typing import TYPE_CHECKING

import torch
from torch.distributed import DistStoreError, PrefixStore

from kv_transfer.base import (
    HEADER_LEN,
    ChannelAddress,
    KVReceiver,
    LandedHook,
    LayerHook,
    ReceivedKV,
    TransferHeader,
    TransferResult,
    TransferState,
)
from kv_transfer.layers import TRAILER_LEN, TrailerStatus
from kv_transfer.packing import empty_payload
from kv_transfer.recv_pool import RecvBufferPool
from kv_transfer import wire

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup, Store

    from kv_transfer.torch_dist import TorchDistBackend

log = logging.getLogger(__name__)


class TorchDistReceiver(KVReceiver):
    def __init__(self, backend: TorchDistBackend) -> None:
        self._backend = backend
        self._config = backend.config
        self._store = wire.host_store(self._config.host, self._config.connect_timeout_s)
        self.host, self.port = self._config.host, self._store.port
        self._inbox: deque[ReceivedKV] = deque()  # appended by channel threads
        self._arrived = threading.Event()  # set after each append; cleared by poll()
        # Shared by all channels; CPU only (a GPU's caching allocator already reuses memory).
        on_cpu = torch.device(self._config.device).type == "cpu"
        self._pool = RecvBufferPool(self._config.recv_buffer_pool_bytes if on_cpu else 0)
        self._channels: dict[str, _Channel] = {}
        self._closed = False

    def open_channel(self) -> ChannelAddress:
        if self._closed:
            raise RuntimeError("receiver is closed")
        self._channels = {k: c for k, c in self._channels.items() if c.thread.is_alive()}
        address = ChannelAddress(self.host, self.port, uuid.uuid4().hex)
        nonce = wire.new_nonce()
        # Set before the address leaves D, so P never waits for it.
        PrefixStore(address.channel_id, self._store).set(wire.NONCE_KEY, nonce)
        self._channels[address.channel_id] = _Channel(self._backend, address, nonce, self._inbox,
                                                      self._pool, self._arrived, self._announce,
                                                      self._layer_landed)
        return address

    def close_channel(self, address: ChannelAddress) -> None:
        channel = self._channels.pop(address.channel_id, None)
        if channel is not None:
            channel.stop(self._store)
            channel.join()

    def poll(self) -> list[ReceivedKV]:
        self._arrived.clear()  # before draining: an append after this sets it again
        items = []
        while self._inbox:
            items.append(self._inbox.popleft())
        return items

    def wait(self, timeout_s: float) -> None:
        self._arrived.wait(timeout_s)

    def recycle(self, payload: torch.Tensor) -> None:
        self._pool.put(payload)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._arrived.set()  # wake a waiter: there is nothing more to wait for
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            channel.stop(self._store)
        for channel in channels:
            channel.join()
        del self._store  # closes the listening socket


class _Channel:
    """One P's channel on D: its thread, and the doorbell sequence number it waits on."""

    def __init__(self, backend: TorchDistBackend, address: ChannelAddress, nonce: bytes,
                 inbox: deque[ReceivedKV], pool: RecvBufferPool, arrived: threading.Event,
                 announce: LandedHook, layer_landed: LayerHook) -> None:
        self._backend = backend
        self._config = backend.config
        self.address = address
        self._nonce = nonce
        self._inbox = inbox
        self._pool = pool
        self._arrived = arrived
        self._announce = announce
        self._layer_landed = layer_landed
        self._lock = threading.Lock()
        self._seq = 0  # the ring D waits on next; guarded by _lock
        self._stopping = False
        self.thread = threading.Thread(
            target=self._run, name=f"kv-recv-{address.channel_id}", daemon=True)
        self.thread.start()

    def stop(self, store: Store) -> None:
        """Wake the thread: ring "close" on the sequence number it waits on (or will)."""
        with self._lock:
            self._stopping = True
            seq = self._seq
        try:
            PrefixStore(self.address.channel_id, store).set(wire.ring_key(seq), wire.CLOSE)
        except Exception as e:  # noqa: BLE001 - the thread also checks _stopping
            log.debug("could not ring close on channel %s: %s", self.address.channel_id, e)

    def join(self) -> None:
        limit = self._config.timeout_s + 1.0
        self.thread.join(limit)
        if self.thread.is_alive():
            log.warning("kv channel %s thread still running after %.1fs",
                        self.address.channel_id, limit)

    def _run(self) -> None:
        a, c = self.address, self._config
        store, admitted = None, False
        try:
            self._backend.prepare_thread()
            store = wire.channel_store(a.host, a.port, a.channel_id, c.connect_timeout_s)
            admitted = self._admit(store, wire.wait_ring(store, 0, wire.seconds(c.connect_timeout_s)))
            group = self._backend.make_group(store, wire.RANK_D) if admitted else None
        except Exception as e:  # noqa: BLE001 - nobody joined, or joining failed
            log.warning("kv channel %s closed before a prefill worker joined: %s", a.channel_id, e)
            group = None
        finally:  # an admitted P read both before joining; a refused one still reads "refused"
            _forget(store, (wire.NONCE_KEY, wire.REPLY_KEY) if admitted else (wire.NONCE_KEY,))
        if group is None:
            return
        try:
            wire.exchange_group_proofs(group, c.secret, a.channel_id, self._nonce, wire.RANK_D,
                                       c.device, c.timeout_s)
        except Exception as e:  # noqa: BLE001 - a wrong or late proof: no KV from this peer
            log.warning("kv channel %s closed before a prefill worker joined: %s", a.channel_id, e)
            return
        seq = self._next_seq()
        while seq is not None:
            waited = time.monotonic()
            try:
                ring = wire.wait_ring(store, seq, wire.IDLE_WAIT)
            except Exception as e:  # noqa: BLE001 - a long idle wait expired, or the store is gone
                if isinstance(e, DistStoreError) and time.monotonic() - waited > 60.0:
                    continue  # idle for IDLE_WAIT: wait on the same ring again
                log.warning("kv channel %s lost its store: %s", a.channel_id, e)
                return
            if ring != wire.XFER or not self._receive_one(group):
                return  # closed, or broken: dropping the group tells P at once
            seq = self._next_seq()

    def _admit(self, store: Store, hello: bytes) -> bool:
        """Answer P's hello: D's proof when it proves the secret; else "refused", and False."""
        secret, a = self._config.secret, self.address
        assert secret is not None, "a torch.distributed channel without the cluster secret"
        if hello == wire.CLOSE:
            return False  # closed before anyone joined
        if not wire.hello_ok(secret, a.channel_id, self._nonce, hello):
            log.warning("kv channel %s refused a peer whose hello does not prove the cluster "
                        "secret; channel dropped", a.channel_id)
            store.set(wire.REPLY_KEY, wire.REFUSED)
            return False
        store.set(wire.REPLY_KEY, wire.proof(secret, a.channel_id, self._nonce, "D"))
        return True

    def _next_seq(self) -> int | None:
        """Advance to the next ring; None once stopping."""
        with self._lock:
            if self._stopping:
                return None
            self._seq += 1
            return self._seq

    def _receive_one(self, group: ProcessGroup) -> bool:
        """Receive one transfer into the inbox. False when the channel broke."""
        device = self._config.device
        deadline = wire.Deadline(self._config.timeout_s)
        ints = torch.empty(HEADER_LEN, dtype=torch.int64, device=device)
        try:
            deadline.wait(group.recv([ints], wire.RANK_P, wire.TAG_HEADER))
            header = TransferHeader.from_ints(ints.tolist())
        except Exception as e:  # noqa: BLE001 - no header: nothing to report per ticket
            log.warning("kv channel %s broken reading a header: %s", self.address.channel_id, e)
            return False
        if self._pool.budget_bytes:  # off on a GPU, or by config
            payload = self._pool.take(header)
        else:
            payload = empty_payload(header, device)
        trailer = torch.empty(TRAILER_LEN, dtype=torch.int64, device=device)
        written, complete = 0, False
        try:
            if header.payload_nbytes:
                # All posted at once (in order: gloo matches them to P's sends in order); each
                # layer lands as P computes it (layers.py), so each is bounded on its own:
                # within timeout_s of the one before. Each goes into the ticket's blocks as it
                # lands (the layer hook), spreading the unpack over P's forward pass instead
                # of one copy of the whole payload on D's cores after the trailer.
                posted = [group.recv([payload[layer]], wire.RANK_P, wire.TAG_PAYLOAD)
                          for layer in range(header.num_layers)]
                for layer, work in enumerate(posted):
                    wire.Deadline(self._config.timeout_s).wait(work)
                    written += self._layer_landed(header, layer, payload[layer])
            rest = wire.Deadline(self._config.timeout_s)  # trailer and ack (P bounds its own waits)
            rest.wait(group.recv([trailer], wire.RANK_P, wire.TAG_TRAILER))
            ticket, status, first_token_id, first_token_at_us = trailer.tolist()
            if ticket != header.ticket_id:
                raise RuntimeError(f"trailer names ticket {ticket}, header {header.ticket_id}")
            acked = group.send([wire.ack_tensor(header.ticket_id, header.payload_nbytes, device)],
                               wire.RANK_P, wire.TAG_ACK)
            if status == TrailerStatus.COMPLETE:
                header = replace(header, first_token_id=first_token_id, first_token_at_us=first_token_at_us)
                complete = True
                # On this thread and before the ack's send completes: the first token goes
                # one wire wait sooner, and before the importer wakes.
                self._announce(header)
            rest.wait(acked)
        except Exception as e:  # noqa: BLE001 - gloo/nccl errors fail this ticket
            if complete:  # only the ack failed: every byte is here and the first token may be out
                log.warning("kv channel %s: ticket %d arrived whole but its ack failed after %.2fs: %s",
                            self.address.channel_id, header.ticket_id, deadline.elapsed(), e)
                self._deliver(header, payload, deadline, written)
                return False
            error = (f"receiving ticket {header.ticket_id} on channel {self.address.channel_id} "
                     f"failed after {deadline.elapsed():.2f}s: {e}")
            result = TransferResult(header.ticket_id, TransferState.FAILED, 0,
                                    deadline.elapsed(), error)
            # payload is not pooled again: a timed-out recv may still write into it.
            self._inbox.append(ReceivedKV(header, None, result))
            self._arrived.set()
            return False
        if not complete:  # P's request ended mid-transfer: nothing to import
            self._pool.put(payload)
            result = TransferResult(header.ticket_id, TransferState.FAILED, 0, deadline.elapsed(),
                                    f"the prefill worker cancelled ticket {header.ticket_id} mid-transfer")
            self._inbox.append(ReceivedKV(header, None, result))
            self._arrived.set()
            return True
        self._deliver(header, payload, deadline, written)
        return True

    def _deliver(self, header: TransferHeader, payload: torch.Tensor, deadline: wire.Deadline,
                 written: int) -> None:
        """A whole payload (its first token in `header`, announced) into the inbox."""
        result = TransferResult(header.ticket_id, TransferState.DONE, header.payload_nbytes,
                                deadline.elapsed())
        self._inbox.append(ReceivedKV(header, payload, result, written))
        self._arrived.set()

def _forget(store: Store | None, keys: tuple[str, ...]) -> None:
    for key in keys if store is not None else ():
        try:
            store.delete_key(key)
        except Exception as e:  # noqa: BLE001 - the store may be gone already
            log.debug("could not delete %s: %s", key, e)
