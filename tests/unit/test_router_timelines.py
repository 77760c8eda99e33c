"""Per-request timelines (issue 14 item 2): the recorder's phases (exact names, order, bounds,
contiguous from 0 to e2e), and the routes over the ring through the real HTTP app, keyed by
the X-Request-Id the client got; token sample times in SSE chunks when asked for."""

from __future__ import annotations

import pytest

from pdserve.cli import build_parser
from pdserve.specs import RouterSpec
from router.api.http import HttpSettings, create_app
from proto.pdserve.v1 import worker_pb2
from router.ops.timeline import RouteSummary, Timeline, TimelineStore, TransferSummary
from router.ops.timeline_http import timeline_routes
from router.routing.worker_replies import trace_prefill, wire_seconds
from router.serving.backend import TokenDelta
from router.serving.timeline_recorder import TimelineRecorder
from router.serving.trace import BackendTrace
from tests.unit.router_doubles import MODEL, ScriptedBackend, call, make_service, sse_payloads, token_steps


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _traced(clock: Clock) -> BackendTrace:
    trace = BackendTrace(clock=clock)
    for name, at in (("backend_start", 100.011), ("reserve_start", 100.020), ("ticket", 100.030)):
        clock.now = at
        trace.mark(name)
    trace.queue_s = 0.004
    trace.reserve.update(decode="d1", num_cached_tokens=16, num_blocks=2)
    trace.prefill.update(worker="p1", attempts=1, first_token_from="stream")
    trace.route = RouteSummary("p1", "d1", "least loaded", (("score", 1.5),))
    trace.transfer = TransferSummary(8192, 0.004, 2, 1, "gloo")
    return trace


def _bounds(timeline) -> list[tuple[str, float, float]]:
    return [(p.name, round(p.start_ms, 6), round(p.end_ms, 6)) for p in timeline.phases]


def test_a_disaggregated_request_has_every_phase_in_order_and_they_add_up_to_e2e():
    clock, store = Clock(), TimelineStore(capacity=10)
    recorder = TimelineRecorder(store, "req-1", MODEL, clock, lambda: 1_700_000_000.0)
    clock.now = 100.010
    recorder.dispatched()
    trace = _traced(clock)
    clock.now = 100.100
    recorder.on_delta(0, TokenDelta((7,), trace=trace, path="disaggregated"))
    recorder.on_delta(1, TokenDelta((5,)))  # another sequence's tokens are not timed
    clock.now = 100.200
    recorder.on_delta(0, TokenDelta((8,), finish_reason="length"))
    clock.now = 100.250
    recorder.finish(finish_reason="length", path="disaggregated", prompt_tokens=40,
                    completion_tokens=4, sequences=2)
    timeline = store.get("req-1")

    assert _bounds(timeline) == [("validate", 0.0, 11.0), ("admission_wait", 11.0, 20.0),
                                 ("reserve", 20.0, 30.0), ("prefill", 30.0, 100.0),
                                 ("decode", 100.0, 200.0), ("finish", 200.0, 250.0)]
    assert timeline.e2e_ms == pytest.approx(250.0)
    assert sum(p.duration_ms for p in timeline.phases) == pytest.approx(timeline.e2e_ms, abs=1e-9)
    assert [(m.name, round(m.at_ms, 6)) for m in timeline.marks] == [("first_token", 100.0), ("last_token", 200.0)]
    assert dict(timeline.phases[1].detail) == {"queue_ms": 4.0}
    assert dict(timeline.phases[2].detail) == {"decode": "d1", "num_cached_tokens": 16, "num_blocks": 2}
    assert dict(timeline.phases[3].detail) == {"worker": "p1", "attempts": 1, "first_token_from": "stream"}
    assert (timeline.finish_reason, timeline.path, timeline.sequences) == ("length", "disaggregated", 2)
    assert timeline.transfer.gbps == pytest.approx(8192 / 0.004 / 1e9)
    assert store.get("req-1") is timeline
    body = timeline.to_json()
    assert body["ttft_ms"] == pytest.approx(100.0)
    assert body["route"]["inputs"] == {"score": 1.5}
    assert body["transfer"]["blocks_skipped"] == 1


def test_a_transfer_streamed_during_the_prefill_reports_its_wire_seconds_and_speed_beside_its_open_time():
    streamed = TransferSummary(1_100_000, 0.5, 3, 0, "gloo", wire_seconds=0.002)
    older = TransferSummary(8192, 0.004, 2, 1, "gloo")
    body = Timeline("r", 0.0, 1.0, (), transfer=streamed).to_json()["transfer"]
    assert body == {"nbytes": 1_100_000, "seconds": 0.5, "num_blocks": 3, "blocks_skipped": 0,
                    "backend": "gloo", "wire_seconds": 0.002, "gbps": pytest.approx(0.0022),
                    "wire_gbps": pytest.approx(0.55)}
    assert (older.wire_seconds, older.wire_gbps) == (None, None)


def test_the_prefill_reply_s_wire_seconds_reach_the_trace_and_link_totals_use_them():
    trace = BackendTrace(clock=Clock())
    reply = worker_pb2.PrefillResponse(transfer=worker_pb2.TransferStats(
        bytes=4096, seconds=0.5, num_blocks=1, backend="gloo", wire_seconds=0.001))
    trace_prefill(trace, "p1", 1, 0.6, reply, blocks_skipped=2)
    older = worker_pb2.TransferStats(bytes=4096, seconds=0.5, num_blocks=1, backend="gloo")
    assert trace.transfer == TransferSummary(4096, 0.5, 1, 2, "gloo", wire_seconds=0.001)
    assert (wire_seconds(reply.transfer), wire_seconds(older)) == (0.001, 0.5)


def test_an_error_before_the_ticket_ends_the_timeline_in_the_phase_it_was_in():
    clock, store = Clock(), TimelineStore()
    recorder = TimelineRecorder(store, "req-2", MODEL, clock, lambda: 0.0)
    trace = BackendTrace(clock=clock)
    clock.now = 100.005
    trace.mark("backend_start")
    recorder.dispatched()
    recorder.on_delta(0, TokenDelta((), trace=trace))
    clock.now = 100.500
    recorder.failed(RuntimeError("no decode worker has room"))
    recorder.finish(finish_reason=None, path=None, prompt_tokens=3, completion_tokens=0, sequences=1)
    timeline = store.get("req-2")

    assert _bounds(timeline) == [("validate", 0.0, 5.0), ("admission_wait", 5.0, 500.0)]
    assert (timeline.finish_reason, timeline.error) == ("error", "no decode worker has room")
    assert timeline.marks == ()


def test_a_client_gone_before_the_end_is_recorded_as_abort():
    clock, store = Clock(), TimelineStore()
    recorder = TimelineRecorder(store, "req-3", MODEL, clock, lambda: 0.0)
    recorder.dispatched()
    clock.now = 100.050
    recorder.on_delta(0, TokenDelta((7,)))
    clock.now = 100.060
    recorder.finish(finish_reason=None, path="colocated", prompt_tokens=3, completion_tokens=1,
                    sequences=1)
    timeline = store.get("req-3")
    assert timeline.finish_reason == "abort"
    assert _bounds(timeline) == [("validate", 0.0, 0.0), ("backend", 0.0, 50.0), ("decode", 50.0, 50.0),
                                 ("finish", 50.0, 60.0)]


def test_boundaries_out_of_order_are_clamped_so_no_phase_is_negative():
    clock, store = Clock(), TimelineStore()
    recorder = TimelineRecorder(store, "req-4", MODEL, clock, lambda: 0.0)
    trace = BackendTrace(clock=clock)
    trace.marks.update(backend_start=100.030, reserve_start=100.010, ticket=100.500)  # another clock
    clock.now = 100.020
    recorder.on_delta(0, TokenDelta((7,), trace=trace, finish_reason="length"))
    clock.now = 100.040
    recorder.finish(finish_reason="length", path="disaggregated", prompt_tokens=1,
                    completion_tokens=1, sequences=1)
    timeline = store.get("req-4")
    assert _bounds(timeline) == [("validate", 0.0, 30.0), ("admission_wait", 30.0, 30.0),
                                 ("reserve", 30.0, 40.0), ("prefill", 40.0, 40.0), ("decode", 40.0, 40.0),
                                 ("finish", 40.0, 40.0)]


def test_the_ring_keeps_the_last_capacity_timelines_and_a_reused_id_replaces_its_entry():
    clock, store = Clock(), TimelineStore(capacity=2)
    for rid, e2e in (("a", 0.3), ("b", 0.1), ("a", 0.2), ("c", 0.05)):
        recorder = TimelineRecorder(store, rid, MODEL, clock, lambda: 0.0)
        clock.now += e2e
        recorder.finish(finish_reason="stop", path=None, prompt_tokens=0, completion_tokens=0, sequences=1)
    assert [t.request_id for t in store.recent(10)] == ["c", "a"]
    assert [t.request_id for t in store.slowest(10)] == ["a", "c"]


def _app(api_key: str | None = None, capacity: int = 10, steps=None):
    backend = ScriptedBackend(steps if steps is not None else token_steps([7, 8, 9]))
    service = make_service(backend, timelines=TimelineStore(capacity=capacity))
    settings = HttpSettings(api_key=api_key, version="9.9.9", ops_routes=(timeline_routes(service.timelines),))
    return create_app(service, settings)


def _complete(app, rid: str, headers: dict | None = None, **body):
    return call(app, "POST", "/v1/completions", headers={"X-Request-Id": rid, **(headers or {})},
                json={"model": MODEL, "prompt": "hi", "max_tokens": 3, **body})


def test_a_completions_timeline_is_served_by_its_x_request_id():
    app = _app()
    assert _complete(app, "my-id").status_code == 200
    response = call(app, "GET", "/v1/requests/my-id/timeline")
    assert response.status_code == 200
    body = response.json()
    assert (body["request_id"], body["finish_reason"], body["completion_tokens"]) == ("my-id", "length", 3)
    assert [p["name"] for p in body["phases"]] == ["validate", "backend", "decode", "finish"]
    assert (body["path"], body["model"], body["sequences"]) == ("disaggregated", MODEL, 1)


def test_an_unknown_request_id_is_a_404_in_vllms_error_shape():
    response = call(_app(), "GET", "/v1/requests/nope/timeline")
    assert response.status_code == 404
    assert response.json()["error"]["type"] == "NotFoundError"
    assert "nope" in response.json()["error"]["message"]


def test_a_refused_request_has_a_timeline_with_its_error():
    app = _app()
    assert _complete(app, "bad", model="other-model").status_code == 404
    body = call(app, "GET", "/v1/requests/bad/timeline").json()
    assert (body["finish_reason"], [p["name"] for p in body["phases"]]) == ("error", ["validate"])
    assert "other-model" in body["error"]


def test_the_list_is_newest_first_or_slowest_first_and_its_limit_is_checked():
    app = _app()
    for rid in ("r1", "r2", "r3"):
        _complete(app, rid)
    recent = call(app, "GET", "/v1/requests", params={"limit": "2"}).json()
    assert recent["object"] == "list"
    assert [t["request_id"] for t in recent["data"]] == ["r3", "r2"]
    assert len(call(app, "GET", "/v1/requests", params={"order": "slowest"}).json()["data"]) == 3
    for params in ({"limit": "201"}, {"limit": "0"}, {"limit": "x"}, {"order": "fastest"}):
        response = call(app, "GET", "/v1/requests", params=params)
        assert response.status_code == 400, params


def test_without_the_api_key_the_timeline_routes_answer_401():
    app = _app(api_key="sk-test")
    _complete(app, "k1", headers={"Authorization": "Bearer sk-test"})
    assert call(app, "GET", "/v1/requests/k1/timeline").status_code == 401
    assert call(app, "GET", "/v1/requests").status_code == 401
    ok = call(app, "GET", "/v1/requests/k1/timeline", headers={"Authorization": "Bearer sk-test"})
    assert ok.status_code == 200


def _timed_steps() -> list[TokenDelta]:
    return [TokenDelta((7,), sampled_at=(10.0,), path="disaggregated"),
            TokenDelta((8, 9), sampled_at=(10.5, 11.0), finish_reason="length")]


def test_sse_chunks_carry_each_tokens_sample_time_only_when_the_client_asks():
    app = _app(steps=_timed_steps())
    asked = _complete(app, "t1", headers={"X-Pdserve-Token-Times": "1"}, stream=True)
    chunks = [c for c in sse_payloads(asked.text) if isinstance(c, dict)]
    assert [c.get("pdserve_sampled_at") for c in chunks] == [[10.0], [10.5, 11.0]]
    plain = _complete(app, "t2", stream=True)
    assert all("pdserve_sampled_at" not in c for c in sse_payloads(plain.text) if isinstance(c, dict))


def test_chat_sse_chunks_carry_sample_times_too():
    app = _app(steps=_timed_steps())
    response = call(app, "POST", "/v1/chat/completions", headers={"X-Pdserve-Token-Times": "1"},
                    json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True})
    chunks = [c for c in sse_payloads(response.text) if isinstance(c, dict) and "pdserve_sampled_at" in c]
    assert [c["pdserve_sampled_at"] for c in chunks] == [[10.0], [10.5, 11.0]]


def test_timeline_capacity_is_a_router_spec_field_that_pdserve_up_passes_on_only_when_set():
    assert "--timeline-capacity" not in RouterSpec().to_argv()
    spec = RouterSpec(timeline_capacity=5)
    assert spec.to_argv()[-2:] == ["--timeline-capacity", "5"]
    assert RouterSpec.from_args(build_parser().parse_args(spec.to_argv())) == spec
    assert RouterSpec.from_args(build_parser().parse_args(["up", "--timeline-capacity", "7"])).timeline_capacity == 7
    with pytest.raises(ValueError, match="timeline_capacity"):
        RouterSpec(timeline_capacity=0)


def test_a_timeline_becomes_one_trace_with_a_span_per_phase_at_its_own_times():
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from router.ops.timeline_otel import TimelineSpans

    exporter, provider = InMemorySpanExporter(), TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    clock, store = Clock(), TimelineStore()
    store.subscribe(TimelineSpans(provider.get_tracer("test")))
    recorder = TimelineRecorder(store, "otel-1", MODEL, clock, lambda: 1_700_000_000.0)
    recorder.dispatched()
    clock.now = 100.010
    recorder.on_delta(0, TokenDelta((7,), finish_reason="length"))
    clock.now = 100.030
    recorder.finish(finish_reason="length", path="colocated", prompt_tokens=2, completion_tokens=1, sequences=1)

    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert sorted(spans) == ["pdserve.backend", "pdserve.decode", "pdserve.finish", "pdserve.request",
                             "pdserve.validate"]
    root, finish = spans["pdserve.request"], spans["pdserve.finish"]
    near = lambda ns, want: abs(ns - want) < 1000  # noqa: E731 (float seconds -> ns: within 1 us)
    assert near(root.start_time, 1_700_000_000_000_000_000) and near(root.end_time, 1_700_000_000_030_000_000)
    assert near(finish.start_time, 1_700_000_000_010_000_000) and finish.end_time == root.end_time
    assert all(s.parent.span_id == root.context.span_id for s in spans.values() if s is not root)
    assert root.attributes["pdserve.request_id"] == "otel-1"
    assert [e.name for e in root.events] == ["first_token", "last_token"]


def test_without_the_otlp_exporter_installed_export_is_off_with_a_warning(caplog):
    from router.ops.timeline_otel import otlp_subscriber

    try:
        import opentelemetry.exporter.otlp.proto.http.trace_exporter  # noqa: F401
    except ImportError:
        assert otlp_subscriber("http://127.0.0.1:4318/v1/traces") is None
        assert "opentelemetry-exporter-otlp" in caplog.text
    else:
        pytest.skip("the OTLP exporter is installed here")


def test_a_recorded_timeline_is_built_when_first_read_or_at_once_for_subscribers(monkeypatch):
    clock, store = Clock(), TimelineStore()
    builds = []
    real_phases = TimelineRecorder._phases

    def counting_phases(self, e2e):
        builds.append(self._request_id)
        return real_phases(self, e2e)

    monkeypatch.setattr(TimelineRecorder, "_phases", counting_phases)
    for rid in ("a", "b"):
        recorder = TimelineRecorder(store, rid, MODEL, clock, lambda: 0.0)
        clock.now += 0.01
        recorder.finish(finish_reason="stop", path=None, prompt_tokens=0, completion_tokens=0, sequences=1)
    assert builds == []  # nobody read them yet
    assert store.get("a").e2e_ms == pytest.approx(10.0) and builds == ["a"]
    assert store.get("a") is store.get("a") and builds == ["a"]  # built once
    assert [t.request_id for t in store.recent(10)] == ["b", "a"] and builds == ["a", "b"]

    seen = []
    store.subscribe(seen.append)
    recorder = TimelineRecorder(store, "c", MODEL, clock, lambda: 0.0)
    recorder.finish(finish_reason="stop", path=None, prompt_tokens=0, completion_tokens=0, sequences=1)
    assert [t.request_id for t in seen] == ["c"] and builds == ["a", "b", "c"]
