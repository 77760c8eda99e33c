"""cuda_ipc backend: a prefill (P) and a decode (D) process on the same GPU move KV payloads
through a staging buffer that D allocates and shares by CUDA IPC: device-to-device copies,
no NCCL group, no host round trip of the data. Needs cupy (for the raw IPC calls) and CUDA;
constructing the backend without them raises RuntimeError.

Handshake (the gRPC control plane is unchanged; the IPC handle travels as raw bytes, never
pickled — torch's own CUDA-tensor sharing would pickle):

    D  open_channel(): cudaMalloc(staging_bytes), cudaIpcGetMemHandle -> 64 raw bytes; put
       under the channel's prefix of the TCPStore that D hosts (wire.py):
         "ipc/handle" = the 64 bytes, "ipc/meta" = b"<pid> <pointer> <staging_bytes>"
       and answer OpenChannel with (store_host, store_port, channel_id), as gloo/nccl do.
       (A proto field `bytes ipc_handle` in OpenChannelResponse could carry the handle
       instead and save P one store read; the store keeps the proto and ChannelAddress as
       they are.)
    P  connect(address): its thread reads handle and meta, cudaIpcOpenMemHandle (or, in D's
       own process, uses the pointer: CUDA refuses to open a handle in its exporter), then
       rings ring/0 = "hello".

Per transfer, P cuts the payload into pieces of at most staging_bytes; per piece n:

    P                                         D (channel thread)
    wait for the payload's producer (event)
    copy piece -> staging; sync its stream
    set ring/n = "xfer" + header + offset,    wait ring/n; offset 0 allocates the payload
                 nbytes (int64, little-endian)  copy staging -> payload[offset:]; sync
    wait ack/n (deadline timeout_s)           set ack/n = "ok" (or "fail <why>", and stop)
    ... last piece acked: DONE                last piece copied: ReceivedKV into the inbox

Either side may ring "close". An error or a missed deadline breaks the channel for good (as
with gloo): every later send FAILS and P asks D for a new channel.

Who frees the staging buffer: P may write into it whenever it has a transfer, so D frees it
only after P said it is done: P unmaps it, then rings "close". A channel that ends any other
way (close_channel, a deadline, an error, P never joining) retires its buffer, and the
receiver frees retired buffers in close() — CUDA calls freeing memory that another process
still maps undefined, so a P still alive then must not send again.
"""

from __future__ import annotations

import logging
import os
import queue
import struct
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed import DistStoreError, PrefixStore

from engine.thread_priority import start_at_process_priority
from kv_transfer import wire
from kv_transfer.base import (
    HEADER_LEN,
    ChannelAddress,
    KVReceiver,
    KVSender,
    KVTransferBackend,
    LandedHook,
    ReceivedKV,
    TransferConfig,
    TransferHeader,
    TransferResult,
    TransferState,
)
from kv_transfer.packing import check_payload, empty_payload

log = logging.getLogger(__name__)

DEFAULT_STAGING_BYTES = 64 << 20
XFER = b"xfer"
OK = b"ok"
STOP = b"stop"  # D waking its own channel thread; unlike P's "close", it frees nothing
_PIECE = struct.Struct(f"<{HEADER_LEN + 2}q")  # header ints, offset, nbytes
_DEVICE_TO_DEVICE = 3  # cudaMemcpyDeviceToDevice


def _cupy() -> Any:
    try:
        import cupy
    except ImportError as e:
        raise RuntimeError("the cuda_ipc kv transfer backend needs cupy and a CUDA device; "
                           "use the 'gloo' backend on CPU") from e
    return cupy


def _use_device(device: torch.device) -> None:
    """Make `device` current on this thread for torch and cupy alike."""
    torch.cuda.set_device(device)
    _cupy().cuda.runtime.setDevice(device.index)


def _copy(dst: int, src: int, nbytes: int, stream: torch.cuda.Stream) -> None:
    """Device-to-device copy of nbytes; returns once it is done."""
    if nbytes:
        _cupy().cuda.runtime.memcpyAsync(dst, src, nbytes, _DEVICE_TO_DEVICE, stream.cuda_stream)
    stream.synchronize()


def _wait_key(store: Any, key: str, timeout_s: float) -> bytes:
    """Block until `key` is set (at most timeout_s, else the store raises), consume it."""
    store.wait([key], wire.seconds(max(timeout_s, 1e-3)))
    value = store.get(key)
    store.delete_key(key)
    return value


class CudaIpcBackend(KVTransferBackend):
    name = "cuda_ipc"
    on_engine_device = True

    def __init__(self, config: TransferConfig = TransferConfig(device="cuda:0"),
                 staging_bytes: int = DEFAULT_STAGING_BYTES) -> None:
        """staging_bytes: the buffer D allocates per channel; larger payloads go in pieces."""
        if not torch.cuda.is_available():
            raise RuntimeError("the cuda_ipc kv transfer backend needs a CUDA device (torch "
                               "sees none); use the 'gloo' backend on CPU")
        _cupy()
        if torch.device(config.device).type != "cuda":
            raise ValueError(f"the cuda_ipc backend works on a CUDA device, got "
                             f"{config.device!r}")
        if staging_bytes <= 0:
            raise ValueError(f"staging_bytes must be positive, got {staging_bytes}")
        super().__init__(config)
        self.device = torch.device(config.device)
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.staging_bytes = staging_bytes

    def open_receiver(self) -> CudaIpcReceiver:
        """Hosts a TCPStore on a free port of config.host (D side)."""
        return CudaIpcReceiver(self)

    def connect(self, address: ChannelAddress) -> CudaIpcSender:
        return CudaIpcSender(self, address)


class CudaIpcReceiver(KVReceiver):
    def __init__(self, backend: CudaIpcBackend) -> None:
        self._backend = backend
        self._store = wire.host_store(backend.config.host, backend.config.connect_timeout_s)
        self._inbox: deque[ReceivedKV] = deque()  # appended by channel threads
        self._channels: dict[str, _RecvChannel] = {}
        self._retired: list[int] = []  # staging buffers a P may still map; appended by threads
        self._closed = False

    def open_channel(self) -> ChannelAddress:
        """Allocates the channel's staging buffer now (on the caller's thread)."""
        if self._closed:
            raise RuntimeError("receiver is closed")
        self._channels = {k: c for k, c in self._channels.items() if c.thread.is_alive()}
        address = ChannelAddress(self._backend.config.host, self._store.port, uuid.uuid4().hex)
        self._channels[address.channel_id] = _RecvChannel(self._backend, address, self._store,
                                                          self._inbox, self._retired, self._announce)
        return address

    def close_channel(self, address: ChannelAddress) -> None:
        channel = self._channels.pop(address.channel_id, None)
        if channel is not None:
            channel.stop()
            channel.join()

    def poll(self) -> list[ReceivedKV]:
        items = []
        while self._inbox:
            items.append(self._inbox.popleft())
        return items

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            channel.stop()
        for channel in channels:
            channel.join()
        cp = _cupy()
        with cp.cuda.Device(self._backend.device.index):
            while self._retired:
                cp.cuda.runtime.free(self._retired.pop())
        del self._store


@dataclass
class _Incoming:
    """The transfer D is in the middle of: its payload fills piece by piece."""

    header: TransferHeader
    payload: torch.Tensor | None  # None only in a _Refused for a transfer never started
    start: float
    received: int = 0


class _Refused(Exception):
    """A piece D cannot take: the channel ends, and `transfer` (when known) FAILS."""

    def __init__(self, why: str, transfer: _Incoming | None) -> None:
        super().__init__(why)
        self.why, self.transfer = why, transfer


class _RecvChannel:
    """One P's channel on D: the staging buffer, and the thread that copies out of it."""

    def __init__(self, backend: CudaIpcBackend, address: ChannelAddress, host_store: Any,
                 inbox: deque[ReceivedKV], retired: list[int],
                 announce: LandedHook) -> None:
        self._backend, self._config, self.address = backend, backend.config, address
        self._inbox, self._retired, self._announce = inbox, retired, announce
        self._host_store = PrefixStore(address.channel_id, host_store)
        cp = _cupy()
        with cp.cuda.Device(backend.device.index):
            self._staging = cp.cuda.runtime.malloc(backend.staging_bytes)
            handle = cp.cuda.runtime.ipcGetMemHandle(self._staging)
        self._host_store.set("ipc/handle", handle)
        self._host_store.set("ipc/meta", f"{os.getpid()} {self._staging} "
                                         f"{backend.staging_bytes}".encode())
        self._lock = threading.Lock()
        self._seq = 0  # the ring the thread waits on; guarded by _lock
        self._stopping = False
        self.thread = threading.Thread(target=self._run, daemon=True,
                                       name=f"kv-ipc-recv-{address.channel_id}")
        self.thread.start()

    def stop(self) -> None:
        """Wake the thread: ring "stop" on the sequence number it waits on."""
        with self._lock:
            self._stopping = True
            seq = self._seq
        try:
            self._host_store.set(wire.ring_key(seq), STOP)
        except Exception as e:  # noqa: BLE001 - the thread also checks _stopping
            log.debug("could not ring close on channel %s: %s", self.address.channel_id, e)

    def join(self) -> None:
        self.thread.join(self._config.timeout_s + 1.0)
        if self.thread.is_alive():
            log.warning("kv ipc channel %s thread still running", self.address.channel_id)

    def _run(self) -> None:
        a, c = self.address, self._config
        peer_done = False
        try:
            _use_device(self._backend.device)
            store = wire.channel_store(a.host, a.port, a.channel_id, c.connect_timeout_s)
            if wire.wait_ring(store, 0, wire.seconds(c.connect_timeout_s)) == wire.HELLO:
                peer_done = self._serve(store, torch.cuda.Stream(self._backend.device))
        except Exception as e:  # noqa: BLE001 - nobody joined, or the store went away
            log.warning("kv ipc channel %s ended: %s", a.channel_id, e)
        finally:
            if peer_done:  # P unmapped the buffer before ringing "close"
                cp = _cupy()
                with cp.cuda.Device(self._backend.device.index):
                    cp.cuda.runtime.free(self._staging)
            else:
                self._retired.append(self._staging)

    def _serve(self, store: Any, stream: torch.cuda.Stream) -> bool:
        """Take pieces until "close", stop() or an error (which fails the open transfer).
        True when P rang "close" between transfers."""
        incoming: _Incoming | None = None
        seq = self._next_seq()
        while seq is not None:
            waited = time.monotonic()
            if incoming is None:
                timeout = wire.IDLE_WAIT
            else:
                left = incoming.start + self._config.timeout_s - time.perf_counter()
                timeout = wire.seconds(max(left, 1e-3))
            try:
                ring = wire.wait_ring(store, seq, timeout)
            except Exception as e:  # noqa: BLE001 - a deadline or a long idle wait expired
                if (incoming is None and isinstance(e, DistStoreError)
                        and time.monotonic() - waited > 60.0):
                    continue  # idle for IDLE_WAIT: wait on the same ring again
                if incoming is not None:
                    self._fail(incoming.header, incoming.start, f"no piece in time: {e}")
                return False
            if not ring.startswith(XFER):
                if incoming is not None:
                    self._fail(incoming.header, incoming.start, "the sender closed mid-transfer")
                return incoming is None and ring == wire.CLOSE
            try:
                incoming = self._take_piece(ring[len(XFER):], incoming, stream)
            except _Refused as e:
                store.set(f"ack/{seq}", b"fail " + e.why.encode())
                if e.transfer is not None:
                    self._fail(e.transfer.header, e.transfer.start, e.why)
                return False
            store.set(f"ack/{seq}", OK)
            seq = self._next_seq()
        return False

    def _take_piece(self, body: bytes, incoming: _Incoming | None,
                    stream: torch.cuda.Stream) -> _Incoming | None:
        """Copy one piece out of staging. Returns the transfer still filling, or None once
        it is complete (and in the inbox). Raises _Refused when the piece does not follow
        or cannot be taken."""
        try:
            *ints, offset, nbytes = _PIECE.unpack(body)
            header = TransferHeader.from_ints(ints)
        except (struct.error, ValueError) as e:
            raise _Refused(f"bad piece message: {e}", incoming) from e
        try:
            if incoming is None and offset == 0:
                incoming = _Incoming(header, empty_payload(header, self._backend.device),
                                     time.perf_counter())
        except Exception as e:  # noqa: BLE001 - e.g. out of device memory
            raise _Refused(f"no payload memory: {e}", _Incoming(header, None, 0.0)) from e
        if (incoming is None or header != incoming.header or offset != incoming.received
                or not 0 <= nbytes <= self._backend.staging_bytes
                or offset + nbytes > header.payload_nbytes):
            raise _Refused(f"piece {offset}+{nbytes} of ticket {header.ticket_id} does not "
                           f"follow", incoming or _Incoming(header, None, 0.0))
        try:
            _copy(incoming.payload.data_ptr() + offset, self._staging, nbytes, stream)
        except Exception as e:  # noqa: BLE001 - a CUDA error
            raise _Refused(f"copying piece {offset}+{nbytes} failed: {e}", incoming) from e
        incoming.received += nbytes
        if incoming.received < header.payload_nbytes:
            return incoming
        result = TransferResult(header.ticket_id, TransferState.DONE, incoming.received,
                                time.perf_counter() - incoming.start)
        self._announce(header)
        self._inbox.append(ReceivedKV(header, incoming.payload, result))
        return None

    def _fail(self, header: TransferHeader, start: float, why: str) -> None:
        error = (f"receiving ticket {header.ticket_id} on ipc channel "
                 f"{self.address.channel_id} failed: {why}")
        self._inbox.append(ReceivedKV(header, None, TransferResult(
            header.ticket_id, TransferState.FAILED, 0, time.perf_counter() - start, error)))

    def _next_seq(self) -> int | None:
        """Advance to the next ring; None once stopping."""
        with self._lock:
            if self._stopping:
                return None
            self._seq += 1
            return self._seq


class CudaIpcSender(KVSender):
    """P's end: one thread maps D's staging buffer and moves queued payloads through it."""

    def __init__(self, backend: CudaIpcBackend, address: ChannelAddress) -> None:
        self._backend, self._config, self.address = backend, backend.config, address
        self._queue: queue.SimpleQueue[tuple[TransferHeader, torch.Tensor, Any] | None] = (
            queue.SimpleQueue())
        self._lock = threading.Lock()
        self._states: dict[int, TransferState] = {}  # guarded by _lock
        self._results: deque[TransferResult] = deque()
        self._error: str | None = None
        self._closing = False
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"kv-ipc-send-{address.channel_id}")
        start_at_process_priority(self._thread)  # made from the engine loop, which may run lower

    # ---------------------------------------------------------------- caller's thread
    def send(self, header: TransferHeader, payload: torch.Tensor) -> None:
        """As KVSender.send; payload must be on the backend's device. The copy waits for
        the work queued so far on the caller's current stream (which produced payload)."""
        if self._closing:
            raise RuntimeError(f"sender to {self._where()} is closed")
        check_payload(header, payload)
        if payload.device != self._backend.device:
            raise ValueError(f"the cuda_ipc backend sends tensors on {self._backend.device}, "
                             f"got one on {payload.device}")
        with self._lock:
            if header.ticket_id in self._states:
                raise ValueError(f"ticket {header.ticket_id} is already outstanding")
            self._states[header.ticket_id] = TransferState.PENDING
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(payload.device))
        self._queue.put((header, payload, ready))

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
            log.warning("kv ipc sender thread to %s still running after %.1fs",
                        self._where(), limit)

    # ---------------------------------------------------------------- channel thread
    def _run(self) -> None:
        store, staging, mapped, stream = None, 0, False, None
        try:
            _use_device(self._backend.device)
            a = self.address
            store = wire.channel_store(a.host, a.port, a.channel_id,
                                       self._config.connect_timeout_s)
            pid, pointer, staging_bytes = (int(x) for x in store.get("ipc/meta").split())
            if pid == os.getpid():  # D in this process: CUDA will not open its own handle
                staging = pointer
            else:
                staging = _cupy().cuda.runtime.ipcOpenMemHandle(store.get("ipc/handle"))
                mapped = True
            stream = torch.cuda.Stream(self._backend.device)
            store.set(wire.ring_key(0), wire.HELLO)
        except Exception as e:  # noqa: BLE001 - any failure to join breaks the channel
            self._break(f"could not join ipc channel {self._where()}: {e}")
        seq = 1
        while (item := self._queue.get()) is not None:
            header, payload, ready = item
            if self._closing or self._error is not None:
                self._finish(header, 0, 0.0, self._error or "sender closed before sending")
                continue
            assert store is not None and stream is not None, "channel works without a store"
            with self._lock:
                self._states[header.ticket_id] = TransferState.IN_FLIGHT
            seq = self._transfer(store, stream, staging, staging_bytes, seq, header, payload,
                                 ready)
        if mapped:  # before "close": D frees the buffer once it hears it
            _cupy().cuda.runtime.ipcCloseMemHandle(staging)
        if store is not None and self._error is None:
            try:
                store.set(wire.ring_key(seq), wire.CLOSE)
            except Exception as e:  # noqa: BLE001 - D may already be gone; closing anyway
                log.debug("could not ring close on %s: %s", self._where(), e)

    def _transfer(self, store: Any, stream: torch.cuda.Stream, staging: int,
                  staging_bytes: int, seq: int, header: TransferHeader, payload: torch.Tensor,
                  ready: Any) -> int:
        """Send one payload piece by piece; returns the next ring's sequence number."""
        start = time.perf_counter()
        total, offset = header.payload_nbytes, 0
        try:
            ready.synchronize()
            while True:  # a zero-byte payload still sends one (empty) piece
                nbytes = min(staging_bytes, total - offset)
                _copy(staging, payload.data_ptr() + offset, nbytes, stream)
                store.set(wire.ring_key(seq),
                          XFER + _PIECE.pack(*header.to_ints(), offset, nbytes))
                ack = _wait_key(store, f"ack/{seq}",
                                start + self._config.timeout_s - time.perf_counter())
                seq += 1
                if ack != OK:
                    raise RuntimeError(f"D refused the piece: {ack.decode(errors='replace')}")
                offset += nbytes
                if offset >= total:
                    break
        except Exception as e:  # noqa: BLE001 - CUDA, store and deadline errors all fail it
            error = (f"transfer of ticket {header.ticket_id} ({total} bytes) to "
                     f"{self._where()} failed after {time.perf_counter() - start:.2f}s: {e}")
            self._break(error)
            self._finish(header, 0, time.perf_counter() - start, error)
            return seq
        self._finish(header, total, time.perf_counter() - start, None)
        return seq

    def _finish(self, header: TransferHeader, nbytes: int, secs: float, error: str | None) -> None:
        state = TransferState.FAILED if error is not None else TransferState.DONE
        with self._lock:
            self._states[header.ticket_id] = state
            self._results.append(TransferResult(header.ticket_id, state, nbytes, secs, error))

    def _break(self, error: str) -> None:
        if self._error is None:
            self._error = error
            log.warning("kv ipc channel broken: %s", error)

    def _where(self) -> str:
        a = self.address
        return f"{a.host}:{a.port}/{a.channel_id}"
