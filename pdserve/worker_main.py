"""`pdserve prefill` / `pdserve decode`: one worker process (what Helm and Ray run)."""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import logging
import os
import time

from kv_transfer.base import KV_TRANSFER_BACKENDS, TransferConfig
from pdserve.engine_args import add_engine_args, engine_config_from_args

logger = logging.getLogger(__name__)


def add_worker_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("worker")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default: localhost only)")
    g.add_argument("--port", type=int, default=0, help="gRPC port (0: any free port)")
    g.add_argument("--metrics-port", type=int, default=0, help="HTTP /metrics port (0: any free port)")
    g.add_argument("--redis-url", default=None, help="cluster state (heartbeats); none: no registration")
    g.add_argument("--cluster", default="default", help="cluster name (Redis key prefix)")
    g.add_argument("--worker-id", default=None)
    g.add_argument("--kv-transfer", default="gloo", choices=KV_TRANSFER_BACKENDS.names())
    g.add_argument("--transfer-timeout", type=float, default=30.0, help="seconds per KV transfer step")
    g.add_argument("--heartbeat-interval", type=float, default=1.0)
    g.add_argument("--heartbeat-ttl", type=float, default=5.0)
    g.add_argument("--kv-snapshot-interval", type=float, default=10.0,
                   help="seconds between full snapshots of cached block hashes for routers")
    g.add_argument("--ready-file", default=None, help="write 'grpc_port metrics_port' here when serving")
    add_engine_args(parser)


# glibc mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8


def tune_allocator() -> None:
    """Keep a worker's C heap from growing through fragmentation: few arenas, large blocks
    mmapped (returned at free), free memory trimmed past 16 MiB. Measured by
    benchmarks/soak.py: the prefill worker's free-but-kept heap fell from ~100 MB to ~20 MB.
    A user's own MALLOC_* environment wins; a libc other than glibc is left alone."""
    if any(name.startswith("MALLOC_") for name in os.environ):
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
        for param, value in ((_M_ARENA_MAX, 2), (_M_MMAP_THRESHOLD, 1 << 20), (_M_TRIM_THRESHOLD, 16 << 20)):
            libc.mallopt(param, value)
    except (OSError, AttributeError):
        logger.debug("not glibc: allocator left as it is")


def run_worker(role: str, args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from pdserve.worker_metrics import serve_metrics
    from pdserve.worker_server import build_worker, serve
    from proto.internal_auth import require_cluster_secret

    secret = require_cluster_secret(f"pdserve {role}")  # before the model loads: fail fast
    tune_allocator()
    config = engine_config_from_args(args, parser)
    transfer = TransferConfig(host=args.host, timeout_s=args.transfer_timeout, secret=secret)
    worker = build_worker(role, config, transfer, args.kv_transfer)
    if args.worker_id:
        worker.worker_id = args.worker_id
    metrics_port = serve_metrics(worker, role, args.host, args.metrics_port)
    heartbeat = kv_events = None

    def on_ready(grpc_port: int) -> None:
        nonlocal heartbeat, kv_events
        address = f"{args.host}:{grpc_port}"
        if args.redis_url:
            from pdserve.heartbeat import HeartbeatPublisher

            from proto.auth import load_cluster_secret

            heartbeat = HeartbeatPublisher(  # Redis credentials: from the environment
                args.redis_url, args.cluster, lambda: worker_info(worker, role, address, args.host, metrics_port),
                interval_s=args.heartbeat_interval, ttl_s=args.heartbeat_ttl, secret=load_cluster_secret())
            heartbeat.start()
            from pdserve.kv_events import KVEventPublisher

            kv_events = KVEventPublisher(
                args.redis_url, args.cluster, worker.worker_id, worker.incarnation,
                worker.core.take_block_events, worker.core.cached_block_hashes,
                snapshot_interval_s=args.kv_snapshot_interval,
                retention_s=max(60.0, 2 * args.kv_snapshot_interval))
            worker.loop.add_poll_hook(kv_events.poll)
            kv_events.start()
        else:  # nobody publishes the block events: drain them, or the core keeps them all
            worker.loop.add_poll_hook(worker.core.take_block_events)
        if args.ready_file:
            with open(args.ready_file, "w") as f:
                f.write(f"{grpc_port} {metrics_port}\n")
        print(f"pdserve {role} worker {worker.worker_id}: gRPC {address}, metrics "
              f"http://{args.host}:{metrics_port}/metrics", flush=True)

    try:
        asyncio.run(serve(role, worker, args.host, args.port, secret, on_ready))
    finally:
        if kv_events is not None:
            kv_events.stop()
        if heartbeat is not None:
            heartbeat.stop()
    return 0


def worker_info(worker, role: str, address: str, host: str, metrics_port: int):
    from router.cluster_keys import WorkerInfo

    s = worker.loop.stats
    return WorkerInfo(
        worker_id=worker.worker_id, role=role, address=address,
        metrics_address=f"{host}:{metrics_port}", incarnation=worker.incarnation,
        block_size=worker.core.config.block_size, total_blocks=s.total_blocks,
        free_blocks=s.free_blocks, reserved_blocks=s.reserved_blocks, cached_blocks=s.cached_blocks,
        num_running=s.num_running, num_waiting=s.num_waiting,
        queued_prefill_tokens=s.queued_prefill_tokens, max_model_len=worker.core.max_model_len,
        updated_at=time.time(),
    )
