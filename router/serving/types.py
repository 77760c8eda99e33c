"""Plain values the router shares with its backends (pure: no tokenizer, no I/O).

TokenLogprobs is the engine's own type (engine.outputs is pure), so workers, the cluster
backend and the HTTP layer all speak the same one.
"""

import os

from engine.outputs import TokenLogprobs

__all__ = ["TokenLogprobs", "random_id"]


_IDS_PER_READ = 256
_ids: list[str] = []
"""Ids read from the OS ahead: one getrandom call per 256 requests instead of two a request
(a system call each, ~1.5% of the router's CPU at 16 in flight). Emptied in a forked child,
which must not hand out its parent's ids."""
os.register_at_fork(after_in_child=_ids.clear)


def random_id() -> str:
    """128 random bits from os.urandom as 32 hex digits (uuid4().hex's shape): a new request's
    id, as unguessable as uuid4's. Not a UUID object: building one costs several times the
    random bytes, twice on every request. Thread-safe (list pop and extend are atomic)."""
    try:
        return _ids.pop()
    except IndexError:
        digits = os.urandom(16 * _IDS_PER_READ).hex()
        _ids.extend(digits[i:i + 32] for i in range(32, len(digits), 32))
        return digits[:32]
