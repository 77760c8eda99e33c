"""The worker role registry: every role the specs know has one entry naming its builder, servicer,
generated add_*_to_server and gRPC service; an unknown role lists the known ones; the registry
itself loads no worker code until a role is looked up."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.specs import WORKER_ROLES
from worker_runtime.roles import WORKER_ROLE_REGISTRY, role_def

ROOT = Path(__file__).resolve().parents[2]


def test_registry_has_exactly_the_roles_a_worker_spec_accepts():
    assert WORKER_ROLE_REGISTRY.names() == sorted(WORKER_ROLES) == ["decode", "prefill"]


def test_unknown_role_raises_key_error_listing_the_known_roles():
    with pytest.raises(KeyError) as info:
        role_def("both")
    assert info.value.args[0] == "unknown worker role 'both'; known: decode, prefill"


@pytest.mark.parametrize("role, service", [("prefill", "PrefillWorker"), ("decode", "DecodeWorker")])
def test_each_role_names_its_proto_service_servicer_and_add_function(role, service):
    from proto.pdserve.v1 import worker_pb2, worker_pb2_grpc

    entry = role_def(role)
    assert entry.name == role
    assert entry.service_name == worker_pb2.DESCRIPTOR.services_by_name[service].full_name == f"pdserve.v1.{service}"
    assert issubclass(entry.servicer, getattr(worker_pb2_grpc, f"{service}Servicer"))
    assert entry.add_to_server is getattr(worker_pb2_grpc, f"add_{service}Servicer_to_server")
    assert entry.build.__name__ == f"build_{role}"


def test_importing_the_registry_loads_no_torch_and_no_worker_code():
    code = ("import sys, worker_runtime.roles as r; r.WORKER_ROLE_REGISTRY.names(); "
            "print(sorted(m for m in ('torch', 'decode_worker.worker', 'prefill_worker.worker', "
            "'worker_runtime.builders') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert (done.returncode, done.stdout.strip()) == (0, "[]"), done.stderr
