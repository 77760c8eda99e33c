"""pack_blocks / unpack_blocks: exact round trips of chosen blocks, fp8 included."""

from __future__ import annotations

import pytest
import torch

from kv_transfer.base import DTypeCode, TransferHeader
from kv_transfer.packing import (
    check_payload,
    dtype_code,
    empty_payload,
    make_header,
    pack_blocks,
    unpack_blocks,
)

LAYERS, BLOCKS, BLOCK, HEADS, DIM = 3, 12, 4, 2, 8


def caches(dtype: torch.dtype, seed: int | None) -> list[torch.Tensor]:
    """Per layer [2, BLOCKS, BLOCK, HEADS, DIM]; random when seeded, else zeros."""
    shape = (2, BLOCKS, BLOCK, HEADS, DIM)
    if seed is None:
        return [torch.zeros(shape).to(dtype) for _ in range(LAYERS)]
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen).to(dtype) for _ in range(LAYERS)]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16,
                                   torch.float8_e4m3fn], ids=str)
def test_pack_then_unpack_into_other_block_ids_copies_exactly_those_blocks(dtype):
    src, dst = caches(dtype, seed=0), caches(dtype, seed=None)
    src_ids, dst_ids = [9, 2, 3, 11], [0, 5, 6, 10]  # holes and a non-sorted order
    payload = pack_blocks(src, src_ids)
    assert payload.shape == (LAYERS, 2, 4, BLOCK, HEADS, DIM)
    assert payload.dtype == dtype and payload.is_contiguous()
    unpack_blocks(payload, dst, dst_ids)
    for layer in range(LAYERS):
        for s, d in zip(src_ids, dst_ids):
            assert torch.equal(bits(dst[layer][:, d]), bits(src[layer][:, s]))
        untouched = [b for b in range(BLOCKS) if b not in dst_ids]
        assert torch.count_nonzero(bits(dst[layer][:, untouched])).item() == 0


def test_pack_copies_so_the_cache_can_be_reused_at_once():
    src = caches(torch.float32, seed=1)
    expected = src[0][:, [4]].clone()
    payload = pack_blocks(src, [4])
    src[0].fill_(-1.0)
    assert torch.equal(payload[0], expected)


def test_pack_rejects_block_ids_out_of_range_or_repeated():
    src = caches(torch.float32, seed=2)
    with pytest.raises(ValueError, match=r"block ids \[12\] out of range for 12 blocks"):
        pack_blocks(src, [1, 12])
    with pytest.raises(ValueError, match=r"block ids repeat: \[3, 3\]"):
        unpack_blocks(pack_blocks(src, [1, 2]), src, [3, 3])


def test_unpack_rejects_a_payload_of_another_shape_or_dtype():
    src = caches(torch.float32, seed=3)
    with pytest.raises(ValueError, match="does not fit caches"):
        unpack_blocks(pack_blocks(src, [1, 2]), src, [5])
    with pytest.raises(ValueError, match="does not fit caches"):
        unpack_blocks(pack_blocks(src, [1]).half(), src, [5])


def test_header_made_from_a_payload_describes_it_and_allocates_its_twin():
    payload = pack_blocks(caches(torch.bfloat16, seed=4), [0, 7])
    header = make_header(ticket_id=5, first_token_id=77, payload=payload)
    assert header == TransferHeader(5, 77, LAYERS, 2, BLOCK, HEADS, DIM, DTypeCode.BFLOAT16)
    assert header.payload_nbytes == payload.numel() * payload.element_size()
    twin = empty_payload(header)
    assert (twin.shape, twin.dtype) == (payload.shape, payload.dtype)
    check_payload(header, payload)
    with pytest.raises(ValueError, match="payload must be contiguous"):
        check_payload(header, payload.transpose(3, 4).contiguous().transpose(3, 4))


def test_dtype_codes_cover_the_kv_cache_dtypes_and_reject_others():
    assert [dtype_code(d) for d in (torch.float32, torch.bfloat16, torch.float16,
                                    torch.float8_e4m3fn)] == [1, 2, 3, 4]
    with pytest.raises(ValueError, match="no transfer dtype code for torch.int32"):
        dtype_code(torch.int32)
