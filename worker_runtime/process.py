"""One worker process: a WorkerSpec turned into a served, registered, drainable worker.

`WorkerProcess(spec, secret).run()` builds the role's worker (worker_runtime/roles.py), then

    STARTING  gRPC server (cluster-auth interceptor; health and reflection open for probes),
              the worker link (proto/link: the routers' request plane, the same servicer),
              /metrics and the probes (probes.py), heartbeat and block events into Redis,
              the ready file once the first heartbeat was tried (routers can see it)
      -> SERVING   until the first SIGTERM/SIGINT, or a Drain RPC (the servicer's request_drain)
      -> DRAINING  marked "draining" in Redis at once (one beat, not the next interval), gRPC
                   health NOT_SERVING; one router snapshot period later (routers have stopped
                   choosing it) the worker drains: in-flight requests finish, or end with an
                   explicit error past spec.drain_timeout_s
      -> STOPPED   gRPC server and link stopped (grace), heartbeat stopped (its Redis entry deleted),
                   block events stopped, worker stopped; run() returns 0
    A second signal during the drain stops at once (in-flight calls end CANCELLED); run()
    returns 1. SIGINT and SIGTERM are the same here: a supervisor should start workers in their
    own session, so a terminal's Ctrl-C (sent to the whole foreground process group) does not
    count as a worker's first signal on top of the supervisor's SIGTERM.

Heartbeat, metrics and the drain read the worker only through `status()`: a frozen
WorkerStatus, with the process's own DRAINING state laid over the worker's.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
import time
from dataclasses import replace
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from engine.openmp import build_on_passing_thread
from proto.heap import settle_heap
from proto.internal_auth import ClusterAuthServerInterceptor
from proto.link import LinkServer
from proto.log_context import set_identity
from proto.limits import grpc_message_options
from worker_runtime.metrics import WorkerCollector, capacity_metrics, serve_metrics, served_model_name
from worker_runtime.probes import WorkerProbes
from worker_runtime.roles import role_def
from worker_runtime.stats_log import WorkerStatsLog
from worker_runtime.status import DrainResult, WorkerState, WorkerStatus

if TYPE_CHECKING:  # the spec is pdserve's; the runtime only reads its fields
    from pdserve.specs import WorkerSpec

__all__ = ["ROUTER_SNAPSHOT_PERIOD_S", "WorkerProcess"]

logger = logging.getLogger(__name__)

ROUTER_SNAPSHOT_PERIOD_S = 0.2
"""A router's view of Redis is at most this old (router/cluster/state.py caches <= 100 ms, plus
the read): a worker marked draining waits this long before it refuses new work, so no router
still picks it from an older snapshot."""
STOP_GRACE_S = 2.0
"""After a drain, the longest gRPC calls (a last chunk, a GetLoad) get to finish."""
FIRST_BEAT_WAIT_S = 5.0
"""The longest the ready file waits for the first heartbeat's try (each try gives up after the
Redis client's timeout, at most 1 s; this only bounds a stuck thread)."""


class WorkerProcess:
    """Hosts one worker in this process; see the module docstring for its lifecycle."""

    def __init__(self, spec: WorkerSpec, secret: bytes, *, handle_signals: bool = True) -> None:
        """secret: the cluster secret (callers prove it; it signs heartbeats and admits a
        prefill to a data channel). handle_signals False: the host is not this process's main
        thread (a Ray actor); it drains through drain_threadsafe() instead of SIGTERM. Raises
        KeyError for a role with no registry entry."""
        self._created = time.monotonic()
        self.spec = spec
        self._handle_signals = handle_signals
        self.serving = threading.Event()
        """Set once the worker serves (its address and metrics_port are known); any thread."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self.role = role_def(spec.role)
        self._secret = secret
        self.state = WorkerState.STARTING
        self.worker = None
        self.address: str | None = None
        self.link_address = ""
        """host:port of the worker link once serving; "" without one (spec.link_port -1)."""
        self.metrics_port: int | None = None
        self.drain_result: DrainResult | None = None
        self.probes: WorkerProbes | None = None
        """/startupz, /livez, /readyz on the metrics port; set once that server starts."""
        self._grpc_serving = False
        self._server: grpc.aio.Server | None = None
        self._link: LinkServer | None = None
        self._health = None
        self._metrics_server = None
        self._heartbeat = None
        self._kv_events = None
        self._stats_log: WorkerStatsLog | None = None
        self._signals = 0
        self._forced = False
        self._drain_on_start = False
        """A first signal came before the servers were up: serve() drains once they are."""
        self._stopping: asyncio.Event | None = None
        self._drain_task: asyncio.Task | None = None

    # ------------------------------------------------------------------ running
    def run(self) -> int:
        """Build the worker (loads the model), serve until stopped; the exit code (0 after a
        drain, 1 when a second signal cut it short, 130 when interrupted while loading:
        nothing was registered yet, so there is nothing to drain)."""
        try:
            # The build's OpenMP pool ends with its thread: the engine loop's is then the only
            # one, and its helpers spin between a step's regions (engine.openmp).
            self.worker = build_on_passing_thread(lambda: self.role.build(self.spec, self._secret))
        except KeyboardInterrupt:
            logger.info("%s worker interrupted while starting", self.spec.role)
            return 130
        set_identity(self.spec.role, self.worker.worker_id)  # every later log line names it
        return asyncio.run(self.serve())

    async def serve(self) -> int:
        """Serve the built worker until a drain ends or a second signal; then stop everything."""
        self._stopping = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        self.worker.start()
        try:
            # Handlers before the ready file and the "serving" line: a signal sent the moment a
            # supervisor sees either drains (asyncio.run's own SIGINT handler would cancel serve()).
            if self._handle_signals:
                self._install_signal_handlers()
            await self._start()
            self.serving.set()
            if self._drain_on_start:  # a signal came while starting: drain now that there is a server
                self.begin_drain(self.spec.drain_timeout_s)
            await self._stopping.wait()
        finally:
            await self._shutdown()
        return 1 if self._forced else 0

    def status(self) -> WorkerStatus:
        """The worker's frozen status, DRAINING from the moment this process started draining
        (before the worker itself refuses work). Any thread."""
        status = self.worker.status()
        if self.state is WorkerState.DRAINING and status.state is not WorkerState.DRAINING:
            return replace(status, state=WorkerState.DRAINING)
        return status

    # ------------------------------------------------------------------ draining
    def request_drain(self, timeout_s: float | None = None) -> tuple[bool, int]:
        """The servicers' Drain hook (on the serving loop): start the drain unless one is under
        way; (started, requests in flight now). timeout_s None: the spec's drain timeout."""
        started = self.begin_drain(self.spec.drain_timeout_s if timeout_s is None else timeout_s)
        return started, self.status().in_flight

    def begin_drain(self, timeout_s: float) -> bool:
        """Start the drain as a task on the serving loop (call on that loop). Idempotent: False
        when a drain or stop is already under way."""
        if self._stopping is None or self._drain_task is not None or self._stopping.is_set():
            return False
        self._drain_task = asyncio.get_running_loop().create_task(self._drain(timeout_s))
        return True

    async def _drain(self, timeout_s: float) -> None:
        start = time.monotonic()
        try:
            self.state = WorkerState.DRAINING
            await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
            if self._heartbeat is not None:  # routers learn it now, not at the next interval
                await asyncio.to_thread(self._heartbeat.beat)
            await asyncio.sleep(ROUTER_SNAPSHOT_PERIOD_S)
            logger.info("%s worker %s draining: %d in flight, timeout %g s", self.spec.role,
                        self.worker.worker_id, self.status().in_flight, timeout_s)
            result = await self.worker.drain(timeout_s)
            self.drain_result = result
            logger.info("%s worker %s drained in %.2f s: %d finished, %d aborted at the timeout",
                        self.spec.role, self.worker.worker_id, time.monotonic() - start,
                        result.finished, result.aborted)
        except Exception:
            logger.exception("draining %s failed; stopping now", self.worker.worker_id)
        finally:
            self._stopping.set()

    def drain_threadsafe(self, forced: bool = False) -> bool:
        """From any thread (a Ray actor's method): start the drain (forced: stop at once, as a
        second signal does). False when the worker is not serving yet or already stopping."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return False
        loop.call_soon_threadsafe(self._stop_now if forced else self.begin_drain, self.spec.drain_timeout_s)
        return True

    def _stop_now(self, _timeout_s: float = 0.0) -> None:
        logger.warning("stopping at once, %d request(s) in flight end with an error", self.status().in_flight)
        self._forced = True
        self._stopping.set()

    def _on_signal(self, signum: int) -> None:
        self._signals += 1
        name = signal.Signals(signum).name
        if self._signals == 1:
            logger.info("%s: draining (a second signal stops at once)", name)
            if self.serving.is_set():
                self.begin_drain(self.spec.drain_timeout_s)
            else:
                self._drain_on_start = True
            return
        logger.warning("%s again: stopping at once, %d request(s) in flight end with an error",
                       name, self.status().in_flight)
        self._forced = True
        self._stopping.set()

    def _install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, self._on_signal, signum)

    # ------------------------------------------------------------------ start and stop
    async def _start(self) -> None:
        spec = self.spec
        # Message limits above anything the router accepts (a 2 MiB request's prompt, stops, logprobs).
        self._server = grpc.aio.server(interceptors=[ClusterAuthServerInterceptor(self._secret)],
                                       options=grpc_message_options())
        port = self._server.add_insecure_port(f"{spec.host}:{spec.port}")
        self.address = f"{spec.advertised_host}:{port}"  # what peers dial; the bind may be 0.0.0.0
        servicer = self._servicer()
        self.role.add_to_server(servicer, self._server)
        self._health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        reflection.enable_server_reflection(
            (self.role.service_name, health.SERVICE_NAME, reflection.SERVICE_NAME), self._server)
        self._start_metrics()
        settle_heap()  # the model, tokenizer and servers are built: freeze them before serving
        await self._server.start()
        if spec.link_port >= 0 and self.role.link_methods:
            self._link = LinkServer(self._secret, servicer, self.role.link_methods, spec.host, spec.link_port)
            self.link_address = f"{spec.advertised_host}:{await self._link.start()}"
        self._grpc_serving = True
        if self.state is WorkerState.STARTING:  # a Drain call may have come in the moment the server started
            await self._set_health(health_pb2.HealthCheckResponse.SERVING)
            self.state = WorkerState.SERVING
        self._start_publishers()
        if self.spec.log_stats_interval_s > 0:
            self._stats_log = WorkerStatsLog(self.status, self.spec.log_stats_interval_s)
            self._stats_log.start()
        if self._heartbeat is not None:
            # Ready means routers can see it: the first heartbeat is tried before the ready file
            # is written (bounded: a beat gives up after the Redis client's socket timeout).
            await asyncio.to_thread(self._heartbeat.wait_first_beat, FIRST_BEAT_WAIT_S)
        self._announce(port)

    def _servicer(self):
        """The role's servicer, with this process's address and drain hook."""
        return self.role.make_servicer(self.worker, self.address, self.request_drain)

    def _start_metrics(self) -> None:
        core = self.worker.core
        model_name = served_model_name(core.config, core.model_path)
        labels = {"model_name": model_name, "role": self.spec.role, "worker_id": self.worker.worker_id}
        collector = WorkerCollector(self.status, capacity_metrics(core, labels), model_name)
        self.probes = WorkerProbes(lambda: self.state, lambda: self._grpc_serving, self._registration_problem,
                                   self.worker.loop.progress, self.spec.liveness_stall_s)
        self._metrics_server, self.metrics_port = serve_metrics(collector, self.spec.host, self.spec.metrics_port,
                                                                self.probes.routes())

    def _registration_problem(self) -> str | None:
        """/readyz's "registered": None when routers can see this worker (or it uses no Redis)."""
        if self.spec.redis_url is None:
            return None
        heartbeat = self._heartbeat
        if heartbeat is None or heartbeat.beats == 0:
            return "not registered in Redis yet"
        return None if heartbeat.redis_ok else "heartbeats to Redis are failing (routers may drop this worker)"

    def _start_publishers(self) -> None:
        spec, worker = self.spec, self.worker
        if spec.redis_url is None:  # nobody publishes the block events: drain them, or the core keeps them all
            worker.loop.add_poll_hook(worker.core.take_block_events)
            return
        from worker_runtime.heartbeat import HeartbeatPublisher, heartbeat_info
        from worker_runtime.kv_events import KVEventPublisher

        metrics_address = f"{spec.advertised_host}:{self.metrics_port}"
        self._heartbeat = HeartbeatPublisher(  # Redis credentials: from the environment
            spec.redis_url, spec.cluster, lambda: heartbeat_info(self.status(), self.address, metrics_address, self.link_address),
            interval_s=spec.heartbeat_interval_s, ttl_s=spec.heartbeat_ttl_s, secret=self._secret)
        self._heartbeat.start()
        self._kv_events = KVEventPublisher(
            spec.redis_url, spec.cluster, worker.worker_id, worker.incarnation,
            worker.core.take_block_events, worker.core.cached_block_hashes,
            snapshot_interval_s=spec.kv_snapshot_interval_s, retention_s=max(60.0, 2 * spec.kv_snapshot_interval_s))
        worker.loop.add_poll_hook(self._kv_events.poll)
        self._kv_events.start()

    def _announce(self, port: int) -> None:
        if self.spec.ready_file:
            with open(self.spec.ready_file, "w") as f:
                f.write(f"{port} {self.metrics_port}\n")
        # The one start line (a supervisor does not repeat it): a log line, not a print, so it is
        # named and formatted like every other line of the worker.
        logger.info("%s worker %s serving: gRPC %s, metrics http://%s:%d/metrics, link %s (pid %d, started in %.1f s)",
                    self.spec.role, self.worker.worker_id, self.address, self.spec.advertised_host,
                    self.metrics_port, self.link_address or "none", os.getpid(), time.monotonic() - self._created)

    async def _shutdown(self) -> None:
        """Stop in dependency order, each step bounded: calls first, then the Redis entries,
        then the engine."""
        if self._drain_task is not None and not self._drain_task.done():
            self._drain_task.cancel()
            await asyncio.gather(self._drain_task, return_exceptions=True)
        grace = 0 if self._forced else STOP_GRACE_S
        stops = [s.stop(grace) for s in (self._server, self._link) if s is not None]
        await asyncio.gather(*stops)
        for publisher in (self._heartbeat, self._kv_events, self._stats_log):
            if publisher is not None:
                await asyncio.to_thread(publisher.stop)
        await asyncio.to_thread(self.worker.stop)
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            # and its socket closed: a stopped worker's port refuses probes and scrapes (shut
            # down but open, it accepted them into the backlog and never answered).
            self._metrics_server.server_close()
        self.state = WorkerState.STOPPED
        logger.info("%s worker %s stopped%s", self.spec.role, self.worker.worker_id,
                    " at once (second signal)" if self._forced else "")

    async def _set_health(self, status: int) -> None:
        if self._health is not None:
            for name in ("", self.role.service_name):
                await self._health.set(name, status)
