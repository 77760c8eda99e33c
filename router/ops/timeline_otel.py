"""Per-request timelines exported as OpenTelemetry spans (optional).

With `--otlp-traces-endpoint URL` (vLLM's flag name) and OpenTelemetry's SDK and OTLP exporter
installed (`opentelemetry-sdk`, `opentelemetry-exporter-otlp`; not dependencies of pdserve),
every stored timeline becomes one trace: a root span "pdserve.request" from arrival to the end
of the response, one child span per phase at the phase's own times, and the first/last token
as events. The spans are built from the finished Timeline (the router already holds every
number), then handed to a batching processor whose own thread exports them, so the event loop
that stores timelines never waits on the collector.
"""

from __future__ import annotations

import logging

from router.ops.timeline import Timeline

logger = logging.getLogger(__name__)
SERVICE_NAME = "pdserve-router"


def _ns(unix_s: float) -> int:
    return int(unix_s * 1e9)


def _attributes(timeline: Timeline) -> dict[str, object]:
    attrs: dict[str, object] = {
        "pdserve.request_id": timeline.request_id, "pdserve.finish_reason": timeline.finish_reason or "",
        "pdserve.path": timeline.path or "", "pdserve.e2e_ms": timeline.e2e_ms,
        "gen_ai.request.model": timeline.model, "gen_ai.usage.input_tokens": timeline.prompt_tokens,
        "gen_ai.usage.output_tokens": timeline.completion_tokens, "pdserve.sequences": timeline.sequences,
    }
    if timeline.route is not None:
        attrs.update({"pdserve.prefill_id": timeline.route.prefill_id or "", "pdserve.decode_id": timeline.route.decode_id,
                      "pdserve.route_reason": timeline.route.reason})
    if timeline.transfer is not None:
        t = timeline.transfer
        attrs.update({"pdserve.kv.bytes": t.nbytes, "pdserve.kv.seconds": t.seconds, "pdserve.kv.blocks": t.num_blocks,
                      "pdserve.kv.blocks_skipped": t.blocks_skipped, "pdserve.kv.backend": t.backend})
        if t.wire_seconds is not None:
            attrs["pdserve.kv.wire_seconds"] = t.wire_seconds
    if timeline.error is not None:
        attrs["pdserve.error"] = timeline.error
    return attrs


class TimelineSpans:
    """A TimelineStore subscriber: each stored timeline -> its spans on `tracer`."""

    def __init__(self, tracer) -> None:
        self._tracer = tracer

    def __call__(self, timeline: Timeline) -> None:
        from opentelemetry import trace

        start = timeline.arrival_unix
        root = self._tracer.start_span("pdserve.request", start_time=_ns(start), attributes=_attributes(timeline))
        for mark in timeline.marks:
            root.add_event(mark.name, timestamp=_ns(start + mark.at_ms / 1000))
        parent = trace.set_span_in_context(root)
        for phase in timeline.phases:
            span = self._tracer.start_span(f"pdserve.{phase.name}", context=parent,
                                           start_time=_ns(start + phase.start_ms / 1000),
                                           attributes={f"pdserve.{k}": v for k, v in phase.detail})
            span.end(end_time=_ns(start + phase.end_ms / 1000))
        if timeline.finish_reason == "error":
            root.set_status(trace.Status(trace.StatusCode.ERROR, timeline.error or ""))
        root.end(end_time=_ns(start + timeline.e2e_ms / 1000))


def otlp_subscriber(endpoint: str) -> TimelineSpans | None:
    """Spans exported to `endpoint` over OTLP/HTTP, or None (with a warning naming what to
    install) when OpenTelemetry's SDK or OTLP exporter is missing."""
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:
        logger.warning("--otlp-traces-endpoint is set but OpenTelemetry cannot export (%s); install "
                       "opentelemetry-sdk and opentelemetry-exporter-otlp. Timelines stay in the router only.", exc)
        return None
    provider = TracerProvider(resource=Resource.create({"service.name": SERVICE_NAME}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    logger.info("exporting request timelines as OpenTelemetry spans to %s", endpoint)
    return TimelineSpans(provider.get_tracer("pdserve.router"))
