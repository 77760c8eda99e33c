"""`pdserve plan` with quantized weights, tensor parallelism and CPU offload: exact weight bytes,
per-device KV heads, and "the weights alone do not fit" said as such (not "raise the KV cache")."""

from __future__ import annotations

import dataclasses

import json
from pathlib import Path

import pytest

from engine.capacity import weights_bytes
from pdserve.cli import main
from tests.unit.test_capacity import smollm2_like

GiB = 1 << 30
LLAMA_70B = {"architectures": ["LlamaForCausalLM"], "_name_or_path": "llama-70b-shape", "vocab_size": 128256,
             "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64,
             "num_key_value_heads": 8, "max_position_embeddings": 8192, "rope_theta": 500000.0,
             "tie_word_embeddings": False}
LLAMA_8B = {**LLAMA_70B, "_name_or_path": "llama-8b-shape", "hidden_size": 4096, "intermediate_size": 14336,
            "num_hidden_layers": 32, "num_attention_heads": 32}
GPU_BF16 = ["--device", "cuda", "--dtype", "bfloat16", "--max-model-len", "8192"]


def model_dir(tmp_path: Path, config: dict) -> str:
    folder = tmp_path / config["_name_or_path"]
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))  # the shape only: plan reads no weights
    return str(folder)


def plan_json(capsys, *flags: str) -> dict:
    assert main(["plan", "--json", *flags]) == 0
    return json.loads(capsys.readouterr().out)


def plan_error(capsys, *flags: str) -> str:
    with pytest.raises(SystemExit) as exc:
        main(["plan", *flags])
    assert exc.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_weights_bytes_count_int4_and_int8_linears_with_their_scales():
    spec = smollm2_like()  # 106,168,320 linear weights in 155,520 rows; 28,346,688 dense parameters
    assert weights_bytes(spec, "bfloat16", "none") == 269_030_016
    # dense 28,346,688 x 2 + linears / 2 + (linears / 32) x (scale + zero) x 2 B
    assert weights_bytes(spec, "bfloat16", "int4") == 56_693_376 + 53_084_160 + 13_271_040 == 123_048_576
    assert weights_bytes(spec, "bfloat16", "int8") == 56_693_376 + 106_168_320 + 311_040 == 163_172_736
    assert weights_bytes(spec, "float32", "int4") == 113_386_752 + 53_084_160 + 13_271_040
    # a head that keeps a GGUF's blocks: beside the tied embedding, or instead of an untied dense head
    head = 49152 * 576
    assert weights_bytes(spec, "bfloat16", "int4", "q8_0") == 123_048_576 + head + head // 32 * 2
    assert weights_bytes(spec, "bfloat16", "int4", "int4") == 123_048_576 + head // 2 + head // 32 * 4
    untied = dataclasses.replace(spec, tie_word_embeddings=False)
    assert weights_bytes(untied, "bfloat16", "int4", "q8_0") == (
        weights_bytes(untied, "bfloat16", "int4") - 2 * head + head + head // 32 * 2)
    with pytest.raises(ValueError, match="head must be one of dense, int4, q8_0"):
        weights_bytes(spec, "bfloat16", "int4", "q4")


def test_a_70b_model_fits_4x80gb_at_8192_with_tensor_parallel_4(tmp_path, capsys):
    out = plan_json(capsys, "--model", model_dir(tmp_path, LLAMA_70B), *GPU_BF16, "--device-memory", "80GiB",
                    "--tensor-parallel-size", "4")
    assert out["num_params"] == 70_553_706_496 and out["weights_bytes"] == 141_107_412_992
    w = out["weights"]
    assert (w["quantization"], w["tensor_parallel_size"], w["per_device_bytes"], w["kv_heads_per_device"]) == (
        "none", 4, 35_276_853_248, 2)
    # 0.9 x 80 GiB - 35,276,853,248 B = 42,032,558,080 B of KV per GPU; 2 x 80 layers x 2 heads x 128 x 2 B
    assert out["budget"]["num_bytes"] == 42_032_558_080
    assert (out["capacity"]["bytes_per_token"], out["capacity"]["num_blocks"]) == (81_920, 32_068)
    assert out["capacity"]["num_tokens"] == 513_088 and out["warnings"] == []


def test_a_70b_model_on_one_80gb_gpu_is_refused_because_of_its_weights(tmp_path, capsys):
    err = plan_error(capsys, "--model", model_dir(tmp_path, LLAMA_70B), *GPU_BF16, "--device-memory", "80GiB")
    assert err == (
        "pdserve plan: error: the weights alone do not fit one device: 131.4 GiB of dense weights = 131.4 GiB "
        "per device, more than 0.9 x 80.0 GiB (--device-memory) = 72.0 GiB, before any KV cache. Raise "
        "--tensor-parallel-size, give --cpu-offload-gb at least 59.5, or use --quantization int4.")


def test_an_8b_model_in_7gb_needs_int4_and_cpu_offload(tmp_path, capsys):
    folder = model_dir(tmp_path, LLAMA_8B)
    flags = ["--model", folder, *GPU_BF16, "--device-memory", "7GiB"]
    assert "the weights alone do not fit one device: 15.0 GiB of dense weights" in plan_error(capsys, *flags)
    # int4 weights (6.0 GiB) fit 0.9 x 7 GiB, but leave 2,288 tokens of KV: less than one request
    assert "KV cache too small: 143 blocks x 16 = 2,288 tokens" in plan_error(capsys, *flags, "--quantization", "int4")
    out = plan_json(capsys, *flags, "--quantization", "int4", "--cpu-offload-gb", "2")
    w = out["weights"]
    # int4: 1,050,939,392 dense params (embeddings, lm_head, norms) x 2 B + 6,979,321,856 linears x 0.625 B
    assert (w["total_bytes"], w["cpu_offload_bytes"], w["per_device_bytes"]) == (
        6_463_954_944, 2 * GiB, 4_316_471_296)
    assert out["budget"]["num_bytes"] == int(0.9 * 7 * GiB) - 4_316_471_296
    assert (out["capacity"]["num_blocks"], out["capacity"]["max_concurrency"]) == (1_167, 2.279296875)


def test_tensor_parallel_must_split_the_heads(tmp_path, capsys):
    err = plan_error(capsys, "--model", model_dir(tmp_path, LLAMA_8B), *GPU_BF16, "--device-memory", "80GiB",
                     "--tensor-parallel-size", "3")
    assert err == "pdserve plan: error: --tensor-parallel-size 3 does not divide the model's 32 attention heads"


def test_gguf_on_the_default_q4_gguf_counts_int4_and_auto_counts_as_the_c_kernel_decides(capsys, monkeypatch):
    from engine.cpu_kernels import loader

    cpu = ["--device", "cpu", "--device-memory", "8GiB", "--max-model-len", "2048"]
    # beside int4 linears the C kernel keeps the tied head's Q8_0 blocks too: 49152 x 576 at one
    # byte a weight plus a float16 d per 32, on top of the dense token embedding
    q8_head = 49152 * 576 + 49152 * 576 // 32 * 2
    assert q8_head == 30_081_024
    monkeypatch.setattr(loader, "int4_kernel_host", lambda activations="auto": None)  # a host that builds the C int4 kernel
    kept = plan_json(capsys, *cpu, "--dtype", "bfloat16", "--quantization", "gguf")
    assert (kept["weights"]["quantization"], kept["weights"]["head"]) == ("int4", "q8_0")
    assert kept["weights_bytes"] == 123_048_576 + q8_head
    auto = plan_json(capsys, *cpu, "--dtype", "bfloat16")
    assert (auto["weights"]["quantization"], auto["weights_bytes"]) == ("int4", 123_048_576 + q8_head)
    assert "C int4 kernel" in auto["weights"]["quantization_source"]
    torch_int4 = plan_json(capsys, *cpu, "--dtype", "bfloat16", "--quantization", "gguf", "--no-cpu-int4-kernel")
    assert (torch_int4["weights"]["head"], torch_int4["weights_bytes"]) == ("dense", 123_048_576)
    off = plan_json(capsys, *cpu, "--dtype", "bfloat16", "--no-cpu-int4-kernel")
    assert (off["weights"]["quantization"], off["weights_bytes"]) == ("none", 269_030_016)
    monkeypatch.setattr(loader, "int4_kernel_host", lambda activations="auto": "the CPU has no AVX512-BF16")
    bf16 = plan_json(capsys, *cpu, "--dtype", "bfloat16")
    assert (bf16["weights"]["quantization"], bf16["weights_bytes"]) == ("none", 269_030_016)
    assert "no AVX512-BF16" in bf16["weights"]["quantization_source"]
    f32 = plan_json(capsys, *cpu, "--dtype", "float32")
    assert (f32["weights"]["quantization"], f32["weights_bytes"]) == ("none", 538_060_032)


@pytest.mark.parametrize("flags, bf16_reason, int8_reason, auto_reason", [
    ("avx2 fma f16c avx512f avx512_bf16 avx512_vnni", None, None, None),
    ("avx2 fma f16c", "the CPU has no AVX512-BF16", None, None),  # the int8-activation kernel's AVX2 build
    ("sse4_2 avx", "the CPU has no AVX512-BF16", "the CPU has neither AVX512-VNNI nor AVX2 with FMA and F16C",
     "the CPU has neither AVX512-BF16 nor AVX512-VNNI or AVX2 with FMA and F16C"),
])
def test_plan_predicts_each_c_int4_path_by_the_cpus_flags(monkeypatch, flags, bf16_reason, int8_reason, auto_reason):
    from engine.cpu_kernels import loader

    monkeypatch.setattr(loader, "compiler", lambda: "/usr/bin/cc")
    monkeypatch.setattr(loader, "_cpu_flags", lambda: flags)
    assert loader.int4_kernel_host("bfloat16") == bf16_reason
    assert loader.int4_kernel_host("int8") == int8_reason
    assert loader.int4_kernel_host() == loader.int4_kernel_host("auto") == auto_reason


def test_auto_counts_int4_on_an_avx2_host_unless_bfloat16_activations_are_asked_for(capsys, monkeypatch):
    from engine.cpu_kernels import loader

    monkeypatch.setattr(loader, "compiler", lambda: "/usr/bin/cc")
    monkeypatch.setattr(loader, "_cpu_flags", lambda: "avx2 fma f16c")
    cpu = ["--device", "cpu", "--device-memory", "8GiB", "--max-model-len", "2048", "--dtype", "bfloat16"]
    assert plan_json(capsys, *cpu, "--int4-activations", "bfloat16")["weights"]["quantization"] == "none"
    for asked in ([], ["--int4-activations", "int8"]):  # auto: int8 activations, the AVX2 build's path
        int8 = plan_json(capsys, *cpu, *asked)
        assert (int8["weights"]["quantization"], int8["weights"]["head"]) == ("int4", "q8_0")
