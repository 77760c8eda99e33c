"""`pdserve prefill` / `pdserve decode`: one worker process (what Helm and Ray run).

Thin on purpose: flags (and --config FILE.yaml) -> a WorkerSpec -> worker_runtime's
WorkerProcess, which builds, serves and drains the worker."""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import sys

from engine.capacity import KVCacheTooSmall
from kv_transfer.base import KV_TRANSFER_BACKENDS
from pdserve.engine_args import add_engine_args, parse_redis_url
from pdserve.preflight import check_engine_settings, port_problem, redis_auth_problem
from pdserve.specs import WorkerSpec

logger = logging.getLogger(__name__)


def add_worker_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("worker")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (127.0.0.1: this host only)")
    g.add_argument("--advertise-host", default=None,
                   help="address peers dial (Redis registration, tickets, KV data channel); default: --host")
    g.add_argument("--port", type=int, default=0, help="gRPC port (0: any free port)")
    g.add_argument("--metrics-port", type=int, default=0,
                   help="HTTP port of /metrics and /livez, /readyz, /startupz (0: any free port)")
    g.add_argument("--link-port", type=int, default=0,
                   help="port of the worker link, the routers' request plane (0: any free port; -1: none, "
                        "routers then call over gRPC)")
    g.add_argument("--redis-url", type=parse_redis_url, default=None,
                   help="cluster state (heartbeats); none: no registration")
    g.add_argument("--cluster", default="default", help="cluster name (Redis key prefix)")
    g.add_argument("--worker-id", default=None,
                   help="name in the cluster state and logs (default: ROLE-<8 random hex digits>)")
    g.add_argument("--kv-transfer", default="gloo", choices=KV_TRANSFER_BACKENDS.names(),
                   help="KV transfer backend between prefill and decode workers")
    g.add_argument("--transfer-timeout", type=float, default=30.0, help="seconds per KV transfer step")
    g.add_argument("--heartbeat-interval", type=float, default=1.0, help="seconds between heartbeats written to Redis")
    g.add_argument("--heartbeat-ttl", type=float, default=5.0,
                   help="seconds a heartbeat lives in Redis: a worker silent this long leaves the routers' view")
    g.add_argument("--kv-snapshot-interval", type=float, default=10.0,
                   help="seconds between full snapshots of cached block hashes for routers")
    g.add_argument("--drain-timeout", type=float, default=60.0,
                   help="on SIGTERM/SIGINT or a Drain call: seconds in-flight requests get to finish "
                        "before they end with an error (a second signal stops at once)")
    g.add_argument("--liveness-stall", type=float, default=60.0,
                   help="seconds the engine loop may have work without finishing a step before /livez fails")
    g.add_argument("--ready-file", default=None, help="write 'grpc_port metrics_port' here when serving")
    from pdserve.logs import add_log_args

    add_log_args(parser.add_argument_group("logging"))
    add_engine_args(parser)


# glibc mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8


def tune_allocator() -> None:
    """Keep a worker's per-step temporaries in the C heap between steps, and its big blocks
    returned at free: 2 arenas (fewer heaps to fragment, benchmarks/soak.py), blocks over
    32 MiB mmapped, free heap kept up to 256 MiB before it is trimmed.

    Why: the engine steps on its own thread, in one of glibc's per-thread arenas, and every
    step allocates and frees the same few MB of activations and gathered KV. With the 1 MiB
    mmap threshold and 16 MiB trim set here before (for a smaller idle heap in
    benchmarks/soak.py), and with glibc's defaults alike, those blocks went back to the kernel
    each step and came back as page faults: 41% of the served decode thread's CPU was system
    time, and a batch-16 step took 152-195 ms against 65 ms in process. With these values the
    system time is gone and the step takes 72-79 ms (benchmarks/RESULTS.md, 2026-11-24); the
    arena cap measured the same as none within the runs' spread. The price is up to 256 MiB of
    freed heap a worker may keep.
    A user's own MALLOC_* environment wins; a libc other than glibc is left alone."""
    if any(name.startswith("MALLOC_") for name in os.environ):
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
        for param, value in ((_M_ARENA_MAX, 2), (_M_MMAP_THRESHOLD, 32 << 20), (_M_TRIM_THRESHOLD, 256 << 20)):
            libc.mallopt(param, value)
    except (OSError, AttributeError):
        logger.debug("not glibc: allocator left as it is")


def worker_spec_from_args(role: str, args: argparse.Namespace, parser: argparse.ArgumentParser) -> WorkerSpec:
    """The WorkerSpec the flags (and --config file) describe; an invalid value exits through
    parser.error with the reason (no traceback). The inverse of WorkerSpec.to_argv()."""
    try:
        return WorkerSpec.from_args(args, role)
    except ValueError as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits


def preflight(role: str, spec: WorkerSpec) -> int | None:
    """What the worker would refuse after loading its model, checked before (pdserve.preflight):
    None when all is well, else the exit code after one line on stderr, no traceback: 2 for an
    engine setting, 1 for a port that is taken or Redis credentials that cannot be read."""
    problem = port_problem(spec.host, (("--port", spec.port), ("--metrics-port", spec.metrics_port),
                                          *((("--link-port", spec.link_port),) if spec.link_port > 0 else ())))
    if problem is not None or (spec.redis_url and (problem := redis_auth_problem()) is not None):
        print(f"pdserve {role}: {problem}", file=sys.stderr, flush=True)
        return 1
    try:  # after the ports: this one imports torch
        check_engine_settings(spec.engine)
    except (ValueError, OSError) as exc:
        print(f"pdserve {role}: {exc}", file=sys.stderr, flush=True)
        return 2
    return None


def run_worker(role: str, args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from proto.internal_auth import require_cluster_secret

    spec = worker_spec_from_args(role, args, parser)
    secret = require_cluster_secret(f"pdserve {role}")  # before the model loads: fail fast
    if (code := preflight(role, spec)) is not None:
        return code
    from worker_runtime.process import WorkerProcess  # torch, the engine: after the checks

    tune_allocator()
    try:
        return WorkerProcess(spec, secret).run()
    except KVCacheTooSmall as exc:  # a setting, found once the model is read: one line, no traceback
        print(f"pdserve {role}: {exc}", file=sys.stderr, flush=True)
        return 2
