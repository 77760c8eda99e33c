"""What a prefill on one core costs a decode on the other, with no pdserve process in between:
the floor under disagg_vs_colocated.py's "ITL with bursts / steady" on this machine.

    .venv/bin/python benchmarks/core_interference.py [--quick] [--rounds 4] [--no-results]

disagg_vs_colocated.py pins the prefill worker to one core and the decode worker to another.
The decode worker still slows while the prefill worker computes long prompts, partly through
what pdserve does on its core (receiving and writing the KV) and partly through what the two
cores share (last-level cache, memory bandwidth). This script measures the second part alone:

- this process, pinned to the second core, holds an LLMEngine of the default model as a decode
  worker runs it (1 torch thread, the default dtype and quantization), and steps decode batches
  of 2 prompts of 128 tokens, --new-tokens each: the step times of a batch (median, p90, p99);
- a second process, pinned to the first core, is either absent ("idle") or an LLMEngine of the
  same model prefilling random prompts of --long-len tokens one after another ("prefilling"),
  as the prefill worker does under disagg_vs_colocated.py's bursts. No KV goes anywhere.
- the two take turns, --rounds times each (first place alternating), and the ratio is taken per
  round: prefilling / idle.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere

from benchmarks.common import decode_steps_ms, report_tables  # noqa: E402
from benchmarks.peers.servers import exit_on_sigterm, pinned_cores  # noqa: E402

SHORT_LEN = 128
READY_TIMEOUT_S = 300.0
"""Longest the prefilling process may take to load its model and finish its first prompt."""


def engine(kv_cache_memory: int):
    """An LLMEngine of the default model on one torch thread, as `pdserve decode --num-threads 1`."""
    from engine.config import EngineConfig
    from engine.engine import LLMEngine

    return LLMEngine(EngineConfig.from_kwargs(max_model_len=4096, num_threads=1, kv_cache_memory=kv_cache_memory,
                                              enable_prefix_caching=False))


def prefill_forever(core: int, long_len: int) -> None:
    """The load: prefill random `long_len`-token prompts (1 new token each) until killed; prints
    "ready" once the first one is done."""
    os.sched_setaffinity(0, {core})
    import torch

    from engine.sampling_params import SamplingParams

    torch.set_num_threads(1)
    llm = engine(512 << 20)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    rng = random.Random(1)
    n = 0
    while True:
        llm.add_request(f"long-{n}", [rng.randrange(100, 40000) for _ in range(long_len)], params)
        while llm.has_unfinished_requests():
            llm.step()
        if n == 0:
            print("ready", flush=True)
        n += 1


class PrefillLoad:
    """The prefilling process, started and stopped around one measurement."""

    def __init__(self, core: int, long_len: int) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, __file__, "--prefill-load", "--core", str(core), "--long-len", str(long_len)],
            stdout=subprocess.PIPE, text=True)

    def __enter__(self) -> PrefillLoad:
        deadline = time.monotonic() + READY_TIMEOUT_S
        line = ""
        try:
            while time.monotonic() < deadline and self._proc.poll() is None:
                line = self._proc.stdout.readline()  # the process prints only "ready"
                if line.strip() == "ready":
                    return self
        except BaseException:  # SIGTERM (SystemExit) while it loads: `with` will not call __exit__
            self.__exit__()
            raise
        self.__exit__()
        raise RuntimeError(f"the prefilling process was not ready within {READY_TIMEOUT_S:.0f} s "
                           f"(exit code {self._proc.returncode}, last line {line!r})")

    def __exit__(self, *exc: object) -> None:
        self._proc.kill()
        self._proc.wait(timeout=30)
        self._proc.stdout.close()


def measure(args, decode_core: int, prefill_core: int) -> dict[str, list[float]]:
    import torch

    from engine.sampling_params import SamplingParams

    os.sched_setaffinity(0, {decode_core})
    torch.set_num_threads(1)
    llm = engine(256 << 20)
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    rng = random.Random(0)

    def steps_ms(tag: str) -> list[float]:
        prompts = [[rng.randrange(100, 40000) for _ in range(SHORT_LEN)] for _ in range(2)]
        steps = decode_steps_ms(llm, prompts, params, tag)
        if not steps:
            raise RuntimeError(f"{tag}: no step decoded the whole batch")
        return steps

    steps_ms("warm-up")
    steps: dict[str, list[list[float]]] = {"idle": [], "prefilling": []}
    for r in range(args.rounds):
        for load in (("idle", "prefilling") if r % 2 == 0 else ("prefilling", "idle")):
            if load == "idle":
                ms = steps_ms(f"idle-{r}")
            else:
                with PrefillLoad(prefill_core, args.long_len):
                    ms = steps_ms(f"prefilling-{r}")
            steps[load].append(ms)
            print(f"  round {r + 1} {load}: decode step median {statistics.median(ms):.2f} ms, "
                  f"p90 {percentile(ms, 90):.2f} ms", flush=True)
    return steps


def percentile(xs: list[float], p: float) -> float:
    import numpy as np

    return float(np.percentile(xs, p))


def spread(xs: list[float], fmt: str) -> str:
    return " / ".join(fmt.format(x) for x in (min(xs), statistics.median(xs), max(xs)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tiny smoke run; nothing is appended to RESULTS.md")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--long-len", type=int, default=2048, help="tokens of each prompt the other core prefills")
    parser.add_argument("--new-tokens", type=int, default=96, help="tokens each decoding prompt makes per round")
    parser.add_argument("--no-results", action="store_true", help="do not append to benchmarks/RESULTS.md")
    parser.add_argument("--prefill-load", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--core", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    exit_on_sigterm()  # the prefilling process is stopped by PrefillLoad's exit
    if args.prefill_load:
        prefill_forever(args.core, args.long_len)
        return 0
    if args.quick:
        args.rounds, args.long_len, args.new_tokens = 1, 256, 8
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    prefill_core, decode_core = pinned_cores(2)
    cores = os.sched_getaffinity(0)
    steps = measure(args, decode_core, prefill_core)
    os.sched_setaffinity(0, cores)  # measure() pinned this process: the results' header counts the machine's

    idle, busy = steps["idle"], steps["prefilling"]
    medians = [statistics.median(b) / statistics.median(i) for i, b in zip(idle, busy)]
    p90s = [percentile(b, 90) / percentile(i, 90) for i, b in zip(idle, busy)]
    table = [[r + 1, f"{statistics.median(idle[r]):.2f} / {percentile(idle[r], 90):.2f}",
              f"{statistics.median(busy[r]):.2f} / {percentile(busy[r], 90):.2f}", f"{medians[r]:.2f}x / {p90s[r]:.2f}x"]
             for r in range(args.rounds)]
    pooled = [percentile(sum(busy, []), p) / percentile(sum(idle, []), p) for p in (50, 90, 99)]
    headers = ["round", f"decode step ms, core {prefill_core} idle: median / p90",
               f"decode step ms, core {prefill_core} prefilling: median / p90", "prefilling / idle: median / p90"]
    findings = [
        f"- prefilling / idle, per round (min / median / max over {args.rounds}): median step "
        f"{spread(medians, '{:.2f}x')}, p90 step {spread(p90s, '{:.2f}x')}",
        f"- prefilling / idle, the rounds' steps pooled: median {pooled[0]:.2f}x, p90 {pooled[1]:.2f}x, "
        f"p99 {pooled[2]:.2f}x ({sum(map(len, busy))} and {sum(map(len, idle))} steps)",
    ]
    method = [
        f"- decode: this process on core {decode_core}, an LLMEngine of the default model (default dtype and "
        f"quantization, 1 torch thread); per round, 2 random prompts of {SHORT_LEN} tokens, {args.new_tokens} new tokens "
        "each, added at once: the steps in which both decode",
        f"- load: a second process on core {prefill_core}, idle (absent) or an LLMEngine of the same model prefilling "
        f"random prompts of {args.long_len} tokens one after another (1 new token each, no KV sent anywhere); the "
        "two take turns, first place alternating",
    ]
    report_tables([(headers, table)], "core_interference (a prefill on one core against a decode on the other)",
                  method, write=not (args.quick or args.no_results), findings=findings)
    print("\n".join(method))
    return 0


if __name__ == "__main__":
    sys.exit(main())
