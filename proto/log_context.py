"""Who is logging: the process's identity (worker id, role) and the request being handled.

Lives in `proto` because it is the one package the router, both workers and the command line
may all import (DESIGN.md's dependency arrows); pdserve/logs.py reads it to stamp every record.
Pure: no I/O, no logging configuration.

The identity is process-wide (plain module state, so threads see it: contextvars do not reach
a thread that was started without a copy of the context). The request id is a ContextVar, so
each asyncio task (one per gRPC call or HTTP request) carries its own.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

__all__ = ["Identity", "current_request_id", "identity", "request_context", "set_identity", "set_request_id"]


@dataclass(frozen=True)
class Identity:
    role: str | None = None
    """"prefill", "decode", "router", "up"; None for a command that is no cluster component."""
    worker_id: str | None = None
    """The worker's stable name (None for the router, `up`, or a worker before its id is known)."""

    @property
    def name(self) -> str | None:
        """What a text log line shows in brackets: the worker id, else the role."""
        return self.worker_id or self.role


_identity = Identity()
_request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("pdserve_request_id", default=None)


def set_identity(role: str | None, worker_id: str | None = None) -> None:
    """Name this process in every later log line (a worker calls it again once its generated id
    is known). Any thread."""
    global _identity
    _identity = Identity(role, worker_id)


def identity() -> Identity:
    return _identity


def current_request_id() -> str | None:
    """The request the running task handles, or None."""
    return _request_id.get()


def set_request_id(request_id: str | None) -> None:
    """Name the request for the rest of the running task (each gRPC call and HTTP request runs
    in its own task with its own copy of the context, so nothing leaks to the next one). Use
    this in async generators, where a context manager may be closed in another context."""
    _request_id.set(request_id)


@contextmanager
def request_context(request_id: str | None) -> Iterator[None]:
    """Log lines inside the block name `request_id` (JSON format: the request_id field)."""
    token = _request_id.set(request_id)
    try:
        yield
    finally:
        _request_id.reset(token)
