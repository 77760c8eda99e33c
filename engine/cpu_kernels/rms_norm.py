"""RMSNorm of bfloat16 rows with the residual add fused in (rms_norm.c), for the CPU decode path.

At batch 1 a bfloat16 RMSNorm through torch is about ten small ops (to float32, pow, mean, add,
rsqrt, mul, back to bfloat16, the weight product) plus the residual add before it, ~35 us a call
and 61 calls a step on SmolLM2; this is one call of a few microseconds. engine.model.llama.RMSNorm
uses it for bfloat16 rows when the engine runs on the CPU and the library builds; float32 keeps
torch.rms_norm, which equals HF bit for bit.
"""

from __future__ import annotations

import ctypes

import torch

from engine.cpu_kernels.loader import RMS_NORM, Loaded, load_kernel

LANES = 16
"""The row width must be a multiple of this (rms_norm.c's LANES)."""


class RMSNormKernel:
    """The function of one loaded library (rms_norm.c)."""

    def __init__(self, loaded: Loaded) -> None:
        if loaded.library is None:
            raise ValueError(f"no kernel library: {loaded.reason}")
        self.path = loaded.path
        self._fn = loaded.library.add_rms_norm_bf16
        self._fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 2 + [ctypes.c_float]
        self._fn.restype = ctypes.c_int
        self.unchecked = self._fn
        """add_rms_norm_bf16 itself, (x, residual or 0, weight, out, rows, hidden, eps) by address:
        for a caller that checked every shape once and calls it many times (engine.model.decode_plan)."""

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> torch.Tensor:
        """weight * rms_norm(x [+ residual]) of x's rows ([rows, hidden] bfloat16, contiguous, CPU).
        With `residual` (same shape), x + residual is written into residual first and normalized."""
        rows, hidden = x.shape
        for name, t in (("x", x), ("weight", weight), ("residual", residual)):
            if t is not None and (t.dtype != torch.bfloat16 or not t.is_contiguous() or t.device.type != "cpu"):
                raise ValueError(f"{name} must be a contiguous bfloat16 CPU tensor")
        if weight.shape != (hidden,) or (residual is not None and residual.shape != x.shape):
            raise ValueError(f"shapes do not fit: x {tuple(x.shape)}, weight {tuple(weight.shape)}, residual "
                             f"{None if residual is None else tuple(residual.shape)}")
        out = torch.empty_like(x)
        if self._fn(x.data_ptr(), 0 if residual is None else residual.data_ptr(), weight.data_ptr(), out.data_ptr(),
                    rows, hidden, eps):
            raise ValueError(f"add_rms_norm_bf16 does not take rows of {hidden} (a multiple of {LANES})")
        return out


def load_rms_norm_kernel() -> tuple[RMSNormKernel | None, str]:
    """(the kernel, "") or (None, why there is none)."""
    return load_kernel(RMS_NORM, RMSNormKernel)
