"""Plain values the router shares with its backends (pure: no tokenizer, no I/O).

TokenLogprobs is the engine's own type (engine.outputs is pure), so workers, the cluster
backend and the HTTP layer all speak the same one.
"""

import os

from engine.outputs import TokenLogprobs

__all__ = ["TokenLogprobs", "random_id"]


def random_id() -> str:
    """128 random bits as 32 hex digits (uuid4().hex's shape): a new request's id. Not a UUID
    object: building one costs several times the random bytes, twice on every request."""
    return os.urandom(16).hex()
