"""A worker's /metrics: vLLM's gauge names with `model_name`, `role` and `worker_id` labels, plus
KV transfer totals and the worker's drain state. Everything dynamic is read from one frozen
WorkerStatus per scrape."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator, Mapping
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import ThreadingWSGIServer

from worker_runtime.status import WorkerState, WorkerStatus


class WorkerCollector:
    """Reads `status()` once per scrape (a frozen snapshot, any thread); the capacity families
    are fixed after start-up and built once."""

    def __init__(self, status: Callable[[], WorkerStatus], capacity: list[GaugeMetricFamily],
                 model_name: str) -> None:
        """model_name: the served model's name, a label on every series (vLLM's dashboards
        select by it)."""
        self._status = status
        self._capacity = capacity
        self._model_name = model_name

    def collect(self) -> Iterator[Metric]:
        status = self._status()
        s = status.core
        labels = {"model_name": self._model_name, "role": status.role, "worker_id": status.worker_id}
        names = list(labels)
        values = list(labels.values())

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=names)
            g.add_metric(values, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=names)
            c.add_metric(values, value)
            return c

        yield gauge("vllm:num_requests_running", "Requests in the decode batch.", s.num_running)
        yield gauge("vllm:num_requests_waiting", "Requests waiting for blocks or compute.", s.num_waiting)
        yield gauge("pdserve_queued_prefill_tokens", "Prompt tokens waiting for prefill on this worker "
                    "(what a prefill autoscaler scales on).", s.queued_prefill_tokens)
        used = s.total_blocks - s.free_blocks
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                    used / s.total_blocks if s.total_blocks else 0.0)
        yield gauge("pdserve_kv_blocks_total", "KV blocks of this worker.", s.total_blocks)
        yield gauge("pdserve_kv_blocks_free", "KV blocks free (cached blocks count as free).", s.free_blocks)
        yield gauge("pdserve_kv_blocks_reserved", "Blocks reserved for KV in flight.", s.reserved_blocks)
        yield counter("vllm:num_preemptions", "Preemptions (recompute or swap to host memory).",
                      s.num_preemptions)
        yield counter("pdserve_swapped_out", "Requests whose KV was swapped out to host memory.", s.num_swapped_out)
        yield counter("pdserve_swapped_in", "Requests whose KV was swapped back in.", s.num_swapped_in)
        yield gauge("pdserve_requests_swapped", "Requests waiting in host memory now.", s.num_swapped)
        yield gauge("pdserve_swap_blocks_total", "Host-memory swap blocks (--swap-space).", s.swap_blocks_total)
        yield gauge("pdserve_swap_blocks_used", "Swap blocks holding a swapped-out request's KV.",
                    s.swap_blocks_used)
        yield counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      s.prefix_cache_queries)
        yield counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_cache_hits)
        yield from self._capacity
        t = status.transfers
        yield counter("pdserve_kv_transfer_bytes", "KV bytes sent (prefill) or received (decode).", t.nbytes)
        yield counter("pdserve_kv_transfer_seconds", "Seconds spent in KV transfers.", t.seconds)
        yield counter("pdserve_kv_transfers", "KV transfers completed.", t.count)
        yield counter("pdserve_kv_transfer_failures", "KV transfers that failed.", t.failures)
        yield gauge("pdserve_worker_in_flight", "Requests this worker still owes an answer.", status.in_flight)
        yield gauge("pdserve_worker_draining", "1 while the worker drains (routers send it no new work).",
                    1.0 if status.state is WorkerState.DRAINING else 0.0)


def capacity_metrics(core, labels: dict[str, str]) -> list[GaugeMetricFamily]:
    """The numbers `pdserve plan` prints, from the running core (fixed after start-up).

    vllm:cache_config_info follows vLLM: value 1, the cache settings as labels (unset ones
    as "None", the way vLLM writes them), plus this worker's `labels`.
    """
    cfg, capacity = core.config, core.capacity
    config_labels = {
        **labels,
        "block_size": str(cfg.block_size),
        "cache_dtype": cfg.kv_cache_dtype,
        "enable_prefix_caching": str(cfg.enable_prefix_caching),
        "gpu_memory_utilization": str(cfg.gpu_memory_utilization),
        "kv_cache_memory_bytes": str(cfg.kv_cache_memory),
        "num_gpu_blocks": str(capacity.num_blocks),
        "num_gpu_blocks_override": str(cfg.num_gpu_blocks_override),
    }
    info = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                             labels=list(config_labels))
    info.add_metric(list(config_labels.values()), 1.0)
    families = [info]
    for name, doc, value in (
        ("pdserve_kv_capacity_tokens", "KV cache capacity in tokens (num_blocks x block_size).",
         capacity.num_tokens),
        ("pdserve_kv_bytes_per_token", "KV cache bytes per token (K and V of every layer).",
         capacity.bytes_per_token),
        ("pdserve_max_concurrency", "Requests of max_model_len tokens the KV cache holds at once.",
         capacity.max_concurrency),
    ):
        gauge = GaugeMetricFamily(name, doc, labels=list(labels))
        gauge.add_metric(list(labels.values()), value)
        families.append(gauge)
    return families


def served_model_name(config, model_path) -> str:
    """The name clients and the router use for the model (pdserve router's rule): the
    --served-model-name, else the default model's name, else the model file's or folder's stem."""
    from engine.loader.locate import DEFAULT_MODEL_NAME

    if config.served_model_name:
        return config.served_model_name
    return DEFAULT_MODEL_NAME if config.model is None else model_path.stem


def serve_metrics(collector: WorkerCollector, host: str, port: int,
                  routes: Mapping[str, Callable] | None = None):
    """Start the worker's HTTP server (/metrics, plus the probe `routes`:
    worker_runtime/probes.py) in a daemon thread; returns (server, bound port). The caller
    shuts the server down (server.shutdown(), then server.server_close()) when the worker stops."""
    from worker_runtime.probes import with_probe_routes

    registry = CollectorRegistry()
    registry.register(collector)
    app = with_probe_routes(make_wsgi_app(registry), routes or {})

    class Server(ThreadingWSGIServer):
        address_family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                            flags=socket.AI_PASSIVE)[0][0]

    server = make_server(host, port, app, Server, handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name="worker-http", daemon=True).start()
    return server, server.server_port


class _QuietHandler(WSGIRequestHandler):
    """No access log line per scrape or probe."""

    def log_message(self, format: str, *args) -> None:  # noqa: A002 — the base class's name
        pass
