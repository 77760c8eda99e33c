"""`pdserve up --colocated`: one worker prefills and decodes (the benchmarks' baseline);
responses say so, and greedy tokens equal the offline engine's."""

from __future__ import annotations

import httpx
import pytest

from tests.e2e.cluster import start_cluster

pytestmark = pytest.mark.slow


def test_colocated_cluster_serves_with_the_offline_engines_tokens(tmp_path):
    from engine import LLM, SamplingParams

    prompt = "The capital of France is"
    llm = LLM(dtype="float32", max_model_len=1024)
    want = list(llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12))[0].token_ids)
    del llm
    cluster = start_cluster(tmp_path, "--colocated", "--decode", "1", "--dtype", "float32",
                            "--max-model-len", "1024", "--kv-cache-memory", "256MiB")
    try:
        r = httpx.post(cluster.base_url + "/v1/completions", timeout=120, json={
            "model": "SmolLM2-135M-Instruct", "prompt": prompt, "max_tokens": 12, "temperature": 0,
            "return_token_ids": True})
        assert r.status_code == 200, r.text
        assert r.headers["x-pdserve-path"] == "colocated"
        assert r.json()["choices"][0]["token_ids"] == want
        assert list(cluster.workers) == ["decode-0"]
    finally:
        cluster.stop()
