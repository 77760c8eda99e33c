"""`pdserve router`: the front door (OpenAI HTTP + public gRPC) over the P/D cluster."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from pathlib import Path

from proto.heap import settle_heap

logger = logging.getLogger(__name__)


def key_from(flag_value: str | None, flag: str, env: str) -> str | None:
    """A bearer key: the flag's value (with a warning: `ps` shows it), else $env, else the
    contents of the file named by ${env}_FILE; an empty file refuses to serve."""
    if flag_value:
        logger.warning("%s on the command line is visible to every user of this host (ps); "
                       "prefer %s_FILE or %s", flag, env, env)
        return flag_value
    if os.environ.get(env):
        return os.environ[env]
    key_file = os.environ.get(f"{env}_FILE")
    if not key_file:
        return None
    try:
        key = Path(key_file).read_text().strip()
    except OSError as exc:  # a setting, not a bug: one line, no traceback
        raise SystemExit(f"{env}_FILE {key_file}: cannot read it ({exc.strerror})") from None
    if not key:
        raise SystemExit(f"{env}_FILE {key_file} is empty: refusing to serve without the key it promises")
    return key


def api_key_from(args: argparse.Namespace) -> str | None:
    """--api-key, else $PDSERVE_API_KEY, else the contents of $PDSERVE_API_KEY_FILE."""
    return key_from(args.api_key, "--api-key", "PDSERVE_API_KEY")


def build_service(args: argparse.Namespace):
    """RouterService + ClusterBackend for the arguments (no network I/O yet)."""
    from engine.loader.locate import DEFAULT_MODEL_NAME, resolve_model_path
    from engine.loader.spec_reader import read_spec
    from engine.tokenizer import load_tokenizer
    from router.routing.admission import AdmissionQueue, AdmissionSettings
    from router.routing.cluster_backend import ClusterBackend, plain_route_request
    from router.cluster.metrics import ClusterCollector
    from router.cluster.state import ClusterStateReader
    from router.cluster.kv_event_reader import KVEventReader
    from router.routing.local_prefill import LocalPrefillRule, WithLocalPrefill
    from router.routing.policy import CacheAware, CacheAwareWeights, make_policy
    from router.serving.prompt_encoder import serial_tokenizer_threads
    from router.serving.service import RouterService
    from router.api.validation import RequestLimits
    from router.routing.worker_calls import WorkerTimeouts
    from proto.internal_auth import require_cluster_secret

    secret = require_cluster_secret("pdserve router")  # before the model loads: fail fast
    model_path = resolve_model_path(args.model)
    spec = read_spec(model_path)
    serial_tokenizer_threads()
    tokenizer = load_tokenizer(args.tokenizer or model_path)
    name = args.served_model_name or (DEFAULT_MODEL_NAME if args.model is None else model_path.stem)
    max_model_len = args.max_model_len or spec.max_position_embeddings

    # Redis credentials come from the environment (router/cluster/redis_settings.py); the secret
    # verifies the workers' signed heartbeats.
    reader = ClusterStateReader(args.redis_url, args.cluster, secret=secret)
    admission = AdmissionQueue(AdmissionSettings(max_queued=args.max_queued_requests,
                                                 max_wait_s=args.max_queue_wait))
    kv_reader = KVEventReader(args.redis_url, args.cluster) if args.redis_url else None
    builder = kv_reader.route_request if kv_reader is not None else plain_route_request
    if args.policy == "cache_aware":
        policy = CacheAware(CacheAwareWeights(queued_token=args.prefill_queue_weight))
    else:
        policy = make_policy(args.policy)
    if args.local_prefill_max_tokens:
        policy = WithLocalPrefill(policy, LocalPrefillRule(args.local_prefill_max_tokens, args.local_prefill_min_queue))
    backend = ClusterBackend(reader.snapshot, policy.choose, args.ticket_timeout,
                             admission=admission, route_request=builder,
                             timeouts=WorkerTimeouts(prefill_s=args.prefill_timeout,
                                                     stream_idle_s=args.stream_idle_timeout),
                             secret=secret, use_links=args.worker_link)
    backend.kv_reader = kv_reader
    limits = RequestLimits(max_n=args.max_n, max_sequences=max(RequestLimits.max_sequences, args.max_n))
    service = RouterService(tokenizer, backend, name, max_model_len, limits=limits,
                            timelines=timeline_store(args))
    service.metrics.registry.register(ClusterCollector(backend, reader, name, kv_reader))
    return service, backend, reader


def cluster_view(args: argparse.Namespace, backend, reader):
    """The /v1/cluster body builder for this router."""
    from router.cluster.view import cluster_body

    async def view() -> dict[str, object]:
        snapshot = await reader.snapshot()
        queue = backend.admission
        body = cluster_body(args.cluster, snapshot, reader.redis_ok, args.policy, {
            "waiting": queue.num_waiting,
            "max_queued": queue.settings.max_queued,
            "max_wait_s": queue.settings.max_wait_s,
            "blocks_freed_per_s": round(queue.free_rate.per_second(), 3),
            "rejections": dict(queue.rejections) | dict(backend.rejections),
            "fallbacks": dict(backend.fallbacks),
        })
        kv = backend.kv_reader
        if kv is not None:
            body["prefix_index"] = {"hashes": len(kv.index), "workers": kv.index.workers(),
                                    "events_applied": kv.events_applied, "caught_up": kv.caught_up,
                                    "lag_s": round(kv.lag_s, 3)}
        return body

    return view


def readiness_check(args: argparse.Namespace, reader):
    """/ready and gRPC health: workers of the roles this cluster needs are registered."""
    from router.cluster.readiness import readiness

    async def check():
        return readiness(await reader.snapshot(), needs_prefill=not args.colocated)

    return check


# --- Roles, scaling and admin (GET/PUT /v1/roles, drain, pdserve.v1.Admin) -----------------
# Everything the router adds for scaling lives in this block: the flags, the admin key, the
# scaler and the RolesApi that HTTP, gRPC and /metrics share.


def admin_key_from(args: argparse.Namespace) -> str | None:
    """--admin-key, else $PDSERVE_ADMIN_KEY, else the contents of $PDSERVE_ADMIN_KEY_FILE."""
    return key_from(args.admin_key, "--admin-key", "PDSERVE_ADMIN_KEY")


def make_scaler(name: str, redis_url: str | None, cluster: str, secret: bytes | None):
    """The scaler named by --scaler (None for "none"), built from pdserve.scalers' registry
    (imported only when one is asked for). Raises SystemExit with one line when it cannot be."""
    if name == "none":
        return None
    try:
        from pdserve.scalers import SCALERS
    except ImportError as exc:
        raise SystemExit(f"--scaler {name}: no scalers are available in this installation ({exc})") from None
    try:
        factory = SCALERS.get(name)
    except KeyError as exc:
        raise SystemExit(f"--scaler: {exc.args[0]}; or none") from None
    try:
        return factory(redis_url, cluster, secret)
    except ValueError as exc:  # e.g. the local scaler without --redis-url
        raise SystemExit(f"--scaler {name}: {exc}") from None


def build_admin(args: argparse.Namespace, backend, reader, api_key: str | None):
    """The RolesApi and AdminAccess this router serves (HTTP, gRPC, /metrics)."""
    from proto.internal_auth import require_cluster_secret
    from router.ops.access import AdminAccess
    from router.ops.drain_call import WorkerDrainer
    from router.ops.roles import RolesApi

    # The scaler signs the desired counts it writes with the cluster secret.
    scaler = make_scaler(args.scaler, args.redis_url, args.cluster, require_cluster_secret("pdserve router"))
    drainer = WorkerDrainer(backend.channel, backend.timeouts.abort_s)
    roles = RolesApi(reader.snapshot, scaler, drainer, max_replicas=args.max_replicas)
    try:
        access = AdminAccess(admin_key_from(args), api_key, args.host)
    except ValueError as exc:
        raise SystemExit(f"pdserve router: {exc}") from None
    return roles, access


# --- end of the roles, scaling and admin block ---------------------------------------------


# --- Dashboard (/dashboard, /v1/dashboard/state, /v1/dashboard/history) ---------------------
# The page and its live data: a history sampler started and stopped with the router. No flags:
# the dashboard is always served (its data under the API key, like every /v1 route).


def build_dashboard(args: argparse.Namespace, service, backend, reader, roles, api_key: str | None):
    """(the dashboard's routes, its sampler): start the sampler once serving, stop it on the
    way out. The mean request length comes from the service's timeline ring when it keeps one."""
    from router.ops.dashboard.history import History
    from router.ops.dashboard.http import dashboard_routes
    from router.ops.dashboard.sampler import DashboardSampler
    from router.ops.dashboard.state import DashboardSettings, DashboardState

    history = History()
    sampler = DashboardSampler(history, service.metrics.registry, backend, reader.snapshot)
    settings = DashboardSettings(args.cluster, service.model_name, service.max_model_len, args.policy)
    state = DashboardState(settings, roles, reader.snapshot, backend, getattr(service, "timelines", None))
    return dashboard_routes(state, history, api_key_required=api_key is not None), sampler


# --- end of the dashboard block -------------------------------------------------------------
# --- Planner and --autoscale (GET /v1/plan; issue 14 item 3) --------------------------------
# Flags, objects and tasks live in pdserve/planner_main.py; add_planner_args is called from
# add_routing_args (so `pdserve up` takes the flags too and passes them on through RouterSpec).


# --- end of the planner block ---------------------------------------------------------------
# --- per-request timelines (issue 14 item 2) -----------------------------------------------


def timeline_store(args: argparse.Namespace):
    from router.ops.timeline import DEFAULT_TIMELINE_CAPACITY, TimelineStore

    store = TimelineStore(getattr(args, "timeline_capacity", DEFAULT_TIMELINE_CAPACITY))
    if getattr(args, "otlp_traces_endpoint", None):
        from router.ops.timeline_otel import otlp_subscriber

        if (spans := otlp_subscriber(args.otlp_traces_endpoint)) is not None:
            store.subscribe(spans)
    return store


def timeline_ops_routes(service) -> tuple:
    """The timeline routes over the service's ring (none when it keeps no timelines)."""
    from router.ops.timeline_http import timeline_routes

    return () if service.timelines is None else (timeline_routes(service.timelines),)
# --- end of the per-request timelines block ------------------------------------------------


async def serve_router(args: argparse.Namespace, stop: asyncio.Event | None = None,
                       on_ready=None) -> None:
    """Serve until SIGINT/SIGTERM, or until `stop` is set when given (a host that is not this
    process's main thread: a Ray actor). on_ready(http_port, grpc_port) is called once serving."""
    import uvicorn

    from router.api.grpc_api import start_grpc_server
    from router.api.http import HttpSettings, create_app

    service, backend, reader = build_service(args)
    api_key = api_key_from(args)
    roles, admin_access = build_admin(args, backend, reader, api_key)
    from pdserve.planner_main import build_planner, plan_routes, start_planner

    planner = build_planner(args, service, backend, reader, roles)

    ready = readiness_check(args, reader)
    dashboard_api, dashboard_sampler = build_dashboard(args, service, backend, reader, roles, api_key)
    app = create_app(service, HttpSettings(api_key=api_key, cluster_view=cluster_view(args, backend, reader),
                                           max_request_bytes=args.max_request_bytes, readiness=ready,
                                           roles=roles, admin_access=admin_access,
                                           ops_routes=(dashboard_api, *timeline_ops_routes(service), plan_routes(planner))))
    app.state.cluster_backend = backend
    app.state.cluster_reader = reader
    if backend.kv_reader is not None:
        backend.kv_reader.start()  # replays the block-event stream, then follows it
    grpc_door = await start_grpc_server(service, args.host, args.grpc_port, api_key=api_key,
                                        max_message_bytes=args.max_request_bytes, readiness=ready,
                                        roles=roles, admin_access=admin_access)
    grpc_port = grpc_door.port
    # log_config None: uvicorn's loggers propagate to ours (named, text or JSON), not a handler of its own
    from router.api.http_transport import http_protocol

    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", lifespan="off", log_config=None,
                            access_log=False,  # one log call per request for a line nobody sees at WARNING
                            proxy_headers=False,  # nothing reads the client's address; no X-Forwarded-* trusted
                            http=http_protocol())  # a send() per loop pass, not per ASGI message
    server = uvicorn.Server(config)
    server.install_signal_handlers = lambda: None  # we handle signals below
    from pdserve.router_workers import WORKER_HEADER, http_sockets, start_router_processes  # --- router workers

    sockets = http_sockets(args)  # None: one process, uvicorn binds
    if sockets is not None:
        from router.api.http_guards import ResponseHeaderMiddleware

        app.add_guard(ResponseHeaderMiddleware, name=WORKER_HEADER, value=str(args.router_worker_index))
    settle_heap()
    http_task = asyncio.create_task(server.serve(sockets=sockets))
    while not server.started:
        if http_task.done():
            await http_task  # raises why it could not start
        await asyncio.sleep(0.05)
    http_port = server.servers[0].sockets[0].getsockname()[1]
    stop_router_processes = await start_router_processes(args, http_port, grpc_port, api_key,
                                                         admin_key_from(args))  # --- router workers
    if stop is None:  # before the ready file: a signal sent the moment it appears stops us cleanly
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
    logger.info("router serving OpenAI HTTP on http://%s:%d and gRPC on %s:%d",
                args.host, http_port, args.host, grpc_port)
    if args.ready_file:
        Path(args.ready_file).write_text(f"{http_port} {grpc_port}\n")
    if on_ready is not None:
        on_ready(http_port, grpc_port)
    stats_task = start_cluster_stats(args, reader, backend) if not getattr(args, "router_worker_index", 0) else None
    dashboard_sampler.start()
    planner_tasks = start_planner(planner)
    await stop.wait()
    await dashboard_sampler.stop()
    for task in planner_tasks:
        task.cancel()
    await asyncio.gather(*planner_tasks, return_exceptions=True)
    if stats_task is not None:
        stats_task.cancel()
        await asyncio.gather(stats_task, return_exceptions=True)
    if stop_router_processes is not None:  # --- router workers
        await stop_router_processes()
    server.should_exit = True
    await http_task
    await grpc_door.stop(grace=2)
    await backend.close()
    if backend.kv_reader is not None:
        await backend.kv_reader.aclose()
    await reader.aclose()
    if getattr(args, "router_worker_index", 0) > 0 and args.ready_file:
        from pdserve.router_workers import forget_ready_file

        forget_ready_file(Path(args.ready_file))


def start_cluster_stats(args: argparse.Namespace, reader, backend) -> asyncio.Task | None:
    """The cluster stats line every --log-stats-interval seconds (None when 0)."""
    from router.serving.stats_log import run_cluster_stats

    interval_s = getattr(args, "log_stats_interval", 0.0)
    if interval_s <= 0:
        return None
    return asyncio.create_task(run_cluster_stats(reader.snapshot, backend, interval_s), name="cluster-stats")


def run_router(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from pdserve.preflight import port_problem, redis_auth_problem

    from pdserve.planner_main import planner_problem

    ports = (("--port", args.port), ("--grpc-port", args.grpc_port)) if not getattr(args, "router_worker_index", 0) else ()
    problem = planner_problem(args) or port_problem(args.host, ports)  # process i > 0 shares process 0's ports
    if problem is not None or (args.redis_url and (problem := redis_auth_problem()) is not None):
        print(f"pdserve router: {problem}", file=sys.stderr, flush=True)  # before the tokenizer loads
        return 1
    run_event_loop(serve_router(args))
    return 0


def run_event_loop(main) -> None:
    """asyncio.run(main) on uvloop when it is installed: the router's request path is mostly
    event-loop and socket work, which uvloop does in C (benchmarks/router_overhead.py)."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
        return
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(main)
