"""--autoscale: hysteresis (hold, cooldown, pending, slower down than up) and the autoscaler
acting through the real RolesApi on a scaler that records its calls."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from router.ops.planner.autoscale import Autoscaler, AutoscaleSettings, Hysteresis
from router.ops.planner.collector import PlanCollector, RouterTotals, Sample
from router.ops.planner.model import PlanSettings, RoleBounds
from router.ops.planner.service import Planner
from tests.unit.roles_doubles import FakeScaler, roles_api, snapshot, worker

SETTINGS = AutoscaleSettings(interval_s=1.0, cooldown_s=30.0, up_evaluations=2, down_evaluations=4)


def test_scaling_up_waits_for_the_recommendation_to_hold_then_jumps_to_it():
    h = Hysteresis(SETTINGS)
    assert h.step("prefill", current=1, recommended=3, pending=False, now=100.0) is None
    assert h.step("prefill", current=1, recommended=3, pending=False, now=101.0) == 3


def test_scaling_down_waits_longer_and_removes_one_worker_at_a_time():
    h = Hysteresis(SETTINGS)
    assert [h.step("decode", 4, 1, False, 100.0 + t) for t in range(4)] == [None, None, None, 3]


def test_a_role_is_left_alone_for_the_cooldown_after_a_change():
    h = Hysteresis(SETTINGS)
    h.step("prefill", 1, 2, False, 0.0)
    assert h.step("prefill", 1, 2, False, 1.0) == 2
    assert [h.step("prefill", 2, 4, False, t) for t in (2.0, 3.0, 30.0)] == [None, None, None]
    assert h.step("prefill", 2, 4, False, 31.0) == 4  # the streak held through the cooldown


def test_a_pending_change_or_a_flip_of_direction_restarts_the_count():
    h = Hysteresis(SETTINGS)
    assert h.step("decode", 2, 3, False, 0.0) is None
    assert h.step("decode", 2, 3, True, 1.0) is None     # desired != ready: wait for it
    assert h.step("decode", 2, 3, False, 2.0) is None    # counting again from 1
    assert h.step("decode", 2, 1, False, 3.0) is None    # the other way: from 1 again
    assert h.step("decode", 2, 3, False, 4.0) is None
    assert h.step("decode", 2, 3, False, 5.0) == 3


def long_prompt_samples() -> list[Sample]:
    """20 s of prompts arriving at 1000 tok/s on one prefill worker that computes 500 tok/s busy."""
    p0, d0 = worker("prefill-0", "prefill"), worker("decode-0", "decode")
    return [Sample(t, (dataclasses.replace(p0, prompt_tokens=int(500 * t), prefill_busy_s=t),
                       dataclasses.replace(d0, generation_tokens=int(2 * t), decode_busy_s=t / 100)),
                   RouterTotals(requests=t, prompt_tokens=1000 * t, generation_tokens=2 * t))
            for t in (0.0, 20.0)]


def planner(scaler: FakeScaler, autoscale: bool = True) -> Planner:
    cluster = snapshot(worker("prefill-0", "prefill"), worker("decode-0", "decode"))
    roles = roles_api(scaler, cluster=cluster)

    async def snap():
        return cluster

    collector = PlanCollector(snap, RouterTotals, lambda: 0, window_s=60)
    collector.samples.extend(long_prompt_samples())
    settings = PlanSettings(bounds=RoleBounds(max_prefill=4, max_decode=4))
    scaler_loop = Autoscaler(SETTINGS, roles.scale, clock=iter(range(100)).__next__, wall=lambda: 1234.5)
    return Planner(collector, roles, settings, scaler_loop if autoscale else None)


def test_the_autoscaler_scales_through_the_roles_api_once_the_recommendation_holds():
    scaler = FakeScaler({"prefill": 1, "decode": 1})
    p = planner(scaler)

    async def evaluate_twice():
        first = await p.autoscaler.evaluate(await p.plan())
        second = await p.autoscaler.evaluate(await p.plan())
        return first, second, await p.plan()

    first, second, report = asyncio.run(evaluate_twice())
    assert first == [] and scaler.calls == [("prefill", 3)]  # ceil(1000 / (500 x 0.8)) = 3; decode stays 1
    body = p.to_json(report)
    assert body["current"] == {"prefill": 3, "decode": 1}
    assert body["autoscale"] == {"enabled": True, "min": {"prefill": 1, "decode": 1}, "max": {"prefill": 4, "decode": 4},
                                 "last_action": {"at_unix": 1234.5, "role": "prefill", "from": 1, "to": 3,
                                                 "why": "1000.0 prompt tok/s over 400.0 tok/s per worker"}}


def test_settings_refuse_a_zero_interval():
    with pytest.raises(ValueError, match="autoscale interval must be > 0 and cooldown >= 0; got 0, 30"):
        AutoscaleSettings(interval_s=0, cooldown_s=30)
