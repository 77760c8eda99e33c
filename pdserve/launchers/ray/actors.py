"""The Ray actors of `pdserve up --launcher ray`. Every node of the Ray cluster must have pdserve
installed (the classes are imported there by name, not shipped).

ComponentActor hosts one component in its own process, in-process (no extra child): a worker
(worker_runtime.process.WorkerProcess) or the router (pdserve.router_main.serve_router), built
from the command line its spec wrote (`WorkerSpec.to_argv()` / `RouterSpec.to_argv()`), parsed
by the same parser as `pdserve prefill|decode|router`. Its methods (a threaded actor):

    run()         builds and serves until drained or stopped; returns the exit code (0 drained)
    wait_ready()  returns once serving: {"ok", "address", "node", "pid", "ports"}; ok False if
                  run() ended first
    drain(forced) what SIGTERM (or a second one) does to a `pdserve prefill|decode|router`

Secrets reach the actor as a constructor argument (a dict of strings, sent over Ray's
authenticated channel) and are put into its process environment, where the component reads
them (proto/auth.py, router/cluster/redis_settings.py) as it does under `pdserve up`; they are never in
argv and never in a runtime_env (which Ray's state API shows). Only strings, lists and dicts
cross Ray here (msgpack-serialisable, no pickled objects of ours).

RedisActor owns the embedded Redis (pdserve.redis_server.EmbeddedRedis) on its node.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time

import ray

logger = logging.getLogger(__name__)

READY_TIMEOUT_S = 900.0
"""wait_ready's own bound (a model load on a slow node included)."""


def _configure_logging(argv: list[str], role: str, worker_id: str | None) -> None:
    """As `pdserve prefill|decode|router` configures itself (pdserve/logs.py): its level and
    format flags, every line naming the component."""
    from pdserve.logs import configure_logging

    configure_logging(_flag_value(argv, "--log-level") or "INFO", _flag_value(argv, "--log-format") or "text",
                      role, worker_id)


class ComponentActor:
    """One worker or the router (made a Ray actor class per role below, so `ray list actors`
    names the role). max_restarts 0: pdserve's supervisor replaces a dead actor (counted, with
    backoff, under the same worker id), not Ray."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], bind_node: bool) -> None:
        os.environ.update(env)
        _configure_logging(argv, argv[0], _flag_value(argv, "--worker-id"))
        self._name, self._argv, self._bind_node = name, list(argv), bind_node
        self._ready = threading.Event()
        self._done = threading.Event()
        self._info: dict[str, object] = {}
        self._worker = None  # WorkerProcess
        self._router_loop: asyncio.AbstractEventLoop | None = None
        self._router_stop: asyncio.Event | None = None

    def __repr__(self) -> str:  # Ray prefixes the actor's log lines with it
        return self._name

    def run(self) -> int:
        """Serve until drained (0), stopped at once (1) or failed (1, the reason logged)."""
        try:
            if self._argv[0] == "router":
                return self._run_router()
            return self._run_worker()
        except SystemExit as exc:  # a parser error or a refused setting: one line already said why
            return exc.code if isinstance(exc.code, int) else 1
        except Exception:  # noqa: BLE001 — the actor's log gets the traceback; the supervisor the code
            logger.exception("%s failed", self._name)
            return 1
        finally:
            self._done.set()

    def wait_ready(self) -> dict[str, object]:
        """Blocks until the component serves, run() ends, or READY_TIMEOUT_S."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not self._ready.wait(0.2):
            if self._done.is_set() or time.monotonic() > deadline:
                return {"ok": False, "pid": os.getpid(), "node": ray.util.get_node_ip_address()}
        return {"ok": True, **self._info}

    def drain(self, forced: bool = False) -> bool:
        """Start the drain (forced: stop at once). False when not serving yet, or done."""
        if self._worker is not None:
            return self._worker.drain_threadsafe(forced)
        loop, stop = self._router_loop, self._router_stop
        if loop is None or stop is None or loop.is_closed():
            return False
        loop.call_soon_threadsafe(stop.set)
        return True

    # ------------------------------------------------------------------ components
    def _run_worker(self) -> int:
        from dataclasses import replace

        from engine.capacity import KVCacheTooSmall
        from pdserve.cli import build_parser
        from pdserve.specs import WorkerSpec
        from pdserve.worker_main import preflight, tune_allocator
        from proto.internal_auth import require_cluster_secret
        from worker_runtime.process import WorkerProcess

        role = self._argv[0]
        spec = WorkerSpec.from_args(build_parser().parse_args(self._argv), role)
        if self._bind_node:  # bind and advertise this node's address, whatever `up --host` said
            spec = replace(spec, host=ray.util.get_node_ip_address(), advertise_host=None)
        secret = require_cluster_secret(f"pdserve {role}")
        if (code := preflight(role, spec)) is not None:  # on this node: its model file, its device
            return code
        tune_allocator()
        self._worker = WorkerProcess(spec, secret, handle_signals=False)
        watcher = threading.Thread(target=self._watch_worker, name="ready-watch", daemon=True)
        watcher.start()
        try:
            return self._worker.run()
        except KVCacheTooSmall as exc:  # a setting, found once the model is read: one line, no traceback
            logger.error("%s: %s", self._name, exc)
            return 2

    def _watch_worker(self) -> None:
        worker = self._worker
        while not worker.serving.wait(0.2):
            if self._done.is_set():
                return
        self._info = {"address": worker.address, "node": worker.spec.host, "pid": os.getpid(),
                      "ports": [int(worker.address.rsplit(":", 1)[1]), worker.metrics_port]}
        self._ready.set()

    def _run_router(self) -> int:
        from pdserve.cli import build_parser
        from pdserve.router_main import serve_router

        args = build_parser().parse_args(self._argv)

        def on_ready(http_port: int, grpc_port: int) -> None:
            self._info = {"address": f"{args.host}:{http_port}", "node": ray.util.get_node_ip_address(),
                          "pid": os.getpid(), "ports": [http_port, grpc_port]}
            self._ready.set()

        async def main() -> None:
            self._router_stop = asyncio.Event()
            self._router_loop = asyncio.get_running_loop()
            await serve_router(args, self._router_stop, on_ready)

        asyncio.run(main())
        logger.info("router stopped")
        return 0


def _actor_class(name: str):
    """A Ray actor class named `name` (its CLASS_NAME in `ray list actors`) hosting one component;
    threaded (max_concurrency), so drain() and wait_ready() run while run() serves."""
    return ray.remote(max_restarts=0, max_concurrency=8)(type(name, (ComponentActor,), {"__module__": __name__}))


PrefillWorker = _actor_class("PrefillWorker")
DecodeWorker = _actor_class("DecodeWorker")
Router = _actor_class("Router")
ACTOR_CLASSES = {"prefill": PrefillWorker, "decode": DecodeWorker, "router": Router}
"""component -> its actor class."""


@ray.remote(max_restarts=0, max_concurrency=4, num_cpus=0)
class RedisActor:
    """The embedded Redis of a Ray-launched cluster, on the node this actor is placed on."""

    def __init__(self, host: str, avoid_ports: tuple[int, ...] = ()) -> None:
        """avoid_ports: what its free port pick must not take (the router's --port and
        --grpc-port, bound only after Redis is up; the router may be on this node)."""
        _configure_logging([], "redis", None)
        from pdserve.redis_server import EmbeddedRedis

        self._redis = EmbeddedRedis(host=ray.util.get_node_ip_address() if host == "node" else host,
                                    avoid_ports=avoid_ports)

    def __repr__(self) -> str:
        return "redis"

    def start(self) -> dict[str, object]:
        """Starts it (blocks until PING answers); {"url", "password", "port", "pid"}."""
        self._redis.start()
        return self.describe()

    def describe(self) -> dict[str, object]:
        return {"url": self._redis.url, "password": self._redis.password, "port": self._redis.port,
                "pid": self._redis.pid, "running": self._redis.running, "returncode": self._redis.returncode}

    def restart(self) -> dict[str, object]:
        self._redis.restart()
        return self.describe()

    def stop(self) -> None:
        self._redis.stop()


def _flag_value(argv: list[str], flag: str) -> str | None:
    if flag in argv and argv.index(flag) + 1 < len(argv):
        return argv[argv.index(flag) + 1]
    return None
