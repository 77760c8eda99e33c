"""The heartbeat and /metrics read a worker only through its frozen WorkerStatus: given a
status, they publish exactly its numbers, and a DRAINING worker as draining."""

from __future__ import annotations

import dataclasses

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from engine.core import CoreStats
from worker_runtime.heartbeat import heartbeat_info
from worker_runtime.metrics import WorkerCollector
from worker_runtime.status import TransferTotals, WorkerState, WorkerStatus

CORE = CoreStats(total_blocks=100, free_blocks=60, reserved_blocks=7, cached_blocks=5, num_running=3,
                 num_waiting=2, num_reserved=1, queued_prefill_tokens=90, num_preemptions=4,
                 prefix_cache_queries=320, prefix_cache_hits=48, prompt_tokens=272, generation_tokens=35,
                 prefill_busy_s=0.75, decode_busy_s=1.25)
STATUS = WorkerStatus(worker_id="decode-3", incarnation="inc-9", role="decode", state=WorkerState.SERVING,
                      block_size=16, max_model_len=2048, core=CORE, in_flight=6,
                      transfers=TransferTotals(count=11, nbytes=4096, seconds=0.5, failures=2))


@pytest.mark.parametrize("state, published", [(WorkerState.SERVING, "serving"), (WorkerState.DRAINING, "draining")])
def test_heartbeat_info_publishes_the_status_numbers_and_state(state, published):
    info = heartbeat_info(dataclasses.replace(STATUS, state=state), "127.0.0.1:5001", "127.0.0.1:9001",
                          "127.0.0.1:5002")
    assert dataclasses.asdict(info) | {"updated_at": 0} == {
        "worker_id": "decode-3", "role": "decode", "address": "127.0.0.1:5001",
        "metrics_address": "127.0.0.1:9001", "incarnation": "inc-9", "block_size": 16, "total_blocks": 100,
        "free_blocks": 60, "reserved_blocks": 7, "cached_blocks": 5, "num_running": 3, "num_waiting": 2,
        "queued_prefill_tokens": 90, "max_model_len": 2048, "updated_at": 0, "state": published,
        "prefix_cache_queries": 320, "prefix_cache_hits": 48, "prompt_tokens": 272, "generation_tokens": 35,
        "prefill_busy_s": 0.75, "decode_busy_s": 1.25, "link_address": "127.0.0.1:5002"}
    assert info.draining is (state is WorkerState.DRAINING)


def scrape(status: WorkerStatus) -> dict[str, tuple[dict[str, str], float]]:
    registry = CollectorRegistry()
    registry.register(WorkerCollector(lambda: status, capacity=[], model_name="SmolLM2-135M-Instruct"))
    text = generate_latest(registry).decode()
    return {s.name: (s.labels, s.value) for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_are_read_from_the_status_with_model_role_and_worker_labels():
    samples = scrape(STATUS)
    labels = {"model_name": "SmolLM2-135M-Instruct", "role": "decode", "worker_id": "decode-3"}
    assert samples["vllm:num_requests_running"] == (labels, 3.0)
    assert samples["vllm:num_requests_waiting"] == (labels, 2.0)
    assert samples["vllm:kv_cache_usage_perc"] == (labels, 0.4)
    assert samples["pdserve_kv_blocks_reserved"] == (labels, 7.0)
    assert samples["pdserve_kv_transfers_total"] == (labels, 11.0)
    assert samples["pdserve_kv_transfer_bytes_total"] == (labels, 4096.0)
    assert samples["pdserve_kv_transfer_failures_total"] == (labels, 2.0)
    assert samples["pdserve_worker_in_flight"] == (labels, 6.0)
    assert samples["pdserve_worker_draining"] == (labels, 0.0)


def test_metrics_show_a_draining_worker():
    assert scrape(dataclasses.replace(STATUS, state=WorkerState.DRAINING))["pdserve_worker_draining"][1] == 1.0
