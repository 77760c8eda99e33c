"""The worker link's opening: each side proves the cluster secret before any call (pure).

    worker -> caller  HELLO   MAGIC + the worker's nonce (64 hex digits)
    caller -> worker  PROOF   the caller's nonce + HMAC(secret, CLIENT_DOMAIN, both nonces)
    worker -> caller  ACCEPT  HMAC(secret, SERVER_DOMAIN, both nonces)

Fresh nonces from both sides make every proof good for one connection only: a captured
opening replays nowhere, and neither proof reveals the secret. The caller checks ACCEPT, so a
process that does not hold the secret cannot pose as a worker. A worker closes a connection
whose PROOF does not verify, or that has not completed the opening within HANDSHAKE_TIMEOUT_S,
without a word; it logs the refusal (rate limited). Like the gRPC proofs (proto/internal_auth.py)
this authenticates the caller, it does not encrypt: whoever can read the link can read the
prompts on it, as on the gRPC one.
"""

from __future__ import annotations

import hmac
import secrets

from proto.auth import sign

__all__ = [
    "ACCEPT_BYTES",
    "HANDSHAKE_TIMEOUT_S",
    "HELLO_BYTES",
    "MAGIC",
    "PROOF_BYTES",
    "accept_for",
    "check_accept",
    "check_proof",
    "hello",
    "nonce_of_hello",
    "proof_for",
]

MAGIC = b"PDSLINK1"
"""The first bytes a worker's link port sends: a caller that dialled something else says so."""
HANDSHAKE_TIMEOUT_S = 5.0
"""Longest either side waits for the other's part of the opening."""
_NONCE_HEX = 64
HELLO_BYTES = len(MAGIC) + _NONCE_HEX
PROOF_BYTES = 2 * _NONCE_HEX
ACCEPT_BYTES = 64
_CLIENT_DOMAIN = "pdserve-link-client-v1"
_SERVER_DOMAIN = "pdserve-link-server-v1"


def _nonce() -> bytes:
    return secrets.token_hex(_NONCE_HEX // 2).encode()


def hello() -> tuple[bytes, bytes]:
    """(HELLO to send, the worker's nonce)."""
    nonce = _nonce()
    return MAGIC + nonce, nonce


def nonce_of_hello(data: bytes) -> bytes | None:
    """The worker's nonce from a HELLO; None when it is not one (not a pdserve link port)."""
    if len(data) != HELLO_BYTES or not data.startswith(MAGIC):
        return None
    nonce = data[len(MAGIC):]
    return nonce if _is_hex(nonce) else None


def proof_for(secret: bytes, server_nonce: bytes) -> tuple[bytes, bytes]:
    """(PROOF to send, the caller's nonce)."""
    nonce = _nonce()
    return nonce + sign(secret, _CLIENT_DOMAIN, server_nonce, nonce).encode(), nonce


def check_proof(secret: bytes, server_nonce: bytes, data: bytes) -> bytes | None:
    """The caller's nonce when PROOF verifies (constant-time compare); None otherwise."""
    if len(data) != PROOF_BYTES:
        return None
    nonce, mac = data[:_NONCE_HEX], data[_NONCE_HEX:]
    if not _is_hex(nonce):
        return None
    expected = sign(secret, _CLIENT_DOMAIN, server_nonce, nonce).encode()
    return nonce if hmac.compare_digest(mac, expected) else None


def accept_for(secret: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    """ACCEPT: the worker's proof, sent once the caller's verified."""
    return sign(secret, _SERVER_DOMAIN, server_nonce, client_nonce).encode()


def check_accept(secret: bytes, server_nonce: bytes, client_nonce: bytes, data: bytes) -> bool:
    """Whether the worker's ACCEPT proves the secret (constant-time compare)."""
    return len(data) == ACCEPT_BYTES and hmac.compare_digest(data, accept_for(secret, server_nonce, client_nonce))


def _is_hex(data: bytes) -> bool:
    try:
        bytes.fromhex(data.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        return False
    return True
