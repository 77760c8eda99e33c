"""Int4 linears on the CPU (int4_linear.c): bfloat16 activations times weights kept as 4-bit codes
with a float16 (d, m) pair per group of 32, GGUF Q4_1's block split into two arrays; and the same
for GGUF Q8_0 blocks (int8 codes, a float16 d per 32), which a Q4 GGUF's head often is.

torch's own int4 CPU kernel (engine.model.quantized_linear's fallback) was about as fast at batch
1 and lost to dense bfloat16 from batch 8 and on prefill, so `--quantization auto` kept GGUF
weights dense. This one dequantizes each group once per call and shares it across up to 8 rows
of activations in bfloat16 dot products; above MAX_KERNEL_ROWS rows (prefill chunks) a call
dequantizes the whole weight into bfloat16 and runs torch's dense matmul on it.
benchmarks/int4_linear.py measures the three side by side on SmolLM2's shapes.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from engine.cpu_kernels.loader import INT4_LINEAR, Loaded, load_kernel

GROUP = 32
"""Weights per (d, m) pair (int4_linear.c's GROUP): GGUF's block."""
MAX_KERNEL_ROWS = 32
"""Most rows of x a call takes through the kernel; more (prefill) dequantize, then matmul.
On SmolLM2's shapes at 2 threads, with the weights read from memory, the kernel at 16 rows was as
fast as oneDNN's packed bfloat16 matmul and twice torch's int4 kernel (benchmarks/int4_linear.py)."""


@dataclass(frozen=True)
class PackedInt4:
    """The kernel's layout of one [out, in] weight."""

    codes: torch.Tensor  # [out, in // 2] uint8: low nibbles weights 0..15 of a group, high 16..31
    dm: torch.Tensor  # [out, in // 32, 2] float16: w = q * d + m

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape[0], self.codes.shape[1] * 2


def pack(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> PackedInt4 | str:
    """Codes 0..15 with w = (q - 8) * scale + zero per group (engine.model.quantized_linear.Int4Weight)
    in the kernel's layout, or why they do not fit it (a group size other than 32, or a (d, m)
    pair float16 cannot hold: GGUF's pairs are float16 already, so only re-quantized weights can)."""
    if group_size != GROUP:
        return f"group size {group_size} (the kernel takes {GROUP})"
    out, cols = codes.shape
    if cols % GROUP:
        return f"in_features {cols} (a multiple of {GROUP})"
    d = scales.to(torch.float32)
    m = zeros.to(torch.float32) - 8 * d
    dm = torch.stack((d, m), -1)
    half = dm.to(torch.float16)
    if not torch.allclose(half.to(torch.float32), dm, rtol=2.0 ** -10, atol=2.0 ** -24):
        return "scales or zeros outside float16's range"
    groups = codes.to(torch.uint8).reshape(out, cols // GROUP, 2, GROUP // 2)
    nibbles = (groups[:, :, 0] | (groups[:, :, 1] << 4)).reshape(out, cols // 2)
    return PackedInt4(nibbles.contiguous(), half.contiguous())


class Int4Kernel:
    """The functions of one loaded library (int4_linear.c)."""

    def __init__(self, loaded: Loaded) -> None:
        if loaded.library is None:
            raise ValueError(f"no kernel library: {loaded.reason}")
        self.path = loaded.path
        lib = loaded.library
        lib.int4_linear_supported.restype = ctypes.c_int
        if not lib.int4_linear_supported():
            raise ValueError("this CPU has no AVX512-BF16 (the kernel computes in bfloat16 dot products)")
        self._linear = lib.int4_linear_bf16
        self._q8_linear = lib.q8_linear_bf16
        for fn in (self._linear, self._q8_linear):  # (x, codes, scales, y, M, N, K)
            fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3
            fn.restype = ctypes.c_int
        self.unchecked_linear = self._linear
        """int4_linear_bf16 itself, (x, codes, dm, y, rows, out, in) by address: for a caller that
        checked every shape once and calls it many times (engine.model.decode_plan)."""
        self._dequantize = lib.int4_dequantize_bf16
        self._dequantize.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2
        self._dequantize.restype = ctypes.c_int

    def linear(self, x: torch.Tensor, weight: PackedInt4) -> torch.Tensor:
        """x [rows, in] bfloat16 -> [rows, out] bfloat16. Rows above MAX_KERNEL_ROWS go through
        the dense matmul on the dequantized weight."""
        out, cols = weight.shape
        _check_rows(x, cols)
        if x.shape[0] > MAX_KERNEL_ROWS:
            return torch.nn.functional.linear(x, self.dequantize(weight))
        return _run(self._linear, "int4_linear_bf16", x, weight.codes, weight.dm, out)

    def q8_linear(self, x: torch.Tensor, codes: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        """x [rows, in] bfloat16 times GGUF Q8_0 blocks (codes [out, in] int8, d [out, in // 32]
        float16, both contiguous) -> [rows, out] bfloat16, each weight q * d rounded to bfloat16.
        Every batch size goes through the kernel (past 8 rows it expands each chunk of rows once)."""
        out, cols = codes.shape
        _check_rows(x, cols)
        return _run(self._q8_linear, "q8_linear_bf16", x, codes, d, out)

    def dequantize(self, weight: PackedInt4) -> torch.Tensor:
        """The [out, in] bfloat16 weight, each value as `linear` computes with it."""
        out, cols = weight.shape
        w = torch.empty(out, cols, dtype=torch.bfloat16)
        if self._dequantize(weight.codes.data_ptr(), weight.dm.data_ptr(), w.data_ptr(), out, cols):
            raise ValueError(f"int4_dequantize_bf16 refused {[out, cols]}")
        return w


def _check_rows(x: torch.Tensor, cols: int) -> None:
    if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != cols:
        raise ValueError(f"x must be [rows, {cols}] bfloat16, got {list(x.shape)} {x.dtype}")


def _run(fn, name: str, x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, out: int) -> torch.Tensor:
    """y = fn(x, codes, scales) as [rows, out] bfloat16, on the calling thread's OpenMP team
    (torch's setting at the time: engine.device.StepThreads)."""
    x = x.contiguous()
    y = torch.empty(x.shape[0], out, dtype=torch.bfloat16)
    if fn(x.data_ptr(), codes.data_ptr(), scales.data_ptr(), y.data_ptr(), x.shape[0], out, x.shape[1]):
        raise ValueError(f"{name} refused {list(x.shape)} x {[out, x.shape[1]]}")
    return y


def load_int4_kernel() -> tuple[Int4Kernel | None, str]:
    """(the kernel, "") or (None, why there is none)."""
    return load_kernel(INT4_LINEAR, Int4Kernel)
