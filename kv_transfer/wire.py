"""The wire protocol of the torch.distributed backends (gloo, nccl), shared by both ends.

One channel = one 2-rank process group (P is rank 0, D rank 1) plus a doorbell in the
TCPStore that D hosts, under the channel's key prefix:

    P                                   D (channel thread)
    set ring/0 = "hello"; join group    wait ring/0; join group
    per transfer n = 1, 2, ...:
      set ring/n = "xfer"               wait ring/n (idle here, never in a gloo recv)
      send header  (TAG_HEADER)         recv header: HEADER_LEN int64
      send payload (TAG_PAYLOAD)        recv payload: shape/dtype from the header
      recv ack     (TAG_ACK)            send ack = (ticket_id, nbytes)
    set ring/n = "close" on close       either side may ring "close"

Why a doorbell: a gloo recv that times out poisons the whole group, so D must not sit in a
recv while idle; the store wait is interruptible (close rings it) and costs nothing.
Everything on the wire is raw tensor bytes; nothing is pickled.
"""

from __future__ import annotations

import datetime
import socket
import time

import torch
from torch.distributed import PrefixStore, Store, TCPStore

TAG_HEADER = 1
TAG_PAYLOAD = 2
TAG_ACK = 3
RANK_P = 0
RANK_D = 1
HELLO = b"hello"
XFER = b"xfer"
CLOSE = b"close"
IDLE_WAIT = datetime.timedelta(days=1)  # store waits are re-armed; poll() ms must fit int32


def seconds(s: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=s)


def ring_key(seq: int) -> str:
    return f"ring/{seq}"


def host_store(host: str, timeout_s: float) -> TCPStore:
    """A TCPStore server on a free port of `host` only (torch's own would listen on all)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.bind((host, 0))
    sock.listen(128)
    # The store takes ownership of the descriptor and closes it when destroyed.
    return TCPStore(host, 0, None, True, seconds(timeout_s), wait_for_workers=False,
                    master_listen_fd=sock.detach())


def channel_store(host: str, port: int, channel_id: str, timeout_s: float) -> Store:
    """A client of D's store, scoped to one channel's keys. Blocks until connected."""
    return PrefixStore(channel_id, TCPStore(host, port, None, False, seconds(timeout_s)))


def wait_ring(store: Store, seq: int, timeout: datetime.timedelta) -> bytes:
    """Block until ring/seq is set, then consume it. Raises DistStoreError on timeout."""
    key = ring_key(seq)
    store.wait([key], timeout)
    value = store.get(key)
    store.delete_key(key)
    return value


class Deadline:
    """One transfer's time budget, spent across its wire operations."""

    def __init__(self, timeout_s: float) -> None:
        self.start = time.perf_counter()
        self.end = self.start + timeout_s

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def wait(self, work: torch.distributed.Work) -> None:
        """Raises RuntimeError (from the backend) if `work` fails or the budget runs out."""
        left = self.end - time.perf_counter()
        if left <= 0:
            raise RuntimeError("Timed out: the transfer's time budget is spent")
        work.wait(seconds(left))


def header_tensor(ints: tuple[int, ...], device: torch.device | str) -> torch.Tensor:
    return torch.tensor(ints, dtype=torch.int64, device=device)


def ack_tensor(ticket_id: int, nbytes: int, device: torch.device | str) -> torch.Tensor:
    return torch.tensor((ticket_id, nbytes), dtype=torch.int64, device=device)
