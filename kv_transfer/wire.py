"""The wire protocol of the torch.distributed backends (gloo, nccl), shared by both ends.

One channel = one 2-rank process group (P is rank 0, D rank 1) plus a doorbell in the
TCPStore that D hosts, under the channel's key prefix:

    P                                   D
                                        open_channel: set auth/nonce = random (per channel)
    get auth/nonce                      (channel thread)
    set ring/0 = "hello " + proof(P)    wait ring/0; check proof(P), constant time
                                          wrong: set auth/reply = "refused", log, drop channel
    wait auth/reply == proof(D)           right: set auth/reply = proof(D)
    join group                          join group; delete auth/*
    send group_proof(P)   (TAG_PROOF)   recv group_proof(P); check it, else drop the group
    recv group_proof(D); check it       send group_proof(D)
    per transfer n = 1, 2, ...:
      set ring/n = "xfer"               wait ring/n (idle here, never in a gloo recv)
      send header  (TAG_HEADER)         recv header: HEADER_LEN int64
      send layer 0..n-1 (TAG_PAYLOAD)   recv each layer [2, blocks, block, heads, dim] in turn
      send trailer (TAG_TRAILER)        recv trailer: (ticket_id, status, first_token_id,
                                          first_token_at_us); CANCELLED: nothing to import
      recv ack     (TAG_ACK)            send ack = (ticket_id, nbytes)
    set ring/n = "close" on close       either side may ring "close"

Why the handshake: anyone on the host can connect to D's store, and the channel id (a uuid4,
handed to P over authenticated gRPC) is the only other thing guarding it. proof(side) =
HMAC(cluster secret, "kv-channel", channel id, nonce, side): it shows the peer holds the secret
without sending it, cannot be replayed on another channel (fresh nonce), and P's and D's
proofs differ, so neither can be reflected back as the other's. D joins the group only after
P proved itself. The store accepts any client on the host and lists its keys, so a rogue one
could still race to overwrite a rank's address during the group's own rendezvous and sit at
one end of the group: hence the second pair of proofs, over the group's own connection, with
values that never appear in the store. Neither side sends KV or accepts KV before it.

Why layers and a trailer: a prefill worker may start a transfer while it still computes the
prompt (kv_transfer/layers.py), so each layer goes as soon as it exists, and the first token,
known last, follows the layers. A one-shot send uses the same frames.

Why a doorbell: a gloo recv that times out poisons the whole group, so D must not sit in a
recv while idle; the store wait is interruptible (close rings it) and costs nothing.
Everything on the wire is raw tensor bytes; nothing is pickled.
"""

from __future__ import annotations

import datetime
import hmac
import secrets
import socket
import time

import torch
from torch.distributed import PrefixStore, Store, TCPStore

from proto.auth import sign

TAG_HEADER = 1
TAG_PAYLOAD = 2
TAG_ACK = 3
TAG_PROOF = 4
TAG_TRAILER = 5
RANK_P = 0
RANK_D = 1
HELLO = b"hello"
XFER = b"xfer"
CLOSE = b"close"
REFUSED = b"refused"
NONCE_KEY = "auth/nonce"
REPLY_KEY = "auth/reply"
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


def new_nonce() -> bytes:
    return secrets.token_hex(16).encode()


def proof(secret: bytes, channel_id: str, nonce: bytes, side: str) -> bytes:
    """What `side` ("P" or "D") shows to prove the cluster secret on one channel."""
    return sign(secret, "kv-channel", channel_id, nonce, side).encode()


def hello(secret: bytes, channel_id: str, nonce: bytes) -> bytes:
    """P's ring/0 value."""
    return HELLO + b" " + proof(secret, channel_id, nonce, "P")


def hello_ok(secret: bytes, channel_id: str, nonce: bytes, value: bytes) -> bool:
    """Whether ring/0's value proves the secret (constant time in the proof)."""
    return hmac.compare_digest(value, hello(secret, channel_id, nonce))


def reply_ok(secret: bytes, channel_id: str, nonce: bytes, value: bytes) -> bool:
    """Whether D's auth/reply proves the secret (constant time in the proof)."""
    return hmac.compare_digest(value, proof(secret, channel_id, nonce, "D"))


def prove(store: Store, secret: bytes | None, channel_id: str, timeout_s: float) -> bytes:
    """P's side of the handshake: prove the cluster secret to D, and check D's proof; the
    channel's nonce. Raises RuntimeError when D refused or did not prove it, DistStoreError
    when D stayed silent."""
    if secret is None:
        raise RuntimeError("a torch.distributed channel needs the cluster secret")
    nonce = wait_get(store, NONCE_KEY, seconds(timeout_s))
    store.set(ring_key(0), hello(secret, channel_id, nonce))
    reply = wait_get(store, REPLY_KEY, seconds(timeout_s))
    if reply == REFUSED:
        raise RuntimeError("the decode worker refused this channel: the cluster secrets differ")
    if not reply_ok(secret, channel_id, nonce, reply):
        raise RuntimeError("the channel's host did not prove the cluster secret")
    return nonce


def group_proof(secret: bytes, channel_id: str, nonce: bytes, side: str,
                device: torch.device | str) -> torch.Tensor:
    """`side`'s proof over the group: 32 HMAC bytes as 4 int64 (a type every backend sends)."""
    digest = bytes.fromhex(sign(secret, "kv-group", channel_id, nonce, side))
    return torch.tensor([int.from_bytes(digest[i:i + 8], "big", signed=True) for i in range(0, 32, 8)],
                        dtype=torch.int64, device=device)


def exchange_group_proofs(group: torch.distributed.ProcessGroup, secret: bytes, channel_id: str,
                          nonce: bytes, rank: int, device: torch.device | str,
                          timeout_s: float) -> None:
    """Both ends prove the secret over the group's own connection: P sends first, D answers
    only a valid proof. Raises RuntimeError when the peer's proof is wrong or late."""
    mine, peer = ("P", "D") if rank == RANK_P else ("D", "P")
    other = RANK_D if rank == RANK_P else RANK_P
    deadline = Deadline(timeout_s)
    got = torch.empty(4, dtype=torch.int64, device=device)
    if rank == RANK_P:
        deadline.wait(group.send([group_proof(secret, channel_id, nonce, mine, device)], other, TAG_PROOF))
    deadline.wait(group.recv([got], other, TAG_PROOF))
    expected = group_proof(secret, channel_id, nonce, peer, device)
    if not hmac.compare_digest(_bytes(got), _bytes(expected)):
        raise RuntimeError(f"the peer in the group did not prove the cluster secret ({peer} side)")
    if rank == RANK_D:
        deadline.wait(group.send([group_proof(secret, channel_id, nonce, mine, device)], other, TAG_PROOF))


def _bytes(t: torch.Tensor) -> bytes:
    return b"".join(int(v).to_bytes(8, "big", signed=True) for v in t.tolist())


def wait_get(store: Store, key: str, timeout: datetime.timedelta) -> bytes:
    """Block until `key` is set, then read it (left in place). Raises DistStoreError on timeout."""
    store.wait([key], timeout)
    return store.get(key)


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

    def left(self) -> float:
        """Seconds of the budget left (0 once spent)."""
        return max(self.end - time.perf_counter(), 0.0)

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
