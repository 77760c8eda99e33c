"""Component specs: a router or a worker as a typed, launchable unit.

A spec is frozen and validated at construction. It is built from command-line flags (or a
YAML --config file of the same flag names) and turned back into a command line in exactly one
place (`to_argv`), which every launcher and scaler uses: `pdserve up`'s supervisor, the Helm
chart's rendering, the Ray launcher. None of them rebuilds argv itself.

Secrets are never part of a spec: the cluster secret, the Redis password, the API and admin
keys reach a process through its environment (proto/auth.py, router/redis_settings.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Literal, get_args

from engine.config import EngineConfig

WorkerRole = Literal["prefill", "decode"]
WORKER_ROLES: tuple[str, ...] = get_args(WorkerRole)

_ENGINE_NOT_FLAGS = frozenset({"weights_cache_dir"})
"""EngineConfig fields with no command-line flag (set by the process itself)."""
_ENGINE_BOOL_FLAGS = frozenset({"enable_prefix_caching", "cpu_packed_weights"})
"""BooleanOptionalAction flags: --name / --no-name."""


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def engine_argv(engine: EngineConfig) -> list[str]:
    """The engine flags that differ from EngineConfig's defaults (so a child takes the same
    defaults as its parent for everything not set)."""
    defaults = EngineConfig()
    argv: list[str] = []
    for f in fields(EngineConfig):
        value, default = getattr(engine, f.name), getattr(defaults, f.name)
        if f.name in _ENGINE_NOT_FLAGS or value == default:
            continue
        if f.name in _ENGINE_BOOL_FLAGS:
            argv.append(_flag(f.name) if value else "--no-" + f.name.replace("_", "-"))
        elif value is not None:
            argv += [_flag(f.name), str(value)]
    return argv


@dataclass(frozen=True)
class WorkerSpec:
    """One prefill or decode worker process."""

    role: WorkerRole
    engine: EngineConfig = field(default_factory=EngineConfig)
    worker_id: str | None = None
    """Stable name (survives restarts; each start gets a new incarnation). None: generated."""
    host: str = "127.0.0.1"
    """Address to bind and to advertise (localhost only by default)."""
    port: int = 0
    """gRPC port (0: any free port)."""
    metrics_port: int = 0
    """HTTP /metrics port (0: any free port)."""
    redis_url: str | None = None
    """Cluster state (heartbeats, block events); None: the worker does not register."""
    cluster: str = "default"
    kv_transfer: str = "gloo"
    """KV transfer backend name (kv_transfer.base.KV_TRANSFER_BACKENDS)."""
    transfer_timeout_s: float = 30.0
    heartbeat_interval_s: float = 1.0
    heartbeat_ttl_s: float = 5.0
    kv_snapshot_interval_s: float = 10.0
    drain_timeout_s: float = 60.0
    """On SIGTERM or Drain: the longest wait for in-flight requests before they end with an
    explicit error."""
    ready_file: str | None = None
    """Written with 'grpc_port metrics_port' once serving (how a launcher learns the ports)."""
    log_level: str = "INFO"

    def __post_init__(self) -> None:
        if self.role not in WORKER_ROLES:
            raise ValueError(f"role must be one of {', '.join(WORKER_ROLES)}; got {self.role!r}")
        for name in ("port", "metrics_port"):
            if not 0 <= getattr(self, name) <= 65535:
                raise ValueError(f"{name} must be 0..65535; got {getattr(self, name)}")
        for name in ("transfer_timeout_s", "heartbeat_interval_s", "heartbeat_ttl_s",
                     "kv_snapshot_interval_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0; got {getattr(self, name)}")
        if self.drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s must be >= 0; got {self.drain_timeout_s}")
        if self.heartbeat_ttl_s <= self.heartbeat_interval_s:
            raise ValueError(f"heartbeat_ttl_s ({self.heartbeat_ttl_s}) must exceed heartbeat_interval_s "
                             f"({self.heartbeat_interval_s}), or a live worker's entry expires")
        if not self.cluster:
            raise ValueError("cluster must not be empty")

    def to_argv(self) -> list[str]:
        """`pdserve <role> ...`: the arguments (after the program) that run this spec."""
        argv = [self.role, "--host", self.host, "--port", str(self.port),
                "--metrics-port", str(self.metrics_port), "--cluster", self.cluster,
                "--kv-transfer", self.kv_transfer, "--transfer-timeout", str(self.transfer_timeout_s),
                "--heartbeat-interval", str(self.heartbeat_interval_s),
                "--heartbeat-ttl", str(self.heartbeat_ttl_s),
                "--kv-snapshot-interval", str(self.kv_snapshot_interval_s),
                "--drain-timeout", str(self.drain_timeout_s), "--log-level", self.log_level]
        for flag, value in (("--worker-id", self.worker_id), ("--redis-url", self.redis_url),
                            ("--ready-file", self.ready_file)):
            if value is not None:
                argv += [flag, value]
        return argv + engine_argv(self.engine)
