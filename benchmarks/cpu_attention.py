"""CPU decode attention: the C kernel (engine/cpu_kernels) against the torch path it replaced
(gather the context's blocks, then SDPA), side by side in one run.

    .venv/bin/python benchmarks/cpu_attention.py [--quick] [--no-results] [--baseline REV]

Two parts, both on one torch thread (a decode worker's setting under load on this machine):

- kernel: one layer's decode attention in the default model's shape (9 query heads, 3 KV
  heads, head_dim 64, 16-token blocks), per context length and batch, in bfloat16. The caches
  of LAYERS layers are allocated at a served worker's size, the blocks of each sequence are
  drawn at random, and the layers are called in turn, so every call reads its K and V from
  memory as a decode step does, not from a warm cache. us per layer call, median of --repeat.
- engine: an EngineCore of the default model (bfloat16), the same decode batch stepped with the
  kernel and with the torch path: the median decode step of each mix of 2k-token and
  128-token prompts, 40 new tokens each.

--baseline REV adds two columns to the kernel part: paged_decode.c as it was at the git
revision REV, built with the same compiler and flags and called in turn with the other two, so
a change to the kernel is measured against the code before it in one run.

Where Linux offers transparent huge pages, the kernel part has two more columns: the current
kernel on the same blocks of the same caches copied onto 2 MiB pages, as a worker allocates its
KV cache (engine/huge_pages.py), against the plain tensors' 4 KiB pages.
"""

from __future__ import annotations

import argparse
import ctypes
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere

import torch  # noqa: E402

from benchmarks.common import median_decode_step_ms, report_tables  # noqa: E402

LAYERS = 30
BLOCK_SIZE, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 16, 9, 3, 64
CACHE_BLOCKS = 1456
"""Blocks per layer of a worker at --kv-cache-memory 512MiB with the default model."""


def baseline_kernel(rev: str, workdir: Path):
    """paged_decode.c at git revision `rev`, built as the loader builds the current one."""
    from engine.cpu_kernels import Loaded, PagedDecodeKernel
    from engine.cpu_kernels.loader import PAGED_DECODE, build, compiler

    repo = Path(__file__).resolve().parent.parent
    shown = subprocess.run(["git", "show", f"{rev}:engine/cpu_kernels/{PAGED_DECODE.file}"], cwd=repo,
                           capture_output=True, text=True, timeout=30, check=False)
    if shown.returncode != 0:
        raise SystemExit(f"--baseline {rev}: {shown.stderr.strip()}")
    source, library = workdir / PAGED_DECODE.file, workdir / "baseline.so"
    source.write_text(shown.stdout)
    cc = compiler()
    if cc is None:
        raise SystemExit("--baseline: no C compiler")
    try:
        build(library, cc, PAGED_DECODE, path=source)
    except RuntimeError as e:
        raise SystemExit(f"--baseline {rev}: {e}") from e
    return PagedDecodeKernel(Loaded(ctypes.CDLL(str(library)), library))


def huge_page_copy(caches: list[torch.Tensor]) -> list[torch.Tensor] | None:
    """The same caches in one buffer on 2 MiB pages, as a worker allocates them
    (engine.runner.allocate_kv_caches); None where Linux offers no transparent huge pages."""
    from engine.huge_pages import zeros_on_huge_pages

    whole, advised = zeros_on_huge_pages((len(caches), *caches[0].shape), caches[0].dtype)
    if not advised:
        return None
    for layer, cache in zip(whole.unbind(0), caches, strict=True):
        layer.copy_(cache)
    return list(whole.unbind(0))


def kernel_rows(contexts: list[int], batches: list[int], repeat: int,
                baseline=None) -> tuple[list[list[object]], bool]:
    """The kernel part's rows, and whether they carry the 2 MiB pages columns."""
    from engine.cpu_kernels import load_decode_kernel
    from engine.model.attention import AttentionMetadata, DecodeGroup, paged_attention

    kernel, reason = load_decode_kernel()
    if kernel is None:
        raise SystemExit(f"no C kernel here: {reason}")
    gen = torch.Generator().manual_seed(0)
    caches = [torch.randn(2, CACHE_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16)
              for _ in range(LAYERS)]
    huge = huge_page_copy(caches)
    scale = HEAD_DIM ** -0.5
    rows = []
    for context in contexts:
        for batch in batches:
            max_blocks = -(-context // BLOCK_SIZE)
            tables = torch.stack([torch.randperm(CACHE_BLOCKS, generator=gen)[:max_blocks] for _ in range(batch)])
            lens = torch.full((batch,), context, dtype=torch.int64)
            pos = torch.arange(max_blocks * BLOCK_SIZE)
            mask = None if context == max_blocks * BLOCK_SIZE else (pos[None, :] < lens[:, None])[:, None, None, :]
            group = DecodeGroup(torch.arange(batch), tables, lens, mask)
            q = torch.randn(batch, NUM_HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16)
            slots = torch.zeros(batch, dtype=torch.int64)
            on_kernel = AttentionMetadata(slots, (group,), (), kernel)
            runs = {"torch": (AttentionMetadata(slots, (group,), ()), caches), "kernel": (on_kernel, caches)}
            if baseline is not None:
                runs["baseline"] = (AttentionMetadata(slots, (group,), (), baseline), caches)
            if huge is not None:
                runs["huge"] = (on_kernel, huge)
            times: dict[str, list[float]] = {name: [] for name in runs}
            for r in range(repeat + 1):  # the first round warms up
                for name, (meta, layers) in runs.items():
                    start = time.perf_counter()
                    for cache in layers:
                        paged_attention(q, cache, meta, scale)
                    if r:
                        times[name].append((time.perf_counter() - start) / LAYERS * 1e6)
            t, k = statistics.median(times["torch"]), statistics.median(times["kernel"])
            row: list[object] = [context, batch, f"{t:.0f}", f"{k:.0f}", f"{k / t:.2f}x"]
            if baseline is not None:
                b = statistics.median(times["baseline"])
                row += [f"{b:.0f}", f"{k / b:.2f}x"]
            if huge is not None:
                h = statistics.median(times["huge"])
                row += [f"{h:.0f}", f"{h / k:.2f}x"]
            rows.append(row)
    return rows, huge is not None


def engine_rows(mixes: list[tuple[int, int]], long_len: int, new_tokens: int) -> list[list[object]]:
    from engine.config import EngineConfig
    from engine.engine import LLMEngine
    from engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    medians: dict[tuple[int, int], dict[bool, float]] = {mix: {} for mix in mixes}
    for on in (True, False):
        engine = LLMEngine(EngineConfig.from_kwargs(
            dtype="bfloat16", max_model_len=max(4096, long_len + new_tokens + 16), num_threads=1,
            kv_cache_memory=1 << 30, cpu_attention_kernel=on, enable_prefix_caching=False))
        rng = random.Random(0)
        for n, (longs, shorts) in enumerate(mixes):
            prompts = ([[rng.randrange(100, 40000) for _ in range(long_len)] for _ in range(longs)]
                       + [[rng.randrange(100, 40000) for _ in range(128)] for _ in range(shorts)])
            medians[(longs, shorts)][on] = median_decode_step_ms(engine, prompts, params, f"{on}-{n}")
    return [[f"{longs} x {long_len} + {shorts} x 128", f"{m[False]:.1f}", f"{m[True]:.1f}", f"{m[True] / m[False]:.2f}x"]
            for (longs, shorts), m in medians.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tiny smoke run; nothing is appended to RESULTS.md")
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--no-results", action="store_true", help="do not append to benchmarks/RESULTS.md")
    parser.add_argument("--baseline", metavar="REV",
                        help="also time paged_decode.c as it was at this git revision (kernel part)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.quick:
        contexts, batches, repeat, mixes, long_len, new_tokens = [64, 300], [1, 4], 1, [(1, 1)], 256, 4
    else:
        contexts, batches, repeat = [128, 512, 2048], [1, 8], args.repeat
        mixes, long_len, new_tokens = [(0, 5), (1, 4), (3, 4)], 2000, 40
    k_headers = ["context", "batch", "torch path us/layer", "C kernel us/layer", "kernel / torch"]
    with tempfile.TemporaryDirectory(prefix="pdserve-kernel-") as workdir:
        baseline = baseline_kernel(args.baseline, Path(workdir)) if args.baseline else None
        k_rows, on_huge_pages = kernel_rows(contexts, batches, repeat, baseline)
    if baseline is not None:
        k_headers += [f"{args.baseline} kernel us/layer", f"kernel / {args.baseline}"]
    if on_huge_pages:
        k_headers += ["C kernel, caches on 2 MiB pages us/layer", "2 MiB / 4 KiB pages"]
    e_headers = ["decode batch", "torch path step ms", "C kernel step ms", "kernel / torch"]
    e_rows = engine_rows(mixes, long_len, new_tokens)
    report_tables([(k_headers, k_rows), (e_headers, e_rows)], "cpu_attention (C decode kernel vs torch path)", [
        f"- kernel: one layer of decode attention in bfloat16 in the default model's shape ({NUM_HEADS} query heads, "
        f"{NUM_KV_HEADS} KV heads, head_dim {HEAD_DIM}, blocks of {BLOCK_SIZE}); {LAYERS} layers' caches of "
        f"{CACHE_BLOCKS} blocks each (a worker at --kv-cache-memory 512MiB), each sequence's blocks drawn at random, "
        f"the layers called in turn so K and V come from memory; 1 torch thread; median of {repeat} rounds",
        "- torch path: the context's blocks gathered with index_select, then SDPA with the query heads of a KV head "
        "folded into its query axis (engine.model.attention._decode_group)",
        *([f"- {args.baseline} kernel: engine/cpu_kernels/paged_decode.c at git revision {args.baseline}, built with "
           "the loader's compiler and flags, called in turn with the other two in every round"] if args.baseline else []),
        "- caches on 2 MiB pages: the same caches copied into one buffer on transparent huge pages, as a worker "
        "allocates its KV cache (engine/huge_pages.py), the current kernel on the same blocks; the other columns' "
        "caches are plain torch tensors on 4 KiB pages",
        f"- engine: EngineCore of the default model in bfloat16, 1 thread, random prompts, {new_tokens} new tokens "
        "each, all added at once; median of the steps in which every request decodes",
    ], write=not (args.quick or args.no_results))

if __name__ == "__main__":
    main()
