"""Conditional disaggregation: short prompts skip a backed-up prefill worker."""

from __future__ import annotations

import random

import pytest

from router.cluster.keys import ClusterSnapshot, WorkerInfo
from router.routing.local_prefill import LocalPrefillRule, WithLocalPrefill, local_prefill
from router.routing.policy import RouteDecision, RouteRequest, make_policy


def worker(worker_id: str, role: str, queued: int = 0) -> WorkerInfo:
    return WorkerInfo(worker_id=worker_id, role=role, address="127.0.0.1:1", metrics_address="",
                      incarnation="i", block_size=16, total_blocks=1000, free_blocks=1000, reserved_blocks=0,
                      cached_blocks=0, num_running=0, num_waiting=0, queued_prefill_tokens=queued,
                      max_model_len=4096, updated_at=1.0)


def snap(queued: int) -> ClusterSnapshot:
    return ClusterSnapshot((worker("d0", "decode"), worker("p0", "prefill", queued)), taken_at=0.0, stale=False)


DECISION = RouteDecision("p0", "d0", "cache_aware: ...", (("prompt_tokens", 130.0),))
RULE = LocalPrefillRule(max_tokens=128, min_queued_tokens=1024)


@pytest.mark.parametrize(("prompt", "cached", "queued", "local"), [
    (128, 0, 1024, True),    # short enough, prefill worker backed up
    (129, 0, 1024, False),   # one token too long
    (128, 0, 1023, False),   # prefill worker not backed up enough
    (160, 2, 5000, True),    # 160 - 2 x 16 cached on the decode worker = 128 to compute
])
def test_short_prompt_is_prefilled_on_the_decode_worker_only_when_the_prefill_worker_is_backed_up(
        prompt, cached, queued, local):
    request = RouteRequest(prompt, 16, cached_blocks=(("d0", cached),) if cached else ())
    decision = local_prefill(DECISION, request, snap(queued), RULE)
    assert (decision.prefill_id is None) is local
    if local:
        assert decision.decode_id == "d0"
        assert decision.reason == (f"cache_aware: ...; prefill on decode d0: 128 tokens <= 128 while p0 has "
                                   f"{queued} queued >= 1024")
        assert decision.inputs[-2:] == (("local_prefill_tokens", 128.0),
                                        ("skipped_prefill_queued_tokens", float(queued)))
    else:
        assert decision is DECISION


def test_rule_off_by_default_and_validated():
    assert local_prefill(DECISION, RouteRequest(1, 1), snap(10**6), LocalPrefillRule()) is DECISION
    with pytest.raises(ValueError, match="max_tokens must be an int >= 0"):
        LocalPrefillRule(max_tokens=-1)


def test_wrapper_applies_the_rule_to_the_inner_policys_decision():
    policy = WithLocalPrefill(make_policy("least_loaded"), RULE)
    decision = policy.choose(RouteRequest(100, 16), snap(2000), random.Random(0))
    assert (decision.prefill_id, decision.decode_id) == (None, "d0")
    assert policy.choose(RouteRequest(100, 16), snap(0), random.Random(0)).prefill_id == "p0"
