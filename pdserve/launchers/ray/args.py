"""`pdserve up --launcher ray` flags (and `pdserve down`'s). Parsed without importing Ray."""

from __future__ import annotations

import argparse

LAUNCHERS = ("local", "ray")


def add_launcher_args(parser: argparse.ArgumentParser) -> None:
    """--launcher and the Ray flags of `pdserve up`."""
    parser.add_argument("--launcher", choices=LAUNCHERS, default="local",
                        help="local: child processes of this command; ray: Ray actors (pip install pdserve[ray])")
    g = parser.add_argument_group("ray (--launcher ray)")
    add_ray_connection_args(g)
    for role in ("prefill", "decode"):
        g.add_argument(f"--{role}-num-cpus", type=float, default=1.0,
                       help=f"CPUs Ray reserves for each {role} actor (its engine threads: this, rounded up, "
                            "unless --num-threads)")
        g.add_argument(f"--{role}-num-gpus", type=float, default=0.0,
                       help=f"GPUs Ray reserves for each {role} actor")
        g.add_argument(f"--{role}-resource", action="append", default=None, metavar="NAME[=AMOUNT]",
                       help=f"a custom Ray resource each {role} actor needs (repeatable), to pin the role to "
                            "nodes started with `ray start --resources`")
    g.add_argument("--ray-worker-host", default=None, metavar="ADDRESS|node",
                   help="address worker actors bind and advertise: node (the address of the node each runs "
                        "on) or an address. Unset: node with --ray-address, else --host")


def add_ray_connection_args(g) -> None:
    g.add_argument("--ray-address", default=None,
                   help="an existing Ray cluster (auto, ray://HOST:PORT or HOST:PORT); unset: start a local "
                        "Ray instance for this run and stop it after")


def add_down_args(parser: argparse.ArgumentParser) -> None:
    """`pdserve down --launcher ray [--ray-address ADDR] [--cluster NAME]`."""
    parser.add_argument("--launcher", choices=("ray",), default="ray",
                        help="the launcher that runs the cluster (a local `pdserve up` stops with Ctrl-C)")
    parser.add_argument("--ray-address", default="auto",
                        help="the Ray cluster the cluster runs on (auto: the one this node belongs to)")
    parser.add_argument("--cluster", default="default", help="cluster name given to `pdserve up --cluster`")
    parser.add_argument("--timeout", type=float, default=180.0,
                        help="seconds to wait for the cluster's actors to drain and go")
