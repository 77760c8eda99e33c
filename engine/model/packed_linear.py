"""CPU linears on oneDNN-packed weights.

Plain float32 `F.linear` on CPU goes to an sgemm that is 2-3x slower on this model's
shapes than oneDNN with weights reordered once at load (what torch's inductor does for
frozen models). The ops are torch-private, so packing is guarded: when they are missing
or fail a self-check against `F.linear`, modules keep their ordinary linears.

Row counts are bucketed (`padded_rows`): oneDNN builds and keeps a primitive (and memory
that glibc does not give back) for every distinct input shape it sees, so a prefill worker
fed prompts of every length grew by hundreds of MB, and kept growing, over a soak
(benchmarks/soak.py). With rows padded to at most 8 sizes per power of two, a process sees
a bounded set of shapes (under 100 up to 8,192 rows) and its memory levels off; the zero
rows cost under 12.5% extra compute and never change the real rows' values.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

logger = logging.getLogger(__name__)

_BATCH_HINT = 32  # oneDNN picks a weight layout for this many rows; any row count works
EXACT_ROWS = 16
"""Row counts up to this run unpadded (decode batches: the common small sizes stay exact)."""


def padded_rows(rows: int) -> int:
    """`rows` rounded up to a multiple of 1/8 of its power of two: 8 sizes per octave.

    17 -> 18, 100 -> 104, 1000 -> 1024; at most 12.5% more rows than asked for.
    """
    if rows <= EXACT_ROWS:
        return rows
    step = 1 << (rows.bit_length() - 4)
    return -(-rows // step) * step


def packing_available() -> bool:
    """Whether this torch build has the oneDNN ops PackedLinear uses."""
    mkldnn = getattr(torch.ops, "mkldnn", None)
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(mkldnn, "_reorder_linear_weight")
        and hasattr(mkldnn, "_linear_pointwise")
    )


class PackedLinear(nn.Module):
    """y = x @ W^T with W reordered for oneDNN (no bias: the Llama family has none)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _BATCH_HINT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        n = rows.shape[0]
        padded = padded_rows(n)
        if padded != n:  # a bounded set of shapes (module docstring): zero rows, sliced off below
            rows = torch.cat((rows, rows.new_zeros(padded - n, self.in_features)))
        y = torch.ops.mkldnn._linear_pointwise(rows, self.packed, None, "none", [], "")
        return y[:n].view(*x.shape[:-1], self.out_features)


def _self_check(linear: nn.Linear, packed: PackedLinear) -> bool:
    x = torch.randn(3, linear.in_features, dtype=linear.weight.dtype, generator=torch.Generator().manual_seed(0))
    want = nn.functional.linear(x, linear.weight)
    return torch.allclose(packed(x), want, rtol=1e-3, atol=1e-3)


def pack_linears(module: nn.Module) -> int:
    """Replace every bias-free CPU nn.Linear in `module` by a PackedLinear; returns how many.

    Mutates `module` (at load time only). Tied weights keep working: the embedding keeps its
    tensor, lm_head gets its own packed copy.
    """
    if not packing_available():
        return 0
    targets = [
        (parent, name, child)
        for parent in module.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear) and child.bias is None and child.weight.device.type == "cpu"
        and child.weight.dtype in (torch.float32, torch.bfloat16)
    ]
    if not targets:
        return 0
    try:
        first = PackedLinear(targets[0][2].weight)
        if not _self_check(targets[0][2], first):
            logger.warning("oneDNN packed linear disagrees with F.linear; keeping plain linears")
            return 0
    except RuntimeError as exc:  # private ops can change between torch releases
        logger.warning("oneDNN weight packing unavailable (%s); keeping plain linears", exc)
        return 0
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child.weight))
    return len(targets)
