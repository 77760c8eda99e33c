"""The planner as the router serves it: current counts (the roles API's one truth), the live
measurements (PlanCollector), the model's recommendation, and the autoscaler's state, joined
into one PlanReport and its JSON (GET /v1/plan, `pdserve plan --live`, the dashboard's panel)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from router.ops.planner.autoscale import Autoscaler
from router.ops.planner.collector import PlanCollector
from router.ops.planner.model import PLAN_ROLES, PlanInputs, PlanSettings, Recommendation, recommend
from router.ops.roles import RolesApi, RolesView


@dataclass(frozen=True)
class PlanReport:
    current: dict[str, int]
    """Per role: the scaler's desired count, or the ready workers when nobody manages the role."""
    recommendation: Recommendation
    inputs: PlanInputs
    roles: RolesView


def current_counts(view: RolesView) -> dict[str, int]:
    return {r.role: r.ready if r.desired is None else r.desired for r in view.roles if r.role in PLAN_ROLES}


class Planner:
    def __init__(self, collector: PlanCollector, roles: RolesApi, settings: PlanSettings,
                 autoscaler: Autoscaler | None = None) -> None:
        self.collector = collector
        self.roles = roles
        self.settings = settings
        self.autoscaler = autoscaler

    async def plan(self) -> PlanReport:
        """The recommendation now. Raises Unavailable when the scaler cannot be read."""
        view = await self.roles.roles()
        current = current_counts(view)
        inputs = self.collector.inputs(current["prefill"], current["decode"])
        return PlanReport(current, recommend(inputs, self.settings), inputs, view)

    def to_json(self, report: PlanReport) -> dict[str, object]:
        rec, bounds, scaler = report.recommendation, self.settings.bounds, self.autoscaler
        inputs = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in asdict(report.inputs).items()
                  if v is not None}
        return {
            "current": dict(report.current),
            "recommended": {"prefill": rec.prefill, "decode": rec.decode},
            "reasons": dict(rec.reasons),
            "arithmetic": list(rec.arithmetic),
            "inputs": inputs,
            "slo": {"ttft_ms": self.settings.slo_ttft_ms, "itl_ms": self.settings.slo_itl_ms},
            "window_s": self.collector.window_s,
            "autoscale": {
                "enabled": scaler is not None,
                "min": {role: bounds.low(role) for role in PLAN_ROLES},
                "max": {role: bounds.high(role) for role in PLAN_ROLES},
                "last_action": None if scaler is None or scaler.last_action is None else scaler.last_action.to_json(),
            },
        }
