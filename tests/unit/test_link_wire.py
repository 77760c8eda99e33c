"""The worker link's wire format and opening (proto/link/frames.py, handshake.py): frames split
anywhere in the byte stream come out whole and in order; what breaks the format is refused; each
side's proof holds for its own connection only."""

from __future__ import annotations

import grpc
import pytest

from proto.link import handshake
from proto.link.frames import (
    HEADER, FrameKind, FrameReader, LinkProtocolError, LinkStatus, decode_status, encode_status, frame)

SECRET = b"link-unit-secret"


def test_frames_split_at_every_byte_boundary_come_out_whole_and_in_order():
    frames = [(1, FrameKind.CALL, b"\x01request"), (7, FrameKind.MESSAGE, b""), (2**32 - 1, FrameKind.END, b"x" * 300)]
    stream = b"".join(frame(call_id, kind, payload) for call_id, kind, payload in frames)
    for cut in range(len(stream) + 1):
        reader = FrameReader()
        got = reader.feed(stream[:cut]) + reader.feed(stream[cut:])
        assert got == [(c, int(k), p) for c, k, p in frames]
        assert reader.buffered == 0


def test_a_frame_above_the_limit_is_refused_from_its_header_before_its_payload_arrives():
    reader = FrameReader(max_frame_bytes=100)
    with pytest.raises(LinkProtocolError, match="frame of 101 bytes is above the limit of 100"):
        reader.feed(HEADER.pack(101, 1, FrameKind.MESSAGE))


def test_an_unknown_frame_kind_is_refused():
    with pytest.raises(LinkProtocolError, match="unknown frame kind 9"):
        FrameReader().feed(HEADER.pack(0, 1, 9))


def test_a_status_round_trips_with_its_details_and_trailing_metadata():
    status = LinkStatus(grpc.StatusCode.RESOURCE_EXHAUSTED, "no room: 3 of 100 blocks free",
                        (("pdserve-no-room", "1"), ("ünïcode", "välue")))
    back = decode_status(encode_status(status))
    assert (back.code, back.details, back.trailing_metadata) == (status.code, status.details, status.trailing_metadata)
    ok = decode_status(encode_status(LinkStatus(grpc.StatusCode.OK)))
    assert (ok.code, ok.details, ok.trailing_metadata) == (grpc.StatusCode.OK, "", ())


@pytest.mark.parametrize("payload, reason", [
    (b"", "malformed status"),
    (bytes([200, 0, 0]), "unknown status code 200"),
    (bytes([8, 0, 1, 0, 9, 0, 0, 0, 1]) + b"key", "status metadata runs past the frame"),
])  # fmt: skip
def test_a_malformed_status_is_a_protocol_error(payload, reason):
    with pytest.raises(LinkProtocolError, match=reason):
        decode_status(payload)


def test_the_opening_proves_the_secret_both_ways():
    hello, server_nonce = handshake.hello()
    assert len(hello) == handshake.HELLO_BYTES and handshake.nonce_of_hello(hello) == server_nonce
    proof, client_nonce = handshake.proof_for(SECRET, server_nonce)
    assert len(proof) == handshake.PROOF_BYTES
    assert handshake.check_proof(SECRET, server_nonce, proof) == client_nonce
    accept = handshake.accept_for(SECRET, server_nonce, client_nonce)
    assert handshake.check_accept(SECRET, server_nonce, client_nonce, accept)


def test_a_proof_made_with_another_secret_or_for_another_connection_is_refused():
    _, server_nonce = handshake.hello()
    proof, client_nonce = handshake.proof_for(b"another secret", server_nonce)
    assert handshake.check_proof(SECRET, server_nonce, proof) is None
    _, other_nonce = handshake.hello()
    replayed, _ = handshake.proof_for(SECRET, other_nonce)  # captured on another connection
    assert handshake.check_proof(SECRET, server_nonce, replayed) is None
    forged_accept = handshake.accept_for(b"another secret", server_nonce, client_nonce)
    assert not handshake.check_accept(SECRET, server_nonce, client_nonce, forged_accept)


@pytest.mark.parametrize("data", [b"HTTP/1.1 400 Bad Request\r\n" + b"x" * 46, b"PDSLINK1" + b"z" * 64, b"PDSLINK1"])
def test_a_hello_that_is_not_a_link_is_told_apart(data):
    assert handshake.nonce_of_hello(data) is None
