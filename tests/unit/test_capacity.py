"""KV capacity arithmetic: bytes per token, blocks for a budget, the log line, the refusal."""

from __future__ import annotations

import pytest

from engine.capacity import (
    KVBudget,
    KVCapacity,
    blocks_for_budget,
    format_bytes,
    kv_budget,
    kv_bytes_per_token,
    kv_dtype_name,
    plan_capacity,
    resolve_max_model_len,
    weights_bytes,
)
from engine.config import EngineConfig
from engine.model.spec import ModelSpec

GiB = 1 << 30
MiB = 1 << 20


def smollm2_like(**overrides) -> ModelSpec:
    """The shape of SmolLM2-135M: 30 layers, 9 heads, 3 KV heads of 64."""
    fields = dict(
        architecture="llama", name="smollm2-like", vocab_size=49152, hidden_size=576,
        intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
        rms_norm_eps=1e-5, rope_theta=100000.0, max_position_embeddings=8192,
        tie_word_embeddings=True,
    )
    fields.update(overrides)
    return ModelSpec(**fields)


@pytest.mark.parametrize(
    ("kv_dtype", "expected"),
    [("float32", 46080), ("bfloat16", 23040), ("float16", 23040), ("fp8", 11520)],
)
def test_kv_bytes_per_token_of_a_smollm2_like_model(kv_dtype, expected):
    # 2 (K and V) x 30 layers x 3 kv heads x 64 dims x element size
    assert kv_bytes_per_token(smollm2_like(), kv_dtype) == expected


def test_weights_bytes_counts_smollm2_135m_parameters_with_tied_embeddings():
    assert smollm2_like().num_params == 134_515_008
    assert weights_bytes(smollm2_like(), "bfloat16") == 269_030_016
    untied = smollm2_like(tie_word_embeddings=False)
    assert untied.num_params == 134_515_008 + 49152 * 576


def test_log_line_for_known_numbers():
    capacity = KVCapacity(num_blocks=17131, block_size=64, bytes_per_token=46080, max_model_len=8192)
    assert capacity.log_line() == (
        "KV cache: 17131 blocks x 64 = 1,096,384 tokens (45 KiB/token); "
        "max concurrency at 8,192 tokens/request: 133.8x"
    )


def test_capacity_derived_sizes():
    capacity = KVCapacity(num_blocks=17131, block_size=64, bytes_per_token=46080, max_model_len=8192)
    assert capacity.num_tokens == 1_096_384
    assert capacity.bytes_per_block == 2_949_120
    assert capacity.total_bytes == 17131 * 2_949_120
    assert capacity.blocks_per_request == 128
    assert capacity.max_concurrency == 1_096_384 / 8192


def test_blocks_per_request_rounds_a_partial_block_up():
    assert KVCapacity(10, 16, 512, 100).blocks_per_request == 7


def test_plan_capacity_from_a_budget_rounds_down_to_whole_blocks_and_logs_the_numbers():
    spec = smollm2_like()
    one_block = 64 * 46080
    capacity = plan_capacity(
        spec, kv_dtype="float32", block_size=64, max_model_len=8192,
        kv_budget_bytes=17131 * one_block + one_block - 1,
    )
    assert capacity == KVCapacity(17131, 64, 46080, 8192)
    assert capacity.log_line() == (
        "KV cache: 17131 blocks x 64 = 1,096,384 tokens (45 KiB/token); "
        "max concurrency at 8,192 tokens/request: 133.8x"
    )


def test_plan_capacity_for_2_gib_of_fp8_kv_cache():
    capacity = plan_capacity(
        smollm2_like(), kv_dtype="fp8", block_size=16, max_model_len=2048, kv_budget_bytes=2 * GiB
    )
    # 2 GiB // (11520 B x 16) = 11650 blocks
    assert capacity.num_blocks == 11650
    assert capacity.log_line() == (
        "KV cache: 11650 blocks x 16 = 186,400 tokens (11.2 KiB/token); "
        "max concurrency at 2,048 tokens/request: 91.0x"
    )


def test_log_line_shows_bytes_below_one_kib_per_token():
    tiny = smollm2_like(num_layers=1, num_heads=1, num_kv_heads=1)  # 2 x 64 x 4 = 512 B
    capacity = plan_capacity(
        tiny, kv_dtype="float32", block_size=16, max_model_len=64, kv_budget_bytes=None,
        num_blocks_override=8,
    )
    assert capacity.log_line() == (
        "KV cache: 8 blocks x 16 = 128 tokens (512 B/token); "
        "max concurrency at 64 tokens/request: 2.0x"
    )


def test_num_blocks_override_ignores_the_budget():
    capacity = plan_capacity(
        smollm2_like(), kv_dtype="float32", block_size=16, max_model_len=2048,
        kv_budget_bytes=1, num_blocks_override=300,
    )
    assert (capacity.num_blocks, capacity.num_tokens) == (300, 4800)


def test_plan_capacity_accepts_exactly_one_max_model_len_request():
    capacity = plan_capacity(
        smollm2_like(), kv_dtype="float32", block_size=16, max_model_len=2048,
        kv_budget_bytes=None, num_blocks_override=128,
    )
    assert capacity.max_concurrency == 1.0


def test_plan_capacity_refuses_when_one_max_model_len_request_does_not_fit():
    with pytest.raises(ValueError) as info:
        plan_capacity(
            smollm2_like(), kv_dtype="float32", block_size=16, max_model_len=2048,
            kv_budget_bytes=None, num_blocks_override=127,
        )
    # 128 blocks x 16 tokens x 46080 B = 90.0 MiB
    assert str(info.value) == (
        "KV cache too small: 127 blocks x 16 = 2,032 tokens (45 KiB/token) cannot hold one "
        "request of max_model_len=2,048 tokens, which needs 128 blocks (90.0 MiB). "
        "Raise --kv-cache-memory / --gpu-memory-utilization / --num-gpu-blocks-override, "
        "or lower --max-model-len to at most 2,032."
    )


def test_plan_capacity_refusal_from_a_budget_names_blocks_tokens_and_the_need():
    with pytest.raises(ValueError) as info:
        plan_capacity(
            smollm2_like(), kv_dtype="float32", block_size=16, max_model_len=8192,
            kv_budget_bytes=1 * MiB,
        )
    message = str(info.value)
    # 1 MiB // (46080 B x 16) = 1 block; 8192 tokens need 512 blocks = 360.0 MiB
    assert message.startswith("KV cache too small: 1 blocks x 16 = 16 tokens (45 KiB/token)")
    assert "max_model_len=8,192 tokens, which needs 512 blocks (360.0 MiB)" in message
    assert message.endswith("or lower --max-model-len to at most 16.")


def test_blocks_for_budget_is_never_negative():
    assert blocks_for_budget(10 * 737280 + 5, 46080, 16) == 10
    assert blocks_for_budget(0, 46080, 16) == 0
    assert blocks_for_budget(-1, 46080, 16) == 0


def never_read() -> int:
    raise AssertionError("device memory must not be read for this budget")


def test_kv_budget_with_num_gpu_blocks_override_is_no_byte_budget():
    config = EngineConfig(num_gpu_blocks_override=300, kv_cache_memory=GiB)
    assert kv_budget(config, "cuda", 10, never_read) == KVBudget(None, "--num-gpu-blocks-override")


def test_kv_budget_takes_kv_cache_memory_over_gpu_memory_utilization():
    config = EngineConfig(kv_cache_memory=64 * MiB, gpu_memory_utilization=0.5)
    assert kv_budget(config, "cuda", 10, never_read) == KVBudget(64 * MiB, "--kv-cache-memory")


def test_kv_budget_on_cpu_defaults_to_2_gib_without_reading_memory():
    assert kv_budget(EngineConfig(), "cpu", 10, never_read) == KVBudget(2 * GiB, "CPU default --kv-cache-memory")


def test_kv_budget_is_the_utilization_share_of_device_memory_minus_the_weights():
    weights = 269_030_016
    budget = kv_budget(EngineConfig(), "cuda", weights, lambda: 80 * GiB)
    # default 0.9 x 80 GiB = 77,309,411,328 B, minus the weights
    assert budget == KVBudget(77_309_411_328 - weights, "0.9 x 80.0 GiB - 256.6 MiB weights")
    on_cpu = kv_budget(EngineConfig(gpu_memory_utilization=0.25), "cpu", 1 * GiB, lambda: 8 * GiB)
    assert on_cpu == KVBudget(1 * GiB, "0.25 x 8.0 GiB - 1.0 GiB weights")


def test_kv_budget_is_never_negative_when_the_weights_exceed_the_share():
    assert kv_budget(EngineConfig(gpu_memory_utilization=0.1), "cuda", GiB, lambda: GiB).num_bytes == 0


def test_max_model_len_defaults_to_the_model_context_and_refuses_longer():
    spec = smollm2_like()
    assert resolve_max_model_len(spec, None) == 8192
    assert resolve_max_model_len(spec, 2048) == 2048
    with pytest.raises(ValueError) as info:
        resolve_max_model_len(spec, 8193)
    assert str(info.value) == "max_model_len=8193 is longer than the model's context length (8192)"


def test_kv_dtype_auto_follows_the_model_dtype():
    assert kv_dtype_name("auto", "bfloat16") == "bfloat16"
    assert kv_dtype_name("fp8", "bfloat16") == "fp8"


@pytest.mark.parametrize(
    ("n", "text"), [(512, "512 B"), (1536, "1.5 KiB"), (64 * MiB, "64.0 MiB"), (3 * GiB, "3.0 GiB")]
)
def test_format_bytes_in_binary_units(n, text):
    assert format_bytes(n) == text


def test_a_gpu_budget_beyond_the_free_memory_is_refused_with_the_numbers():
    """On a GPU the share is of the whole memory (vLLM's meaning, and `pdserve plan`'s): a budget
    that others' memory makes impossible ends the start with a message, not an OOM later."""
    from engine.capacity import check_budget_fits_free

    weights = 256 * MiB
    budget = kv_budget(EngineConfig(), "cuda", weights, lambda: 80 * GiB)
    check_budget_fits_free(budget, 72 * GiB, "cuda:0")  # fits: nothing raised
    with pytest.raises(ValueError) as info:
        check_budget_fits_free(budget, 30 * GiB, "cuda:0")
    assert str(info.value) == (
        "the KV cache budget (71.8 GiB = 0.9 x 80.0 GiB - 256.0 MiB weights) is more than the 30.0 GiB free "
        "on cuda:0: other processes hold the rest; lower --gpu-memory-utilization (its share is of the whole "
        "GPU, and workers sharing a GPU need shares that add up to at most ~0.9), or set --kv-cache-memory")
    check_budget_fits_free(KVBudget(None, "--num-gpu-blocks-override"), 0, "cuda:0")  # a block count: unchecked
