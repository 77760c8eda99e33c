"""The calls the worker link carries: each a method of a worker's gRPC servicer, by a one-byte id.

A worker's link serves the methods its servicer implements (a prefill worker has no Decode);
a call to another answers UNIMPLEMENTED, as gRPC would.
"""

from __future__ import annotations

from dataclasses import dataclass

from google.protobuf.message import Message

from proto.pdserve.v1 import worker_pb2

__all__ = ["ABORT", "DECODE", "LINK_METHODS", "PREFILL", "LinkMethod"]


@dataclass(frozen=True)
class LinkMethod:
    id: int
    """The byte that names it in a CALL frame."""
    name: str
    """The servicer's method (the gRPC method's name)."""
    request: type[Message]
    response: type[Message]
    streaming: bool
    """True: the servicer method is an async generator of responses (unary-stream); False: it
    returns one response (unary-unary)."""


DECODE = LinkMethod(1, "Decode", worker_pb2.DecodeRequest, worker_pb2.DecodeEvent, streaming=True)
PREFILL = LinkMethod(2, "Prefill", worker_pb2.PrefillRequest, worker_pb2.PrefillResponse, streaming=False)
ABORT = LinkMethod(3, "Abort", worker_pb2.AbortRequest, worker_pb2.AbortResponse, streaming=False)
LINK_METHODS: dict[int, LinkMethod] = {m.id: m for m in (DECODE, PREFILL, ABORT)}
