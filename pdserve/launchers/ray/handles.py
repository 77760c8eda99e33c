"""Driver-side handles: Ray actors behind the interfaces the local launcher already drives.

ActorProcess is the supervisor's Process (pdserve/launchers/supervisor.py): poll() / is_ready()
never block (ray.wait with timeout 0), terminate() asks the actor to drain, kill() is ray.kill.
So the reconcile loop, its restarts and backoff, and the stop order are the local launcher's
own, whichever launcher places the processes.

RemoteRedis is EmbeddedRedis's interface (running, port, url, restart, stop) over a RedisActor,
so the local launcher's Redis supervision works unchanged; each call is bounded.
"""

from __future__ import annotations

import logging
import signal

import ray
import ray.util.state
from ray.exceptions import GetTimeoutError, RayActorError

logger = logging.getLogger(__name__)

CALL_TIMEOUT_S = 10.0
"""Bound of one blocking call to an actor (Redis start/restart: its own start bound is 10 s)."""
ACTOR_DIED = -signal.SIGKILL
"""The exit code reported for an actor that died (killed, its node lost, or crashed hard)."""


class ActorProcess:
    """One component actor, started: run() and wait_ready() are in flight from the start."""

    def __init__(self, name: str, handle) -> None:
        self.name, self.handle = name, handle
        self._run = handle.run.remote()
        self._ready = handle.wait_ready.remote()
        self._info: dict[str, object] | None = None
        self._code: int | None = None
        self.warned = False
        """The launcher has reported that Ray has not placed it yet."""

    @property
    def pid(self) -> int:
        return int(self._info["pid"]) if self._info else 0

    @property
    def where(self) -> str:
        if not self._info:
            return f"Ray actor {self.name}, placing"
        return f"Ray actor {self.name} on {self._info['node']}, pid {self._info['pid']}"

    @property
    def info(self) -> dict[str, object] | None:
        """wait_ready()'s answer once serving: address, node, pid, ports."""
        return self._info

    def placed(self) -> bool:
        """Ray has placed the actor (its process exists), whether or not it serves yet. Asks
        Ray's GCS (bounded); True when the answer does not come, so nothing is reported wrongly."""
        try:
            state = ray.util.state.get_actor(self.handle._actor_id.hex(), timeout=5)  # noqa: SLF001
        except Exception:  # noqa: BLE001 — no state API (no dashboard): assume placed
            return True
        return state is None or state.state != "PENDING_CREATION"

    def poll(self) -> int | None:
        """The exit code once run() has returned or the actor died; never blocks. The actor is
        then released (ray.kill), so its process and resources go back to Ray."""
        if self._code is not None:
            return self._code
        done, _ = ray.wait([self._run], timeout=0)
        if not done:
            return None
        try:
            self._code = int(ray.get(self._run, timeout=CALL_TIMEOUT_S))
        except RayActorError as exc:
            logger.error("Ray actor %s died: %s", self.name, first_line(exc))
            self._code = ACTOR_DIED
        except Exception as exc:  # noqa: BLE001 — any other failure of the call is an exit too
            logger.error("Ray actor %s failed: %s", self.name, first_line(exc))
            self._code = 1
        self.kill()
        return self._code

    def is_ready(self) -> bool:
        """It serves (wait_ready answered ok). Never blocks."""
        if self._info is not None:
            return True
        done, _ = ray.wait([self._ready], timeout=0)
        if not done:
            return False
        try:
            answer = ray.get(self._ready, timeout=CALL_TIMEOUT_S)
        except Exception:  # noqa: BLE001 — the actor died; poll() reports it
            return False
        if answer.get("ok"):
            self._info = answer
        return self._info is not None

    def terminate(self) -> None:
        """Drain, as SIGTERM does to a local worker (fire and forget). An actor not serving yet
        (unplaced, or loading its model) has nothing to drain and is removed at once, as SIGTERM
        ends a local worker that has not installed its drain handler yet."""
        if self.is_ready():
            self.handle.drain.remote(False)
        else:
            self.kill()

    def kill(self) -> None:
        try:
            ray.kill(self.handle, no_restart=True)
        except Exception:  # noqa: BLE001 — already gone
            pass


class RemoteRedis:
    """The embedded Redis in a RedisActor, with EmbeddedRedis's interface for LocalCluster."""

    def __init__(self, handle) -> None:
        self.handle = handle
        self._state = self._call(handle.start)

    @property
    def url(self) -> str:
        return str(self._state["url"])

    @property
    def password(self) -> str:
        return str(self._state["password"])

    @property
    def port(self) -> int:
        return int(self._state["port"])

    @property
    def running(self) -> bool:
        try:
            self._state = self._call(self.handle.describe)
        except (GetTimeoutError, RayActorError) as exc:
            logger.error("the Redis actor does not answer: %s", first_line(exc))
            return True  # nothing to restart in place; the workers' own Redis errors say the rest
        return bool(self._state["running"])

    @property
    def returncode(self) -> int | None:
        return self._state.get("returncode")  # type: ignore[return-value]

    def restart(self) -> RemoteRedis:
        self._state = self._call(self.handle.restart)
        return self

    def stop(self) -> None:
        try:
            self._call(self.handle.stop)
        except Exception as exc:  # noqa: BLE001 — killed next anyway
            logger.warning("stopping the Redis actor: %s", first_line(exc))
        try:
            ray.kill(self.handle, no_restart=True)
        except Exception:  # noqa: BLE001 — already gone
            pass

    @staticmethod
    def _call(method):
        return ray.get(method.remote(), timeout=CALL_TIMEOUT_S)


def first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:300]
