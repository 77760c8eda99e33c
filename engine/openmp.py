"""One OpenMP pool per worker process: the engine loop's.

libgomp gives every thread that starts a parallel region with more than one thread its own pool
of helper threads, kept until that thread ends. Helpers wait for the next region by spinning
first and sleeping on a futex after, and libgomp spins only ~100 times (instead of ~300,000)
as soon as the process holds more of its threads than it may use cores. A worker that loads
its model on the main thread and steps it on the engine loop's thread holds two pools: on
2 cores every one of a decode step's ~120 regions then wakes its helper from the futex.
Measured on the 2-core EPYC, batch-1 decode with two threads (int8-activation kernel): 8.2 ms
a step where one thread both loads and steps, 18-23 ms where the main thread loaded and
another steps (benchmarks/RESULTS.md, 2026-11-28).

So a worker builds its engine on a thread that ends once built (its pool goes with it), the
engine loop's thread is the only one that runs regions of several threads, and any other
thread that touches tensors asks for one OpenMP thread first (`one_openmp_thread_here`).
"""

from __future__ import annotations

import ctypes
import functools
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


@functools.cache
def _libgomp() -> ctypes.CDLL | None:
    """The libgomp torch loaded (by its soname: the dynamic linker hands back the loaded copy);
    None where there is none (a torch built without OpenMP)."""
    try:
        return ctypes.CDLL("libgomp.so.1")
    except OSError:
        return None


def one_openmp_thread_here() -> None:
    """Regions started by the calling thread run on it alone, and torch's ops on it too.

    torch's own set_num_threads would also change the count every thread reads when it first
    runs an op, so this sets only the calling thread's OpenMP setting, after torch has applied
    its count to this thread (torch does that once per thread, on first use)."""
    import torch  # here, so that importing this module (worker_runtime.process) loads no torch

    torch.get_num_threads()  # torch's once-per-thread setup, so it cannot override what follows
    gomp = _libgomp()
    if gomp is not None:
        gomp.omp_set_num_threads(1)


def build_on_passing_thread(build: Callable[[], T], name: str = "engine-build") -> T:
    """`build()` run on a thread that ends when it returns, so the OpenMP helpers the build
    started (loading and packing weights use every thread) end with it; then the calling
    thread is kept to one OpenMP thread. The build's exception is raised here. A signal on the
    calling thread (KeyboardInterrupt) interrupts the wait; the build thread is a daemon."""
    result: list[T] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            result.append(build())
        except BaseException as exc:  # handed to the caller
            error.append(exc)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    thread.join()
    if error:
        raise error[0]
    one_openmp_thread_here()
    return result[0]
