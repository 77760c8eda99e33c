"""The worker role registry: one entry per role, so nothing in the worker path branches on a
role's name.

A `RoleDef` says how to host a role in a process: how to build its worker from a WorkerSpec,
its gRPC servicer class, the generated `add_*_to_server` function and the gRPC service's full
name (for health and reflection). Entries are registered lazily ("module:attr"), so importing
this module (e.g. to list the role names in a parser) loads no torch, engine or worker code.
An unknown name raises KeyError listing the known roles.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.registry import Registry

if TYPE_CHECKING:
    from proto.link.methods import LinkMethod
    from pdserve.specs import WorkerSpec
    from worker_runtime.status import Worker

__all__ = ["RoleDef", "WORKER_ROLE_REGISTRY", "role_def"]


@dataclass(frozen=True)
class RoleDef:
    """How one role is hosted in a worker process. Immutable; shared by every process of the role."""

    name: str
    """"prefill" or "decode" (the spec's role and the heartbeat's)."""
    service_name: str
    """Full gRPC service name, e.g. "pdserve.v1.DecodeWorker" (health status, reflection)."""
    build: Callable[[WorkerSpec, bytes], Worker]
    """(spec, cluster secret) -> the worker, built (model loaded) but not started. Blocks for
    the model load; raises ValueError on a spec the role cannot run."""
    servicer: type
    """The gRPC servicer class (its generated base names the service)."""
    make_servicer: Callable[[Worker, str, Callable], Any]
    """(worker, the worker's own gRPC host:port, the process's drain hook) -> the servicer."""
    add_to_server: Callable[[Any, Any], None]
    """The generated add_<Service>Servicer_to_server(servicer, server)."""
    link_methods: tuple[LinkMethod, ...] = ()
    """The servicer's methods the worker link serves (proto/link: the routers' request plane)."""


WORKER_ROLE_REGISTRY: Registry[RoleDef] = Registry("worker role")
WORKER_ROLE_REGISTRY.register("prefill", "worker_runtime.builders:PREFILL")
WORKER_ROLE_REGISTRY.register("decode", "worker_runtime.builders:DECODE")


def role_def(name: str) -> RoleDef:
    """The RoleDef of `name`; KeyError listing the known roles when there is none."""
    return WORKER_ROLE_REGISTRY.get(name)
