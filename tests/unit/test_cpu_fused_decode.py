"""The C pieces of a bfloat16 decode step on the CPU: RMSNorm with the residual add fused in
(rms_norm.c) and the rope + K/V store + attention call (paged_decode.c's paged_decode_rope_bf16),
each against the torch path it replaces, and the engine's use of them."""

from __future__ import annotations

import shutil

import pytest
import torch

from engine.cpu_kernels import check_slots, load_decode_kernel
from engine.cpu_kernels.rms_norm import load_rms_norm_kernel
from engine.model.attention import AttentionMetadata, DecodeGroup, paged_attention, write_kv
from engine.model.llama import RMSNorm
from engine.model.rope import StepRope, rope_tables
from engine.model.spec import RopeScaling

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                reason="no C compiler: the engine keeps the torch path (tested elsewhere)")
BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def norm_kernel():
    k, reason = load_rms_norm_kernel()
    assert k is not None, reason
    return k


@pytest.fixture(scope="module")
def decode_kernel():
    k, reason = load_decode_kernel()
    assert k is not None, reason
    return k


def activations(rows: int, hidden: int, seed: int) -> torch.Tensor:
    """Rows like a decoder's: scaled per row, with a few large outliers."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, hidden, generator=g) * torch.rand(rows, 1, generator=g) * 8
    return (x * (1 + 60 * (torch.rand(rows, hidden, generator=g) > 0.99))).to(BF16)


@pytest.mark.parametrize("rows,hidden", [(1, 576), (4, 576), (33, 576), (2, 16), (3, 4096)])
def test_add_rms_norm_matches_the_torch_path_within_a_bfloat16_step(norm_kernel, rows, hidden):
    torch_norm = RMSNorm(hidden, 1e-5).to(BF16)
    torch_norm.weight.data = (torch.rand(hidden, generator=torch.Generator().manual_seed(1)) * 2).to(BF16)
    kernel_norm = RMSNorm(hidden, 1e-5).to(BF16)
    kernel_norm.weight.data = torch_norm.weight.data.clone()
    kernel_norm.kernel = norm_kernel
    differ = total = 0
    for seed in range(20):
        x, residual = activations(rows, hidden, seed), activations(rows, hidden, seed + 100)
        want, want_residual = torch_norm(x, residual.clone())
        kept = residual.clone()
        got, got_residual = kernel_norm(x, kept)
        assert got_residual is kept and torch.equal(kept, want_residual)  # x + residual, in place, exact
        # The float32 sum of squares is added in its own order: where its last bit differs
        # from torch's, the normalized value moves by one bfloat16 step and the weight's
        # product by at most two.
        steps = want.float().abs() * 2.0**-6
        assert bool(((got.float() - want.float()).abs() <= steps).all())
        differ += int((got != want).sum())
        total += got.numel()
    assert differ <= total // 1000, f"{differ} of {total} outputs differ"


def test_float32_rows_and_odd_shapes_keep_torch(norm_kernel):
    norm = RMSNorm(576, 1e-5)
    norm.kernel = norm_kernel
    x = torch.randn(3, 576)
    assert torch.equal(norm(x), torch.rms_norm(x, (576,), norm.weight, 1e-5))  # float32: torch, HF-exact
    three_d = torch.randn(2, 3, 576).to(BF16)
    plain = RMSNorm(576, 1e-5).to(BF16)
    norm_bf16 = RMSNorm(576, 1e-5).to(BF16)
    norm_bf16.kernel = norm_kernel
    assert torch.equal(norm_bf16(three_d), plain(three_d))  # not 2-D: the torch path


def test_the_norm_kernel_refuses_bad_arguments(norm_kernel):
    w = torch.ones(576, dtype=BF16)
    with pytest.raises(ValueError, match="bfloat16"):
        norm_kernel(torch.ones(1, 576), w, 1e-5)
    with pytest.raises(ValueError, match="do not fit"):
        norm_kernel(torch.ones(1, 576, dtype=BF16), torch.ones(512, dtype=BF16), 1e-5)
    with pytest.raises(ValueError, match="multiple of 16"):
        norm_kernel(torch.ones(1, 40, dtype=BF16), torch.ones(40, dtype=BF16), 1e-5)


def decode_case(num_seqs: int, num_heads: int, num_kv_heads: int, head_dim: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    block_size, max_blocks = 16, 4
    num_blocks = num_seqs * max_blocks + 2
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(BF16)
    tables = torch.randperm(num_blocks, generator=g)[: num_seqs * max_blocks].view(num_seqs, max_blocks).contiguous()
    lens = torch.randint(1, max_blocks * block_size + 1, (num_seqs,), generator=g)
    slots = torch.tensor([int(tables[s, (n - 1) // block_size]) * block_size + (n - 1) % block_size
                          for s, n in enumerate(lens.tolist())])
    qkv = (torch.randn(num_seqs, (num_heads + 2 * num_kv_heads) * head_dim, generator=g) * 3).to(BF16)
    cos, sin = rope_tables(head_dim, 256, 10000.0, RopeScaling(), torch.device("cpu"))
    rope = StepRope.gather(cos[lens - 1], sin[lens - 1], BF16)
    group = DecodeGroup(torch.arange(num_seqs), tables, lens, None)
    return cache, qkv, rope, group, slots


@pytest.mark.parametrize("num_seqs,num_heads,num_kv_heads,head_dim", [(1, 9, 3, 64), (5, 9, 3, 64), (3, 8, 2, 128)])
def test_rope_decode_equals_rope_write_kv_and_the_kernel_bit_for_bit(decode_kernel, num_seqs, num_heads,
                                                                     num_kv_heads, head_dim):
    cache, qkv, rope, group, slots = decode_case(num_seqs, num_heads, num_kv_heads, head_dim, seed=num_seqs)
    meta = AttentionMetadata(slots, (group,), (), decode_kernel)
    scale = head_dim ** -0.5
    # the torch path of engine.model.llama.LlamaAttention, with the same C attention
    want_cache = cache.clone()
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qk = rope.apply(qkv[:, : q_size + kv_size].view(num_seqs, -1, head_dim))
    q, k = qk.split((num_heads, num_kv_heads), dim=1)
    write_kv(want_cache, slots, k, qkv[:, q_size + kv_size:].view(num_seqs, num_kv_heads, head_dim))
    want = paged_attention(q, want_cache, meta, scale)
    got = decode_kernel.rope_decode(qkv, rope.cos, rope.signed_sin, cache, meta, num_heads, scale)
    assert torch.equal(cache, want_cache)  # the rotated k and the v, in their slots, nothing else
    assert torch.equal(got, want)


def test_rope_decode_refuses_what_does_not_fit(decode_kernel):
    cache, qkv, rope, group, slots = decode_case(2, 9, 3, 64, seed=0)
    meta = AttentionMetadata(slots, (group,), (), decode_kernel)
    with pytest.raises(ValueError, match="bfloat16"):
        decode_kernel.rope_decode(qkv.float(), rope.cos, rope.signed_sin, cache, meta, 9, 0.125)
    with pytest.raises(ValueError, match="do not fit"):
        decode_kernel.rope_decode(qkv[:, :-64].contiguous(), rope.cos, rope.signed_sin, cache, meta, 9, 0.125)
    check_slots(slots, cache.shape[1] * cache.shape[2])
    with pytest.raises(ValueError, match=r"slots must lie in \[0, 32\)"):
        check_slots(torch.tensor([3, 32]), 32)


def test_the_engine_takes_the_fused_calls_in_bfloat16_decode_steps(tmp_path):
    from engine import SamplingParams
    from tests.tiny_model import tiny_llm, write_tiny_model

    folder = write_tiny_model(tmp_path / "tiny")
    llm = tiny_llm(folder, dtype="bfloat16")
    runner = llm.engine.core.runner
    norms = [m for m in runner.model.modules() if isinstance(m, RMSNorm)]
    assert norms and all(n.kernel is not None for n in norms)
    seen = []
    original = runner._metadata

    def spy(decodes, prefills, slot_mapping):
        meta = original(decodes, prefills, slot_mapping)
        seen.append((len(prefills), meta.rope_decode is not None))
        return meta

    runner._metadata = spy
    outs = llm.generate([[5, 6, 7, 8], [9, 10]], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [6, 6]
    assert all(fused == (prefills == 0) for prefills, fused in seen), seen  # pure decode steps only
    assert any(fused for _, fused in seen)
    off = tiny_llm(folder, dtype="bfloat16", cpu_attention_kernel=False)
    assert all(m.kernel is None for m in off.engine.core.runner.model.modules() if isinstance(m, RMSNorm))
