"""The router's planner assembly: the planner flags, the Planner (collector, model settings,
autoscaler) built from them, and the tasks that run it (pdserve/router_main.py calls these)."""

from __future__ import annotations

import argparse
import asyncio
import logging

__all__ = ["add_planner_args", "build_planner", "plan_routes", "planner_problem", "role_bounds", "start_planner"]

logger = logging.getLogger(__name__)


def add_planner_args(g) -> None:
    """The planner and --autoscale flags (on `pdserve router` and `pdserve up`)."""
    from pdserve.router_args import _true_or_false
    from router.ops.planner.autoscale import AutoscaleSettings
    from router.ops.planner.model import PlanSettings, RoleBounds

    g.add_argument("--slo-ttft-ms", type=float, default=None,
                   help="planner: time-to-first-token p99 target in ms (unset: no TTFT rule)")
    g.add_argument("--slo-itl-ms", type=float, default=None,
                   help="planner: inter-token latency p99 target in ms (unset: no ITL rule)")
    g.add_argument("--plan-window", type=float, default=60.0,
                   help="planner: seconds of live measurements the rates and throughputs are taken over")
    g.add_argument("--plan-target-utilization", type=float, default=PlanSettings.target_utilization,
                   help="planner: busy fraction each worker is sized for (0..1]")
    g.add_argument("--autoscale", nargs="?", const=True, default=False, type=_true_or_false,
                   help="apply the planner's recommendation through the scaler (needs --scaler)")
    g.add_argument("--autoscale-interval", type=float, default=AutoscaleSettings.interval_s,
                   help="autoscale: seconds between evaluations of the plan")
    g.add_argument("--autoscale-cooldown", type=float, default=AutoscaleSettings.cooldown_s,
                   help="autoscale: seconds a role is left alone after it was scaled")
    for role in ("prefill", "decode"):
        g.add_argument(f"--autoscale-min-{role}", type=int, default=getattr(RoleBounds, f"min_{role}"),
                       help=f"fewest {role} workers the planner recommends (and autoscale keeps)")
        g.add_argument(f"--autoscale-max-{role}", type=int, default=getattr(RoleBounds, f"max_{role}"),
                       help=f"most {role} workers the planner recommends (and autoscale starts); "
                            "not above --max-replicas (a default one is lowered to it)")


NO_SCALER = ("--autoscale needs a scaler to act through (--scaler local, ray or kubernetes; pdserve up and the "
             "Helm chart set one)")


def planner_problem(args: argparse.Namespace) -> str | None:
    """Why these flags cannot start a router's planner (checked before the model loads), or None."""
    if args.autoscale and args.scaler == "none":
        return NO_SCALER
    try:
        _given_bounds(args).within(args.max_replicas)
    except ValueError as exc:  # bounds that contradict each other or --max-replicas
        return str(exc)
    return None


def _given_bounds(args: argparse.Namespace):
    from router.ops.planner.model import RoleBounds

    return RoleBounds(args.autoscale_min_prefill, args.autoscale_max_prefill, args.autoscale_min_decode,
                      args.autoscale_max_decode)


def role_bounds(args: argparse.Namespace):
    """The planner's per-role bounds from the --autoscale-min/max flags, held to --max-replicas
    (RoleBounds.within: one set above it is a ValueError, a default one is lowered to it)."""
    given = _given_bounds(args)
    bounds = given.within(args.max_replicas)
    if bounds != given:
        logger.info("autoscale bounds held to --max-replicas %d: prefill %d..%d, decode %d..%d", args.max_replicas,
                    bounds.min_prefill, bounds.max_prefill, bounds.min_decode, bounds.max_decode)
    return bounds


def build_planner(args: argparse.Namespace, service, backend, reader, roles):
    """The Planner (its collector, and its autoscaler when --autoscale on router process 0).
    Raises SystemExit with one line for --autoscale without a scaler."""
    from router.ops.planner.autoscale import Autoscaler, AutoscaleSettings
    from router.ops.planner.collector import PlanCollector, router_totals
    from router.ops.planner.model import PlanSettings
    from router.ops.planner.service import Planner

    if args.autoscale and roles.scaler is None:
        raise SystemExit(f"pdserve router: {NO_SCALER}")
    try:
        settings = PlanSettings(args.slo_ttft_ms, args.slo_itl_ms, args.plan_target_utilization, role_bounds(args))
        collector = PlanCollector(reader.snapshot, lambda: router_totals(service.metrics.registry),
                                  lambda: backend.admission.num_waiting, args.plan_window)
        autoscaler = None
        if args.autoscale and getattr(args, "router_worker_index", 0) == 0:  # one autoscaler per router
            autoscaler = Autoscaler(AutoscaleSettings(args.autoscale_interval, args.autoscale_cooldown), roles.scale)
    except ValueError as exc:
        raise SystemExit(f"pdserve router: {exc}") from None
    return Planner(collector, roles, settings, autoscaler)


def plan_routes(planner):
    """GET /v1/plan (fastapi imported only when a router is built, not for every `pdserve` command)."""
    from router.ops.planner.http import plan_routes as routes

    return routes(planner)


def start_planner(planner) -> list[asyncio.Task]:
    """The collector's sampling task, and the autoscaler's when there is one."""
    tasks = [asyncio.create_task(planner.collector.run(), name="planner-samples")]
    if planner.autoscaler is not None:
        tasks.append(asyncio.create_task(planner.autoscaler.run(planner.plan), name="autoscaler"))
    return tasks
