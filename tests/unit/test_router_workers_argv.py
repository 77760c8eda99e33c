"""What process 0 of `--router-workers N` gives the others: its own spec on the ports it bound,
one process each (no recursion), its index, and the keys in the environment, never on argv."""

from __future__ import annotations

import sys

from pdserve.cli import build_parser
from pdserve.router_workers import child_argv, child_env


def test_the_other_router_processes_get_process_0s_spec_on_its_bound_ports_and_their_index(tmp_path):
    args = build_parser().parse_args(["router", "--port", "0", "--grpc-port", "0", "--router-workers", "3",
                                      "--api-key", "sk-flag", "--policy", "round_robin", "--cluster", "c7"])
    argv = child_argv(args, 2, 18001, 18002, tmp_path / "r2.ready")
    assert argv[:4] == [sys.executable, "-m", "pdserve", "router"]
    flags = dict(zip(argv[4::2], argv[5::2]))
    assert (flags["--port"], flags["--grpc-port"], flags["--policy"], flags["--cluster"]) == (
        "18001", "18002", "round_robin", "c7")
    assert flags["--ready-file"] == str(tmp_path / "r2.ready")
    assert flags["--router-worker-index"] == "2"
    assert "--router-workers" not in flags  # one process each
    assert "sk-flag" not in argv and "--api-key" not in argv
    child = build_parser().parse_args(argv[3:])
    assert (child.router_workers, child.router_worker_index, child.port) == (1, 2, 18001)


def test_keys_reach_the_other_router_processes_through_the_environment(monkeypatch):
    monkeypatch.delenv("PDSERVE_ADMIN_KEY", raising=False)
    env = child_env("sk-api", None)
    assert env["PDSERVE_API_KEY"] == "sk-api"
    assert "PDSERVE_ADMIN_KEY" not in env
