"""The CPU KV cache on 2 MiB pages (engine/huge_pages.py): aligned, advised before first touch,
zeroed, one buffer whose per-layer views stay independent."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.huge_pages import HUGE_PAGE_BYTES, huge_page_mode, zeros_on_huge_pages
from engine.runner import allocate_kv_caches
from tests.unit.test_capacity import smollm2_like

THP_OFFERED = huge_page_mode() in ("always", "madvise")


def vm_flags_over(address: int, length: int) -> list[list[str]]:
    """The VmFlags of each of this process's mappings that overlap [address, address + length)
    (/proc/self/smaps), in address order."""
    flags, inside = [], False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(" ", 1)[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start < address + length and address < end
        elif inside and line.startswith("VmFlags:"):
            flags.append(line.split()[1:])
    if not flags:
        raise AssertionError(f"no mapping holds {address:#x}")
    return flags


def vm_flags_at(address: int) -> list[str]:
    """The VmFlags of this process's mapping that holds `address`."""
    return vm_flags_over(address, 1)[0]


@pytest.mark.skipif(not THP_OFFERED, reason=f"transparent huge pages: {huge_page_mode()}")
def test_a_large_tensor_starts_on_a_huge_page_and_its_mapping_is_advised():
    tensor, advised = zeros_on_huge_pages((3, 1 << 20), torch.bfloat16)  # 6 MiB
    assert advised
    assert tensor.shape == (3, 1 << 20) and tensor.dtype == torch.bfloat16 and tensor.is_contiguous()
    assert tensor.data_ptr() % HUGE_PAGE_BYTES == 0
    assert "hg" in vm_flags_at(tensor.data_ptr())  # MADV_HUGEPAGE took
    assert int(tensor.count_nonzero()) == 0


def test_a_tensor_under_one_huge_page_is_plain_zeros():
    tensor, advised = zeros_on_huge_pages((16, 1024), torch.float32)  # 64 KiB
    assert not advised
    assert tensor.shape == (16, 1024) and int(tensor.count_nonzero()) == 0


def test_cpu_kv_caches_are_independent_zeroed_layers_of_one_buffer():
    spec = smollm2_like(num_layers=4)
    caches = allocate_kv_caches(spec, num_blocks=512, block_size=16, dtype=torch.bfloat16, device=torch.device("cpu"))
    assert len(caches) == 4
    for cache in caches:
        assert cache.shape == (2, 512, 16, 3, 64) and cache.dtype == torch.bfloat16 and cache.is_contiguous()
        assert int(cache.count_nonzero()) == 0
    caches[1][0, 7].fill_(1.0)
    assert [int(c.count_nonzero()) for c in caches] == [0, 16 * 3 * 64, 0, 0]
    if THP_OFFERED:  # 4 layers x 6 MiB: one advised buffer
        assert caches[0].data_ptr() % HUGE_PAGE_BYTES == 0
        assert "hg" in vm_flags_at(caches[3].data_ptr())


def test_cpu_kv_caches_on_small_pages_when_asked_are_the_same_zeroed_layers(caplog):
    spec = smollm2_like(num_layers=2)
    # malloc may hand back memory an earlier huge-page buffer advised (seen in CI): the small
    # pages must not inherit that advice anywhere in the cache.
    raised = torch.empty(32 << 20, dtype=torch.uint8)  # freed, it raises glibc's mmap threshold
    del raised
    earlier, _ = zeros_on_huge_pages((2, 2, 512, 16, 3, 64), torch.float32)
    del earlier
    with caplog.at_level("INFO", logger="engine.runner"):
        caches = allocate_kv_caches(spec, num_blocks=512, block_size=16, dtype=torch.float32,
                                    device=torch.device("cpu"), huge_pages=False)
    assert [c.shape for c in caches] == [(2, 512, 16, 3, 64)] * 2
    assert all(c.is_contiguous() and int(c.count_nonzero()) == 0 for c in caches)
    whole = caches[0].data_ptr(), 2 * caches[0].numel() * caches[0].element_size()
    assert caches[1].data_ptr() == whole[0] + whole[1] // 2  # one buffer
    assert not any("hg" in flags for flags in vm_flags_over(*whole))
    if THP_OFFERED:
        assert all("nh" in flags for flags in vm_flags_over(*whole))  # MADV_NOHUGEPAGE took
    assert "KV cache on small pages (--no-cpu-kv-huge-pages)" in caplog.text


@pytest.mark.skipif(not THP_OFFERED, reason=f"transparent huge pages: {huge_page_mode()}")
def test_the_huge_page_log_line_gives_the_time_to_zero_the_cache(caplog):
    with caplog.at_level("INFO", logger="engine.runner"):
        allocate_kv_caches(smollm2_like(num_layers=2), num_blocks=512, block_size=16, dtype=torch.float32,
                           device=torch.device("cpu"))
    assert "KV cache on 2 MiB pages (transparent huge pages: " in caplog.text
    assert " zeroed in " in caplog.text
