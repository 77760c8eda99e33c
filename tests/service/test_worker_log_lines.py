"""A real worker process (`python -m pdserve decode|prefill`, tiny model, real Redis): every line
it writes names it, in text and in JSON, its start is announced once, its stats line appears
after work, and a normal stop (SIGTERM drain) writes no warning and no traceback."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import signal
import time

import pytest

from proto.auth import load_cluster_secret
from proto.internal_auth import internal_channel
from proto.pdserve.v1 import worker_pb2_grpc
from tests.service.test_worker_process import (  # noqa: F401 — fixtures, by name
    EXIT_TIMEOUT_S, decode_request, decode_spec, redis_url, start, started, tiny_model_dir,
)

pytestmark = pytest.mark.timeout(300)

TEXT_LINE = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR|CRITICAL) \[(\S+)\] \S+: .*")


async def one_local_request(grpc_port: int) -> None:
    async with internal_channel(f"127.0.0.1:{grpc_port}", load_cluster_secret()) as channel:
        async for _ in worker_pb2_grpc.DecodeWorkerStub(channel).Decode(decode_request("logged-1", 8, True)):
            pass


def wait_for_line(log, needle: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while needle not in log.read_text():
        assert time.monotonic() < deadline, f"no {needle!r} within {timeout_s} s:\n{log.read_text()}"
        time.sleep(0.1)


def test_every_text_line_of_a_decode_worker_names_it_from_start_to_stop(tiny_model_dir, redis_url, tmp_path,
                                                                      started):
    spec = dataclasses.replace(decode_spec(tiny_model_dir, redis_url, tmp_path), log_stats_interval_s=0.5)
    process, log, grpc_port, _ = start(spec, tmp_path, started)
    asyncio.run(one_local_request(grpc_port))
    wait_for_line(log, "Avg generation throughput")
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=EXIT_TIMEOUT_S) == 0, log.read_text()
    lines = log.read_text().splitlines()
    unnamed = [line for line in lines if not ((m := TEXT_LINE.fullmatch(line)) and m.group(2) == "decode-wp")]
    assert unnamed == []
    assert len([line for line in lines if "decode worker decode-wp serving: gRPC 127.0.0.1:" in line]) == 1
    assert [line for line in lines if " WARNING " in line or "Traceback" in line] == []
    assert "decode worker decode-wp stopped" in lines[-1]


def test_every_json_line_of_a_prefill_worker_carries_its_id_and_role(tiny_model_dir, redis_url, tmp_path, started):
    spec = dataclasses.replace(decode_spec(tiny_model_dir, redis_url, tmp_path, role="prefill"), log_format="json")
    process, log, _, _ = start(spec, tmp_path, started)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=EXIT_TIMEOUT_S) == 0, log.read_text()
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert {(r["worker_id"], r["role"]) for r in records} == {("prefill-wp", "prefill")}
    assert all({"ts", "level", "logger", "message"} <= set(r) for r in records)
    assert [r["message"] for r in records if r["message"].startswith("prefill worker prefill-wp serving")] != []
    assert [r for r in records if r["level"] in ("WARNING", "ERROR")] == []
