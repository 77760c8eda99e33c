"""WorkerSpec's advertised address and liveness bound: flags, validation, argv round trip."""

from __future__ import annotations

import pytest

from pdserve.cli import build_parser
from pdserve.specs import WorkerSpec


def test_advertised_host_defaults_to_the_bind_host():
    assert WorkerSpec(role="decode", host="10.0.0.7").advertised_host == "10.0.0.7"


def test_worker_bound_to_all_addresses_advertises_the_given_host():
    spec = WorkerSpec(role="decode", host="0.0.0.0", advertise_host="10.1.2.3")
    assert (spec.host, spec.advertised_host) == ("0.0.0.0", "10.1.2.3")


@pytest.mark.parametrize("host,advertise,name", [("0.0.0.0", None, "host"), ("::", None, "host"),
                                                 ("0.0.0.0", "0.0.0.0", "advertise_host"),
                                                 ("127.0.0.1", "", "advertise_host")])
def test_bind_all_address_is_refused_as_the_advertised_one(host, advertise, name):
    with pytest.raises(ValueError) as info:
        WorkerSpec(role="prefill", host=host, advertise_host=advertise)
    assert str(info.value).startswith(f"{name} {(advertise if advertise is not None else host)!r} cannot be "
                                      "advertised: peers cannot dial a bind-all address; pass --advertise-host")


def test_liveness_stall_must_be_positive():
    with pytest.raises(ValueError, match=r"^liveness_stall_s must be > 0; got 0$"):
        WorkerSpec(role="decode", liveness_stall_s=0)


def test_advertise_host_and_liveness_stall_round_trip_through_argv():
    spec = WorkerSpec(role="decode", host="0.0.0.0", advertise_host="10.1.2.3", port=50051,
                      metrics_port=9100, liveness_stall_s=12.5)
    argv = spec.to_argv()
    assert argv[argv.index("--advertise-host") + 1] == "10.1.2.3"
    assert argv[argv.index("--liveness-stall") + 1] == "12.5"
    assert WorkerSpec.from_args(build_parser().parse_args(argv)) == spec


def test_worker_flags_default_to_no_advertise_host_and_a_60_s_stall():
    spec = WorkerSpec.from_args(build_parser().parse_args(["prefill"]))
    assert (spec.advertise_host, spec.liveness_stall_s) == (None, 60.0)
    assert "--advertise-host" not in spec.to_argv()


@pytest.mark.parametrize("host,advertised", [("0.0.0.0", "127.0.0.1"), ("::", "127.0.0.1"),
                                             ("127.0.0.1", "127.0.0.1"), ("10.0.0.4", "10.0.0.4")])
def test_pdserve_up_workers_bound_to_all_addresses_advertise_loopback(host, advertised):
    import shutil

    from pdserve.launchers.local import LocalCluster

    cluster = LocalCluster(build_parser().parse_args(["up", "--host", host]))
    try:
        assert cluster._worker_spec("decode", "decode-0").advertised_host == advertised
    finally:
        shutil.rmtree(cluster.workdir)


@pytest.mark.parametrize("argv,share", [
    (["--device", "cuda"], 0.45),  # 1 prefill + 1 decode on the one GPU: 0.9 split in two
    (["--device", "cuda", "--prefill", "2", "--decode", "1"], 0.3),
    (["--device", "cuda", "--gpu-memory-utilization", "0.2"], 0.2),  # as given
    (["--device", "cuda", "--kv-cache-memory", "4GiB"], None),  # sized another way
    (["--device", "cuda", "--num-gpu-blocks-override", "512"], None),
    (["--device", "cpu"], None),  # the CPU default (2 GiB per engine) stands
])
def test_pdserve_up_splits_the_default_gpu_share_among_the_workers_it_starts(argv, share, monkeypatch):
    """Local workers all start on the same GPU, and each share is of the whole GPU: two workers
    each taking the default 0.9 would not fit (the second's allocation would fail)."""
    import shutil

    import torch

    from pdserve.launchers.local import LocalCluster

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # as on a GPU host (`up` checked it)

    cluster = LocalCluster(build_parser().parse_args(["up", *argv]))
    try:
        for role in ("prefill", "decode"):
            assert cluster._worker_spec(role, f"{role}-0").engine.gpu_memory_utilization == share
    finally:
        shutil.rmtree(cluster.workdir)
