"""RecvBufferPool: D's recycled payload memory, so a transfer lands in already-touched pages.

A fresh 10-700 MB CPU buffer costs about as much to page-fault as the transfer itself, so the
decode worker hands payloads back (KVReceiver.recycle) once it has copied them into its KV
blocks, and the next transfer that fits is received into one of them.

Ownership: a buffer is either idle in the pool (counted against `budget_bytes`) or lent out
as one payload (the caller's, not counted). Channel threads take(), the worker's loop thread
put()s, so every access to the idle set holds the lock.
"""

from __future__ import annotations

import threading

import torch

from kv_transfer.base import TransferHeader
from kv_transfer.packing import TORCH_DTYPES, empty_payload

MAX_WASTE = 2
"""A buffer serves a payload only if it is at most this many times the payload's size, so a
small transfer does not hold a large buffer that a concurrent large one could have used."""


class RecvBufferPool:
    """Idle flat uint8 CPU buffers, at most `budget_bytes` of them in total. Thread-safe."""

    def __init__(self, budget_bytes: int) -> None:
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self._lock = threading.Lock()
        self._idle: list[torch.Tensor] = []  # guarded by _lock; oldest put() first
        self._idle_bytes = 0  # guarded by _lock; sum of the idle buffers' sizes

    @property
    def idle_bytes(self) -> int:
        with self._lock:
            return self._idle_bytes

    def take(self, header: TransferHeader) -> torch.Tensor:
        """A contiguous CPU payload of the header's shape and dtype, uninitialised.

        Reuses the smallest idle buffer that fits (within MAX_WASTE), else allocates a new
        one. Does not block beyond the lock. The buffer leaves the pool: the caller owns it.
        """
        need = header.payload_nbytes
        with self._lock:
            fits = [b for b in self._idle if need <= b.numel() <= MAX_WASTE * need]
            buffer = min(fits, key=torch.Tensor.numel, default=None)
            if buffer is not None:
                self._remove(buffer)
        if buffer is None:
            return empty_payload(header, "cpu")
        return buffer[:need].view(TORCH_DTYPES[header.dtype]).view(header.payload_shape)

    def put(self, payload: torch.Tensor) -> None:
        """Make the whole storage under `payload` idle again; the caller must not use it after.

        Ignores non-CPU tensors, empty ones, storage already idle, and storage larger than the
        budget. Evicts the oldest idle buffers (freeing them) to stay within budget_bytes.
        """
        storage = payload.untyped_storage()
        nbytes = storage.nbytes()
        if payload.device.type != "cpu" or nbytes == 0 or nbytes > self.budget_bytes:
            return
        buffer = torch.empty(0, dtype=torch.uint8).set_(storage)  # [nbytes], the whole storage
        with self._lock:
            if any(b.data_ptr() == buffer.data_ptr() for b in self._idle):
                return  # recycled twice: keep one entry, or two transfers would share it
            while self._idle_bytes + nbytes > self.budget_bytes:
                self._remove(self._idle[0])
            self._idle.append(buffer)
            self._idle_bytes += nbytes

    def _remove(self, buffer: torch.Tensor) -> None:
        """Called with _lock held."""
        self._idle = [b for b in self._idle if b is not buffer]
        self._idle_bytes -= buffer.numel()
