"""RayCluster: `pdserve up --launcher ray`, the local launcher's cluster with Ray actors.

Same start order (Redis, the workers until each serves, the router), same reconcile loop
(pdserve/launchers/supervisor.py: desired counts from Redis, restarts with backoff, drain on
scale-down), same stop order (router, workers draining, Redis) as LocalCluster, which it
extends: only what starts a process differs. Each worker is a ComponentActor placed by Ray with
its role's resources (placement.py); the router and the embedded Redis are actors pinned to
this node. The actors are not detached: they belong to this driver, so if `pdserve up` itself
is killed, Ray removes them too.

A dead actor is replaced by our supervisor, not by Ray's actor restart (max_restarts=0): the
replacement keeps the worker id, is counted per role in /v1/roles and the restart metric, waits
out the same backoff as a local process, and is never raced by Ray into a slot that a scale-down
is removing.

Before anything starts, a named `controller` actor is created in the namespace
`pdserve-{cluster}`: a second `pdserve up --launcher ray` for the same cluster on the same Ray
cluster is refused, and `pdserve down --launcher ray` asks this driver to stop through it (the
driver drains and removes everything it created, exactly as on Ctrl-C).

Without --ray-address a local Ray instance is started for this run (its dashboard on
127.0.0.1) and shut down at the end; with one, the driver only disconnects, leaving the Ray
cluster as it found it.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from pdserve.launchers.local import LocalCluster, Signals
from pdserve.launchers.ray.actors import ACTOR_CLASSES, RedisActor
from pdserve.launchers.ray.handles import ActorProcess, RemoteRedis, first_line
from pdserve.launchers.ray.placement import NODE_ADDRESS, placements_from_args, worker_host
from pdserve.specs import RouterSpec, WorkerSpec
from proto.auth import CLUSTER_SECRET_ENV
from router.cluster.redis_settings import PASSWORD_ENV, RedisAuth, USERNAME_ENV

logger = logging.getLogger(__name__)

SECRET_VARS = (CLUSTER_SECRET_ENV, USERNAME_ENV, PASSWORD_ENV, "PDSERVE_API_KEY", "PDSERVE_ADMIN_KEY")
"""What an actor gets of the driver's environment: the secrets, as values (a *_FILE path on
this node means nothing on another)."""
CONTROLLER = "controller"
PLACEMENT_WARNING_S = 30.0
"""A worker actor not placed after this long is reported (once), with what it needs."""
NAME_RELEASE_S = 5.0
"""How long a new actor waits for Ray to release the name of its killed predecessor."""
DOWN_TIMEOUT_S = 180.0


def namespace_of(cluster: str) -> str:
    return f"pdserve-{cluster}"


def actor_secrets(env: dict[str, str]) -> dict[str, str]:
    """The secret variables of `env`, each as a value (VAR, else the contents of VAR_FILE)."""
    out = {}
    for name in SECRET_VARS:
        if env.get(name):
            out[name] = env[name]
        elif env.get(f"{name}_FILE"):
            out[name] = Path(env[f"{name}_FILE"]).read_text().strip()
    return out


@ray.remote(num_cpus=0, max_concurrency=2)
class Controller:
    """The running `pdserve up --launcher ray`'s mailbox: its presence claims the cluster name,
    and `pdserve down` leaves a stop request here."""

    def __init__(self, description: str) -> None:
        self._description, self._stop = description, False

    def request_stop(self) -> str:
        self._stop = True
        return self._description

    def stop_requested(self) -> bool:
        return self._stop


class RayCluster(LocalCluster):
    kind = "ray"
    scaler = "ray"

    def __init__(self, args: argparse.Namespace, signals: Signals | None = None) -> None:
        super().__init__(args, signals)
        self.placements = placements_from_args(args)
        self.namespace = namespace_of(args.cluster)
        self.bind = worker_host(args.ray_worker_host, args.ray_address, args.host)
        self.actor_env: dict[str, str] = {}
        self.started_ray = False
        self.controller = None
        self.node_id: str | None = None
        self.dashboard: str | None = None

    # ------------------------------------------------------------------ start
    def start_state(self) -> None:
        self._connect()
        super().start_state()
        self.actor_env = actor_secrets(self.env)

    def _connect(self) -> None:
        address = self.args.ray_address
        if not sys.stdout.isatty():  # a log file: Ray's actor prefixes without terminal colours
            os.environ.setdefault("RAY_COLOR_PREFIX", "0")
        try:
            context = ray.init(address=address, namespace=self.namespace, log_to_driver=True,
                               include_dashboard=None if address else True,
                               dashboard_host="127.0.0.1", configure_logging=False)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            where = f"the Ray cluster at {address}" if address else "a local Ray instance"
            raise RuntimeError(f"cannot connect to {where}: {first_line(exc)}") from None
        self.started_ray = address is None
        self.signals.install()  # ray.init installs its own SIGINT/SIGTERM handlers in the driver
        self.node_id = ray.get_runtime_context().get_node_id()
        self.dashboard = getattr(context, "dashboard_url", None) or None
        try:
            self.controller = Controller.options(name=CONTROLLER, lifetime=None).remote(
                f"pdserve up --launcher ray (cluster {self.args.cluster!r})")
            ray.get(self.controller.stop_requested.remote(), timeout=60)
        except ValueError:
            self.controller = None
            raise RuntimeError(f"cluster {self.args.cluster!r} is already running on this Ray cluster "
                               f"(namespace {self.namespace}); stop it with `pdserve down --launcher ray`") from None
        where = "a local Ray instance" if self.started_ray else f"the Ray cluster at {address}"
        logger.info("on %s (node %s, namespace %s); workers bind %s", where, ray.util.get_node_ip_address(),
                    self.namespace, "their node's address" if self.bind == NODE_ADDRESS else self.bind)

    def _here(self) -> NodeAffinitySchedulingStrategy:
        return NodeAffinitySchedulingStrategy(node_id=self.node_id, soft=False)

    def _redis(self) -> tuple[str, RedisAuth]:
        if self.args.redis_url is not None:
            return super()._redis()
        handle = RedisActor.options(name="redis", scheduling_strategy=self._here()).remote(
            self.bind, (self.args.port, self.args.grpc_port))
        self.redis = RemoteRedis(handle)
        return self.redis.url, RedisAuth(password=self.redis.password)

    def threads_of(self, role: str) -> int:
        return self.args.num_threads or self.placements[role].threads()

    def gpu_share_of(self, role: str) -> float | None:
        return self.args.gpu_memory_utilization  # each actor has GPUs of its own (num_gpus)

    def _launch(self, spec: WorkerSpec) -> ActorProcess:
        name = spec.worker_id or spec.role
        spec = replace(spec, ready_file=None)  # actors report readiness through wait_ready()
        options = self.placements[spec.role].actor_options()
        return ActorProcess(name, _create(spec.role, name, options, spec.to_argv(), self.actor_env,
                                          self.bind == NODE_ADDRESS))

    def _launch_router(self, spec: RouterSpec) -> ActorProcess:
        spec = replace(spec, ready_file=None)
        options = {"num_cpus": 0, "scheduling_strategy": self._here()}
        return ActorProcess("router", _create("router", "router", options, spec.to_argv(), self.actor_env, False))

    def describe(self) -> str:
        where = "local Ray instance" if self.started_ray else f"Ray cluster {self.args.ray_address}"
        dashboard = f", Ray dashboard http://{self.dashboard}" if self.dashboard else ""
        placement = "; ".join(f"{role} {p.describe()}" for role, p in self.placements.items())
        return (f"ray: {where} (namespace {self.namespace}{dashboard}); per actor: {placement}\n"
                + super().describe())

    # ------------------------------------------------------------------ running
    def reconcile(self) -> None:
        super().reconcile()
        self._warn_unplaced()
        if self.controller is not None and self._stop_requested():
            if self.signals.count == 0:
                print("\npdserve up: `pdserve down` asked to stop (draining)", flush=True)
                self.signals.count = 1

    def _warn_unplaced(self) -> None:
        """Say once per actor when Ray has not placed it within PLACEMENT_WARNING_S (no node has
        its role's resources free): it stays `starting` until a node has them."""
        now = time.monotonic()
        for slot in self.supervisor.slots:
            process = slot.process
            if (isinstance(process, ActorProcess) and process.info is None and not process.warned
                    and now - slot.started_at > PLACEMENT_WARNING_S and not process.placed()):
                process.warned = True
                free = {k: v for k, v in ray.available_resources().items() if not k.startswith("node:")}
                logger.warning("worker %s has waited %.0f s for Ray to place it: it needs %s; free in the Ray "
                               "cluster: %s", slot.worker_id, now - slot.started_at,
                               self.placements[slot.spec.role].describe(), _resources_text(free))

    def _stop_requested(self) -> bool:
        try:
            return bool(ray.get(self.controller.stop_requested.remote(), timeout=5))
        except Exception:  # noqa: BLE001 — a missing mailbox must not stop the cluster
            return False

    # ------------------------------------------------------------------ stop
    def stop(self) -> None:
        try:
            super().stop()
        finally:
            self._release()

    def _release(self) -> None:
        """Whatever actor is left (a second Ctrl-C, a failed start) is killed; then the
        controller; then Ray: shut down if we started it, else only disconnected."""
        if not ray.is_initialized():
            return
        for slot in self.supervisor.slots:
            if slot.process is not None:
                slot.process.kill()
        if self.router is not None:
            self.router.kill()
        if self.controller is not None:
            ray.kill(self.controller, no_restart=True)
        ray.shutdown()


def _create(component: str, name: str, options: dict, argv: list[str], env: dict[str, str], bind_node: bool):
    """A new named actor. The name of an incarnation just killed (a restart, or an id reused
    right after its drain) is released by Ray asynchronously: wait for it (NAME_RELEASE_S), then
    kill whatever still holds it (only a dead incarnation of ours can) and wait once more.
    Raises RuntimeError when the name stays taken (the supervisor retries with backoff)."""
    actor_class = ACTOR_CLASSES[component]
    for attempt in (1, 2):
        deadline = time.monotonic() + NAME_RELEASE_S
        while time.monotonic() < deadline:
            try:
                return actor_class.options(name=name, **options).remote(name, argv, env, bind_node)
            except ValueError:
                time.sleep(0.1)
        if attempt == 1:
            logger.warning("Ray still holds the actor name %s; killing the old incarnation", name)
            _kill_named(name)
    raise RuntimeError(f"the Ray actor name {name} stays taken")


def _resources_text(resources: dict[str, float]) -> str:
    shown = {k: v for k, v in resources.items() if k not in ("memory", "object_store_memory")}
    return ", ".join(f"{v:g} {k}" for k, v in sorted(shown.items())) or "nothing"


def _kill_named(name: str) -> None:
    try:
        ray.kill(ray.get_actor(name), no_restart=True)
    except ValueError:
        pass


def run_down(args: argparse.Namespace) -> int:
    """`pdserve down --launcher ray`: ask the running driver of --cluster to stop (it drains and
    removes its actors), and wait until its actors are gone (bounded)."""
    try:
        ray.init(address=args.ray_address or "auto", namespace=namespace_of(args.cluster), log_to_driver=False,
                 configure_logging=False)
    except Exception as exc:  # noqa: BLE001 — no cluster there, or its token missing: one line, no traceback
        print(f"pdserve down: cannot connect to the Ray cluster at {args.ray_address}: {first_line(exc)}",
              file=sys.stderr, flush=True)
        return 1
    try:
        try:
            controller = ray.get_actor(CONTROLLER)
        except ValueError:
            print(f"pdserve down: no pdserve cluster {args.cluster!r} runs on this Ray cluster", flush=True)
            return 1
        print(f"pdserve down: stopping {ray.get(controller.request_stop.remote(), timeout=30)}", flush=True)
        deadline = time.monotonic() + args.timeout
        while time.monotonic() < deadline:
            if not _named_actors(namespace_of(args.cluster)):
                print("pdserve down: stopped; no actor of the cluster is left", flush=True)
                return 0
            time.sleep(0.5)
        print(f"pdserve down: actors still present after {args.timeout:g} s: "
              f"{', '.join(_named_actors(namespace_of(args.cluster)))}", flush=True)
        return 1
    finally:
        ray.shutdown()


def _named_actors(namespace: str) -> list[str]:
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == namespace)
