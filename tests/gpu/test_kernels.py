"""Each CUDA kernel against its torch reference (engine/kernels/reference.py) on random inputs,
then its speed against the device-to-device copy bandwidth measured in the same run.

Outputs are filled with NaN first, so an element a kernel forgets to write fails the test;
caches hold NaN wherever no token lives, so a kernel reading past a context fails too.
Tolerance: max |out - ref| / max |ref| <= 1e-5 (fp32) or 1e-2 (fp16, bf16).
"""

from __future__ import annotations

import pytest
import torch

from engine.kernels import (
    block_checksum,
    block_checksum_blocks,
    pack_blocks,
    paged_decode_attention,
    store_kv,
    unpack_blocks,
)
from engine.kernels.reference import (
    block_checksum_ref,
    pack_blocks_ref,
    paged_decode_attention_ref,
    store_kv_ref,
    unpack_blocks_ref,
)

pytestmark = pytest.mark.gpu
pytest.importorskip("cupy", reason="the CUDA kernels need cupy")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}


def rel_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    diff = (out.double() - expected.double()).abs().max()
    return (diff / expected.double().abs().max().clamp_min(1e-30)).item()


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def paged_inputs(num_seqs, num_kv_heads, head_dim, block_size, max_context, dtype, seed):
    """A NaN cache with each sequence's tokens in randomly placed blocks (tables with holes),
    context lengths in [1, max_context] (the first is max_context, the last 0 when there are
    3 or more sequences)."""
    g = torch.Generator().manual_seed(seed)
    width = -(-max_context // block_size)
    num_blocks = num_seqs * width + 7
    tables = torch.randperm(num_blocks, generator=g)[: num_seqs * width].view(num_seqs, width)
    lens = torch.randint(1, max_context + 1, (num_seqs,), generator=g)
    lens[0] = max_context
    if num_seqs >= 3:
        lens[-1] = 0
    cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), float("nan"),
                       dtype=dtype, device="cuda")
    pos = torch.arange(max_context)
    slots = tables[:, pos // block_size] * block_size + pos % block_size  # [num_seqs, max_ctx]
    used = slots[pos[None, :] < lens[:, None]].cuda()
    flat = cache.view(2, -1, num_kv_heads, head_dim)
    flat[:, used] = torch.randn(2, used.numel(), num_kv_heads, head_dim, device="cuda").to(dtype)
    return (cache, tables.to(torch.int32).cuda(), lens.to(torch.int32).cuda())


ATTENTION_SHAPES = [
    # num_seqs, num_heads, num_kv_heads, head_dim, block_size, max_context
    (1, 32, 8, 128, 16, 4000),
    (7, 9, 3, 64, 16, 1000),  # SmolLM2-135M
    (64, 16, 16, 64, 32, 600),  # no GQA
    (256, 32, 8, 128, 16, 700),
    (3, 32, 1, 256, 16, 3000),  # MQA, head_dim 256: small partitions for shared memory
    (2, 8, 2, 80, 8, 20000),  # odd head_dim, many partitions
    (5, 4, 2, 64, 16, 1),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", ATTENTION_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_paged_decode_attention_matches_reference(shape, dtype):
    num_seqs, num_heads, num_kv_heads, head_dim, block_size, max_context = shape
    cache, tables, lens = paged_inputs(num_seqs, num_kv_heads, head_dim, block_size, max_context,
                                       dtype, seed=sum(shape))
    q = torch.randn(num_seqs, num_heads, head_dim, device="cuda").to(dtype)
    out = torch.full_like(q, float("nan"))
    paged_decode_attention(q, cache, tables, lens, head_dim ** -0.5, out=out)
    expected = paged_decode_attention_ref(q, cache, tables, lens, head_dim ** -0.5)
    assert not out.isnan().any(), "an output element was not written (or read a NaN slot)"
    assert rel_error(out, expected) <= TOL[dtype]
    if num_seqs >= 3:
        assert torch.count_nonzero(out[-1]) == 0  # context 0


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_tokens", [1, 33, 4096])
@pytest.mark.parametrize("fused", [False, True], ids=["separate", "fused-kv"])
def test_store_kv_matches_reference(num_tokens, dtype, fused):
    g = torch.Generator().manual_seed(num_tokens)
    cache = torch.randn(2, 600, 16, 8, 64, generator=g).to(dtype).cuda()
    slots = torch.randperm(600 * 16, generator=g)[:num_tokens]
    slots[::5] = -1
    if fused:  # K and V split out of one [num_tokens, 2, heads, dim] projection: strided rows
        kv = torch.randn(num_tokens, 2, 8, 64, generator=g).to(dtype).cuda()
        key, value = kv[:, 0], kv[:, 1]
    else:
        key = torch.randn(num_tokens, 8, 64, generator=g).to(dtype).cuda()
        value = torch.randn(num_tokens, 8, 64, generator=g).to(dtype).cuda()
    expected = cache.clone()
    store_kv(cache, slots.cuda(), key, value)
    store_kv_ref(expected, slots.cuda(), key, value)
    assert same_bytes(cache, expected)


@pytest.mark.parametrize("dtype,block", [
    (torch.float32, (16, 8, 128)), (torch.float16, (16, 8, 128)), (torch.bfloat16, (16, 2, 64)),
    (torch.float8_e4m3fn, (16, 8, 128)), (torch.float16, (1, 1, 3)), (torch.bfloat16, (3, 1, 2)),
], ids=str)
@pytest.mark.parametrize("num_ids", [1, 17, 200])
def test_pack_unpack_and_checksums_match_reference(dtype, block, num_ids):
    g = torch.Generator().manual_seed(num_ids)
    caches = [torch.randn(2, 256, *block, generator=g).to(dtype).cuda() for _ in range(4)]
    ids = torch.randperm(256, generator=g)[:num_ids].tolist()
    payload = torch.full((4, 2, num_ids, *block), float("nan"), device="cuda").to(dtype)
    pack_blocks(caches, ids, out=payload)
    assert same_bytes(payload, pack_blocks_ref(caches, ids))
    targets = [torch.full(c.shape, float("nan"), device="cuda").to(dtype) for c in caches]
    expected = [t.clone() for t in targets]
    new_ids = torch.randperm(256, generator=g)[:num_ids].tolist()
    unpack_blocks(payload, targets, new_ids)
    unpack_blocks_ref(payload, expected, new_ids)
    assert all(same_bytes(t, e) for t, e in zip(targets, expected))
    if (block[0] * block[1] * block[2] * payload.element_size()) % 4 == 0:
        sums = block_checksum(payload)
        assert torch.equal(sums, block_checksum_ref(payload))
        assert torch.equal(block_checksum_blocks(caches, ids), sums)
        assert torch.equal(block_checksum_blocks(targets, new_ids), sums)


def timed_ms(fn, iters: int = 20) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def test_kernel_speed_against_copy_bandwidth(capsys):
    """Prints GB/s (bytes read + written per second); asserts nothing about time."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_gbps = 2 * src.numel() / timed_ms(lambda: dst.copy_(src)) / 1e6
    del src, dst
    lines = [f"device-to-device copy: {copy_gbps:8.1f} GB/s"]

    num_seqs, context, block_size = 64, 4096, 16
    cache, tables, lens = paged_inputs(num_seqs, 8, 128, block_size, context, torch.bfloat16, 0)
    lens.fill_(context)
    cache = torch.nan_to_num(cache)
    q = torch.randn(num_seqs, 32, 128, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    ms = timed_ms(lambda: paged_decode_attention(q, cache, tables, lens, 128 ** -0.5, out=out))
    kv_bytes = 2 * num_seqs * context * 8 * 128 * 2
    gbps = kv_bytes / ms / 1e6
    lines.append(f"paged attention 64 x 4k, 32/8 heads x 128, bf16: {ms:7.3f} ms "
                 f"{gbps:8.1f} GB/s ({gbps / copy_gbps:.0%} of copy)")
    del cache

    caches = [torch.randn(2, 2048, 16, 8, 128, device="cuda", dtype=torch.bfloat16)
              for _ in range(32)]
    ids = torch.randperm(2048)[:256].tolist()
    payload = pack_blocks(caches, ids)
    moved = 2 * payload.numel() * payload.element_size()
    for name, fn in (("pack", lambda: pack_blocks(caches, ids, out=payload)),
                     ("unpack", lambda: unpack_blocks(payload, caches, ids)),
                     ("checksum", lambda: block_checksum(payload))):
        ms = timed_ms(fn)
        nbytes = moved if name != "checksum" else moved // 2
        gbps = nbytes / ms / 1e6
        lines.append(f"{name} 32 layers x 256 blocks (512 MiB): {ms:7.3f} ms {gbps:8.1f} GB/s "
                     f"({gbps / copy_gbps:.0%} of copy)")
    with capsys.disabled():
        print("\n" + "\n".join(lines))
