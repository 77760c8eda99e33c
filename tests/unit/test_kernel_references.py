"""The torch references the CUDA kernels are tested against are themselves right (on CPU):
paged decode attention equals dense attention over the gathered context and the engine's own
CPU attention; store, pack/unpack and checksums place and read exactly the expected bytes.
Also: the attention launch plan, and the wrappers' argument checks, which run before CUDA."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import blocks, paged_attention
from engine.kernels.paged_attention import plan
from engine.kernels.reference import (
    block_checksum_ref,
    pack_blocks_ref,
    paged_decode_attention_ref,
    store_kv_ref,
    unpack_blocks_ref,
)
from engine.model.attention import AttentionMetadata, DecodeGroup
from engine.model.attention import paged_attention as engine_paged_attention
from kv_transfer.packing import pack_blocks as transfer_pack_blocks


def scattered_cache(contexts, num_kv_heads, head_dim, block_size, num_blocks, seed=0):
    """A NaN-filled cache holding each sequence's dense K/V [ctx, heads, dim] in randomly
    chosen blocks (so tables have holes and unused blocks poison any stray read)."""
    g = torch.Generator().manual_seed(seed)
    cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), float("nan"),
                       dtype=torch.float64)
    width = max(-(-c // block_size) for c in contexts)
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables, dense = [], []
    for ctx in contexts:
        ids = [free.pop() for _ in range(-(-ctx // block_size))]
        kv = torch.randn(2, ctx, num_kv_heads, head_dim, generator=g, dtype=torch.float64)
        for p in range(ctx):
            cache[:, ids[p // block_size], p % block_size] = kv[:, p]
        tables.append(ids + [0] * (width - len(ids)))
        dense.append(kv)
    return cache, torch.tensor(tables, dtype=torch.int32), dense


def dense_attention(q, k, v, scale):
    """q [heads, dim], k/v [ctx, kv_heads, dim]; GQA by repeating each kv head."""
    group = q.shape[0] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    weights = torch.softmax(torch.einsum("hd,thd->ht", q, k) * scale, dim=-1)
    return torch.einsum("ht,thd->hd", weights, v)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (9, 3), (6, 1)])
def test_paged_decode_attention_ref_equals_dense_attention_over_the_gathered_context(
        num_heads, num_kv_heads):
    contexts = [1, 16, 37, 100, 5]
    cache, tables, dense = scattered_cache(contexts, num_kv_heads, 32, 16, 40)
    q = torch.randn(len(contexts), num_heads, 32, dtype=torch.float64,
                    generator=torch.Generator().manual_seed(1))
    out = paged_decode_attention_ref(q, cache, tables, torch.tensor(contexts, dtype=torch.int32),
                                     0.2)
    for s, kv in enumerate(dense):
        torch.testing.assert_close(out[s], dense_attention(q[s], kv[0], kv[1], 0.2),
                                   rtol=1e-12, atol=1e-12)


def test_paged_decode_attention_ref_gives_zeros_for_an_empty_context():
    cache, tables, _ = scattered_cache([3, 20], 2, 8, 4, 12)
    q = torch.ones(2, 2, 8, dtype=torch.float64)
    out = paged_decode_attention_ref(q, cache, tables, torch.tensor([0, 20], dtype=torch.int32),
                                     1.0)
    assert torch.equal(out[0], torch.zeros(2, 8, dtype=torch.float64))
    assert not out[1].isnan().any()


def test_paged_decode_attention_ref_matches_the_engines_cpu_attention():
    contexts, block_size = [9, 23, 16], 8
    cache, tables, _ = scattered_cache(contexts, 2, 16, block_size, 20, seed=3)
    cache = torch.nan_to_num(cache).float()  # the engine's path reads padding slots (masked)
    q = torch.randn(3, 6, 16, generator=torch.Generator().manual_seed(4))
    lengths = torch.tensor(contexts)
    pos = torch.arange(tables.shape[1] * block_size)
    mask = (pos[None, :] < lengths[:, None])[:, None, None, :]
    group = DecodeGroup(torch.arange(3), tables.long(), lengths, mask)
    meta = AttentionMetadata(torch.zeros(3, dtype=torch.int64), (group,), ())
    expected = engine_paged_attention(q, cache, meta, 0.25)
    out = paged_decode_attention_ref(q, cache, tables, lengths.to(torch.int32), 0.25)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_store_kv_ref_writes_each_token_at_its_slot_and_skips_negative_slots():
    cache = torch.zeros(2, 3, 2, 1, 2)  # 6 slots
    k = torch.tensor([[[1.0, 2.0]], [[3.0, 4.0]], [[5.0, 6.0]]])
    store_kv_ref(cache, torch.tensor([5, -1, 2]), k, -k)
    flat = cache.view(2, 6, 2)
    assert flat[0].tolist() == [[0, 0], [0, 0], [5, 6], [0, 0], [0, 0], [1, 2]]
    assert flat[1].tolist() == [[0, 0], [0, 0], [-5, -6], [0, 0], [0, 0], [-1, -2]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_pack_then_unpack_round_trips_blocks_of_every_layer(dtype):
    g = torch.Generator().manual_seed(5)
    caches = [torch.randn(2, 8, 4, 2, 3, generator=g).to(dtype) for _ in range(3)]
    payload = pack_blocks_ref(caches, [6, 1, 3])
    assert payload.shape == (3, 2, 3, 4, 2, 3)
    assert torch.equal(payload[2, 1, 0].view(torch.uint8), caches[2][1, 6].view(torch.uint8))
    assert torch.equal(payload.view(torch.uint8),
                       transfer_pack_blocks(caches, [6, 1, 3]).view(torch.uint8))
    fresh = [torch.zeros_like(c) for c in caches]
    unpack_blocks_ref(payload, fresh, [0, 7, 2])
    for cache, new in zip(caches, fresh):
        assert torch.equal(new[:, [0, 7, 2]].view(torch.uint8),
                           cache[:, [6, 1, 3]].view(torch.uint8))
        assert torch.count_nonzero(new[:, [1, 3, 4, 5, 6]].view(torch.uint8)) == 0


def test_block_checksum_ref_sums_uint32_words_per_block_with_wrap_around():
    words = torch.zeros(1, 2, 2, 4, dtype=torch.int32)
    words[0, 0, 0] = torch.tensor([1, 2, 3, 4])
    words[0, 1, 1] = torch.tensor([-1, -1, 5, 0])  # 0xFFFFFFFF twice wraps to 0xFFFFFFFE
    payload = words.view(torch.float32).view(1, 2, 2, 1, 1, 4)
    assert block_checksum_ref(payload).tolist() == [[[10, 0], [0, (0xFFFFFFFE + 5) % 2**32]]]


def test_plan_uses_512_token_partitions_for_a_large_batch():
    p = plan(64, 32, 8, 128, 4096, 132)
    assert (p.partition_size, p.num_partitions, p.threads) == (512, 8, 256)
    assert p.shared_mem == paged_attention.shared_mem_bytes(4, 128, 512)


def test_plan_splits_finer_to_fill_the_device_for_one_sequence():
    assert plan(1, 32, 8, 128, 4096, 132).partition_size == 128
    assert plan(1, 32, 8, 128, 100, 132).num_partitions == 1


def test_plan_shrinks_partitions_to_fit_shared_memory_or_refuses():
    p = plan(64, 32, 1, 256, 4096, 132)  # MQA: 32 query heads share each K/V row
    assert p.partition_size == 64 and p.shared_mem <= paged_attention.SHARED_MEM_LIMIT
    with pytest.raises(ValueError, match="shared memory"):
        plan(1, 64, 1, 256, 100, 132)


def test_paged_decode_attention_rejects_cpu_tensors_before_touching_cuda():
    q = torch.zeros(2, 4, 8)
    cache = torch.zeros(2, 3, 4, 2, 8)
    tables, lens = torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="CUDA"):
        paged_attention.paged_decode_attention(q, cache, tables, lens, 1.0)
    with pytest.raises(ValueError, match="block_tables must be torch.int32"):
        paged_attention.paged_decode_attention(q, cache, tables.long(), lens, 1.0)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        paged_attention.paged_decode_attention(torch.zeros(2, 3, 8), cache, tables, lens, 1.0)
    with pytest.raises(ValueError, match="kv_cache has dtype torch.float16"):
        paged_attention.paged_decode_attention(q, cache.half(), tables, lens, 1.0)


def test_block_wrappers_reject_bad_arguments_before_touching_cuda():
    cache = torch.zeros(2, 3, 4, 2, 8)
    with pytest.raises(ValueError, match=r"key must be \[2, 2, 8\]"):
        blocks.store_kv(cache, torch.zeros(2, dtype=torch.int64), torch.zeros(2, 2, 4),
                        torch.zeros(2, 2, 8))
    with pytest.raises(ValueError, match="out of range"):
        blocks.pack_blocks([cache], [3])
    with pytest.raises(ValueError, match="repeat"):
        blocks.unpack_blocks(torch.zeros(1, 2, 2, 4, 2, 8), [cache], [1, 1])
    with pytest.raises(ValueError, match="CUDA"):
        blocks.pack_blocks([cache], [0, 2])
