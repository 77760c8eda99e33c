"""`pdserve plan`: capacity numbers, the P:D roofline, the max_model_len warning, request-length
files, and exit status 2 with a reason for bad input."""

from __future__ import annotations

import json

import pytest

from engine.capacity import KVBudget, KVCapacity
from engine.config import EngineConfig
from engine.model.spec import ModelSpec
from pdserve.cli import main
from pdserve.plan import PDEstimate, PlanInputs, build_plan, render, size_workers
from pdserve.plan_traffic import Traffic, read_request_lengths, read_traffic, traffic_from_lengths

GiB = 1 << 30
MiB = 1 << 20
# Explicit device and dtype: the numbers must not depend on this machine's CPU flags or GPU.
CPU_F32 = ["--device", "cpu", "--dtype", "float32", "--device-memory", "16GiB"]


def run_plan_json(capsys, *flags: str) -> dict:
    assert main(["plan", "--json", *flags]) == 0
    return json.loads(capsys.readouterr().out)


def tiny_spec() -> ModelSpec:
    """2 layers, 4 heads, 2 KV heads of 16: 512 B/token in float32, 90,432 parameters."""
    return ModelSpec(
        architecture="llama", name="tiny", vocab_size=256, hidden_size=64, intermediate_size=128,
        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5,
        rope_theta=10000.0, max_position_embeddings=1024, tie_word_embeddings=True,
    )


def tiny_plan(**config_overrides):
    config = EngineConfig(**{
        "device": "cuda", "dtype": "float32", "gpu_memory_utilization": 0.5, "max_model_len": 512,
        "max_num_batched_tokens": 1000, **config_overrides,
    })
    inputs = PlanInputs(device_memory=10 * MiB, traffic=read_traffic(100, 50, None),
                        device_flops=1e9, device_bandwidth=1e8)
    return build_plan(config, inputs, tiny_spec(), "tiny.gguf")


# ---------------------------------------------------------------- capacity
def test_plan_of_the_default_model_in_float32_on_cpu_uses_the_2_gib_default_budget(capsys):
    out = run_plan_json(capsys, *CPU_F32, "--max-model-len", "2048")
    assert (out["num_params"], out["weights_bytes"], out["kv_cache_dtype"]) == (134_515_008, 538_060_032, "float32")
    assert out["budget"] == {"num_bytes": 2 * GiB, "source": "CPU default --kv-cache-memory"}
    # 2 GiB // (46,080 B/token x 16) = 2912 blocks
    assert out["capacity"] == {
        "num_blocks": 2912, "block_size": 16, "bytes_per_token": 46080, "max_model_len": 2048,
        "num_tokens": 46_592, "max_concurrency": 22.75, "total_bytes": 2912 * 16 * 46080,
        "log_line": "KV cache: 2912 blocks x 16 = 46,592 tokens (45 KiB/token); "
                    "max concurrency at 2,048 tokens/request: 22.8x",
    }
    assert out["traffic"] is None and out["pd"] is None and out["warnings"] == []


def test_plan_text_shows_the_worker_log_line_and_the_weights_memory(capsys):
    assert main(["plan", *CPU_F32, "--kv-cache-memory", "256MiB", "--max-model-len", "2048"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "Weights memory (float32):               513.1 MiB" in lines
    assert "KV budget:                              256.0 MiB (--kv-cache-memory)" in lines
    assert "Blocks x block size:                    364 x 16" in lines
    assert "Token capacity:                         5,824" in lines
    assert "Max concurrency:                        2.8x" in lines
    assert ("Worker log line:                        KV cache: 364 blocks x 16 = 5,824 tokens "
            "(45 KiB/token); max concurrency at 2,048 tokens/request: 2.8x") in lines


def test_plan_of_a_tiny_spec_takes_the_utilization_share_minus_the_weights():
    plan = tiny_plan()
    assert (plan.num_params, plan.weights_bytes) == (90_432, 361_728)
    # 0.5 x 10 MiB - 361,728 B of weights = 4,881,152 B; // (512 B x 16) = 595 blocks
    assert plan.budget == KVBudget(4_881_152, "0.5 x 10.0 MiB - 353.2 KiB weights")
    assert plan.capacity == KVCapacity(num_blocks=595, block_size=16, bytes_per_token=512, max_model_len=512)
    assert plan.capacity.log_line() == (
        "KV cache: 595 blocks x 16 = 9,520 tokens (512 B/token); max concurrency at 512 tokens/request: 18.6x"
    )


def test_plan_with_num_gpu_blocks_override_ignores_memory():
    plan = tiny_plan(num_gpu_blocks_override=40)
    assert plan.budget == KVBudget(None, "--num-gpu-blocks-override")
    assert (plan.capacity.num_blocks, plan.capacity.num_tokens) == (40, 640)


# ---------------------------------------------------------------- P:D roofline
def test_pd_estimate_of_a_tiny_spec_is_the_roofline_of_each_step():
    pd = tiny_plan().pd
    flops_per_token = 2 * 90_432
    # prefill: 1000 tokens x 180,864 FLOP at 1 GFLOP/s beats reading 361,728 B at 100 MB/s
    assert (pd.prefill_step_tokens, pd.prefill_bound) == (1000, "compute")
    assert pd.prefill_step_seconds == pytest.approx(1000 * flops_per_token / 1e9, rel=1e-12)
    # decode: 150-token requests hold 10 blocks -> 595 // 10 = 59 in the batch, each at 125 tokens
    assert (pd.decode_batch, pd.decode_bound) == (59, "bandwidth")
    assert pd.decode_step_seconds == pytest.approx((361_728 + 59 * 125 * 512) / 1e8, rel=1e-12)
    assert pd.prefill_requests_per_s == pytest.approx(10 / 0.180864, rel=1e-12)
    assert pd.decode_requests_per_s == pytest.approx(59 / (50 * 0.04137728), rel=1e-12)
    assert pd.prefill_per_decode == pytest.approx(0.51578, rel=1e-4)
    assert pd.ratio == (1, 2)


def test_render_prints_the_roofline_assumptions_and_the_suggested_ratio():
    lines = render(tiny_plan()).splitlines()
    assert "Assumed device:                         1.0 GFLOP/s, 100.0 MB/s (given)" in lines
    assert "Prefill step:                           1,000 tokens in 180.9 ms (compute-bound)" in lines
    assert "Decode step:                            41.4 ms (bandwidth-bound)" in lines
    assert "Suggested prefill:decode:               1:2 (0.52 prefill per decode worker)" in lines


@pytest.mark.parametrize(
    ("decode_rps", "ratio"),
    [(1.0, (1, 1)), (0.5, (1, 2)), (0.75, (3, 4)), (1.5, (3, 2)), (9.6, (10, 1)), (0.1, (1, 10))],
)
def test_ratio_is_small_integers_prefill_to_decode(decode_rps, ratio):
    pd = PDEstimate(2048, 1.0, "compute", 8, 0.1, "bandwidth", prefill_requests_per_s=1.0,
                    decode_requests_per_s=decode_rps)
    assert pd.ratio == ratio


def test_size_workers_fills_in_the_missing_side_and_names_the_bottleneck():
    pd = PDEstimate(2048, 1.0, "compute", 8, 0.1, "bandwidth", prefill_requests_per_s=2.0,
                    decode_requests_per_s=3.0)
    assert size_workers(pd, None, None) is None
    given_decode = size_workers(pd, None, 2)
    assert (given_decode.prefill_workers, given_decode.decode_workers) == (3, 2)
    assert (given_decode.requests_per_s, given_decode.bottleneck) == (6.0, "decode")
    given_prefill = size_workers(pd, 4, None)
    assert (given_prefill.prefill_workers, given_prefill.decode_workers) == (4, 3)
    assert (given_prefill.requests_per_s, given_prefill.bottleneck) == (8.0, "prefill")


# ---------------------------------------------------------------- max_model_len warning
def test_warning_fires_for_8192_with_1000_token_requests_and_states_the_concurrency_lost(capsys):
    out = run_plan_json(capsys, *CPU_F32, "--max-model-len", "8192",
                        "--mean-input-len", "800", "--mean-output-len", "200")
    assert out["capacity"]["max_concurrency"] == 46_592 / 8192
    assert out["warnings"] == [
        "max_model_len=8,192 is 4.0x the 2,048 tokens this traffic needs (2,000: 2 x the mean request "
        "of 1,000); max concurrency is 5.7x at 8,192 but 22.8x at 2,048: it costs 4.0x concurrency "
        "(17.1 requests of 2,048 tokens). Use --max-model-len 2048 unless longer requests must be accepted."
    ]


def test_no_warning_when_max_model_len_matches_the_traffic(capsys):
    out = run_plan_json(capsys, *CPU_F32, "--max-model-len", "2048",
                        "--mean-input-len", "800", "--mean-output-len", "200")
    assert out["warnings"] == []
    assert out["traffic"]["needed_len"] == 2000


def test_warning_uses_the_longest_request_of_a_file_and_counts_requests_over_max_model_len(tmp_path):
    lengths = tmp_path / "lengths.csv"
    lengths.write_text("input,output\n300,100\n300,200\n2500,100\n")
    traffic = read_traffic(None, None, str(lengths))
    config = EngineConfig(device="cuda", dtype="float32", max_model_len=512, num_gpu_blocks_override=2000)
    plan = build_plan(config, PlanInputs(device_memory=GiB, traffic=traffic), tiny_spec(), "tiny.gguf")
    assert plan.warnings == (
        "1 of 3 requests need more than max_model_len=512 tokens (the longest 2,600); they would be rejected.",
    )
    config = EngineConfig(device="cuda", dtype="float32", max_model_len=1024, num_gpu_blocks_override=2000)
    short = traffic_from_lengths([(100, 20), (200, 50)], "two")
    plan = build_plan(config, PlanInputs(device_memory=GiB, traffic=short), tiny_spec(), "tiny.gguf")
    # longest 250 -> 256 tokens; 32,000 tokens hold 31.2 requests of 1,024 but 125.0 of 256
    assert plan.warnings == (
        "max_model_len=1,024 is 4.0x the 256 tokens this traffic needs (250: the longest in the file); "
        "max concurrency is 31.2x at 1,024 but 125.0x at 256: it costs 4.0x concurrency "
        "(93.8 requests of 256 tokens). Use --max-model-len 256 unless longer requests must be accepted.",
    )


# ---------------------------------------------------------------- request-length files
def test_jsonl_lengths_accept_objects_and_pairs_and_skip_blank_lines(tmp_path):
    path = tmp_path / "requests.jsonl"
    path.write_text('{"input_len": 100, "output_len": 20}\n\n[300, 60]\n{"output_len": 1, "input_len": 2}\n')
    assert read_request_lengths(path) == [(100, 20), (300, 60), (2, 1)]
    traffic = read_traffic(None, None, str(path))
    assert (traffic.mean_input_len, traffic.mean_output_len, traffic.longest) == (134.0, 27.0, 360)
    assert traffic.source == f"3 requests from {path}"


def test_csv_lengths_with_and_without_a_header(tmp_path):
    with_header = tmp_path / "a.csv"
    with_header.write_text("input,output\n10, 5\n20,15\n")
    bare = tmp_path / "b.txt"
    bare.write_text("10,5\n20,15\n\n")
    assert read_request_lengths(with_header) == read_request_lengths(bare) == [(10, 5), (20, 15)]


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("r.jsonl", '{"input_len": 10, "output_len": 2}\n{"input_len": 10}\n',
         "r.jsonl:2: lengths must be whole numbers, got [10, None]"),
        ("r.jsonl", "[1, 2, 3]\n", "r.jsonl:1: expected input and output lengths, got [1, 2, 3]"),
        ("r.jsonl", "{nope\n", "r.jsonl:1: not JSON (Expecting property name enclosed in double quotes)"),
        ("r.csv", "10,5\n7,x\n", "r.csv:2: lengths must be whole numbers, got ['7', 'x']"),
        ("r.csv", "10,0\n", "r.csv:1: lengths must be at least 1, got 10, 0"),
        ("r.csv", "input,output\n", "r.csv: no request lengths in the file"),
    ],
)
def test_bad_length_files_name_the_file_and_line(tmp_path, name, text, message):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ValueError) as info:
        read_request_lengths(path)
    assert str(info.value) == f"{tmp_path}/{message}"


def test_means_alone_assume_the_longest_request_is_twice_the_mean():
    traffic = read_traffic(700, 300, None)
    assert traffic == Traffic(700, 300, None, (), "means given")
    assert (traffic.needed_len, traffic.needed_reason) == (2000, "2 x the mean request of 1,000")
    assert read_traffic(None, None, None) is None


# ---------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    ("flags", "reason"),
    [
        (["--mean-input-len", "800"], "--mean-input-len and --mean-output-len go together"),
        (["--mean-input-len", "8", "--mean-output-len", "2", "--request-lengths", "x.csv"],
         "give either --request-lengths or --mean-input-len/--mean-output-len, not both"),
        (["--mean-input-len", "-5", "--mean-output-len", "2"], "--mean-input-len must be positive, got -5.0"),
        (["--request-lengths", "/nonexistent/lengths.csv"], "No such file or directory"),
        (["--decode-workers", "2"], "--prefill-workers/--decode-workers need --mean-input-len"),
        (["--block-size", "24"], "block_size must be a positive power of two, got 24"),
        (["--max-model-len", "16384"], "max_model_len=16384 is longer than the model's context length (8192)"),
        (["--model", "/nonexistent/model.gguf"], "is neither a GGUF file nor a folder on this machine"),
        (["--kv-cache-memory", "1MiB", "--max-model-len", "2048"],
         "KV cache too small: 1 blocks x 16 = 16 tokens (45 KiB/token) cannot hold one request"),
        (["--kv-cache-memory", "lots"], "not a size: 'lots'"),
    ],
)
def test_bad_input_exits_2_with_the_reason(capsys, flags, reason):
    with pytest.raises(SystemExit) as info:
        main(["plan", *CPU_F32, *flags])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: pdserve plan")
    assert "pdserve plan: error: " in err and reason in err


def test_render_without_traffic_says_what_the_ratio_needs():
    config = EngineConfig(device="cuda", dtype="float32", max_model_len=512, num_gpu_blocks_override=100)
    text = render(build_plan(config, PlanInputs(device_memory=GiB), tiny_spec(), "tiny.gguf"))
    assert ("P:D ratio:                              "
            "give --mean-input-len/--mean-output-len or --request-lengths") in text
