"""The router's cluster-side metrics, read at scrape time: KV transfers its prefills reported,
routing decisions, admission (queue, rejections by reason), path fallbacks, Redis, and the
service-wide KV view (per role and per worker) from the last cluster snapshot.

The router's /metrics is the one a Prometheus scrapes, so it also carries vLLM's engine gauges
and prefix-cache counters for every worker of the snapshot (labels model_name, role, worker_id,
as vLLM's Grafana board selects them). vllm:num_requests_waiting has one more series: the
router's own admission queue (role "router", worker_id ""), so summing it over a model gives
everything waiting in the cluster."""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from router.cluster.view import role_totals

_ROLE = ["role"]
_WORKER = ["role", "worker_id"]
_VLLM_WORKER = ["model_name", "role", "worker_id"]


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    c = CounterMetricFamily(name, doc, labels=_ROLE)
    c.add_metric(["router"], value)
    return c


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    g = GaugeMetricFamily(name, doc, labels=_ROLE)
    g.add_metric(["router"], value)
    return g


class ClusterCollector:
    """Reads the ClusterBackend's counters, its admission queue and the state reader."""

    def __init__(self, backend, reader, model_name: str = "", kv_reader=None) -> None:
        self.backend = backend
        self.reader = reader
        self.model_name = model_name
        self.kv_reader = kv_reader

    def collect(self):
        b = self.backend
        t = b.transfers
        yield _counter("pdserve_kv_transfer_bytes", "KV bytes moved prefill -> decode (as prefill reported).", t.nbytes)
        yield _counter("pdserve_kv_transfer_seconds", "Seconds those KV transfers took.", t.seconds)
        yield _counter("pdserve_kv_transfers", "KV transfers completed.", t.count)
        yield _counter("pdserve_prefill_retries", "Prefill attempts that failed and were retried elsewhere.",
                       t.prefill_retries)
        yield _counter("pdserve_decode_rejections", "Decode admissions refused for lack of blocks.",
                       t.decode_rejections)
        yield _gauge("pdserve_redis_up", "1 while the cluster state in Redis is readable.",
                     1.0 if self.reader.redis_ok else 0.0)
        yield from self._routing()
        yield from self._vllm_workers()
        yield from self._admission()
        yield from self._cluster_kv()
        if self.kv_reader is not None:
            yield from self._prefix_index()

    def _prefix_index(self):
        r = self.kv_reader
        yield _counter("pdserve_kv_events_applied", "Block events applied to the router's prefix index.",
                       r.events_applied)
        yield _counter("pdserve_kv_events_dropped", "Block events dropped (fenced incarnations, malformed).",
                       r.events_dropped + r.malformed)
        yield _gauge("pdserve_prefix_index_hashes", "Block hashes the router's prefix index holds.", len(r.index))
        yield _gauge("pdserve_kv_events_lag_seconds", "Age of the newest block event applied.", r.lag_s)

    def _routing(self):
        decisions = CounterMetricFamily(
            "pdserve_routing_decisions", "Requests placed, by prefill and decode worker.",
            labels=["role", "prefill", "decode"])
        for (prefill, decode), count in sorted(self.backend.decisions.items()):
            decisions.add_metric(["router", prefill, decode], count)
        yield decisions
        fallbacks = CounterMetricFamily(
            "pdserve_path_fallbacks", "Requests that left their planned path, by reason.",
            labels=["role", "reason"])
        for reason, count in sorted(self.backend.fallbacks.items()):
            fallbacks.add_metric(["router", reason], count)
        yield fallbacks

    def _admission(self):
        queue = self.backend.admission
        rejections = CounterMetricFamily(
            "pdserve_admission_rejections", "Requests refused by admission control, by reason.",
            labels=["role", "reason"])
        reasons = dict(self.backend.rejections)
        for reason, count in queue.rejections.items():
            reasons[reason] = reasons.get(reason, 0) + count
        for reason in ("queue_full", "queue_timeout", "exceeds_kv_capacity", "no_decode_worker"):
            rejections.add_metric(["router", reason], reasons.pop(reason, 0))
        for reason, count in sorted(reasons.items()):
            rejections.add_metric(["router", reason], count)
        yield rejections
        yield _gauge("pdserve_block_free_rate", "Decode blocks freed per second lately (estimates Retry-After).",
                     queue.free_rate.per_second())

    def _vllm_workers(self):
        """vLLM's names, one series per worker of the last snapshot (draining ones included:
        they still run requests and hold blocks)."""
        snapshot = self.reader.last_snapshot
        workers = () if snapshot is None else snapshot.workers
        families = {
            "running": GaugeMetricFamily("vllm:num_requests_running", "Requests in a worker's running batch.",
                                         labels=_VLLM_WORKER),
            "waiting": GaugeMetricFamily("vllm:num_requests_waiting",
                                         "Requests waiting: in a worker's queue, or in the router's admission "
                                         "queue (role router).", labels=_VLLM_WORKER),
            "usage": GaugeMetricFamily("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                                       labels=_VLLM_WORKER),
            "queries": CounterMetricFamily("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                           labels=_VLLM_WORKER),
            "hits": CounterMetricFamily("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                                        labels=_VLLM_WORKER),
        }
        families["waiting"].add_metric([self.model_name, "router", ""], self.backend.admission.num_waiting)
        for w in workers:
            labels = [self.model_name, w.role, w.worker_id]
            families["running"].add_metric(labels, w.num_running)
            families["waiting"].add_metric(labels, w.num_waiting)
            families["usage"].add_metric(labels, 1 - w.free_blocks / w.total_blocks if w.total_blocks else 0.0)
            families["queries"].add_metric(labels, w.prefix_cache_queries)
            families["hits"].add_metric(labels, w.prefix_cache_hits)
        yield from families.values()

    def _cluster_kv(self):
        snapshot = self.reader.last_snapshot
        if snapshot is None:
            return
        names = {
            "total_blocks": ("pdserve_cluster_kv_blocks_total", "KV blocks of every worker of the role."),
            "free_blocks": ("pdserve_cluster_kv_blocks_free", "Free KV blocks (cached count as free)."),
            "reserved_blocks": ("pdserve_cluster_kv_blocks_reserved", "Blocks reserved for KV in flight."),
            "cached_blocks": ("pdserve_cluster_kv_blocks_cached", "Free blocks still holding a reusable prefix."),
            "capacity_tokens": ("pdserve_cluster_kv_capacity_tokens", "Tokens the role's KV caches hold."),
            "workers": ("pdserve_cluster_workers", "Live workers (fresh heartbeats)."),
            "num_running": ("pdserve_cluster_requests_running", "Requests running on the role's workers."),
        }
        families = {key: GaugeMetricFamily(name, doc, labels=_ROLE) for key, (name, doc) in names.items()}
        usage = GaugeMetricFamily("pdserve_cluster_kv_cache_usage_perc",
                                  "KV-cache usage of the role's workers together (1 means 100 percent).", labels=_ROLE)
        for role in ("decode", "prefill"):  # draining workers still hold their blocks
            workers = snapshot.members(role)
            totals = role_totals(workers)
            for key, family in families.items():
                family.add_metric([role], totals[key])
            usage.add_metric([role], totals["kv_cache_usage_perc"])
        yield from families.values()
        yield usage
        per_worker = {
            "free_blocks": GaugeMetricFamily("pdserve_worker_kv_blocks_free", "Free KV blocks per worker.",
                                             labels=_WORKER),
            "total_blocks": GaugeMetricFamily("pdserve_worker_kv_blocks_total", "KV blocks per worker.",
                                              labels=_WORKER),
            "num_running": GaugeMetricFamily("pdserve_worker_requests_running", "Running requests per worker.",
                                             labels=_WORKER),
        }
        for w in snapshot.workers:
            for key, family in per_worker.items():
                family.add_metric([w.role, w.worker_id], getattr(w, key))
        yield from per_worker.values()
