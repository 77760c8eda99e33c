"""Cluster state's Redis key schema and the values stored under it (pure: no I/O, no redis).

Keys live under `pdserve:{cluster}:` (DESIGN.md, "Cluster state"):

    pdserve:{cluster}:workers             SET   worker ids that have heart-beaten
    pdserve:{cluster}:worker:{worker_id}  HASH  WorkerInfo.to_hash(), with a TTL
    pdserve:{cluster}:kv_events           STREAM  block events (router/routing/prefix_index.py BlockEvent)
    pdserve:{cluster}:scale:desired       HASH  role -> desired replicas (written by a scaler)
    pdserve:{cluster}:scale:status        HASH  the local supervisor's status, with a TTL

A worker's hash expires when its heartbeats stop; the set may still name it until a reader
notices and removes it. A worker signs its hash with the cluster secret (`signed_hash`: an
HMAC over the cluster name and every WorkerInfo field, in a `signature` field), and a router
that holds the secret takes only entries that verify (`verified_info`), so write access to
Redis alone cannot register a worker and redirect users' requests to it. Redis is a routing hint, not the source of truth: workers own their
blocks, and a router may route on a snapshot that is a little old.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Literal, get_args

from proto.auth import sign, verify

__all__ = [
    "ROLES",
    "BUSY_SIGNATURE_FIELD",
    "COUNTERS_SIGNATURE_FIELD",
    "LINK_SIGNATURE_FIELD",
    "SIGNATURE_FIELD",
    "ClusterSnapshot",
    "UnsignedEntry",
    "Role",
    "WorkerInfo",
    "WORKER_STATES",
    "WorkerState",
    "cluster_prefix",
    "desired_replicas_key",
    "scaler_status_key",
    "kv_events_key",
    "signed_hash",
    "verified_info",
    "worker_key",
    "workers_set_key",
]

Role = Literal["prefill", "decode", "both"]
ROLES: tuple[str, ...] = get_args(Role)
WorkerState = Literal["starting", "serving", "draining", "stopped"]
"""A worker process's state as its heartbeat tells it (a heartbeat is written only while
serving or draining)."""
WORKER_STATES: tuple[str, ...] = get_args(WorkerState)


def cluster_prefix(cluster: str) -> str:
    """`pdserve:{cluster}:` — every key of one cluster starts with it."""
    if not cluster:
        raise ValueError("cluster name must not be empty")
    return f"pdserve:{cluster}:"


def worker_key(cluster: str, worker_id: str) -> str:
    """The heartbeat hash of one worker."""
    if not worker_id:
        raise ValueError("worker_id must not be empty")
    return f"{cluster_prefix(cluster)}worker:{worker_id}"


def workers_set_key(cluster: str) -> str:
    """The set of worker ids that have registered (some may have expired since)."""
    return f"{cluster_prefix(cluster)}workers"


def desired_replicas_key(cluster: str) -> str:
    """HASH role -> desired replica count, written by a scaler (the Scale subresource's
    spec.replicas); the local supervisor reconciles its worker processes to it."""
    return f"{cluster_prefix(cluster)}scale:desired"


def scaler_status_key(cluster: str) -> str:
    """HASH the running supervisor's status (kind, restarts per role, updated_at), with a TTL:
    present only while a supervisor is alive to act on desired_replicas_key."""
    return f"{cluster_prefix(cluster)}scale:status"


def kv_events_key(cluster: str) -> str:
    """The stream of every worker's prefix-cache block events (stored, evicted, snapshot)."""
    return f"{cluster_prefix(cluster)}kv_events"


@dataclass(frozen=True)
class WorkerInfo:
    """One worker's heartbeat: who it is, where it listens, and its load and KV capacity.

    Block counts are in the worker's own blocks of `block_size` tokens.
    """

    worker_id: str
    """Stable name of the worker (survives restarts; the incarnation does not)."""
    role: Role
    """"prefill", "decode", or "both" (may serve either phase)."""
    address: str
    """gRPC host:port of the worker's service."""
    metrics_address: str
    """host:port of its Prometheus /metrics, or "" when it exposes none."""
    incarnation: str
    """Opaque id, new at each start of the process; fences entries of a previous run."""
    block_size: int
    """Tokens per KV block."""
    total_blocks: int
    """KV blocks in the worker's cache."""
    free_blocks: int
    """Blocks not held by any request (includes cached_blocks, which are evictable)."""
    reserved_blocks: int
    """Blocks promised to admitted requests whose KV has not arrived yet; NOT subtracted from
    free_blocks, so room for new work is free_blocks - reserved_blocks."""
    cached_blocks: int
    """Free blocks still holding a reusable prefix (evicted LRU when needed)."""
    num_running: int
    """Requests in the running batch."""
    num_waiting: int
    """Requests queued, not yet scheduled."""
    queued_prefill_tokens: int
    """Prompt tokens still to prefill across queued and running requests."""
    max_model_len: int
    """Longest sequence (prompt + output tokens) the worker accepts."""
    updated_at: float
    """Unix time (seconds, the worker's clock) when this heartbeat was taken."""
    state: WorkerState = "serving"
    """"serving", or "draining": finishing its in-flight requests before it exits; routers
    send a draining worker no new work (worker_runtime.status.WorkerState names them all)."""
    # Counters since the worker's start (its incarnation): the router's /metrics and its cluster
    # stats line are built from them. Optional: a worker of an earlier release writes none (0).
    prefix_cache_queries: int = 0
    """Prompt tokens looked up in the worker's prefix cache."""
    prefix_cache_hits: int = 0
    """Of those, tokens found there."""
    prompt_tokens: int = 0
    """Prompt tokens the worker computed."""
    generation_tokens: int = 0
    """Tokens the worker sampled."""
    prefill_busy_s: float = 0.0
    """Seconds its engine spent computing prompt tokens: prompt_tokens / prefill_busy_s is its
    prefill throughput while busy (the planner's measure; idle time does not dilute it)."""
    decode_busy_s: float = 0.0
    """Seconds its engine spent generating: generation_tokens / decode_busy_s while busy."""
    link_address: str = ""
    """host:port of its worker link (proto/link), the request plane routers use for Decode,
    Prefill and Abort; "" when it serves none (an earlier release, or --link-port -1): routers
    then make those calls over gRPC at `address`."""

    def __post_init__(self) -> None:
        if not self.worker_id:
            raise ValueError("worker_id must not be empty")
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}; got {self.role!r}")
        if not self.address:
            raise ValueError(f"worker {self.worker_id!r}: address must not be empty")
        if not self.incarnation:
            raise ValueError(f"worker {self.worker_id!r}: incarnation must not be empty")
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(
                    f"worker {self.worker_id!r}: {name} must be an int >= 0; got {value!r}"
                )
        for name in _BUSY_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
                raise ValueError(f"worker {self.worker_id!r}: {name} must be a finite number >= 0; got {value!r}")
        if self.link_address and ":" not in self.link_address:
            raise ValueError(f"worker {self.worker_id!r}: link_address must be host:port; got {self.link_address!r}")
        if self.state not in WORKER_STATES:
            raise ValueError(f"worker {self.worker_id!r}: state must be one of {', '.join(WORKER_STATES)}; "
                             f"got {self.state!r}")
        if self.block_size < 1:
            raise ValueError(f"worker {self.worker_id!r}: block_size must be >= 1")
        if not isinstance(self.updated_at, (int, float)) or not math.isfinite(self.updated_at):
            raise ValueError(
                f"worker {self.worker_id!r}: updated_at must be a finite number; "
                f"got {self.updated_at!r}"
            )

    def with_queued_prefill_tokens(self, tokens: int) -> WorkerInfo:
        """This entry with another queued_prefill_tokens (an int >= 0). The router makes one per
        request it routes (its own prefills in flight, on top of the heartbeat's count), so the
        rest, checked when this entry was made, is copied rather than checked again."""
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
            raise ValueError(f"worker {self.worker_id!r}: queued_prefill_tokens must be an int >= 0; got {tokens!r}")
        copy = object.__new__(WorkerInfo)
        copy.__dict__.update(self.__dict__)
        object.__setattr__(copy, "queued_prefill_tokens", tokens)
        return copy

    @property
    def draining(self) -> bool:
        return self.state == "draining"

    @property
    def serves_prefill(self) -> bool:
        return self.role in ("prefill", "both")

    @property
    def serves_decode(self) -> bool:
        return self.role in ("decode", "both")

    def to_hash(self) -> dict[str, str]:
        """The Redis hash fields: every field as a string (floats round-trip exactly)."""
        return {
            f.name: repr(float(v)) if f.name in _FLOAT_FIELDS else str(v)
            for f in fields(self)
            for v in (getattr(self, f.name),)
        }

    @classmethod
    def from_hash(cls, data: Mapping[bytes | str, bytes | str]) -> WorkerInfo:
        """Parse a hash as HGETALL returns it (bytes or str keys and values).

        Unknown fields are ignored (a newer worker may publish more). Raises ValueError naming
        the missing fields, or the field whose value is invalid.
        """
        text = {_text(k): _text(v) for k, v in data.items()}
        missing = [f.name for f in fields(cls) if f.name not in text and f.name not in _OPTIONAL_FIELDS]
        if missing:
            raise ValueError(f"worker hash lacks field(s): {', '.join(missing)}")
        values: dict[str, object] = {}
        for f in fields(cls):
            if f.name not in text:
                continue  # an optional field an older worker does not write: its default
            raw = text[f.name]
            try:
                if f.name in _INT_FIELDS:
                    values[f.name] = int(raw)
                elif f.name in _FLOAT_FIELDS:
                    values[f.name] = float(raw)
                else:
                    values[f.name] = raw
            except ValueError:
                raise ValueError(f"worker hash field {f.name} is not a number: {raw!r}") from None
        return cls(**values)  # type: ignore[arg-type]


_COUNTER_FIELDS = ("prefix_cache_queries", "prefix_cache_hits", "prompt_tokens", "generation_tokens")
_BUSY_FIELDS = ("prefill_busy_s", "decode_busy_s")
"""Counters that came after the token counters, signed by BUSY_SIGNATURE_FIELD."""
_INT_FIELDS = frozenset(
    {
        "block_size",
        "total_blocks",
        "free_blocks",
        "reserved_blocks",
        "cached_blocks",
        "num_running",
        "num_waiting",
        "queued_prefill_tokens",
        "max_model_len",
        *_COUNTER_FIELDS,
    }
) - frozenset(_BUSY_FIELDS)
_FLOAT_FIELDS = frozenset({"updated_at", *_BUSY_FIELDS})
_LINK_FIELDS = ("link_address",)
"""Came after the busy seconds, signed by LINK_SIGNATURE_FIELD."""
_OPTIONAL_FIELDS = frozenset({"state", *_COUNTER_FIELDS, *_BUSY_FIELDS, *_LINK_FIELDS})


def _text(value: bytes | str) -> str:
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"worker hash holds bytes that are not UTF-8: {value!r}") from None
    return value


@dataclass(frozen=True)
class ClusterSnapshot:
    """The workers a router knows of at one moment. Lives here (pure) so policies can use it
    without importing the Redis reader."""

    workers: tuple[WorkerInfo, ...]
    """Live workers sorted by worker_id, at most one entry (one incarnation) per worker_id."""
    taken_at: float
    """The reader's clock (monotonic seconds) when these entries were read."""
    stale: bool
    """True when Redis could not be read and these are the last entries that were."""

    def prefill_workers(self) -> tuple[WorkerInfo, ...]:
        """Serving workers that may prefill (role "prefill" or "both"). The one place routing,
        admission and readiness read candidates from: a draining worker is left out, so it gets
        no new work from the next snapshot on."""
        return self._candidates[0]

    def decode_workers(self) -> tuple[WorkerInfo, ...]:
        """Serving workers that may decode (role "decode" or "both"); see prefill_workers."""
        return self._candidates[1]

    def members(self, role: Literal["prefill", "decode"]) -> tuple[WorkerInfo, ...]:
        """Every live worker of the role, draining ones included: what holds KV blocks and
        what an operator sees (views, metrics, the roles API). Never a routing candidate list."""
        if role == "prefill":
            return tuple(w for w in self.workers if w.serves_prefill)
        return tuple(w for w in self.workers if w.serves_decode)

    def by_id(self, worker_id: str) -> WorkerInfo | None:
        """The worker with this id, or None when the snapshot has none."""
        return self._by_id.get(worker_id)

    def __post_init__(self) -> None:
        # Read several times by every request routed on this snapshot (the candidates, the
        # chosen workers' entries): worked out once here rather than scanned per call.
        candidates = tuple(tuple(w for w in self.members(role) if w.state == "serving")
                           for role in ("prefill", "decode"))
        by_id: dict[str, WorkerInfo] = {}
        for w in self.workers:
            by_id.setdefault(w.worker_id, w)
        object.__setattr__(self, "_candidates", candidates)
        object.__setattr__(self, "_by_id", by_id)


SIGNATURE_FIELD = "signature"
"""The heartbeat hash field holding the HMAC (hex) of the others (all but the counters)."""
COUNTERS_SIGNATURE_FIELD = "counters_signature"
"""The HMAC of every field, counters included. The counters came after signing began and have a
signature of their own, so either side may be a release older than the other: an older router
checks `signature` and ignores the rest; a newer router reads counters only when this verifies,
and a worker of an older release (no counters, no counters_signature) still verifies."""
BUSY_SIGNATURE_FIELD = "busy_signature"
"""The HMAC of every field, the busy seconds included. Their own signature for the same reason
as the counters': a router of the release before them verifies `counters_signature` over the
fields it knows and would refuse the heartbeat if the new fields were folded into it."""
LINK_SIGNATURE_FIELD = "link_signature"
"""The HMAC of every field, the link address included (the same reason again)."""


class UnsignedEntry(ValueError):
    """A heartbeat hash without a valid signature (none, or one that does not verify)."""


@dataclass(frozen=True)
class _SignatureLevel:
    """One signature of a heartbeat: it covers the fields it adds and every earlier level's."""

    field: str
    """The hash field holding it."""
    domain: str
    """Signed first, so a heartbeat signature is never valid as any other signed message."""
    adds: tuple[str, ...]
    """The WorkerInfo fields that came with it."""
    label: str
    """What a refusal calls it."""


_LEVELS = (
    _SignatureLevel(SIGNATURE_FIELD, "pdserve-heartbeat-v1", (), "heartbeat"),
    _SignatureLevel(COUNTERS_SIGNATURE_FIELD, "pdserve-heartbeat-counters-v1", _COUNTER_FIELDS, "heartbeat counters"),
    _SignatureLevel(BUSY_SIGNATURE_FIELD, "pdserve-heartbeat-busy-v1", _BUSY_FIELDS, "heartbeat busy-time"),
    _SignatureLevel(LINK_SIGNATURE_FIELD, "pdserve-heartbeat-link-v1", _LINK_FIELDS, "heartbeat link address"),
)
"""In the order they came: a router knows the levels up to its release and checks each whose
fields the hash holds; a worker writes all it knows."""


def _signed_parts(cluster: str, text: Mapping[str, str], level: int = 0) -> list[str]:
    # Every WorkerInfo field up to the level, by name, in declaration order: a field moved,
    # dropped or changed breaks the signature. Fields of later levels are not signed by it.
    later = {name for lv in _LEVELS[level + 1:] for name in lv.adds}
    parts = [_LEVELS[level].domain, cluster]
    for f in fields(WorkerInfo):
        if f.name not in later:
            parts += [f.name, text.get(f.name, "")]
    return parts


def signed_hash(info: WorkerInfo, cluster: str, secret: bytes) -> dict[str, str]:
    """info.to_hash() plus its signature: what a worker writes when it holds the secret.
    The cluster name is signed too, so an entry copied into another cluster's keys fails."""
    text = info.to_hash()
    for i, level in enumerate(_LEVELS):
        text[level.field] = sign(secret, *_signed_parts(cluster, text, i))
    return text


def verified_info(data: Mapping[bytes | str, bytes | str], cluster: str, secret: bytes | None) -> WorkerInfo:
    """Parse a heartbeat hash (as WorkerInfo.from_hash) after checking its signature.

    secret None: no check (in-process library use and tests without a cluster secret; every
    pdserve process has one). Raises UnsignedEntry when the secret is set and the signature is
    missing or wrong (constant-time compare), or the hash holds later fields whose own signature
    is (COUNTERS_SIGNATURE_FIELD, BUSY_SIGNATURE_FIELD, LINK_SIGNATURE_FIELD); ValueError when the
    hash does not parse.
    """
    text = {_text(k): _text(v) for k, v in data.items()}
    if secret is not None:
        if text.get(SIGNATURE_FIELD) is None:
            raise UnsignedEntry("heartbeat has no signature")
        for i, level in enumerate(_LEVELS):
            if i and not any(name in text for name in level.adds):
                continue  # a worker of a release before these fields
            if not verify(secret, text.get(level.field, ""), *_signed_parts(cluster, text, i)):
                raise UnsignedEntry(f"{level.label} signature does not verify")
    return WorkerInfo.from_hash(text)
