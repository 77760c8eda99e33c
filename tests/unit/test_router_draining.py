"""A draining worker leaves the routing candidates: policies, admission and /ready see only
serving workers, while views and the roles API still list it (it still holds blocks)."""

from __future__ import annotations

import random

import pytest

from router.cluster.view import cluster_body
from router.routing.policy import RouteRequest, make_policy
from router.cluster.readiness import Readiness, readiness
from tests.unit.roles_doubles import snapshot, worker

# d-idle is the emptiest decode worker and p-idle the emptiest prefill worker, so a policy
# that still saw draining workers would pick them.
CLUSTER = snapshot(
    worker("d-busy", "decode", free_blocks=10),
    worker("d-idle", "decode", state="draining", free_blocks=100),
    worker("p-busy", "prefill", free_blocks=10),
    worker("p-idle", "prefill", state="draining", free_blocks=100),
    worker("b-0", "both", free_blocks=50),
)


def ids(workers) -> list[str]:
    return [w.worker_id for w in workers]


def test_candidates_leave_out_draining_workers_and_members_keep_them():
    assert ids(CLUSTER.decode_workers()) == ["b-0", "d-busy"]
    assert ids(CLUSTER.prefill_workers()) == ["b-0", "p-busy"]
    assert ids(CLUSTER.members("decode")) == ["b-0", "d-busy", "d-idle"]
    assert ids(CLUSTER.members("prefill")) == ["b-0", "p-busy", "p-idle"]


@pytest.mark.parametrize("policy", ["least_loaded", "round_robin", "cache_aware"])
def test_no_policy_ever_places_a_request_on_a_draining_worker(policy):
    chooser, rng = make_policy(policy), random.Random(0)
    picks = {(d.prefill_id, d.decode_id)
             for d in (chooser.choose(RouteRequest(64, 16), CLUSTER, rng) for _ in range(40))}
    assert {p for p, _ in picks} <= {"b-0", "p-busy", None}
    assert {d for _, d in picks} <= {"b-0", "d-busy"}


def test_ready_counts_only_serving_workers():
    assert readiness(CLUSTER, needs_prefill=True) == Readiness(True, "ready", 2, 2)


def test_not_ready_when_every_worker_of_a_role_drains_says_how_many_drain():
    only_draining = snapshot(worker("d-0", "decode", state="draining"), worker("d-1", "decode", state="draining"),
                             worker("p-0", "prefill"))
    assert readiness(only_draining, needs_prefill=True) == Readiness(
        False, "not ready: no decode worker is serving (2 draining)", 1, 0)


def test_the_cluster_view_counts_a_draining_workers_blocks_and_shows_its_state():
    body = cluster_body("c", snapshot(worker("d-0", "decode", free_blocks=10),
                                      worker("d-1", "decode", state="draining", free_blocks=40)),
                        True, "least_loaded", {}, now=1000.0)
    assert (body["decode"]["workers"], body["decode"]["free_blocks"]) == (2, 50)
    assert [(w["worker_id"], w["state"]) for w in body["workers"]] == [("d-0", "serving"), ("d-1", "draining")]
