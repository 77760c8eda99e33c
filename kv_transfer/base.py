"""KV transfer interface: a sender on the prefill worker (P), a receiver on the decode worker (D).

Lifecycle of one transfer (one request's KV blocks), seen from P:

    send(header, payload)   PENDING    queued on the channel; the sender owns `payload`
    (sender's own thread)   IN_FLIGHT  header, then payload, go over the wire; D acknowledges
    poll()                  DONE | FAILED  the result is returned once; `payload` is the
                                        caller's again and the ticket is forgotten

Seen from D, `poll()` returns a `ReceivedKV` once per transfer whose header arrived: with the
payload (DONE, now owned by the caller) or without it (FAILED, with the reason).

Both ends are non-blocking and polled; nothing here calls back into the engine. This module
is part of the pure core: it imports no torch (tensors appear in type hints only).
"""

from __future__ import annotations

import enum
import logging
import math
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.registry import Registry

if TYPE_CHECKING:
    import torch

    from kv_transfer.layers import LayerFeed


class TransferState(enum.Enum):
    PENDING = "pending"
    IN_FLIGHT = "in_flight"
    DONE = "done"
    FAILED = "failed"


TERMINAL_STATES = frozenset({TransferState.DONE, TransferState.FAILED})


class DTypeCode(enum.IntEnum):
    """Element type of a payload as it travels in the header (torch mapping: packing.py)."""

    FLOAT32 = 1
    BFLOAT16 = 2
    FLOAT16 = 3
    FLOAT8_E4M3FN = 4

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self]


_ITEMSIZE = {
    DTypeCode.FLOAT32: 4,
    DTypeCode.BFLOAT16: 2,
    DTypeCode.FLOAT16: 2,
    DTypeCode.FLOAT8_E4M3FN: 1,
}

HEADER_MAGIC = 0x4B565846  # "KVXF"
HEADER_VERSION = 2  # 2: first_token_at_us added (the first token's sample time)
HEADER_LEN = 11  # ints on the wire; both ends must agree (gloo aborts on a size mismatch)


@dataclass(frozen=True)
class TransferHeader:
    """What D needs to allocate and place one payload; travels as HEADER_LEN int64s."""

    ticket_id: int
    first_token_id: int
    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: DTypeCode
    first_token_at_us: int = 0
    """Unix time (microseconds, P's clock) the first token was sampled; 0 when unknown. D
    stamps the first token it streams with it, for token delivery delay (sample -> client)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", DTypeCode(self.dtype))  # ValueError if unknown
        if self.first_token_at_us < 0:
            raise ValueError(f"first_token_at_us must be >= 0, got {self.first_token_at_us}")
        for name in ("num_layers", "block_size", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {self.num_blocks}")

    @property
    def payload_shape(self) -> tuple[int, ...]:
        """[num_layers, 2 (K, V), num_blocks, block_size, num_kv_heads, head_dim]."""
        return (self.num_layers, 2, self.num_blocks, self.block_size, self.num_kv_heads,
                self.head_dim)

    @property
    def payload_nbytes(self) -> int:
        return math.prod(self.payload_shape) * self.dtype.itemsize

    def to_ints(self) -> tuple[int, ...]:
        """(magic, version, ticket_id, first_token_id, num_layers, num_blocks, block_size,
        num_kv_heads, head_dim, dtype, first_token_at_us); always HEADER_LEN long."""
        return (HEADER_MAGIC, HEADER_VERSION, self.ticket_id, self.first_token_id,
                self.num_layers, self.num_blocks, self.block_size, self.num_kv_heads,
                self.head_dim, int(self.dtype), self.first_token_at_us)

    @classmethod
    def from_ints(cls, ints: tuple[int, ...] | list[int]) -> TransferHeader:
        """Inverse of to_ints. Raises ValueError on a wrong length, magic, version or field."""
        if len(ints) != HEADER_LEN:
            raise ValueError(f"a transfer header has {HEADER_LEN} ints, got {len(ints)}")
        magic, version, *fields = (int(i) for i in ints)
        if magic != HEADER_MAGIC:
            raise ValueError(f"bad transfer header magic {magic:#x}, expected {HEADER_MAGIC:#x}")
        if version != HEADER_VERSION:
            raise ValueError(f"transfer header version {version}, expected {HEADER_VERSION}")
        return cls(*fields[:7], dtype=DTypeCode(fields[7]), first_token_at_us=fields[8])


@dataclass(frozen=True)
class TransferResult:
    """How one transfer ended, on either side. `seconds` is wall time on the reporting side."""

    ticket_id: int
    state: TransferState
    nbytes: int
    seconds: float
    """Doorbell to ack. For a layer-streamed transfer this includes the wait for the prefill
    to compute each layer and the first token: it is not the channel's speed."""
    error: str | None = None
    wire_seconds: float | None = None
    """The part of `seconds` the channel had this transfer's bytes to move: `seconds` less
    the time the sender waited, with every send it had posted done, for the prefill to
    compute the next layer or the first token. An upper bound on the wire's own time: it keeps
    the sender thread's waits for the GIL (which a busy engine thread holds) after each send.
    None: not measured (a receiver's result)."""

    def __post_init__(self) -> None:
        if self.state not in TERMINAL_STATES:
            raise ValueError(f"a result's state must be terminal, got {self.state}")
        if (self.state is TransferState.FAILED) != (self.error is not None):
            raise ValueError("error is set exactly when the state is FAILED")

    @property
    def gbps(self) -> float:
        """Payload gigabytes (1e9 bytes) per second; 0.0 when no time was measured."""
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    @property
    def wire_gbps(self) -> float:
        """Payload GB/s over wire_seconds (the channel's speed; `seconds` where not measured)."""
        took = self.wire_seconds if self.wire_seconds is not None else self.seconds
        return self.nbytes / took / 1e9 if took > 0 else 0.0


@dataclass(frozen=True)
class ReceivedKV:
    """One transfer as D sees it. payload is None exactly when result.state is FAILED."""

    header: TransferHeader
    payload: torch.Tensor | None
    result: TransferResult
    layers_written: int = 0
    """Layers the receiver's layer hook already wrote where they belong (KVReceiver.on_layer):
    all of them (header.num_layers) means the payload need not be unpacked again."""


@dataclass(frozen=True)
class ChannelAddress:
    """Where P joins a channel D opened (the TCPStore rendezvous D hosts)."""

    host: str
    port: int
    channel_id: str


@dataclass(frozen=True)
class TransferConfig:
    """Settings of one worker's transfer backend, frozen at start-up."""

    host: str = "127.0.0.1"
    """Address this worker's channel endpoints bind to (D's store, either side's sockets)."""
    timeout_s: float = 30.0
    """Limit on each wire operation (header, payload, ack); past it the transfer FAILS."""
    connect_timeout_s: float = 60.0
    """How long an opened channel waits for P to join, and P to reach D's store."""
    max_channels: int = 8
    """Most channels (process groups) a ChannelPool on P keeps open."""
    device: str = "cpu"
    """Where D allocates received payloads ("cpu" for gloo, "cuda:N" for nccl)."""
    recv_buffer_pool_bytes: int = 1 << 30
    """Most bytes of recycled payload memory D keeps idle for later transfers (CPU payloads
    only: on a GPU the caching allocator already reuses memory). 0 turns the pool off."""
    secret: bytes | None = field(default=None, repr=False)
    """The cluster secret: a prefill worker proves it before D lets it join a channel (wire.py).
    Required by the network backends (gloo, nccl); None only for the in-process `local` one."""

    def __post_init__(self) -> None:
        for name in ("timeout_s", "connect_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_channels <= 0:
            raise ValueError(f"max_channels must be positive, got {self.max_channels}")
        if self.secret is not None and not self.secret:
            raise ValueError("secret must be non-empty bytes, or None for the local backend")
        if self.recv_buffer_pool_bytes < 0:
            raise ValueError(
                f"recv_buffer_pool_bytes must be >= 0, got {self.recv_buffer_pool_bytes}")


class KVSender(ABC):
    """P's end of one channel to one D. Used from one thread (the worker's loop)."""

    @abstractmethod
    def send(self, header: TransferHeader, payload: torch.Tensor) -> None:
        """Queue `payload` (shape and dtype as the header says, contiguous) for D.

        Does not block on the network. Mutates only the sender's queue. The sender owns
        `payload` until poll() returns this ticket's result: the caller must not write it.
        Raises ValueError when payload and header disagree or the ticket is already
        outstanding, RuntimeError after close(). A broken channel is not an exception:
        the transfer comes back FAILED from poll().
        """

    streams_layers: bool = False
    """Whether send_layers works: the KV may go layer by layer while the prefill computes."""

    def send_layers(self, feed: LayerFeed) -> None:
        """Queue a transfer whose layers the caller puts into `feed` as they are computed,
        then finishes (or cancels) it. Does not block. The header's first_token_id is the
        feed's placeholder: D gets the real one from finish(). Raises as send(), and
        NotImplementedError where streams_layers is False. A cancelled feed comes back FAILED
        from poll() without breaking the channel."""
        raise NotImplementedError(f"{type(self).__name__} sends whole payloads only")

    @abstractmethod
    def poll(self) -> list[TransferResult]:
        """Results (DONE or FAILED) finished since the last poll, each returned once.

        Does not block. Forgets the returned tickets; their payloads are the caller's again.
        """

    @abstractmethod
    def state(self, ticket_id: int) -> TransferState:
        """State of an outstanding ticket. Raises KeyError once it has been polled."""

    @property
    @abstractmethod
    def outstanding(self) -> int:
        """Transfers sent whose result poll() has not returned yet."""

    @property
    @abstractmethod
    def error(self) -> str | None:
        """None while the channel works; why it broke once it did (every later send FAILS)."""

    @abstractmethod
    def close(self) -> None:
        """Stop the channel. Blocks a bounded time: an in-flight transfer may finish (at most
        timeout_s), a channel still forming may take up to connect_timeout_s.

        Queued transfers come back FAILED from later polls. Idempotent.
        """


LandedHook = Callable[["TransferHeader"], None]
"""Called with a payload's header (its first token filled in) on the thread that received it."""

LayerHook = Callable[["TransferHeader", int, "torch.Tensor"], bool]
"""Called with (header, layer, that layer's [2, blocks, block, heads, dim] KV) on the thread that
received it, as soon as the layer is in; True when it wrote the layer where it belongs."""


class KVReceiver(ABC):
    """D's end: hosts channels that prefill workers join. Used from one thread (on_landed's
    hook excepted: the receiving threads call it)."""

    _landed: LandedHook | None = None
    _layer: LayerHook | None = None

    def on_landed(self, hook: LandedHook | None) -> None:
        """Call `hook(header)` on the receiving thread the moment a payload is complete, before
        poll() can return it: the decode worker streams the first token from there, one thread
        hop sooner than from the thread that polls. Not for failed transfers. The hook must not
        block; an exception from it is logged and dropped. Set it before opening channels."""
        self._landed = hook

    def on_layer(self, hook: LayerHook | None) -> None:
        """Call `hook(header, layer, kv)` on the receiving thread as each layer of a payload
        lands (P streams them while its prefill computes), so the decode worker writes it into
        the ticket's blocks then, a layer at a time, instead of unpacking the whole payload at
        its end. The payload still holds every layer; ReceivedKV.layers_written counts those
        the hook took. Backends that receive a payload whole never call it. An exception from
        the hook is logged and counts as not taken. Set it before opening channels."""
        self._layer = hook

    def _layer_landed(self, header: TransferHeader, layer: int, kv: torch.Tensor) -> bool:
        """For the backends: `layer` of a payload is in (before its trailer). True when the
        layer hook wrote it."""
        hook = self._layer
        if hook is None:
            return False
        try:
            return bool(hook(header, layer, kv))
        except Exception:  # noqa: BLE001 - the import thread unpacks (or fails) the whole payload
            logging.getLogger(__name__).exception("the layer hook failed for ticket %d layer %d",
                                                  header.ticket_id, layer)
            return False

    def _announce(self, header: TransferHeader) -> None:
        """For the backends: a payload is complete (call before it can be polled)."""
        hook = self._landed
        if hook is None:
            return
        try:
            hook(header)
        except Exception:  # noqa: BLE001 - the transfer itself is fine; poll() still has it
            logging.getLogger(__name__).exception("the landed hook failed for ticket %d", header.ticket_id)

    @abstractmethod
    def open_channel(self) -> ChannelAddress:
        """Open a channel for one P to join (the address travels to P over gRPC).

        Does not block on P. A channel nobody joins within connect_timeout_s is dropped.
        """

    @abstractmethod
    def close_channel(self, address: ChannelAddress) -> None:
        """Drop one channel (e.g. its P is known dead). Idempotent; unknown ids are ignored."""

    @abstractmethod
    def poll(self) -> list[ReceivedKV]:
        """Transfers finished since the last poll, from all channels, each returned once.

        Does not block. The caller owns each returned payload.
        """

    def wait(self, timeout_s: float) -> None:
        """Block until poll() may have something new, or at most timeout_s (a spurious early
        return is allowed): a thread importing transfers sleeps here instead of spinning.
        Mutates nothing; any thread. This default sleeps a short slice of timeout_s."""
        time.sleep(min(timeout_s, 0.002))

    def recycle(self, payload: torch.Tensor) -> None:
        """Hand back a payload poll() returned, once the caller has copied it out (e.g. into
        KV blocks); the receiver may receive a later transfer into the same memory.

        Optional: never recycling is correct, only slower. The caller must not read or write
        `payload` (or any view of it) afterwards, and must never pass a tensor still in use.
        Does not block beyond a lock; mutates only the receiver's idle memory. This default
        keeps nothing.
        """

    @abstractmethod
    def close(self) -> None:
        """Drop every channel and stop its threads, within a bounded time. Idempotent."""


class KVTransferBackend(ABC):
    """Factory for both ends; constructed from a TransferConfig. Constructing one raises
    RuntimeError where it cannot run (nccl without CUDA)."""

    name: str
    on_engine_device = False
    """True: the channel's buffers live on the engine's GPU, so a worker sets
    TransferConfig.device to its engine's device (nccl, cuda_ipc). False: host memory."""

    def __init__(self, config: TransferConfig = TransferConfig()) -> None:
        self.config = config

    @abstractmethod
    def open_receiver(self) -> KVReceiver:
        """D side: start hosting channels (binds config.host). Does not block on any peer."""

    @abstractmethod
    def connect(self, address: ChannelAddress) -> KVSender:
        """P side: a sender joining `address`. Does not block: the channel forms in the
        sender's own thread, and if it cannot, every transfer queued on it FAILS."""


KV_TRANSFER_BACKENDS: Registry[type[KVTransferBackend]] = Registry("kv transfer backend")
KV_TRANSFER_BACKENDS.register("local", "kv_transfer.local:LocalBackend")
KV_TRANSFER_BACKENDS.register("gloo", "kv_transfer.gloo:GlooBackend")
KV_TRANSFER_BACKENDS.register("nccl", "kv_transfer.nccl:NcclBackend")
KV_TRANSFER_BACKENDS.register("cuda_ipc", "kv_transfer.cuda_ipc:CudaIpcBackend")
