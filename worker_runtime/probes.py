"""A worker's Kubernetes probes, served on its metrics HTTP port beside /metrics.

    GET /startupz  200 once the model is loaded and the gRPC server serves (before the model
                   loads nothing listens on the port at all: the probe fails the same way)
    GET /livez     200 unless the engine loop is wedged: its thread ended, or it has not
                   finished an iteration (a step when it has work; a short idle wait when it
                   has none) for --liveness-stall seconds. Draining does not fail it: a drain
                   must not be cut short by a restart.
    GET /readyz    200 only when serving: started, registered in Redis (when the worker uses
                   Redis: at least one heartbeat written and the last one succeeded), the loop
                   alive as /livez says, and not draining
Every failure answers 503 with the reason as one line of text (what `kubectl describe pod`
shows). The checks are pure reads of the process's state, any thread, never blocking.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from engine.serving_loop import LoopProgress
from worker_runtime.status import WorkerState

__all__ = ["ProbeResult", "WorkerProbes", "with_probe_routes"]


@dataclass(frozen=True)
class ProbeResult:
    ok: bool
    reason: str
    """"ok", or why not (one line)."""

    @property
    def http_status(self) -> str:
        return "200 OK" if self.ok else "503 Service Unavailable"


OK = ProbeResult(True, "ok")


class WorkerProbes:
    """The three checks over a worker process's state, read through callables (so the probes
    hold no reference to the process)."""

    def __init__(self, state: Callable[[], WorkerState], serving: Callable[[], bool],
                 registration_problem: Callable[[], str | None], progress: Callable[[], LoopProgress],
                 stall_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        """state: the process's WorkerState. serving: the gRPC server has started.
        registration_problem: None when registered (or no Redis), else why not. stall_s: the
        longest an iteration of the engine loop may take before /livez fails."""
        if not stall_s > 0:
            raise ValueError(f"stall_s must be > 0; got {stall_s}")
        self._state, self._serving, self._registration = state, serving, registration_problem
        self._progress, self._stall_s, self._clock = progress, stall_s, clock

    def startup(self) -> ProbeResult:
        return OK if self._serving() else ProbeResult(False, "starting: the gRPC server is not serving yet")

    def liveness(self) -> ProbeResult:
        progress = self._progress()
        if not progress.alive:
            return ProbeResult(False, "the engine loop thread is not running")
        stalled = self._clock() - progress.last_progress_at
        if stalled > self._stall_s:
            return ProbeResult(False, f"the engine loop has made no progress for {stalled:.1f} s "
                                      f"(--liveness-stall {self._stall_s:g}; {progress.steps} steps so far)")
        return OK

    def readiness(self) -> ProbeResult:
        state = self._state()
        if state is not WorkerState.SERVING:
            return ProbeResult(False, f"{state.value}: not taking new requests")
        for result in (self.liveness(), self._registered()):
            if not result.ok:
                return result
        return OK

    def routes(self) -> dict[str, Callable[[], ProbeResult]]:
        return {"/startupz": self.startup, "/livez": self.liveness, "/readyz": self.readiness}

    def _registered(self) -> ProbeResult:
        problem = self._registration()
        return OK if problem is None else ProbeResult(False, problem)


def with_probe_routes(app: Callable, routes: Mapping[str, Callable[[], ProbeResult]]) -> Callable:
    """A WSGI app answering GET `routes` (plain text) and passing every other path to `app`."""

    def dispatch(environ: dict, start_response: Callable) -> Iterable[bytes]:
        check = routes.get(environ.get("PATH_INFO", ""))
        if check is None:
            return app(environ, start_response)
        result = check()
        body = (result.reason + "\n").encode()
        start_response(result.http_status, [("Content-Type", "text/plain; charset=utf-8"),
                                            ("Content-Length", str(len(body))), ("Cache-Control", "no-store")])
        return [body]

    return dispatch
