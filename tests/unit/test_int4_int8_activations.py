"""The C int4 kernel's int8-activation path (--int4-activations int8, int4_linear.c's "int8
activations"): x quantized per group of 32 as llama.cpp quantizes activations for its Q4 dot
products, checked against a float32 emulation of that formula written here; the repacked layout;
the module, the decode plan and the flag around it."""

from __future__ import annotations

import logging

import pytest
import torch

from engine import SamplingParams
from engine.config import EngineConfig
from engine.cpu_kernels.int4_matmul import GROUP, INT8X_LANES, PackedInt4, load_int4_kernel, pack, pack_int8x, \
    pack_q8_int8x, sums_in_half
from engine.model.decode_plan import DecodePlan
from engine.model.quantized_linear import (
    Int4Linear, KernelInt4Int8xLinear, KernelInt4Linear, KernelQ8Int8xLinear, Q8BlockWeight, quantize_int4, quantized_linear,
)
from tests.tiny_model import tiny_llm, write_tiny_model

KERNEL, WHY = load_int4_kernel()
pytestmark = pytest.mark.skipif(KERNEL is None or not KERNEL.int8x_supported,
                                reason=f"no int8-activation kernel here (AVX512-VNNI or AVX2 with FMA and F16C): {WHY or 'not on this CPU'}")


def _packed(rows: int, cols: int, seed: int = 0, q4_0: bool = False) -> PackedInt4:
    weight = quantize_int4(torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * 0.05)
    packed = pack(weight.codes, weight.scales, weight.zeros, weight.group_size)
    if q4_0:  # m = -8 d everywhere, as a Q4_0 block maps
        d = packed.dm[..., 0]
        packed = PackedInt4(packed.codes, torch.stack((d, (d.float() * -8).half()), -1).contiguous())
    return packed


def _codes(packed: PackedInt4) -> torch.Tensor:
    rows, cols = packed.shape
    nibbles = packed.codes.reshape(rows, cols // GROUP, GROUP // 2)
    return torch.cat((nibbles & 15, nibbles >> 4), -1)  # [rows, groups, 32] in weight order


def _quantize_x(x: torch.Tensor, sum_half: bool):
    """llama.cpp's activation blocks: q = round-half-even(x * (127 / amax)) (a true division),
    d = amax / 127 as float16, s = d * sum(q) (Q8_1: amax / 127 times the sum, as float16)."""
    rows, cols = x.shape
    xf = x.float().reshape(rows, cols // GROUP, GROUP)
    amax = xf.abs().amax(-1)
    inverse = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = torch.round(xf * inverse[..., None])
    total = q.sum(-1)
    d = (amax / 127).half().float()
    s = (amax / 127 * total).half().float() if sum_half else d * total
    return q, d, s


def _fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """a * b + c rounded once to float32, as an FMA does (float32 products are exact in float64)."""
    return (a.double() * b.double() + c.double()).float()


def _emulated(x: torch.Tensor, packed: PackedInt4, sum_half: bool) -> torch.Tensor:
    """Group by group in float32 FMAs: acc += sum(q_w * q) * (d_w * d); acc += m_w * s; then bfloat16."""
    q, d, s = _quantize_x(x, sum_half)
    dots = torch.einsum("ngk,mgk->mng", _codes(packed).double(), q.double()).float()  # exact integers
    dm = packed.dm.float()
    acc = torch.zeros(x.shape[0], packed.shape[0])
    for g in range(dm.shape[1]):
        acc = _fma(dots[:, :, g], dm[None, :, g, 0] * d[:, None, g], acc)
        acc = _fma(dm[None, :, g, 1], s[:, None, g], acc)
    return acc.to(torch.bfloat16)


@pytest.mark.parametrize("sum_half", [False, True])
@pytest.mark.parametrize("rows, out, cols", [(1, 16, 32), (1, 960, 576), (3, 70, 96), (8, 576, 1536),
                                             (9, 33, 64), (33, 48, 160), (130, 32, 576)])
def test_every_batch_size_is_llamacpps_formula_computed_in_float32(rows, out, cols, sum_half):
    packed = _packed(out, cols, seed=rows)
    x = (torch.randn(rows, cols, generator=torch.Generator().manual_seed(out)) * 2).to(torch.bfloat16)
    x[0, :GROUP] = 0  # a group of zeros: d = 0, q = 0
    got = KERNEL.linear_int8x(x, pack_int8x(packed), out, sum_half)
    assert got.shape == (rows, out) and got.dtype == torch.bfloat16
    assert torch.equal(got, _emulated(x, packed, sum_half))


def test_activations_round_half_to_even_after_a_true_division_by_amax():
    # one-hot weights (d = 1, m = 0) read back d * q of each activation
    cols = 576
    eye = torch.eye(cols, dtype=torch.uint8)
    packed = PackedInt4(pack(eye, torch.ones(cols, cols // GROUP), torch.full((cols, cols // GROUP), 8.0), GROUP).codes,
                        torch.stack((torch.ones(cols, cols // GROUP), torch.zeros(cols, cols // GROUP)), -1).half())
    x = torch.randn(4, cols, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    x[1, :GROUP] = torch.linspace(-2.5, 2.5, GROUP).to(torch.bfloat16)  # amax 2.5: x = amax/2 lands on .5
    x[1, 5] = 1.25
    q, d, _ = _quantize_x(x, False)
    got = KERNEL.linear_int8x(x, pack_int8x(packed), cols, False)
    assert torch.equal(got, (q * d[..., None]).reshape(4, cols).to(torch.bfloat16))
    assert q[1, 0, 5] == 64  # 1.25 * (127 / 2.5) = 63.5 -> 64, half to even


def test_the_repacked_layout_holds_the_same_codes_d_and_m():
    packed = _packed(40, 96)  # 40 rows: 2 whole blocks of 16 and one of 8 padded with zeros
    blocks = pack_int8x(packed)
    groups = 96 // GROUP
    assert blocks.shape == (3, groups, 320) and blocks.dtype == torch.uint8
    nibbles = blocks[..., :256].reshape(3, groups, 4, INT8X_LANES, 4)  # [block, group, c, row, t]
    low = (nibbles & 15).permute(0, 3, 1, 2, 4).reshape(48, groups, 16)
    high = (nibbles >> 4).permute(0, 3, 1, 2, 4).reshape(48, groups, 16)
    assert torch.equal(torch.cat((low, high), -1)[:40], _codes(packed))
    assert not torch.cat((low, high), -1)[40:].any()
    scales = blocks[..., 256:].contiguous().view(torch.float16).reshape(3, groups, 2, INT8X_LANES)
    assert torch.equal(scales.permute(0, 3, 1, 2).reshape(48, groups, 2)[:40], packed.dm)


def test_q4_0_weights_keep_the_exact_sum_and_q4_1_round_it_as_llamacpps_q8_1_block():
    assert not sums_in_half(_packed(16, 64, q4_0=True))
    assert sums_in_half(_packed(16, 64))


def test_the_module_and_its_bound_call_agree_and_int8_is_asked_for_explicitly():
    weight = quantize_int4(torch.randn(48, 64, generator=torch.Generator().manual_seed(1)) * 0.05)
    without_int8 = quantized_linear(weight, torch.bfloat16, KERNEL)
    assert isinstance(without_int8, KernelInt4Linear if KERNEL.bf16_supported else Int4Linear)  # AVX2: torch's
    linear = quantized_linear(weight, torch.bfloat16, KERNEL, int8_activations=True)
    assert isinstance(linear, KernelInt4Int8xLinear)
    x = torch.randn(2, 3, 64)  # float32, three dimensions: restored as the input came
    y = linear(x)
    assert y.shape == (2, 3, 48) and y.dtype == torch.float32
    rows = x.reshape(6, 64).to(torch.bfloat16)
    out = torch.empty(6, 48, dtype=torch.bfloat16)
    fn, args = linear.bound_call(rows, out, 6)
    assert fn(*args) == 0
    assert torch.equal(out.float(), y.reshape(6, 48))
    assert torch.equal(out, KERNEL.linear_int8x(rows, linear.blocks, 48, linear.sum_half))


def test_two_threads_give_the_same_bits_as_one():
    packed, x = _packed(512, 576), torch.randn(5, 576).to(torch.bfloat16)
    blocks = pack_int8x(packed)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = KERNEL.linear_int8x(x, blocks, 512, True)
        torch.set_num_threads(2)
        two = KERNEL.linear_int8x(x, blocks, 512, True)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_the_setting_is_checked():
    with pytest.raises(ValueError, match="int4_activations"):
        EngineConfig(int4_activations="int4")
    assert EngineConfig().int4_activations == "auto"


@pytest.mark.parametrize("bf16, int8x, wanted, path", [
    (True, True, "auto", "int8"), (True, False, "auto", "bfloat16"), (False, True, "auto", "int8"),
    (False, False, "auto", None), (True, True, "bfloat16", "bfloat16"), (False, True, "bfloat16", None),
    (True, True, "int8", "int8"), (True, False, "int8", "refused")])
def test_auto_activations_take_int8_where_the_kernel_has_that_path(bf16, int8x, wanted, path):
    """What a worker's kernel does with each setting, by the paths this host's kernel has: auto
    is int8 where it can be, else bfloat16; int8 asked for where it cannot be refuses to start."""
    from types import SimpleNamespace

    from engine.loader.model_loader import _int8_activations, _kernel_for

    kernel = SimpleNamespace(bf16_supported=bf16, int8x_supported=int8x, int8x_build="avx512-vnni" if int8x else "")
    if path == "refused":
        with pytest.raises(ValueError, match="--int4-activations int8 needs AVX512-VNNI or AVX2"):
            _kernel_for(kernel, wanted)
        return
    chosen, int8_path = _kernel_for(kernel, wanted)
    assert (chosen is kernel) == (path is not None)
    if chosen is not None:
        int8 = _int8_activations(int8_path, wanted, chosen, torch.bfloat16, "gguf")
        assert ("int8" if int8 else "bfloat16") == path


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def test_a_model_with_int8_activations_decodes_through_the_plan_with_the_modules_tokens(folder):
    llm = tiny_llm(folder, dtype="bfloat16", quantization="int4", int4_activations="int8")
    runner = llm.engine.core.runner
    assert {type(m) for m in runner.model.modules() if "Kernel" in type(m).__name__} == {KernelInt4Int8xLinear}
    plan = runner.decode_plan
    assert isinstance(plan, DecodePlan)
    prompts = [[i + 1, i + 2, i + 3][: 1 + i % 3] + list(range(100, 100 + 7 * i)) for i in range(12)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for batch in (prompts[:1], prompts[:5], prompts):
        runner.decode_plan = plan
        with_plan = [o.token_ids for o in llm.generate(batch, params)]
        runner.decode_plan = None
        modules = [o.token_ids for o in llm.generate(batch, params)]
        assert with_plan == modules
    runner.decode_plan = plan
    assert llm.engine.core.kv.num_free_blocks == llm.engine.core.capacity.num_blocks


def test_int8_activations_on_a_dense_model_are_ignored_with_a_warning(folder, caplog):
    with caplog.at_level(logging.WARNING, logger="engine.loader.model_loader"):
        llm = tiny_llm(folder, dtype="bfloat16", quantization="none", int4_activations="int8")
    assert not any(isinstance(m, KernelInt4Int8xLinear) for m in llm.engine.core.runner.model.modules())
    assert "int4 activations int8: ignored" in caplog.text


def _q8(rows: int, cols: int, seed: int = 0) -> Q8BlockWeight:
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(-128, 128, (rows, cols), generator=gen, dtype=torch.int8)
    d = (torch.rand(rows, cols // GROUP, generator=gen) * 0.01 + 1e-4).half()
    return Q8BlockWeight(codes, d)


@pytest.mark.parametrize("rows, out, cols", [(1, 16, 32), (1, 100, 576), (3, 24, 64), (8, 48, 96), (9, 33, 64),
                                             (70, 40, 160)])
def test_q8_0_weights_are_llamacpps_q8_0_times_q8_0_computed_in_float32(rows, out, cols):
    weight = _q8(out, cols, seed=rows)
    x = (torch.randn(rows, cols, generator=torch.Generator().manual_seed(out)) * 2).to(torch.bfloat16)
    x[-1, -GROUP:] = 0
    q, d, _ = _quantize_x(x, False)
    dots = torch.einsum("ngk,mgk->mng", weight.codes.reshape(out, cols // GROUP, GROUP).double(), q.double()).float()
    dw = weight.d.float()
    want = torch.zeros(rows, out)
    for g in range(cols // GROUP):  # the integer sum exact, then one FMA a group
        want = _fma(dots[:, :, g], dw[None, :, g] * d[:, None, g], want)
    got = KERNEL.q8_linear_int8x(x, pack_q8_int8x(weight.codes, weight.d), out)
    assert torch.equal(got, want.to(torch.bfloat16))
    module = quantized_linear(weight, torch.bfloat16, KERNEL, int8_activations=True)
    assert isinstance(module, KernelQ8Int8xLinear)
    assert torch.equal(module(x), got)


def test_asking_for_int8_activations_on_a_cpu_without_vnni_refuses_to_start(folder, monkeypatch):
    from engine.loader import model_loader

    without_vnni = load_int4_kernel()[0]
    without_vnni.int8x_supported = False
    monkeypatch.setattr(model_loader, "_int4_kernel", lambda: without_vnni)
    with pytest.raises(ValueError, match="--int4-activations int8 needs AVX512-VNNI or AVX2"):
        tiny_llm(folder, dtype="bfloat16", quantization="int4", int4_activations="int8")
