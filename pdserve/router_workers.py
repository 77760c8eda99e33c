"""`--router-workers N`: one router served by N processes that share its ports.

One Python process tops out at one core (the request path is event-loop work), so a router may
run N copies of itself on the same HTTP and gRPC ports (SO_REUSEPORT: the kernel spreads new
connections over them; a keep-alive connection stays with its process). Cluster state is shared
through Redis as it is between separate routers; per-process state stays per process: the
admission queue, the request metrics behind /metrics, the ops history and timelines, the
prefix index (each process follows the block-event stream itself).

Lifecycle: process 0 is the one that was started (by a user or by `pdserve up`). It binds the
ports, then starts processes 1..N-1 with the same RouterSpec (the ports it bound, its own
router_workers = 1, the hidden `--router-worker-index i`; keys through the environment, never
argv) and reports ready only when all are. It restarts one that exits (at most once per
RESTART_INTERVAL_S each), and stops them all when it stops: SIGTERM, then SIGKILL after
STOP_TIMEOUT_S. Each of them asks the kernel for SIGTERM if process 0 dies first (Linux), so
none outlives it.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import dataclasses
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 60.0
"""Longest process 0 waits for the others to serve before it gives up starting."""
STOP_TIMEOUT_S = 10.0
"""Longest a stopping process may take before it is killed."""
RESTART_INTERVAL_S = 5.0
"""A process that exits is restarted at most this often."""
WORKER_HEADER = "x-pdserve-router-worker"
"""Response header naming the process that answered (only when N > 1)."""
_PR_SET_PDEATHSIG = 1


def add_router_workers_args(g) -> None:
    """--router-workers (router and `pdserve up`) and the hidden --router-worker-index."""
    g.add_argument("--router-workers", type=int, default=1,
                   help="router processes sharing the HTTP and gRPC ports (SO_REUSEPORT); state is per process")


def add_router_worker_index_arg(g) -> None:
    g.add_argument("--router-worker-index", type=int, default=0,
                   help="internal: set by process 0 of --router-workers on the processes it starts")


def reuse_port_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port that other processes of this user may bind too."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host.strip("[]"), port))
    sock.listen(2048)  # uvicorn's default backlog
    return sock


READY_DIR_PREFIX = "pdserve-router-workers-"
"""The temp folder that holds processes 1..N-1's ready files."""


def die_with_parent() -> None:
    """Ask Linux to SIGTERM this process when its parent (process 0) dies; elsewhere a no-op."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() == 1:  # the parent died before prctl: do not linger
        os.kill(os.getpid(), signal.SIGTERM)


def forget_ready_file(ready_file: Path) -> None:
    """In process i > 0, as it stops: remove its ready file, and the folder process 0 made for
    them once empty. Process 0 does the same when it stops them; when it was killed (SIGKILL),
    nobody else would, and a folder was left in the temp dir each time."""
    ready_file.unlink(missing_ok=True)
    if ready_file.parent.name.startswith(READY_DIR_PREFIX):
        try:
            ready_file.parent.rmdir()
        except OSError:  # another process's file is still there: the last one out removes it
            pass


def child_env(api_key: str | None, admin_key: str | None) -> dict[str, str]:
    """Process 0's environment, plus the keys it resolved (a flag's value included): the others
    read them from there, never from argv."""
    env = dict(os.environ)
    for name, key in (("PDSERVE_API_KEY", api_key), ("PDSERVE_ADMIN_KEY", admin_key)):
        if key is not None:
            env[name] = key
    return env


def child_argv(args: argparse.Namespace, index: int, http_port: int, grpc_port: int, ready_file: Path) -> list[str]:
    """`python -m pdserve router ...` for process `index`: process 0's spec on the bound ports."""
    from pdserve.specs import RouterSpec

    spec = dataclasses.replace(RouterSpec.from_args(args), port=http_port, grpc_port=grpc_port,
                               ready_file=str(ready_file), router_workers=1)
    return [sys.executable, "-m", "pdserve", *spec.to_argv(), "--router-worker-index", str(index)]


@dataclasses.dataclass
class _Child:
    index: int
    ready_file: Path
    process: subprocess.Popen
    started_at: float


class RouterWorkers:
    """Processes 1..N-1 of a router, run by process 0. Not thread-safe; one per router."""

    def __init__(self, args: argparse.Namespace, http_port: int, grpc_port: int, env: dict[str, str]) -> None:
        self._args, self._ports, self._env = args, (http_port, grpc_port), env
        self._dir = Path(tempfile.mkdtemp(prefix=READY_DIR_PREFIX))
        self._children: dict[int, _Child] = {}
        self._stopping = False

    @property
    def pids(self) -> list[int]:
        return [c.process.pid for c in self._children.values()]

    def _spawn(self, index: int) -> _Child:
        ready = self._dir / f"router-{index}.ready"
        ready.unlink(missing_ok=True)
        argv = child_argv(self._args, index, *self._ports, ready)
        # Its own process group: a Ctrl-C in the terminal reaches process 0 only, which stops the
        # rest. Not its own session: where the kernel schedules by autogroup, CPU is shared between
        # sessions before nice counts, and the workers' engines (EngineConfig.engine_nice) should
        # rank below every router process on the host, as they do below process 0.
        process = subprocess.Popen(argv, env=self._env, process_group=0)
        return _Child(index, ready, process, time.monotonic())

    async def start(self, count: int) -> None:
        """Start processes 1..count-1 and wait until each serves. Raises RuntimeError (after
        stopping those started) if one exits or is not serving within START_TIMEOUT_S."""
        for index in range(1, count):
            self._children[index] = self._spawn(index)
        deadline = time.monotonic() + START_TIMEOUT_S
        try:
            while not all(c.ready_file.exists() and c.ready_file.read_text().strip() for c in self._children.values()):
                for c in self._children.values():
                    if c.process.poll() is not None:
                        raise RuntimeError(f"router process {c.index} exited with {c.process.returncode} while starting")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"router processes did not serve within {START_TIMEOUT_S:.0f} s")
                await asyncio.sleep(0.1)
        except BaseException:
            await self.stop()
            raise
        logger.info("router serving from %d processes (pids %s)", count, [os.getpid(), *self.pids])

    def restart_exited(self) -> list[int]:
        """Restart the processes that exited (rate-limited); returns their indexes."""
        restarted = []
        for index, c in list(self._children.items()):
            if self._stopping or c.process.poll() is None or time.monotonic() - c.started_at < RESTART_INTERVAL_S:
                continue
            logger.error("router process %d (pid %d) exited with %s; restarting it", index, c.process.pid,
                         c.process.returncode)
            self._children[index] = self._spawn(index)
            restarted.append(index)
        return restarted

    async def supervise(self, interval_s: float = 1.0) -> None:
        """restart_exited() every interval_s until cancelled."""
        while True:
            await asyncio.sleep(interval_s)
            self.restart_exited()

    async def stop(self) -> None:
        """SIGTERM every process, SIGKILL those still running after STOP_TIMEOUT_S. Idempotent."""
        self._stopping = True
        running = [c.process for c in self._children.values() if c.process.poll() is None]
        for process in running:
            process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while any(p.poll() is None for p in running) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for process in running:
            if process.poll() is None:
                logger.warning("router process %d did not stop within %.0f s; killing it", process.pid,
                               STOP_TIMEOUT_S)
                process.kill()
                process.wait(timeout=STOP_TIMEOUT_S)
        for c in self._children.values():
            c.ready_file.unlink(missing_ok=True)
        try:
            self._dir.rmdir()
        except OSError:
            pass


def http_sockets(args: argparse.Namespace) -> list[socket.socket] | None:
    """The shared HTTP socket when this router runs as several processes, else None (uvicorn
    binds as usual)."""
    if getattr(args, "router_workers", 1) <= 1 and getattr(args, "router_worker_index", 0) == 0:
        return None
    return [reuse_port_socket(args.host, args.port)]


async def start_router_processes(args: argparse.Namespace, http_port: int, grpc_port: int,
                                 api_key: str | None, admin_key: str | None):
    """In process 0 of N > 1: start the others and their supervision; returns a stop coroutine
    function (None when there is nothing to stop). In process i > 0: ties it to process 0."""
    if getattr(args, "router_worker_index", 0) > 0:
        die_with_parent()
        return None
    count = getattr(args, "router_workers", 1)
    if count <= 1:
        return None
    workers = RouterWorkers(args, http_port, grpc_port, child_env(api_key, admin_key))
    await workers.start(count)
    supervisor = asyncio.create_task(workers.supervise(), name="router-workers")

    async def stop() -> None:
        supervisor.cancel()
        await asyncio.gather(supervisor, return_exceptions=True)
        await workers.stop()

    return stop
