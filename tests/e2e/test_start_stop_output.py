"""What `pdserve up` prints from start to Ctrl-C, read line by line: each start announced once,
every log line names its process, a stats line from every worker and the router after work,
the router's /metrics carrying vLLM's per-worker gauges, and no warning or traceback at a
normal shutdown."""

from __future__ import annotations

import re
import time

import httpx
import pytest

from tests.e2e.cluster import start_cluster

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
LOG_LINE = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} [A-Z]+ \[(\S+)\] \S+: .*")


def wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"no {what} within {timeout_s} s"
        time.sleep(0.2)


def test_up_prints_each_start_once_names_every_line_and_stops_without_a_warning(tmp_path):
    cluster = start_cluster(tmp_path, "--kv-cache-memory", "128MiB", "--max-model-len", "2048",
                            "--log-stats-interval", "1")
    try:
        r = httpx.post(f"{cluster.base_url}/v1/completions", timeout=120,
                       json={"model": MODEL, "prompt": "Hello there", "max_tokens": 8, "ignore_eos": True})
        assert r.status_code == 200, r.text
        log = cluster.log
        for name in ("[prefill-0] worker_runtime.stats_log", "[decode-0] worker_runtime.stats_log",
                     "[router] router.serving.stats_log: Cluster: "):
            wait_for(lambda: name in log.read_text(), 30, name)
        # The router's per-worker series come from its last snapshot of the workers' heartbeats:
        # a worker's counters reach it a heartbeat and a snapshot after the request, not at once.
        wanted = [rf"^vllm:{name}{{model_name=\"{MODEL}\",role=\"{role}\",worker_id=\"{role}-0\"}} {value}"
                  for role in ("prefill", "decode")
                  for name, value in (("kv_cache_usage_perc", r"\S+$"), ("prefix_cache_queries_total", "[1-9]"))]
        metrics = ""

        def every_series_there() -> bool:
            nonlocal metrics
            metrics = httpx.get(f"{cluster.base_url}/metrics", timeout=10).text
            return all(re.search(pattern, metrics, re.M) for pattern in wanted)

        try:
            wait_for(every_series_there, 30, "per-worker series in the router's /metrics")
        except AssertionError as e:
            raise AssertionError(f"{e}: {[p for p in wanted if not re.search(p, metrics, re.M)]}\n{metrics}") from None
    finally:
        cluster.stop()
    assert cluster.process.returncode == 0
    lines = cluster.log.read_text().splitlines()
    logged = [line for line in lines if re.match(r"\d{4}-\d\d-\d\d ", line)]
    assert [line for line in logged if not LOG_LINE.fullmatch(line)] == []
    names = {LOG_LINE.fullmatch(line).group(1) for line in logged}
    assert names == {"up", "router", "prefill-0", "decode-0"}
    for worker_id in ("prefill-0", "decode-0"):
        assert len([line for line in lines if worker_id in line and "serving" in line
                    and "draining" not in line]) == 1, lines
    assert len([line for line in lines if "router serving OpenAI HTTP" in line]) == 1
    banner = [line for line in lines if line.strip() and not re.match(r"\d{4}-\d\d-\d\d ", line)]
    assert len(banner) == len(set(banner)), banner  # "pdserve is up", its hints, "stopping": once each
    assert [line for line in lines if "WARNING" in line or "Traceback" in line or "ERROR" in line] == []
    for role in ("prefill", "decode"):  # the drain is told once, by the worker's process
        assert len([line for line in lines if f"{role} worker {role}-0 draining" in line]) == 1, lines
        assert len([line for line in lines if f"{role} worker {role}-0 drained" in line]) == 1, lines
    assert any("worker decode-0 stopped" in line for line in lines)

