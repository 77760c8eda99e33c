"""Where Ray puts each component, and which address a component binds and advertises.

A role's placement is Ray's resource request for each of its actors: CPUs, GPUs and custom
resources (`ray start --resources '{"prefill_node": 8}'` on the nodes meant for prefill, then
`--prefill-resource prefill_node=1`), so a role can be pinned to a node type. The router and
the embedded Redis ask for no CPU (like Ray Serve's proxies: they must always be placeable) and
are pinned to the node that runs `pdserve up`, so `--host 127.0.0.1 --port 8000` means there
what it means with local processes.

Addresses: a local Ray instance (no --ray-address) is this one machine, so every component
binds 127.0.0.1 (or --host) exactly as with local processes. On an existing Ray cluster
(--ray-address) a worker binds and advertises the address of the node it was placed on, as Ray
knows it, never a loopback: the router, the other role's workers and the gloo/NCCL rendezvous
reach it from other nodes. `--ray-worker-host ADDRESS` overrides the rule (one node: 127.0.0.1).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field

from pdserve.specs import WORKER_ROLES

NODE_ADDRESS = "node"
"""--ray-worker-host value: bind the address of the node the actor runs on."""


@dataclass(frozen=True)
class RolePlacement:
    """One role's resource request per actor."""

    num_cpus: float = 1.0
    num_gpus: float = 0.0
    resources: dict[str, float] = field(default_factory=dict)
    """Custom resources: {"prefill_node": 1} needs a node started with that resource."""

    def __post_init__(self) -> None:
        if self.num_cpus < 0 or self.num_gpus < 0:
            raise ValueError(f"num_cpus and num_gpus must be >= 0; got {self.num_cpus}, {self.num_gpus}")
        for name, amount in self.resources.items():
            if not name or amount <= 0:
                raise ValueError(f"a custom resource needs a name and an amount > 0; got {name!r}={amount}")

    def actor_options(self) -> dict[str, object]:
        """The resource part of `ActorClass.options(...)`."""
        options: dict[str, object] = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus}
        if self.resources:
            options["resources"] = dict(self.resources)
        return options

    def threads(self) -> int:
        """Engine threads for an actor of this role: its CPUs rounded up, at least 1."""
        return max(1, math.ceil(self.num_cpus))

    def describe(self) -> str:
        parts = [f"{self.num_cpus:g} CPU"]
        if self.num_gpus:
            parts.append(f"{self.num_gpus:g} GPU")
        parts += [f"{amount:g} {name}" for name, amount in sorted(self.resources.items())]
        return ", ".join(parts)


def parse_resource(text: str) -> tuple[str, float]:
    """`NAME=AMOUNT` or `NAME` (amount 1) -> (name, amount). Raises ValueError."""
    name, _, amount = text.partition("=")
    name = name.strip()
    try:
        value = float(amount) if amount else 1.0
    except ValueError:
        raise ValueError(f"resource {text!r}: the amount must be a number (NAME=AMOUNT)") from None
    if not name or value <= 0:
        raise ValueError(f"resource {text!r}: expected NAME=AMOUNT with AMOUNT > 0")
    return name, value


def placements_from_args(args: argparse.Namespace) -> dict[str, RolePlacement]:
    """role -> RolePlacement from --ROLE-num-cpus / --ROLE-num-gpus / --ROLE-resource. Raises
    ValueError naming the flag."""
    out = {}
    for role in WORKER_ROLES:
        try:
            resources = dict(parse_resource(r) for r in getattr(args, f"{role}_resource") or [])
            out[role] = RolePlacement(getattr(args, f"{role}_num_cpus"), getattr(args, f"{role}_num_gpus"), resources)
        except ValueError as exc:
            raise ValueError(f"--{role}-*: {exc}") from None
    return out


def worker_host(setting: str | None, ray_address: str | None, default_host: str) -> str:
    """What a worker actor binds: --ray-worker-host when given ("node": its node's address),
    else the node's address on an existing cluster (--ray-address) and default_host (--host,
    127.0.0.1 by default) on a local Ray instance."""
    if setting:
        return setting
    return NODE_ADDRESS if ray_address else default_host
