"""Host tensors backed by 2 MiB pages (Linux transparent huge pages), for the CPU KV cache.

The decode kernel reads a request's blocks wherever the pool put them: 6 KB reads scattered over
hundreds of MB. With 4 KiB pages nearly every block costs a TLB miss and a page walk; with 2 MiB
pages the whole cache of a worker fits the CPU's second-level TLB. On the 2-core EPYC this
project is measured on, the decode kernel over the same randomly placed blocks took 0.85-0.94x
the time on 2 MiB pages (benchmarks/cpu_attention.py).

Linux backs a range with huge pages only where it is 2 MiB aligned and advised (MADV_HUGEPAGE;
the default `madvise` mode of /sys/kernel/mm/transparent_hugepage/enabled) before its pages are
first touched. So the tensor is carved out of an allocation padded to an aligned start and a
whole number of huge pages, advised, and only then zeroed. Where the kernel says `never`, or
madvise fails, the tensor is the same, only on small pages.

Small pages when asked (`--no-cpu-kv-huge-pages`) are advised too (MADV_NOHUGEPAGE): memory
that malloc hands back may lie in a range an earlier huge-page buffer advised, and in the
`always` mode every aligned range would get huge pages, with the slow start the flag avoids.
"""

from __future__ import annotations

import ctypes
import logging
import math
import sys
from pathlib import Path

import torch

__all__ = ["HUGE_PAGE_BYTES", "huge_page_mode", "zeros_on_huge_pages", "zeros_on_small_pages"]

logger = logging.getLogger(__name__)
HUGE_PAGE_BYTES = 2 << 20
_MADV_HUGEPAGE = 14
_MADV_NOHUGEPAGE = 15
_THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_page_mode() -> str:
    """The kernel's transparent huge page mode (always, madvise or never); "unsupported" off
    Linux or without the knob."""
    try:
        text = _THP_ENABLED.read_text()
    except OSError:
        return "unsupported"
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else "unsupported"


def _madvise(address: int, length: int, advice: int) -> bool:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return libc.madvise(address, length, advice) == 0


def _zeros_advised(shape: tuple[int, ...], dtype: torch.dtype, advice: int) -> tuple[torch.Tensor, bool]:
    """A zeroed tensor carved out of a buffer padded to a 2 MiB aligned start and a whole number
    of huge pages, the aligned range given `advice` before its first touch; (tensor, whether the
    advice was taken). Off Linux, under one huge page, or where the kernel has no huge pages,
    plain zeros: there is nothing to advise."""
    nbytes = math.prod(shape) * dtype.itemsize
    if not sys.platform.startswith("linux") or nbytes < HUGE_PAGE_BYTES or huge_page_mode() in ("never", "unsupported"):
        return torch.zeros(shape, dtype=dtype), False
    padded = -(-nbytes // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    raw = torch.empty(padded + HUGE_PAGE_BYTES, dtype=torch.uint8)  # not touched yet
    start = raw.data_ptr()
    offset = -start % HUGE_PAGE_BYTES
    advised = _madvise(start + offset, padded, advice)
    if not advised:
        logger.debug("madvise(%d) failed (errno %d): the kernel's default pages", advice, ctypes.get_errno())
    tensor = raw[offset:offset + nbytes].view(dtype).view(shape)
    tensor.zero_()  # first touch: the faults take the pages the advice asked for
    return tensor, advised


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, bool]:
    """A zeroed, contiguous CPU tensor whose memory starts on a 2 MiB boundary and was advised
    for huge pages before it was touched; (tensor, whether the advice was taken). The tensor is
    a view into a slightly larger buffer (at most 2 huge pages more), which it keeps alive."""
    return _zeros_advised(shape, dtype, _MADV_HUGEPAGE)


def zeros_on_small_pages(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, bool]:
    """The same, advised against huge pages (MADV_NOHUGEPAGE): 4 KiB pages whatever the range
    was advised before and whatever the kernel's mode; (tensor, whether the advice was taken)."""
    return _zeros_advised(shape, dtype, _MADV_NOHUGEPAGE)
