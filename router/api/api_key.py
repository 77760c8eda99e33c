"""The API key check shared by the HTTP and gRPC front doors (one key, one comparison)."""

from __future__ import annotations

import hashlib
import hmac


class ApiKey:
    """Holds a digest of the key, never the key; `allows` answers in constant time."""

    def __init__(self, key: str) -> None:
        if not key:
            raise ValueError("an API key must not be empty")
        self._digest = hashlib.sha256(key.encode()).digest()

    def allows(self, authorization: str | None) -> bool:
        """True for `Bearer <key>` (scheme case-insensitive, as HTTP has it)."""
        scheme, _, token = (authorization or "").partition(" ")
        # Compare fixed-length digests so timing reveals nothing about the key or its length.
        given = hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()
        return scheme.lower() == "bearer" and hmac.compare_digest(given, self._digest)
