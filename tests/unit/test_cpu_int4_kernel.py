"""The C int4 linear kernel (engine/cpu_kernels/int4_linear.c): its formula against a float64
reference written here, the packing of GGUF's Q4_0/Q4_1 blocks, the batch sizes on both sides of
MAX_KERNEL_ROWS, threads, and the fallbacks to torch's kernel."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.cpu_kernels import loader
from engine.cpu_kernels.int4_matmul import GROUP, MAX_KERNEL_ROWS, PackedInt4, load_int4_kernel, pack
from engine.loader.gguf_quant import q4_blocks_to_int4, q8_blocks
from engine.model.quantized_linear import (
    Int4Linear, Int4Weight, KernelInt4Linear, KernelQ8Linear, Q8BlockWeight, kernels_available, quantize_int4,
    quantized_linear,
)

KERNEL, WHY = load_int4_kernel()
pytestmark = pytest.mark.skipif(KERNEL is None or not KERNEL.bf16_supported,
                                reason=f"no C bfloat16 int4 kernel here (needs AVX512-BF16): {WHY or 'not on this CPU'}")


def _weight(rows: int, cols: int, seed: int = 0) -> Int4Weight:
    return quantize_int4(torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * 0.05)


def _bf16_weights(packed: PackedInt4) -> torch.Tensor:
    """q * d + m in float32, rounded to bfloat16: the values the kernel multiplies (its header)."""
    rows, cols = packed.shape
    codes = packed.codes.reshape(rows, cols // GROUP, GROUP // 2)
    q = torch.cat((codes & 15, codes >> 4), -1)  # low nibbles: weights 0..15 of the group
    dm = packed.dm.to(torch.float32)
    return (q.to(torch.float32) * dm[..., :1] + dm[..., 1:]).reshape(rows, cols).to(torch.bfloat16)


def test_it_computes_q_times_d_plus_m_per_group_of_32_exactly_on_small_integers():
    codes = (torch.arange(64) + 5 * torch.arange(3)[:, None]).remainder(16).to(torch.uint8)
    scales, zeros = torch.tensor([[1.0, 2.0]] * 3), torch.tensor([[0.0, -3.0]] * 3)
    linear = quantized_linear(Int4Weight(codes, scales, zeros, 32), torch.bfloat16, KERNEL)
    assert isinstance(linear, KernelInt4Linear)
    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    x[0, 0] = 1  # column 0: (q - 8) * 1
    x[1, 33] = 1  # column 33, group 1: (q - 8) * 2 - 3
    want = torch.stack((codes[:, 0].float() - 8, (codes[:, 33].float() - 8) * 2 - 3))
    assert torch.equal(linear(x).float(), want)


@pytest.mark.parametrize("rows, cols", [(1, 32), (3, 64), (7, 576), (130, 576), (64, 1536)])
def test_every_batch_size_matches_the_float64_reference(rows, cols):
    weight = pack(*_parts(_weight(rows, cols)))
    w = _bf16_weights(weight).to(torch.float64)
    generator = torch.Generator().manual_seed(1)
    for m in (*range(1, 18), 40):
        x = torch.randn(m, cols, generator=generator).to(torch.bfloat16)
        y = KERNEL.linear(x, weight)
        assert (y.dtype, y.shape) == (torch.bfloat16, (m, rows))
        ref = x.to(torch.float64) @ w.T
        # The output is rounded to bfloat16 (2^-9 relative); float32 sums add far less.
        tolerance = 2.0 ** -8 * ref.abs() + 1e-4 * ref.abs().max()
        assert ((y.to(torch.float64) - ref).abs() <= tolerance).all(), (rows, cols, m)


def test_above_max_kernel_rows_it_is_a_dense_matmul_on_the_same_bfloat16_weights():
    weight = pack(*_parts(_weight(48, 576)))
    x = torch.randn(MAX_KERNEL_ROWS + 1, 576).to(torch.bfloat16)
    assert torch.equal(KERNEL.dequantize(weight), _bf16_weights(weight))
    assert torch.equal(KERNEL.linear(x, weight), torch.nn.functional.linear(x, _bf16_weights(weight)))


def test_two_threads_give_the_same_bits_as_one():
    weight = pack(*_parts(_weight(200, 576)))
    x = torch.randn(8, 576).to(torch.bfloat16)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = KERNEL.linear(x, weight)
        torch.set_num_threads(2)
        two = KERNEL.linear(x, weight)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)  # each output row is one thread's sum, in one order


def _q8_weight(rows: int, cols: int, seed: int = 0) -> Q8BlockWeight:
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(-127, 128, (rows, cols), dtype=torch.int8, generator=generator)
    d = (torch.rand(rows, cols // GROUP, generator=generator) * 0.01 + 1e-4).to(torch.float16)
    return Q8BlockWeight(codes, d)


def test_q8_0_blocks_multiply_as_q_times_d_rounded_to_bfloat16_for_every_batch_size():
    for rows, cols in [(1, 32), (7, 64), (130, 576)]:
        weight = _q8_weight(rows, cols)
        # the dense path's values: q * d in float32 (exact), then bfloat16
        w = weight.dequantize().to(torch.bfloat16).to(torch.float64)
        linear = quantized_linear(weight, torch.bfloat16, KERNEL)
        assert isinstance(linear, KernelQ8Linear)
        generator = torch.Generator().manual_seed(1)
        for m in (1, 2, 4, 5, 8, 9, 17, 40):
            x = torch.randn(m, cols, generator=generator).to(torch.bfloat16)
            y = linear(x)
            assert (y.dtype, y.shape) == (torch.bfloat16, (m, rows))
            ref = x.to(torch.float64) @ w.T
            tolerance = 2.0 ** -8 * ref.abs() + 1e-4 * ref.abs().max()
            assert ((y.to(torch.float64) - ref).abs() <= tolerance).all(), (rows, cols, m)


def test_a_q8_0_head_with_a_dense_copy_runs_more_than_8_rows_on_it_packed_on_first_use():
    from engine.model.packed_linear import PackedLinear, packing_available
    from engine.model.quantized_linear import Q8_KERNEL_ROWS

    if not packing_available():
        pytest.skip("no oneDNN packing in this torch build")
    weight = _q8_weight(256, 576)
    dense = weight.dequantize().to(torch.bfloat16)  # what a tied embedding holds
    head, plain = (quantized_linear(weight, torch.bfloat16, KERNEL) for _ in range(2))
    head.pack_above(dense)
    generator = torch.Generator().manual_seed(2)
    few = torch.randn(Q8_KERNEL_ROWS, 576, generator=generator).to(torch.bfloat16)
    assert torch.equal(head(few), plain(few)) and head._packed is None  # the kernel; nothing packed yet
    many = torch.randn(Q8_KERNEL_ROWS + 1, 576, generator=generator).to(torch.bfloat16)
    assert torch.equal(head(many), PackedLinear(dense)(many))  # the same values, oneDNN's order
    assert head._packed is not None
    close = (head(many).float() - plain(many).float()).abs() <= 2.0 ** -7 * plain(many).float().abs() + 1e-3
    assert bool(close.all())
    with pytest.raises(ValueError, match=r"must be \[256, 576\] bfloat16"):
        head.pack_above(dense.float())


def test_q8_0_on_small_integers_is_exact_and_needs_the_kernel_in_bfloat16():
    codes = (torch.arange(64) - 32 + 7 * torch.arange(3)[:, None]).to(torch.int8)
    d = torch.tensor([[1.0, 0.5]] * 3, dtype=torch.float16)
    linear = quantized_linear(Q8BlockWeight(codes, d), torch.bfloat16, KERNEL)
    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    x[0, 3] = 1  # group 0: q * 1
    x[1, 40] = 2  # group 1: q * 0.5 * 2
    assert torch.equal(linear(x).float(), torch.stack((codes[:, 3].float(), codes[:, 40].float())))
    with pytest.raises(ValueError, match="only by the C kernel, in bfloat16"):
        quantized_linear(Q8BlockWeight(codes, d), torch.bfloat16, None)
    with pytest.raises(ValueError, match="only by the C kernel, in bfloat16"):
        quantized_linear(Q8BlockWeight(codes, d), torch.float16, KERNEL)
    with pytest.raises(ValueError, match=r"x must be \[rows, 64\] bfloat16"):
        KERNEL.q8_linear(torch.zeros(2, 64), codes, d)


def test_gguf_q8_0_blocks_keep_their_codes_and_float16_d_bit_for_bit():
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, size=(5, 18, 34), dtype=np.uint8)
    d = (rng.standard_normal((5, 18)) * 0.01).astype(np.float16)
    blocks[..., 0:2] = d[..., None].view(np.uint8)
    weight = q8_blocks(blocks.reshape(5, -1))
    assert weight.codes.dtype == torch.int8 and weight.codes.shape == (5, 576)
    assert np.array_equal(weight.codes.numpy().view(np.uint8), blocks[..., 2:].reshape(5, -1))
    assert np.array_equal(weight.d.numpy(), d)


def test_the_library_runs_on_torchs_own_openmp_runtime():
    """int4_linear.c's loops share torch's thread pool: one libgomp.so.1 in the process, not the
    system's beside torch's. (Wheels that vendor a renamed copy, libgomp-<hash>, keep theirs.)"""
    with open("/proc/self/maps") as maps:
        gomps = {line.split()[-1] for line in maps if "/libgomp.so" in line}
    assert len(gomps) <= 1, gomps


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_gguf_q4_blocks_keep_their_float16_d_and_m_bit_for_bit(kind):
    rng = np.random.default_rng(0)
    header = 2 if kind == "Q4_0" else 4
    blocks = rng.integers(0, 256, size=(5, 18, header + 16), dtype=np.uint8)
    d = (rng.standard_normal((5, 18)) * 0.01).astype(np.float16)
    m = (rng.standard_normal((5, 18)) * 0.05).astype(np.float16)
    blocks[..., 0:2] = d[..., None].view(np.uint8)
    if kind == "Q4_1":
        blocks[..., 2:4] = m[..., None].view(np.uint8)
    weight = q4_blocks_to_int4(blocks.reshape(5, -1), kind)
    packed = pack(weight.codes, weight.scales, weight.zeros, weight.group_size)
    assert np.array_equal(packed.codes.numpy(), blocks[..., header:].reshape(5, -1))  # the block's bytes
    assert np.array_equal(packed.dm[..., 0].numpy(), d)
    want_m = -8 * d.astype(np.float32) if kind == "Q4_0" else m
    assert np.array_equal(packed.dm[..., 1].numpy(), np.asarray(want_m, dtype=np.float16))
    # ... and the values are the ones torch's int4 weight stands for
    torch.testing.assert_close(_bf16_weights(packed).float(), weight.dequantize(), rtol=2.0 ** -8, atol=1e-6)


def test_weights_the_kernel_cannot_hold_stay_on_torchs_int4_kernel():
    weight = _weight(16, 64)
    assert "group size 64" in pack(weight.codes, weight.scales, weight.zeros, 64)
    huge = Int4Weight(weight.codes, weight.scales * 1e6, weight.zeros, weight.group_size)
    assert "float16" in pack(huge.codes, huge.scales, huge.zeros, huge.group_size)
    if kernels_available("cpu"):
        assert isinstance(quantized_linear(huge, torch.bfloat16, KERNEL), Int4Linear)
        assert isinstance(quantized_linear(weight, torch.float16, KERNEL), Int4Linear)  # float16 compute
        assert isinstance(quantized_linear(weight, torch.bfloat16, None), Int4Linear)


def test_float32_activations_come_back_float32():
    weight = _weight(32, 64)
    linear = quantized_linear(weight, torch.float32, KERNEL)
    x = torch.randn(3, 2, 64)
    y = linear(x)
    assert (y.dtype, y.shape) == (torch.float32, (3, 2, 32))
    want = x @ weight.dequantize().T
    assert (y - want).abs().max().item() < 0.05 * want.abs().max().item()


def test_bad_activations_are_refused():
    weight = pack(*_parts(_weight(16, 64)))
    with pytest.raises(ValueError, match=r"x must be \[rows, 64\] bfloat16"):
        KERNEL.linear(torch.zeros(2, 64), weight)
    with pytest.raises(ValueError, match=r"x must be \[rows, 64\] bfloat16"):
        KERNEL.linear(torch.zeros(2, 32, dtype=torch.bfloat16), weight)


def test_the_build_is_named_by_its_own_source_and_flags():
    cc = loader.compiler()
    text = loader.INT4_LINEAR.path.read_text()
    name = loader.library_name(text, cc, loader.INT4_LINEAR)
    assert name.startswith("int4_linear-") and name != loader.library_name(text, cc, loader.PAGED_DECODE)
    assert KERNEL.path.name == name


def _parts(weight: Int4Weight):
    return weight.codes, weight.scales, weight.zeros, weight.group_size
