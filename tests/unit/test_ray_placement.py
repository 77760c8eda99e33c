"""`pdserve up --launcher ray`: flags, placement and the address rule (pure; no Ray started)."""

from __future__ import annotations

import pytest

from pdserve.cli import build_parser
from pdserve.launchers.ray.placement import (NODE_ADDRESS, RolePlacement, parse_resource, placements_from_args,
                                             worker_host)


def up_args(*flags: str):
    return build_parser().parse_args(["up", "--launcher", "ray", *flags])


def test_each_role_states_its_cpus_gpus_and_custom_resources():
    args = up_args("--prefill-num-cpus", "4", "--decode-num-cpus", "2", "--decode-num-gpus", "1",
                   "--prefill-resource", "prefill_node", "--decode-resource", "decode_node=0.5",
                   "--decode-resource", "fast_nic=1")
    placements = placements_from_args(args)
    assert placements["prefill"] == RolePlacement(4.0, 0.0, {"prefill_node": 1.0})
    assert placements["decode"] == RolePlacement(2.0, 1.0, {"decode_node": 0.5, "fast_nic": 1.0})
    assert placements["decode"].actor_options() == {"num_cpus": 2.0, "num_gpus": 1.0,
                                                    "resources": {"decode_node": 0.5, "fast_nic": 1.0}}
    assert placements["prefill"].actor_options() == {"num_cpus": 4.0, "num_gpus": 0.0,
                                                     "resources": {"prefill_node": 1.0}}
    assert placements["decode"].describe() == "2 CPU, 1 GPU, 0.5 decode_node, 1 fast_nic"


def test_defaults_are_one_cpu_no_gpu_and_the_local_launcher():
    args = build_parser().parse_args(["up"])
    assert args.launcher == "local" and args.ray_address is None
    assert placements_from_args(args) == {"prefill": RolePlacement(1.0, 0.0, {}), "decode": RolePlacement(1.0, 0.0, {})}


def test_engine_threads_follow_the_cpus_ray_reserves():
    assert [RolePlacement(n).threads() for n in (0.0, 0.5, 1.0, 2.5, 8.0)] == [1, 1, 1, 3, 8]


@pytest.mark.parametrize("text, message", [
    ("=2", "resource '=2': expected NAME=AMOUNT with AMOUNT > 0"),
    ("gpu_node=x", "resource 'gpu_node=x': the amount must be a number (NAME=AMOUNT)"),
    ("gpu_node=0", "resource 'gpu_node=0': expected NAME=AMOUNT with AMOUNT > 0"),
])
def test_a_bad_resource_is_refused_with_the_reason(text, message):
    with pytest.raises(ValueError) as info:
        parse_resource(text)
    assert str(info.value) == message


def test_negative_cpus_are_refused_naming_the_role():
    with pytest.raises(ValueError, match=r"--decode-\*: num_cpus and num_gpus must be >= 0; got -1.0, 0.0"):
        placements_from_args(up_args("--decode-num-cpus", "-1"))


def test_workers_bind_loopback_on_a_local_instance_and_their_node_address_on_an_existing_cluster():
    assert worker_host(None, None, "127.0.0.1") == "127.0.0.1"
    assert worker_host(None, "auto", "127.0.0.1") == NODE_ADDRESS
    assert worker_host(None, "ray://head:10001", "127.0.0.1") == NODE_ADDRESS
    assert worker_host("127.0.0.1", "auto", "127.0.0.1") == "127.0.0.1"
    assert worker_host(NODE_ADDRESS, None, "127.0.0.1") == NODE_ADDRESS


def test_down_defaults_to_the_ray_cluster_this_node_belongs_to():
    args = build_parser().parse_args(["down"])
    assert (args.launcher, args.ray_address, args.cluster, args.timeout) == ("ray", "auto", "default", 180.0)


@pytest.mark.parametrize("command", [["up", "--launcher", "ray"], ["down"]])
def test_without_ray_installed_the_ray_commands_name_the_extra_in_one_line(command):
    import subprocess
    import sys

    code = ("import sys; sys.modules['ray'] = None; from pdserve.cli import main; "
            f"raise SystemExit(main({command!r}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "Ray is not installed" in out.stderr and "pip install 'pdserve[ray]'" in out.stderr
    assert "Traceback" not in out.stderr
