"""Weight-only quantized CPU linears: weights stay int4 / int8 in memory and in the matmul.

A decode step at batch 1 reads every weight once, so its speed is the bytes it reads: int4
reads a quarter of bfloat16's. The kernels are torch's own CPU ones:

    int4  torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group_size, scales_and_zeros)
          w = (q - 8) * scale + zero, q in 0..15, one (scale, zero) per `group_size` weights of a row
          (measured against this formula in tests/unit/test_quantized_linear.py)
    int8  torch.ops.aten._weight_int8pack_mm(x, codes, scales)
          w = q * scale, q in -128..127, one scale per output row

Both run fast for bfloat16 / float16 activations; their float32 paths are reference loops
(50-100x slower on this project's EPYC), so a float32 model computes these layers in bfloat16.
Scales and zeros are stored in that compute dtype, the one rounding the GGUF mapping cannot avoid
(engine/loader/gguf_quant.py says where each GGUF format lands).

Where this project's own int4 kernel is loaded (engine.cpu_kernels.int4_matmul, on CPUs with
AVX512-BF16), int4 weights go through it instead (KernelInt4Linear): the GGUF block's float16
(d, m) pair is kept as it is, and batches of decode size read the weights once per call. With
int8 activations (EngineConfig.int4_activations) they go through KernelInt4Int8xLinear: the same
weights, x quantized per group of 32 as llama.cpp does, integer dot products (AVX512-VNNI, or
AVX2 with FMA and F16C: the one C path a CPU without AVX512-BF16 has).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from engine.cpu_kernels.int4_matmul import Int4Kernel, PackedInt4, pack, pack_int8x, pack_q8_int8x, sums_in_half

logger = logging.getLogger(__name__)

INT4_GROUP_SIZE = 32
"""Weights per (scale, zero) group: GGUF's Q4_0/Q4_1/Q8_0 block size, so their blocks map 1:1."""
_INT4_OFFSET = 8  # the kernel subtracts 8 from every 4-bit code
_ROW_MULTIPLE = 16  # _convert_weight_to_int4pack_for_cpu: "expect N to be dividable by 16"


@dataclass(frozen=True)
class Int4Weight:
    """A [out, in] weight as 4-bit codes: w[r, c] = (codes[r, c] - 8) * scales[r, g] + zeros[r, g],
    g = c // group_size. Rows may be permuted like any weight (each row carries its own groups)."""

    codes: torch.Tensor  # [out, in] uint8 in 0..15
    scales: torch.Tensor  # [out, in // group_size] float32
    zeros: torch.Tensor  # [out, in // group_size] float32
    group_size: int = INT4_GROUP_SIZE

    def dequantize(self) -> torch.Tensor:
        """The float32 weight these codes stand for (tests, and re-quantizing to int8)."""
        g = self.group_size
        q = self.codes.to(torch.float32) - _INT4_OFFSET
        return q * self.scales.repeat_interleave(g, 1) + self.zeros.repeat_interleave(g, 1)


@dataclass(frozen=True)
class Int8Weight:
    """A [out, in] weight as w[r, c] = codes[r, c] * scales[r]."""

    codes: torch.Tensor  # [out, in] int8
    scales: torch.Tensor  # [out] float32

    def dequantize(self) -> torch.Tensor:
        return self.codes.to(torch.float32) * self.scales[:, None]


@dataclass(frozen=True)
class Q8BlockWeight:
    """A [out, in] weight as GGUF's Q8_0 blocks: w[r, c] = codes[r, c] * d[r, c // 32], d float16
    (the file's bits). Only the C kernel computes with it (KernelQ8Linear)."""

    codes: torch.Tensor  # [out, in] int8
    d: torch.Tensor  # [out, in // 32] float16

    def dequantize(self) -> torch.Tensor:
        return self.codes.to(torch.float32) * self.d.to(torch.float32).repeat_interleave(INT4_GROUP_SIZE, 1)


QuantizedWeight = Int4Weight | Int8Weight | Q8BlockWeight


def quantize_int4(weight: torch.Tensor, group_size: int = INT4_GROUP_SIZE) -> Int4Weight:
    """Asymmetric min/max quantization per group (what an HF folder or a non-Q4 GGUF tensor gets):
    the group's min and max are represented exactly up to rounding of the scale."""
    out, cols = weight.shape
    if cols % group_size:
        raise ValueError(f"int4 needs in_features ({cols}) to be a multiple of {group_size}")
    groups = weight.detach().to(torch.float32).reshape(out, cols // group_size, group_size)
    low, high = groups.amin(-1), groups.amax(-1)
    scales = ((high - low) / 15).clamp_min(1e-12)
    codes = torch.round((groups - low[..., None]) / scales[..., None]).clamp_(0, 15)
    return Int4Weight(
        codes.to(torch.uint8).reshape(out, cols), scales, low + _INT4_OFFSET * scales, group_size
    )


def quantize_int8(weight: torch.Tensor) -> Int8Weight:
    """Symmetric per-row quantization: scale = max |w| / 127."""
    w = weight.detach().to(torch.float32)
    scales = (w.abs().amax(1) / 127).clamp_min(1e-12)
    codes = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return Int8Weight(codes, scales)


def concat_rows(weights: list[QuantizedWeight]) -> QuantizedWeight:
    """One weight whose rows are the given weights' rows in order (fused projections): every row
    carries its own scales (and zeros), so stacking is exact. All must be of one kind and width."""
    first = weights[0]
    if not all(type(w) is type(first) for w in weights):
        raise ValueError(f"cannot fuse {[type(w).__name__ for w in weights]}: mixed quantization")
    if isinstance(first, Int4Weight):
        if any(w.group_size != first.group_size for w in weights):
            raise ValueError("cannot fuse int4 weights of different group sizes")
        cat = lambda field: torch.cat([getattr(w, field) for w in weights])  # noqa: E731
        return Int4Weight(cat("codes"), cat("scales"), cat("zeros"), first.group_size)
    return Int8Weight(torch.cat([w.codes for w in weights]), torch.cat([w.scales for w in weights]))


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The kernels' fast activation dtypes (module docstring); float32 computes in bfloat16."""
    return dtype if dtype in (torch.bfloat16, torch.float16) else torch.bfloat16


def kernel_computes(dtype: torch.dtype) -> bool:
    """Whether the C kernel (bfloat16 only) computes the quantized linears of a model in `dtype`."""
    return _compute_dtype(dtype) == torch.bfloat16


class Int4Linear(nn.Module):
    """y = x @ W^T with W as packed int4 codes and per-group scales and zeros (no bias)."""

    def __init__(self, weight: Int4Weight, dtype: torch.dtype) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.codes.shape
        self.group_size = weight.group_size
        if self.in_features % self.group_size:
            raise ValueError(f"int4 linears need in_features ({self.in_features}) divisible by {self.group_size}")
        self.compute_dtype = _compute_dtype(dtype)
        # The packing wants a multiple of 16 rows: padded with zero rows, sliced off in forward.
        pad = -self.out_features % _ROW_MULTIPLE
        self.padded = pad > 0
        codes, scales, zeros = (nn.functional.pad(t, (0, 0, 0, pad)) for t in
                                (weight.codes.to(torch.int32), weight.scales, weight.zeros))
        # inner_k_tiles is ignored by the CPU packing; [out, in // 2] uint8 comes back.
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.contiguous(), 1))
        # [in // group_size, out, 2]: the kernel's layout of (scale, zero) pairs.
        pairs = torch.stack((scales, zeros), -1).transpose(0, 1)
        self.register_buffer("scales_and_zeros", pairs.to(self.compute_dtype).contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Thin on purpose: at batch 1 each skipped no-op (reshape, to, slice) saved ~1-2 us a
        # call, ~210 calls a step. The kernel takes [rows, in] in the compute dtype.
        rows = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        if rows.dtype != self.compute_dtype:
            rows = rows.to(self.compute_dtype)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.packed, self.group_size, self.scales_and_zeros)
        return _restore(y[:, :self.out_features] if self.padded else y, x)


class Int8Linear(nn.Module):
    """y = x @ W^T with W as int8 codes and one scale per output row (no bias)."""

    def __init__(self, weight: Int8Weight, dtype: torch.dtype) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.codes.shape
        if self.in_features % 32:  # measured: widths 4 and 8 give inf or crash torch 2.13's kernel
            raise ValueError(f"int8 linears need in_features divisible by 32, got {self.in_features}")
        self.compute_dtype = _compute_dtype(dtype)
        self.register_buffer("codes", weight.codes.contiguous())
        self.register_buffer("scales", weight.scales.to(self.compute_dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        if rows.dtype != self.compute_dtype:
            rows = rows.to(self.compute_dtype)
        return _restore(torch.ops.aten._weight_int8pack_mm(rows, self.codes, self.scales), x)


def _bf16_rows(x: torch.Tensor, in_features: int) -> torch.Tensor:
    """x as the C kernel takes it: [rows, in] bfloat16."""
    rows = x if x.dim() == 2 else x.reshape(-1, in_features)
    return rows if rows.dtype == torch.bfloat16 else rows.to(torch.bfloat16)


def _restore(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The kernel's [rows, out] output in x's dtype and leading shape (no-ops skipped)."""
    if y.dtype != x.dtype:
        y = y.to(x.dtype)
    return y if x.dim() == 2 else y.view(*x.shape[:-1], y.shape[-1])


class KernelInt4Linear(nn.Module):
    """An int4 linear through this project's C kernel (engine.cpu_kernels.int4_matmul): the same
    w = (q - 8) * scale + zero, held as GGUF Q4_1 blocks, computed in bfloat16."""

    def __init__(self, weight: PackedInt4, kernel: Int4Kernel) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.kernel = kernel
        self.register_buffer("codes", weight.codes)
        self.register_buffer("dm", weight.dm)
        self.packed = weight  # the same tensors; the kernel reads them by address (CPU, never moved)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _restore(self.kernel.linear(_bf16_rows(x, self.in_features), self.packed), x)

    def bound_call(self, x: torch.Tensor, y: torch.Tensor, rows: int) -> tuple:
        """(the C function, its arguments) computing y[:rows] = x[:rows] @ W^T for contiguous
        [>= rows, in] / [>= rows, out] bfloat16 buffers that stay put (engine.model.decode_plan)."""
        return self.kernel.unchecked_linear, (x.data_ptr(), self.codes.data_ptr(), self.dm.data_ptr(), y.data_ptr(),
                                              rows, self.out_features, self.in_features)


def _require_int8x(kernel: Int4Kernel) -> None:
    if not kernel.int8x_supported:
        raise ValueError("int8 activations need AVX512-VNNI or AVX2 with FMA and F16C, which this CPU (or build) lacks")


class KernelInt4Int8xLinear(nn.Module):
    """The same int4 weight through the C kernel's int8-activation path: each row of x quantized
    to 8 bits per group of 32, integer dot products (llama.cpp's numerics for Q4 x Q8; about
    twice KernelInt4Linear's speed). The weight is held once, in pack_int8x's layout."""

    def __init__(self, weight: PackedInt4, kernel: Int4Kernel) -> None:
        super().__init__()
        _require_int8x(kernel)
        self.out_features, self.in_features = weight.shape
        self.kernel = kernel
        self.register_buffer("blocks", pack_int8x(weight))
        self.sum_half = sums_in_half(weight)  # Q4_1 (llama.cpp rounds s to float16) or Q4_0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = _bf16_rows(x, self.in_features)
        return _restore(self.kernel.linear_int8x(rows, self.blocks, self.out_features, self.sum_half), x)

    def bound_call(self, x: torch.Tensor, y: torch.Tensor, rows: int) -> tuple:
        """As KernelInt4Linear.bound_call."""
        return self.kernel.unchecked_linear_int8x, (x.data_ptr(), self.blocks.data_ptr(), y.data_ptr(), rows,
                                                    self.out_features, self.in_features, self.sum_half)


Q8_KERNEL_ROWS = 8
"""Most rows KernelQ8Linear sends to the C kernel once it has a dense copy to pack (pack_above).
SmolLM2's 49152 x 576 head, 2 threads (1 thread), ms: the kernel against oneDNN's packed bfloat16
at 4 rows 1.9 / 3.2 (3.2 / 3.6), at 8 2.7 / 2.8 (5.6 / 5.5), at 16 5.6 / 4.1 (10.5 / 6.9), at 64
15.3 / 10.4 (30.3 / 20.6)."""


class KernelQ8Linear(nn.Module):
    """A linear on GGUF Q8_0 blocks through this project's C kernel (engine.cpu_kernels.int4_matmul):
    each weight q * d rounded to bfloat16, the values the dense path holds, read at half the bytes.

    Past Q8_KERNEL_ROWS rows the kernel loses to oneDNN's packed bfloat16 matmul. Where the same
    values are held dense anyway (a tied head: the token embedding), pack_above lets the first such
    call pack them (~56 MB for SmolLM2, made only by a process that sees batches that large)."""

    def __init__(self, weight: Q8BlockWeight, kernel: Int4Kernel) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.codes.shape
        self.kernel = kernel
        self.register_buffer("codes", weight.codes.contiguous())
        self.register_buffer("d", weight.d.contiguous())
        self._dense: torch.Tensor | None = None
        self._packed: nn.Module | None = None

    def pack_above(self, dense: torch.Tensor) -> None:
        """Let calls of more than Q8_KERNEL_ROWS rows run on `dense` ([out, in] bfloat16 holding
        q * d rounded, as the tied embedding does) packed for oneDNN, packed on first use. The
        sums then run in oneDNN's order, as a dense head's do. Mutates at load time only."""
        if dense.shape != (self.out_features, self.in_features) or dense.dtype != torch.bfloat16:
            raise ValueError(f"a dense copy must be [{self.out_features}, {self.in_features}] bfloat16, got "
                             f"{list(dense.shape)} {dense.dtype}")
        self._dense = dense

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = _bf16_rows(x, self.in_features)
        if rows.shape[0] > Q8_KERNEL_ROWS and self._dense is not None:
            return _restore(self._packed_head()(rows), x)
        return _restore(self.kernel.q8_linear(rows, self.codes, self.d), x)

    def _packed_head(self) -> nn.Module:
        if self._packed is None:
            from engine.model.packed_linear import PackedLinear

            self._packed = PackedLinear(self._dense)
            logger.info("output head: %d rows and more run on a oneDNN-packed bfloat16 copy (%.0f MB), "
                        "packed now", Q8_KERNEL_ROWS + 1, self._dense.numel() * 2 / 1e6)
        return self._packed


class KernelQ8Int8xLinear(nn.Module):
    """GGUF Q8_0 blocks through the C kernel's int8-activation path: llama.cpp's Q8_0 x Q8_0
    product (x quantized per group of 32, exact integer sums), for every batch size. Beside int4
    linears with int8 activations, so a Q4 GGUF's Q8_0 head computes as llama.cpp's does."""

    def __init__(self, weight: Q8BlockWeight, kernel: Int4Kernel) -> None:
        super().__init__()
        _require_int8x(kernel)
        self.out_features, self.in_features = weight.codes.shape
        self.kernel = kernel
        self.register_buffer("blocks", pack_q8_int8x(weight.codes, weight.d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = _bf16_rows(x, self.in_features)
        return _restore(self.kernel.q8_linear_int8x(rows, self.blocks, self.out_features), x)


def head_held_as(module: nn.Module) -> str:
    """How `module`'s output projection is held, in engine.capacity.HEADS' terms: a GGUF's Q8_0 or
    Q4 blocks, or dense."""
    head = getattr(module, "lm_head", None)
    if isinstance(head, (KernelQ8Linear, KernelQ8Int8xLinear)):
        return "q8_0"
    if isinstance(head, (Int4Linear, KernelInt4Linear, KernelInt4Int8xLinear)):
        return "int4"
    return "dense"


def quantized_linear(weight: QuantizedWeight, dtype: torch.dtype, int4_kernel: Int4Kernel | None = None,
                     int8_activations: bool = False) -> nn.Module:
    """The module for one quantized weight: int4 through `int4_kernel` when given and the weight
    fits it (engine.cpu_kernels.int4_matmul.pack says when not), with int8 activations when asked,
    else torch's kernels; Q8_0 blocks only through the kernel, in bfloat16 (ValueError otherwise)."""
    if isinstance(weight, Q8BlockWeight):
        if int4_kernel is None or not kernel_computes(dtype) or not (int8_activations or int4_kernel.bf16_supported):
            raise ValueError("Q8_0 blocks are computed only by the C kernel, in bfloat16 (its bfloat16 path needs "
                             "AVX512-BF16; its int8-activation path runs on AVX2)")
        return KernelQ8Int8xLinear(weight, int4_kernel) if int8_activations else KernelQ8Linear(weight, int4_kernel)
    if isinstance(weight, Int8Weight):
        return Int8Linear(weight, dtype)
    if int4_kernel is not None and kernel_computes(dtype) and (int8_activations or int4_kernel.bf16_supported):
        packed = pack(weight.codes, weight.scales, weight.zeros, weight.group_size)
        if isinstance(packed, PackedInt4):
            kind = KernelInt4Int8xLinear if int8_activations else KernelInt4Linear
            return kind(packed, int4_kernel)
    return Int4Linear(weight, dtype)


def kernels_available(device_type: str) -> bool:
    """Whether this build has the CPU kernels (the only device this module serves)."""
    aten = torch.ops.aten
    return device_type == "cpu" and all(
        hasattr(aten, op) for op in
        ("_convert_weight_to_int4pack_for_cpu", "_weight_int4pack_mm_for_cpu", "_weight_int8pack_mm")
    )


def install_quantized_linears(module: nn.Module, weights: dict[str, QuantizedWeight], dtype: torch.dtype,
                              int4_kernel: Int4Kernel | None = None, int8_activations: bool = False) -> None:
    """Replace each linear named in `weights` (HF parameter names, `...q_proj.weight`) by its
    quantized module (quantized_linear). Mutates `module`, at load time only; raises KeyError for
    an unknown name."""
    for name, weight in weights.items():
        parent_name, _, child = name.removesuffix(".weight").rpartition(".")
        parent = module.get_submodule(parent_name)
        if not isinstance(getattr(parent, child), nn.Linear):
            raise KeyError(f"{name} is not a linear of {type(module).__name__}")
        setattr(parent, child, quantized_linear(weight, dtype, int4_kernel, int8_activations))
