"""WorkerProbes' three checks over a process's state (the real class; the process's state is
given as plain values and a clock): each failure's exact reason, in the order readiness
reports them."""

from __future__ import annotations

import pytest

from engine.serving_loop import LoopProgress
from worker_runtime.probes import ProbeResult, WorkerProbes
from worker_runtime.status import WorkerState

OK = ProbeResult(True, "ok")


def probes(state=WorkerState.SERVING, serving=True, problem=None, alive=True, last=100.0, now=100.0):
    return WorkerProbes(lambda: state, lambda: serving, lambda: problem,
                        lambda: LoopProgress(alive, last, 7), stall_s=60.0, clock=lambda: now)


def test_a_serving_registered_worker_with_a_moving_loop_passes_all_three():
    p = probes()
    assert (p.startup(), p.liveness(), p.readiness()) == (OK, OK, OK)


def test_liveness_fails_only_past_the_stall_bound():
    assert probes(last=100.0, now=160.0).liveness() == OK
    assert probes(last=100.0, now=160.5).liveness() == ProbeResult(
        False, "the engine loop has made no progress for 60.5 s (--liveness-stall 60; 7 steps so far)")
    assert probes(alive=False).liveness() == ProbeResult(False, "the engine loop thread is not running")


@pytest.mark.parametrize("kwargs,reason", [
    ({"state": WorkerState.STARTING}, "starting: not taking new requests"),
    ({"state": WorkerState.DRAINING}, "draining: not taking new requests"),
    ({"alive": False}, "the engine loop thread is not running"),
    ({"problem": "not registered in Redis yet"}, "not registered in Redis yet"),
])
def test_readiness_names_why_the_worker_is_not_ready(kwargs, reason):
    assert probes(**kwargs).readiness() == ProbeResult(False, reason)


def test_draining_and_redis_trouble_do_not_fail_liveness_or_startup():
    p = probes(state=WorkerState.DRAINING, problem="heartbeats to Redis are failing")
    assert (p.startup(), p.liveness()) == (OK, OK)


def test_startup_fails_until_the_grpc_server_serves():
    assert probes(serving=False).startup() == ProbeResult(False, "starting: the gRPC server is not serving yet")


def test_a_stall_bound_must_be_positive():
    with pytest.raises(ValueError, match="^stall_s must be > 0; got 0$"):
        WorkerProbes(lambda: WorkerState.SERVING, lambda: True, lambda: None, lambda: None, stall_s=0)
