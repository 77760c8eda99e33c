"""Decode and prefill throughput of our engine vs HF transformers, same GGUF weights and dtype.

    .venv/bin/python benchmarks/engine_throughput.py [--dtype float32] [--batch-sizes 1,8,32] ...

Method (printed with the results too):

- decode, batch B: B random prompts of --prompt-len-decode tokens (fixed seed, ids in the
  vocab, equal lengths so HF needs no padding), greedy, eos ignored, --decode-tokens new
  tokens each. The decode phase starts when every request has its first token (that token
  comes from the prefill) and ends when the last token is out, so it holds N - 1 forward
  passes: tok/s = B * (N - 1) / decode seconds.
  ours: add_request + step(); the clock starts at the end of the step after which every
        request has a token.
  HF:   model.generate(input_ids [B, L], max_new_tokens=N, do_sample=False); a logits
        processor stamps each call (the first comes right after the prefill forward).
  Both also give per-step times; a second table uses the median decode step, which a
  burst of load from other processes moves much less than the whole phase.
- prefill: --prefill-prompts random prompts of --prompt-len tokens, submitted together as
  one batch, one new token each. ours: one engine step (max_num_batched_tokens is raised
  to fit them all); HF: generate(input_ids [P, L], max_new_tokens=1).
  tok/s = P * L / seconds of the whole call.

Every configuration is warmed up once (ours and HF) before it is timed. Each timed run
uses fresh prompts, so our prefix cache never serves a prompt it has seen; ours and HF
get the same prompts in the same run. Repeats alternate ours and HF; the table shows the
median of --repeat runs.
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere

import torch  # noqa: E402

from benchmarks.common import append_results, markdown_table, run_header, text_table  # noqa: E402

Kind = Literal["decode", "prefill"]

GOALS = {1: 1.0, 32: 1.5}
"""batch size -> minimum decode ratio ours/HF."""

_request_ids = itertools.count()


@dataclass(frozen=True)
class Timed:
    seconds: float
    """The timed phase: the decode phase, or the whole call for prefill."""
    token_ids: list[list[int]]
    """Per prompt, the generated tokens."""
    step_seconds: list[float]
    """Decode only: the duration of each of the N - 1 decode steps (one forward each)."""


@dataclass(frozen=True)
class Config:
    name: str
    kind: Kind
    num_prompts: int
    prompt_len: int
    new_tokens: int

    @property
    def tokens_per_run(self) -> int:
        """Tokens a run's timed phase processes (the numerator of tok/s)."""
        if self.kind == "prefill":
            return self.num_prompts * self.prompt_len
        return self.num_prompts * (self.new_tokens - 1)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--quantization", choices=("none", "auto", "gguf", "int8", "int4"), default="none",
                   help="ours: --quantization (none keeps the token-exact comparison with HF; gguf keeps the "
                        "GGUF's Q4_1 blocks as int4 in bfloat16)")
    p.add_argument("--batch-sizes", default="1,8,32", help="decode batch sizes, comma separated")
    p.add_argument("--decode-tokens", type=int, default=64, help="new tokens per decode request")
    p.add_argument("--prompt-len-decode", type=int, default=32, help="prompt tokens of decode runs")
    p.add_argument("--prompt-len", type=int, default=512, help="prompt tokens of prefill runs")
    p.add_argument("--prefill-prompts", type=int, default=4, help="prompts in the prefill batch")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                   help="torch intra-op threads for both engines (default: all usable cores)")
    p.add_argument("--repeat", type=int, default=3, help="timed runs per config (median shown)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument("--no-results", action="store_true", help="do not append to benchmarks/RESULTS.md")
    args = p.parse_args(argv)
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b.strip()]
    if args.decode_tokens < 2:
        p.error("--decode-tokens must be at least 2 (the first token belongs to the prefill)")
    if min(args.batch_sizes + [args.prefill_prompts, args.repeat, args.threads]) < 1:
        p.error("batch sizes, --prefill-prompts, --repeat and --threads must be positive")
    return args


def make_configs(args: argparse.Namespace) -> list[Config]:
    configs = [
        Config(f"decode bs={b}", "decode", b, args.prompt_len_decode, args.decode_tokens)
        for b in args.batch_sizes
    ]
    configs.append(Config(
        f"prefill {args.prefill_prompts}x{args.prompt_len} (batched)",
        "prefill", args.prefill_prompts, args.prompt_len, 1,
    ))
    return configs


def random_prompts(seed: int, count: int, length: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(count)]


# ---------------------------------------------------------------------- ours
def load_ours(args: argparse.Namespace):
    from engine import LLM

    max_model_len = max(args.prompt_len + 1, args.prompt_len_decode + args.decode_tokens)
    max_model_len = -(-max_model_len // 16) * 16
    batch_tokens = max(
        2048, args.prefill_prompts * args.prompt_len, max(args.batch_sizes) * args.prompt_len_decode
    )
    return LLM(
        dtype=args.dtype,
        quantization=args.quantization,
        max_model_len=max_model_len,
        max_num_seqs=max(args.batch_sizes + [args.prefill_prompts]),
        max_num_batched_tokens=batch_tokens,
        num_threads=args.threads,
    )


def run_ours(llm, prompts: list[list[int]], new_tokens: int, kind: Kind) -> Timed:
    """Run the prompts to completion; time the decode phase or the whole call (prefill)."""
    from engine import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    ids = [f"bench-{next(_request_ids)}" for _ in prompts]
    tokens: dict[str, tuple[int, ...]] = {}
    start = time.perf_counter()
    for request_id, prompt in zip(ids, prompts, strict=True):
        engine.add_request(request_id, prompt, params)
    stamps: list[float] = []  # end of the step that completed the first tokens, then each step
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] = out.token_ids
        if stamps or (len(tokens) == len(ids) and all(tokens.values())):
            stamps.append(time.perf_counter())
    assert stamps, "the engine finished without producing every first token"
    seconds = stamps[-1] - (start if kind == "prefill" else stamps[0])
    steps = [b - a for a, b in zip(stamps, stamps[1:])]
    return Timed(seconds, [list(tokens[i]) for i in ids], steps if kind == "decode" else [])


# ------------------------------------------------------------------------ HF
def load_hf(dtype: str):
    from transformers import AutoModelForCausalLM

    from engine.loader.locate import default_model_path

    path = default_model_path()
    return AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=getattr(torch, dtype)
    ).eval()


class _StepClock:
    """A no-op logits processor that stamps each call: generate() calls it once per new
    token, right after that token's forward pass (the first call follows the prefill)."""

    def __init__(self) -> None:
        self.calls: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.calls.append(time.perf_counter())
        return scores


def run_hf(model, prompts: list[list[int]], new_tokens: int, kind: Kind) -> Timed:
    from transformers import LogitsProcessorList

    input_ids = torch.tensor(prompts, dtype=torch.int64)  # equal lengths: no padding, no mask
    clock = _StepClock()
    with torch.inference_mode():
        start = time.perf_counter()
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=new_tokens,
            do_sample=False,
            # eos off (not min_new_tokens, which masks the eos logit and so changes the
            # argmax wherever eos wins; ours with ignore_eos keeps it).
            eos_token_id=None,
            pad_token_id=0,
            logits_processor=LogitsProcessorList([clock]),
        )
        end = time.perf_counter()
    generated = out[:, input_ids.shape[1]:].tolist()
    assert all(len(g) == new_tokens for g in generated), "HF stopped early"
    assert len(clock.calls) == new_tokens, f"logits processor called {len(clock.calls)} times"
    if kind == "prefill":
        return Timed(end - start, generated, [])
    steps = [b - a for a, b in zip(clock.calls, clock.calls[1:])]
    return Timed(end - clock.calls[0], generated, steps)


# ------------------------------------------------------------------- driving
@dataclass
class Measured:
    config: Config
    ours: list[float]  # tok/s per repeat
    hf: list[float]
    ours_steps: list[float]  # decode step seconds, all repeats pooled
    hf_steps: list[float]
    mismatches: int  # prompts whose greedy tokens differ between ours and HF
    first_mismatch: str | None

    @property
    def ours_median(self) -> float:
        return statistics.median(self.ours)

    @property
    def hf_median(self) -> float:
        return statistics.median(self.hf)

    @property
    def ratio(self) -> float:
        return self.ours_median / self.hf_median

    @property
    def step_ratio(self) -> float:
        """ours/HF throughput from the median decode step time (robust to load bursts)."""
        return statistics.median(self.hf_steps) / statistics.median(self.ours_steps)


def describe_mismatch(ours: list[int], hf: list[int]) -> str:
    at = next(i for i, (a, b) in enumerate(zip(ours, hf)) if a != b)
    return f"first differs at new token {at}: ours {ours[at:at + 4]} vs HF {hf[at:at + 4]}"


def measure(config: Config, llm, hf_model, args, vocab: int, config_index: int) -> Measured:
    def prompts(run: int) -> list[list[int]]:
        seed = args.seed * 1_000_003 + config_index * 1_009 + run
        return random_prompts(seed, config.num_prompts, config.prompt_len, vocab)

    warm = prompts(args.repeat)  # a set no timed run uses
    run_ours(llm, warm, config.new_tokens, config.kind)
    run_hf(hf_model, warm, config.new_tokens, config.kind)
    ours_rates, hf_rates, ours_steps, hf_steps, mismatches, first = [], [], [], [], 0, None
    for run in range(args.repeat):
        batch = prompts(run)
        ours = run_ours(llm, batch, config.new_tokens, config.kind)
        hf = run_hf(hf_model, batch, config.new_tokens, config.kind)
        ours_rates.append(config.tokens_per_run / ours.seconds)
        hf_rates.append(config.tokens_per_run / hf.seconds)
        ours_steps += ours.step_seconds
        hf_steps += hf.step_seconds
        for a, b in zip(ours.token_ids, hf.token_ids, strict=True):
            if a != b:
                mismatches += 1
                first = first or describe_mismatch(a, b)
        print(f"  {config.name} run {run + 1}/{args.repeat}: ours {ours_rates[-1]:.1f} tok/s "
              f"({ours.seconds:.3f}s), HF {hf_rates[-1]:.1f} tok/s ({hf.seconds:.3f}s)", flush=True)
    return Measured(config, ours_rates, hf_rates, ours_steps, hf_steps, mismatches, first)


TABLE_HEADERS = ["config", "ours tok/s", "HF tok/s", "ratio (ours/HF)"]
SPREAD_HEADERS = ["config", "ours per run", "HF per run", "ratio of best runs"]
STEP_HEADERS = ["config", "ours ms/step", "HF ms/step", "ours tok/s", "HF tok/s", "ratio (ours/HF)"]


def table_rows(results: list[Measured]) -> list[list[str]]:
    return [
        [m.config.name, f"{m.ours_median:.1f}", f"{m.hf_median:.1f}", f"{m.ratio:.2f}x"]
        for m in results
    ]


def spread_rows(results: list[Measured]) -> list[list[str]]:
    fmt = lambda xs: " / ".join(f"{x:.1f}" for x in xs)  # noqa: E731
    return [[m.config.name, fmt(m.ours), fmt(m.hf), f"{max(m.ours) / max(m.hf):.2f}x"] for m in results]


def step_rows(results: list[Measured]) -> list[list[str]]:
    rows = []
    for m in results:
        if m.config.kind != "decode":
            continue
        ours_s, hf_s = statistics.median(m.ours_steps), statistics.median(m.hf_steps)
        batch = m.config.num_prompts
        rows.append([
            m.config.name, f"{ours_s * 1e3:.1f}", f"{hf_s * 1e3:.1f}",
            f"{batch / ours_s:.1f}", f"{batch / hf_s:.1f}", f"{m.step_ratio:.2f}x",
        ])
    return rows


def goal_lines(results: list[Measured]) -> list[str]:
    by_batch = {m.config.num_prompts: m for m in results if m.config.kind == "decode"}
    lines = []
    for batch, goal in GOALS.items():
        m = by_batch.get(batch)
        if m is None:
            lines.append(f"goal decode bs={batch} >= {goal:.1f}x: not measured")
            continue
        # Load from other processes only ever slows a run down, and it can hit ours or HF's
        # run alone; a goal counts only when both estimates agree.
        phase_met, step_met = m.ratio >= goal, m.step_ratio >= goal
        verdict = (
            "MET" if phase_met and step_met
            else "NOT MET" if not (phase_met or step_met)
            else "UNCLEAR (the two estimates disagree: load noise; run again)"
        )
        lines.append(
            f"goal decode bs={batch} >= {goal:.1f}x: {verdict} "
            f"(decode-phase ratio {m.ratio:.2f}x, median-step ratio {m.step_ratio:.2f}x)"
        )
    return lines


def check_lines(results: list[Measured]) -> list[str]:
    lines = []
    for m in results:
        if m.config.kind != "decode":
            continue
        total = m.config.num_prompts * len(m.ours)
        if m.mismatches == 0:
            lines.append(f"{m.config.name}: greedy tokens equal HF's ({total}/{total} prompts)")
        else:
            note = " (batched HF numerics may differ)" if m.config.num_prompts > 1 else ""
            lines.append(f"{m.config.name}: greedy tokens DIFFER from HF's for {m.mismatches}/{total} "
                         f"prompts{note}; {m.first_mismatch}")
    return lines


def method_lines(args, hf_model) -> list[str]:
    attn = getattr(hf_model.config, "_attn_implementation", "?")
    # transformers can keep GGUF weights packed behind its own kernels; then HF is not dense.
    linear = type(hf_model.get_output_embeddings()).__name__
    mlp = type(hf_model.model.layers[0].mlp.down_proj).__name__
    return [
        f"dtype {args.dtype}, ours --quantization {args.quantization} (resolved: {args.resolved_quantization}; "
        f"RSS of this process after loading ours, before HF: {args.ours_rss_mib:.0f} MiB), "
        f"{args.threads} threads, median of {args.repeat} runs after 1 warm-up, "
        f"fresh random prompts (seed {args.seed}) per run.",
        f"decode: prompts of {args.prompt_len_decode} tokens, greedy, eos ignored, "
        f"{args.decode_tokens} new tokens; tok/s = batch * {args.decode_tokens - 1} / decode-phase "
        "seconds (from every request holding its first token to the last token; "
        "ours: step() timestamps; HF: generate() with a logits processor stamping each call, "
        "the first one right after the prefill forward).",
        "median step: the median over all timed runs of one decode step's duration "
        "(ours: between step() returns; HF: between logits-processor calls); "
        "it ignores load bursts that hit only some steps.",
        f"prefill: {args.prefill_prompts} prompts of {args.prompt_len} tokens as ONE batch, 1 new token; "
        "tok/s = prompt tokens / seconds of the whole call "
        "(ours: add_request + step() to completion; HF: generate(max_new_tokens=1)).",
        f"HF attention implementation: {attn}; HF layers: {mlp} (MLP), {linear} (lm_head). "
        "Load average (1/5/15 min) at the end: "
        + " / ".join(f"{x:.2f}" for x in os.getloadavg())
        + " (other jobs on this host make the numbers noisy).",
    ]


def report(results: list[Measured], args, hf_model) -> tuple[str, str]:
    """(terminal text, RESULTS.md body)."""
    notes = goal_lines(results) + check_lines(results)
    method = method_lines(args, hf_model)
    terminal = "\n\n".join([
        "\n".join(run_header()),
        text_table(TABLE_HEADERS, table_rows(results)),
        "per run tok/s:\n" + text_table(SPREAD_HEADERS, spread_rows(results)),
        "decode from the median step time:\n" + text_table(STEP_HEADERS, step_rows(results)),
        "\n".join(notes),
        "\n".join(method),
    ])
    markdown = "\n\n".join([
        markdown_table(TABLE_HEADERS, table_rows(results)),
        "Per run tok/s:\n\n" + markdown_table(SPREAD_HEADERS, spread_rows(results)),
        "Decode from the median step time:\n\n" + markdown_table(STEP_HEADERS, step_rows(results)),
        "\n".join(f"- {line}" for line in notes),
        "Method:\n\n" + "\n".join(f"- {line}" for line in method),
    ])
    return terminal, markdown


def rss_mib() -> float:
    """This process's resident memory now (VmRSS), MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    print(f"loading ours ({args.dtype}) ...", flush=True)
    llm = load_ours(args)
    args.resolved_quantization = llm.engine.core.quantization
    args.ours_rss_mib = rss_mib()
    print("loading HF transformers ...", flush=True)
    hf_model = load_hf(args.dtype)
    torch.set_num_threads(args.threads)  # the engine set it too; HF runs in this process
    vocab = llm.engine.spec.vocab_size
    assert hf_model.config.vocab_size == vocab, (
        f"vocab sizes differ: ours {vocab}, HF {hf_model.config.vocab_size}"
    )
    results = [
        measure(config, llm, hf_model, args, vocab, i)
        for i, config in enumerate(make_configs(args))
    ]
    terminal, markdown = report(results, args, hf_model)
    print("\n" + terminal)
    if not args.no_results:
        path = append_results(f"engine_throughput ({args.dtype}, --quantization {args.quantization})", markdown)
        print(f"\nappended to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
