"""Device, dtype and KV-cache dtype choices."""

from __future__ import annotations

import pytest
import torch

import engine.device
from engine.device import cpu_has_avx512_bf16, resolve_device, resolve_dtype, resolve_kv_dtype, set_num_threads

CPU = torch.device("cpu")


def _cpuinfo_has_avx512_bf16() -> bool:
    with open("/proc/cpuinfo") as f:
        return any("avx512_bf16" in line.split() for line in f if line.startswith("flags"))


def test_auto_dtype_on_this_cpu_is_bfloat16_iff_cpuinfo_lists_avx512_bf16():
    want = torch.bfloat16 if _cpuinfo_has_avx512_bf16() else torch.float32
    assert cpu_has_avx512_bf16() is _cpuinfo_has_avx512_bf16()
    assert resolve_dtype("auto", CPU) == want


def test_auto_dtype_on_cpu_with_avx512_bf16_is_bfloat16(monkeypatch):
    monkeypatch.setattr(engine.device, "cpu_has_avx512_bf16", lambda: True)
    assert resolve_dtype("auto", CPU) == torch.bfloat16


def test_auto_dtype_on_cpu_without_avx512_bf16_is_float32(monkeypatch):
    monkeypatch.setattr(engine.device, "cpu_has_avx512_bf16", lambda: False)
    assert resolve_dtype("auto", CPU) == torch.float32


def test_auto_dtype_on_cuda_is_bfloat16_whatever_the_cpu(monkeypatch):
    monkeypatch.setattr(engine.device, "cpu_has_avx512_bf16", lambda: False)
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16


@pytest.mark.parametrize(
    "name,dtype", [("float32", torch.float32), ("bfloat16", torch.bfloat16), ("float16", torch.float16)]
)
def test_explicit_dtype_names_map_to_torch_dtypes(monkeypatch, name, dtype):
    monkeypatch.setattr(engine.device, "cpu_has_avx512_bf16", lambda: True)
    assert resolve_dtype(name, CPU) == dtype
    assert resolve_dtype(name, torch.device("cuda")) == dtype


def test_kv_dtype_auto_follows_the_model_dtype():
    assert resolve_kv_dtype("auto", torch.bfloat16) == ("bfloat16", torch.bfloat16)
    assert resolve_kv_dtype("auto", torch.float32) == ("float32", torch.float32)


def test_kv_dtype_fp8_is_float8_e4m3fn():
    assert resolve_kv_dtype("fp8", torch.bfloat16) == ("fp8", torch.float8_e4m3fn)


def test_kv_dtype_explicit_name_ignores_the_model_dtype():
    assert resolve_kv_dtype("float16", torch.float32) == ("float16", torch.float16)


def test_cuda_device_without_cuda_raises_value_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="device 'cuda' was requested but torch sees no CUDA device"):
        resolve_device("cuda")


def test_auto_device_is_cpu_without_cuda_and_cuda_with_it(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == CPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == torch.device("cuda")
    assert resolve_device("cpu") == CPU


def test_set_num_threads_applies_the_given_count():
    before = torch.get_num_threads()
    try:
        assert set_num_threads(2) == 2
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
