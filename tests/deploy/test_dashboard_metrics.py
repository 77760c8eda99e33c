"""Each series the Grafana dashboard and the autoscalers query is one pdserve exports: its name
is a metric name in the router's or the workers' metrics code. Counters and histograms are
named there without the `_total` / `_bucket` suffixes Prometheus adds."""

from __future__ import annotations

import json
import re

from tests.deploy.chart import CHART, EXAMPLES, ROOT, render

METRIC = re.compile(r"\b(vllm:[a-z0-9_:]+|pdserve_[a-z0-9_]+)")


def _exported() -> set[str]:
    sources = [*ROOT.glob("router/**/*.py"), *ROOT.glob("worker_runtime/**/*.py")]
    return {m for p in sources for m in re.findall(r'"((?:vllm:|pdserve_)[a-z0-9_:]+)"', p.read_text())}


def _queried(text: str) -> set[str]:
    return {re.sub(r"_(total|bucket)$", "", m) for m in METRIC.findall(text)}


def test_dashboard_queries_only_exported_metrics():
    board = json.loads((CHART / "files" / "dashboard.json").read_text())
    exprs = " ".join(t["expr"] for p in board["panels"] for t in p.get("targets", []))
    assert _queried(exprs) - _exported() == set(), "the dashboard queries metrics nobody exports"


def test_autoscalers_query_exported_metrics(helm):
    objects = render(helm, EXAMPLES / "autoscaling.yaml", sets=("prefill.autoscaling.kind=keda",))
    queries = " ".join(t["metadata"]["query"] for o in objects if o["kind"] == "ScaledObject" for t in o["spec"]["triggers"])
    assert _queried(queries) == {"pdserve_queued_prefill_tokens", "vllm:num_requests_waiting"}
    assert _queried(queries) - _exported() == set()
