"""The benchmarks that compare int4 with bfloat16 and llama.cpp pass --quantization through
(the runs themselves are scripts, not timed tests; their --quick modes are run by hand)."""

from __future__ import annotations

from benchmarks.engine_throughput import parse_args
from benchmarks.vs_llamacpp import BATCH1, FULL, QUICK, pdserve_flags, workloads


def test_vs_llamacpp_starts_pdserve_with_the_asked_quantization():
    assert pdserve_flags("colocated", "auto", "int4") == [
        "--colocated", "--decode", "1", "--num-threads", "2", "--dtype", "auto", "--quantization", "int4",
        "--max-num-seqs", "8", "--max-model-len", "4096"]


def test_vs_llamacpp_passes_int4_activations_through_only_when_asked():
    assert "--int4-activations" not in pdserve_flags("colocated", "auto", "gguf")  # auto, the workers' default
    for asked in ("int8", "bfloat16"):
        flags = pdserve_flags("colocated", "auto", "gguf", asked)
        assert flags[flags.index("--int4-activations") + 1] == asked


def test_vs_llamacpp_measures_decode_at_batch_1_one_request_at_a_time(tmp_path):
    [batch1] = [w for w in workloads(FULL, tmp_path / "mixed.jsonl") if w.name == BATCH1]
    assert batch1.flags == ("--dataset-name", "random", "--random-input-len", "32", "--random-output-len", "128",
                            "--num-prompts", "3", "--max-concurrency", "1")
    assert QUICK.batch1_out == 16


def test_engine_throughput_keeps_hf_exactness_by_default_and_takes_int4():
    assert parse_args([]).quantization == "none"
    assert parse_args(["--quantization", "auto", "--dtype", "bfloat16"]).quantization == "auto"
