"""The local scaler's state in Redis: signed desired counts, and the supervisor's status.

    pdserve:{cluster}:scale:desired  HASH role -> "REPLICAS SEQ SIGNATURE"
    pdserve:{cluster}:scale:status   HASH kind, pid, updated_at, restarts:ROLE, ready:ROLE,
                                     starting:ROLE, draining:ROLE; TTL STATUS_TTL_S

A desired count is signed with the cluster secret (HMAC over a domain, the cluster, the role,
the count and SEQ, a write time in ns), and the supervisor acts only on records that verify
and are not older than the last one it took for that role. So write access to Redis alone can
neither scale the cluster nor replay an older signed count over a newer one. The status hash is
not signed: it only reports (restarts, counts), and its presence tells a scaler that a
supervisor is alive to act.

Pure encoding here; the Redis reads and writes are small functions over a client, sync for the
supervisor and async for the router's scaler.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

from proto.auth import sign, verify
from router.ops.scaling import SCALABLE_ROLES

__all__ = ["DesiredCount", "STATUS_TTL_S", "decode_desired", "status_fields", "text_map"]

STATUS_TTL_S = 5.0
"""The status hash's TTL: it vanishes within this long after the supervisor stops."""
_DOMAIN = "pdserve-desired-v1"


@dataclass(frozen=True)
class DesiredCount:
    """One role's desired replicas, as written by a scaler."""

    role: str
    replicas: int
    seq: int
    """Write time in ns (orders records: an older one never replaces a newer one)."""

    def __post_init__(self) -> None:
        if self.role not in SCALABLE_ROLES:
            raise ValueError(f"role must be one of {', '.join(SCALABLE_ROLES)}; got {self.role!r}")
        if isinstance(self.replicas, bool) or not isinstance(self.replicas, int) or self.replicas < 0:
            raise ValueError(f"replicas must be an int >= 0; got {self.replicas!r}")

    @classmethod
    def now(cls, role: str, replicas: int) -> DesiredCount:
        return cls(role, replicas, time.time_ns())

    def encode(self, cluster: str, secret: bytes) -> str:
        """The hash value: 'REPLICAS SEQ SIGNATURE'."""
        return f"{self.replicas} {self.seq} {sign(secret, *self._parts(cluster))}"

    def _parts(self, cluster: str) -> tuple[str, ...]:
        return (_DOMAIN, cluster, self.role, str(self.replicas), str(self.seq))


def decode_desired(role: str, value: bytes | str, cluster: str, secret: bytes) -> DesiredCount:
    """Parse and verify one hash value. Raises ValueError (malformed, or a signature that does
    not verify)."""
    text = value.decode() if isinstance(value, bytes) else value
    try:
        replicas, seq, signature = text.split(" ")
        count = DesiredCount(role, int(replicas), int(seq))
    except ValueError:
        raise ValueError(f"desired count for {role} is malformed: {text[:40]!r}") from None
    if not verify(secret, signature, *count._parts(cluster)):  # noqa: SLF001 — same class's parts
        raise ValueError(f"desired count for {role} is not signed with the cluster secret")
    return count


def text_map(data: Mapping[bytes | str, bytes | str]) -> dict[str, str]:
    """A hash as HGETALL returns it, as text."""
    return {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
            for k, v in data.items()}


def status_fields(pid: int, restarts: Mapping[str, int], counts: Mapping[str, Mapping[str, int]],
                  kind: str = "local") -> dict[str, str]:
    """The status hash of a `pdserve up` supervisor. counts: role -> {"ready": n, "starting": n,
    "draining": n}; kind: its launcher ("local", "ray"), which the scaler of that name checks."""
    out = {"kind": kind, "pid": str(pid), "updated_at": repr(time.time())}
    for role in SCALABLE_ROLES:
        out[f"restarts:{role}"] = str(restarts.get(role, 0))
        for state, n in counts.get(role, {}).items():
            out[f"{state}:{role}"] = str(n)
    return out

