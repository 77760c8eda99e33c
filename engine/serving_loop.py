"""The engine loop of a worker process: one thread owns the EngineCore.

gRPC handlers never touch the core. They `submit` commands (plain callables run on the
loop thread between steps) and read each request's outputs from a per-request sink.
The thread sleeps on its command queue when there is nothing to step.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TypeVar

from engine.core import EngineCore
from engine.scheduler import EngineCoreOutput
from engine.thread_priority import lower_thread_priority

logger = logging.getLogger(__name__)
T = TypeVar("T")

OutputSink = Callable[[EngineCoreOutput], None]
"""Called on the loop thread with each output of its request; must not block."""


@dataclass(frozen=True)
class LoopProgress:
    """How the loop thread is doing, for a liveness probe (any thread)."""

    alive: bool
    """The thread has started and not ended."""
    last_progress_at: float
    """time.monotonic() at the end of the loop's last iteration: after a step when it had work,
    after a short idle wait when it had none. A loop stuck in a step, a command or a poll
    hook stops advancing it."""
    steps: int


class ServingLoop:
    def __init__(self, core: EngineCore, idle_hooks: list[Callable[[], None]] | None = None) -> None:
        self.core = core
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._sinks: dict[str, OutputSink] = {}
        self._poll_hooks = list(idle_hooks or [])
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.steps = 0
        self.stats = core.stats()
        """A frozen snapshot of the core, refreshed by the loop thread; safe to read anywhere."""
        self._stats_at = 0.0
        self._progress_at = time.monotonic()

    def start(self) -> None:
        self._progress_at = time.monotonic()
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._commands.put(lambda: None)
        self._thread.join(timeout)

    def progress(self) -> LoopProgress:
        """Any thread; never waits for the loop."""
        return LoopProgress(self._thread.is_alive(), self._progress_at, self.steps)

    def add_poll_hook(self, hook: Callable[[], None]) -> Future[None]:
        """Run `hook` on the loop thread every iteration (e.g. poll KV transfers), from the
        loop's next iteration on: commands run before hooks and steps, so it is in place before
        the next step. Never waits for the loop (an asyncio caller must not block on a step in
        progress); the future is done once the hook is in place."""
        return self.submit(lambda: self._poll_hooks.append(hook))

    def submit(self, command: Callable[[], T]) -> Future[T]:
        """Run `command(core)`-style work on the loop thread; the future holds its result."""
        future: Future[T] = Future()

        def run() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(command())
            except BaseException as exc:  # handed to the caller, not swallowed
                future.set_exception(exc)

        self._commands.put(run)
        return future

    def attach(self, request_id: str, sink: OutputSink) -> None:
        """Route the request's outputs to `sink` (loop thread only: call inside a command)."""
        self._sinks[request_id] = sink

    def detach(self, request_id: str) -> None:
        self._sinks.pop(request_id, None)

    def deliver(self, output: EngineCoreOutput) -> None:
        """Hand `output` to its request's sink. A sink that raises fails only its own request
        (detached and aborted, blocks freed); it must never stop this thread, which every
        other request depends on."""
        sink = self._sinks.get(output.request_id)
        if sink is not None:
            try:
                sink(output)
            except Exception:
                logger.exception("the output sink of %s failed; aborting that request", output.request_id)
                self._sinks.pop(output.request_id, None)
                self.core.abort([output.request_id])
                return
        if output.finish_reason is not None:
            self._sinks.pop(output.request_id, None)

    def _run(self) -> None:
        # Before the first step: the torch threads this thread starts inherit its priority.
        nice = lower_thread_priority(self.core.engine_nice)
        if nice is not None:
            logger.debug("engine loop thread at nice %d: threads that stream tokens take the core first", nice)
        while not self._stop.is_set():
            busy = self.core.has_work and not self.core.stalled
            try:
                # Wait for a command only when there is nothing to step (or the last step could
                # schedule nothing: only a command, a transfer or a deadline can change that);
                # poll hooks need the short timeout so transfers and deadlines progress.
                command = None if busy else self._commands.get(timeout=0.005)
            except queue.Empty:
                command = None
            if command is not None:
                command()
            self._drain_commands()
            for hook in self._poll_hooks:
                try:
                    hook()
                except Exception:
                    logger.exception("poll hook failed")
            now = time.monotonic()
            if now - self._stats_at > 0.02:
                self.stats, self._stats_at = self.core.stats(), now
            if self.core.has_work:
                try:
                    outputs = self.core.step()
                except Exception:
                    logger.exception("engine step failed; failing the running requests")
                    self._fail_running()
                    continue
                self.steps += 1
                for output in outputs:
                    self.deliver(output)
            self._progress_at = time.monotonic()

    def _drain_commands(self) -> None:
        while True:
            try:
                self._commands.get_nowait()()
            except queue.Empty:
                return

    def _fail_running(self) -> None:
        scheduler = self.core.scheduler
        ids = [r.request_id for r in (*scheduler.running, *scheduler.waiting, *scheduler.swapped)]
        for request in self.core.abort(ids):
            self.deliver(EngineCoreOutput(request.request_id, (), None, "abort", None))


def wait_until(predicate: Callable[[], bool], timeout: float, interval: float = 0.01) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


async def wait_until_async(predicate: Callable[[], bool], timeout: float, interval: float = 0.02) -> bool:
    """`wait_until` for the asyncio loop: polls without blocking it; True when `predicate`
    held within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(min(interval, max(deadline - time.monotonic(), 0.0)))
    return True
