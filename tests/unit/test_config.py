"""EngineConfig: validation at construction, naming the field; unknown arguments named."""

from __future__ import annotations

import dataclasses

import pytest

from engine.config import EngineConfig


def test_defaults_are_valid_and_follow_vllm():
    config = EngineConfig()
    assert (config.block_size, config.max_num_seqs, config.step_tokens) == (16, 256, 2048)
    assert config.max_num_batched_tokens is None  # the role decides (a CPU prefill worker: 512)
    assert (config.dtype, config.kv_cache_dtype, config.device) == ("auto", "auto", "auto")
    assert config.enable_prefix_caching is True
    assert config.max_model_len is None


def test_config_is_frozen():
    config = EngineConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.block_size = 32  # type: ignore[misc]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("dtype", "float64"),
        ("kv_cache_dtype", "int8"),
        ("device", "tpu"),
        ("block_size", 0),
        ("block_size", -16),
        ("block_size", 12),
        ("max_model_len", 0),
        ("max_model_len", -1),
        ("gpu_memory_utilization", 0.0),
        ("gpu_memory_utilization", 1.01),
        ("gpu_memory_utilization", -0.5),
        ("gpu_memory_utilization", float("nan")),
        ("kv_cache_memory", 0),
        ("num_gpu_blocks_override", 0),
        ("num_gpu_blocks_override", -3),
        ("num_threads", 0),
        ("max_num_seqs", 0),
        ("max_num_batched_tokens", 0),
        ("swap_space", -0.5),
        ("swap_space", float("nan")),
        ("swap_space", float("inf")),
        ("long_prefill_token_threshold", -1),
        ("max_long_partial_prefills", 0),
    ],
)
def test_invalid_value_raises_value_error_naming_the_field(field, value):
    with pytest.raises(ValueError) as info:
        EngineConfig(**{field: value})
    assert str(info.value).startswith(f"{field} must be ")
    assert repr(value) in str(info.value) or str(value) in str(info.value)


def test_choice_error_lists_the_choices():
    with pytest.raises(ValueError) as info:
        EngineConfig(kv_cache_dtype="int8")
    assert str(info.value) == (
        "kv_cache_dtype must be one of auto, float32, bfloat16, float16, fp8; got 'int8'"
    )


def test_block_size_error_message():
    with pytest.raises(ValueError) as info:
        EngineConfig(block_size=12)
    assert str(info.value) == "block_size must be a positive power of two, got 12"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("block_size", 1),
        ("block_size", 128),
        ("gpu_memory_utilization", 1.0),
        ("max_model_len", 1),
        ("kv_cache_memory", 1),
        ("kv_cache_dtype", "fp8"),
        ("device", "cpu"),
        ("swap_space", 0),
        ("swap_space", 0.25),
    ],
)
def test_boundary_values_are_accepted(field, value):
    assert getattr(EngineConfig(**{field: value}), field) == value


def test_from_kwargs_builds_a_config():
    config = EngineConfig.from_kwargs(block_size=32, max_num_seqs=4)
    assert (config.block_size, config.max_num_seqs) == (32, 4)


def test_from_kwargs_rejects_unknown_arguments_listing_them():
    with pytest.raises(TypeError) as info:
        EngineConfig.from_kwargs(block_size=32, tensor_parallel_size=2, cpu_offload_gb=4)
    message = str(info.value)
    assert message.startswith("unknown engine argument(s): cpu_offload_gb, tensor_parallel_size; known: ")
    assert "block_size" in message.split("known: ")[1]


def test_from_kwargs_still_validates_values():
    with pytest.raises(ValueError, match="max_num_seqs must be positive, got 0"):
        EngineConfig.from_kwargs(max_num_seqs=0)


def test_field_names_are_the_dataclass_fields():
    assert EngineConfig.field_names() == {f.name for f in dataclasses.fields(EngineConfig)}
    assert "num_gpu_blocks_override" in EngineConfig.field_names()


def test_a_prefill_worker_caps_long_prompts_by_default_and_an_explicit_setting_wins():
    from engine.config import PREFILL_LONG_PREFILL_TOKENS

    assert EngineConfig().long_prefill_token_threshold is None  # the role decides
    gpu = EngineConfig().for_prefill_worker(on_cpu=False)
    assert (gpu.long_prefill_token_threshold, gpu.step_tokens) == (PREFILL_LONG_PREFILL_TOKENS, 2048) == (256, 2048)
    for on_cpu in (True, False):
        assert EngineConfig(long_prefill_token_threshold=0).for_prefill_worker(on_cpu).long_prefill_token_threshold == 0
        assert EngineConfig(long_prefill_token_threshold=1024).for_prefill_worker(
            on_cpu).long_prefill_token_threshold == 1024
        assert EngineConfig(max_num_batched_tokens=4096).for_prefill_worker(on_cpu).step_tokens == 4096


def test_a_cpu_prefill_worker_takes_smaller_chunks_and_steps():
    from engine.config import CPU_PREFILL_BATCHED_TOKENS, CPU_PREFILL_LONG_PREFILL_TOKENS

    cpu = EngineConfig(device="cpu").for_prefill_worker()  # the device resolves to the CPU
    assert (cpu.long_prefill_token_threshold, cpu.max_num_batched_tokens) == (
        CPU_PREFILL_LONG_PREFILL_TOKENS, CPU_PREFILL_BATCHED_TOKENS) == (128, 512)
    assert EngineConfig(device="cpu").step_tokens == 2048  # other roles keep vLLM's budget
    assert EngineConfig(max_num_batched_tokens=256).for_prefill_worker(on_cpu=True).long_prefill_token_threshold == 128
