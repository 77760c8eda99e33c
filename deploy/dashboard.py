"""Generate the Grafana dashboard the chart ships (deploy/helm/pdserve/files/dashboard.json).

Built with grafanalib (a maintained library, `pip install grafanalib`) rather than written by
hand, so panels stay consistent and a test can check that the committed JSON is what this
script produces:

    python deploy/dashboard.py            # rewrite the JSON
    python deploy/dashboard.py --check    # exit 1 when the committed JSON is stale

Every series comes from the router's and the workers' /metrics (metric names as exported:
vLLM's `vllm:` names with a `role` label, pdserve's own `pdserve_` names; counters carry
Prometheus's `_total` suffix). One dashboard, filtered by the `role` variable.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from grafanalib.core import (
    Dashboard,
    GridPos,
    RowPanel,
    Stat,
    Target,
    Template,
    Templating,
    TimeSeries,
)
from grafanalib._gen import DashboardEncoder

OUT = Path(__file__).resolve().parent / "helm" / "pdserve" / "files" / "dashboard.json"
DS = "${datasource}"
WORKERS = 'role=~"$role"'
"""Worker series of the chosen roles (prefill, decode)."""
QUANTILES = (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))


def _target(expr: str, legend: str, ref: str = "A") -> Target:
    return Target(expr=expr, legendFormat=legend, refId=ref, datasource=DS)


def _series(title: str, y: int, x: int, targets: list[Target], unit: str = "short", w: int = 8) -> TimeSeries:
    return TimeSeries(title=title, dataSource=DS, targets=targets, unit=unit,
                      gridPos=GridPos(h=8, w=w, x=x, y=y))


def _latency(title: str, metric: str, y: int, x: int) -> TimeSeries:
    """p50/p90/p99 of a router histogram (one series per quantile)."""
    targets = [_target(f"histogram_quantile({q}, sum by (le) (rate({metric}_bucket[$__rate_interval])))",
                       name, ref=chr(ord("A") + i)) for i, (name, q) in enumerate(QUANTILES)]
    return _series(title, y, x, targets, unit="s")


def workers_row(y: int) -> list:
    ready = Stat(title="Ready workers", dataSource=DS, gridPos=GridPos(h=8, w=6, x=0, y=y + 1),
                 targets=[_target(f"sum by (role) (pdserve_cluster_workers{{{WORKERS}}})", "{{role}}")],
                 reduceCalc="last", graphMode="none")
    return [
        RowPanel(title="Workers per role", gridPos=GridPos(h=1, w=24, x=0, y=y)),
        ready,
        TimeSeries(title="KV cache usage per worker", dataSource=DS, unit="percentunit",
                   gridPos=GridPos(h=8, w=9, x=6, y=y + 1),
                   targets=[_target(f"max by (role, worker_id) (vllm:kv_cache_usage_perc{{{WORKERS}}})",
                                    "{{role}} {{worker_id}}")]),
        TimeSeries(title="Queue: waiting requests and queued prefill tokens", dataSource=DS,
                   gridPos=GridPos(h=8, w=9, x=15, y=y + 1),
                   targets=[_target(f"sum by (role) (max by (role, worker_id) (vllm:num_requests_waiting{{{WORKERS}}}))",
                                    "{{role}} waiting requests"),
                            _target('sum(vllm:num_requests_waiting{role="router"})', "router admission queue", "B"),
                            _target('sum(pdserve_queued_prefill_tokens{role="prefill"})', "queued prefill tokens", "C")]),
    ]


def latency_row(y: int) -> list:
    return [
        RowPanel(title="Latency (router)", gridPos=GridPos(h=1, w=24, x=0, y=y)),
        _latency("Time to first token", "vllm:time_to_first_token_seconds", y + 1, 0),
        _latency("Inter-token latency", "vllm:inter_token_latency_seconds", y + 1, 8),
        _latency("End-to-end latency", "vllm:e2e_request_latency_seconds", y + 1, 16),
    ]


def flow_row(y: int) -> list:
    rate = "[$__rate_interval]"
    return [
        RowPanel(title="Transfers, paths and admission", gridPos=GridPos(h=1, w=24, x=0, y=y)),
        _series("KV transfer throughput", y + 1, 0, [_target(
            f"sum by (role) (rate(pdserve_kv_transfer_bytes_total{{{WORKERS}}}{rate})) / 1e9",
            "{{role}} GB/s")], unit="GBs"),
        _series("Request paths and fallbacks", y + 1, 8, [
            _target(f"sum by (path) (rate(pdserve_request_path_total{rate}))", "{{path}}"),
            _target(f"sum by (reason) (rate(pdserve_path_fallbacks_total{rate}))", "fallback: {{reason}}", "B")],
            unit="reqps"),
        _series("Admission rejections", y + 1, 16, [_target(
            f"sum by (reason) (rate(pdserve_admission_rejections_total{rate}))", "{{reason}}")], unit="reqps"),
    ]


def dashboard() -> Dashboard:
    role = Template(name="role", label="Role", type="custom", query="prefill,decode", default="All",
                    includeAll=True, multi=True, allValue="prefill|decode")
    datasource = Template(name="datasource", label="Data source", type="datasource", query="prometheus")
    return Dashboard(
        title="pdserve", uid="pdserve", description="Prefill/decode disaggregated serving: per-role "
        "workers, KV usage, queues, latency, KV transfer, paths and admission.",
        tags=["pdserve", "llm"], timezone="browser", refresh="30s",
        templating=Templating(list=[datasource, role]),
        panels=[*workers_row(0), *latency_row(9), *flow_row(18)],
    ).auto_panel_ids()


def render() -> str:
    return json.dumps(dashboard().to_json_data(), cls=DashboardEncoder, indent=2, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when the committed JSON differs")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        stale = not OUT.is_file() or OUT.read_text() != text
        if stale:
            print(f"{OUT} is stale: run python deploy/dashboard.py", file=sys.stderr)
        return 1 if stale else 0
    OUT.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
