"""CPU int4 linears: the C kernel (engine/cpu_kernels/int4_linear.c), with bfloat16 activations and
with int8 ones (--int4-activations int8), against torch's int4 kernel and oneDNN-packed dense
bfloat16, side by side in one run.

    .venv/bin/python benchmarks/int4_linear.py [--quick] [--no-results]

Two parts:

- linears: the decoder linears of the default model's LAYERS layers (q|k|v, o, gate|up, down;
  weights quantized at random, int4 in groups of 32), each layer its own tensors and called in
  turn as a decode step does, so the weights come from memory, not from a warm cache. ms for
  the 30 layers per batch size (rows of x) and torch thread count, median of --repeat.
- engine: an EngineCore of the default Q4_1 GGUF in bfloat16 on 2 threads, the median decode
  step at batch 1 and 8 (128-token prompts), with the C kernel (--quantization gguf), the same
  with int8 activations, torch's int4 kernel (--no-cpu-int4-kernel) and dense (--quantization none).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere

import torch  # noqa: E402

from benchmarks.common import median_decode_step_ms, report_tables  # noqa: E402

LAYERS = 30
SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))
"""(out, in) of SmolLM2-135M's fused q|k|v, o, fused gate|up and down."""


def median_ms(calls: dict[str, Callable[[], object]], repeat: int) -> list[float]:
    """Each call's median time in ms over `repeat` rounds, in the dict's order; the calls take
    turns within a round, and a first round warms them up."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for r in range(repeat + 1):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            if r:
                times[name].append((time.perf_counter() - start) * 1e3)
    return [statistics.median(times[name]) for name in calls]


def linear_rows(batches: list[int], threads: list[int], repeat: int, layers: int) -> list[list[object]]:
    from engine.cpu_kernels.int4_matmul import load_int4_kernel, pack
    from engine.model.packed_linear import PackedLinear
    from engine.model.quantized_linear import Int4Linear, KernelInt4Int8xLinear, KernelInt4Linear, quantize_int4

    kernel, reason = load_int4_kernel()
    if kernel is None or not (kernel.int8x_supported and kernel.bf16_supported):
        raise SystemExit(f"this table compares both C int4 paths; this CPU lacks one (AVX512-BF16 and AVX512-VNNI "
                         f"both needed): {reason or 'bfloat16 path ' + ('yes' if kernel.bf16_supported else 'no')}")
    gen = torch.Generator().manual_seed(0)
    modules: dict[str, list[torch.nn.Module]] = {"C kernel": [], "C int8 act": [], "torch int4": [], "dense bf16": []}
    for _ in range(layers):
        for out, cols in SHAPES:
            w = quantize_int4(torch.randn(out, cols, generator=gen) * 0.05)
            packed = pack(w.codes, w.scales, w.zeros, w.group_size)
            modules["C kernel"].append(KernelInt4Linear(packed, kernel))
            modules["C int8 act"].append(KernelInt4Int8xLinear(packed, kernel))
            modules["torch int4"].append(Int4Linear(w, torch.bfloat16))
            modules["dense bf16"].append(PackedLinear(kernel.dequantize(packed)))
    rows = []
    for n in threads:
        torch.set_num_threads(n)
        for batch in batches:
            xs = {cols: torch.randn(batch, cols, generator=gen).to(torch.bfloat16) for cols in (576, 1536)}
            c, i, t, d = median_ms({name: partial(_call_all, mods, xs) for name, mods in modules.items()}, repeat)
            rows.append([n, batch, f"{c:.2f}", f"{i:.2f}", f"{t:.2f}", f"{d:.2f}", f"{c / t:.2f}x", f"{c / d:.2f}x",
                         f"{c / i:.2f}x"])
    return rows


def _call_all(mods: list[torch.nn.Module], xs: dict[int, torch.Tensor]) -> None:
    for m in mods:
        m(xs[m.in_features])


HEAD = (49152, 576)
"""(out, in) of SmolLM2-135M's output projection: Q8_0 blocks in the default GGUF."""


def head_rows(batches: list[int], repeat: int) -> list[list[object]]:
    """The Q8_0 head on 2 threads: the C kernel with bfloat16 and with int8 activations, and
    oneDNN's packed bfloat16 matmul on the same values (what a bfloat16 worker uses past 8 rows)."""
    from engine.cpu_kernels.int4_matmul import load_int4_kernel
    from engine.model.packed_linear import PackedLinear
    from engine.model.quantized_linear import KernelQ8Int8xLinear, KernelQ8Linear, Q8BlockWeight

    kernel, _ = load_int4_kernel()
    gen = torch.Generator().manual_seed(1)
    out, cols = HEAD
    weight = Q8BlockWeight(torch.randint(-128, 128, (out, cols), generator=gen, dtype=torch.int8),
                           (torch.rand(out, cols // 32, generator=gen) * 0.01).half())
    heads = {"C q8 bf16": KernelQ8Linear(weight, kernel), "C q8 int8 act": KernelQ8Int8xLinear(weight, kernel),
             "packed bf16": PackedLinear(weight.dequantize().to(torch.bfloat16))}
    torch.set_num_threads(2)
    rows = []
    for batch in batches:
        x = torch.randn(batch, cols, generator=gen).to(torch.bfloat16)
        q, i, d = median_ms({name: partial(head, x) for name, head in heads.items()}, repeat)
        rows.append([batch, f"{q:.2f}", f"{i:.2f}", f"{d:.2f}", f"{q / i:.2f}x", f"{d / i:.2f}x"])
    return rows


def engine_rows(batches: list[int], new_tokens: int) -> list[list[object]]:
    from engine.config import EngineConfig
    from engine.engine import LLMEngine
    from engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    setups = {"C kernel": dict(quantization="gguf"), "C int8 act": dict(quantization="gguf", int4_activations="int8"),
              "torch int4": dict(quantization="gguf", cpu_int4_kernel=False), "dense bf16": dict(quantization="none")}
    medians: dict[int, dict[str, float]] = {b: {} for b in batches}
    for name, kwargs in setups.items():
        engine = LLMEngine(EngineConfig.from_kwargs(dtype="bfloat16", max_model_len=1024, num_threads=2,
                                                    kv_cache_memory=256 << 20, enable_prefix_caching=False, **kwargs))
        rng = random.Random(0)
        for batch in batches:
            prompts = [[rng.randrange(100, 40000) for _ in range(128)] for _ in range(batch)]
            medians[batch][name] = median_decode_step_ms(engine, prompts, params, f"{name}-{batch}")
    return [[b, f"{m['C kernel']:.1f}", f"{m['C int8 act']:.1f}", f"{m['torch int4']:.1f}", f"{m['dense bf16']:.1f}",
             f"{m['C kernel'] / m['torch int4']:.2f}x", f"{m['C kernel'] / m['dense bf16']:.2f}x",
             f"{m['C kernel'] / m['C int8 act']:.2f}x"] for b, m in medians.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tiny smoke run; nothing is appended to RESULTS.md")
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--no-results", action="store_true", help="do not append to benchmarks/RESULTS.md")
    args = parser.parse_args()
    if args.quick:
        batches, threads, repeat, layers, e_batches, new_tokens = [1, 20], [1], 1, 2, [2], 4
    else:
        batches, threads, repeat, layers = [1, 4, 8, 16, 32, 256], [1, 2], args.repeat, LAYERS
        e_batches, new_tokens = [1, 8], 40
    l_headers = ["threads", "rows of x", "C kernel ms", "C int8 act ms", "torch int4 ms", "dense bf16 ms",
                 "C / torch int4", "C / dense", "C / C int8 act"]
    l_rows = linear_rows(batches, threads, repeat, layers)
    e_headers = ["decode batch", "C kernel step ms", "C int8 act step ms", "torch int4 step ms", "dense bf16 step ms",
                 "C / torch int4", "C / dense", "C / C int8 act"]
    e_rows = engine_rows(e_batches, new_tokens)
    h_headers = ["head rows of x", "C q8 bf16 ms", "C q8 int8 act ms", "packed bf16 ms", "bf16 / int8 act",
                 "packed / int8 act"]
    h_rows = head_rows(batches, repeat)
    report_tables([(l_headers, l_rows), (e_headers, e_rows), (h_headers, h_rows)],
                  "int4_linear (C int4 kernel, bfloat16 and int8 activations, vs torch int4 vs dense bfloat16)", [
        f"- linears: the {len(SHAPES)} decoder linears of the default model's shape {list(SHAPES)} (out, in), "
        f"{layers} layers of them, each its own weights (random, int4 in groups of 32), called in turn so the weights "
        f"come from memory; bfloat16 activations; ms for all {layers} layers, median of {repeat} rounds",
        "- C kernel: engine.cpu_kernels.int4_matmul (up to 32 rows through the kernel, more: dequantize + dense "
        "matmul); C int8 act: the same weights with x quantized per group of 32 as llama.cpp does, integer dot "
        "products, every batch size in the kernel; torch int4: _weight_int4pack_mm_for_cpu; dense bf16: "
        "oneDNN-packed weights of the same values",
        f"- engine: EngineCore of the default Q4_1 GGUF in bfloat16, 2 threads (steps of <= 4 tokens too: the "
        f"default --decode-threads), prompts of 128 random tokens, {new_tokens} new tokens each, all added at once; "
        "median of the steps in which every request decodes",
        f"- head: the default model's {HEAD[0]} x {HEAD[1]} output projection as Q8_0 blocks (random), 2 threads, "
        f"the same rows of x as above; median of {repeat} rounds",
    ], write=not (args.quick or args.no_results))

if __name__ == "__main__":
    main()
