"""The router's cluster-side metrics: KV transfers its prefills reported, failovers, Redis."""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


class ClusterCollector:
    """Read at scrape time from the ClusterBackend's totals and the state reader."""

    def __init__(self, backend, reader) -> None:
        self.backend = backend
        self.reader = reader

    def collect(self):
        t = self.backend.transfers
        labels = ["role"]

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(["router"], value)
            return c

        yield counter("pdserve_kv_transfer_bytes", "KV bytes moved prefill -> decode (as prefill reported).", t.nbytes)
        yield counter("pdserve_kv_transfer_seconds", "Seconds those KV transfers took.", t.seconds)
        yield counter("pdserve_kv_transfers", "KV transfers completed.", t.count)
        yield counter("pdserve_prefill_retries", "Prefill attempts that failed and were retried elsewhere.",
                      t.prefill_retries)
        yield counter("pdserve_decode_rejections", "Decode admissions refused for lack of blocks.",
                      t.decode_rejections)
        ok = GaugeMetricFamily("pdserve_redis_up", "1 while the cluster state in Redis is readable.",
                               labels=labels)
        ok.add_metric(["router"], 1.0 if self.reader.redis_ok else 0.0)
        yield ok
