"""The CUDA kernels compile, and the Python wrappers launch them as they are declared — checked
on CPU, so CI catches a kernel that does not build or a wrapper that passes the wrong
arguments even where no GPU runs the tests.

- every .cu in engine/kernels compiles to PTX with nvcc (skipped when nvcc is not on PATH),
  and the PTX has an entry for each kernel loader.KERNELS declares for it;
- each declared kernel is an `extern "C" __global__` function of its source file;
- each wrapper, run on CPU tensors with a recording launcher, launches only declared kernels,
  with as many arguments as the kernel's signature has and of matching width.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.kernels import blocks, checks, paged_attention
from engine.kernels.loader import KERNEL_DIR, KERNELS

REPO = Path(__file__).resolve().parents[2]
CU_FILES = sorted(KERNEL_DIR.glob("*.cu"))
KERNEL_DEF = re.compile(
    r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\(\s*\d+\s*\)\s+)?(\w+)\s*\(([^)]*)\)')
# Kernel parameter type -> the numpy scalar type the wrappers must pass for it.
ARG_TYPES = {"int": np.int32, "long long": np.int64, "float": np.float32}


def kernel_signatures(path: Path) -> dict[str, list[type]]:
    """{kernel name: numpy type of each parameter} for the extern "C" kernels of one file."""
    found = {}
    for name, params in KERNEL_DEF.findall(path.read_text()):
        types = []
        for param in params.split(","):
            words = param.replace("const", " ").split()
            if "*" in param:
                types.append(np.uint64)
            else:
                types.append(ARG_TYPES[" ".join(words[:-1])])
        found[name] = types
    return found


def test_every_cu_file_is_declared_in_the_loader():
    assert sorted(p.name for p in CU_FILES) == sorted(KERNELS)


@pytest.mark.parametrize("filename", sorted(KERNELS))
def test_each_declared_kernel_is_an_extern_c_kernel_of_its_file(filename):
    defined = kernel_signatures(KERNEL_DIR / filename)
    assert sorted(set(KERNELS[filename]) - set(defined)) == []


@pytest.mark.parametrize("path", CU_FILES, ids=lambda p: p.name)
def test_kernel_source_compiles_to_ptx_for_sm80(path, tmp_path):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not on PATH: the kernels' compile check needs the CUDA toolkit")
    ptx = tmp_path / (path.stem + ".ptx")
    proc = subprocess.run([nvcc, "-ptx", "-arch=sm_80", "-std=c++17", "-o", str(ptx), str(path)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"nvcc failed on {path.name}:\n{proc.stderr}"
    entries = set(re.findall(r"\.entry\s+(\w+)\s*\(", ptx.read_text()))
    assert sorted(set(KERNELS[path.name]) - entries) == []


def test_importing_the_kernels_loads_no_cupy():
    code = ("import sys, json, engine.kernels\n"
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'cupy')))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []


@pytest.fixture
def launches(monkeypatch):
    """Run the wrappers on CPU: record each launch instead of running it."""
    recorded = []

    def record(filename, name, device, grid, block, args, shared_mem=0):
        recorded.append((filename, name, grid, block, args, shared_mem))

    monkeypatch.setattr(blocks, "launch", record)
    monkeypatch.setattr(paged_attention, "launch", record)
    monkeypatch.setattr(paged_attention, "sm_count", lambda index: 132)
    monkeypatch.setattr(checks, "on_cuda", lambda *tensors: tensors[0].device)
    return recorded


def assert_launches_match_signatures(recorded):
    signatures = {p.name: kernel_signatures(p) for p in CU_FILES}
    for filename, name, grid, block, args, shared_mem in recorded:
        assert name in KERNELS[filename], name
        assert [type(a) for a in args] == signatures[filename][name], name
        assert all(1 <= g <= 65535 for g in grid[1:]) and 1 <= grid[0] < 2**31, (name, grid)
        assert block[0] % 32 == 0 and block[0] <= 1024 and block[1:] == (1, 1), (name, block)
        assert shared_mem <= paged_attention.SHARED_MEM_LIMIT, (name, shared_mem)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_attention_and_store_wrappers_pass_each_kernel_its_signature(launches, dtype):
    cache = torch.zeros(2, 40, 16, 2, 64, dtype=dtype)
    k = torch.zeros(5, 2, 64, dtype=dtype)
    blocks.store_kv(cache, torch.arange(5), k, k.clone())
    q = torch.zeros(3, 8, 64, dtype=dtype)
    lens = torch.tensor([1, 17, 30], dtype=torch.int32)
    paged_attention.paged_decode_attention(q, cache, torch.zeros(3, 2, dtype=torch.int32), lens,
                                           0.125)
    paged_attention.paged_decode_attention(q, cache, torch.zeros(3, 40, dtype=torch.int32), lens,
                                           0.125)
    suffix = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}[dtype]
    assert [name for _, name, *_ in launches] == [
        f"store_kv_{suffix}", f"paged_attention_partition_{suffix}",
        f"paged_attention_partition_{suffix}", f"paged_attention_reduce_{suffix}"]
    assert_launches_match_signatures(launches)


def test_block_wrappers_pass_each_kernel_its_signature(launches):
    caches = [torch.zeros(2, 6, 4, 2, 8, dtype=torch.bfloat16) for _ in range(3)]
    payload = blocks.pack_blocks(caches, [4, 1])
    blocks.unpack_blocks(payload, caches, [0, 5])
    blocks.block_checksum(payload)
    blocks.block_checksum_blocks(caches, [2])
    assert [name for _, name, *_ in launches] == [
        "pack_blocks", "unpack_blocks", "block_checksum_payload", "block_checksum_blocks"]
    assert_launches_match_signatures(launches)
