"""The cluster secret: what proves that a caller belongs to this cluster.

One secret per cluster, shared by its router(s) and workers. It guards the internal gRPC
services (a token in each call's metadata), signs the heartbeats workers write to Redis (so
write access to Redis alone cannot redirect traffic), and admits a peer to a KV data channel.
It is read from the environment or a file, never from the command line (argv is visible to
every user of the host through `ps`). `pdserve up` generates one and hands it to its children
through the environment; Helm mounts one from a Secret.

Pure: imports no grpc, redis or torch, so every tier (router, workers, launchers) may use it.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections.abc import Mapping
from pathlib import Path

__all__ = [
    "CLUSTER_SECRET_ENV",
    "CLUSTER_SECRET_FILE_ENV",
    "generate_secret",
    "load_cluster_secret",
    "sign",
    "verify",
]

CLUSTER_SECRET_ENV = "PDSERVE_CLUSTER_SECRET"
"""Environment variable holding the cluster secret itself."""
CLUSTER_SECRET_FILE_ENV = "PDSERVE_CLUSTER_SECRET_FILE"
"""Environment variable naming a file whose contents (stripped) are the cluster secret."""


def generate_secret() -> str:
    """A fresh random secret (256 bits, URL-safe text)."""
    return secrets.token_urlsafe(32)


def load_cluster_secret(environ: Mapping[str, str] | None = None) -> bytes | None:
    """The cluster secret from $PDSERVE_CLUSTER_SECRET, else from the file named by
    $PDSERVE_CLUSTER_SECRET_FILE; None when neither is set. Raises ValueError, naming the
    variable or path, for an empty secret or an unreadable file."""
    env = os.environ if environ is None else environ
    value = env.get(CLUSTER_SECRET_ENV)
    if value is None and env.get(CLUSTER_SECRET_FILE_ENV):
        path = Path(env[CLUSTER_SECRET_FILE_ENV])
        try:
            value = path.read_text().strip()
        except OSError as exc:
            raise ValueError(f"cannot read the cluster secret file {path} ({CLUSTER_SECRET_FILE_ENV}): {exc}") from exc
    if value is None:
        return None
    if not value.strip():
        raise ValueError(f"the cluster secret ({CLUSTER_SECRET_ENV} or {CLUSTER_SECRET_FILE_ENV}) is empty")
    return value.strip().encode()


def sign(secret: bytes, *parts: bytes | str) -> str:
    """HMAC-SHA256 of the parts (length-prefixed, so ("ab", "c") != ("a", "bc")), as hex."""
    chunks = []
    for part in parts:
        data = part.encode() if isinstance(part, str) else part
        chunks += (len(data).to_bytes(8, "big"), data)
    # One update, not two per part: a heartbeat entry has ~40 parts and the router checks every
    # worker's several times a second.
    return hmac.new(secret, b"".join(chunks), hashlib.sha256).hexdigest()


def verify(secret: bytes, signature: str | bytes, *parts: bytes | str) -> bool:
    """Whether `signature` is sign(secret, *parts); constant time in the signature."""
    given = signature.decode(errors="replace") if isinstance(signature, bytes) else signature
    return hmac.compare_digest(given.encode(), sign(secret, *parts).encode())
