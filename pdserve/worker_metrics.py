"""A worker's /metrics: vLLM's gauge names with a `role` label, plus KV transfer totals."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


class WorkerCollector:
    """Reads the worker's state at scrape time (counts are plain ints; reads are racy but
    each value is a whole int or float, which is enough for monitoring)."""

    def __init__(self, worker, role: str) -> None:
        self.worker = worker
        self.role = role

    def collect(self):
        s = self.worker.loop.stats
        labels = {"role": self.role, "worker_id": self.worker.worker_id}
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
        yield from capacity_metrics(self.worker.core, labels)
        nbytes, seconds, count = transfer_totals(self.worker)
        yield counter("pdserve_kv_transfer_bytes", "KV bytes sent (prefill) or received (decode).", nbytes)
        yield counter("pdserve_kv_transfer_seconds", "Seconds spent in KV transfers.", seconds)
        yield counter("pdserve_kv_transfers", "KV transfers completed.", count)


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


def transfer_totals(worker) -> tuple[int, float, int]:
    return worker.transfer_bytes, worker.transfer_seconds, worker.transfers


def serve_metrics(worker, role: str, host: str, port: int) -> int:
    """Start the /metrics HTTP server in a daemon thread; returns the bound port."""
    registry = CollectorRegistry()
    registry.register(WorkerCollector(worker, role))
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return server.server_port
