"""engine.model.decode_plan: a step of decodes as bound C calls gives the module path's hidden
states bit for bit, takes only the steps it may, and says why a model keeps the modules."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import SamplingParams
from engine.cpu_kernels.int4_matmul import load_int4_kernel
from engine.model.decode_plan import MAX_ROWS, DecodePlan
from tests.tiny_model import tiny_llm, write_tiny_model

_KERNEL, _WHY = load_int4_kernel()
pytestmark = pytest.mark.skipif(_KERNEL is None or not _KERNEL.bf16_supported,
                                reason="no C bfloat16 int4 kernel here (needs AVX512-BF16): no bfloat16 plan to test "
                                       "(int8 activations' plan: tests/unit/test_int4_int8_activations.py)")


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def _int4(folder: Path, **args):
    return tiny_llm(folder, dtype="bfloat16", quantization="int4", **args)


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


class _StepSpy:
    """Records each forward pass's arguments and which path ran it."""

    def __init__(self, runner) -> None:
        self.steps: list[tuple[str, tuple]] = []
        model_call, plan_call = runner.model.forward, runner.decode_plan.forward
        runner.model.forward = lambda *a: (self.steps.append(("modules", a)), model_call(*a))[1]
        runner.decode_plan.forward = lambda *a: (self.steps.append(("plan", a)), plan_call(*a))[1]


def test_decode_steps_run_through_the_plan_and_give_the_module_path_hidden_states_bit_for_bit(folder):
    llm = _int4(folder)
    runner = llm.engine.core.runner
    plan = runner.decode_plan
    assert isinstance(plan, DecodePlan)
    spy = _StepSpy(runner)
    prompts = [[5, 6, 7, 8], [9, 10], list(range(20, 57))]  # contexts of 3 lengths in one step
    llm.generate(prompts, _greedy(5))
    kinds = [kind for kind, _ in spy.steps]
    assert kinds[0] == "modules" and set(kinds[1:]) == {"plan"}, kinds  # the prefill, then 4 decode steps
    _, (input_ids, cos, sin, kv_caches, meta, _layer_done) = spy.steps[-1]
    assert input_ids.shape == (3,)
    with torch.inference_mode():  # both store the step's K/V into the same slots: a rerun is idempotent
        want = runner.model(input_ids, cos, sin, kv_caches, meta)
        done: list[int] = []
        got = plan.forward(input_ids, cos, sin, kv_caches, meta, done.append)
    assert torch.equal(got, want)
    assert done == list(range(len(kv_caches)))  # the runner's per-layer callback, after each layer


def test_the_plan_and_the_modules_generate_the_same_tokens_for_batches_of_every_size(folder):
    llm = _int4(folder)
    runner = llm.engine.core.runner
    plan = runner.decode_plan
    prompts = [[i + 1, i + 2, i + 3][: 1 + i % 3] + list(range(100, 100 + 7 * i)) for i in range(12)]
    for batch in (prompts[:1], prompts[:5], prompts):  # the int4 kernel's 1-8 rows and its 9-32
        runner.decode_plan = plan
        with_plan = [o.token_ids for o in llm.generate(batch, _greedy(8))]
        runner.decode_plan = None
        modules = [o.token_ids for o in llm.generate(batch, _greedy(8))]
        assert with_plan == modules
    runner.decode_plan = plan
    assert llm.engine.core.kv.num_free_blocks == llm.engine.core.capacity.num_blocks


def test_the_plan_takes_decode_steps_of_at_most_max_rows_tokens(folder):
    llm = _int4(folder)
    runner = llm.engine.core.runner
    spy = _StepSpy(runner)
    llm.generate([[3 + i, 4, 5] for i in range(MAX_ROWS + 2)], _greedy(3))
    decode_steps = [(kind, args[0].shape[0]) for kind, args in spy.steps if args[4].rope_decode is not None]
    assert decode_steps and all((kind == "plan") == (rows <= MAX_ROWS) for kind, rows in decode_steps), decode_steps
    assert ("modules", MAX_ROWS + 2) in decode_steps


@pytest.mark.parametrize("args, reason", [
    (dict(dtype="bfloat16", quantization="none"), "self_attn.qkv_proj is"),
    (dict(dtype="bfloat16", quantization="int4", cpu_int4_kernel=False), "not the C int4 kernel's"),
    (dict(dtype="bfloat16", quantization="int4", cpu_attention_kernel=False), "no C decode attention kernel"),
    (dict(dtype="float32", quantization="int4"), "weights in torch.float32"),
])
def test_a_model_the_plan_does_not_fit_keeps_the_modules_and_says_why(folder, args, reason):
    runner = tiny_llm(folder, **args).engine.core.runner
    assert runner.decode_plan is None
    plan, why = DecodePlan.build(runner.model, runner.decode_kernel)
    assert plan is None and reason in why, why
