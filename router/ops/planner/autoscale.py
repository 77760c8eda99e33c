"""--autoscale: the router applies the planner's recommendation itself, through the scaler.

It calls RolesApi.scale, the call PUT /v1/roles/{role} makes, so the dashboard, `pdserve
scale` and an external autoscaler all see one truth (the scaler's desired count); a person
who sets a count is overridden only by a recommendation that holds again afterwards.

Hysteresis (`Hysteresis`, pure): a recommendation different from the current desired count
must hold for `up_evaluations` consecutive evaluations to scale up and `down_evaluations` to
scale down; no role changes again within `cooldown_s` of its last change, nor while its last
change is still pending (desired != ready, or a worker draining). Up jumps to the
recommendation; down removes one worker per change (slower down than up: a drain is not free,
and a burst that comes back would find the capacity gone).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from router.errors import RouterError
from router.ops.planner.model import PLAN_ROLES

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AutoscaleSettings:
    interval_s: float = 5.0
    """Seconds between evaluations (--autoscale-interval)."""
    cooldown_s: float = 30.0
    """Seconds a role is left alone after a change (--autoscale-cooldown)."""
    up_evaluations: int = 2
    """Consecutive evaluations a higher recommendation must hold before scaling up."""
    down_evaluations: int = 6
    """... a lower one before scaling down (slower down than up)."""

    def __post_init__(self) -> None:
        if not self.interval_s > 0 or self.cooldown_s < 0:
            raise ValueError(f"autoscale interval must be > 0 and cooldown >= 0; got {self.interval_s}, "
                             f"{self.cooldown_s}")
        if self.up_evaluations < 1 or self.down_evaluations < 1:
            raise ValueError("autoscale evaluations must be >= 1")


@dataclass(frozen=True)
class ScaleAction:
    at_unix: float
    role: str
    from_count: int
    to_count: int
    why: str

    def to_json(self) -> dict[str, object]:
        return {"at_unix": self.at_unix, "role": self.role, "from": self.from_count, "to": self.to_count,
                "why": self.why}


@dataclass
class Hysteresis:
    """Per role: how long the recommendation has pointed one way, and when the role last changed."""

    settings: AutoscaleSettings
    _streak: dict[str, tuple[int, int]] = field(default_factory=dict)
    """role -> (direction +1/-1, consecutive evaluations)."""
    _changed_at: dict[str, float] = field(default_factory=dict)

    def step(self, role: str, current: int, recommended: int, pending: bool, now: float) -> int | None:
        """One evaluation of one role: the count to scale to now, or None. Mutates the streak."""
        if pending or recommended == current:
            self._streak.pop(role, None)
            return None
        direction = 1 if recommended > current else -1
        previous, count = self._streak.get(role, (direction, 0))
        count = count + 1 if previous == direction else 1
        self._streak[role] = (direction, count)
        hold = self.settings.up_evaluations if direction > 0 else self.settings.down_evaluations
        if count < hold or now - self._changed_at.get(role, -float("inf")) < self.settings.cooldown_s:
            return None
        self._streak.pop(role, None)
        self._changed_at[role] = now
        return recommended if direction > 0 else current - 1


Scale = Callable[[str, int], Awaitable[object]]


class Autoscaler:
    """Evaluates the plan every interval_s and scales through `scale` (RolesApi.scale)."""

    def __init__(self, settings: AutoscaleSettings, scale: Scale, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
        self.settings = settings
        self._scale = scale
        self._hysteresis = Hysteresis(settings)
        self._clock = clock
        self._wall = wall
        self.last_action: ScaleAction | None = None

    async def evaluate(self, report) -> list[ScaleAction]:
        """Act on one PlanReport (router.ops.planner.service): the actions taken."""
        actions = []
        for role in PLAN_ROLES:
            status = next(r for r in report.roles.roles if r.role == role)
            pending = status.desired is not None and (status.desired != status.ready or status.draining > 0)
            current, recommended = report.current[role], getattr(report.recommendation, role)
            target = self._hysteresis.step(role, current, recommended, pending, self._clock())
            if target is None:
                continue
            action = ScaleAction(self._wall(), role, current, target, report.recommendation.reasons[role])
            try:
                await self._scale(role, target)
            except RouterError as exc:
                logger.warning("autoscale %s %d -> %d failed: %s", role, current, target, exc.message)
                continue
            logger.info("autoscale: %s %d -> %d (%s)", role, current, target, action.why)
            self.last_action = action
            actions.append(action)
        return actions

    async def run(self, plan: Callable[[], Awaitable[object]]) -> None:
        """Evaluate every interval_s until cancelled; a failed evaluation is logged and skipped."""
        while True:
            await asyncio.sleep(self.settings.interval_s)
            try:
                await self.evaluate(await plan())
            except RouterError as exc:  # e.g. the scaler unreachable: try again next time
                logger.warning("autoscale evaluation skipped: %s", exc.message)
            except Exception:  # noqa: BLE001 — the autoscaler must not take the router down
                logger.exception("autoscale evaluation failed")
