"""Router-side request metrics with vLLM's names and buckets, labelled role="router".

Each RouterMetrics owns its CollectorRegistry, so several apps (tests, a router and a worker in
one process) never collide in prometheus_client's global registry.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST as PROMETHEUS_CONTENT_TYPE

__all__ = ["PROMETHEUS_CONTENT_TYPE", "RouterMetrics", "one_two_five_buckets"]

# vLLM v1's buckets (vllm/v1/metrics/loggers.py), so dashboards built for vLLM read ours.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
E2E_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip

_LABELS = ("model_name", "role")


def one_two_five_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's build_1_2_5_buckets)."""
    buckets, exponent = [], 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return tuple(buckets)
            buckets.append(value)
        exponent += 1


class RouterMetrics:
    """Counters and histograms of backend requests (one per choice). The token counters move
    as the work arrives (prompt tokens at dispatch, generated tokens as they stream), so the
    planner's arrival rates do not lag by a request's length; the per-request histograms,
    request_success and e2e latency are observed when a request ends, as vLLM does."""

    def __init__(self, model_name: str, max_model_len: int) -> None:
        self.registry = CollectorRegistry()
        self._labels = {"model_name": model_name, "role": "router"}
        r = self.registry
        self._success = Counter(
            "vllm:request_success", "Count of finished requests.",
            [*_LABELS, "finished_reason"], registry=r,
        )  # fmt: skip
        self._prompt_tokens = Counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", _LABELS, registry=r
        )
        self._generation_tokens = Counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", _LABELS, registry=r
        )
        self._path = Counter(
            "pdserve_request_path", "Finished requests by how they were served.",
            [*_LABELS, "path"], registry=r,
        )  # fmt: skip
        self._ttft = self._histogram(
            "vllm:time_to_first_token_seconds", "Time to first token in seconds.", TTFT_BUCKETS
        )
        self._itl = self._histogram(
            "vllm:inter_token_latency_seconds", "Inter-token latency in seconds.", ITL_BUCKETS
        )
        self._e2e = self._histogram(
            "vllm:e2e_request_latency_seconds", "End-to-end request latency in seconds.",
            E2E_BUCKETS,
        )  # fmt: skip
        self._queue_time = self._histogram(
            "vllm:request_queue_time_seconds",
            "Time spent waiting in the router's admission queue in seconds.", E2E_BUCKETS,
        )  # fmt: skip
        token_buckets = one_two_five_buckets(max_model_len)
        self._request_prompt = self._histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", token_buckets
        )
        self._request_generation = self._histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.",
            token_buckets,
        )  # fmt: skip

        self._children: dict[tuple[object, str], object] = {}
        """(metric, extra label value) -> its labelled child, resolved on first use (a series
        appears once observed, as before): labels(**kw) per call, a lock and dicts per token,
        showed in benchmarks/router_overhead.py's profile."""

    def _histogram(self, name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
        return Histogram(name, doc, _LABELS, buckets=buckets, registry=self.registry)

    def _child(self, metric, extra: str | None = None, value: str = ""):
        child = self._children.get((metric, value))
        if child is None:
            labels = self._labels if extra is None else {**self._labels, extra: value}
            child = self._children[(metric, value)] = metric.labels(**labels)
        return child

    def observe_first_token(self, seconds: float) -> None:
        self._child(self._ttft).observe(seconds)

    def observe_queue_time(self, seconds: float) -> None:
        self._child(self._queue_time).observe(seconds)

    def observe_inter_token(self, seconds: float) -> None:
        self._child(self._itl).observe(seconds)

    def count_prompt(self, tokens: int) -> None:
        """A backend request was dispatched with this many prompt tokens."""
        self._child(self._prompt_tokens).inc(tokens)

    def count_generated(self, tokens: int) -> None:
        """This many more tokens reached the client for a backend request."""
        if tokens:
            self._child(self._generation_tokens).inc(tokens)

    def observe_finished(
        self,
        finished_reason: str,
        prompt_tokens: int,
        generation_tokens: int,
        e2e_seconds: float,
        path: str | None,
    ) -> None:
        """One backend request ended (finished_reason "abort" when the router cut it off)."""
        self._child(self._success, "finished_reason", finished_reason).inc()
        self._child(self._request_prompt).observe(prompt_tokens)
        self._child(self._request_generation).observe(generation_tokens)
        self._child(self._e2e).observe(e2e_seconds)
        self._child(self._path, "path", path or "unknown").inc()

    def render(self) -> bytes:
        """The Prometheus text exposition of this registry."""
        return generate_latest(self.registry)
