"""The int4 path (--quantization gguf on the default Q4_1 GGUF: its blocks kept as int4 linears)
against llama.cpp on the same file: the 30 prompts of tests/real_model.py, 48 greedy tokens each,
with bfloat16 activations and with int8 ones (--int4-activations int8, llama.cpp's numerics, and what
the default auto takes where the CPU has the path).

The reference is tests/fixtures/llamacpp_greedy_smollm2.json (make_llamacpp_greedy.py records it
with llama-server). Neither side is exact: llama.cpp quantizes activations to 8 bits for its
Q4_1 dot products; pdserve's C int4 kernel multiplies bfloat16 activations by each weight
q * d + m rounded to bfloat16 (the values of the dense bfloat16 load), or with int8 activations
quantizes them as llama.cpp does (from bfloat16 rather than float32 values, and with its own
attention, norms and summation order around them); torch's int4 kernel keeps weights in float32
from bfloat16 scales. So greedy paths part after a near-tie and stay apart.
Agreement is counted as the common prefix of each prompt's tokens.
Asserted: the first token equals llama.cpp's top-1 on every prompt where llama.cpp's top-1 is
clear of its second (NEAR_TIE), and is one of its top two on the near-ties; the count on all 30 is
reported. And the prefix agreement stays above the floor measured when this test was written
(MEASURED_FLOOR).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.cpu_kernels.int4_matmul import load_int4_kernel
from engine.model.quantized_linear import KernelInt4Int8xLinear, KernelQ8Int8xLinear, KernelQ8Linear

pytestmark = pytest.mark.slow

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "llamacpp_greedy_smollm2.json"
MEASURED_FLOOR = 0.35
"""Measured 2026-11-24: 612/1440 = 42.5% common prefix (641/1440 same position, 4/30 identical
answers, first token 30/30); 2026-11-25, decode attention in the C kernel: 582/1440 = 40.4%
(618 same position, 3/30 identical; the torch attention path gave 564 = 39.2% that day). The
floor leaves room for bfloat16 kernels that round differently. 2026-11-25, the C int4 kernel:
576/1440 = 40.0% (643 same position, 3/30 identical), first token llama.cpp's top-1 on 28/30.
2026-11-27, the Q8_0 head on its blocks in the C kernel (the dense head's values, summed in
another order): 641/1440 = 44.5% (704 same position, 3/30 identical), first token 28/30; the
dense head the day before: 46.0%, 29/30. 2026-11-27, int8 activations (--int4-activations int8:
llama.cpp's own Q8 activation blocks, the Q8_0 head as Q8_0 x Q8_0): 603/1440 = 41.9% (659 same
position, 5/30 identical), first token 28/30; with the head still in bfloat16 it measured 52.2%
(7/30 identical), though its first-token log-probabilities were further from llama.cpp's (mean
|difference| over the two recorded top tokens: 0.062 all int8, 0.065 head in bfloat16, 0.068
bfloat16 activations). Greedy prefixes part at the first near-tie either way. 2026-12-07 (an
Intel Xeon with VNNI, where int8 activations became the default): int8 676/1440 = 46.9% (7/30
identical), bfloat16 655/1440 = 45.5% (4/30), first token 29/30 both."""
NEAR_TIE = 1.1
"""A prompt whose llama.cpp top-1 probability is below 1.1x its second (a logit gap under 0.1).
Of the 30: prompt 4 (0.025 vs 0.024), 8 (0.020 vs 0.020) and 11 (0.127 vs 0.119). On 4 and 8 the
dense bfloat16 path and the C int4 kernel (the same bfloat16 weights) take llama.cpp's second
token, torch's int4 kernel its first: rounding decides a tie, not the model."""


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@pytest.fixture(scope="module")
def reference() -> dict:
    return json.loads(FIXTURE.read_text())


def _greedy_tokens(llm: LLM, prompts: list[list[int]], n: int) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    return [list(out.token_ids) for out in llm.generate(prompts, params)]


@pytest.mark.parametrize("activations", ["bfloat16", "int8"])
def test_int4_first_token_is_llamacpps_top1_and_greedy_tokens_agree(activations, reference, record_property, capsys):
    kernel = load_int4_kernel()[0]
    if activations == "int8" and (kernel is None or not kernel.int8x_supported):
        pytest.skip("int8 activations need the C int4 kernel (AVX512-VNNI, or AVX2 with FMA and F16C)")
    kernel_runs = kernel is not None and (kernel.int8x_supported if activations == "int8" else kernel.bf16_supported)
    llm = LLM(dtype="bfloat16", quantization="gguf", max_model_len=1024, num_threads=2, int4_activations=activations)
    assert llm.engine.core.quantization == "gguf"  # Q4_1 blocks kept as int4
    assert llm.engine.core.head == ("q8_0" if kernel_runs else "dense")  # counted in the weights' bytes
    model = llm.engine.runner.model
    if activations == "int8":  # the Q8_0 head as llama.cpp multiplies it: Q8_0 x Q8_0, every batch size
        assert isinstance(model.lm_head, KernelQ8Int8xLinear)
        assert all(isinstance(layer.mlp.down_proj, KernelInt4Int8xLinear) for layer in model.model.layers)
    elif kernel_runs:  # the C kernel computes the Q8_0 head on its blocks
        assert isinstance(model.lm_head, KernelQ8Linear)
        # the tied embedding holds the head's blocks as q * d rounded to bfloat16: batches of more
        # than Q8_KERNEL_ROWS rows (this test's 30) multiply by the same values, packed for oneDNN
        head = model.lm_head
        blocks = (head.codes.float() * head.d.float().repeat_interleave(32, dim=1)).to(torch.bfloat16)
        assert torch.equal(blocks, model.model.embed_tokens.weight)
        assert head._dense is model.model.embed_tokens.weight
    prompts = [p["prompt_ids"] for p in reference["prompts"]]
    ours = _greedy_tokens(llm, prompts, 48)
    theirs = [p["token_ids"] for p in reference["prompts"]]
    first_top1 = [p["first_token_top"][0]["id"] for p in reference["prompts"]]
    prefix = sum(_common_prefix(a, b) for a, b in zip(ours, theirs))
    same_position = sum(x == y for a, b in zip(ours, theirs) for x, y in zip(a, b))
    total = 48 * len(prompts)
    report = (f"int4 ({activations} activations) vs llama.cpp ({reference['model_file']}): first token = llama.cpp top-1 on "
              f"{sum(o[0] == t for o, t in zip(ours, first_top1))}/{len(prompts)} prompts; common prefix "
              f"{prefix}/{total} tokens ({prefix / total:.1%}); same token at the same position "
              f"{same_position}/{total} ({same_position / total:.1%}); identical answers "
              f"{sum(a == b for a, b in zip(ours, theirs))}/{len(prompts)}")
    record_property("int4_vs_llamacpp", report)
    with capsys.disabled():
        print("\n" + report)
    for i, (out, p) in enumerate(zip(ours, reference["prompts"])):
        top = p["first_token_top"]
        if top[0]["prob"] >= NEAR_TIE * top[1]["prob"]:
            assert out[0] == top[0]["id"], f"prompt {i}: {out[0]}, llama.cpp's clear top-1 is {top[0]}"
        else:
            assert out[0] in (top[0]["id"], top[1]["id"]), f"prompt {i}: {out[0]} not in llama.cpp's {top[:2]}"
    assert prefix / total >= MEASURED_FLOOR
