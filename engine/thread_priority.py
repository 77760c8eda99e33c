"""Thread priorities on a CPU worker: the engine step runs below the threads that move tokens.

On a CPU the engine's step takes whole cores, and every thread a token passes through (the
data channel's sender and receiver, the gRPC and asyncio threads that stream it) waits for a
core behind it. So the engine loop lowers its own priority (EngineConfig.engine_nice) before
its first step; the torch threads it starts inherit that.

A thread inherits its creator's nice, and raising it back needs privilege. Threads the engine
loop starts for token traffic (a data channel's sender, made when P first sends to a decode
worker) therefore go through start_at_process_priority: a starter thread, made before the
first lowering, starts them at the priority the process had.
"""

from __future__ import annotations

import os
import queue
import sys
import threading

import torch

ENGINE_NICE_CPU = 10
"""Default EngineConfig.engine_nice on CPU. Measured on the 2-core EPYC (1 prefill + 1 decode,
16 streams of 420-token prompts): token delivery delay p99 9.4-11.8 ms at 0, 6.5-7.5 at 10
(benchmarks/RESULTS.md); 19 measured the same as 10."""

START_TIMEOUT_S = 10.0
"""Longest start_at_process_priority waits for the starter thread to start a thread."""


def engine_nice_for(configured: int | None, device: torch.device) -> int:
    """EngineConfig.engine_nice resolved: None is ENGINE_NICE_CPU on CPU, 0 elsewhere."""
    if configured is not None:
        return configured
    return ENGINE_NICE_CPU if device.type == "cpu" else 0


def _per_thread() -> bool:
    """Linux only: elsewhere a thread id is no process id, and setpriority would reach the process."""
    return sys.platform.startswith("linux")


def thread_nice() -> int:
    """The calling thread's nice (the process's where nice is not per thread)."""
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id() if _per_thread() else 0)


def lower_thread_priority(steps: int) -> int | None:
    """Lower the calling thread's priority by `steps` nice steps (at most to 19); threads it starts
    from now on inherit it (but see start_at_process_priority). Returns the thread's nice, or None
    where it was left alone: steps 0, or not Linux."""
    if steps <= 0 or not _per_thread():
        return None
    _ThreadStarter.ensure()  # made at this thread's priority, before it drops
    nice = min(thread_nice() + steps, 19)
    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    return nice


def start_at_process_priority(thread: threading.Thread) -> None:
    """Start `thread` at the priority threads had before any lower_thread_priority call: from a
    lowered thread the starter thread starts it; otherwise (or before any lowering) the caller
    does. Raises what Thread.start raises, or RuntimeError when the starter does not answer
    within START_TIMEOUT_S."""
    starter = _ThreadStarter.instance
    if starter is None or thread_nice() <= starter.nice:
        thread.start()
        return
    starter.start(thread, START_TIMEOUT_S)


class _ThreadStarter:
    """One daemon thread that starts threads for callers that run below it."""

    instance: _ThreadStarter | None = None
    _made = threading.Lock()

    @classmethod
    def ensure(cls) -> None:
        with cls._made:
            if cls.instance is None:
                cls.instance = cls()

    def __init__(self) -> None:
        self.nice = thread_nice()
        self._requests: queue.SimpleQueue[tuple[threading.Thread, queue.SimpleQueue]] = queue.SimpleQueue()
        threading.Thread(target=self._run, name="thread-starter", daemon=True).start()

    def start(self, thread: threading.Thread, timeout_s: float) -> None:
        answer: queue.SimpleQueue[BaseException | None] = queue.SimpleQueue()
        self._requests.put((thread, answer))
        try:
            error = answer.get(timeout=timeout_s)
        except queue.Empty:
            raise RuntimeError(f"the thread starter did not start {thread.name} within {timeout_s:g} s") from None
        if error is not None:
            raise error

    @classmethod
    def _forget(cls) -> None:
        """After a fork: the child has no starter thread, so its first lowering makes one."""
        cls.instance = None
        cls._made = threading.Lock()

    def _run(self) -> None:
        while True:
            thread, answer = self._requests.get()
            try:
                thread.start()
            except BaseException as exc:  # handed to the caller, who raises it
                answer.put(exc)
            else:
                answer.put(None)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_ThreadStarter._forget)
