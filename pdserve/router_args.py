"""`pdserve router`'s command line: its flags by group, and the routing, limit, deadline,
planner and timeline flags `pdserve up` takes too and passes on through RouterSpec.
pdserve/router_main.py assembles the router from what these flags parse to."""

from __future__ import annotations

import argparse

from pdserve.engine_args import parse_redis_url


def add_router_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("router")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (127.0.0.1: this host only)")
    g.add_argument("--port", type=int, default=8000, help="OpenAI HTTP port")
    g.add_argument("--grpc-port", type=int, default=50051, help="public gRPC port (0: any free port)")
    g.add_argument("--redis-url", type=parse_redis_url, default=None,
                   help="cluster state written by the workers (unset: no workers are seen)")
    g.add_argument("--cluster", default="default", help="cluster name (Redis key prefix)")
    g.add_argument("--model", default=None,
                   help="model file or folder: its tokenizer and name (default: SmolLM2-135M-Instruct GGUF)")
    g.add_argument("--tokenizer", default=None, help="tokenizer source if not the model's")
    g.add_argument("--served-model-name", default=None, help="model name in the API (default: the model file's name)")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + output in tokens (default: the model's context length)")
    g.add_argument("--api-key", default=None,
                   help="require this bearer token (or set PDSERVE_API_KEY / PDSERVE_API_KEY_FILE)")
    g.add_argument("--ticket-timeout", type=float, default=60.0,
                   help="seconds a decode worker holds blocks reserved for a prompt whose KV has not arrived")
    g.add_argument("--ready-file", default=None, help="write 'http_port grpc_port' here when serving")
    # Takes an optional value so that `pdserve up` can pass it on like ROUTING_FLAGS
    # (`--colocated True|False`); `--colocated` alone means True.
    g.add_argument("--colocated", nargs="?", const=True, default=False, type=_true_or_false,
                   help="the cluster has no prefill workers by design: /ready needs only a decode worker")
    add_routing_args(parser.add_argument_group("routing and admission"))
    add_admin_args(parser.add_argument_group("roles, scaling and admin"))
    from pdserve.router_workers import add_router_worker_index_arg

    add_router_worker_index_arg(g)
    add_timeline_args(timelines := parser.add_argument_group("per-request timelines"))
    timelines.add_argument("--otlp-traces-endpoint", default=None,
                           help="also export each request's timeline as OpenTelemetry spans to this OTLP/HTTP URL")
    from pdserve.logs import add_log_args

    add_log_args(parser.add_argument_group("logging"))


ROUTING_FLAGS = ("policy", "prefill_queue_weight", "local_prefill_max_tokens", "local_prefill_min_queue",
                 "max_queued_requests", "max_queue_wait")
"""The routing/admission arguments, which `pdserve up` also takes and passes to its router."""
LIMIT_FLAGS = ("max_request_bytes", "max_n")
"""Request limits, checked before any work; `pdserve up` passes them on like ROUTING_FLAGS."""
DEADLINE_FLAGS = ("prefill_timeout", "stream_idle_timeout")
"""Deadlines of the router's calls to workers (router.routing.worker_calls.WorkerTimeouts)."""
ROUTING_FLAGS += LIMIT_FLAGS + DEADLINE_FLAGS + ("colocated", "worker_link")  # `up --colocated` tells its router (/ready)


def _true_or_false(text: str) -> bool:
    if text.lower() in ("true", "1", "yes"):
        return True
    if text.lower() in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def add_routing_args(g) -> None:
    """Routing policy and admission flags (shared by `pdserve router` and `pdserve up`)."""
    g.add_argument("--policy", default="cache_aware",
                   help="routing policy (cache_aware, least_loaded, round_robin)")
    g.add_argument("--prefill-queue-weight", type=float, default=0.5,
                   help="cache_aware: cost of one queued prefill token relative to one uncached prompt token")
    g.add_argument("--local-prefill-max-tokens", type=int, default=0,
                   help="conditional disaggregation: prefill prompts of at most this many uncached tokens on "
                        "the decode worker when the prefill worker is backed up (0: never)")
    g.add_argument("--local-prefill-min-queue", type=int, default=1024,
                   help="... backed up = at least this many prompt tokens queued on the chosen prefill worker")
    g.add_argument("--max-queued-requests", type=int, default=256,
                   help="requests that may wait for decode room at once; more get 503 + Retry-After")
    g.add_argument("--max-queue-wait", type=float, default=30.0,
                   help="seconds a request may wait for decode room before 503 + Retry-After")
    add_limit_args(g)
    add_deadline_args(g)
    from pdserve.router_workers import add_router_workers_args

    add_router_workers_args(g)
    add_planner_args(g)


def add_limit_args(g) -> None:
    """Request limits (HTTP and gRPC alike), checked before a request is tokenized or routed."""
    from router.api.validation import DEFAULT_MAX_REQUEST_BYTES, RequestLimits

    g.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                   help="largest HTTP body / gRPC message accepted (413 / RESOURCE_EXHAUSTED beyond)")
    g.add_argument("--max-n", type=int, default=RequestLimits.max_n,
                   help="most completions per prompt (n); prompts x n is capped at "
                        f"{RequestLimits.max_sequences}")


def add_deadline_args(g) -> None:
    """--prefill-timeout and --stream-idle-timeout (defaults: router.routing.worker_calls.WorkerTimeouts)."""
    from router.routing.worker_calls import WorkerTimeouts

    g.add_argument("--prefill-timeout", type=float, default=WorkerTimeouts.prefill_s,
                   help="seconds one prefill worker may take for a request's Prefill (queue, compute, KV "
                        "transfer) before the next prefill worker, then the decode worker itself, is tried")
    g.add_argument("--stream-idle-timeout", type=float, default=WorkerTimeouts.stream_idle_s,
                   help="seconds a decode worker may send nothing on a request's stream (its ticket "
                        "included) before the request ends with an explicit error")
    g.add_argument("--worker-link", nargs="?", const=True, default=True, type=_true_or_false,
                   help="send Decode, Prefill and Abort over the workers' links (one multiplexed connection "
                        "per worker; a tenth of a gRPC call's CPU) where they serve one; false: over gRPC")


def add_admin_args(g) -> None:
    from router.ops.roles import DEFAULT_MAX_REPLICAS

    g.add_argument("--scaler", default="none",
                   help="what acts on PUT /v1/roles: none (read-only roles API) or a scaler name "
                        "(local: the pdserve up supervisor; ray: pdserve up --launcher ray; kubernetes: "
                        "the Helm chart's Deployments)")
    g.add_argument("--max-replicas", type=int, default=DEFAULT_MAX_REPLICAS,
                   help="largest replica count PUT /v1/roles/{role} accepts for one role")
    g.add_argument("--admin-key", default=None,
                   help="bearer token for scaling and draining (or set PDSERVE_ADMIN_KEY / "
                        "PDSERVE_ADMIN_KEY_FILE); distinct from --api-key. Without one, those routes "
                        "answer 403 unless --host is a loopback address")


def add_planner_args(g) -> None:
    from pdserve.planner_main import add_planner_args as add

    add(g)


def add_timeline_args(g) -> None:
    """`pdserve up` takes these too and passes them on through RouterSpec."""
    from router.ops.timeline import DEFAULT_TIMELINE_CAPACITY

    g.add_argument("--timeline-capacity", type=int, default=DEFAULT_TIMELINE_CAPACITY,
                   help="per-request timelines kept for GET /v1/requests/{id}/timeline (the oldest is dropped)")
