"""Int4 linears on the CPU (int4_linear.c): bfloat16 activations times weights kept as 4-bit codes
with a float16 (d, m) pair per group of 32, GGUF Q4_1's block split into two arrays; and the same
for GGUF Q8_0 blocks (int8 codes, a float16 d per 32), which a Q4 GGUF's head often is.

torch's own int4 CPU kernel (engine.model.quantized_linear's fallback) was about as fast at batch
1 and lost to dense bfloat16 from batch 8 and on prefill, so `--quantization auto` kept GGUF
weights dense. This one dequantizes each group once per call and shares it across up to 8 rows
of activations in bfloat16 dot products; above MAX_KERNEL_ROWS rows (prefill chunks) a call
dequantizes the whole weight into bfloat16 and runs torch's dense matmul on it.
benchmarks/int4_linear.py measures the three side by side on SmolLM2's shapes.

With int8 activations (EngineConfig.int4_activations) the same codes and (d, m) pairs are
repacked 16 output rows to a block (pack_int8x), and each row of x is quantized per group of 32
as llama.cpp does for its Q4 dot products: the sums are integer ones, about twice as fast at
every batch size, with llama.cpp's numerics instead of the dense model's (int8x_linear.c says
exactly what is computed). That path is a library of its own, built for AVX512-VNNI or for AVX2
with FMA and F16C, so a CPU without AVX512-BF16 (no bfloat16 kernel) still runs int4 weights
kept quantized: Int4Kernel.bf16_supported and int8x_supported say which paths a host has.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from engine.cpu_kernels.loader import INT4_LINEAR, INT8X_LINEAR, Loaded, load

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


INT8X_LANES = 16
"""Output rows per block of the int8-activation layout (one float32 register's lanes)."""


def pack_int8x(weight: PackedInt4) -> torch.Tensor:
    """The int8-activation kernel's layout of the same weight: [ceil(out / 16), in / 32, 320]
    uint8 (int4_linear.c's "int8 activations" comment; rows past `out` are zero)."""
    out, cols = weight.shape
    groups, blocks = cols // GROUP, -(-out // INT8X_LANES)
    nibbles = weight.codes.reshape(out, groups, GROUP // 2)
    q = torch.cat((nibbles & 15, nibbles >> 4), -1)  # [out, groups, 32] in weight order
    dm = weight.dm
    if blocks * INT8X_LANES != out:
        q = torch.cat((q, q.new_zeros(blocks * INT8X_LANES - out, groups, GROUP)))
        dm = torch.cat((dm, dm.new_zeros(blocks * INT8X_LANES - out, groups, 2)))
    q = q.reshape(blocks, INT8X_LANES, groups, GROUP).permute(0, 2, 1, 3)  # [block, group, row, k]

    def quarters(half: torch.Tensor) -> torch.Tensor:  # [block, group, row, 16] -> [block, group, c, row, t]
        return half.reshape(blocks, groups, INT8X_LANES, 4, 4).permute(0, 1, 3, 2, 4)

    codes = (quarters(q[..., :GROUP // 2]) | (quarters(q[..., GROUP // 2:]) << 4)).reshape(blocks, groups, 256)
    scales = dm.reshape(blocks, INT8X_LANES, groups, 2).permute(0, 2, 3, 1).contiguous()  # [block, group, d|m, row]
    packed = torch.cat((codes, scales.view(torch.uint8).reshape(blocks, groups, 4 * INT8X_LANES)), -1)
    return packed.contiguous()


def pack_q8_int8x(codes: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """GGUF Q8_0 blocks (codes [out, in] int8, d [out, in // 32] float16) in the int8-activation
    kernel's layout: [ceil(out / 16), in / 32, 544] uint8 (int4_linear.c's "int8 activations";
    codes held as q + 128, rows past `out` zero)."""
    out, cols = codes.shape
    groups, blocks = cols // GROUP, -(-out // INT8X_LANES)
    q = (codes.to(torch.int16) + 128).to(torch.uint8)
    if blocks * INT8X_LANES != out:
        q = torch.cat((q, q.new_zeros(blocks * INT8X_LANES - out, cols)))
        d = torch.cat((d, d.new_zeros(blocks * INT8X_LANES - out, groups)))
    q = q.reshape(blocks, INT8X_LANES, groups, 8, 4).permute(0, 2, 3, 1, 4)  # [block, group, c, row, t]
    scales = d.reshape(blocks, INT8X_LANES, groups).permute(0, 2, 1).contiguous()  # [block, group, row]
    packed = torch.cat((q.reshape(blocks, groups, 512), scales.view(torch.uint8).reshape(blocks, groups, 32)), -1)
    return packed.contiguous()


def sums_in_half(weight: PackedInt4) -> bool:
    """Whether llama.cpp would compute this weight as Q4_1 (an activation block's d * sum(q)
    rounded to float16, as its Q8_1 block holds it) rather than Q4_0 (m = -8 d everywhere: the
    offset applied to the integer sum, so nothing is rounded)."""
    d, m = weight.dm.unbind(-1)
    return not torch.equal(m, (d.to(torch.float32) * -8).to(torch.float16))


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
    """The functions of the loaded libraries: int4_linear.c's bfloat16 path (bf16_supported) and
    int8x_linear.c's int8-activation path (int8x_supported). At least one is there."""

    def __init__(self, bf16: Loaded, int8x: Loaded) -> None:
        self.bf16_supported = _supported(bf16, "int4_linear_supported")
        """Whether the bfloat16 path runs here (AVX512-BF16): linear, q8_linear, dequantize."""
        self.int8x_supported = _supported(int8x, "int4_linear_int8x_supported")
        """Whether the int8-activation path runs here (AVX512-VNNI, or AVX2 with FMA and F16C)."""
        if not (self.bf16_supported or self.int8x_supported):
            raise ValueError("this CPU has neither AVX512-BF16 (the bfloat16 kernel) nor AVX2 with FMA and F16C "
                             f"(the int8-activation kernel){_reasons(bf16, int8x)}")
        self.path = bf16.path if self.bf16_supported else int8x.path
        self.int8x_build = ""
        """"avx512-vnni" or "avx2": which build of int8x_linear.c runs ("" when none)."""
        if self.bf16_supported:
            lib = bf16.library
            self._linear = lib.int4_linear_bf16
            self._q8_linear = lib.q8_linear_bf16
            for fn in (self._linear, self._q8_linear):  # (x, codes, scales, y, M, N, K)
                fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3
                fn.restype = ctypes.c_int
            self.unchecked_linear = self._linear
            """int4_linear_bf16 itself, (x, codes, dm, y, rows, out, in) by address: for a caller
            that checked every shape once and calls it many times (engine.model.decode_plan)."""
            self._dequantize = lib.int4_dequantize_bf16
            self._dequantize.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2
            self._dequantize.restype = ctypes.c_int
        if self.int8x_supported:
            lib = int8x.library
            lib.int8x_build.restype = ctypes.c_char_p
            self.int8x_build = lib.int8x_build().decode()
            self.unchecked_linear_int8x = lib.int4_linear_int8x
            """int4_linear_int8x, (x, blocks, y, rows, out, in, sum_half) by address: as unchecked_linear."""
            self.unchecked_linear_int8x.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3 + [ctypes.c_int]
            self.unchecked_linear_int8x.restype = ctypes.c_int
            self.unchecked_q8_linear_int8x = lib.q8_linear_int8x
            """q8_linear_int8x, (x, blocks, y, rows, out, in) by address: as unchecked_linear."""
            self.unchecked_q8_linear_int8x.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3
            self.unchecked_q8_linear_int8x.restype = ctypes.c_int

    def _require(self, path: str) -> None:
        supported = self.bf16_supported if path == "bfloat16" else self.int8x_supported
        if not supported:
            raise ValueError(f"the C int4 kernel's {path} path does not run on this CPU")

    def linear(self, x: torch.Tensor, weight: PackedInt4) -> torch.Tensor:
        """x [rows, in] bfloat16 -> [rows, out] bfloat16. Rows above MAX_KERNEL_ROWS go through
        the dense matmul on the dequantized weight."""
        self._require("bfloat16")
        out, cols = weight.shape
        _check_rows(x, cols)
        if x.shape[0] > MAX_KERNEL_ROWS:
            return torch.nn.functional.linear(x, self.dequantize(weight))
        return _run(self._linear, "int4_linear_bf16", x, weight.codes, weight.dm, out)

    def linear_int8x(self, x: torch.Tensor, blocks: torch.Tensor, out: int, sum_half: bool) -> torch.Tensor:
        """x [rows, in] bfloat16 times a weight in pack_int8x's layout with `out` rows -> [rows, out]
        bfloat16, each row of x quantized to 8 bits per group of 32 (llama.cpp's numerics;
        sum_half: for a Q4_1 weight, see sums_in_half). Every batch size goes through the kernel.
        ValueError when the kernel refuses, or this CPU has no int8-activation build (int8x_supported)."""
        self._require("int8-activation")
        return self._int8x(self.unchecked_linear_int8x, "int4_linear_int8x", x, blocks, out, int(sum_half))

    def q8_linear_int8x(self, x: torch.Tensor, blocks: torch.Tensor, out: int) -> torch.Tensor:
        """The same for Q8_0 blocks in pack_q8_int8x's layout (llama.cpp's Q8_0 x Q8_0 product)."""
        self._require("int8-activation")
        return self._int8x(self.unchecked_q8_linear_int8x, "q8_linear_int8x", x, blocks, out)

    def _int8x(self, fn, name: str, x: torch.Tensor, blocks: torch.Tensor, out: int, *extra: int) -> torch.Tensor:
        cols = blocks.shape[1] * GROUP
        _check_rows(x, cols)
        x = x.contiguous()
        y = torch.empty(x.shape[0], out, dtype=torch.bfloat16)
        if fn(x.data_ptr(), blocks.data_ptr(), y.data_ptr(), x.shape[0], out, cols, *extra):
            raise ValueError(f"{name} refused {list(x.shape)} x {[out, cols]}")
        return y

    def q8_linear(self, x: torch.Tensor, codes: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        """x [rows, in] bfloat16 times GGUF Q8_0 blocks (codes [out, in] int8, d [out, in // 32]
        float16, both contiguous) -> [rows, out] bfloat16, each weight q * d rounded to bfloat16.
        Every batch size goes through the kernel (past 8 rows it expands each chunk of rows once)."""
        self._require("bfloat16")
        out, cols = codes.shape
        _check_rows(x, cols)
        return _run(self._q8_linear, "q8_linear_bf16", x, codes, d, out)

    def dequantize(self, weight: PackedInt4) -> torch.Tensor:
        """The [out, in] bfloat16 weight, each value as `linear` computes with it."""
        self._require("bfloat16")
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


def _supported(loaded: Loaded, probe: str) -> bool:
    if loaded.library is None:
        return False
    fn = getattr(loaded.library, probe)
    fn.restype = ctypes.c_int
    return bool(fn())


def _reasons(*loaded: Loaded) -> str:
    why = "; ".join(each.reason for each in loaded if each.reason)
    return f" ({why})" if why else ""


def load_int4_kernel() -> tuple[Int4Kernel | None, str]:
    """(the kernel, "") or (None, why there is none: no compiler, or a CPU with neither path)."""
    bf16, int8x = load(INT4_LINEAR), load(INT8X_LINEAR)
    try:
        return Int4Kernel(bf16, int8x), ""
    except ValueError as e:
        return None, str(e)
