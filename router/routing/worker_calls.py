"""Bounds on the router's calls to workers, and what their failures mean.

Every internal call has a deadline, so a silent worker (stopped, wedged, partitioned) ends the
request with an explicit error instead of holding a client, a stream and admission accounting
forever. A decode worker's refusal is read by one rule: only its explicit no-room mark means
"wait for room"; any other error is the request's own, immediate and truthful.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import grpc

from proto.limits import NO_ROOM_METADATA_KEY
from proto.link.calls import LinkStreamCall
from router.errors import InvalidRequest, WorkerFailure


@dataclass(frozen=True)
class WorkerTimeouts:
    """Deadlines of the router's calls to workers, in seconds."""

    prefill_s: float = 60.0
    """One Prefill call (queue + compute + KV transfer) on one prefill worker; past it the
    next prefill worker is tried, then the decode worker's own prefill."""
    stream_idle_s: float = 30.0
    """Longest a decode stream may send nothing (its ticket included) before the request ends
    with an explicit error. A healthy decode worker steps every running request each
    iteration (well under a second even under load), so 30 s of silence means it is stopped
    or wedged, while a request briefly preempted under KV pressure is not cut off."""
    abort_s: float = 5.0
    """One Abort call (best effort: the worker may be gone)."""

    def __post_init__(self) -> None:
        for name in ("prefill_s", "stream_idle_s", "abort_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0; got {getattr(self, name)}")


class WorkerSilent(WorkerFailure):
    """A worker sent nothing within its deadline (the request has been cancelled there)."""


async def read_within(stream, timeout_s: float, what: str):
    """The next message of a stream call (grpc.aio's or the worker link's; a message already
    received comes at once, with no deadline armed), or WorkerSilent after `timeout_s` of
    nothing (the call is cancelled then). Raises the stream's AioRpcError as is."""
    try:
        if isinstance(stream, LinkStreamCall):  # bounds its own wait (one timer, no task bookkeeping)
            return await stream.read(timeout_s)
        async with asyncio.timeout(timeout_s):  # not wait_for: 3.11's may swallow a cancellation
            return await stream.read()
    except TimeoutError:
        stream.cancel()
        raise WorkerSilent(f"{what} sent nothing for {timeout_s:g} s") from None


def is_no_room(exc: grpc.aio.AioRpcError) -> bool:
    """True only for a decode worker's marked "no KV room now" refusal. gRPC answers
    RESOURCE_EXHAUSTED itself for a message above a size limit, which waiting never cures."""
    if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
        return False
    return any(key == NO_ROOM_METADATA_KEY and value == "1" for key, value in (exc.trailing_metadata() or ()))


def request_error(exc: grpc.aio.AioRpcError) -> InvalidRequest | None:
    """The request's own fault, which no other worker and no waiting would cure, or None."""
    details = exc.details() or ""
    if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidRequest(details or "invalid request")
    if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in details:
        return InvalidRequest(f"the request is too large for the cluster's internal messages ({details})")
    return None


def decode_call_error(exc: grpc.aio.AioRpcError, worker_id: str) -> Exception:
    """The truthful error for a decode worker's failure other than no-room or unavailable."""
    return request_error(exc) or WorkerFailure(f"decode worker {worker_id}: {exc.code().name}: {exc.details()}")
