"""The reconcile loop of `pdserve up`'s workers: desired counts in, worker processes out.

Each call to `Supervisor.step(desired)` (the local launcher calls it every ~0.5 s) never
blocks: it looks at every worker process, then

- fewer live workers of a role than desired: start new ones (ids `{role}-{n}`, the lowest n
  not in use); a worker loads in the background and counts as `starting` until it writes its
  ready file;
- more: pick one (one that waits for a restart first, then one still starting, then the
  newest) and SIGTERM it. The worker drains itself (finishes its in-flight requests within
  its drain timeout); it counts as `draining` until it exits, and is SIGKILLed if it outlives
  drain_timeout + KILL_GRACE_S;
- a worker that exits on its own (a crash, or a drain asked over its Drain RPC) while it is
  still wanted is started again under the same id (a new process: a new incarnation) after
  an exponential backoff (1 s doubling to 30 s; reset after 60 s up), as a Kubernetes
  Deployment would. Each restart is counted per role and logged with the exit code.

States of one worker slot (`WorkerSlot.state`):
    starting -> ready -> draining -> (gone)
    starting | ready -> backoff (exited on its own) -> starting
    backoff -> (gone)   (no longer wanted)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal, Protocol

from pdserve.launchers.child import describe_exit
from pdserve.specs import WORKER_ROLES, WorkerSpec

logger = logging.getLogger(__name__)

BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 30.0
BACKOFF_RESET_AFTER_S = 60.0
"""A worker up this long has recovered: its next crash restarts it after BACKOFF_FIRST_S."""
KILL_GRACE_S = 30.0
"""How long past its drain timeout a draining worker may take before it is SIGKILLed."""

SlotState = Literal["starting", "ready", "draining", "backoff"]


def restart_delay(failures: int) -> float:
    """Seconds before restart number `failures` (1, 2, 3, ...) of one worker: 1, 2, 4, ... 30."""
    return min(BACKOFF_FIRST_S * 2 ** max(failures - 1, 0), BACKOFF_MAX_S)


class Process(Protocol):
    """What the supervisor needs of a started worker: a local process
    (pdserve.launchers.child.ChildProcess) or a Ray actor (pdserve.launchers.ray.handles)."""

    @property
    def where(self) -> str:
        """Where it runs, for logs: "pid 1234", "Ray actor default-decode-0 (node 10.0.0.2)"."""
        ...

    def poll(self) -> int | None: ...
    def is_ready(self) -> bool: ...
    def terminate(self) -> None: ...
    def kill(self) -> None: ...


@dataclass
class WorkerSlot:
    """One wanted worker: its spec, and its current process (None while backing off)."""

    spec: WorkerSpec
    order: int
    """Creation order (the newest is scaled down first)."""
    process: Process | None = None
    started_at: float = 0.0
    ready: bool = False
    ever_ready: bool = False
    draining_since: float | None = None
    failures: int = 0
    """Consecutive exits without BACKOFF_RESET_AFTER_S of uptime (the backoff's exponent)."""
    restart_at: float | None = None
    last_exit: int | None = None

    @property
    def worker_id(self) -> str:
        assert self.spec.worker_id is not None, "supervised workers have ids"
        return self.spec.worker_id

    @property
    def state(self) -> SlotState:
        if self.draining_since is not None:
            return "draining"
        if self.process is None:
            return "backoff"
        return "ready" if self.ready else "starting"


class Supervisor:
    """Worker processes of every role, reconciled to desired counts. Single-threaded; the
    caller owns the loop and the clock (`now`, monotonic seconds)."""

    def __init__(self, spec_for: Callable[[str, str], WorkerSpec], launch: Callable[[WorkerSpec], Process],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._spec_for, self._launch, self._clock = spec_for, launch, clock
        self.slots: list[WorkerSlot] = []
        self.restarts: dict[str, int] = {role: 0 for role in WORKER_ROLES}
        self._created = 0

    def step(self, desired: dict[str, int]) -> None:
        """Observe every process, then start, restart or drain toward `desired` (role ->
        count; a role absent is left as it is). Never blocks."""
        now = self._clock()
        for slot in list(self.slots):
            self._observe(slot, now)
        for role, count in desired.items():
            self._reconcile(role, count, now)
        for slot in self.slots:
            if slot.state == "backoff" and slot.restart_at is not None and slot.restart_at <= now:
                self._start(slot, now)

    def counts(self) -> dict[str, dict[str, int]]:
        """role -> {"ready": n, "starting": n (backoff included), "draining": n}."""
        out = {role: {"ready": 0, "starting": 0, "draining": 0} for role in WORKER_ROLES}
        for slot in self.slots:
            state = "starting" if slot.state == "backoff" else slot.state
            out[slot.spec.role][state] += 1
        return out

    def live(self, role: str) -> list[WorkerSlot]:
        """The role's slots that count toward its desired count (all but draining ones)."""
        return [s for s in self.slots if s.spec.role == role and s.draining_since is None]

    def _observe(self, slot: WorkerSlot, now: float) -> None:
        if slot.process is None:
            return
        code = slot.process.poll()
        if code is not None:
            self._exited(slot, code, now)
            return
        if not slot.ready and slot.process.is_ready():
            slot.ready = slot.ever_ready = True
            # debug: the worker announces itself (addresses, pid, start time); one line per start
            logger.debug("worker %s (%s) is serving after %.1f s", slot.worker_id, slot.process.where,
                         now - slot.started_at)
        if slot.ready and slot.failures and now - slot.started_at >= BACKOFF_RESET_AFTER_S:
            slot.failures = 0
        overdue = slot.draining_since is not None and now - slot.draining_since > slot.spec.drain_timeout_s + KILL_GRACE_S
        if overdue:
            logger.error("worker %s still running %.0f s after SIGTERM; killing it", slot.worker_id,
                         now - slot.draining_since)
            slot.process.kill()

    def _exited(self, slot: WorkerSlot, code: int, now: float) -> None:
        slot.process, slot.ready, slot.last_exit = None, False, code
        if slot.draining_since is not None:
            logger.info("worker %s drained and %s", slot.worker_id, describe_exit(code))
            self.slots.remove(slot)
            return
        slot.failures += 1
        self.restarts[slot.spec.role] += 1
        delay = restart_delay(slot.failures)
        slot.restart_at = now + delay
        logger.error("worker %s %s; restarting it in %.0f s (restart %d of role %s)", slot.worker_id,
                     describe_exit(code), delay, self.restarts[slot.spec.role], slot.spec.role)

    def _reconcile(self, role: str, count: int, now: float) -> None:
        live = self.live(role)
        for _ in range(count - len(live)):
            slot = WorkerSlot(self._spec_for(role, self._free_id(role)), self._next_order())
            self.slots.append(slot)
            self._start(slot, now)
        for slot in _removal_order(live)[:max(len(live) - count, 0)]:
            self._remove(slot, now)

    def _remove(self, slot: WorkerSlot, now: float) -> None:
        if slot.process is None:  # backing off: nothing runs, nothing to drain
            self.slots.remove(slot)
            logger.info("worker %s is no longer wanted (it was waiting to restart)", slot.worker_id)
            return
        slot.draining_since = now
        slot.process.terminate()
        logger.info("scaling down %s: worker %s (%s) drains, then exits", slot.spec.role, slot.worker_id,
                    slot.process.where)

    def _start(self, slot: WorkerSlot, now: float) -> None:
        """Launch the slot's process; a launch that raises counts as an exit (code 1), so it is
        retried with the same backoff as a crash."""
        slot.restart_at, slot.ready, slot.started_at = None, False, now
        try:
            slot.process = self._launch(slot.spec)
        except Exception as exc:  # noqa: BLE001 — e.g. fork failed, Ray refused the actor
            logger.error("starting worker %s failed: %s", slot.worker_id, exc)
            self._exited(slot, 1, now)
            return
        logger.info("started worker %s (%s)", slot.worker_id, slot.process.where)

    def _free_id(self, role: str) -> str:
        used = {s.worker_id for s in self.slots}
        n = 0
        while f"{role}-{n}" in used:
            n += 1
        return f"{role}-{n}"

    def _next_order(self) -> int:
        self._created += 1
        return self._created

    def stop_all(self) -> None:
        """SIGTERM every running worker (each drains); slots waiting to restart are dropped."""
        now = self._clock()
        for slot in list(self.slots):
            if slot.draining_since is None:
                self._remove(slot, now)

    def kill_all(self) -> None:
        for slot in self.slots:
            if slot.process is not None:
                slot.process.kill()

    def running(self) -> list[WorkerSlot]:
        """Slots whose process has not exited yet (after a step: polled)."""
        return [s for s in self.slots if s.process is not None]


def _removal_order(live: Iterable[WorkerSlot]) -> list[WorkerSlot]:
    """Which to remove first: backing off, then starting, then ready; newest first in each."""
    rank = {"backoff": 0, "starting": 1, "ready": 2}
    return sorted(live, key=lambda s: (rank[s.state], -s.order))

