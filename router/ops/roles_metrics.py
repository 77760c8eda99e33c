"""The roles' replica counts and restarts on the router's /metrics, from RolesApi's last view
(refreshed by the /metrics route just before it renders; a failed refresh keeps the previous
view, so a scrape never waits on a dead scaler for more than its timeout)."""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from router.ops.roles import RolesApi


class RolesCollector:
    """pdserve_role_replicas{role,state} and pdserve_worker_restarts_total{role}."""

    def __init__(self, roles: RolesApi) -> None:
        self.roles = roles

    def collect(self):
        view = self.roles.last
        replicas = GaugeMetricFamily(
            "pdserve_role_replicas",
            "Replicas per role: desired (the scaler's count; absent without a scaler), ready "
            "(serving) and draining.", labels=["role", "state"])
        restarts = CounterMetricFamily(
            "pdserve_worker_restarts", "Crashed workers restarted by the scaler's controller.",
            labels=["role"])
        for status in view.roles if view is not None else ():
            if status.desired is not None:
                replicas.add_metric([status.role, "desired"], status.desired)
            replicas.add_metric([status.role, "ready"], status.ready)
            replicas.add_metric([status.role, "draining"], status.draining)
            restarts.add_metric([status.role], status.restarts)
        yield replicas
        yield restarts
