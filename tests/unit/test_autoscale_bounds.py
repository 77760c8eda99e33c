"""The planner's --autoscale-min/max bounds against the roles API's --max-replicas: a bound set
above it is refused at start (pdserve router before the model loads, pdserve up before anything
starts), naming both flags and values; a bound left at its default is lowered to it."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.cli import build_parser
from pdserve.planner_main import planner_problem, role_bounds
from pdserve.specs import RouterSpec
from router.ops.planner.model import RoleBounds

ROOT = Path(__file__).resolve().parents[2]


def refusal(flag: str, value: int, max_replicas: int) -> str:
    return (f"{flag} {value} is above --max-replicas {max_replicas}: the roles API refuses any scale past "
            f"{max_replicas}, so the autoscaler could never get there; lower {flag} or raise --max-replicas")


def router_args(*flags: str):
    return build_parser().parse_args(["router", *flags])


@pytest.mark.parametrize(("bounds", "flag", "value"), [
    (RoleBounds(max_decode=20), "--autoscale-max-decode", 20),
    (RoleBounds(max_prefill=17), "--autoscale-max-prefill", 17),
    (RoleBounds(min_decode=17, max_decode=17), "--autoscale-min-decode", 17),
])
def test_a_bound_set_above_max_replicas_is_refused_naming_both_flags(bounds, flag, value):
    with pytest.raises(ValueError) as refused:
        bounds.within(16)
    assert str(refused.value) == refusal(flag, value, 16)


def test_bounds_left_at_their_defaults_are_lowered_to_max_replicas():
    assert RoleBounds().within(2) == RoleBounds(min_prefill=1, max_prefill=2, min_decode=1, max_decode=2)
    assert RoleBounds(min_decode=2, max_prefill=2).within(2) == RoleBounds(1, 2, 2, 2)
    assert RoleBounds().within(0) == RoleBounds(0, 1, 0, 1)  # a max stays >= 1 (RoleBounds' own rule)


def test_bounds_within_max_replicas_are_kept_as_given():
    bounds = RoleBounds(min_prefill=2, max_prefill=16, min_decode=3, max_decode=12)
    assert bounds.within(16) is bounds


def test_the_router_holds_default_bounds_to_its_max_replicas_and_says_so(caplog):
    caplog.set_level(logging.INFO, logger="pdserve.planner_main")
    args = router_args("--max-replicas", "3")
    assert planner_problem(args) is None
    assert role_bounds(args) == RoleBounds(1, 3, 1, 3)
    assert [r.getMessage() for r in caplog.records] == [
        "autoscale bounds held to --max-replicas 3: prefill 1..3, decode 1..3"]


def test_the_router_reports_an_explicit_contradiction_before_the_model_loads():
    assert planner_problem(router_args("--autoscale-max-prefill", "9", "--max-replicas", "8")) == \
        refusal("--autoscale-max-prefill", 9, 8)
    assert planner_problem(router_args("--autoscale-max-prefill", "8", "--max-replicas", "8")) is None


def test_the_router_spec_refuses_the_contradiction_so_pdserve_up_does_before_starting():
    with pytest.raises(ValueError) as refused:
        RouterSpec(max_replicas=4, autoscale_max_decode=6)
    assert str(refused.value) == refusal("--autoscale-max-decode", 6, 4)
    assert RouterSpec(max_replicas=2).max_replicas == 2  # default bounds: no flag needed


@pytest.mark.parametrize(("command", "code", "stderr_tail"), [
    (["router", "--port", "0", "--grpc-port", "0", "--autoscale-max-decode", "20"], 1,
     "pdserve router: " + refusal("--autoscale-max-decode", 20, 16)),
    (["up", "--port", "0", "--grpc-port", "0", "--max-replicas", "8", "--autoscale-max-prefill", "9"], 2,
     "pdserve: error: " + refusal("--autoscale-max-prefill", 9, 8)),
])
def test_the_commands_exit_at_once_with_one_line(command, code, stderr_tail):
    result = subprocess.run([sys.executable, "-m", "pdserve", *command], cwd=ROOT, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == code
    assert result.stderr.splitlines()[-1] == stderr_tail
