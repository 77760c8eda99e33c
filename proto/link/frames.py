"""The worker link's wire format (pure: struct and grpc's status names only).

After the handshake (handshake.py) both directions are a sequence of frames:

    length  uint32, big-endian   bytes of payload that follow the 9-byte header
    call    uint32               the call this frame belongs to (chosen by the caller, unique
                                 among the connection's open calls)
    kind    uint8                FrameKind
    payload length bytes

    CALL     caller -> worker  method id (1 byte), then the serialized request message
    CANCEL   caller -> worker  no payload: the caller left; the worker cancels the call
    MESSAGE  worker -> caller  one serialized response message
    END      worker -> caller  the call's status (encode_status): OK, or a gRPC status code
                               with its details and trailing metadata; nothing follows it

A frame above MAX_FRAME_BYTES, an unknown kind or a malformed status is a protocol error:
the reader raises LinkProtocolError and the connection closes (every call on it fails).
"""

from __future__ import annotations

import enum
import struct

import grpc

from proto.limits import INTERNAL_MAX_MESSAGE_BYTES

__all__ = [
    "HEADER",
    "MAX_FRAME_BYTES",
    "FrameKind",
    "FrameReader",
    "LinkProtocolError",
    "LinkStatus",
    "decode_status",
    "encode_status",
    "frame",
]

HEADER = struct.Struct("!IIB")
"""length, call id, kind."""
MAX_FRAME_BYTES = INTERNAL_MAX_MESSAGE_BYTES + 16
"""The largest payload: a message at the internal limit plus a CALL's method byte."""
MAX_CALL_ID = 0xFFFFFFFF
_STATUS_HEAD = struct.Struct("!BH")  # code, metadata entries
_ENTRY_HEAD = struct.Struct("!HI")  # key length, value length
_CODES = {code.value[0]: code for code in grpc.StatusCode}


class FrameKind(enum.IntEnum):
    CALL = 1
    CANCEL = 2
    MESSAGE = 3
    END = 4


_KINDS = frozenset(int(k) for k in FrameKind)


class LinkProtocolError(Exception):
    """The peer broke the wire format; the connection cannot go on."""


def frame(call_id: int, kind: FrameKind, payload: bytes = b"") -> bytes:
    """One frame, header and payload."""
    return HEADER.pack(len(payload), call_id, kind) + payload


class LinkStatus:
    """How a call ended: a gRPC status code, its details and trailing metadata."""

    __slots__ = ("code", "details", "trailing_metadata")

    def __init__(self, code: grpc.StatusCode, details: str = "",
                 trailing_metadata: tuple[tuple[str, str], ...] = ()) -> None:
        self.code, self.details, self.trailing_metadata = code, details, trailing_metadata

    def __repr__(self) -> str:
        return f"LinkStatus({self.code.name}, {self.details!r}, {self.trailing_metadata!r})"


OK = LinkStatus(grpc.StatusCode.OK)


def encode_status(status: LinkStatus) -> bytes:
    """An END frame's payload."""
    parts = [_STATUS_HEAD.pack(status.code.value[0], len(status.trailing_metadata))]
    for key, value in status.trailing_metadata:
        k, v = str(key).encode(), str(value).encode()
        parts += [_ENTRY_HEAD.pack(len(k), len(v)), k, v]
    parts.append(status.details.encode())
    return b"".join(parts)


def decode_status(payload: bytes) -> LinkStatus:
    """An END frame's status; LinkProtocolError when it does not parse."""
    try:
        code, entries = _STATUS_HEAD.unpack_from(payload, 0)
        offset, metadata = _STATUS_HEAD.size, []
        for _ in range(entries):
            k_len, v_len = _ENTRY_HEAD.unpack_from(payload, offset)
            offset += _ENTRY_HEAD.size
            if offset + k_len + v_len > len(payload):
                raise LinkProtocolError("status metadata runs past the frame")
            key = payload[offset:offset + k_len].decode()
            value = payload[offset + k_len:offset + k_len + v_len].decode()
            offset += k_len + v_len
            metadata.append((key, value))
        details = payload[offset:].decode()
    except (struct.error, UnicodeDecodeError) as exc:
        raise LinkProtocolError(f"malformed status: {exc}") from None
    if code not in _CODES:
        raise LinkProtocolError(f"unknown status code {code}")
    return LinkStatus(_CODES[code], details, tuple(metadata))


class FrameReader:
    """Splits a byte stream into frames. feed() returns the frames completed so far as
    (call id, kind, payload) and keeps the rest; LinkProtocolError on a broken stream."""

    __slots__ = ("_buffer", "max_frame_bytes")

    def __init__(self, max_frame_bytes: int = MAX_FRAME_BYTES) -> None:
        self._buffer = bytearray()
        self.max_frame_bytes = max_frame_bytes

    def feed(self, data: bytes) -> list[tuple[int, int, bytes]]:
        buffer = self._buffer
        buffer += data
        frames, offset, end = [], 0, len(buffer)
        unpack, size = HEADER.unpack_from, HEADER.size
        while end - offset >= size:
            length, call_id, kind = unpack(buffer, offset)
            if length > self.max_frame_bytes:
                raise LinkProtocolError(f"frame of {length} bytes is above the limit of {self.max_frame_bytes}")
            if kind not in _KINDS:
                raise LinkProtocolError(f"unknown frame kind {kind}")
            start = offset + size
            if end - start < length:
                break
            frames.append((call_id, kind, bytes(buffer[start:start + length])))
            offset = start + length
        if offset:
            del buffer[:offset]
        return frames

    @property
    def buffered(self) -> int:
        """Bytes received that are not a whole frame yet."""
        return len(self._buffer)
