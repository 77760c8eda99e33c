"""Component specs: a router or a worker as a typed, launchable unit.

A spec is frozen and validated at construction. It is built from command-line flags (or a
YAML --config file of the same flag names, expanded into flags by pdserve.engine_args before
parsing) and turned back into a command line in exactly one place (`to_argv`), which every
launcher and scaler uses: `pdserve up`'s supervisor, the Helm chart's rendering, the Ray
launcher. None of them rebuilds argv itself.

Field names map to flags by one rule: drop a `_s` (seconds) suffix, then `_` -> `-`
(`drain_timeout_s` <-> `--drain-timeout`). `from_args` and `to_argv` both follow it.

Secrets are never part of a spec: the cluster secret, the Redis password, the API and admin
keys reach a process through its environment (proto/auth.py, router/cluster/redis_settings.py).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, fields
from typing import Any, Literal, get_args

from engine.config import EngineConfig
from pdserve.logs import DEFAULT_LOG_STATS_INTERVAL_S, LOG_FORMATS, LogFormat

WorkerRole = Literal["prefill", "decode"]
WORKER_ROLES: tuple[str, ...] = get_args(WorkerRole)

_ENGINE_NOT_FLAGS = frozenset({"weights_cache_dir"})
"""EngineConfig fields with no command-line flag (set by the process itself)."""
_ENGINE_BOOL_FLAGS = frozenset({"enable_prefix_caching", "cpu_packed_weights", "cpu_attention_kernel",
                                "cpu_int4_kernel", "cpu_kv_huge_pages"})
"""BooleanOptionalAction flags: --name / --no-name."""


def dest_of(field_name: str) -> str:
    """The argparse dest of a spec field: `drain_timeout_s` -> `drain_timeout`."""
    return field_name.removesuffix("_s")


def flag_of(field_name: str) -> str:
    """The flag of a spec field: `drain_timeout_s` -> `--drain-timeout`."""
    return "--" + dest_of(field_name).replace("_", "-")


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


def engine_config_from(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig of a parsed command line (its engine flags; others are ignored).
    Raises ValueError naming the bad setting."""
    values = {name: getattr(args, name) for name in EngineConfig.field_names()
              if name not in _ENGINE_NOT_FLAGS and hasattr(args, name)}
    return EngineConfig(**values)


def _values_from(cls: type, args: argparse.Namespace, skip: frozenset[str]) -> dict[str, Any]:
    """The spec fields a namespace has, by the dest rule; absent ones keep their defaults."""
    return {f.name: getattr(args, dest_of(f.name)) for f in fields(cls)
            if f.name not in skip and hasattr(args, dest_of(f.name))}


def _check_port(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 65535:
        raise ValueError(f"{name} must be 0..65535; got {value!r}")


_BIND_ALL = frozenset({"", "0.0.0.0", "::", "[::]"})


def _check_advertised(host: str, name: str) -> None:
    """A worker's advertised address must be one a peer can dial."""
    if host in _BIND_ALL:
        raise ValueError(f"{name} {host!r} cannot be advertised: peers cannot dial a bind-all address; "
                         "pass --advertise-host with an address of this host that peers reach "
                         "(in Kubernetes, the pod IP)")


def _check_positive(owner: object, *names: str) -> None:
    for name in names:
        if not getattr(owner, name) > 0:
            raise ValueError(f"{name} must be > 0; got {getattr(owner, name)}")


_LOGGING_FIELDS = ("log_format", "log_stats_interval_s")
"""Passed to a child only when not their defaults: a child of an older release takes the argv."""
_PLANNER_FIELDS = ("slo_ttft_ms", "slo_itl_ms", "plan_window_s", "plan_target_utilization", "autoscale",
                   "autoscale_interval_s", "autoscale_cooldown_s", "autoscale_min_prefill", "autoscale_max_prefill",
                   "autoscale_min_decode", "autoscale_max_decode")
_ROUTER_ONLY_IF_SET = frozenset({"scaler", "max_replicas", "router_workers", "timeline_capacity", "worker_link",
                                 *_LOGGING_FIELDS,
                                 *_PLANNER_FIELDS})


def _check_logging(spec: WorkerSpec | RouterSpec) -> None:
    if spec.log_format not in LOG_FORMATS:
        raise ValueError(f"log_format must be one of {', '.join(LOG_FORMATS)}; got {spec.log_format!r}")
    if not spec.log_stats_interval_s >= 0:
        raise ValueError(f"log_stats_interval_s must be >= 0 (0: no stats lines); got {spec.log_stats_interval_s}")


def _logging_argv(spec: WorkerSpec | RouterSpec) -> list[str]:
    defaults = type(spec).__dataclass_fields__
    return [part for name in _LOGGING_FIELDS if getattr(spec, name) != defaults[name].default
            for part in (flag_of(name), str(getattr(spec, name)))]


def _check_planner(spec: RouterSpec) -> None:
    """The planner's own validation (router.ops.planner is pure: no I/O at import)."""
    from router.ops.planner.autoscale import AutoscaleSettings
    from router.ops.planner.model import PlanSettings, RoleBounds

    PlanSettings(spec.slo_ttft_ms, spec.slo_itl_ms, spec.plan_target_utilization, RoleBounds(
        spec.autoscale_min_prefill, spec.autoscale_max_prefill, spec.autoscale_min_decode, spec.autoscale_max_decode
    ).within(spec.max_replicas))  # `pdserve up` refuses a contradiction before anything starts
    AutoscaleSettings(spec.autoscale_interval_s, spec.autoscale_cooldown_s)
    if not spec.plan_window_s > 0:
        raise ValueError(f"plan_window_s must be > 0; got {spec.plan_window_s}")


@dataclass(frozen=True)
class WorkerSpec:
    """One prefill or decode worker process."""

    role: WorkerRole
    engine: EngineConfig = field(default_factory=EngineConfig)
    worker_id: str | None = None
    """Stable name (survives restarts; each start gets a new incarnation). None: generated."""
    host: str = "127.0.0.1"
    """Address to bind the gRPC and HTTP servers to (localhost only by default)."""
    advertise_host: str | None = None
    """Address peers dial: registered in Redis, put in tickets, and the KV data channel's own
    (it binds and advertises it, so it must be an address of this host, e.g. a pod's IP).
    None: `host`. Never a bind-all address: a peer cannot dial 0.0.0.0."""
    port: int = 0
    """gRPC port (0: any free port)."""
    metrics_port: int = 0
    """HTTP port of /metrics and the probes /livez, /readyz, /startupz (0: any free port)."""
    link_port: int = 0
    """Port of the worker link (proto/link), the routers' request plane for Decode, Prefill and
    Abort (0: any free port; -1: no link, routers call those over gRPC too)."""
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
    liveness_stall_s: float = 60.0
    """/livez fails once the engine loop has had work this long without finishing a step (a
    wedged loop; Kubernetes then restarts the pod)."""
    ready_file: str | None = None
    """Written with 'grpc_port metrics_port' once serving (how a launcher learns the ports)."""
    log_level: str = "INFO"
    log_format: LogFormat = "text"
    """"text" or "json" (JSON lines with worker_id, role, request_id)."""
    log_stats_interval_s: float = DEFAULT_LOG_STATS_INTERVAL_S
    """Seconds between the worker's stats lines (only when they changed); 0: none."""

    def __post_init__(self) -> None:
        if self.role not in WORKER_ROLES:
            raise ValueError(f"role must be one of {', '.join(WORKER_ROLES)}; got {self.role!r}")
        for name in ("port", "metrics_port"):
            _check_port(name, getattr(self, name))
        if self.link_port != -1 and (isinstance(self.link_port, bool) or not isinstance(self.link_port, int)
                                     or not 0 <= self.link_port <= 65535):
            raise ValueError(f"link_port must be 0..65535, or -1 for no link; got {self.link_port!r}")
        _check_positive(self, "transfer_timeout_s", "heartbeat_interval_s", "heartbeat_ttl_s",
                        "kv_snapshot_interval_s", "liveness_stall_s")
        _check_advertised(self.advertised_host, "advertise_host" if self.advertise_host is not None else "host")
        if self.drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s must be >= 0; got {self.drain_timeout_s}")
        if self.heartbeat_ttl_s <= self.heartbeat_interval_s:
            raise ValueError(f"heartbeat_ttl_s ({self.heartbeat_ttl_s}) must exceed heartbeat_interval_s "
                             f"({self.heartbeat_interval_s}), or a live worker's entry expires")
        if not self.cluster:
            raise ValueError("cluster must not be empty")
        _check_logging(self)

    @property
    def advertised_host(self) -> str:
        """The address peers dial: advertise_host, else host."""
        return self.host if self.advertise_host is None else self.advertise_host

    @classmethod
    def from_args(cls, args: argparse.Namespace, role: str | None = None) -> WorkerSpec:
        """From `pdserve prefill|decode`'s parsed flags (role: args.command unless given).
        Raises ValueError naming the bad setting."""
        values = _values_from(cls, args, frozenset({"role", "engine"}))
        return cls(role=role or args.command, engine=engine_config_from(args), **values)  # type: ignore[arg-type]

    def to_argv(self) -> list[str]:
        """`pdserve <role> ...`: the arguments (after the program) that run this spec."""
        argv = [self.role, "--host", self.host, "--port", str(self.port),
                "--metrics-port", str(self.metrics_port), "--link-port", str(self.link_port),
                "--cluster", self.cluster,
                "--kv-transfer", self.kv_transfer, "--transfer-timeout", str(self.transfer_timeout_s),
                "--heartbeat-interval", str(self.heartbeat_interval_s),
                "--heartbeat-ttl", str(self.heartbeat_ttl_s),
                "--kv-snapshot-interval", str(self.kv_snapshot_interval_s),
                "--drain-timeout", str(self.drain_timeout_s),
                "--liveness-stall", str(self.liveness_stall_s), "--log-level", self.log_level]
        for flag, value in (("--advertise-host", self.advertise_host), ("--worker-id", self.worker_id),
                            ("--redis-url", self.redis_url), ("--ready-file", self.ready_file)):
            if value is not None:
                argv += [flag, value]
        return argv + _logging_argv(self) + engine_argv(self.engine)


@dataclass(frozen=True)
class RouterSpec:
    """One router process (OpenAI HTTP + public gRPC). Defaults equal `pdserve router`'s flag
    defaults (a unit test holds them together)."""

    host: str = "127.0.0.1"
    """Address to bind (localhost only by default; the admin routes are open only there)."""
    port: int = 8000
    """OpenAI HTTP port (0: any free port)."""
    grpc_port: int = 50051
    """Public gRPC port (0: any free port)."""
    redis_url: str | None = None
    """Cluster state written by the workers; None: no Redis (static workers only)."""
    cluster: str = "default"
    model: str | None = None
    """Model file or folder whose tokenizer and name the router uses; None: the default model."""
    tokenizer: str | None = None
    served_model_name: str | None = None
    max_model_len: int | None = None
    ticket_timeout_s: float = 60.0
    """How long a decode worker's reservation waits for its prefill."""
    colocated: bool = False
    """No prefill workers by design: /ready needs only a decode worker."""
    policy: str = "cache_aware"
    """A name in router.routing.policy.POLICIES."""
    prefill_queue_weight: float = 0.5
    """cache_aware: cost of one queued prefill token relative to one uncached prompt token."""
    local_prefill_max_tokens: int = 0
    """Prefill prompts of at most this many uncached tokens on the decode worker when the
    prefill worker is backed up (0: never)."""
    local_prefill_min_queue: int = 1024
    max_queued_requests: int = 256
    """Requests that may wait for decode room at once; more get 503 + Retry-After."""
    max_queue_wait_s: float = 30.0
    max_request_bytes: int = 2 * 1024 * 1024
    """Largest HTTP body / gRPC message accepted (router.api.validation.DEFAULT_MAX_REQUEST_BYTES)."""
    max_n: int = 128
    """Most completions per prompt (router.api.validation.RequestLimits.max_n)."""
    prefill_timeout_s: float = 60.0
    """One prefill worker's deadline for a request (router.routing.worker_calls.WorkerTimeouts)."""
    stream_idle_timeout_s: float = 30.0
    """Longest a decode stream may send nothing before the request ends with an error."""
    worker_link: bool = True
    """Decode, Prefill and Abort over the workers' links (proto/link) where they serve one;
    False: over gRPC (router.routing.worker_client)."""
    scaler: str = "none"
    """"none" or a name in pdserve.scalers.SCALERS: what answers PUT /v1/roles/{role}."""
    max_replicas: int = 16
    """Most replicas PUT /v1/roles/{role} accepts per role."""
    ready_file: str | None = None
    """Written with 'http_port grpc_port' once serving."""
    log_level: str = "INFO"
    log_format: LogFormat = "text"
    """"text" or "json" (JSON lines with role and request_id)."""
    log_stats_interval_s: float = DEFAULT_LOG_STATS_INTERVAL_S
    """Seconds between the router's cluster stats lines (only when they changed); 0: none."""
    router_workers: int = 1
    """Processes serving this router's ports (SO_REUSEPORT; pdserve/router_workers.py)."""
    # The planner and --autoscale (router.ops.planner); passed only when not their defaults.
    slo_ttft_ms: float | None = None
    """Time-to-first-token p99 target of the planner; None: no TTFT rule."""
    slo_itl_ms: float | None = None
    """Inter-token latency p99 target of the planner; None: no ITL rule."""
    plan_window_s: float = 60.0
    """Seconds of live measurements the planner's rates are taken over."""
    plan_target_utilization: float = 0.8
    """Busy fraction the planner sizes each worker for."""
    autoscale: bool = False
    """Apply the planner's recommendation through the scaler (needs one)."""
    autoscale_interval_s: float = 5.0
    autoscale_cooldown_s: float = 30.0
    autoscale_min_prefill: int = 1
    autoscale_max_prefill: int = 4
    autoscale_min_decode: int = 1
    autoscale_max_decode: int = 4
    timeline_capacity: int = 1000
    """Per-request timelines the router keeps (router.ops.timeline.DEFAULT_TIMELINE_CAPACITY)."""

    def __post_init__(self) -> None:
        if isinstance(self.router_workers, bool) or not isinstance(self.router_workers, int) \
                or self.router_workers < 1:
            raise ValueError(f"router_workers must be >= 1; got {self.router_workers!r}")
        _check_planner(self)
        for name in ("port", "grpc_port"):
            _check_port(name, getattr(self, name))
        if not self.cluster:
            raise ValueError("cluster must not be empty")
        from router.routing.policy import POLICIES  # pure: no I/O

        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES.names())}; got {self.policy!r}")
        _check_positive(self, "ticket_timeout_s", "max_queue_wait_s", "prefill_timeout_s",
                        "stream_idle_timeout_s", "max_request_bytes", "max_n", "max_queued_requests",
                        "timeline_capacity")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be > 0; got {self.max_model_len}")
        for name in ("local_prefill_max_tokens", "local_prefill_min_queue", "prefill_queue_weight",
                     "max_replicas"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0; got {getattr(self, name)}")
        if not self.scaler:
            raise ValueError('scaler must be "none" or a scaler name; got ""')
        _check_logging(self)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RouterSpec:
        """From `pdserve router`'s (or `pdserve up`'s) parsed flags; fields the namespace
        lacks keep their defaults. Raises ValueError naming the bad setting."""
        return cls(**_values_from(cls, args, frozenset()))

    def to_argv(self) -> list[str]:
        """`pdserve router ...`: the arguments (after the program) that run this spec. Optional
        settings left at None are left out; `scaler`, `max_replicas` and the logging settings
        only when not their defaults, so a router of an older release still takes a default
        spec's argv."""
        defaults = RouterSpec()
        argv = ["router"]
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None or (f.name in _ROUTER_ONLY_IF_SET and value == getattr(defaults, f.name)):
                continue
            argv += [flag_of(f.name), str(value).lower() if isinstance(value, bool) else str(value)]
        return argv
